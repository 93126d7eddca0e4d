"""Checkpoints: read safetensors (released or transformers naming, FP8 / FP4 or plain), build models.

* `load_checkpoint(path, cfg)`: a single ``.safetensors`` file, or a directory with
  ``model.safetensors.index.json`` (sharded), ``model.safetensors``, or other ``*.safetensors`` files.
  Names follow any naming in `hf_naming.NAMINGS` (DeepSeek's released names, transformers' in-memory
  names, what its `save_pretrained` writes), detected from the names and mapped to the released ones.
  A tensor with a companion scale (``<module>.scale`` for ``<module>.weight``, ``<name>.scale`` or
  ``<module>.weight_scale_inv``) is decoded to fp32 on load: e4m3 weights as FP8 block-scaled (block
  from ``quantization_config.weight_block_size``), int8 / uint8 / ``float4_e2m1fn_x2`` weights as
  packed FP4 (layout in `weights_quant`). Tensors without a scale are returned as stored.
  ``keep_packed`` (a set of released names): those FP8 / FP4 weights (2-D, power-of-two scales) are
  returned as `kvshare.kernels.Packed` instead, never expanded; `load_model` asks for this for
  every `QLinear` weight of a bf16 model when the native kernels are available.
  Draft (``mtp.*``, or backbone-style layers past ``num_hidden_layers``) and vision tensors are
  skipped with one logged warning (unless the DSpark stages are asked for, ``draft=True``);
  missing, unexpected or mis-shaped tensors raise CheckpointError.
  Engram tables (``layers.L.engram.embed.{weight,scale}``) are never read here: their headers are
  checked, and `load_model` memory-maps them (or reads them into RAM, ``engram_table="memory"``).
Writing checkpoints (`save_checkpoint`, `export_transformers`) lives in `checkpoint_write`.
* `load_model(name_or_path, ...)`: a directory (config + weights, or config only), a model shipped
  with weights (``kvshare/models/<name>/``, e.g. the trained kvshare-mini-v41), or a shipped
  config name; without weights the model is initialised by its ``init_weights(DEFAULT_SEED)``.
  A checkpoint in the released naming (without DSpark stages) is streamed: the model is built with
  its weights allocated but never written (`_unfilled_model`) and `checkpoint_stream.stream_into`
  gives each tensor its value, one at a time (FP8 / FP4 read once and repacked, plain tensors in
  their final dtype mapped from the file); peak memory is about the checkpoint's size. Other
  namings, and ``draft=True``, read the whole checkpoint first (`load_checkpoint`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from kvshare.config import ModelConfig, load_config
from kvshare.errors import CheckpointError
from kvshare.weights import weights_quant as wq
from kvshare.weights.checkpoint_files import (INDEX_FILE, check_header_shapes, describe,
                                           refuse_pickle_only, weight_files)
from kvshare.model.engram_table import DEFAULT_TABLE_MODE, TableMode, is_table_name, open_tables
from kvshare.weights.checkpoint_stream import Entry, index_files, release_free_heap, stream_into
from kvshare.weights.checkpoint_stream import scale_owner as _scale_owner
from kvshare.weights.hf_naming import NAMINGS, detect_naming, released_shapes, to_released

if TYPE_CHECKING:
    from kvshare.model.deepseek import Transformer
    from kvshare.model.quantize import QuantMode

log = logging.getLogger(__name__)

DEFAULT_SEED = 0
_VISION_PREFIXES = ("vision", "visual", "vit.", "mm_projector", "multi_modal_projector", "image_newline",
                    "view_seperator", "view_separator", "projector.")
_LAYER_ID = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


# ---- reading ----------------------------------------------------------------------------------


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (a file, or a directory; sharded via the index file).

    Shard paths stay inside the directory; pickle-only directories are refused (`checkpoint_files`)."""
    return weight_files(path)


def has_weights(path: str | Path) -> bool:
    """Whether a directory holds safetensors weights."""
    p = Path(path)
    return p.is_dir() and ((p / INDEX_FILE).is_file() or any(p.glob("*.safetensors")))


