"""The server's browser pages, with every asset served locally: the chat page (``GET /``, its files under
``/static/``) and Swagger UI at ``/docs`` (its script, style and icon under ``/docs/``, from the files that the
``fastapi-offline`` package ships: Swagger UI 5, which renders OpenAPI 3.1 as FastAPI writes it). Which of them
need the API key is the `Guard`'s rule."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from k3.serve.api.protocol import APIError

__all__ = ["add_pages"]

STATIC = Path(__file__).parent / "static"
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png"}


def _serve(known: dict[str, Path], name: str) -> FileResponse:
    """One of the ``known`` files by name; any other name is a 404 (no path is built from the request)."""
    if name not in known:
        raise APIError(404, f"no such file: {name!r}", code="not_found")
    return FileResponse(known[name], media_type=MEDIA_TYPES[known[name].suffix])


def add_pages(app: FastAPI) -> None:
    """Register ``/`` and ``/static/{name}`` (the chat page), ``/docs`` and ``/docs/{name}`` (Swagger UI)."""
    static = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES}
    swagger_ui = Path(str(files("fastapi_offline") / "static"))
    docs = {name: swagger_ui / name for name in DOCS_ASSETS}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return _serve(static, "chat.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        return _serve(static, name)

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API",
                                   swagger_js_url="/docs/swagger-ui-bundle.js", swagger_css_url="/docs/swagger-ui.css",
                                   swagger_favicon_url="/docs/favicon.png")

    @app.get("/docs/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> FileResponse:
        return _serve(docs, name)
