"""OpenAI-compatible HTTP server: `create_app(engine, tokenizer, model_name)` and `serve(...)`.

Modules: `protocol` (request / response models), `errors` (OpenAI error bodies), `engine_loop`
(the one thread that steps the engine), `generation` (admission, streaming, disconnects),
`responses` (response bodies and SSE chunks), `metrics` (Prometheus text), `app` (routes),
`runner` (building the engine and running uvicorn).
"""

from kvshare.server.app import create_app

__all__ = ["create_app"]
