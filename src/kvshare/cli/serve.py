"""`kvshare serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: /v1/completions, /v1/chat/completions (streaming and not), /v1/models, /health,
/metrics. One engine loop batches every request in flight.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvshare.cli.engine_args import add_engine_args, build_engine, max_model_len_of, tokenizer_of


def served_name(model: str) -> str:
    """The model id clients use: the shipped name, or the model directory's name."""
    from pathlib import Path

    p = Path(model)
    if p.is_dir():
        return p.resolve().name
    if p.is_file():
        return p.resolve().parent.name if p.name == "config.json" else p.stem
    return model


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvshare serve`."""
    import uvicorn

    from kvshare.server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(args)
    app = create_app(
        engine,
        tokenizer_of(engine, args.model),
        args.served_model_name or served_name(args.model),
        max_concurrent_requests=args.max_concurrent_requests,
        max_model_len=max_model_len_of(engine),
        default_max_tokens=args.default_max_tokens,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def register(subparsers: Any) -> None:
    """Add `kvshare serve`."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-concurrent-requests", type=_positive, default=64,
                   help="generation requests served at once; more get HTTP 429 (default 64)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the --model name or directory name)")
    p.add_argument("--default-max-tokens", type=_positive, default=256,
                   help="max_tokens of a chat request that sets none (default 256, capped by the context)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    add_engine_args(p)
    p.set_defaults(func=run)
