"""The whole training chain of the shipped kvshare-mini-v41, in one command.

    python -m kvshare.train.recipe --out runs/kvshare-mini-v41

Stage 1 trains from the seed with the first release's recipe (``TrainConfig`` defaults: 450 steps,
peak lr 2e-3, cosine, seed 0). Stage 2 continues from stage 1's bf16 release with a fresh AdamW:
peak lr 1e-3 after a 30-step warm-up, flat until ``STAGE2_DECAY_START``, then cosine to 10 % at
``STAGE2_STEPS`` (the warm-up / stable / decay schedule whose decay start the shipped run chose by
wall clock; the numbers here are the ones it recorded), data seed 2. No time cap applies, so the
chain is a function of the step counts only. Stage 3 trains the DSpark draft stages on the frozen
stage-2 model (`dspark.py`, ``DSparkTrainConfig`` defaults) and writes the release with them to
``<out>/dspark``; installing it in the package is the separate
``python -m kvshare.train.install <out>/dspark``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvshare.train.dspark import DSparkTrainConfig, train_dspark
from kvshare.train.train import TrainConfig, train

STAGE2_DECAY_START = 710
STAGE2_STEPS = 947


def stage_configs(stage1_dir: Path) -> tuple[TrainConfig, TrainConfig]:
    """(stage 1, stage 2) configs; stage 2 initialises from `stage1_dir`."""
    s1 = TrainConfig(minutes=1e9)
    s2 = TrainConfig(minutes=1e9, seed=1, lr=1e-3, warmup=30, init_from=str(stage1_dir),
                     decay_start=STAGE2_DECAY_START, steps=STAGE2_STEPS)
    return s1, s2


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: run both stages into `--out`."""
    ap = argparse.ArgumentParser(prog="python -m kvshare.train.recipe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/kvshare-mini-v41"), help="run directory")
    a = ap.parse_args(argv)
    s1, s2 = stage_configs(a.out / "stage1")
    for name, tc in (("stage1", s1), ("stage2", s2)):
        print(f"== {name}: {tc}", flush=True)
        log = train(tc, a.out / name, a.out / f"{name}_state")
        print(json.dumps(log["final"]), flush=True)
    dc = DSparkTrainConfig(base=str(a.out / "stage2"), minutes=1e9)
    print(f"== dspark: {dc}", flush=True)
    print(json.dumps(train_dspark(dc, a.out / "dspark")["final"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
