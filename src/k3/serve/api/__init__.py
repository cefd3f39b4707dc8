"""The OpenAI-compatible HTTP API over the engine (FastAPI): routes, bodies and errors, metrics, pages."""
