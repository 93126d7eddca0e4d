"""Loading one tensor-parallel rank's shard: only that rank's slice is read from safetensors.

`load_rank_model(model, args, group)`:
- a built model (a `Transformer`): a copy is sharded with `apply_tp` (the caller's model is untouched);
- a checkpoint directory (or a shipped model with weights) in the released naming: the model is built
  on the meta device (on the CPU for Engram models), given this rank's shapes, and filled by `read_rank_state`, which reads each
  sharded tensor with ``safe_open(...).get_slice`` (and the matching rows of an FP8 weight's block
  scale), skips the routed experts of other ranks and reads replicated tensors whole; in a bf16
  model with the native kernels the FP8 / FP4 `QLinear` weights stay packed (`kernels.Packed`), as
  at TP=1, where the slice allows it (whole experts; FP8 slices of whole scale blocks);
- a checkpoint in another naming (transformers'): the whole checkpoint is read, then narrowed;
- a config name or file without weights: the full model is initialised (`init_weights`), then sharded.
Engram (V4.1): every rank hashes the same ids, maps the host tables and keeps only its hash columns'
rows (`engram_shard.shard_engram`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvshare.config import ModelConfig, load_config
from kvshare.engine.args import resolve_device, resolve_dtype
from kvshare.errors import CheckpointError
from kvshare.weights import weights_quant as wq
from kvshare.weights.checkpoint_files import refuse_pickle_only
from kvshare.weights.hf_naming import NAMINGS, detect_naming
from kvshare.model.engram_table import is_table_name
from kvshare.parallel.engram_shard import shard_engram
from kvshare.weights.checkpoint_stream import _quantised
from kvshare.weights.loader import (_packable_names, _scale_owner, _skip_kind, _weight_block, checkpoint_files,
                                  engram_tables, has_weights, load_checkpoint, load_model, load_state_into)
from kvshare.parallel.shard import ShardPlan, apply_tp, check_divisible, restructure

log = logging.getLogger(__name__)
_PLAIN = ("F64", "F32", "BF16", "F16")


def read_rank_state(path: str | Path, cfg: ModelConfig, plan: ShardPlan,
                    keep_packed: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """This rank's released-naming state dict (local expert numbering), decoded to floating point
    except the FP8 / FP4 weights named (locally) in `keep_packed`, returned as `kernels.Packed` where
    the kernels can hold their slice (a whole expert, or an FP8 slice of whole scale blocks)."""
    files = checkpoint_files(path)
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    names = [n for n in where if _skip_kind(n, cfg) is None and not is_table_name(n)]  # tables: mapped, not read
    present = dict.fromkeys(names)
    scales = {o: n for n in names if (o := _scale_owner(n, present)) is not None
              and where[o].get_slice(o).get_dtype() not in _PLAIN}
    scale_names = set(scales.values())
    if detect_naming([n for n in names if n not in scale_names]) != NAMINGS[0]:
        log.info("checkpoint %s is not in the released naming: reading it whole, then narrowing", path)
        return plan.shard_state(load_checkpoint(path, cfg))
    block = _weight_block(cfg)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name in scale_names:
            continue
        sl = where[name].get_slice(name)
        p = plan.place(name, tuple(sl.get_shape()))
        if p is None:
            continue
        local, dim, start, length = p
        scale = where[scales[name]].get_slice(scales[name]) if name in scales else None
        out[local] = _read(name, sl, scale, dim, start, length, block, local in keep_packed)
    if cfg.tie_word_embeddings and "head.weight" not in out and "embed.weight" in out:
        out["head.weight"] = out["embed.weight"]
    return out


def _read(name: str, sl: Any, scale: Any, dim: int | None, start: int, length: int,
          block: tuple[int, int], pack: bool = False) -> torch.Tensor:
    """One tensor's part (`dim` None: whole), FP8/FP4 decoded with its scale when it has one (kept
    packed instead when `pack` and the kernels can hold it).

    An FP8 slice holding whole scale blocks reads only its rows of the weight and of the scale;
    any other quantised slice is decoded whole, then narrowed."""
    whole = (slice(None),) * (dim or 0)
    if scale is None:
        t = sl[:] if dim is None else sl[whole + (slice(start, start + length),)]
        if wq.is_fp8(t):
            raise CheckpointError(f"tensor `{name}` is quantised ({t.dtype}) but has no `.scale` companion")
        return t
    if dim is None:
        return _decode(name, sl[:], scale[:], block, pack)
    b = block[dim]
    if sl.get_dtype() == "F8_E4M3" and start % b == 0 and length % b == 0:
        return _decode(name, sl[whole + (slice(start, start + length),)],
                       scale[whole + (slice(start // b, (start + length) // b),)], block, pack)
    return _decode(name, sl[:], scale[:], block).narrow(dim, start, length).clone()


def _decode(name: str, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], pack: bool = False) -> Any:
    if pack and (wq.is_fp8(w) or wq.is_packed_fp4(w)):
        return _quantised(name, w.contiguous(), s.contiguous(), block, True)
    try:
        if wq.is_fp8(w):
            return wq.dequant_fp8_weight(w, s, block)
        if wq.is_packed_fp4(w):
            return wq.dequant_fp4_weight(w, s)
    except ValueError as e:
        raise CheckpointError(f"tensor `{name}`: {e}") from e
    return w


def resolve_model(model: str | Path) -> Path:
    """The path `load_model` reads for `model`: a shipped model's directory, else `model` itself."""
    from kvshare.shipped import shipped_model_dir

    p = Path(model)
    return p if p.exists() else shipped_model_dir(str(model)) or p


