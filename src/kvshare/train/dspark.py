"""Train DSpark draft stages for a trained release by distillation from the frozen target.

    python -m kvshare.train.dspark --base runs/kvshare-mini-v41/stage2 --out runs/kvshare-mini-v41/dspark
    python -m kvshare.train.install runs/kvshare-mini-v41/dspark      # explicit step: ship it

The target (the release's backbone) is frozen; only the ``mtp.*`` stages train. Per step, corpus
contexts from the training split go through the target once (no grad) with taps at
``dspark_target_layer_ids``; its greedy token ``g[p] = argmax logits[p]`` at every position is the
teacher. Every position a in ``[1, L - B]`` is a draft anchor, exactly as at inference
(`engine/speculative.py`): the anchor token ``x[a]`` at position a, each stage's context rows
``block_kv(main_x)`` of positions ``a - W .. a - 1`` (from the target's taps), block rows
a .. a+B-1. Row j's logits are ``U[j] + markov(prev_j)`` with ``prev_0 = x[a]`` and
``prev_j = g[a+j-1]`` (the draft the row before should have chosen), and its label is
``g[a+j]``. That label is the target's greedy choice after the corpus prefix ``x[..a+j]``; it is
the greedy choice after the *draft chain* only when the corpus agrees with the chain,
``x[a+1+i] == g[a+i]`` for all i < j. With ``chain_mask`` (default) rows after a disagreement
are left out of the loss, so every trained label is exactly what greedy verification would accept.
The confidence head learns, by a detached binary cross-entropy, whether the row's draft is right.

Stage initialisation: every stage copies the last backbone layer (a sliding-window layer with the
same tensor shapes), ``main_proj`` selects the last target layer's tap, the Markov head starts
with a zero bias. The release keeps the base checkpoint's backbone tensors bit for bit (copied
from its file, never round-tripped) and adds the ``mtp.*`` tensors in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvshare.config import ModelConfig, load_config
from kvshare.step import StepBatch, StepState
from kvshare.train.data import load_split, sample_contexts
from kvshare.train.loop import dense_cache_factory, lr_at

COPIED = ("corpus_manifest.json", "training_log.json", "eval.json", "generation_config.json")


@dataclass
class DSparkTrainConfig:
    """Everything that determines a drafter run (recorded in dspark_log.json)."""

    base: str = "kvshare-mini-v41"  # a release directory or a shipped model name
    seed: int = 0
    steps: int = 300
    minutes: float = 24.0  # safety cap: stops early, saves, and says so
    batch: int = 8
    ctx: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    grad_clip: float = 1.0
    stages: int = 1
    block_size: int = 4
    target_layers: tuple[int, ...] = (2, 5, 7)
    markov_rank: int = 32
    chain_mask: bool = True
    confidence_weight: float = 0.1
    threads: int = 1


def dspark_config(base: ModelConfig, tc: DSparkTrainConfig) -> ModelConfig:
    """`base`'s backbone plus `tc.stages` DSpark stages (ratio-0 draft layers, the backbone's MoE
    sizes); stages `base` already has are replaced."""
    pad = 258 if base.vocab_size > 258 else 0  # the byte tokenizer's pad id: never in the text
    return dataclasses.replace(
        base, compress_ratios=tuple(base.compress_ratios[:base.num_hidden_layers]) + (0,) * tc.stages, num_nextn_predict_layers=tc.stages,
        dspark_block_size=tc.block_size, dspark_noise_token_id=pad, dspark_target_layer_ids=tuple(tc.target_layers),
        dspark_markov_rank=tc.markov_rank, dspark_n_routed_experts=base.n_routed_experts,
        dspark_num_experts_per_tok=base.num_experts_per_tok)


def base_dir(base: str) -> Path:
    """The release directory of `base` (a path, or a shipped model's package directory)."""
    from kvshare.shipped import shipped_model_dir

    p = Path(base)
    d = p if p.is_dir() else shipped_model_dir(base)
    if d is None or not (d / "model.safetensors").is_file():
        raise ValueError(f"--base {base}: not a release directory with model.safetensors")
    return d


def build(tc: DSparkTrainConfig) -> tuple[torch.nn.Module, ModelConfig]:
    """(fp32 target with fresh-initialised stages as ``mtp``, its DSpark config); only mtp trains.
    Bound to the torch reference (`KernelChoice.reference()`): autograd runs through the stages."""
    from kvshare.layers import KernelChoice
    from kvshare.model.deepseek import Transformer
    from kvshare.model.dspark import attach_dspark
    from kvshare.weights.loader import load_checkpoint, load_state_into

    src = base_dir(tc.base)
    cfg = dspark_config(load_config(str(src)), tc)
    model = Transformer(cfg, quant=True)
    attach_dspark(model)
    load_state_into(model, {k: v.float() for k, v in load_checkpoint(src, load_config(str(src))).items()})
    model.float()
    model.bind(KernelChoice.reference())
    init_stages(model, tc.seed)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    return model, cfg


@torch.no_grad()
def init_stages(model: torch.nn.Module, seed: int) -> None:
    """Stages from the last backbone layer; main_proj picks the last tap; zero Markov bias (module doc)."""
    cfg = model.cfg
    last = dict(model.layers[cfg.num_hidden_layers - 1].named_parameters())
    g = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size
    for i, st in enumerate(model.mtp):
        for name, p in st.named_parameters():
            if name in last and last[name].shape == p.shape:
                p.copy_(last[name])
            elif name == "main_proj.weight":
                p.zero_()
                p[:, (len(cfg.dspark_target_layer_ids) - 1) * d:] = torch.eye(d)
            elif name.endswith("norm.weight"):
                p.copy_(model.norm.weight if name == "norm.weight" else torch.ones_like(p))
            elif name == "markov_head.embed.weight":
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif name in ("markov_head.head.weight", "confidence_head.proj.weight"):
                p.zero_()
            else:
                raise RuntimeError(f"init_stages: no rule for mtp.{i}.{name}")


def draft_targets(x: torch.Tensor, g: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
    """Anchors and teacher rows of contexts x [S, L] with the target's greedy tokens g [S, L].

    Returns (seq [N], anchor position [N], label [N, B], prev [N, B], ok [N, B]) over every anchor
    a in [1, L - B] of every sequence: ``label[j] = g[a+j]``, ``prev[0] = x[a]``,
    ``prev[j] = g[a+j-1]``, ``ok[j]`` = the corpus follows the greedy chain up to row j
    (``x[a+1+i] == g[a+i]`` for all i < j; row 0 always)."""
    s, L = x.shape
    a = torch.arange(1, L - b + 1)
    seq = torch.arange(s).repeat_interleave(a.numel())
    anc = a.repeat(s)
    j = torch.arange(b)
    label = g[seq[:, None], anc[:, None] + j[None, :]]
    prev = torch.cat([x[seq, anc][:, None], label[:, :-1]], dim=1)
    agree = x[seq[:, None], anc[:, None] + 1 + j[None, :-1]] == label[:, :-1]
    ok = torch.cat([torch.ones(len(anc), 1, dtype=torch.bool), agree.cumprod(1).bool()], dim=1)
    return seq, anc, label, prev, ok


def step_loss(model: torch.nn.Module, contexts: torch.Tensor, tc: DSparkTrainConfig) -> tuple[torch.Tensor, dict]:
    """(loss, stats) of one batch of equal-length contexts [S, L] (module doc)."""
    from kvshare.model.dspark import DSparkDraft

    draft = DSparkDraft(model)
    s, L = contexts.shape
    b, w = draft.block, model.cfg.sliding_window
    batch = StepBatch.build([0] * s, [L] * s)
    state = StepState(taps={t: None for t in draft.targets})
    with torch.no_grad():
        logits = model(contexts.flatten(), batch, dense_cache_factory(model, batch), state)
    g = logits.argmax(-1).view(s, L)
    x = contexts
    main_x = draft.main_x(state.taps)  # [S * L, D], grad through main_proj / main_norm
    seq, anc, label, prev, ok = draft_targets(x, g, b)
    q = anc[:, None] - w + torch.arange(w)[None, :]  # context positions [N, W]
    valid = q >= 0
    flat = seq[:, None] * L + q.clamp(min=0)
    context = {}
    for layer, st in zip(draft.layers, draft.stages):
        rows = st.attn.block_kv(main_x, batch.positions)  # [S * L, d]
        context[layer] = (rows[flat].masked_fill(~valid[..., None], 0), valid)
    u, x_head = draft.run_block(x[seq, anc], anc, context)  # [N, B, V], [N, B, D]
    weight = ok.float() if tc.chain_mask else torch.ones_like(ok, dtype=torch.float32)
    bias, m_emb = draft.markov_bias(prev.flatten())
    z = u.flatten(0, 1) + bias
    ce = F.cross_entropy(z.float(), label.flatten(), reduction="none")
    loss = (ce * weight.flatten()).sum() / weight.sum()
    hit = (z.argmax(-1) == label.flatten())
    conf = draft.confidence(x_head.flatten(0, 1).detach(), m_emb.detach())
    bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit.float(), reduction="none")
    loss = loss + tc.confidence_weight * (bce * weight.flatten()).sum() / weight.sum()
    hit = hit.view(-1, b)
    stats = {"row_acc": [round(float(hit[ok[:, k], k].float().mean()), 4) for k in range(b)],
             "mean_accepted": round(1.0 + float(hit.cumprod(1).sum(1).float().mean()), 4)}
    return loss, stats


def save_release(model: torch.nn.Module, cfg: ModelConfig, tc: DSparkTrainConfig, log: dict[str, Any],
                 out: Path) -> None:
    """The base release's files, its backbone tensors unchanged, plus the bf16 mtp.* tensors."""
    from kvshare.weights.checkpoint_write import save_checkpoint

    src = base_dir(tc.base)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("mtp.")}
    state.update({f"mtp.{k}": v.detach().to(torch.bfloat16) for k, v in model.mtp.state_dict().items()})
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(state, cfg, out)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    (out / "dspark_log.json").write_text(json.dumps(log, indent=1) + "\n")


