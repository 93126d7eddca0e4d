"""`kvshare chat`: an interactive conversation in the terminal.

Each turn renders the whole conversation with the model's chat template and streams the reply.
`/exit` (or end of input, Ctrl-D) ends the session, `/reset` forgets the conversation. Ctrl-C
while a reply streams cancels that reply (the conversation so far is kept); at the prompt it
ends the session.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, TextIO

from kvshare.cli.engine_args import add_engine_args, build_engine, tokenizer_of
from kvshare.cli.generate import add_sampling_args, sampling_params_from, stream_request
from kvshare.errors import RequestError
from kvshare.tokenizer import ByteTokenizer

EXIT_COMMANDS = ("/exit", "/quit")


def chat_loop(engine: Any, tokenizer: Any, params: Any, read: Callable[[], str], out: TextIO,
              system: str | None = None, show_stats: bool = False) -> list[dict[str, str]]:
    """Run the conversation until /exit or EOF (`read` raising EOFError); return the messages."""
    base: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    turn = 0
    while True:
        try:
            line = read()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        text = line.strip()
        if text in EXIT_COMMANDS:
            break
        if text == "/reset":
            messages = list(base)
            out.write("(conversation reset)\n")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line})
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

        def write(piece: str) -> None:
            out.write(piece)
            out.flush()

        rid = f"chat-{turn}"
        turn += 1
        try:
            result = stream_request(engine, rid, prompt_ids, params, write)
        except RequestError as e:
            messages.pop()
            out.write(f"error: {e}\n")
            continue
        except KeyboardInterrupt:
            cancel(engine, rid)
            messages.pop()  # the unanswered turn; everything before it stays
            out.write("\n(reply cancelled; the conversation is kept)\n")
            continue
        out.write("\n")
        messages.append({"role": "assistant", "content": result.output.text})
        if show_stats:
            print(result.report(), file=sys.stderr)
    return messages


def cancel(engine: Any, request_id: str) -> None:
    """Abort `request_id` and step until the engine has let go of it (its blocks are freed)."""
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvshare chat`."""
    engine = build_engine(args)
    tokenizer = tokenizer_of(engine, args.model)
    # the built-in byte template marks turns with `<|role|>` headers: a new header ends the reply
    stops = ["<|user|>", "<|system|>"] if isinstance(tokenizer, ByteTokenizer) else []
    params = sampling_params_from(args, stop=stops)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kvshare chat with {args.model} — /exit or Ctrl-D to quit, /reset to start over", file=sys.stderr)

    def read() -> str:
        if interactive:
            return input("> ")
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    chat_loop(engine, tokenizer, params, read, sys.stdout, system=args.system, show_stats=args.stats)
    return 0


def register(subparsers: Any) -> None:
    """Add `kvshare chat`."""
    p = subparsers.add_parser("chat", help="interactive chat with a model (chat template, streamed replies)",
                              description=__doc__.splitlines()[0])
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--stats", action="store_true", help="print speed and cache use after each reply")
    add_engine_args(p)
    p.set_defaults(func=run)
