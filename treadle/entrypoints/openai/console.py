"""The web console: a chat playground and a live dashboard at `/`, as static files (no build
step, no CDN), plus the JSON they poll, `/v1/engine/status`.

The page holds nothing secret, so it loads without the API key; everything it asks of the
server goes through the ordinary endpoints, which still need the key when one is set. Open
besides: the icon, and `/console/config`, whether a key is needed (a 401 says as much), so that
a page without one asks for it instead of collecting 401s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse

from treadle.engine.async_llm import AsyncLLM

STATIC = Path(__file__).with_name("static")
ASSETS = {"console.js": "text/javascript", "console.css": "text/css",
          "favicon.svg": "image/svg+xml"}
HISTORY_SECONDS = 300   # how far back the throughput and TTFT charts go
SAMPLE_EVERY_S = 1.0


class History:
    """Output tokens/s and mean TTFT per second, from the Prometheus counters, for the last
    HISTORY_SECONDS: one point per second, kept by a task on the server's event loop."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.registry = engine.metrics.registry
        self.points: deque[dict[str, float | None]] = deque(maxlen=int(HISTORY_SECONDS / SAMPLE_EVERY_S))
        self._last: tuple[float, float, float, float] | None = None

    def _read(self) -> tuple[float, float, float, float]:
        get = self.registry.get_sample_value
        return (time.time(), get("treadle:generation_tokens_total") or 0.0,
                get("treadle:time_to_first_token_seconds_sum") or 0.0,
                get("treadle:time_to_first_token_seconds_count") or 0.0)

    def sample(self) -> None:
        now = self._read()
        if self._last is not None:
            t0, tokens0, ttft_sum0, ttft_n0 = self._last
            t, tokens, ttft_sum, ttft_n = now
            firsts = ttft_n - ttft_n0
            self.points.append({"t": t, "tokens_per_s": (tokens - tokens0) / max(t - t0, 1e-6),
                                "ttft_s": (ttft_sum - ttft_sum0) / firsts if firsts else None})
        self._last = now

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY_S)


def add_console(app: FastAPI, engine: AsyncLLM, serve_page: bool,
                api_key_required: bool) -> contextlib.AbstractAsyncContextManager:
    """Add the status endpoint, and the page unless `serve_page` is False; returns a context
    that samples the history while the app runs."""
    history = History(engine)

    @app.get("/v1/engine/status")
    async def engine_status() -> dict[str, Any]:
        status = await engine.get_engine_status()
        status["history"] = list(history.points)
        status["model"] = app.state.serving.model_name
        return status

    if serve_page:
        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            return FileResponse(STATIC / "index.html", media_type="text/html")

        # Before /console/{name}, which would take it for an asset.
        @app.get("/console/config", include_in_schema=False)
        async def config() -> dict[str, bool]:
            return {"api_key_required": api_key_required}

        @app.get("/console/{name}", include_in_schema=False)
        async def asset(name: str) -> FileResponse:
            if name not in ASSETS:
                raise HTTPException(404, f"no console asset {name!r}")
            return FileResponse(STATIC / name, media_type=ASSETS[name])

        # Browsers ask for it on any page without an icon link: a JSON endpoint opened in a tab.
        @app.get("/favicon.ico", include_in_schema=False)
        async def favicon() -> FileResponse:
            return FileResponse(STATIC / "favicon.svg", media_type=ASSETS["favicon.svg"])

    @contextlib.asynccontextmanager
    async def sampling() -> AsyncIterator[None]:
        task = asyncio.create_task(history.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return sampling()


def is_public(path: str) -> bool:
    """The page, its assets, its config and the icon: served without the API key."""
    return (path in ("/", "/favicon.ico", "/console/config")
            or (path.startswith("/console/") and path[len("/console/"):] in ASSETS))
