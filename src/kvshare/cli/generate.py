"""`kvshare generate "PROMPT" [PROMPT ...]`: stream a completion to the terminal, then report speed and cache use.

Several prompts run together as one batch (continuous batching, as a server would run them); each
completion is printed once all are done.

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


# flag dest -> the fallback when neither the user nor the model's generation_config.json sets it
SAMPLING_FALLBACKS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                      "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    """The sampling flags shared by `generate` and `chat`.

    Flags left unset take the model's ``generation_config.json`` value, else the fallback named in
    their help."""
    g = parser.add_argument_group("sampling (unset flags: the model's generation_config.json, else the default)")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature; 0 = greedy (fallback 1.0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (fallback 1.0 = off)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (fallback 0 = off)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than this fraction of the likeliest, in [0, 1] (fallback 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 0; divides positive / multiplies negative logits of prompt and output tokens "
                        "(fallback 1.0 = off)")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="in [-2, 2]; subtracted from tokens already generated (fallback 0)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="in [-2, 2]; subtracted per earlier occurrence in the output (fallback 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--verbose", action="store_true",
                   help="print the seed and the sampling settings in use (to stderr)")


def sampling_params_from(args: argparse.Namespace, stop: list[str] | None = None) -> Any:
    """SamplingParams from the sampling flags, the model's generation defaults and --seed.

    Without --seed a fresh random seed is drawn and stored in ``args.seed``, so the engine's
    stream and the request use it (a run with ``--seed N`` reproduces one without). RequestError
    on bad values (before any model is built)."""
    import secrets

    from kvshare.engine.generation_config import generation_defaults
    from kvshare.engine.sampling import SamplingParams

    model_defaults = generation_defaults(getattr(args, "model", None) or "kvshare-mini-v41")
    chosen: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, fallback in SAMPLING_FALLBACKS.items():
        value = getattr(args, key, None)
        if value is not None:
            chosen[key], source[key] = value, "flag"
        elif key in model_defaults:
            chosen[key], source[key] = model_defaults[key], "model"
        else:
            chosen[key], source[key] = fallback, "default"
    if getattr(args, "seed", None) is None:
        args.seed = secrets.randbelow(2**31)
        seed_src = "fresh"
    else:
        seed_src = "flag"
    params = SamplingParams(**chosen, seed=args.seed, max_tokens=args.max_tokens,
                            stop=list(args.stop) + list(stop or []), ignore_eos=args.ignore_eos)
    params.validate()
    if getattr(args, "verbose", False):
        settings = ", ".join(f"{k}={v} ({source[k]})" for k, v in chosen.items())
        print(f"seed: {args.seed} ({seed_src}; rerun with --seed {args.seed})\nsampling: {settings}", file=sys.stderr)
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


def generate_batch(engine: Any, prompts: list[str], params: Any) -> tuple[list[Any], float]:
    """Add every prompt as one request (ids ``generate-i``), step the engine until all finish;
    (outputs in prompt order, seconds)."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"generate-{i}", prompt, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"generate-{i}"] for i in range(len(prompts))], time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvshare generate`: one prompt streams; several run as one batch, each
    completion printed after a ``--- [i] 'prompt'`` line once all are done."""
    params = sampling_params_from(args)
    engine = build_engine(args)
    prompts = list(args.prompt)
    if len(prompts) > 1:
        outs, seconds = generate_batch(engine, prompts, params)
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            sys.stdout.write(f"--- [{i}] {prompt!r}\n{out.text}\n")
        sys.stdout.flush()
        if not args.quiet:
            n = sum(len(o.token_ids) for o in outs)
            print(f"{len(prompts)} prompts, {n} tokens generated in {seconds * 1e3:,.1f} ms "
                  f"({n / seconds:,.1f} tokens/s overall)", file=sys.stderr)
        return 0
    result = stream_request(engine, "generate-0", prompts[0], params, _write_stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(result.report(), file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add `kvshare generate`."""
    p = subparsers.add_parser("generate", help="generate a completion for a prompt (streamed), or for several "
                              "prompts as one batch", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="+", help="the prompt text; several prompts run together as one batch")
    add_sampling_args(p)
    p.add_argument("--quiet", action="store_true", help="print only the generated text (no speed report)")
    add_engine_args(p)
    p.set_defaults(func=run)
