"""`treadle disagg-proxy`: an OpenAI-compatible front for prefill/decode disaggregation.

Each completion or chat request goes first to the prefill server with max_tokens=1, which
computes the prompt's KV and saves it through its KV connector (a `kv_producer`); then to the
decode server (a `kv_consumer`), which loads that KV and generates. Whatever
`kv_transfer_params` the prefill answer carries are passed on to the decode request. The
decode answer, streamed or not, is relayed as it comes. A server that cannot be reached is a
503 with a clear error body; a decode server that dies mid-stream ends the stream with an error
event, so no client waits for tokens that are not coming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any, AsyncIterator

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0   # seconds to reach a server; reads wait as long as generation takes


class UpstreamError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status)
        self.status, self.body = status, body


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 503: "ServiceUnavailable"}.get(status, "ProxyError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The same request, cut to one generated token and no stream: only its KV matters."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"], out["n"] = 1, 1
    out.pop("min_tokens", None)   # it may not pass max_tokens; the decode request keeps it
    if chat:
        out.pop("max_completion_tokens", None)
    return out


def build_app(prefill_url: str, decode_url: str) -> FastAPI:
    app = FastAPI(title="treadle disagg-proxy")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
    state: dict[str, aiohttp.ClientSession] = {}

    @app.on_event("startup")
    async def open_session() -> None:
        state["session"] = aiohttp.ClientSession(timeout=timeout)

    @app.on_event("shutdown")
    async def close_session() -> None:
        await state["session"].close()

    async def post_json(url: str, path: str, body: dict[str, Any],
                        headers: dict[str, str]) -> dict[str, Any]:
        try:
            async with state["session"].post(url + path, json=body, headers=headers) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    raise UpstreamError(resp.status, data)
                return data
        except aiohttp.ClientError as e:
            raise UpstreamError(503, error_body(f"server {url} is unreachable: {e}", 503)) from e

    async def relay(path: str, request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            return JSONResponse(error_body(f"the body is not valid JSON: {e}", 400), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object", 400), 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            prefilled = await post_json(prefill_url, path, prefill_body(body, chat), headers)
            if prefilled.get("kv_transfer_params") is not None:
                body = {**body, "kv_transfer_params": prefilled["kv_transfer_params"]}
            if not body.get("stream"):
                return await answer_unless_gone(request, post_json(decode_url, path, body, headers))
            session = state["session"]
            resp = await session.post(decode_url + path, json=body, headers=headers)
        except UpstreamError as e:
            return JSONResponse(e.body, status_code=e.status)
        except aiohttp.ClientError as e:
            return JSONResponse(error_body(f"server {decode_url} is unreachable: {e}", 503), 503)
        if resp.status != 200:
            data = await resp.json(content_type=None)
            resp.release()
            return JSONResponse(data, status_code=resp.status)
        return StreamingResponse(stream(resp), media_type="text/event-stream")

    async def answer_unless_gone(request: Request, decoding: Any) -> Response:
        """The decode server's answer; a client that goes away first cancels the call, and
        the decode server, its connection closed, aborts the request (as a single server
        does for its own client)."""
        task = asyncio.ensure_future(decoding)
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)   # no one reads it
        return JSONResponse(task.result())

    async def stream(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, ConnectionError) as e:
            logger.warning("decode server failed mid-stream: %s", e)
            error = error_body(f"decode server {decode_url} failed mid-stream: {e}", 503)
            yield f"\n\ndata: {json.dumps(error)}\n\n".encode()
        finally:
            resp.release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay("/v1/chat/completions", request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            async with state["session"].get(decode_url + "/v1/models", headers=headers) as resp:
                return JSONResponse(await resp.json(content_type=None), status_code=resp.status)
        except aiohttp.ClientError as e:
            return JSONResponse(error_body(f"server {decode_url} is unreachable: {e}", 503), 503)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                async with state["session"].get(url + "/health") as resp:
                    if resp.status != 200:
                        return JSONResponse(error_body(f"server {url} is unhealthy", 503), 503)
            except aiohttp.ClientError:
                return JSONResponse(error_body(f"server {url} is unreachable", 503), 503)
        return Response(status_code=200)

    return app


def main(ns: argparse.Namespace) -> int:
    logging.getLogger("treadle.entrypoints").setLevel(logging.INFO)
    app = build_app(ns.prefill.rstrip("/"), ns.decode.rstrip("/"))
    logger.info("proxying prefill %s and decode %s on %s:%d", ns.prefill, ns.decode, ns.host,
                ns.port)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0
