"""Achieved memory bandwidth of a decode step, next to the machine's measured copy bandwidth.

Bytes read per decode step (a model, not a hardware counter):

* weights: every parameter once (a packed FP8 / FP4 weight at its packed bytes), except the routed
  experts and the embedding table. A step of B
  tokens routes each to k of E experts, so a layer reads, in expectation,
  ``E * (1 - (1 - k/E) ** B)`` distinct experts; the embedding reads only B rows.
* cache: for every sequence its whole compressed cache (``bytes_per_token * context`` of the
  engine's layout) plus its per-sequence rings (sliding windows, compressor states). Sparse
  attention reads fewer KV rows than that, the indexer reads every index-K row, so this is an
  upper bound on what the step must touch, and the weights dominate at short contexts.

achieved = bytes / step time; it is compared with the read side of a large tensor copy (copy
bandwidth counts each byte read and written; reads are half of it), measured before and after
the run (other processes may share the memory bus; the higher value is the reference).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvshare.bench.report import Section, Target, fmt

_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")
_EMBED = re.compile(r"(^|\.)embed(_tokens)?\.weight$")


def weight_bytes_per_step(model: torch.nn.Module, n_experts: int, experts_per_tok: int, batch: int) -> int:
    """Expected weight bytes one decode step of `batch` tokens reads (see module docstring).

    Weights a `Linear` holds packed (FP8 / FP4 as stored, `Linear.qweight`) count their packed bytes
    (codes plus scale exponents; their `weight` parameter is then empty); speed copies (oneDNN's)
    are not counted, they replace the weight they copy."""
    from kvshare.layers.linear import Linear

    per_layer_expert_bytes = 0
    other = 0
    embed_row_bytes = 0
    for mod_name, mod in model.named_modules():
        leaves = [(f"{mod_name}.{leaf}" if mod_name else leaf, p) for leaf, p in mod.named_parameters(recurse=False)]
        if isinstance(mod, Linear) and mod.qweight is not None:
            leaves.append((f"{mod_name}.qweight", mod.qweight))
        for name, p in leaves:
            nbytes = p.nbytes
            if _EMBED.search(name):
                embed_row_bytes = nbytes // max(1, p.shape[0])
            elif _EXPERT.search(name):
                per_layer_expert_bytes += nbytes
            else:
                other += nbytes
    touched = n_experts * (1 - (1 - experts_per_tok / n_experts) ** batch) if n_experts else 0.0
    experts = per_layer_expert_bytes * touched / n_experts if n_experts else 0
    return int(other + experts + batch * embed_row_bytes)


def cache_bytes_per_step(bytes_per_token: float, state_bytes_per_seq: int, contexts: list[int]) -> int:
    """Upper bound of cache bytes a decode step reads for sequences at `contexts` tokens."""
    return int(sum(bytes_per_token * c + state_bytes_per_seq for c in contexts))


def bandwidth_row(label: str, step_s: float, weight_bytes: int, cache_bytes: int, read_gbps: float) -> list[Any]:
    """A table row: label, step ms, weight MB, cache MB, achieved GB/s, fraction of copy bandwidth."""
    achieved = (weight_bytes + cache_bytes) / step_s / 1e9 if step_s > 0 else float("nan")
    return [label, step_s * 1e3, weight_bytes / 1e6, cache_bytes / 1e6, achieved, achieved / read_gbps]


TARGET_SHARE_OF_COPY = 0.5  # issue 11: a batch-1 decode reads weights + cache at >= 50% of copy bandwidth


def bandwidth_section(copy: dict[str, float], entries: list[dict[str, Any]]) -> Section:
    """The bandwidth table from measured decode steps.

    `entries`: dicts with ``label``, ``step_s``, ``weight_bytes``, ``cache_bytes``.
    """
    read = copy["read_gbps"]
    s = Section("bandwidth", "Achieved bandwidth per decode step vs measured copy bandwidth",
                ["mode", "step ms", "weights MB", "cache MB", "achieved GB/s", "of copy read BW"])
    for e in entries:
        s.rows.append(bandwidth_row(e["label"], e["step_s"], e["weight_bytes"], e["cache_bytes"], read))
    s.data = {"copy": copy, "entries": entries}
    first_b1 = next((r for r in s.rows if "batch 1" in str(r[0])), None)
    if first_b1 is not None:
        s.targets.append(Target(f"achieved / copy read bandwidth, {first_b1[0]}", float(first_b1[5]),
                                TARGET_SHARE_OF_COPY, ">="))
    s.notes.append(f"copy bandwidth: {fmt(copy['read_write_gbps'])} GB/s read+write "
                   f"({fmt(read)} GB/s read) over a {copy['bytes'] / 2**20:.0f} MiB float32 tensor")
    if "start_read_gbps" in copy:
        s.notes.append(f"copy read bandwidth measured before the run {fmt(copy['start_read_gbps'])} GB/s and after "
                       f"it {fmt(copy['end_read_gbps'])} GB/s; the higher is the reference")
    s.notes.append("bytes read = all weights except unused routed experts + the whole cache of each "
                   "sequence (an upper bound for sparse attention)")
    s.plot = _plot
    return s


def _plot(ax: Any, s: Section) -> None:
    labels = [str(r[0]) for r in s.rows] + ["copy (read)"]
    values = [float(r[4]) for r in s.rows] + [float(s.data["copy"]["read_gbps"])]
    colors = ["tab:blue"] * len(s.rows) + ["tab:gray"]
    ax.barh(labels, values, color=colors)
    ax.set_xlabel("GB/s")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
