"""Ship a trained release inside the package: the explicit step after ``python -m kvshare.train.train``.

    python -m kvshare.train.install runs/kvshare-mini-v41 [--generation-config gen.json]

Training writes into a run directory; only this command writes into ``src/kvshare/models/<name>/``.
It checks that the release loads (config + weights, released names and shapes) and that its
weights are at most ``--max-mb`` megabytes, then copies the release files; files it does not
know are left behind.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from kvshare.shipped import MODEL_DIR

RELEASE_FILES = ("config.json", "model.safetensors", "corpus_manifest.json", "training_log.json", "eval.json",
                 "generation_config.json", "dspark_log.json")
MAX_MB = 20.0


def install(src: Path, dest: Path, generation_config: Path | None = None, max_mb: float = MAX_MB) -> list[str]:
    """Copy the release files of `src` into `dest` (created); returns the names copied.

    Raises ValueError when `src` lacks config.json or model.safetensors, when the weights exceed
    `max_mb` MB, or when they do not load against the config."""
    from kvshare.config import load_config
    from kvshare.weights.loader import load_checkpoint

    src, dest = Path(src), Path(dest)
    for need in ("config.json", "model.safetensors"):
        if not (src / need).is_file():
            raise ValueError(f"{src}: no {need}; is this a release directory written by kvshare.train.train?")
    mb = (src / "model.safetensors").stat().st_size / 1e6
    if mb > max_mb:
        raise ValueError(f"{src}/model.safetensors is {mb:.1f} MB, more than the {max_mb} MB limit")
    cfg = load_config(str(src))  # raises CheckpointError on missing / mis-shaped tensors (draft ones too)
    load_checkpoint(src, cfg, draft=cfg.num_draft_layers > 0)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in RELEASE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
            copied.append(name)
    if generation_config is not None:
        shutil.copyfile(generation_config, dest / "generation_config.json")
        copied.append("generation_config.json")
    return copied


def main(argv: list[str] | None = None) -> int:
    """Command-line entry."""
    ap = argparse.ArgumentParser(prog="python -m kvshare.train.install", description=__doc__.split("\n")[0])
    ap.add_argument("release", type=Path, help="release directory written by kvshare.train.train --out")
    ap.add_argument("--name", default="kvshare-mini-v41", help="model name under src/kvshare/models/")
    ap.add_argument("--generation-config", type=Path, default=None,
                    help="generation_config.json to ship with it (else the release's own, if any)")
    ap.add_argument("--max-mb", type=float, default=MAX_MB, help=f"size limit of the weights (default {MAX_MB})")
    a = ap.parse_args(argv)
    dest = MODEL_DIR / a.name
    copied = install(a.release, dest, a.generation_config, a.max_mb)
    print(f"installed {', '.join(copied)} into {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
