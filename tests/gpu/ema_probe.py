"""EMA-horizon probe: one ordinary train_gpt.py run that also keeps one EMA per horizon in
PROBE_HORIZONS (comma-separated fractions of the run; a value >= 0.5 is read as a fixed per-step decay,
e.g. 0.997) and, just before the run's own EMA is applied, scores each on the plain validation windows:

    probe_ema horizon:H val_loss:L val_bpb:B

PROBE_STOP=1 exits after those lines (no artifact, no sliding scoring: for long runs inside one device
call). Everything else is the real script: same loader, optimizer, schedule and scorer."""
import os
import sys

sys.path.insert(0, os.getcwd())  # run from the directory holding the train_gpt.py under test
import train_gpt as tg

VALUES = [float(v) for v in os.environ.pop("PROBE_HORIZONS", "0.02,0.05,0.1,0.997").split(",")]
STOP = os.environ.pop("PROBE_STOP", "0") == "1"
captured = {}
_scorer_init = tg.Scorer.__init__
BaseEMA = tg.EMA


def scorer_init(self, *a, **k):
    _scorer_init(self, *a, **k)
    captured["scorer"] = self


class ProbeEMA(BaseEMA):
    def __init__(self, model, horizon, fixed_decay=0.0):
        super().__init__(model, horizon, fixed_decay)
        self.model = model
        self.extra = [BaseEMA(model, v, 0.0) if v < 0.5 else BaseEMA(model, 1.0, v) for v in VALUES]

    def update(self, progress_delta):
        super().update(progress_delta)
        for e in self.extra:
            e.update(progress_delta)

    def copy_to_model(self):
        scorer = captured["scorer"]
        seq = scorer.cfg.eval_seq_len
        for v, e in zip(VALUES, self.extra):
            e.copy_to_model()
            s = scorer(self.model, seq)
            if tg.dist.is_available() and tg.dist.is_initialized() and tg.dist.get_rank() != 0:
                continue
            print(f"probe_ema {'decay' if v >= 0.5 else 'horizon'}:{v} val_loss:{s.loss:.5f} val_bpb:{s.bpb:.5f}",
                  flush=True)
        if STOP:
            sys.exit(0)
        super().copy_to_model()


tg.Scorer.__init__ = scorer_init
tg.EMA = ProbeEMA
sys.exit(tg.main())
