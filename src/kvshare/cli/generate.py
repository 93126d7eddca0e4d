"""`kvshare generate "PROMPT"`: stream a completion to the terminal, then report speed and cache use.

The command drives `LLMEngine.step()` itself, printing each step's new text as soon as the step
returns. Afterwards it prints (to stderr) prefill and decode tokens/s and the peak KV-cache use
(blocks used / total and bytes).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvshare.cli.engine_args import add_engine_args, build_engine


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    """The sampling flags shared by `generate` and `chat`."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="softmax temperature; 0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0 = off)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params_from(args: argparse.Namespace, stop: list[str] | None = None) -> Any:
    """SamplingParams from the sampling flags (and --seed); RequestError on bad values."""
    from kvshare.engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens, stop=list(args.stop) + list(stop or []),
                            ignore_eos=args.ignore_eos)
    params.validate()
    return params


@dataclass
class StreamResult:
    """What one streamed request produced and how fast."""

    output: Any
    prefill_s: float
    decode_s: float
    peak_blocks_used: int | None
    blocks_total: int | None
    bytes_per_block: float | None
    spec: dict | None = None  # speculative decoding figures (EngineStats.extra spec_*), when on

    @property
    def prompt_tokens(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.output.token_ids)

    def report(self) -> str:
        """Speed and cache use, one line each."""
        n_pre, n_gen = self.prompt_tokens, self.generated_tokens
        pre = f"{n_pre / self.prefill_s:,.1f}" if self.prefill_s > 0 else "n/a"
        dec = f"{(n_gen - 1) / self.decode_s:,.1f}" if n_gen > 1 and self.decode_s > 0 else "n/a"
        lines = [
            f"prefill: {n_pre} tokens in {self.prefill_s * 1e3:,.1f} ms ({pre} tokens/s)",
            f"decode:  {n_gen} tokens in {(self.prefill_s + self.decode_s) * 1e3:,.1f} ms "
            f"({dec} tokens/s after the first), finish_reason={self.output.finish_reason}",
        ]
        if self.peak_blocks_used is not None and self.blocks_total:
            cache = f"cache:   peak {self.peak_blocks_used}/{self.blocks_total} blocks used"
            if self.bytes_per_block:
                used = self.peak_blocks_used * self.bytes_per_block
                total = self.blocks_total * self.bytes_per_block
                cache += f" ({_bytes(used)} of {_bytes(total)}, {_bytes(self.bytes_per_block)} per block)"
            lines.append(cache)
        if self.spec and self.spec.get("spec_num_verifies"):
            drafted, accepted = int(self.spec["spec_draft_tokens"]), int(self.spec["spec_accepted_tokens"])
            lines.append(f"speculation: {drafted} drafted, {accepted} accepted ({accepted / max(drafted, 1):.0%}), "
                         f"mean accepted length {self.spec['spec_mean_accepted_length']:.2f} tokens per step")
        return "\n".join(lines)


def stream_request(engine: Any, request_id: str, prompt: str | list[int], params: Any,
                   write: Callable[[str], None]) -> StreamResult:
    """Add one request, step the engine until it finishes, and `write` its text as it arrives."""
    from kvshare.server.metrics import blocks_used_total, stat
    from kvshare.server.responses import TextDeltas

    engine.add_request(request_id, prompt, params)
    deltas = TextDeltas(list(getattr(params, "stop", None) or []))
    start = time.perf_counter()
    first: float | None = None
    peak: int | None = None
    stats: Any = None
    final = None
    while final is None and engine.has_unfinished_requests():
        outputs = engine.step()
        stats = engine.stats()
        used, _ = blocks_used_total(stats)
        if used is not None:
            peak = used if peak is None else max(peak, used)
        for out in outputs:
            if out.request_id != request_id:
                continue
            if first is None and out.token_ids:
                first = time.perf_counter()
            text = deltas.next(out)
            if text:
                write(text)
            if out.finished:
                final = out
    if final is None:
        raise RuntimeError(f"the engine stopped without finishing request {request_id}")
    end = time.perf_counter()
    first = first or end
    _, total = blocks_used_total(stats)
    spec = {k: v for k, v in (getattr(stats, "extra", None) or {}).items() if k.startswith("spec_")}
    return StreamResult(final, first - start, end - first, peak, total, stat(stats, "bytes_per_block"), spec)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvshare generate`."""
    params = sampling_params_from(args)
    engine = build_engine(args)
    result = stream_request(engine, "generate-0", args.prompt, params, _write_stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(result.report(), file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add `kvshare generate`."""
    p = subparsers.add_parser("generate", help="generate a completion for one prompt, streamed",
                              description=__doc__.splitlines()[0])
    p.add_argument("prompt", help="the prompt text")
    add_sampling_args(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no speed report)")
    add_engine_args(p)
    p.set_defaults(func=run)
