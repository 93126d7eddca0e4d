"""Run the selected benchmark sections in one process, then print and save the results.

Order: copy bandwidth (machine), peer comparison (V4), prefill at the released attention sizes
(``peer`` runs it too, then the side-by-side peer table of both, bench/peer_summary.py),
sharing on/off and context scaling (V4.1-shaped), DSpark speculation on / off, prefix caching on /
off (V4.1-shaped), achieved bandwidth (from the decode steps measured above). ``quant`` (alone,
not in ``all``): the quantised V4 bench model, FP8 / FP4 weights kept packed (bench/quantised.py). The header records the
date, versions, thread count and the machine's load before and after, because the cores may be
shared with other processes.
"""

from __future__ import annotations

import datetime as _dt
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvshare.bench.bandwidth import bandwidth_section, cache_bytes_per_step, weight_bytes_per_step
from kvshare.bench.kv_runner import DTYPES, build_model, engine_layout
from kvshare.bench.measure import copy_bandwidth, load_note, package_version
from kvshare.bench.report import Section, print_sections, save
from kvshare.bench.sizes import BenchSizes, v41_config
from kvshare.config import ModelConfig


@dataclass
class BenchOptions:
    """What `kvshare bench` was asked to do."""

    which: str
    sizes: BenchSizes
    device: str = "cpu"
    dtype: str = "bfloat16"
    threads: int | None = None
    peer: bool = True
    llamacpp: bool = True
    fetch: bool = True
    plots: bool = True
    out_dir: Path = Path("benchmarks/results")
    name: str = "bench-all"
    quick: bool = False


def choose_threads(requested: int | None) -> int:
    """`requested`, else all cores on an idle machine and one thread when others load it.

    With more runnable threads than cores, torch's worker threads wait on each other at every
    op and a step can take 10x longer; one thread per process degrades gracefully.
    """
    if requested:
        return requested
    note = load_note()
    cores = note["cpu_count"] or 1
    busy = note["loadavg_1m"] == note["loadavg_1m"] and note["loadavg_1m"] > 0.5 * cores
    return 1 if busy else torch.get_num_threads()


def _header(opts: BenchOptions, threads: int) -> dict[str, Any]:
    return {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "kvshare " + " ".join(sys.argv[1:]) if sys.argv and "kvshare" in sys.argv[0] else None,
            "which": opts.which, "quick": opts.quick, "device": opts.device, "dtype": opts.dtype,
            "threads": threads, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": package_version("transformers"), "llama-cpp-python": package_version("llama-cpp-python"),
            "machine": platform.machine(), "load_before": load_note(),
            "sizes": opts.sizes.as_dict()}


def _peer_bandwidth(kv: dict[str, Any], s: BenchSizes) -> list[dict[str, Any]]:
    model, cfg = kv["model"], kv["cfg"]
    out = []
    for b in s.batches:
        res, engine = kv[str(b)]["result"], kv[str(b)]["engine"]
        layout = engine_layout(engine)
        ctx = s.prompt_len + s.new_tokens // 2
        out.append({"label": f"V4 peer model, batch {b}, ctx {ctx}", "step_s": res.decode.median,
                    "weight_bytes": weight_bytes_per_step(model, cfg.n_routed_experts, cfg.num_experts_per_tok, b),
                    "cache_bytes": cache_bytes_per_step(layout.bytes_per_token, layout.state_bytes_per_seq,
                                                        [ctx] * b)})
    return out


def _context_bandwidth(sec: Section, model: torch.nn.Module) -> list[dict[str, Any]]:
    cfg = model.cfg
    w = weight_bytes_per_step(model, cfg.n_routed_experts, cfg.num_experts_per_tok, 1)
    return [{"label": f"V4.1 model, batch 1, ctx {r['context']}", "step_s": r["step_s"], "weight_bytes": w,
             "cache_bytes": cache_bytes_per_step(r["bytes_per_token"], r["state_bytes_per_seq"], [r["context"]])}
            for r in sec.data["rows"]]


