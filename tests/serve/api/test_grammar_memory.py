"""The compiled-grammar cache is bounded by bytes (issue 35): a real `k3 serve` process answering many distinct
hostile-but-compilable schemas keeps its resident memory near its ``--grammar-cache-mb`` budget, where a cache bounded
only by count keeps every compiled grammar (each of these holds about 10 MB)."""

from __future__ import annotations

import json

import hostile_schemas
import serving
from http_api import MODEL, raw
from processes import rss_mib, start_server
from k3.model.checkpoint import save_model

SCHEMAS = 12
BRANCHES = 1200  # about 10 MB compiled, about half a second to compile


def test_resident_memory_stays_bounded_over_many_distinct_hostile_schemas(tmp_path):
    ckpt = save_model(tmp_path / MODEL, serving.model(), serving.tokenizer())
    proc, port = start_server(ckpt, "--grammar-cache-mb", "16")
    url, key = f"http://127.0.0.1:{port}", {"authorization": "Bearer k"}

    def ask(schema: dict) -> None:
        code, data = raw(url, "POST", "/v1/chat/completions", json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode(),
            headers=key)
        assert code == 200, data

    try:
        for tag in ("w", "x"):  # the compile child, the tokenizer view and the allocator's first arenas
            ask(hostile_schemas.any_of_objects(BRANCHES, tag))
        before = rss_mib(proc.pid)
        for v in range(SCHEMAS):
            ask(hostile_schemas.any_of_objects(BRANCHES, f"v{v}_"))
        grown = rss_mib(proc.pid) - before
        assert grown < 64, f"resident memory grew by {grown:.0f} MB over {SCHEMAS} distinct schemas"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
