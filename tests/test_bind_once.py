"""A model chooses its kernels once, when it is bound (`kvshare.layers`), never per forward.

* `switches.from_env` turns the ``KVSHARE_*`` switches into `KernelChoice` overrides and `resolve`
  gives the choice for a model's dtype and device (the one reader of the environment).
* A bound model keeps its implementations whatever the process switches say later: flipping
  ``KVSHARE_NATIVE_MHC`` after the bind changes no forward; rebinding does.
* A float64 model binds without the native kernels even when asked for them: a forward whose
  kernels are made to fail runs. (Mutation caught, run: `Transformer.bind` without that check.)

Mutations caught (run): `from_env` ignoring the value "0" (the from_env test); `Mhc.select`
ignoring ``choice.fused_mhc`` (the rebinding test: the fused calls continue after the rebind).
"""

from __future__ import annotations

import pytest
import torch

from kvshare import kernels
from kvshare.kernels import decode as native
from kvshare.kernels import mhc as fused
from kvshare.layers import KernelChoice, switches
from kvshare.layers.mhc import FusedMhc, NativeMhc

CPU = torch.device("cpu")


def test_from_env_reads_each_switch() -> None:
    assert switches.from_env({}) == {}
    assert switches.from_env({"KVSHARE_NATIVE_MHC": "off", "KVSHARE_NATIVE_ATTENTION": "0",
                              "KVSHARE_NATIVE_ATTN_PROJ": "on"}) == {"fused_mhc": False, "attention": False}
    assert switches.from_env({"KVSHARE_KERNELS": "torch"}) == {"gemm": False}
    assert switches.from_env({"KVSHARE_NATIVE_DECODE": " OFF "}) == {"native": False}


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_resolve_gives_the_choice_for_the_model() -> None:
    full = switches.resolve(True, CPU, torch.bfloat16)
    assert full == KernelChoice(True, True, True, True, True, True)
    no_mhc = switches.resolve(True, CPU, torch.bfloat16, overrides=switches.from_env({"KVSHARE_NATIVE_MHC": "off"}))
    assert no_mhc == full.with_(fused_mhc=False) and no_mhc.native
    no_decode = switches.resolve(False, CPU, torch.float32, overrides={"native": False})
    assert no_decode == KernelChoice(gemm=True)  # the packed GEMMs stay; everything that needs native goes
    assert switches.resolve(True, CPU, torch.float64) == KernelChoice(batch_invariant=True)
    assert switches.resolve(False, CPU, torch.bfloat16, "torch") == KernelChoice.reference()
    with pytest.raises(ValueError, match="kernels='native' needs a bf16 / fp32 model"):
        switches.resolve(False, CPU, torch.float64, "native")
    with pytest.raises(ValueError, match="unknown kernel override 'mhc'"):
        switches.resolve(False, CPU, torch.float32, overrides={"mhc": False})
    with pytest.raises(ValueError, match="kernels must be"):
        switches.resolve(False, CPU, torch.float32, "fast")


def _decode(model, steps: int = 3) -> list[torch.Tensor]:
    from kvshare.cache.dense import DenseCache
    from kvshare.step import StepBatch

    cache = DenseCache(model.cfg, model.topo, 1, 24, dtype=model.embed.weight.dtype)
    ids, out = list(range(3, 12)), []
    with torch.inference_mode():
        for i in range(steps):
            start = 0 if i == 0 else 9 + i - 1
            x = model(torch.tensor(ids), StepBatch.build([start], [len(ids)], [0]), cache)
            out.append(x[-1])
            ids = [int(x[-1].argmax())]
    return out


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_a_bound_model_keeps_its_choice_until_rebound(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshare.config import load_config
    from kvshare.model import Transformer

    model = Transformer(load_config("tiny-v41"), quant=False).init_weights(2).eval().to(torch.bfloat16)
    model.bind(switches.resolve(True, CPU, torch.bfloat16))
    assert all(type(b.mhc.impl) is FusedMhc for b in model.layers)
    calls = []
    real = fused.boundary
    monkeypatch.setattr(fused, "boundary", lambda *a: calls.append(1) or real(*a))
    want = _decode(model)
    assert len(calls) == 3 * model.cfg.num_hidden_layers
    monkeypatch.setenv("KVSHARE_NATIVE_MHC", "off")  # read only when a model is bound
    assert torch.equal(torch.stack(_decode(model)), torch.stack(want))
    assert len(calls) == 6 * model.cfg.num_hidden_layers  # still the fused calls: no per-call decision
    model.bind(switches.resolve(True, CPU, torch.bfloat16, overrides=switches.from_env()))
    assert all(type(b.mhc.impl) is NativeMhc for b in model.layers)
    assert torch.equal(torch.stack(_decode(model)), torch.stack(want))  # the unfused calls: the same bits
    assert len(calls) == 6 * model.cfg.num_hidden_layers


def test_a_float64_model_forward_never_reaches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float64 model binds without the native kernels (`Transformer.bind`): an engine forward whose
    native kernels are made to fail still runs."""
    from kvshare.bench.kv_runner import build_model, greedy, make_engine
    from kvshare.bench.sizes import QUICK, peer_v4_config
    from kvshare.config import ModelConfig
    from kvshare.kernels import moe as native_moe

    def boom(*a, **k):
        raise AssertionError("a native kernel ran in a float64 forward")

    for name in ("rms_norm", "rope", "mhc_post", "mhc_collapse", "mhc_expand", "swiglu", "moe_combine",
                 "moe_route", "moe_gate", "sparse_attention", "compress_pool", "fake_quant_fp8"):
        monkeypatch.setattr(native, name, boom)
    for name in ("enter", "boundary", "leave", "head"):
        monkeypatch.setattr(fused, name, boom)
    monkeypatch.setattr(native_moe, "experts", boom)  # the one-call MoE experts
    model = build_model(ModelConfig.from_dict(peer_v4_config(QUICK)), 0, torch.float64)
    eng = make_engine(model, batch=1, max_len=40, block_size=128, dtype="float64", device="cpu")
    model.bind(KernelChoice(True, True, True, True, True, True))  # asked for every native kernel ...
    assert model.kernels.native and not model.bound.native  # ... a float64 model binds without them
    eng.add_request("a", list(range(1, 20)), greedy(3))
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [(o.finish_reason, o.error, len(o.token_ids)) for o in finished] == [("length", None, 3)]
