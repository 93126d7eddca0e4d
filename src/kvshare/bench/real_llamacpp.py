"""llama.cpp's side of `kvshare bench real`: the released-format checkpoint converted by llama.cpp's own
converter, its load measured in a fresh process, and its timed runs.

Conversion (`released_gguf`): ``kvshare.bench.gguf_v4 --outtype released``, i.e. upstream's
DeepseekV4Model rules for DeepSeek-V4-Flash: FP4 experts repacked losslessly to MXFP4 (the same
e2m1 codes and e8m0 scales per 32), FP8 linears dequantised and written Q8_0 (llama.cpp's default
for the FP8 matrices), bf16 tensors (embedding, head, ``wo_a``) BF16, fp32 ones F32. The GGUF is
written next to the checkpoint (``llamacpp-released.gguf``) and reused while it is newer than the
checkpoint's safetensors.

Load (`measure_lc_load`): ``python -m kvshare.bench.real_llamacpp GGUF`` loads the file with
llama.cpp (its default: the file memory-mapped) and reports the same keys as
`kvshare.bench.load_memory.run` (resident set before / peak / after, seconds, MB/s); then an
8-token greedy generation of one sequence touches every weight a token uses, and the peak growth
after it is reported too (mapped pages count as resident once read).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvshare.bench.gen import equal_length_prompts

GGUF_NAME = "llamacpp-released.gguf"


def released_gguf(ckpt: Path, cfg: Any, fetch: bool) -> tuple[Path | None, str]:
    """(the GGUF of `ckpt`, a note) or (None, why llama.cpp is skipped)."""
    from kvshare.bench import llamacpp_files as files
    from kvshare.bench.llamacpp_peer import unsupported

    reason = files.binding_available() or unsupported(cfg)
    if reason is not None:
        return None, f"llama.cpp: skipped, {reason}"
    out = Path(ckpt) / GGUF_NAME
    weights = max((f.stat().st_mtime for f in Path(ckpt).glob("*.safetensors")), default=0.0)
    if out.is_file() and out.stat().st_mtime > weights:
        return out, f"llama.cpp: reused {out}"
    converter = files.converter_dir()
    if converter is None:
        if not fetch:
            return None, (f"llama.cpp: skipped, its converter is not in {files.cache_dir()} (fetching is off; "
                          "set KVSHARE_LLAMACPP_SRC to a llama.cpp source directory)")
        converter = files.fetch_converter()
    t0 = time.perf_counter()
    files.convert_checkpoint(Path(ckpt), out, converter, "released")
    return out, f"llama.cpp: converted in {time.perf_counter() - t0:.0f} s to {out}"


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def run_load(path: str, threads: int, vocab: int) -> dict[str, Any]:
    """Load `path` with llama.cpp in this process and report (module doc)."""
    import llama_cpp

    from kvshare.bench.llamacpp_peer import LlamaCppModel, lc_generate

    llama_cpp.llama_backend_init()
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    model = LlamaCppModel(Path(path), "released")
    seconds = time.perf_counter() - t0
    peak, after = _status_kb("VmHWM"), _status_kb("VmRSS")
    size = Path(path).stat().st_size
    out: dict[str, Any] = {
        "checkpoint_bytes": size, "seconds": seconds, "mb_per_s": size / 1e6 / seconds,
        "rss_before_bytes": before * 1024, "peak_bytes": peak * 1024, "rss_after_bytes": after * 1024,
        "peak_growth_bytes": (peak - before) * 1024, "after_growth_bytes": (after - before) * 1024,
        "peak_growth_over_file": (peak - before) * 1024 / size, "loadavg": os.getloadavg()[0]}
    res = lc_generate(model, equal_length_prompts(1, 8, vocab, 0), 8, threads)
    out["tokens"] = res.tokens[0]
    out["generate_peak_growth_bytes"] = (_status_kb("VmHWM") - before) * 1024
    model.close()
    return out


def own_src_env() -> dict[str, str]:
    """This environment with the kvshare package this module belongs to first on PYTHONPATH (so a
    child process imports the same tree, not another installed copy)."""
    src = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def measure_lc_load(path: Path, threads: int, vocab: int, timeout: float = 1800) -> dict[str, Any]:
    """`run_load` in a fresh Python process; its JSON result."""
    cmd = [sys.executable, "-m", "kvshare.bench.real_llamacpp", str(path), "--threads", str(threads),
           "--vocab", str(vocab)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=own_src_env())
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp load measurement failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lc_round(model: Any, threads: int, prompts: dict[str, Any], new_tokens: int) -> dict[str, float]:
    """One round of llama.cpp at `threads`: decode batch 1 and 4 (`new_tokens` each), prefill of
    ``prompts["prefill"]``; the same measures as kvshare's round."""
    from kvshare.bench.llamacpp_peer import lc_generate

    out: dict[str, Any] = {}
    for b in (1, 4):
        res = lc_generate(model, prompts[f"b{b}"], new_tokens, threads)
        out[f"decode_b{b}_tok_s"], out[f"decode_b{b}_step_s"] = res.decode_tps, res.decode.median
        out[f"tokens_b{b}"] = res.tokens
    pre = prompts["prefill"]
    res = lc_generate(model, pre, 1, threads)
    out["prefill_tok_s"] = pre.shape[1] / res.prefill_s
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="llama.cpp load time and peak memory of a GGUF (JSON on stdout)")
    ap.add_argument("path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, required=True)
    a = ap.parse_args(argv)
    print(json.dumps(run_load(a.path, a.threads, a.vocab)))


if __name__ == "__main__":
    main()
