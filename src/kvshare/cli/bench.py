"""`kvshare bench [peer|prefill|sharing|context|bandwidth|spec|prefix|quant|real|all] [--quick] [size flags]`.

``peer`` also runs ``prefill`` (the released attention sizes) and adds the side-by-side table of
kvshare, transformers and llama.cpp. llama.cpp joins when ``llama-cpp-python`` is installed
(``pip install 'kvshare[llamacpp]'``); its GGUF converter comes from the same pinned sdist,
downloaded once with pip into ``~/.cache/kvshare`` (``--no-fetch`` to never download, or point
``KVSHARE_LLAMACPP_SRC`` at a llama.cpp source tree).

``quant`` (not part of ``all``): the peer V4 model stored with FP8 linears and FP4 experts, kept
packed by kvshare's kernels, against transformers on the dequantised checkpoint, one thread.

``real`` (not part of ``all``; minutes): a checkpoint in the release's formats (FP4 experts, FP8
linears) at a named model's real per-layer sizes (``--model v4-flash|v4.1-flash``, ``--layers``,
``--experts``; default V4-Flash with 4 layers and 32 experts, 2.6 GB), written (or reused with
``--checkpoint DIR``) and run by kvshare and by llama.cpp (V4 only; its converter makes MXFP4
experts and Q8_0 from the FP8 linears): load time, MB/s and peak memory, decode batch 1 and 4,
prefill of ``--prefill-len`` tokens at each of ``--threads 1,2,..`` (default 1..cores), and the
weight bytes per decode token over the copy bandwidth, with issue 37's targets. Of the size
flags it reads ``--experts``, ``--vocab`` (8192), ``--prompt-len`` (32), ``--new-tokens`` (16),
``--repeats`` (3), ``--copy-mib`` (512) and ``--seed``, with those defaults.

Runs the chosen benchmarks in this one process, prints their tables (with ratios against the
transformers peer measured in the same run), and writes JSON, a markdown table and PNG plots to
``--out-dir`` (default ``bench-results``, so a run from the repository never overwrites the
committed ``benchmarks/results``). Without matplotlib the plots are skipped, without
transformers the peer comparison (both come with ``pip install 'kvshare[bench]'``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvshare.bench.sizes import add_size_flags
from kvshare.cli.arg_types import positive_int

SECTIONS = ("peer", "prefill", "sharing", "context", "bandwidth", "spec", "prefix", "quant", "real", "all")


def thread_counts(text: str) -> tuple[int, ...]:
    """'2' or '1,2,4': positive thread counts."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected thread counts like 1,2,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be positive integers, got {text!r}")
    return counts


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = subparsers.add_parser(
        "bench", help="measure kvshare against transformers, sharing on/off, context scaling, bandwidth, "
                                  "prefix caching on/off",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="all", choices=SECTIONS, help="benchmark to run (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run of a few seconds)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"),
                   help="where JSON, markdown and plots go (default: bench-results; the committed results "
                        "were written with --out-dir benchmarks/results)")
    p.add_argument("--name", default=None,
                   help="file stem of the outputs (default: bench-<which>[-quick])")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="weights of both engines (default: bfloat16, the engine's default; kvshare keeps "
                        "norms, router, mHC and sinks in fp32)")
    p.add_argument("--threads", type=thread_counts, default=None, metavar="N[,N..]",
                   help="torch intra-op threads (default: torch's); `real` takes a list (default 1..cores)")
    p.add_argument("--no-peer", dest="peer", action="store_false", default=True,
                   help="skip transformers in `peer` (kvshare numbers only)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", default=True,
                   help="skip llama.cpp in `peer` / `prefill` / `real` (default: run it when llama-cpp-python is installed)")
    p.add_argument("--no-fetch", dest="fetch", action="store_false", default=True,
                   help="never download llama.cpp's GGUF converter (skip llama.cpp when it is not cached)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=True, help="skip the PNG plots")
    g = p.add_argument_group("real (kvshare bench real)")
    g.add_argument("--model", default="v4-flash", choices=["v4-flash", "v4.1-flash"],
                   help="whose real per-layer sizes (default: v4-flash)")
    g.add_argument("--layers", type=positive_int, default=None, help="layers (default: 4 for v4-flash, 6 for v4.1-flash)")
    g.add_argument("--checkpoint", type=Path, default=None,
                   help="reuse the checkpoint in DIR (written there first when it holds none; "
                        "default: a temporary directory)")
    g.add_argument("--prefill-len", type=positive_int, default=512, help="prefill prompt tokens (default: 512)")
    add_size_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; 0 when every section ran (missed targets are reported, not
    failures), 1 when a section failed (the others are still printed and saved)."""
    import importlib.util
    import sys

    from kvshare.bench.suite import BenchOptions, run_suite
    from kvshare.bench.sizes import sizes_from_args

    if args.which == "real":
        return run_real(args)
    if args.threads is not None and len(args.threads) > 1:
        print(f"kvshare bench {args.which}: --threads takes one count (a list is for `real`)", file=sys.stderr)
        return 2

    if args.plots and importlib.util.find_spec("matplotlib") is None:
        print("note: matplotlib is not installed, so no plots (pip install 'kvshare[bench]')", file=sys.stderr)
        args.plots = False
    if args.peer and args.which in ("peer", "quant", "all") and importlib.util.find_spec("transformers") is None:
        print("note: transformers is not installed, so kvshare runs without its peer "
              "(pip install 'kvshare[bench]')", file=sys.stderr)
        args.peer = False
    if args.llamacpp and args.which in ("peer", "prefill", "all"):
        from kvshare.bench.llamacpp_files import binding_available

        reason = binding_available()
        if reason is not None:
            print(f"note: {reason}, so llama.cpp is skipped", file=sys.stderr)

    opts = BenchOptions(
        which=args.which, sizes=sizes_from_args(args), device=args.device, dtype=args.dtype,
        threads=args.threads[0] if args.threads else None, peer=args.peer, llamacpp=args.llamacpp, fetch=args.fetch, plots=args.plots,
        out_dir=args.out_dir,
        name=args.name or f"bench-{args.which}{'-quick' if args.quick else ''}", quick=args.quick)
    _, header, _ = run_suite(opts)
    return 1 if header["errors"] else 0


def run_real(args: argparse.Namespace) -> int:
    """`kvshare bench real` (bench/real.py); 0 when it ran (missed targets are reported, not failures)."""
    import sys

    from kvshare.bench.real import RealOptions, run_real as run

    opts = RealOptions(
        model=args.model, layers=args.layers, experts=args.experts, threads=args.threads or (),
        checkpoint=args.checkpoint, llamacpp=args.llamacpp, fetch=args.fetch, out_dir=args.out_dir,
        name=args.name or "bench-real",
        **{k: getattr(args, k) for k in ("vocab", "prompt_len", "new_tokens", "prefill_len", "repeats", "copy_mib",
                                          "seed") if getattr(args, k, None) is not None})
    try:
        run(opts)
    except ValueError as e:
        print(f"kvshare bench real: {e}", file=sys.stderr)
        return 2
    return 0
