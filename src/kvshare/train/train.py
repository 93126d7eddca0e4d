"""Train kvshare-mini-v41 on the CPython stdlib sources, on the CPU, through the inference model.

    python -m kvshare.train.train --out runs/kvshare-mini-v41            # a run directory, never the package
    python -m kvshare.train.train --init-from DIR ...                     # continue from a release's weights
    python -m kvshare.train.install runs/kvshare-mini-v41                 # explicit step: ship it in the package

Seeded and deterministic for a given (seed, steps, threads): model init from ``--seed``, data
sampling from its own generator seeded ``seed + 1``. AdamW with a linear warm-up then cosine decay
over ``--steps``; ``--minutes`` is a safety cap (the run stops early, saves, and says so). The model
runs with quantisation ON (FP8 / FP4 fake-quant with straight-through gradients); the loss is the
next-byte cross-entropy plus ``--indexer-weight`` times the indexer distillation KL
(`indexer_loss.py`), which is what trains the lightning indexers' own projections. Every
``--resume-every`` steps the full state (model, optimizer, data generator) goes to
``<run-dir>/resume.pt`` so an interrupted run continues bit-for-bit with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvshare.config import load_config
from kvshare.weights.checkpoint_write import save_checkpoint
from kvshare.train.data import build_manifest, load_split, sample_contexts, save_manifest, verify_manifest
from kvshare.train.loop import dense_cache_factory, lm_loss, lr_at, param_groups, train_losses

DEFAULT_OUT = Path("runs/kvshare-mini-v41")
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "models" / "kvshare-mini-v41"


@dataclass
class TrainConfig:
    """Everything that determines a run (recorded in training_log.json)."""

    model: str = "kvshare-mini-v41"
    seed: int = 0
    steps: int = 450
    minutes: float = 48.0
    batch: int = 4
    ctx_min: int = 256
    ctx_max: int = 384
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    indexer_weight: float = 0.1
    threads: int = 1
    quant: bool = True
    val_every: int = 50
    val_chunks: int = 8
    resume_every: int = 25
    init_from: str = ""
    decay_start: int = 0  # > 0: warm-up / stable / decay schedule (loop.lr_at)
    decay_at_minutes: float = 0.0  # > 0: start the decay when this much wall time has passed (sets steps)
    decay_frac: float = 0.25  # with decay_at_minutes: decay steps = stable steps * frac / (1 - frac)
    extra: dict[str, Any] = field(default_factory=dict)


def build_model(cfg_name: str, seed: int, quant: bool, init_from: str = "") -> torch.nn.Module:
    """The inference Transformer in fp32 for training: freshly initialised from `seed`, or, with
    `init_from` (a release directory), holding that release's weights (its config must equal `cfg_name`'s).
    Bound to the torch reference (`KernelChoice.reference()`): autograd runs through every layer."""
    from kvshare.layers import KernelChoice
    from kvshare.model.deepseek import Transformer
    from kvshare.weights.loader import load_checkpoint, load_state_into

    cfg = load_config(cfg_name)
    torch.manual_seed(seed)
    model = Transformer(cfg, quant=quant)
    model.bind(KernelChoice.reference())
    model.init_weights(seed)
    if init_from:
        src = load_config(init_from)
        if src != cfg:
            raise ValueError(f"--init-from {init_from}: its config differs from --model {cfg_name}'s")
        load_state_into(model, {k: v.float() for k, v in load_checkpoint(init_from, cfg).items()})
    return model.float()


def _contexts(split: Any, tc: TrainConfig, gen: torch.Generator) -> list[torch.Tensor]:
    """One step's ragged batch: `batch` contexts with lengths uniform in [ctx_min, ctx_max] (+1 target)."""
    lens = torch.randint(tc.ctx_min, tc.ctx_max + 1, (tc.batch,), generator=gen).tolist()
    full = sample_contexts(split, tc.batch, tc.ctx_max + 1, gen)
    return [full[i, : n + 1] for i, n in enumerate(lens)]


def _val_set(tc: TrainConfig) -> list[torch.Tensor]:
    """A fixed small validation batch from the held-out split (seeded independently of training)."""
    held = load_split(heldout=True)
    return [c for c in sample_contexts(held, tc.val_chunks, tc.ctx_max + 1, torch.Generator().manual_seed(1234))]


@torch.no_grad()
def _val_loss(model: torch.nn.Module, val: list[torch.Tensor]) -> float:
    model.eval()
    loss = float(lm_loss(model, val, dense_cache_factory))
    model.train()
    return loss


