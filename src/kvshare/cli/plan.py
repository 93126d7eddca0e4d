"""`kvshare plan CONFIG`: per-layer roles and the cache memory plan, as rich tables or JSON.

Every number printed comes from `engine.cache_plan.cache_plan` (the function the engine builds its
pool with) and its `CacheLayout`, for the engine's defaults (quantised formats, bf16) and the flags
given, so the CLI and the engine can never disagree. CONFIG is a config file, a directory with
config.json, or a shipped config name.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from kvshare.cli.arg_types import parse_bytes, positive_int

if TYPE_CHECKING:  # imported when a plan is built, so `kvshare --help` stays fast
    from kvshare.cache.layout import CacheLayout
    from kvshare.topology import LayerPlan





def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="show per-layer cache roles and the memory plan",
                              description=__doc__.splitlines()[0])
    p.add_argument("config", metavar="CONFIG", help="config.json, a directory holding it, or a shipped name")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per cache block (default: the engine's, lcm(64, compress ratios): 64 for V4.1, "
                        "128 for V4)")
    p.add_argument("--kv-format", default=None, help="compressed-KV row format (fp4, fp8, fp8_v4, bf16, fp32)")
    p.add_argument("--index-format", default=None, help="index-K row format (fp4, fp8, bf16, fp32)")
    p.add_argument("--window-format", default=None, help="sliding-window row format (fp8, fp8_v4, bf16, fp32)")
    p.add_argument("--memory", type=parse_bytes, default=None, help="cache memory budget, e.g. 80GiB")
    p.add_argument("--max-seqs", type=positive_int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--no-share", action="store_true", help="plan without cross-layer sharing")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="plan for DSpark speculation with K drafts per step: one slack row per draft in every "
                        "backbone window and compressor ring (default 0: no speculation)")
    p.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=positive_int, default=1,
                   help="show weight, cache and Engram bytes per rank for N tensor-parallel ranks (default 1)")
    p.add_argument("--weight-bytes", type=positive_int, default=2,
                   help="bytes per weight parameter as the engine holds them (default 2: bf16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def _state_text(layout: CacheLayout, layer: int) -> str:
    parts = []
    for s in layout.states:
        if s.layer == layer:
            mult = f"{s.tensors}x" if s.tensors > 1 else ""
            name = {"window": "win", "compressor": "cmp", "indexer_compressor": "icmp"}.get(s.name, s.name)
            parts.append(f"{name} {mult}{s.rows}x{s.row_bytes}")
    return ", ".join(parts)


def _layer_row(p: LayerPlan, layout: CacheLayout) -> dict[str, Any]:
    lr = layout.regions_map[p.layer]
    kv_cache, ik_cache = lr.reads_kv, lr.reads_index
    return {
        "layer": p.layer, "ratio": p.ratio, "role": p.role.value, "draft": p.is_draft,
        "kv_source": p.kv_source, "index_source": p.index_source, "index_k_source": p.index_k_source,
        "kv_cache": kv_cache, "index_k_cache": ik_cache,
        "publishes_candidates": p.publishes_candidates, "uses_candidates": p.uses_candidates,
        "regions": [r.kind for r in layout.regions if r.owner == p.layer],
        "state_bytes": sum(s.nbytes for s in layout.states if s.layer == p.layer),
        "state": _state_text(layout, p.layer),
    }


def engine_args(args: argparse.Namespace) -> Any:
    """The `EngineArgs` an engine started with the plan's flags would get."""
    from kvshare.engine.args import EngineArgs

    formats = (args.kv_format, args.index_format, args.window_format)
    k = getattr(args, "speculative_tokens", 0) or 0
    return EngineArgs(block_size=args.block_size, kv_format=formats if any(formats) else "auto",
                      gpu_memory_bytes=args.memory, max_num_seqs=args.max_seqs, share_kv_cache=not args.no_share,
                      speculative_config={"method": "dspark", "num_speculative_tokens": k} if k else None)


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan as a JSON-able dict; numbers come from `cache_plan` and its CacheLayout."""
    import dataclasses

    from kvshare.cache.checkpoint import checkpoint_bytes, checkpoint_bytes_by_ring
    from kvshare.config import load_config
    from kvshare.engine.cache_plan import cache_plan
    from kvshare.parallel.plan import rank_plan
    from kvshare.topology import Topology

    cfg = load_config(args.config)
    topo = Topology(cfg)
    eargs = engine_args(args)
    cp = cache_plan(cfg, topo, eargs)
    layout = cp.layout
    k = getattr(args, "speculative_tokens", 0) or 0
    plan = {
        "config": str(args.config),
        "arch": cfg.arch,
        "num_layers": cfg.num_hidden_layers,
        "num_draft_layers": cfg.num_draft_layers,
        "roles": topo.summary_counts(),
        "layers": [_layer_row(p, layout) for p in topo.layers],
        "layout": layout.to_dict(args.memory, args.max_seqs),
        "pool": cp.to_dict(),
        "weights": weight_bytes(cfg),
        "tensor_parallel": rank_plan(cfg, getattr(args, "tensor_parallel_size", 1), getattr(args, "weight_bytes", 2)),
        "prefix_checkpoint": {
            "bytes_per_boundary": checkpoint_bytes(layout),
            "bytes_per_boundary_with_draft": checkpoint_bytes(layout, draft=True),
            "by_ring": checkpoint_bytes_by_ring(layout),
        },
    }
    if k:
        plain = cache_plan(cfg, topo, dataclasses.replace(eargs, speculative_config=None)).layout
        plan["speculation"] = {
            "num_speculative_tokens": k,
            "draft_window_bytes_per_seq": sum(s.nbytes for s in layout.states if s.layer >= cfg.num_hidden_layers
                                              and s.name == "window"),
            "slack_bytes_per_seq": layout.state_bytes_per_seq - plain.state_bytes_per_seq,
        }
    return plan


def weight_bytes(cfg: Any) -> dict[str, Any]:
    """Backbone parameters (bf16 bytes as the engine holds them on a GPU) and Engram's bytes in its
    released dtypes: the tables stay in host memory; `wkv` and the gates are among the parameters."""
    from kvshare.config.engram import engram_bytes
    from kvshare.weights.hf_naming import released_shapes

    params = sum(math.prod(s) for s in released_shapes(cfg).values())
    eng = engram_bytes(cfg)
    return {"params": params, "bf16_bytes": 2 * params, "engram_table_bytes": eng["tables"],
            "engram_dense_bytes": eng["dense"], "engram_table_placement": "host" if eng["tables"] else None}


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,.0f} B ({n / size:.2f} {unit})"
    return f"{n:,.0f} B" if float(n).is_integer() else f"{n:,.2f} B"


def _print_rich(plan: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    lay = plan["layout"]
    dash = "-"
    t = Table(title=f"{plan['config']} ({plan['arch']}): layer roles", title_justify="left")
    for col in ("layer", "ratio", "role", "kv src", "index src", "index-K src", "candidates", "owns",
                "state (rings: tensors x rows x bytes)"):
        t.add_column(col, justify="right" if col in ("layer", "ratio") else "left", no_wrap=True)
    for r in plan["layers"]:
        cand = "publishes" if r["publishes_candidates"] else ("consumes" if r["uses_candidates"] else dash)
        kv = dash if r["kv_source"] is None else str(r["kv_source"])
        if r["kv_cache"] is not None and r["kv_cache"] != r["kv_source"]:
            kv += f" (copy in {r['kv_cache']})"
        role = r["role"] + (" (draft)" if r["draft"] else "")
        t.add_row(str(r["layer"]), str(r["ratio"]), role, kv,
                  dash if r["index_source"] is None else str(r["index_source"]),
                  dash if r["index_k_source"] is None else str(r["index_k_source"]),
                  cand, "+".join(r["regions"]) or dash, r["state"])
    console.print(t)

    f = lay["formats"]
    s = Table(title="memory plan", title_justify="left", show_header=False)
    s.add_column("item")
    s.add_column("value")
    s.add_row("layout id", lay["layout_id"])
    s.add_row("formats", f"kv {f['kv']['name']} ({f['kv']['row_bytes']} B), index K {f['index_k']['name']} "
                         f"({f['index_k']['row_bytes']} B), window {f['window']['name']} ({f['window']['row_bytes']} B)")
    s.add_row("block size / alignment", f"{lay['block_size']} tokens / {lay['alignment']} B")
    s.add_row("bytes per block", _fmt_bytes(lay["bytes_per_block"]))
    s.add_row("bytes per token" + ("" if lay["share_cache"] else " (no sharing)"), _fmt_bytes(lay["bytes_per_token"]))
    if lay["payload_bytes_per_token"] != lay["bytes_per_token"]:
        s.add_row("row bytes per token (before padding)", f'{lay["payload_bytes_per_token"]:,.2f} B')
    s.add_row("bytes per token without sharing", _fmt_bytes(lay["unshared_bytes_per_token"]))
    s.add_row("sharing saves", f"{lay['saving_factor']:.2f}x")
    s.add_row("per-sequence state", f"{_fmt_bytes(lay['state_bytes_per_seq'])}: window "
                                    f"{_fmt_bytes(lay['window_bytes_per_seq'])}, compressor "
                                    f"{_fmt_bytes(lay['compressor_bytes_per_seq'])}")
    spec = plan.get("speculation")
    if spec:
        s.add_row(f"speculation ({spec['num_speculative_tokens']} drafts)",
                  f"draft windows {_fmt_bytes(spec['draft_window_bytes_per_seq'])}, ring slack "
                  f"{_fmt_bytes(spec['slack_bytes_per_seq'])} per sequence (included above)")
    ck = plan["prefix_checkpoint"]
    parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in ck["by_ring"].items() if v)
    s.add_row("prefix-cache checkpoint per boundary", f"{_fmt_bytes(ck['bytes_per_boundary'])}: {parts}"
              + ("" if ck["bytes_per_boundary_with_draft"] == ck["bytes_per_boundary"] else
                 f" ({_fmt_bytes(ck['bytes_per_boundary_with_draft'])} with draft layers)"))
    pool = plan["pool"]
    s.add_row("engine pool", f"{pool['num_blocks']:,} blocks of {pool['block_size']} tokens (incl. null block), "
                             f"{_fmt_bytes(pool['total_bytes'])} with {pool['num_slots']} slots' rings; "
                             f"max_model_len {pool['max_model_len']:,}")
    mem = lay.get("memory")
    if mem:
        s.add_row("memory budget", _fmt_bytes(mem["memory_bytes"]))
        s.add_row(f"state of {mem['max_seqs']} sequences", _fmt_bytes(mem["state_bytes_total"]))
        s.add_row("blocks (incl. null block)", f"{mem['blocks']:,}")
        s.add_row("tokens that fit", f"{mem['tokens']:,} (without sharing {mem['unshared_tokens']:,})")
    w = plan["weights"]
    s.add_row("weights (device, bf16)", f"{_fmt_bytes(w['bf16_bytes'])}: {w['params']:,} parameters")
    if w["engram_table_bytes"]:
        s.add_row("Engram tables (host memory)", f"{_fmt_bytes(w['engram_table_bytes'])}: FP8 rows + row scales, "
                                                 "memory-mapped or in RAM (--engram-table)")
        s.add_row("Engram wkv + gates (released dtypes)", _fmt_bytes(w["engram_dense_bytes"]))
    console.print(s)

    r = Table(title="regions inside one block", title_justify="left")
    for col in ("owner", "kind", "offset", "end", "rows", "row bytes"):
        r.add_column(col, justify="left" if col == "kind" else "right")
    for reg in lay["regions"]:
        r.add_row(str(reg["owner"]), reg["kind"], f"{reg['offset']:,}", f"{reg['end']:,}", str(reg["rows"]),
                  str(reg["row_bytes"]))
    console.print(r)
    if plan["tensor_parallel"]["size"] > 1:
        _print_ranks(console, plan)


def _print_ranks(console: Any, plan: dict[str, Any]) -> None:
    from rich.table import Table

    tp, lay = plan["tensor_parallel"], plan["layout"]
    t = Table(title=f"per rank, tensor parallel x{tp['size']} (weights at {tp['bytes_per_param']} B/param; "
                    "caches replicated on every rank)", title_justify="left")
    for col in ("rank", "weight params", "weight bytes", "cache bytes per token", "state per sequence",
                "Engram tables (host, own hash columns)"):
        t.add_column(col, justify="right")
    for r in tp["ranks"]:
        t.add_row(str(r["rank"]), f"{r['weight_params']:,}", _fmt_bytes(r["weight_bytes"]),
                  _fmt_bytes(lay["bytes_per_token"]), _fmt_bytes(lay["state_bytes_per_seq"]),
                  _fmt_bytes(r["engram_table_bytes"]))
    console.print(t)


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.json:
        json.dump(plan, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_rich(plan)
    return 0
