"""`kvshare convert --to transformers|released SRC DST`: rewrite a checkpoint for transformers or for kvshare.

SRC is a directory holding config.json and safetensors weights in any naming kvshare reads (DeepSeek's
released names, transformers' in-memory names, or what transformers' `save_pretrained` writes).
``--to transformers`` writes a DeepSeek-V4 checkpoint that transformers 5.23
`DeepseekV4ForCausalLM.from_pretrained` loads (its config.json, the names `save_pretrained` writes);
``--to released`` writes kvshare's own format (DeepSeek's released names). FP8 / FP4 weights are
written dequantised; draft (mtp) and vision tensors are not written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvshare.cli.arg_types import parse_bytes

TARGETS = ("transformers", "released")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `convert` subcommand."""
    p = subparsers.add_parser("convert", help="rewrite a checkpoint in transformers' or DeepSeek's naming",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", required=True, choices=TARGETS, help="naming and config format to write")
    p.add_argument("src", metavar="SRC", type=Path, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", type=Path, help="output directory (created; must hold no weights)")
    p.add_argument("--shard-size", type=parse_bytes, default=None,
                   help="largest shard, e.g. 5GB (default: one model.safetensors)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvshare.config import load_config
    from kvshare.errors import CheckpointError
    from kvshare.weights.loader import has_weights, load_checkpoint
    from kvshare.weights.checkpoint_write import export_transformers, save_checkpoint

    if not has_weights(args.src):
        raise CheckpointError(f"SRC {args.src} is not a directory holding safetensors weights")
    if has_weights(args.dst):
        raise CheckpointError(f"DST {args.dst} already holds safetensors weights; choose a new directory")
    cfg = load_config(str(args.src))
    state = load_checkpoint(args.src, cfg)
    write = export_transformers if args.to == "transformers" else save_checkpoint
    out = write(state, cfg, args.dst, shard_bytes=args.shard_size)
    print(f"wrote {out}: {len(state)} tensors, {args.to} naming")
    return 0
