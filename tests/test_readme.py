"""The README's settings table is generated from the Hyperparameters dataclass and checked here, so
the documentation cannot drift from the code. Regenerate with: python3 tests/test_readme.py --write"""
from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_gpt as tg  # noqa: E402

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def field_sections() -> dict[str, str]:
    """field name -> section, read from the dataclass source: the `# --- section` banners."""
    src = (ROOT / "train_gpt.py").read_text(encoding="utf-8").splitlines()
    cls = next(n for n in ast.parse("\n".join(src)).body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters")
    out, section = {}, ""
    for line in src[cls.lineno: cls.end_lineno]:
        s = line.strip()
        if s.startswith("# ---"):
            section = s.removeprefix("# ---").strip()
        elif re.match(r"    \w+: \w+ = ", line):
            out[line.split(":")[0].strip()] = section
    return out


def settings_table() -> str:
    """One row per setting: its default and meaning as declared (a TTT mode's own settings name the mode)."""
    sections = field_sections()
    rows, section = [], None
    for f in dataclasses.fields(tg.Hyperparameters):
        if sections[f.name] != section:
            section = sections[f.name]
            rows += ["", f"**{section}**", "", "| variable | default | meaning |", "|---|---|---|"]
        default = f.default
        shown = int(default) if isinstance(default, bool) else default
        if default == tg.FP16_MIN_NORMAL:
            shown = "2^-14"
        on, meaning = f.metadata["on"], f.metadata["meaning"]
        if "=" in on:
            meaning = f"{on.split('=')[0].upper()}={on.split('=')[1]}: {meaning}"
        cell = meaning.replace("|", "\\|")  # a bare | would end the table cell
        rows.append(f"| `{f.name.upper()}` | `{shown}` | {cell} |")
    return "\n".join(rows).strip()


def readme_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_every_field_is_documented_with_its_default():
    assert readme_section() == settings_table(), "README settings table is stale: python3 tests/test_readme.py --write"


def test_every_field_has_a_meaning_and_a_section():
    assert set(field_sections()) == set(tg.SETTINGS) and all(field_sections().values())
    assert [n for n, f in tg.SETTINGS.items() if len(f.metadata["meaning"]) < 3] == []


def quickstart_commands() -> list[str]:
    """The non-blank lines of the first fenced block under the README's "## Quickstart (CPU)" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.split(r"^## Quickstart \(CPU\)[ \t]*$", text, maxsplit=1, flags=re.M)[1]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, flags=re.S | re.M).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


def test_ci_runs_exactly_the_readme_quickstart_commands():
    """CI sees what a newcomer sees: .ci/run reads its commands from the README's block and installs nothing
    of its own (an install added to CI only would make CI green where the README's commands fail)."""
    cmds = quickstart_commands()
    install, test = cmds
    torch_cpu, deps = install.split(" && ")[:2]  # the CPU build first: PyPI's torch is a multi-GB CUDA build
    assert torch_cpu.startswith("python3 -m pip install ") and "torch==2.13.0+cpu" in torch_cpu.split()
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_cpu
    assert deps.startswith("python3 -m pip install -r requirements.txt pytest ")
    assert "triton==3.9.0" in deps.split()  # the kernel tests run in Triton's CPU interpreter
    assert "pytest-xdist" in deps.split()  # -n 2: the tests in two processes
    assert test == "python3 -m pytest -q -rs -n 2 --dist worksteal tests"  # -rs: every skip shows its reason
    printed = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.splitlines()
    assert printed == cmds
    ci_code = [ln for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
               if ln.strip() and not ln.lstrip().startswith("#")]
    own = [ln for ln in ci_code if re.search(r"\bpip\b|\binstall\b|quickstart\.sh|python3 -m pytest", ln.split("#")[0])]
    assert not own, f"an install or command in .ci/run that the README's Quickstart block lacks: {own}"


def test_readme_world_sizes_are_those_the_default_batch_divides_into():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cfg, _ = tg.Hyperparameters.from_env({})

    def works(n: int, c=cfg) -> bool:
        try:
            return tg.resolve_grad_accum_steps(c, n) > 0
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
