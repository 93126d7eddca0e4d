"""The training corpus: the CPython standard library's own ``.py`` sources, as bytes.

Every machine with Python has it offline. The file list is fixed and recorded in a manifest
(relative path, size, SHA-256 per file, plus one aggregate hash), shipped beside the checkpoint,
so a run can say exactly what it trained on and warn when the local stdlib differs.

* Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by relative POSIX path,
  skipping ``site-packages``, ``__pycache__`` and every test directory (a directory component
  named ``test`` / ``tests`` / ``idle_test`` or starting with ``test_``).
* Split: a file is held out when ``sha256(relative_path)`` mod ``HOLDOUT_MOD`` is 0 (about 1 in
  20 files). The split depends only on the path, so it survives a different Python version.
* Token stream: each document is ``[bos] + bytes`` of the file; training contexts are random
  windows of that stream, always preceded by ``bos`` at position 0, matching how a prompt is fed
  at inference (``encode(text, add_bos=True)``).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = 256, 257, 258
HOLDOUT_MOD = 20
_TEST_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages"}


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus files under `root` (default: the stdlib)."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in _TEST_DIRS or d.startswith("test_") for d in dirs):
            continue
        if p.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    """Whether a corpus file belongs to the evaluation split (a pure function of its path)."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % HOLDOUT_MOD == 0


def aggregate_hash(entries: list[dict[str, Any]]) -> str:
    """One SHA-256 over the sorted ``path\\0sha256\\n`` lines of a manifest."""
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e["path"]):
        h.update(f"{e['path']}\0{e['sha256']}\n".encode())
    return h.hexdigest()


def build_manifest(root: Path | None = None) -> dict[str, Any]:
    """Manifest of the corpus under `root`: per-file path, size, SHA-256, split, and the aggregate."""
    root = root or stdlib_root()
    entries = []
    for rel in stdlib_files(root):
        data = (root / rel).read_bytes()
        entries.append(
            {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "heldout": is_heldout(rel)}
        )
    return {
        "corpus": "cpython-stdlib-py",
        "python": platform.python_version(),
        "stdlib_root": str(root),
        "holdout_rule": f"sha256(path) mod {HOLDOUT_MOD} == 0",
        "num_files": len(entries),
        "total_bytes": sum(e["bytes"] for e in entries),
        "aggregate_sha256": aggregate_hash(entries),
        "files": entries,
    }


def save_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Write a manifest as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def verify_manifest(manifest: dict[str, Any], root: Path | None = None) -> list[str]:
    """Differences between a manifest and the local files (empty list: identical).

    Emits one clear warning summarising the differences when there are any.
    """
    local = build_manifest(root)
    want = {e["path"]: e["sha256"] for e in manifest["files"]}
    have = {e["path"]: e["sha256"] for e in local["files"]}
    problems = [f"missing locally: {p}" for p in sorted(want.keys() - have.keys())]
    problems += [f"not in manifest: {p}" for p in sorted(have.keys() - want.keys())]
    problems += [f"content differs: {p}" for p in sorted(want.keys() & have.keys()) if want[p] != have[p]]
    if problems:
        warnings.warn(
            f"local stdlib (Python {local['python']}, aggregate {local['aggregate_sha256'][:16]}) differs from the "
            f"manifest (Python {manifest.get('python')}, aggregate {manifest['aggregate_sha256'][:16]}): "
            f"{len(problems)} file(s), e.g. {problems[:3]}; results will not reproduce exactly",
            stacklevel=2,
        )
    return problems


@dataclass
class Split:
    """One split of the corpus as a flat token stream (int16) with document boundaries."""

    paths: list[str]
    tokens: torch.Tensor  # [n] int16, each document = [bos] + bytes
    doc_starts: list[int]  # offset of each document's bos in `tokens`

    @property
    def num_bytes(self) -> int:
        return int(self.tokens.numel()) - len(self.doc_starts)

    def documents(self) -> list[torch.Tensor]:
        """Each document's bytes (without its bos) as int64 tensors."""
        ends = self.doc_starts[1:] + [int(self.tokens.numel())]
        return [self.tokens[s + 1 : e].long() for s, e in zip(self.doc_starts, ends)]


def load_split(heldout: bool, root: Path | None = None, paths: list[str] | None = None) -> Split:
    """Read the train (heldout=False) or evaluation (heldout=True) files into one token stream."""
    root = root or stdlib_root()
    rels = [p for p in (paths if paths is not None else stdlib_files(root)) if is_heldout(p) == heldout]
    chunks: list[torch.Tensor] = []
    starts: list[int] = []
    n = 0
    for rel in rels:
        data = (root / rel).read_bytes()
        doc = torch.empty(len(data) + 1, dtype=torch.int16)
        doc[0] = BOS
        doc[1:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16) if data else doc[1:]
        starts.append(n)
        chunks.append(doc)
        n += doc.numel()
    tokens = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int16)
    return Split(rels, tokens, starts)


def sample_contexts(split: Split, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random contexts of `length` tokens: bos followed by `length - 1` consecutive stream tokens.

    A context may cross a document boundary (the next document's bos then appears inside it, as a
    separator). Deterministic for a given generator state.
    """
    n = int(split.tokens.numel())
    if n < length:
        raise ValueError(f"corpus split has {n} tokens, fewer than a context of {length}")
    offs = torch.randint(0, n - length + 1, (batch,), generator=gen)
    idx = offs[:, None] + torch.arange(length - 1)[None, :]
    body = split.tokens[idx].long()
    return torch.cat([torch.full((batch, 1), BOS, dtype=torch.long), body], dim=1)


def eval_chunks(split: Split, chunk: int, max_bytes: int | None = None) -> list[torch.Tensor]:
    """Held-out documents cut into pieces of at most `chunk` bytes, each to be fed as ``[bos] + piece``.

    With `max_bytes`, every k-th piece, k chosen so the total is about `max_bytes` (deterministic).
    """
    pieces = [d[i : i + chunk] for d in split.documents() for i in range(0, int(d.numel()), chunk)]
    pieces = [p for p in pieces if p.numel() > 0]
    if max_bytes is not None:
        total = sum(int(p.numel()) for p in pieces)
        step = max(1, math.ceil(total / max(max_bytes, 1)))
        pieces = pieces[::step]
    return pieces
