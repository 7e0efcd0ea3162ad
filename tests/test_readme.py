"""The README's settings table is generated from the Hyperparameters dataclass and checked here, so
the documentation cannot drift from the code. Regenerate with: python3 tests/test_readme.py --write"""
from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_gpt as tg  # noqa: E402

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def field_comments() -> dict[str, tuple[str, str]]:
    """field name -> (section, comment) read from the dataclass source: the `# --- section` banners
    and each field's trailing comment."""
    src = (ROOT / "train_gpt.py").read_text(encoding="utf-8").splitlines()
    cls = next(n for n in ast.parse("\n".join(src)).body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters")
    out, section = {}, ""
    for line in src[cls.lineno: cls.end_lineno]:
        s = line.strip()
        if s.startswith("# ---"):
            section = s.removeprefix("# ---").strip()
        elif ":" in s and not s.startswith(("#", "@", "def", "return", '"""')) and line.startswith("    ") and not line.startswith("        "):
            name = s.split(":")[0].strip()
            comment = s.split("#", 1)[1].strip() if "#" in s else ""
            out[name] = (section, comment)
    return out


def settings_table() -> str:
    comments = field_comments()
    rows, section = [], None
    for f in dataclasses.fields(tg.Hyperparameters):
        sec, comment = comments[f.name]
        if sec != section:
            rows += ["", f"**{sec}**", "", "| variable | default | meaning |", "|---|---|---|"]
            section = sec
        default = f.default
        shown = int(default) if isinstance(default, bool) else default
        if f.name == "int6_scale_floor":
            shown = "1/31"
        cell = (comment or "-").replace("|", "\\|")  # a bare | would end the table cell
        rows.append(f"| `{f.name.upper()}` | `{shown}` | {cell} |")
    return "\n".join(rows).strip()


def readme_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_every_field_is_documented_with_its_default():
    assert readme_section() == settings_table(), "README settings table is stale: python3 tests/test_readme.py --write"


def test_every_field_has_a_comment():
    missing = [n for n, (_, c) in field_comments().items() if not c]
    assert set(field_comments()) == {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    assert len(missing) <= 5, f"fields without a one-line comment: {missing}"


def test_readme_names_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest -q tests" in readme and "python3 -m pytest -q tests" in ci


def test_readme_world_sizes_are_those_the_default_batch_divides_into():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cfg, _ = tg.Hyperparameters.from_env({})

    def works(n: int, c=cfg) -> bool:
        try:
            return tg.grad_accum_steps(c, n) > 0
        except ValueError:
            return False
    assert [n for n in range(1, 9) if works(n)] == [1, 2, 3, 4, 6, 8]
    assert "works for N = 1, 2, 3, 4, 6 and 8 with the default batch" in readme
    assert "(N = 5: `TRAIN_BATCH_TOKENS=819200 GRAD_ACCUM_STEPS=2`)" in readme
    assert works(5, dataclasses.replace(cfg, train_batch_tokens=819200, grad_accum_steps=2))


if __name__ == "__main__" and "--write" in sys.argv:
    path = ROOT / "README.md"
    text = path.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + settings_table() + "\n" + END + rest.split(END, 1)[1], encoding="utf-8")
    print("README settings table rewritten")