def train(tc: TrainConfig, out_dir: Path, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Run training; save the checkpoint, manifest and log to `out_dir`. Returns the log dict."""
    torch.set_num_threads(tc.threads)
    manifest = build_manifest()
    for known in (out_dir / "corpus_manifest.json", PACKAGE_DIR / "corpus_manifest.json"):
        if known.is_file():
            verify_manifest(json.loads(known.read_text()))
            break
    split = load_split(heldout=False)
    val = _val_set(tc)
    model = build_model(tc.model, tc.seed, tc.quant, tc.init_from)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(tc.seed + 1)
    log: dict[str, Any] = {"config": asdict(tc), "corpus_aggregate_sha256": manifest["aggregate_sha256"],
                           "python": manifest["python"], "torch": torch.__version__, "steps": [], "val": []}
    start, elapsed0 = 0, 0.0
    run_dir.mkdir(parents=True, exist_ok=True)
    rpath = run_dir / "resume.pt"
    if resume and rpath.is_file():
        st = torch.load(rpath, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        log, start, elapsed0 = st["log"], st["step"], st["elapsed"]
        log.setdefault("resumes", []).append({"step": start, "config": asdict(tc)})  # flags may differ
        print(f"resumed at step {start}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {tc.model}: {n_params / 1e6:.2f}M params; train {split.num_bytes} bytes; "
          f"corpus {manifest['aggregate_sha256'][:16]}", flush=True)
    t0 = time.time() - elapsed0
    step = start
    stopped_early = False
    while step < tc.steps:
        if tc.decay_at_minutes > 0 and not tc.decay_start and time.time() - t0 > tc.decay_at_minutes * 60:
            tc.decay_start = max(step, tc.warmup)
            tc.steps = tc.decay_start + max(1, round(tc.decay_start * tc.decay_frac / (1 - tc.decay_frac)))
            log["config"].update(decay_start=tc.decay_start, steps=tc.steps)
            print(f"decay starts at step {tc.decay_start}, ends at step {tc.steps} (reproduce with "
                  f"--decay-start {tc.decay_start} --steps {tc.steps})", flush=True)
        stable_until = tc.decay_start or (tc.steps if tc.decay_at_minutes > 0 else 0)
        lr = lr_at(step, tc.steps, tc.lr, tc.warmup, tc.min_lr_ratio, stable_until)
        for g in opt.param_groups:
            g["lr"] = lr
        ctx = _contexts(split, tc, gen)
        loss, kl = train_losses(model, ctx)
        opt.zero_grad(set_to_none=True)
        (loss + tc.indexer_weight * kl).backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
        opt.step()
        step += 1
        el = time.time() - t0
        lv, kv = float(loss.detach()), float(kl.detach())
        if not math.isfinite(lv):
            raise FloatingPointError(f"loss became {lv} at step {step}")
        log["steps"].append({"step": step, "loss": round(lv, 5), "indexer_kl": round(kv, 5), "lr": lr,
                             "grad_norm": round(gnorm, 4), "tokens": sum(int(c.numel()) - 1 for c in ctx), "elapsed_s": round(el, 2)})
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  loss {lv:.4f}  bpb {lv / math.log(2):.3f}  kl {kv:.3f}  lr {lr:.2e}  "
                  f"gnorm {gnorm:.2f}  {el / 60:.1f} min", flush=True)
        if step % tc.val_every == 0 or step == tc.steps:
            vl = _val_loss(model, val)
            log["val"].append({"step": step, "loss": round(vl, 5), "bpb": round(vl / math.log(2), 4)})
            print(f"  val loss {vl:.4f}  bpb {vl / math.log(2):.3f}", flush=True)
        if step % tc.resume_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "log": log, "step": step, "elapsed": el}, rpath)
        if el > tc.minutes * 60 and step < tc.steps:
            print(f"time cap of {tc.minutes} min reached at step {step}/{tc.steps}; stopping", flush=True)
            stopped_early = True
            break
    log["final"] = {"step": step, "stopped_early": stopped_early, "elapsed_s": round(time.time() - t0, 1),
                    "train_loss_last20": round(sum(s["loss"] for s in log["steps"][-20:]) /
                                               max(1, len(log["steps"][-20:])), 5),
                    "val_loss": log["val"][-1]["loss"] if log["val"] else None}
    save_release(model, tc, manifest, log, out_dir)
    return log


def save_release(model: torch.nn.Module, tc: TrainConfig, manifest: dict[str, Any], log: dict[str, Any],
                 out_dir: Path) -> None:
    """Write config.json + model.safetensors (via the loader), corpus_manifest.json and training_log.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    save_checkpoint(state, load_config(tc.model), out_dir)
    save_manifest(manifest, out_dir / "corpus_manifest.json")
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: parse flags into a TrainConfig and train."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m kvshare.train.train", description=__doc__.split("\n")[0])
    for name in ("model", "seed", "steps", "minutes", "batch", "ctx_min", "ctx_max", "lr", "min_lr_ratio",
                 "warmup", "weight_decay", "grad_clip", "indexer_weight", "threads", "val_every", "resume_every",
                 "init_from", "decay_start", "decay_at_minutes", "decay_frac"):
        ap.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    ap.add_argument("--no-quant", action="store_true", help="train without fake-quant (not the release setting)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="release directory (default runs/kvshare-mini-v41; `python -m kvshare.train.install` ships it)")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/train"), help="resume state directory")
    ap.add_argument("--resume", action="store_true", help="continue from <run-dir>/resume.pt")
    a = ap.parse_args(argv)
    kw = {k: getattr(a, k) for k in asdict(d) if k not in ("extra", "quant", "val_chunks")}
    tc = TrainConfig(**kw, quant=not a.no_quant)
    log = train(tc, a.out, a.run_dir, a.resume)
    print(json.dumps(log["final"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