def _read_all(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if is_table_name(name):  # Engram tables: memory-mapped by `open_tables`, never read whole
                        continue
                    if name in out:
                        raise CheckpointError(f"tensor `{name}` appears in more than one shard ({f.name})")
                    out[name] = fh.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError, OSError...: name the file
            raise describe(e, f) from e
    return out


def _skip_kind(name: str, cfg: ModelConfig) -> str | None:
    """'draft' / 'vision' for tensors the text backbone does not use, else None."""
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare.startswith("mtp.") or ".mtp." in name:
        return "draft"
    m = _LAYER_ID.match(name)
    if m and cfg.num_hidden_layers <= int(m.group(1)) < len(cfg.compress_ratios):
        return "draft"
    if bare.startswith(_VISION_PREFIXES) or name.endswith(".bias_vl"):
        return "vision"
    return None


def _weight_block(cfg: ModelConfig) -> tuple[int, int]:
    q = cfg.extra.get("quantization_config") or {}
    wbs = q.get("weight_block_size") if isinstance(q, dict) else None
    if isinstance(wbs, (list, tuple)) and len(wbs) == 2:
        return int(wbs[0]), int(wbs[1])
    return cfg.act_quant_block, cfg.act_quant_block


def _keep_packed(t: torch.Tensor, s: torch.Tensor, block: tuple[int, int]):
    """`t` with scale `s` as a `kernels.Packed`, or None where the kernels cannot hold it as is
    (not 2-D, a scale that is not a power of two, an unsupported block)."""
    from kvshare import kernels

    if t.dim() != 2:
        return None
    try:
        return kernels.pack_fp8(t, s, block) if wq.is_fp8(t) else kernels.pack_fp4(t, s)
    except ValueError:
        return None


def _dequantize(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                keep_packed: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    scales: dict[str, str] = {}
    for name in list(tensors):
        if (name.endswith(".scale") or name.endswith("_scale_inv")) and tensors[name].dtype.is_floating_point:
            owner = _scale_owner(name, tensors)
            if owner is not None and (wq.is_fp8(tensors[owner]) or wq.is_packed_fp4(tensors[owner])):
                scales[owner] = name
    block = _weight_block(cfg)
    out: dict[str, torch.Tensor] = {}
    used = set(scales.values())
    for name, t in tensors.items():
        if name in used:
            continue
        if name in scales:
            s = tensors[scales[name]]
            kept = _keep_packed(t, s, block) if name in keep_packed else None
            if kept is not None:
                out[name] = kept  # type: ignore[assignment]
                continue
            try:
                out[name] = wq.dequant_fp8_weight(t, s, block) if wq.is_fp8(t) else wq.dequant_fp4_weight(t, s)
            except ValueError as e:
                raise CheckpointError(f"tensor `{name}`: {e}") from e
        elif wq.is_fp8(t) or (wq.is_packed_fp4(t) and not name.endswith("tid2eid")):
            raise CheckpointError(f"tensor `{name}` is quantised ({t.dtype}) but has no `.scale` companion")
        else:
            out[name] = t
    return out


def load_checkpoint(path: str | Path, cfg: ModelConfig, draft: bool = False,
                    keep_packed: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Read a checkpoint into a released-naming state dict checked against `cfg` (see module doc).

    `keep_packed`: released names of FP8 / FP4 weights to return packed (`kernels.Packed`).
    `draft`: keep the ``mtp.*`` (DSpark) tensors too, dropping their unused ``gate.bias_vl``; they
    are checked against the model by `load_model`."""
    files = checkpoint_files(path)
    raw = _read_all(files)
    engram_tables(files, cfg, "mmap")  # names, dtypes and shapes of the Engram tables
    skipped = {"draft": 0, "vision": 0}
    kept: dict[str, torch.Tensor] = {}
    drafts: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        kind = _skip_kind(name, cfg)
        if draft and kind is not None and name.startswith("mtp."):
            if not name.endswith(".bias_vl"):  # drafts are text: no VL bias (spec engram_dspark.md §2.2)
                drafts[name] = t
        elif kind is None:
            kept[name] = t
        else:
            skipped[kind] += 1
    if any(skipped.values()):  # the config's own draft stages, left out unless asked for, are routine
        routine = not skipped["vision"] and cfg.num_draft_layers > 0
        (log.info if routine else log.warning)(
            "checkpoint %s: skipped %d draft (mtp) and %d vision tensors (not used by the text backbone)",
            path, skipped["draft"], skipped["vision"])
    state = to_released(_dequantize(kept, cfg, keep_packed))
    if cfg.tie_word_embeddings and "head.weight" not in state and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    check_state_dict(state, released_shapes(cfg))
    if draft:
        if not drafts:
            raise CheckpointError(f"checkpoint {path} has no mtp.* (DSpark draft) tensors; speculative_config "
                                  "method 'dspark' needs them (drop speculative_config for this model)")
        state.update(_dequantize(drafts, cfg))
    return state


def engram_tables(files: list[Path], cfg: ModelConfig, mode: TableMode = DEFAULT_TABLE_MODE) -> dict:
    """The Engram table of each Engram layer of `cfg` in the checkpoint `files` (layer id -> EngramTable)."""
    return open_tables(files, cfg.engram_layer_ids, cfg.engram_num_embeddings, cfg.engram_head_dim, mode)


def check_state_dict(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError for the first missing, unexpected or mis-shaped tensor."""
    for name, shape in expected.items():
        if name not in state:
            raise CheckpointError(f"missing tensor `{name}` (expected shape {list(shape)})")
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor `{name}` (shape {list(t.shape)}): not part of this config")
        if tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor `{name}` has shape {list(t.shape)}, expected {list(expected[name])}")


# ---- models -----------------------------------------------------------------------------------


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a released-naming state dict into `model`, checking names and shapes first.

    Model tensors under ``mtp.`` (draft layers) that the checkpoint lacks keep their values. A
    `kernels.Packed` value is handed to its `Linear` (`set_packed`) instead of copied."""
    own = model.state_dict()
    expected = {k: tuple(v.shape) for k, v in own.items()}
    for name in own:
        if name not in state and not name.startswith("mtp."):
            raise CheckpointError(f"missing tensor `{name}` (expected shape {list(expected[name])})")
    check_state_dict(state, {k: s for k, s in expected.items() if k in state or not k.startswith("mtp.")})
    with torch.no_grad():
        for name, t in state.items():
            if isinstance(t, torch.Tensor):
                own[name].copy_(t)
            else:
                model.get_submodule(name.rsplit(".", 1)[0]).set_packed(t)


def _check_draft(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """CheckpointError for a missing, unexpected or mis-shaped ``mtp.*`` tensor (spec §2.9)."""
    from kvshare.model.dspark import dspark_shapes

    expected = dspark_shapes(model)  # type: ignore[arg-type]
    check_state_dict({k: v for k, v in state.items() if k.startswith("mtp.")}, expected)


def _packable_names(model: torch.nn.Module, dtype: torch.dtype) -> frozenset[str]:
    """Weights a bf16 model keeps packed when the native kernels serve them (module doc): those of
    `QLinear`s, whose every use goes through `Linear.forward` (plain linears such as ``wo_a`` or
    the compressor's are also read as dense tensors elsewhere)."""
    from kvshare import kernels
    from kvshare.layers.linear import QLinear

    if dtype != torch.bfloat16 or not kernels.available():
        return frozenset()
    return frozenset(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, QLinear))


def _streamable(weights_dir: Path, cfg: ModelConfig) -> "dict[str, Entry] | None":
    """The checkpoint's backbone tensors with their byte ranges when it is in the released naming
    (`checkpoint_stream`); None for other namings, which `load_checkpoint` maps whole. Draft, vision
    and Engram-table tensors are left out (logged as `load_checkpoint` does)."""
    files = checkpoint_files(weights_dir)
    entries = index_files(files)
    engram_tables(files, cfg, "mmap")  # names, dtypes and shapes of the Engram tables
    skipped = {"draft": 0, "vision": 0}
    kept: dict[str, Entry] = {}
    for name, e in entries.items():
        if is_table_name(name):
            continue
        kind = _skip_kind(name, cfg)
        if kind is None:
            kept[name] = e
        else:
            skipped[kind] += 1
    scale_names = set(_scale_names(kept))
    if detect_naming([n for n in kept if n not in scale_names]) != NAMINGS[0]:
        return None
    if any(skipped.values()):
        routine = not skipped["vision"] and cfg.num_draft_layers > 0
        (log.info if routine else log.warning)(
            "checkpoint %s: skipped %d draft (mtp) and %d vision tensors (not used by the text backbone)",
            weights_dir, skipped["draft"], skipped["vision"])
    if cfg.tie_word_embeddings and "head.weight" not in kept and "embed.weight" in kept:
        kept["head.weight"] = kept["embed.weight"]
    return kept


def _scale_names(entries: dict) -> list[str]:
    return [n for n in entries if (n.endswith(".scale") or n.endswith("_scale_inv"))
            and _scale_owner(n, entries) is not None]


def _unfilled_model(cfg: ModelConfig, quant: "bool | QuantMode", tokenizer: object | None) -> "Transformer":
    """A CPU `Transformer` whose weights are allocated but never written (`_SkipRandomFill`): the
    pages of a large weight are not resident until `stream_into` replaces it (a packed weight's
    never are). Derived tensors (rotary frequencies, the Engram hasher) are computed as usual. (Not
    the meta device: its first use imports ~800 modules, ~3 s and ~72 MB.)"""
    from kvshare.model.deepseek import Transformer

    with _SkipRandomFill():
        return Transformer(cfg, quant=quant, tokenizer=tokenizer)


class _SkipRandomFill(TorchFunctionMode):
    """Turns parameter initialisation's in-place fills (``torch.nn.init.*_``, which the `nn.Linear` /
    `nn.Embedding` constructors call, and ``Tensor.uniform_`` / ``normal_``) into no-ops returning
    the tensor; every other op runs as is."""

    _SKIPPED = frozenset({torch.Tensor.uniform_, torch.Tensor.normal_})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in self._SKIPPED or (getattr(func, "__module__", None) == "torch.nn.init"
                                     and func.__name__.endswith("_")):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quant: "bool | QuantMode" = True, engram_table: TableMode = DEFAULT_TABLE_MODE,
               draft: bool = False) -> "Transformer":
    """Build a `Transformer` from a checkpoint directory, a config file, or a shipped config name.

    With weights next to the config they are loaded; otherwise the model is randomly initialised
    with `init_weights(DEFAULT_SEED)` (deterministic), except Engram tables too large to invent
    (ConfigError). Engram tables stay on the CPU, memory-mapped (`engram_table="mmap"`, the
    default) or read into RAM (`"memory"`); Engram hashing uses the model's tokenizer."""
    from kvshare.model.deepseek import Transformer

    from kvshare.shipped import shipped_model_dir

    p = Path(name_or_path)
    shipped = None if p.exists() else shipped_model_dir(str(name_or_path))
    if shipped is not None:  # a model shipped with trained weights, e.g. kvshare-mini-v41
        name_or_path = p = shipped
    weights_dir = p if p.is_dir() else (p.parent if p.is_file() else None)
    cfg = load_config(str(name_or_path))
    if weights_dir is not None:
        refuse_pickle_only(weights_dir)
    with_weights = weights_dir is not None and has_weights(weights_dir)
    tokenizer = None
    if cfg.engram_layer_ids:
        from kvshare.config.engram import check_random_tables
        from kvshare.tokenizer import load_tokenizer

        if not with_weights:
            check_random_tables(cfg, str(name_or_path))
        tokenizer = load_tokenizer(str(name_or_path))
    if with_weights:  # shapes from the headers, before the model (or any pool) is allocated
        check_header_shapes(weight_files(weights_dir), cfg.num_hidden_layers, released_shapes(cfg),
                            _weight_block(cfg))
    entries = _streamable(weights_dir, cfg) if with_weights and not draft else None
    if entries is not None:  # released naming: filled tensor by tensor (no whole-model copies)
        model = _unfilled_model(cfg, quant, tokenizer)
        stream_into(model, entries, cfg, dtype, _packable_names(model, dtype), _weight_block(cfg))
        release_free_heap()
        if cfg.engram_layer_ids:
            model.attach_engram_tables(engram_tables(checkpoint_files(weights_dir), cfg, engram_table))
        from kvshare.model.dtypes import cast_model

        return cast_model(model, dtype, device).eval()
    model = Transformer(cfg, quant=quant, tokenizer=tokenizer)
    if draft:  # DSpark stages as model.mtp (speculative decoding)
        from kvshare.model.dspark import attach_dspark

        attach_dspark(model)
    if with_weights:
        state = load_checkpoint(weights_dir, cfg, draft=draft, keep_packed=_packable_names(model, dtype))
        if draft:
            _check_draft(model, state)
        load_state_into(model, state)
        if cfg.engram_layer_ids:
            model.attach_engram_tables(engram_tables(checkpoint_files(weights_dir), cfg, engram_table))
    else:
        model.init_weights(DEFAULT_SEED)
    from kvshare.model.dtypes import cast_model

    return cast_model(model, dtype, device).eval()