def load_rank_model(model: Any, args: Any, group: Any) -> torch.nn.Module:
    """This rank's shard of `model` (a Transformer, or a name / path `load_model` accepts)."""
    from kvshare.model.deepseek import Transformer
    from kvshare.model.engram import engram_hasher
    from kvshare.layers.rope import RotaryEmbedding
    from kvshare.tokenizer import load_tokenizer

    model = model if model is not None else "kvshare-mini-v41"
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device) if args.dtype is not None or not isinstance(model, torch.nn.Module) \
        else next(model.parameters()).dtype
    quant = True if args.quantize is None else args.quantize
    if isinstance(model, torch.nn.Module):
        m = copy.deepcopy(model)
        if args.quantize is not None:
            m.set_quant(args.quantize)
        return apply_tp(m, group).to(device=device, dtype=dtype).eval()
    p = resolve_model(model)
    weights_dir = p if p.is_dir() else (p.parent if p.is_file() else None)
    if weights_dir is not None:
        refuse_pickle_only(weights_dir)
    draft = getattr(args, "speculative_config", None) is not None
    if weights_dir is None or not has_weights(weights_dir) or draft:
        # With DSpark stages (replicated: `restructure` shards the backbone only) the whole checkpoint
        # is read, then narrowed: the sliced reader below skips the mtp.* tensors.
        return apply_tp(load_model(model, dtype=dtype, device=device, quant=quant, engram_table=args.engram_table,
                                   draft=draft), group)
    cfg = load_config(str(p))
    plan = ShardPlan(cfg, group.rank, group.size)
    tokenizer = load_tokenizer(str(p)) if cfg.engram_layer_ids else None
    # The Engram hasher needs real tensors while it is built, so Engram models get a CPU skeleton.
    with torch.device("meta") if not cfg.engram_layer_ids else contextlib.nullcontext():
        m = Transformer(cfg, quant=quant, tokenizer=tokenizer)
    check_divisible(cfg, group.size, act_quant=m.quant.act)
    restructure(m, plan, group)
    m.to_empty(device="cpu")
    rd = cfg.qk_rope_head_dim  # what the constructor computed was not materialised on meta: rebuild it
    m.rope_main = RotaryEmbedding(rd, cfg.rope_theta, None)
    m.rope_compress = RotaryEmbedding(rd, cfg.compress_rope_theta, cfg.yarn)
    load_state_into(m, read_rank_state(weights_dir, cfg, plan, _packable_names(m, dtype)))
    if cfg.engram_layer_ids:  # each rank keeps its hash columns' rows of the mapped tables
        m.engram_hash = engram_hasher(cfg, tokenizer)
        m.attach_engram_tables(engram_tables(checkpoint_files(weights_dir), cfg, args.engram_table))
        shard_engram(m, plan.rank, plan.size, group)
    return m.to(device=device, dtype=dtype).eval()
