"""OpenAI-compatible HTTP server.

Modules: `protocol` (request / response models), `errors` (OpenAI error bodies), `engine_loop`
(the one thread that steps the engine), `generation` (admission, streaming, disconnects),
`responses` (response bodies and SSE chunks), `metrics` (Prometheus text), `app` (routes:
`create_app(engine, tokenizer, model_name)`). Nothing is imported here, so the CLI can use the
light modules without loading FastAPI.
"""
