"""The native kernels as torch ops (csrc/*: ``TORCH_LIBRARY_FRAGMENT(kvshare, ...)``, kernels/fake_ops.py).

1. ``torch.ops.kvshare`` holds exactly the ops listed here (`CASES` covers each, `cpu_has` aside).
2. `torch.library.opcheck` passes on every op with small representative inputs: the schema states
   every mutation (and nothing else is mutated), the fake (meta) implementation gives the real
   output's shapes, dtypes and strides, and the op traced by AOT autograd (dynamic shapes) gives the
   eager output. The pack-set ops (`attn_in`, `attn_out`, `index_select`, `moe_experts`) take a
   registered set by id, which opcheck's copies of the arguments do not reach: the set stays fresh
   (a stale one returns an empty list, which a fake cannot foresee).
3. The pack-set registry (`pack_set_new` / `pack_set_free`, csrc/pack_set.h) is a side effect on the
   library, never traced (`kernels.pack_sets.RegisteredSet` is compiler-disabled), so it has no fake
   and no opcheck case; `test_pack_sets_register_use_and_free` checks its contract instead.

Mutation caught (run on a copy of the tree; see the report of issue 34 item 4): the fake of `mhc_head`
returning h's shape [T, hc, D] instead of [T, D]: ``test_opcheck[mhc_head]`` fails in test_faketensor
("Shapes torch.Size([3, 16]) and torch.Size([3, 4, 16]) are not equal"), the 42 other tests pass.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch.library import opcheck

from kernel_data import e4m3_codes, pow2_scales
from kvshare.kernels import attn_proj, pack_bf16, pack_fp8, pack_fp32, supported_isas
from kvshare.kernels import decode as native
from kvshare.kernels import moe as native_moe
from kvshare.kernels.build import best_isa

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable (torch path only)")

Args = tuple[tuple, dict]
BF = torch.bfloat16


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _bf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(BF)


def _f(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


GEN = _g()
ISA = best_isa()
#: the registered pack sets of the cases (a set is freed when its `RegisteredSet` is collected)
KEEP_SETS: list = []


def _rope_tables(t: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(t, rd // 2, generator=GEN) * 6.28
    return a.cos().repeat_interleave(2, 1).contiguous(), a.sin().repeat_interleave(2, 1).contiguous()


def _gemm() -> Args:
    p = pack_bf16(_f(20, 41))
    return (_bf(3, 41), p.data, p.exps, 0, p.n, p.k, p.kp, p.block, ISA, False), {}


def _gemm_fp8_totals() -> Args:
    p = pack_fp8(e4m3_codes(40, 256, GEN), pow2_scales((1, 2), GEN), (128, 128))
    return (_bf(5, 256), p.data, p.exps, 2, p.n, p.k, p.kp, p.block, ISA, True), {}


def _project_wide() -> Args:
    p = pack_fp32(_f(24, 32))
    return (_bf(3, 32), p.data, p.exps, p.n, p.k, ISA, _f(4, 8), torch.tensor([0, 5, 2]), 8), {}


def _rope() -> Args:
    c, s = _rope_tables(3, 8)
    return (_bf(3, 2, 16), c, s), {}


def _mhc(t: int = 3, hc: int = 4, d: int = 16) -> dict:
    return dict(h=_bf(t, hc, d), fn=pack_fp32(_f((2 + hc) * hc, hc * d) / 8).data, base=_f((2 + hc) * hc),
                scale=_f(3), norm_w=_f(d), post=torch.rand(t, hc, generator=GEN),
                comb=torch.rand(t, hc, hc, generator=GEN), y=_bf(t, d), pre=torch.rand(t, hc, generator=GEN))


def _mhc_enter() -> Args:
    m = _mhc()
    return (m["h"], m["fn"], m["base"], m["scale"], m["pre"], m["norm_w"], 1e-6, 1e-6, 1e-6, 3, ISA), {}


def _mhc_boundary() -> Args:
    m = _mhc()
    return (m["h"], m["y"], m["post"], m["comb"], m["fn"], m["base"], m["scale"], None, m["norm_w"], 1e-6, 1e-6, 1e-6,
            3, ISA), {}


def _mhc_head() -> Args:
    m = _mhc()
    fn = pack_fp32(_f(4, 64) / 8).data
    return (m["h"], fn, _f(4), _f(1), None, m["norm_w"], 1e-6, 1e-6, 1e-6, ISA), {}


def _ring_rows(slots: int, rows: int, d: int) -> torch.Tensor:
    return _bf(slots, rows, d).view(torch.uint8)  # bf16 rows stored as bytes


def _paged_attention() -> Args:
    t, h, d = 2, 2, 16
    meta = torch.tensor([[0, 5, 4, 0], [1, 3, 3, 2]])  # (slot, pos, chunk start, first step row)
    pool, tables = _ring_rows(3, 4, d), torch.tensor([[0, 2], [1, 0]])
    return (_bf(t, h, d), _ring_rows(2, 4, d), _bf(3, d), meta, 4, pool, tables, torch.tensor([0, 1]), None,
            torch.tensor([5, 8]), 1, 4, _f(h), 0.25, [-1, 0, 0, -1, 0, 0]), {}


def _index_topk() -> Args:
    t, h, d = 3, 2, 16
    return (_f(t, h, d), _f(t, h), _f(2, 7, d), False, None, torch.tensor([0, 1, 1]), torch.tensor([7, 3, 0]), 1, 1,
            4), {}


def _proj_set(linears: list, fp32: bool = False) -> attn_proj.ProjPacks:
    p = attn_proj.pack_set([(pack_fp32 if fp32 else pack_bf16)(w) for w in linears], [])
    assert p is not None
    KEEP_SETS.append(p)
    return p


def _index_select() -> Args:
    t, rank, dim, h, d = 3, 16, 32, 2, 16
    p = _proj_set([_f(h * d, rank), _f(h, dim)])
    c, s = _rope_tables(t, 8)
    return (_bf(t, rank), _bf(t, dim), p.registered.id, c, s, h, 0.5, 0, ISA, _f(2, 7, d), False, None, torch.tensor([0, 1, 1]), torch.tensor([7, 3, 0]), 1, 1, 4), {}


def _attn_packs(fp32: bool) -> attn_proj.ProjPacks:
    dim, rank, h, d, groups, o_rank = 32, 16, 2, 16, 2, 8  # wq_a, wq_b, wkv, wo_a groups, wo_b
    return _proj_set([_f(rank, dim), _f(h * d, rank), _f(d, dim), _f(o_rank, h * d // groups),
                      _f(o_rank, h * d // groups), _f(dim, groups * o_rank)], fp32)


def _attn_in() -> Args:
    p = _attn_packs(False)
    c, s = _rope_tables(3, 8)
    return (_bf(3, 32), p.registered.id, _f(16), _f(16), 1e-6, c, s, 2, True, 16, 16, ISA), {}


def _attn_out() -> Args:
    p = _attn_packs(True)
    c, s = _rope_tables(3, 8)
    return (_f(3, 2, 16), p.registered.id, c, -s, 0, p.out_dim, ISA), {}


def _moe_experts() -> Args:
    e, dim, inter = 2, 32, 16
    lin = [(pack_bf16(w), w) for _ in range(e + 1) for w in (_f(inter, dim), _f(inter, dim), _f(dim, inter))]
    p = native_moe.pack_set(lin)
    assert p is not None
    KEEP_SETS.append(p)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    return (_bf(3, dim), ids, torch.rand(3, 2, generator=GEN), p.registered.id, 7.0, 16, 16, ISA), {}


def _moe_gate(given: bool) -> Callable[[], Args]:
    def make() -> Args:
        p = pack_fp32(_f(6, 32))
        ids = torch.tensor([[0, 5], [3, 2], [1, 1]]) if given else None
        return (_bf(3, 32), p.data, p.exps, p.n, p.k, ISA, _f(6), 2, "sqrtsoftplus", 1.5, True, 2.5, ids), {}
    return make


def _pack_rows(scheme: int) -> Callable[[], Args]:
    def make() -> Args:
        from kvshare.cache import formats

        kind, name, arch = {0: ("kv", "fp4", "v41"), 1: ("index_k", "fp4", "v41"), 2: ("window", "fp8_v41", "v41"),
                            3: ("window", "fp8_v4", "v4")}[scheme]
        f = formats.row_format(kind, name, 64, arch=arch, rope_dim=16 if arch == "v4" else 0)
        return (_bf(3, 64), scheme, f.block, f.rope_dim, f.row_bytes), {}
    return make


def _unpack_rows(scheme: int) -> Callable[[], Args]:
    def make() -> Args:
        (x, s, block, rd, row_bytes), _ = _pack_rows(scheme)()
        u8 = torch.ops.kvshare.pack_rows(x, s, block, rd, row_bytes)
        return (u8, s, block, 64, rd, torch.float32), {}
    return make


def _ring_store() -> Args:
    rings = [torch.zeros(2, 4, 8, dtype=BF), torch.zeros(3, 4, 16, dtype=torch.uint8)]
    values = [_bf(3, 8), torch.randint(0, 255, (3, 16), dtype=torch.uint8, generator=GEN)]
    return (rings, values, torch.tensor([0, 2]), torch.tensor([1, 0]), torch.tensor([3, 1])), {}


#: (case id, op, inputs); every op of torch.ops.kvshare but `cpu_has` has at least one case
CASES: list[tuple[str, str, Callable[[], Args]]] = [
    ("gemm_bf16", "gemm", _gemm),
    ("gemm_fp8_fp32_totals", "gemm", _gemm_fp8_totals),
    ("project_wide", "project_wide", _project_wide),
    ("fake_quant_fp8", "fake_quant_fp8", lambda: ((_bf(3, 64), 32), {})),
    ("rope", "rope", _rope),
    ("rope_", "rope_", _rope),
    ("compress_pool", "compress_pool",
     lambda: ((_f(3, 4, 32), torch.tensor([[1, 1, 0, 1]] * 3, dtype=torch.bool), 8, True, BF), {})),
    ("sparse_attention", "sparse_attention",
     lambda: ((_bf(2, 2, 16), _bf(2, 3, 16), torch.ones(2, 3, dtype=torch.bool), _bf(2, 2, 16),
               torch.tensor([[True, False]] * 2), _f(2), 0.25), {})),
    ("rms_norm", "rms_norm", lambda: ((_bf(3, 40), _f(40), 1e-6, torch.float32), {})),
    ("swiglu", "swiglu", lambda: ((_bf(4, 16), _bf(4, 16), _f(4), 7.0), {})),
    ("moe_combine", "moe_combine", lambda: ((_bf(2 * 2 + 2, 16), torch.tensor([1, 0, 3, 2]), 2, 2), {})),
    ("moe_route", "moe_route", lambda: ((_f(3, 8), _f(8), 2, "sigmoid"), {})),
    ("moe_gate", "moe_gate", _moe_gate(False)),
    ("moe_gate_hash", "moe_gate", _moe_gate(True)),
    ("mhc_post", "mhc_post", lambda: ((_f(3, 24), _f(24), _f(3), 4, 1e-6, 3), {})),
    ("sinkhorn_", "sinkhorn_", lambda: ((torch.rand(3, 4, 4, generator=GEN) + 0.1, 1e-6, 3), {})),
    ("mhc_collapse", "mhc_collapse", lambda: ((_mhc()["h"], _mhc()["pre"]), {})),
    ("mhc_expand", "mhc_expand", lambda: ((lambda m: (m["h"], m["y"], m["post"], m["comb"]))(_mhc()), {})),
    ("mhc_leave", "mhc_leave", lambda: ((lambda m: (m["h"], m["y"], m["post"], m["comb"]))(_mhc()), {})),
    ("mhc_enter", "mhc_enter", _mhc_enter),
    ("mhc_boundary", "mhc_boundary", _mhc_boundary),
    ("mhc_head", "mhc_head", _mhc_head),
    ("paged_attention", "paged_attention", _paged_attention),
    ("index_topk", "index_topk", _index_topk),
    ("index_select", "index_select", _index_select),
    ("attn_in", "attn_in", _attn_in),
    ("attn_out", "attn_out", _attn_out),
    ("moe_experts", "moe_experts", _moe_experts),
    ("fake_quant_fp4_ue8m0", "fake_quant_fp4", lambda: ((_bf(3, 64), 32, True), {})),
    ("fake_quant_fp4_e4m3", "fake_quant_fp4", lambda: ((_f(3, 64), 16, False), {})),
    *[(f"pack_rows_{s}", "pack_rows", _pack_rows(s)) for s in range(4)],
    *[(f"unpack_rows_{s}", "unpack_rows", _unpack_rows(s)) for s in range(4)],
    ("ring_store", "ring_store", _ring_store),
]

def _registered() -> set[str]:
    return {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kvshare::")}


def test_every_native_op_is_registered_and_covered() -> None:
    ops = _registered()
    untraced = {"cpu_has", "pack_set_new", "pack_set_free"}
    assert ops == {op for _, op, _ in CASES} | untraced, ops ^ ({op for _, op, _ in CASES} | untraced)
    for op in ops:
        schema = getattr(torch.ops.kvshare, op).default._schema
        assert str(schema).startswith(f"kvshare::{op}("), schema
    assert torch.ops.kvshare.cpu_has("avx2") == ("avx2" in supported_isas())
    assert torch.ops.kvshare.cpu_has("no such feature") is False


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_opcheck(case: tuple[str, str, Callable[[], Args]]) -> None:
    _, name, make = case
    args, _ = make()
    op = getattr(torch.ops.kvshare, name).default
    with torch.no_grad():
        eager = op(*_clone(args))  # the inputs are valid: the op runs
    assert eager is None or isinstance(eager, (torch.Tensor, tuple, list))
    opcheck(op, args)  # every default utility: schema, autograd registration, fake, AOT dispatch


def test_pack_sets_register_use_and_free() -> None:
    """A registered set serves calls until freed (then a call names the missing set); a watched tensor
    edited in place makes the calls return nothing (stale); freeing twice is harmless."""
    w = _f(16, 16)  # wq_b: 1 head of 16 from a rank-16 qr; weights_proj: 1 head from 32
    p = attn_proj.pack_set([pack_bf16(w), pack_bf16(_f(1, 32))], [w])
    assert p is not None
    set_id = p.registered.id
    c, s = _rope_tables(3, 8)

    def select() -> list:
        return torch.ops.kvshare.index_select(_bf(3, 16), _bf(3, 32), set_id, c, s, 1, 0.5, 0, ISA, _f(2, 7, 16),
                                              False, None, torch.tensor([0, 1, 1]), torch.tensor([7, 3, 0]), 1, 1, 4)

    assert len(select()) == 1
    with torch.no_grad():
        w.mul_(1.0)  # the same values, a new in-place version: the set no longer matches its weights
    assert select() == []
    del p.registered  # the last reference: the set is freed
    with pytest.raises(RuntimeError, match=f"no pack set {set_id}"):
        select()
    torch.ops.kvshare.pack_set_free(set_id)


def _clone(args: tuple) -> tuple:
    def one(a):  # noqa: ANN001, ANN202
        return a.clone() if isinstance(a, torch.Tensor) else a

    return tuple([one(t) for t in a] if isinstance(a, list) else one(a) for a in args)


def test_mutating_ops_write_their_declared_argument() -> None:
    """The ops that declare ``(a!)`` do write there (rope_ = rope, sinkhorn_ changes comb, ring_store the rings)."""
    (x, c, s), _ = _rope()
    want = torch.ops.kvshare.rope(x, c, s)
    torch.ops.kvshare.rope_(x, c, s)
    assert torch.equal(x, want)
    (rings, values, tokens, slot, row), _ = _ring_store()
    torch.ops.kvshare.ring_store(rings, values, tokens, slot, row)
    assert torch.equal(rings[0][1, 3], values[0][0]) and torch.equal(rings[1][0, 1], values[1][2])


def test_a_build_says_when_it_starts_and_ends(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Issue 35 item 6: the first run of an install compiles for minutes; it prints one line to stderr when
    the build starts and one, with its time, when it ends (a load of a built library prints nothing)."""
    import torch.utils.cpp_extension as ext

    from kvshare.kernels import build

    calls = []
    monkeypatch.setattr(ext, "load", lambda **kw: calls.append(kw["is_python_module"]))  # the library is loaded
    monkeypatch.setattr(build, "_load_built", lambda *a: None)
    build.library.cache_clear()
    try:
        assert build.library() is torch.ops.kvshare and calls == [False]
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and "building the native kernels" in err[0], err
        assert err[1].startswith("kvshare: native kernels built in ") and err[1].endswith(" s"), err
        monkeypatch.undo()
        build.library.cache_clear()
        assert build.library() is torch.ops.kvshare and capsys.readouterr().err == ""  # built: no message
    finally:
        build.library.cache_clear()