def run_suite(opts: BenchOptions) -> tuple[list[Section], dict[str, Any], dict[str, Path]]:
    """Run, print and save; returns (sections, header, written paths)."""
    from kvshare.bench.context import context_section
    from kvshare.bench.peer import peer_section
    from kvshare.bench.sharing import sharing_section

    threads = choose_threads(opts.threads)
    torch.set_num_threads(threads)
    s, w = opts.sizes, opts.which
    header = _header(opts, threads)
    t_start = time.perf_counter()
    sections: list[Section] = []
    copy = copy_bandwidth(s.copy_mib * 2**20, device=opts.device) if w in ("bandwidth", "all") else None
    bw_entries: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    peer_sec: Section | None = None
    if w in ("peer", "all", "bandwidth"):
        t0 = time.perf_counter()
        got = _guard("peer", errors, peer_section, s, dtype=opts.dtype, device=opts.device,
                     with_peer=opts.peer and w != "bandwidth", with_llamacpp=opts.llamacpp and w != "bandwidth",
                     fetch=opts.fetch)
        if got is not None:
            sec, kv = got
            sec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            if w != "bandwidth":
                sections.append(sec)
                peer_sec = sec
            bw_entries += _peer_bandwidth(kv, s)
            del kv
    if w in ("prefill", "peer", "all"):
        from kvshare.bench.prefill import prefill_section

        t0 = time.perf_counter()
        psec = _guard("prefill", errors, prefill_section, s, dtype=opts.dtype, device=opts.device,
                      with_peer=opts.peer, with_llamacpp=opts.llamacpp, fetch=opts.fetch)
        if psec is not None:
            psec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            sections.append(psec)
        if peer_sec is not None:
            from kvshare.bench.peer_summary import summary_section

            sections.append(summary_section(peer_sec, psec, opts.dtype))
    if w in ("sharing", "context", "all", "bandwidth"):
        cfg41 = ModelConfig.from_dict(v41_config(s))
        model41 = build_model(cfg41, s.seed, DTYPES[opts.dtype], opts.device)
        if w in ("sharing", "all"):
            t0 = time.perf_counter()
            ssec = _guard("sharing", errors, sharing_section, s, lambda share: model41, dtype=opts.dtype,
                          device=opts.device)
            if ssec is not None:
                ssec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
                sections.append(ssec)
        if w in ("context", "all", "bandwidth"):
            sizes = s if w != "bandwidth" else s.replace(contexts=(min(s.contexts),))
            t0 = time.perf_counter()
            csec = _guard("context", errors, context_section, sizes, model41, dtype=opts.dtype, device=opts.device)
            if csec is not None:
                csec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
                if w != "bandwidth":
                    sections.append(csec)
                bw_entries += _context_bandwidth(csec, model41)
    if w in ("spec", "all"):
        from kvshare.bench.speculation import speculation_section

        t0 = time.perf_counter()
        spsec = _guard("spec", errors, speculation_section, s, dtype=opts.dtype, device=opts.device)
        if spsec is not None:
            spsec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            sections.append(spsec)
    if w in ("prefix", "all"):
        from kvshare.bench.prefix import prefix_section

        model41p = build_model(ModelConfig.from_dict(v41_config(s)), s.seed, DTYPES[opts.dtype], opts.device)
        t0 = time.perf_counter()
        psec = _guard("prefix", errors, prefix_section, s, model41p, quick=opts.quick, dtype=opts.dtype,
                      device=opts.device)
        if psec is not None:
            psec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            sections.append(psec)
    if w == "quant":  # its own model and copy measure; not part of "all" (it needs the native kernels)
        from kvshare.bench.quantised import quantised_section

        t0 = time.perf_counter()
        qsec = _guard("quant", errors, quantised_section, s, device=opts.device, with_peer=opts.peer)
        if qsec is not None:
            qsec.data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            sections.append(qsec)
    if copy is not None:
        end = copy_bandwidth(s.copy_mib * 2**20, device=opts.device)
        best = max((copy, end), key=lambda c: c["read_gbps"])
        best = {**best, "start_read_gbps": copy["read_gbps"], "end_read_gbps": end["read_gbps"]}
        sections.append(bandwidth_section(best, bw_entries))
    header["errors"] = errors
    header["load_after"] = load_note()
    header["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print_sections(sections, header)
    if not opts.plots:
        for sec in sections:
            sec.plot = None
    paths = save(sections, header, opts.out_dir, opts.name)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for name, err in errors.items():
        print(f"section {name} FAILED: {err}", file=sys.stderr)
    return sections, header, paths


def _guard(name: str, errors: dict[str, str], fn: Any, *args: Any, **kw: Any) -> Any:
    """Run one section; a failure is recorded (and reported) instead of losing the other sections."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - any failure of one section must not lose the others
        import traceback

        errors[name] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        return None