def train_dspark(tc: DSparkTrainConfig, out: Path) -> dict[str, Any]:
    """Run the distillation; write the release to `out`; returns the log."""
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    model, cfg = build(tc)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    split = load_split(heldout=False)
    gen = torch.Generator().manual_seed(tc.seed + 7)
    log: dict[str, Any] = {"config": asdict(tc), "torch": torch.__version__, "steps": []}
    print(f"drafter: {sum(p.numel() for p in params) / 1e6:.2f}M trainable params", flush=True)
    t0, step, stopped = time.time(), 0, False
    while step < tc.steps:
        lr = lr_at(step, tc.steps, tc.lr, tc.warmup, tc.min_lr_ratio)
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, st = step_loss(model, sample_contexts(split, tc.batch, tc.ctx, gen), tc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lv = float(loss.detach())
        gn = float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip))
        opt.step()
        step += 1
        el = time.time() - t0
        if not math.isfinite(lv):
            raise FloatingPointError(f"loss became {lv} at step {step}")
        log["steps"].append({"step": step, "loss": round(lv, 5), "lr": lr, "grad_norm": round(gn, 4),
                             "elapsed_s": round(el, 1), **st})
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  loss {lv:.4f}  acc {st['row_acc']}  mean_acc_len "
                  f"{st['mean_accepted']:.3f}  lr {lr:.2e}  {el / 60:.1f} min", flush=True)
        if el > tc.minutes * 60 and step < tc.steps:
            print(f"time cap of {tc.minutes} min reached at step {step}/{tc.steps}; stopping", flush=True)
            stopped = True
            break
    last = log["steps"][-20:]
    log["final"] = {"step": step, "stopped_early": stopped, "elapsed_s": round(time.time() - t0, 1),
                    "loss_last20": round(sum(r["loss"] for r in last) / max(1, len(last)), 5),
                    "mean_accepted_last20": round(sum(r["mean_accepted"] for r in last) / max(1, len(last)), 4)}
    save_release(model, cfg, tc, log, out)
    return log


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: flags into a DSparkTrainConfig."""
    d = DSparkTrainConfig()
    ap = argparse.ArgumentParser(prog="python -m kvshare.train.dspark", description=__doc__.split("\n")[0])
    for name in ("base", "seed", "steps", "minutes", "batch", "ctx", "lr", "min_lr_ratio", "warmup", "grad_clip",
                 "stages", "block_size", "markov_rank", "confidence_weight", "threads"):
        ap.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    ap.add_argument("--target-layers", type=int, nargs="+", default=list(d.target_layers))
    ap.add_argument("--no-chain-mask", action="store_true", help="train every row, not only greedy-chain rows")
    ap.add_argument("--out", type=Path, default=Path("runs/kvshare-mini-v41/dspark"), help="release directory")
    a = ap.parse_args(argv)
    kw = {k: getattr(a, k) for k in asdict(d) if k not in ("target_layers", "chain_mask")}
    tc = DSparkTrainConfig(**kw, target_layers=tuple(a.target_layers), chain_mask=not a.no_chain_mask)
    log = train_dspark(tc, a.out)
    print(json.dumps(log["final"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
