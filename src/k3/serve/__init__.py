"""Serving: the continuous-batching engine, the K3 chat format and the OpenAI-compatible HTTP server."""
