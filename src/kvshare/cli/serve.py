"""`kvshare serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Endpoints: /v1/completions, /v1/chat/completions (streaming and not), /v1/models, /health,
/metrics. One engine loop batches every request in flight. Limits, access rules and shutdown
are flags (see the README's serving section for what is exposed by default).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from kvshare.cli.arg_types import parse_bytes, port_number, positive_float, positive_int
from kvshare.cli.engine_args import add_engine_args, build_engine, max_model_len_of, tokenizer_of

API_KEY_ENV = "KVSHARE_API_KEY"


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
    from kvshare.engine.generation_config import generation_defaults
    from kvshare.server.app import create_app
    from kvshare.server.limits import RequestLimits
    from kvshare.server.security import AccessPolicy
    from kvshare.server.serving import run_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = RequestLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                           body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                           keep_alive_s=args.keep_alive_timeout)
    access = AccessPolicy(api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                          public_metrics=args.public_metrics, allowed_hosts=list(args.allowed_hosts or []),
                          cors_origins=list(args.cors_origins or []))
    if getattr(args, "prefill_tokens_with_decodes", None) is None:  # streams keep their pace beside long prompts
        from kvshare.engine.scheduler import PREFILL_TOKENS_WITH_DECODES

        args.prefill_tokens_with_decodes = PREFILL_TOKENS_WITH_DECODES
    engine = build_engine(args)
    app = create_app(
        engine,
        tokenizer_of(engine, args.model),
        args.served_model_name or served_name(args.model),
        max_concurrent_requests=args.max_concurrent_requests,
        max_model_len=max_model_len_of(engine),
        default_max_tokens=args.default_max_tokens,
        limits=limits, access=access, watchdog_timeout_s=args.watchdog_timeout,
        sampling_defaults=generation_defaults(args.model or "kvshare-mini-v41"),
    )
    state = app.state.kvshare

    def on_drain() -> None:
        if state.event_loop is not None:
            state.event_loop.call_soon_threadsafe(state.begin_drain, args.shutdown_timeout)

    if access.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("kvshare.server").warning(
            "serving on %s without an API key: anyone who can reach this port can use it "
            "(set --api-key or %s)", args.host, API_KEY_ENV)
    def fatal() -> bool:  # the engine loop stopped for good (e.g. a lost tensor-parallel worker)
        return getattr(state.loop.error, "engine_fatal", False)

    run_app(app, args.host, args.port, log_level=args.log_level, shutdown_timeout_s=args.shutdown_timeout,
            on_drain=on_drain, drained=lambda: state.active == 0, fatal=fatal)
    error = state.loop.error
    if error is not None and fatal():
        raise error  # a KVShareError: one `error:` line, exit code 2
    return 0


def register(subparsers: Any) -> None:
    """Add `kvshare serve`."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 1-65535 (default 8000)")
    p.add_argument("--max-concurrent-requests", type=positive_int, default=64,
                   help="generation requests served at once; more get HTTP 429 (default 64)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the --model name or directory name)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of a chat request that sets none (default 256, capped by the context)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    a = p.add_argument_group("access")
    a.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every route but /health (default: the "
                        f"{API_KEY_ENV} environment variable; none = open)")
    a.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key (default: it needs the key when one is set)")
    a.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="accept only these Host headers, e.g. localhost 127.0.0.1 (guards against DNS "
                        "rebinding; default: any)")
    a.add_argument("--cors-origin", dest="cors_origins", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN call the API (repeatable; default: none)")
    lim = p.add_argument_group("limits and shutdown")
    lim.add_argument("--max-body-bytes", type=parse_bytes, default=4 * 2**20, metavar="SIZE",
                     help="largest request body; larger gets HTTP 413 (default 4MiB)")
    lim.add_argument("--max-json-depth", type=positive_int, default=32,
                     help="deepest JSON nesting accepted (default 32)")
    lim.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="S",
                     help="seconds a client may take to send a request's headers (default 10)")
    lim.add_argument("--body-timeout", type=positive_float, default=30.0, metavar="S",
                     help="seconds a client may take to send a request's body; slower gets 408 (default 30)")
    lim.add_argument("--keep-alive-timeout", type=positive_float, default=5.0, metavar="S",
                     help="seconds an idle keep-alive connection stays open (default 5)")
    lim.add_argument("--shutdown-timeout", type=positive_float, default=20.0, metavar="S",
                     help="on SIGTERM/Ctrl-C, seconds to let requests in flight finish before each open "
                          "stream gets a final error event (default 20); a second signal exits at once")
    lim.add_argument("--watchdog-timeout", type=positive_float, default=60.0, metavar="S",
                     help="/health fails when the engine loop has not advanced for S seconds with work "
                          "pending (default 60)")
    add_engine_args(p)
    p.set_defaults(func=run)
