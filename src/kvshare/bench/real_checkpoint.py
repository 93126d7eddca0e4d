"""Released-format checkpoints at a named model's real per-layer sizes, written one tensor at a time.

`real_config(model, layers, experts, vocab)`: the shipped config of ``deepseek-v4-flash`` or
``deepseek-v4.1-flash`` with fewer layers / routed experts / vocabulary (every per-layer size as
released: hidden, heads, head_dim, LoRA ranks, expert width, index heads), no MTP stage. V4 keeps its
ratio pattern (0 for the first two layers, then 4 / 128 alternating) and at most one hash-routed
layer; V4.1 gets `bench.sizes.v41_layout`'s sharing pattern (>= 6 layers), no Engram layers and no DSpark drafter.

`write_released_checkpoint(cfg, out_dir, seed)`: ``config.json`` + one ``model.safetensors`` in the
release's formats: every `QLinear` weight as FP8 e4m3 with ue8m0 block scales (the config's
``weight_block_size``), routed experts as packed FP4 e2m1 with ue8m0 scales per 32 inputs; the
model's fp32 set (norms, router, mHC, sinks; `dtypes`) as fp32, other floats as bf16, ``tid2eid`` as
int64. Quantised weights are drawn on their grids directly (uniform e2m1 codes; e4m3 codes of normal
draws; ue8m0 scales around 1 / sqrt(in)), the rest by `Transformer.init_weights`'s rules; every tensor
is seeded by its name. Memory stays at one tensor: the safetensors header is computed from the shapes
first, then each tensor is generated and appended. Returns the bytes of tensor data written.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kvshare.config import ModelConfig
from kvshare.weights.checkpoint_files import SINGLE_FILE
from kvshare.weights.checkpoint_write import hf_style_config
from kvshare.weights.loader import _weight_block
from kvshare.weights.weights_quant import FP4_WEIGHT_BLOCK

MODELS = {"v4-flash": "deepseek-v4-flash", "v4.1-flash": "deepseek-v4.1-flash"}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.int8: "I8",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0"}


def real_config(model: str, layers: int, experts: int, vocab: int = 8192) -> ModelConfig:
    """`model` ('v4-flash' / 'v4.1-flash') at its released per-layer sizes with `layers` layers,
    `experts` routed experts (top-k capped at it) and a `vocab`-token vocabulary (see module doc)."""
    from kvshare.bench.sizes import v41_layout
    from kvshare.config import load_config

    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    base = load_config(MODELS[model])
    d = base.to_dict()
    # no MTP layer (the benchmark has no draft): without num_nextn_predict_layers=0 the written
    # config.json would read back with a draft entry appended to compress_ratios, so it would not
    # round-trip and hf_style_config would fall back to kvshare's own format, which llama.cpp's
    # converter cannot read (no `architectures`)
    d.update(num_hidden_layers=layers, n_routed_experts=experts, vocab_size=vocab,
             num_experts_per_tok=min(base.num_experts_per_tok, experts), num_nextn_predict_layers=0)
    if base.arch == "v4":
        d.update(compress_ratios=[0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers)],
                 num_hash_layers=min(1, layers))
    else:  # Engram dropped: its hashed tables (384M rows per layer) are not per-layer weights to scale down
        d.update(v41_layout(layers), engram_layer_ids=[], engram_num_embeddings=[], dspark_block_size=0,
                 dspark_target_layer_ids=[], dspark_markov_rank=0)
    d["eos_token_ids"] = [i for i in d.get("eos_token_ids") or [] if i < vocab] or [1]
    return ModelConfig.from_dict(d)


def _plan(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """(name, kind, shape, stored dtype) of every tensor, kind one of plain / fp32 / int / fp8 / fp4 /
    scale, in file order (weights and their scales adjacent; 8-byte, 4-byte, 2-byte, 1-byte dtypes)."""
    from kvshare.model.deepseek import Transformer
    from kvshare.model.dtypes import _keeps_fp32
    from kvshare.layers.linear import QLinear

    with torch.device("meta"):
        model = Transformer(cfg, quant=False)
    block = _weight_block(cfg)
    quantised = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QLinear)}
    rows: list[tuple[str, str, tuple[int, ...], torch.dtype]] = []
    for mod_name, module in model.named_modules():
        for leaf, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            if name not in model.state_dict():
                continue
            shape = tuple(t.shape)
            if name in quantised:
                stem = name[: -len(".weight")]
                if ".experts." in name and shape[1] % FP4_WEIGHT_BLOCK == 0:
                    rows += [(name, "fp4", (shape[0], shape[1] // 2), torch.int8),
                             (stem + ".scale", "scale", (shape[0], shape[1] // FP4_WEIGHT_BLOCK),
                              torch.float8_e8m0fnu)]
                else:
                    rows += [(name, "fp8", shape, torch.float8_e4m3fn),
                             (stem + ".scale", "scale", (math.ceil(shape[0] / block[0]),
                                                         math.ceil(shape[1] / block[1])), torch.float8_e8m0fnu)]
            elif not t.is_floating_point():
                rows.append((name, "int", shape, torch.int64))
            elif _keeps_fp32(module, leaf):
                rows.append((name, "fp32", shape, torch.float32))
            else:
                rows.append((name, "plain", shape, torch.bfloat16))
    rows.sort(key=lambda r: -r[3].itemsize)  # stable: a weight's scale stays right after it
    return rows


def _init_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """A value drawn by `Transformer.init_weights`'s rule for `name` (fp32 / int64)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        return torch.argsort(torch.rand(shape[0], cfg.n_routed_experts, generator=g), dim=1)[:, : shape[1]]
    if leaf == "weight" and len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name == "embed.weight":
        return torch.randn(shape, generator=g)
    if leaf == "weight" or leaf.endswith("_fn"):
        return torch.randn(shape, generator=g) / math.sqrt(shape[1])
    if leaf == "attn_sink" or leaf.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if leaf in ("ape", "bias"):
        return 0.3 * torch.randn(shape, generator=g)
    if leaf.endswith("_scale") or leaf in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    raise ValueError(f"no initialisation rule for tensor {name}")


