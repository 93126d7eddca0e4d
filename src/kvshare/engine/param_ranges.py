"""Ranges of request values that the sampler and torch's generators can hold.

`check_ranges(params)` runs at admission (from `SamplingParams.validate`), so a value that would
overflow an int64 tensor or a generator seed is refused for that one request with a
RequestError naming the field, instead of failing inside a batched step.

* ``top_k``: at most ``TOP_K_MAX`` (2^31 - 1; any value >= the vocabulary means the whole vocabulary).
* ``seed``: ``torch.Generator.manual_seed`` takes [-2^63, 2^64); Python ints outside overflow.
* ``stop_token_ids``: real ints (not bools), at most ``MAX_STOP_TOKEN_IDS`` of them.
* ``logprobs`` / ``top_logprobs`` at most ``MAX_LOGPROBS``; ``logit_bias`` at most ``MAX_LOGIT_BIAS`` entries.

No torch import here: the server's body-parser child validates requests with these bounds and
stays light (server/body_parser.py).
"""

from __future__ import annotations

from typing import Any

from kvshare.errors import RequestError

TOP_K_MAX = 2**31 - 1
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # OpenAI's bound on `logprobs` / `top_logprobs`
MAX_LOGIT_BIAS = 4096  # entries per request (vLLM does not bound it; OpenAI allows 300)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ranges(params: Any) -> None:
    """Raise RequestError("invalid sampling params: <field> ...") for a value outside its range."""

    def bad(msg: str) -> RequestError:
        return RequestError(f"invalid sampling params: {msg}")

    if _is_int(params.top_k) and params.top_k > TOP_K_MAX:
        raise bad(f"top_k must be <= {TOP_K_MAX} (values >= the vocabulary mean no top-k), got {params.top_k}")
    seed = params.seed
    if seed is not None and _is_int(seed) and not SEED_MIN <= seed <= SEED_MAX:
        raise bad(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {seed}")
    ids = params.stop_token_ids
    if not isinstance(ids, (list, tuple)):
        raise bad(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"stop_token_ids has {len(ids)} entries, more than {MAX_STOP_TOKEN_IDS}")
    for tid in ids:
        if not _is_int(tid):
            raise bad(f"stop_token_ids entry {tid!r} is not an integer token id")
