"""`kernels.decode.forward_scope`: a model forward decides once whether the native kernels serve it."""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels import decode as native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable")


def test_scope_answers_from_the_model_dtype_and_restores_on_exit() -> None:
    f64 = torch.zeros(2, dtype=torch.float64)
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    with torch.no_grad():
        assert native.serves(bf16) and not native.serves(f64)  # per-tensor checks outside a scope
        with native.forward_scope(torch.float64, torch.device("cpu")):
            assert not native.serves(bf16)  # a float64 model's forward runs the torch path throughout
            assert not native.attention_enabled()
            with native.forward_scope(torch.bfloat16, torch.device("cpu")):
                assert native.serves(f64) is True  # the scope's answer, no per-tensor checks
            assert not native.serves(bf16)  # the outer answer is back
        assert native.serves(bf16) and not native.serves(f64)


def test_scope_decides_nothing_while_autograd_records() -> None:
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad(), native.forward_scope(torch.float32, torch.device("cpu")):
        assert not native.serves(x)  # the tensor's own requires_grad is checked
        assert native.serves(x.detach())


def test_a_float64_model_forward_never_reaches_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scope's answer for a float64 model is False: a forward whose native kernels are made to
    fail still runs (mutation: the scope answering True for every dtype fails here)."""
    from kvshare.bench.kv_runner import build_model, make_engine, greedy
    from kvshare.bench.sizes import QUICK, peer_v4_config
    from kvshare.config import ModelConfig

    def boom(*a, **k):
        raise AssertionError("a native kernel ran in a float64 forward")

    for name in ("rms_norm", "rope", "mhc_post", "mhc_collapse", "mhc_expand", "swiglu", "moe_combine",
                 "moe_route", "sparse_attention", "compress_pool"):
        monkeypatch.setattr(native, name, boom)
    from kvshare.kernels import moe as native_moe

    monkeypatch.setattr(native_moe, "experts", boom)  # the one-call MoE experts
    model = build_model(ModelConfig.from_dict(peer_v4_config(QUICK)), 0, torch.float64)
    eng = make_engine(model, batch=1, max_len=40, block_size=128, dtype="float64", device="cpu")
    model.batch_invariant = True  # the native kernels serve only batch-invariant forwards
    eng.add_request("a", list(range(1, 20)), greedy(3))
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [(o.finish_reason, o.error, len(o.token_ids)) for o in finished] == [("length", None, 3)]


def test_registered_switches_are_decided_once_per_forward() -> None:
    """`kernels.mhc` registers its switch (`scoped_switch`): inside a scope
    `enabled()` answers what was decided at entry (the switch flipped inside does not change it; the
    next forward sees it), a float64 model's scope says False, and outside a scope the switch is
    asked. Mutation caught: the scope storing the switches without the `on` of the forward (the
    float64 scope then answers True)."""
    from kvshare.kernels import mhc

    with torch.no_grad():
        for mod in (mhc,):
            try:
                with native.forward_scope(torch.bfloat16, torch.device("cpu")):
                    assert mod.enabled()
                    mod.set_enabled(False)
                    assert mod.enabled()  # decided at the forward's entry
                assert not mod.enabled()  # outside a scope: the switch itself
                with native.forward_scope(torch.bfloat16, torch.device("cpu")):
                    assert not mod.enabled()
                mod.set_enabled(None)
                with native.forward_scope(torch.float64, torch.device("cpu")):
                    assert not mod.enabled()
                assert mod.enabled()
            finally:
                mod.set_enabled(None)
