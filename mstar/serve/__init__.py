"""``mstar-kv serve``: the engine behind an OpenAI-compatible HTTP API
(FastAPI + uvicorn): ``create_app(engine, model_name=...)``."""