def _scales(rows: int, cols: int, exp: float, g: torch.Generator) -> torch.Tensor:
    """ue8m0 scales [rows, cols]: 2^round(exp), each block's exponent moved by -1, 0 or +1 at random."""
    e = round(exp) + 127 + torch.randint(-1, 2, (rows, cols), generator=g, dtype=torch.int16)
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def _grid_fp4(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed FP4 weight [n, k / 2] of uniformly drawn e2m1 codes and its ue8m0 scales [n, k / 32],
    scaled so the weight's RMS is about 1 / sqrt(k) (the codes' RMS is 2.93) as `init_weights` draws."""
    n, k = shape[0], 2 * shape[1]
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(torch.int8)
    return codes, _scales(n, k // FP4_WEIGHT_BLOCK, -math.log2(2.93 * math.sqrt(k)), g)


def _grid_fp8(shape: tuple[int, ...], block: tuple[int, int], g: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight (normal draws of RMS 32, on the e4m3 grid) and its ue8m0 block scales, so the
    weight's RMS is about 1 / sqrt(in)."""
    n, k = shape
    codes = (torch.randn(shape, generator=g) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, _scales(math.ceil(n / block[0]), math.ceil(k / block[1]), -math.log2(32 * math.sqrt(k)), g)


def _tensors(cfg: ModelConfig, plan: list, seed: int) -> Iterator[torch.Tensor]:
    """The stored tensors in `plan`'s order, generated one weight (plus its scale) at a time."""
    block = _weight_block(cfg)
    pending: torch.Tensor | None = None
    for name, kind, shape, dtype in plan:
        if kind == "scale":
            assert pending is not None
            yield pending
            pending = None
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if kind == "fp4":
            w, pending = _grid_fp4(shape, g)
        elif kind == "fp8":
            w, pending = _grid_fp8(shape, block, g)  # type: ignore[arg-type]
        else:
            w = _init_value(name, shape, cfg, g).to(dtype)
        yield w


def _header(plan: list) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, _, shape, dtype in plan:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_released_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0,
                              progress: Callable[[str], None] | None = None) -> int:
    """Write `cfg`'s checkpoint in the released formats to `out_dir` (module doc); returns its data bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_style_config(cfg), indent=2) + "\n")
    plan = _plan(cfg)
    head = _header(plan)
    total = 0
    with open(out / SINGLE_FILE, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little"))
        fh.write(head)
        for (name, _, shape, dtype), t in zip(plan, _tensors(cfg, plan, seed)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise AssertionError(f"{name}: generated {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
            data = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            fh.write(data)
            total += len(data)
            if progress is not None:
                progress(name)
    return total


def main(argv: list[str] | None = None) -> None:
    """``python -m kvshare.bench.real_checkpoint OUT_DIR --model v4-flash --layers 4 --experts 32``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="v4-flash", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = write_released_checkpoint(real_config(a.model, a.layers, a.experts, a.vocab), a.out_dir, a.seed)
    print(f"{a.out_dir}: {n / 1e6:.1f} MB of tensors")


if __name__ == "__main__":
    main()
