"""POST /tokenize and /detokenize bodies, in vLLM's shapes.

/tokenize: ``{"prompt": text}`` (``add_special_tokens``: the bos the completions route adds to a
text prompt) or ``{"messages": [...]}`` (rendered with the chat template, as the chat route does)
-> ``{"count", "max_model_len", "tokens", "token_strs"}``; ``token_strs`` only with
``return_token_strs`` (the token strings logprobs use). /detokenize: ``{"tokens": [...]}`` ->
``{"prompt": text}``.
"""

from __future__ import annotations

from typing import Any

from kvshare.server.errors import APIError
from kvshare.server.protocol import TokenizeRequest
from kvshare.server.responses import TokenText


def tokenize_body(state: Any, req: TokenizeRequest) -> dict[str, Any]:
    """The /tokenize reply for `req`."""
    tok = state.tokenizer
    if req.messages is not None:
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = list(tok.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt))
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
    else:
        ids = list(tok.encode(req.prompt or "", add_bos=req.add_special_tokens))
    strs = [TokenText(tok).string(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}
