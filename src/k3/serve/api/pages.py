"""The server's browser pages, with every asset served locally: the chat page (``GET /``, its files under
``/static/``) and Swagger UI at ``/docs`` (its script, style and icon under ``/docs/``, from the files that the
``fastapi-offline`` package ships: Swagger UI 5, which renders OpenAPI 3.1 as FastAPI writes it). Which of them
need the API key is the `Guard`'s rule.

Both pages come with a Content-Security-Policy that lets them run only this server's scripts and talk only to this
server (the chat page has no inline code at all; Swagger UI's one inline script is allowed by its hash), and
``X-Frame-Options: DENY`` (no other site can frame them to trick a click); every file is ``nosniff``.
"""

from __future__ import annotations

import base64
import hashlib
import re
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
#: What both pages may do: this server's scripts, styles and images (and ``data:`` icons), requests to this server
#: only; no plugins, no frames, no form posts elsewhere, no <base> rewriting.
POLICY = ("default-src 'none'; script-src 'self'{scripts}; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _headers(inline_script: str | None = None) -> dict[str, str]:
    """The security headers of a page: its Content-Security-Policy (allowing ``inline_script`` by its SHA-256), no
    framing, no content sniffing."""
    scripts = "" if inline_script is None else \
        f" 'sha256-{base64.b64encode(hashlib.sha256(inline_script.encode()).digest()).decode()}'"
    policy = POLICY.format(scripts=scripts)
    return {"Content-Security-Policy": policy, "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff"}


def _serve(known: dict[str, Path], name: str, page: dict[str, str]) -> FileResponse:
    """One of the ``known`` files by name (an HTML file with the ``page`` headers); any other name is a 404 (no
    path is built from the request)."""
    if name not in known:
        raise APIError(404, f"no such file: {name!r}", code="not_found")
    suffix = known[name].suffix
    headers = page if suffix == ".html" else {"X-Content-Type-Options": "nosniff"}
    return FileResponse(known[name], media_type=MEDIA_TYPES[suffix], headers=headers)


def add_pages(app: FastAPI) -> None:
    """Register ``/`` and ``/static/{name}`` (the chat page), ``/docs`` and ``/docs/{name}`` (Swagger UI)."""
    static = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES}
    swagger_ui = Path(str(files("fastapi_offline") / "static"))
    docs = {name: swagger_ui / name for name in DOCS_ASSETS}
    chat_headers = _headers()

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return _serve(static, "chat.html", chat_headers)

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        return _serve(static, name, chat_headers)

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui_page() -> HTMLResponse:
        page = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API",
                                   swagger_js_url="/docs/swagger-ui-bundle.js", swagger_css_url="/docs/swagger-ui.css",
                                   swagger_favicon_url="/docs/favicon.png").body.decode()
        (inline,) = re.findall(r"<script>(.*?)</script>", page, re.DOTALL)  # the call that starts Swagger UI
        return HTMLResponse(page, headers=_headers(inline))

    @app.get("/docs/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> FileResponse:
        return _serve(docs, name, {})
