"""Load time and peak memory of loading a checkpoint, measured in a fresh process.

`measure_load(path, ...)` runs ``python -m kvshare.bench.load_memory PATH`` in a subprocess (so the
peak is this load's alone) and returns its JSON: the resident set before loading (after importing
torch and kvshare and loading the native kernels), the peak resident set (``VmHWM``) and the
resident set after (the modules a load and a generation use are imported before the baseline), the checkpoint's bytes on disk, the load's wall time and MB/s, the bytes the model
holds (`dtypes.weight_bytes`) and, with ``new_tokens``, the greedy tokens of a fixed prompt (one
sequence, token ids 1..`prompt_len`, through `LLM` on the loaded model) with the resident set after it.

Peak growth = VmHWM - VmRSS before: what loading added at its worst (file pages mapped by the loader
count, as they are resident in this process; the page cache of files read with ``read`` does not).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of the checkpoint's safetensors files."""
    from kvshare.weights.loader import checkpoint_files

    return sum(f.stat().st_size for f in checkpoint_files(path))


def _greedy(model: Any, prompt_len: int, new_tokens: int) -> list[int]:
    from kvshare.llm import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=1, max_model_len=prompt_len + new_tokens + 1)
    out = llm.generate([list(range(1, prompt_len + 1))],
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return list(out[0].token_ids)


def run(path: str, dtype: str, prompt_len: int, new_tokens: int, threads: int) -> dict[str, Any]:
    """Load `path` in this process and report (module doc)."""
    import torch

    for module in ("kvshare.llm", "kvshare.model.deepseek"):  # imports are not loading: before the baseline
        importlib.import_module(module)
    from kvshare import kernels
    from kvshare.model.dtypes import weight_bytes
    from kvshare.weights.loader import load_model

    torch.set_num_threads(threads)
    kernels.available()  # the native library is loaded before the baseline
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    model = load_model(path, dtype=getattr(torch, dtype), quant=False)
    seconds = time.perf_counter() - t0
    peak, after = _status_kb("VmHWM"), _status_kb("VmRSS")
    size = checkpoint_bytes(path)
    out: dict[str, Any] = {
        "checkpoint_bytes": size, "seconds": seconds, "mb_per_s": size / 1e6 / seconds,
        "rss_before_bytes": before * 1024, "peak_bytes": peak * 1024, "rss_after_bytes": after * 1024,
        "peak_growth_bytes": (peak - before) * 1024, "after_growth_bytes": (after - before) * 1024,
        "weight_bytes": weight_bytes(model), "loadavg": os.getloadavg()[0],
    }
    out["peak_growth_over_file"] = out["peak_growth_bytes"] / size
    if new_tokens:
        out["tokens"] = _greedy(model, prompt_len, new_tokens)
        out["rss_after_generate_bytes"] = _status_kb("VmRSS") * 1024
        out["peak_after_generate_bytes"] = _status_kb("VmHWM") * 1024
    return out


def measure_load(path: str | Path, *, dtype: str = "bfloat16", prompt_len: int = 8, new_tokens: int = 0,
                 threads: int = 1, timeout: float = 1800, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`run` in a fresh Python process (this module's main); its JSON result."""
    cmd = [sys.executable, "-m", "kvshare.bench.load_memory", str(path), "--dtype", dtype,
           "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"load measurement failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.path, a.dtype, a.prompt_len, a.new_tokens, a.threads)))


if __name__ == "__main__":
    main()
