"""`kvshare bench [peer|prefill|sharing|context|bandwidth|spec|prefix|quant|all] [--quick] [size flags]`.

``peer`` also runs ``prefill`` (the released attention sizes) and adds the side-by-side table of
kvshare, transformers and llama.cpp. llama.cpp joins when ``llama-cpp-python`` is installed
(``pip install 'kvshare[llamacpp]'``); its GGUF converter comes from the same pinned sdist,
downloaded once with pip into ``~/.cache/kvshare`` (``--no-fetch`` to never download, or point
``KVSHARE_LLAMACPP_SRC`` at a llama.cpp source tree).

``quant`` (not part of ``all``): the peer V4 model stored with FP8 linears and FP4 experts, kept
packed by kvshare's kernels, against transformers on the dequantised checkpoint, one thread.

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

SECTIONS = ("peer", "prefill", "sharing", "context", "bandwidth", "spec", "prefix", "quant", "all")


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
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-peer", dest="peer", action="store_false", default=True,
                   help="skip transformers in `peer` (kvshare numbers only)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", default=True,
                   help="skip llama.cpp in `peer` / `prefill` (default: run it when llama-cpp-python is installed)")
    p.add_argument("--no-fetch", dest="fetch", action="store_false", default=True,
                   help="never download llama.cpp's GGUF converter (skip llama.cpp when it is not cached)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=True, help="skip the PNG plots")
    add_size_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks; 0 when every section ran (missed targets are reported, not
    failures), 1 when a section failed (the others are still printed and saved)."""
    import importlib.util
    import sys

    from kvshare.bench.suite import BenchOptions, run_suite
    from kvshare.bench.sizes import sizes_from_args

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
        threads=args.threads, peer=args.peer, llamacpp=args.llamacpp, fetch=args.fetch, plots=args.plots,
        out_dir=args.out_dir,
        name=args.name or f"bench-{args.which}{'-quick' if args.quick else ''}", quick=args.quick)
    _, header, _ = run_suite(opts)
    return 1 if header["errors"] else 0
