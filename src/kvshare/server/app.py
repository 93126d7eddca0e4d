"""The FastAPI application: OpenAI-compatible routes over one engine loop.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming with SSE or whole replies),
GET /v1/models, GET/HEAD /health, GET /metrics (Prometheus text); /openapi.json documents the
request bodies and every reply (`openapi`). A known path with the wrong method is a 405 with `Allow`. Every error reply is OpenAI's
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for bad input (malformed
JSON, unknown model, invalid sampling values, too-long prompt, over the concurrency limit) and
500 for an internal failure of one request, which leaves the server serving. Limits (body
size, JSON depth, valid Unicode) and access rules (API key, JSON-only bodies, Host, CORS) are
middleware from `limits` and `security`; /health fails (503) while the server drains or when
the engine loop has not advanced for `watchdog_timeout_s` with work pending.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from jinja2.exceptions import TemplateError
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvshare.engine.sampling import SamplingParams
from kvshare.server.body_parser import BodyParser
from kvshare.server.engine_loop import EngineLoop
from kvshare.server.errors import APIError, internal_error
from kvshare.server.generation import Job, ServerState, admit, generate
from kvshare.server.limits import MAX_CHARS_PER_TOKEN, OFF_LOOP_BYTES, RequestLimits, check_reply_size
from kvshare.server.openapi import install_openapi
from kvshare.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvshare.server.replies import ErrorResponse, ModelCard, ModelList
from kvshare.engine.structured_spec import StructuredSpec
from kvshare.server.responses import ReplyOptions
from kvshare.server.tool_calls import DSML_FORMAT
from kvshare.server.tool_grammar import tool_grammar
from kvshare.server.tokenize import tokenize_reply
from kvshare.server.security import AccessPolicy, install

log = logging.getLogger("kvshare.server")

Handler = Callable[[Request], Awaitable[Response]]


def create_app(engine: Any, tokenizer: Any, model_name: str, *, max_concurrent_requests: int = 64,
               max_model_len: int | None = None, default_max_tokens: int = 256,
               limits: RequestLimits | None = None, access: AccessPolicy | None = None,
               watchdog_timeout_s: float = 60.0, sampling_defaults: dict[str, Any] | None = None) -> FastAPI:
    """An app serving `engine` (an `LLMEngine`) under the model id `model_name`.

    `sampling_defaults` (the model's generation_config.json, as `generation_defaults` reads it)
    fill the sampling fields a request leaves unset; a field the client sends always wins.

    The engine loop thread starts with the app and stops with it.
    """
    limits = limits or RequestLimits()
    if max_model_len is not None:  # a token-id prompt longer than the context is refused while parsing
        limits = dataclasses.replace(limits, max_prompt_tokens=min(limits.max_prompt_tokens, max_model_len))
    parser = BodyParser(limits)
    loop = EngineLoop(engine)
    state = ServerState(loop=loop, tokenizer=tokenizer, model_name=model_name,
                        max_concurrent_requests=max_concurrent_requests, max_model_len=max_model_len,
                        default_max_tokens=default_max_tokens, metrics=loop.metrics,
                        sampling_defaults=dict(sampling_defaults or {}))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.event_loop = asyncio.get_running_loop()
        parser.start()  # its imports (~1.5 s of CPU) now, not during the first burst of large bodies
        structured = getattr(engine, "structured", None)
        if hasattr(structured, "start"):  # the grammar compile child, likewise (in the background)
            threading.Thread(target=structured.start, name="kvshare-grammar-start", daemon=True).start()
        loop.start()
        try:
            yield
        finally:
            loop.stop(timeout=2.0)  # a stuck engine thread (a daemon) must not hold the exit
            parser.close()
            if hasattr(structured, "close"):
                structured.close()

    app = FastAPI(title="kvshare", lifespan=lifespan)
    app.state.kvshare = state
    app.state.limits = limits
    app.state.body_parser = parser
    _install_error_handlers(app)
    install(app, access or AccessPolicy(), limits, state.metrics)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not loop.alive:
            return APIError(503, f"engine loop is not running: {loop.error!r}", code="engine_dead").response()
        if state.draining:
            return APIError(503, "the server is shutting down", code="shutting_down").response()
        if loop.stalled(watchdog_timeout_s):
            return APIError(503, f"the engine loop has not advanced for over {watchdog_timeout_s:g} s with "
                                 "requests pending", code="engine_stalled").response()
        if loop.step_overdue():  # a stopped tensor-parallel worker: seconds, not the step timeout
            return APIError(503, f"the engine step running now has taken over {loop.overdue_after_s:.3g} s "
                                 "(4x the longest recent step)", code="engine_stalled").response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)]).model_dump()

    @app.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorResponse,
                                                            "description": "No such model is served here."}})
    async def model(model_id: str) -> Response:
        _check_model(state, model_id)
        return JSONResponse(ModelCard(id=model_name, max_model_len=max_model_len).model_dump())

    @app.api_route("/v1/responses", methods=["GET", "POST"], include_in_schema=False)  # a 404 that says why
    async def responses_api() -> Response:
        return APIError(404, "the Responses API (/v1/responses) is not served; this server serves "
                             "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, "
                             "POST /detokenize", code="not_found").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    @_guarded(state)
    async def completions(request: Request) -> Response:
        slot = admit(state)  # the concurrency limit comes before any decoding
        try:
            req = await parser.parse(await request.body(), CompletionRequest)
            _check_model(state, req.model)
            ignored = _ignored(req)
            prompts = await _completion_prompts(state, req)
            max_tokens = 16 if req.max_tokens is None else req.max_tokens
            params = _sampling_params(state, req, max_tokens, max(len(p[0]) for p in prompts), "prompt")
            echo_lps = req.echo and req.logprobs is not None
            if echo_lps or req.prompt_logprobs is not None:  # echo needs the prompt tokens' logprobs
                params.prompt_logprobs = (max(req.num_logprobs or 0, req.prompt_logprobs or 0) if echo_lps
                                          else req.prompt_logprobs)
            if req.echo or req.prompt_logprobs is not None:
                check_reply_size(limits, req.n * sum(len(p[0]) for p in prompts), params.prompt_logprobs,
                                 "the echoed prompt" if req.echo else "prompt logprobs",
                                 "echo" if req.echo else "prompt_logprobs")
            options = ReplyOptions(logprobs=req.num_logprobs, echo=req.echo, prompt_logprobs=req.prompt_logprobs,
                                   return_token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids,
                                   include_usage=req.include_usage, continuous_usage=req.continuous_usage)
            return _named(await generate(state, request, Job("completion", prompts, params, req.n, req.stream,
                                                             options, req.cache_salt), slot=slot), ignored)
        except BaseException:
            slot.close()
            raise

    @app.post("/v1/chat/completions")
    @_guarded(state)
    async def chat_completions(request: Request) -> Response:
        slot = admit(state)  # the concurrency limit comes before any decoding
        try:
            req = await parser.parse(await request.body(), ChatCompletionRequest)
            _check_model(state, req.model)
            ignored = _ignored(req)
            try:
                conversation = req.conversation()
                extra: dict[str, Any] = {}
                if req.uses_tools:
                    extra["tools"] = req.tools
                if req.uses_tools or any(m.get("tool_calls") for m in conversation):
                    extra["tool_format"] = DSML_FORMAT
                if req.thinking:
                    extra["thinking"] = True
                render = functools.partial(tokenizer.apply_chat_template, conversation, add_generation_prompt=True,
                                           **extra)
                chars = sum(len(m["content"]) for m in conversation)
                _check_chars(state, chars, "messages")
                prompt_ids = list(await asyncio.to_thread(render) if chars > OFF_LOOP_BYTES else render())
            except (ValueError, TemplateError) as e:  # e.g. a template's raise_exception on role order
                raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
            prompt_ids = _truncated(prompt_ids, req.truncate_prompt_tokens)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = _sampling_params(state, req, max_tokens, len(prompt_ids), "messages")
            params.prompt_logprobs = req.prompt_logprobs
            if req.prompt_logprobs is not None:
                check_reply_size(limits, req.n * len(prompt_ids), req.prompt_logprobs, "prompt logprobs",
                                 "prompt_logprobs")
            params.structured = _tool_constraint(req) or params.structured
            options = ReplyOptions(logprobs=req.num_logprobs, prompt_logprobs=req.prompt_logprobs,
                                   return_token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids,
                                   include_usage=req.include_usage, continuous_usage=req.continuous_usage,
                                   tools=req.uses_tools, thinking=req.thinking,
                                   single_tool_call=req.parallel_tool_calls is False)
            return _named(await generate(state, request, Job("chat", [(prompt_ids, "")], params, req.n, req.stream,
                                                             options, req.cache_salt), slot=slot), ignored)
        except BaseException:
            slot.close()
            raise

    @app.post("/tokenize")
    @_guarded(state)
    async def tokenize(request: Request) -> Response:
        slot = admit(state)  # under the concurrency limit, like generation
        try:
            req = await parser.parse(await request.body(), TokenizeRequest)
            _check_model(state, req.model)
            return await tokenize_reply(state, req, limits)
        finally:
            slot.close()

    @app.post("/detokenize")
    @_guarded(state)
    async def detokenize(request: Request) -> Response:
        req = await parser.parse(await request.body(), DetokenizeRequest)
        _check_model(state, req.model)
        _check_ids(state, req.tokens, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest},
                    model_name)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> Response:
        return APIError(400, str(e.errors()[:1]), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code, headers=e.headers).response()  # keeps `Allow`



def _guarded(state: ServerState) -> Callable[[Handler], Handler]:
    """Turn an unexpected exception in a route into that request's 500 (the server keeps serving)."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                if e.status < 500:
                    state.metrics.requests_rejected += 1
                else:
                    state.metrics.requests_failed += 1
                return e.response()
            except Exception as e:
                log.exception("request failed")
                state.metrics.requests_failed += 1
                return internal_error(e).response()

        return guarded

    return wrap


async def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[tuple[list[int], str, Any]]:
    """Per prompt (token ids, text to echo, what the engine gets: the text, or ids when truncated)."""
    out: list[tuple[list[int], str, Any]] = []
    keep = req.truncate_prompt_tokens
    for p in req.prompts:
        if isinstance(p, list):
            _check_ids(state, p)
            ids = list(p)
            text = state.tokenizer.decode(ids) if req.echo else ""
        else:
            ids, text = await _encode(state, p), p
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            out.append((ids, state.tokenizer.decode(ids), ids))
        else:
            out.append((ids, text, p))
    return out


def _tool_constraint(req: ChatCompletionRequest) -> StructuredSpec | None:
    """The grammar that holds tool calls to their schemas (`tool_grammar`): a required or named
    tool_choice must call; `auto` may (unconstrained in thinking mode, whose reasoning the grammar does
    not model, and when response_format / structured_outputs constrains the output instead)."""
    if req.forced_tool is not False:
        name = req.forced_tool if isinstance(req.forced_tool, str) else None
        return StructuredSpec("grammar", tool_grammar(req.tools or [], name, parallel=req.parallel_tool_calls
                                                      is not False), "tool_choice")
    if req.uses_tools and not req.thinking and req.structured is None:
        return StructuredSpec("grammar", tool_grammar(req.tools or [], None, parallel=req.parallel_tool_calls
                                                      is not False, auto=True), "tools")
    return None


def _ignored(req: Any) -> list[str]:
    """The request's unknown fields, logged (vLLM's warning) and returned for the reply's header."""
    names = req.ignored_fields
    if names:
        log.warning("the request's fields %s are not known to kvshare and were ignored", ", ".join(names))
    return names


def _named(response: Response, ignored: list[str]) -> Response:
    """`response` with the `X-Ignored-Fields` header naming the ignored fields (when there are any)."""
    if ignored:
        response.headers["X-Ignored-Fields"] = ", ".join(ignored)[:1024]
    return response


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens."""
    return ids if keep is None else ids[-keep:]


async def _encode(state: ServerState, prompt: str) -> list[int]:
    """Token ids of a text prompt; 400 before tokenising when it cannot fit the context anyway."""
    _check_chars(state, len(prompt), "prompt")
    encode = functools.partial(state.tokenizer.encode, prompt, add_bos=True)
    return list(await asyncio.to_thread(encode) if len(prompt) > OFF_LOOP_BYTES else encode())


def _check_chars(state: ServerState, chars: int, param: str) -> None:
    """400 before tokenising a text that cannot fit the context anyway."""
    limit = state.max_model_len
    if limit is not None and chars > limit * MAX_CHARS_PER_TOKEN:
        raise APIError(400, f"the {param} text has {chars} characters, far more than this model's context of "
                            f"{limit} tokens holds; shorten it", param=param, code="context_length_exceeded")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")


def _check_ids(state: ServerState, ids: list[int], param: str = "prompt") -> None:
    vocab = getattr(state.tokenizer, "vocab_size", None)
    if vocab is not None and any(i >= vocab for i in ids):
        raise APIError(400, f"{param} token ids must be < vocab_size {vocab}", param=param,
                       code="invalid_value")


def _sampling_params(state: ServerState, req: Any, max_tokens: int | None, n_prompt: int, prompt_param: str) -> Any:
    """Engine SamplingParams for `req`; 400 when the prompt leaves no room to generate."""
    limit = state.max_model_len
    if limit is not None and n_prompt >= limit:
        raise APIError(400, f"the prompt has {n_prompt} tokens but this model's context is {limit} tokens; "
                            "shorten the prompt", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = state.default_max_tokens
        if limit is not None:
            max_tokens = max(1, min(max_tokens, limit - n_prompt))
    elif limit is not None and n_prompt + max_tokens > limit:
        raise APIError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceeds this "
                            f"model's context of {limit} tokens", param="max_tokens",
                       code="context_length_exceeded")
    sampling = {k: getattr(req, k) for k in _SAMPLING_FIELDS}
    sampling.update({k: v for k, v in state.sampling_defaults.items()
                     if k in _SAMPLING_FIELDS and k not in req.model_fields_set})
    return SamplingParams(**sampling, seed=req.seed, max_tokens=max_tokens, stop=list(req.stop),
                          ignore_eos=req.ignore_eos, logprobs=req.num_logprobs,
                          stop_token_ids=list(req.stop_token_ids or []), logit_bias=req.bias,
                          allowed_token_ids=req.allowed_token_ids, min_tokens=req.min_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output, structured=req.structured)


# Request fields a model's generation_config.json may default (a field the client sends wins).
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
