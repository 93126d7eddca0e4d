"""FP8 / FP4 checkpoint weights stay packed in a bf16 model (kvshare.kernels): bytes in memory =
checkpoint bytes, the same numbers as the dequantised weights, a working forward, MoE rows
independent of their group, and the binding of dense linears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvshare import kernels
from kvshare.config import load_config
from kvshare.model.deepseek import Transformer
from kvshare.model.dtypes import cast_model, weight_bytes
from kvshare.layers import KernelChoice
from kvshare.layers.linear import Linear, QLinear
from kvshare.weights.loader import load_model
from kvshare.weights.checkpoint_write import save_checkpoint
from kvshare.model.moe import _run_experts
from kvshare.weights.weights_quant import release_quantize
from test_model_common import run_chunks, token_ids

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (torch path only)")


def _quantised_checkpoint(tmp_path: Path) -> Path:
    """tiny-v4 in bf16 (fp32 set kept) with every QLinear weight as the release stores it."""
    cfg = load_config("tiny-v4")
    model = cast_model(Transformer(cfg).init_weights(3), torch.bfloat16)
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QLinear)}
    save_checkpoint(release_quantize(model.state_dict(), names), cfg, tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _quantised_checkpoint(tmp_path_factory.mktemp("qckpt"))


def test_weights_stay_packed_with_the_checkpoint_bytes(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype=torch.bfloat16)
    qlin = [m for m in model.modules() if isinstance(m, QLinear)]
    assert qlin and all(m.qweight is not None and m.weight.numel() == 0 for m in qlin)
    fmts = {m.qweight.fmt for m in qlin}
    assert fmts == {"fp8", "fp4"}
    buffers = {n for n, _ in model.named_buffers()}
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        ck = sum(_nbytes(f, n) for n in f.keys() if n not in buffers)
    got = weight_bytes(model)
    assert abs(got / ck - 1) < 0.02, (got, ck)  # observed: 350,336 vs 350,273 bytes (+0.02%)


def _nbytes(f, name: str) -> int:
    t = f.get_tensor(name)
    return t.numel() * t.element_size()


def test_packed_weights_are_the_dequantised_weights(checkpoint: Path) -> None:
    packed = load_model(checkpoint, dtype=torch.bfloat16)
    dense = load_model(checkpoint, dtype=torch.float32)  # the loader's dequantisation (fp32, exact)
    dense_q = {n: m for n, m in dense.named_modules() if isinstance(m, QLinear)}
    for n, m in packed.named_modules():
        if isinstance(m, QLinear):
            assert torch.equal(kernels.dequantize(m.qweight).float(), dense_q[n].weight), n


def test_forward_is_close_to_the_dequantised_model(checkpoint: Path) -> None:
    """Same weights, another summation order: logits agree to bf16 noise (observed: identical,
    max abs diff 0 on logits up to 3.75 over 12 tokens; at these widths the sums round alike)."""
    packed = load_model(checkpoint, dtype=torch.bfloat16)
    dense = cast_model(load_model(checkpoint, dtype=torch.float32), torch.bfloat16)
    ids = token_ids(packed.cfg, 12)
    a = run_chunks(packed, ids, [12]).float()
    b = run_chunks(dense, ids, [12]).float()
    assert torch.isfinite(a).all()
    assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item()


def test_moe_rows_do_not_depend_on_their_group(checkpoint: Path) -> None:
    """A token's expert output is the same bits whether 1 or 6 rows chose the expert."""
    model = load_model(checkpoint, dtype=torch.bfloat16)
    moe = model.layers[1].ffn
    gen = torch.Generator().manual_seed(4)
    xs = torch.randn(6, model.cfg.hidden_size, generator=gen).to(torch.bfloat16)
    w = torch.rand(6, generator=gen)
    # expert 2 sees row 3 alone, then with 5 other rows; the shared expert sees it alone, then with row 0
    alone = _run_experts([(moe.experts[2], 1), (moe.shared_experts, 1)], xs[[3, 3]], w[[3, 3]])
    many = _run_experts([(moe.experts[2], 6), (moe.shared_experts, 2)], xs[[0, 1, 2, 3, 4, 5, 0, 3]],
                        w[[0, 1, 2, 3, 4, 5, 0, 3]])
    assert torch.equal(many[3], alone[0]) and torch.equal(many[7], alone[1])


def test_binding_routes_dense_linears() -> None:
    """A `Linear` bound batch-invariant multiplies through kvshare's fixed-order kernels (row-count
    invariant), bound batched through oneDNN / F.linear (the reference), and rebinding goes back.
    Mutation caught (run): `select` returning `forward_torch` for the batch-invariant choice."""
    gen = torch.Generator().manual_seed(6)
    lin = Linear(77, 45)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(45, 77, generator=gen) * 0.1)
    lin = lin.to(torch.bfloat16).requires_grad_(False)
    lin.pack()
    x = torch.randn(33, 77, generator=gen).to(torch.bfloat16)
    assert lin.impl == lin.forward_torch
    off = lin(x)
    invariant = KernelChoice(batch_invariant=True, gemm=True, native=True)
    lin.bind(invariant)
    assert lin.impl == lin.forward_invariant
    on = lin(x)
    assert torch.equal(on, kernels.linear(x, kernels.pack_bf16(lin.weight)))
    assert torch.equal(lin(x[5:6]), on[5:6])  # row-count invariant through the module
    lin32 = Linear(77, 45).requires_grad_(False)
    lin32.bind(invariant)
    x32 = torch.randn(9, 77, generator=gen)
    assert torch.equal(lin32(x32), kernels.linear(x32, kernels.pack_fp32(lin32.weight)))
    lin.bind(KernelChoice(gemm=True, native=True))
    assert torch.equal(lin(x), off)
