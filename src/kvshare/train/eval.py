"""Evaluate the shipped byte model: held-out bits per byte, baselines, sample generations.

    python -m kvshare.train.eval [--model kvshare-mini-v41] [--max-bytes 8192] [--chunk 384]

The default (8 KiB of held-out text) takes a few minutes on one core and prints progress; the
release table in notes/training.md uses ``--max-bytes 32768``.

Bits per byte are computed on the same held-out pieces (``data.eval_chunks``: held-out files cut
into pieces of at most ``--chunk`` bytes, each fed as ``[bos] + piece``, every byte a target) by

* the dense reference path: ``Transformer`` + ``DenseCache``, one prefill per piece (pieces are
  batched as several sequences of one ragged step);
* the engine path (``engine_eval.py``): the paged block pool, continuous batching, chunked prefill
  and the packed quantised cache;
* unigram / bigram byte models fitted on the training split.

The table is printed, followed by greedy and sampled generations for a few code prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Callable

import torch

from kvshare.train.baselines import ByteNgram
from kvshare.train.data import BOS, eval_chunks, load_split
from kvshare.train.loop import CacheFactory, dense_cache_factory, token_nll

PROMPTS = ("def ", "import ", "class ", "    for ")


def with_bos(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each piece as a model context ``[bos] + piece``."""
    return [torch.cat([torch.tensor([BOS]), p.long()]) for p in pieces]


@torch.no_grad()
def dense_bits_per_byte(
    model: Any, pieces: list[torch.Tensor], seqs_per_step: int = 4, cache_factory: CacheFactory = dense_cache_factory,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Bits per byte of `model` on the pieces through the dense reference path (one prefill each).

    `progress(done, total)` is called after each step with the number of pieces scored."""
    model.eval()
    ctxs = with_bos(pieces)
    nll, n = 0.0, 0
    for i in range(0, len(ctxs), seqs_per_step):
        part = ctxs[i : i + seqs_per_step]
        nll += float(token_nll(model, part, cache_factory).double().sum())
        n += sum(int(c.numel()) - 1 for c in part)
        if progress is not None:
            progress(i + len(part), len(ctxs))
    return nll / n / math.log(2)


def progress_printer(label: str, every_s: float = 10.0) -> Callable[[int, int], None]:
    """A progress callback that prints ``label: done/total pieces, elapsed`` at most every `every_s` s."""
    start = time.time()
    last = [start - every_s]

    def report(done: int, total: int) -> None:
        now = time.time()
        if now - last[0] >= every_s or done == total:
            last[0] = now
            print(f"  {label}: {done}/{total} pieces, {now - start:.0f} s", flush=True)

    return report


def default_params(model: str, max_tokens: int, greedy: bool, seed: int | None = None) -> Any:
    """SamplingParams with `model`'s generation_config.json defaults; `greedy` sets temperature 0
    (keeping the model's penalties and filters), as ``kvshare generate --temperature 0`` does."""
    from kvshare.engine.generation_config import generation_defaults
    from kvshare.engine.sampling import SamplingParams

    kw = generation_defaults(model)
    if greedy:
        kw["temperature"] = 0.0
    return SamplingParams(**kw, seed=seed, max_tokens=max_tokens)


def generate_samples(llm: Any, model: str, prompts: tuple[str, ...] = PROMPTS,
                     max_tokens: int = 120) -> list[dict[str, str]]:
    """Greedy and seeded-sampled continuations of each prompt through the engine, with the
    model's generation defaults (greedy = the same with temperature 0); sample i uses seed i."""
    outs = llm.generate(list(prompts), default_params(model, max_tokens, greedy=True), use_tqdm=False)
    sampled = [default_params(model, max_tokens, greedy=False, seed=i) for i in range(len(prompts))]
    souts = llm.generate(list(prompts), sampled, use_tqdm=False)
    return [{"prompt": p, "greedy": g.text, "sampled": s.text} for p, g, s in zip(prompts, outs, souts)]


def format_table(rows: list[tuple[str, float]], n_bytes: int) -> str:
    """A plain-text bits-per-byte table."""
    width = max(len(r[0]) for r in rows)
    lines = [f"held-out bits per byte ({n_bytes} bytes)", f"{'method'.ljust(width)}  bits/byte", "-" * (width + 11)]
    lines += [f"{name.ljust(width)}  {v:9.4f}" for name, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print the bits-per-byte table and the samples; optionally write JSON."""
    ap = argparse.ArgumentParser(prog="python -m kvshare.train.eval", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kvshare-mini-v41", help="shipped model name or checkpoint directory")
    ap.add_argument("--max-bytes", type=int, default=8192,
                    help="held-out bytes to score (evenly spaced pieces; the release table uses 32768)")
    ap.add_argument("--chunk", type=int, default=384, help="piece length in bytes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine path and the samples")
    ap.add_argument("--max-tokens", type=int, default=120, help="tokens per sample generation")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from kvshare.weights.loader import load_model

    pieces = eval_chunks(load_split(heldout=True), a.chunk, a.max_bytes)
    n_bytes = sum(int(p.numel()) for p in pieces)
    base = ByteNgram(load_split(heldout=False).tokens).bits_per_byte(pieces)
    model = load_model(a.model, dtype=torch.float32, device="cpu", quant=True)
    t = time.time()
    print(f"scoring {len(pieces)} held-out pieces ({n_bytes} bytes) with {a.model}", flush=True)
    rows = [("model, dense reference path", dense_bits_per_byte(model, pieces, progress=progress_printer("dense")))]
    timing = {"dense_s": round(time.time() - t, 1)}
    print(f"dense: {rows[0][1]:.4f} bits/byte on {n_bytes} bytes ({timing['dense_s']} s)", flush=True)
    samples: list[dict[str, str]] = []
    if not a.no_engine:
        from kvshare.train.engine_eval import build_llm, engine_bits_per_byte

        llm = build_llm(model, a.chunk)
        t = time.time()
        rows.append(("model, engine (paged, chunked prefill)", engine_bits_per_byte(llm, pieces, progress_printer("engine"))))
        timing["engine_s"] = round(time.time() - t, 1)
        print(f"engine: {rows[1][1]:.4f} bits/byte ({timing['engine_s']} s)", flush=True)
        samples = generate_samples(llm, a.model, max_tokens=a.max_tokens)
    rows += [("bigram baseline", base["bigram"]), ("unigram baseline", base["unigram"])]
    print(format_table(rows, n_bytes))
    print(f"timing: {timing}")
    for s in samples:
        print(f"\n--- prompt {s['prompt']!r}\n[greedy ] {s['prompt'] + s['greedy']!r}\n"
              f"[sampled] {s['prompt'] + s['sampled']!r}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bits_per_byte": dict(rows), "bytes": n_bytes, "pieces": len(pieces), "chunk": a.chunk,
                       "timing": timing, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
