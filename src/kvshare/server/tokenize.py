"""POST /tokenize and /detokenize bodies, in vLLM's shapes.

/tokenize: ``{"prompt": text}`` (``add_special_tokens``: the bos the completions route adds to a
text prompt) or ``{"messages": [...]}`` (rendered with the chat template, as the chat route does)
-> ``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` only with
``return_token_strs`` (the token strings logprobs use). /detokenize: ``{"tokens": [...]}`` ->
``{"prompt": text}``.

`tokenize_reply` does the work — tokenising, the token strings, the JSON encoding — on a worker
thread (4 MB of text took 8 s, all on the event loop, before), and refuses with a 413 a reply
whose token count alone puts it over `RequestLimits.max_response_bytes` (checked before the
token strings are built).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.responses import Response

from kvshare.server.errors import APIError
from kvshare.server.limits import RequestLimits
from kvshare.server.protocol import TokenizeRequest
from kvshare.server.responses import TokenText

_BYTES_PER_ID = 8  # an id and its comma in the JSON list (ids up to 7 digits)
_BYTES_PER_STR = 8  # a token string's quotes, comma and a few characters


def tokenize_body(state: Any, req: TokenizeRequest, limits: RequestLimits | None = None) -> dict[str, Any]:
    """The /tokenize reply for `req`; 413 when it would pass `limits.max_response_bytes`."""
    tok = state.tokenizer
    if req.messages is not None:
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = list(tok.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt))
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
    else:
        ids = list(tok.encode(req.prompt or "", add_bos=req.add_special_tokens))
    if limits is not None:
        size = len(ids) * (_BYTES_PER_ID + (_BYTES_PER_STR if req.return_token_strs else 0))
        if size > limits.max_response_bytes:
            raise APIError(413, f"the reply would list {len(ids)} tokens, about {size // 2**20 + 1} MiB, over the "
                                f"server's response limit of {limits.max_response_bytes // 2**20} MiB "
                                "(max_response_bytes); send less text", param="prompt" if req.messages is None
                           else "messages", code="response_too_large")
    strs = [TokenText(tok).string(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


async def tokenize_reply(state: Any, req: TokenizeRequest, limits: RequestLimits) -> Response:
    """`tokenize_body` as a JSON response, built on a worker thread."""

    def build() -> bytes:
        body = tokenize_body(state, req, limits)
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    return Response(await asyncio.to_thread(build), media_type="application/json")
