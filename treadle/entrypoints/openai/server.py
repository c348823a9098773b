"""The FastAPI app and `run_server`: OpenAI-compatible endpoints, tokenizer endpoints, health,
and the RL controls (pause/resume, prefix cache reset, weight reload, sleep/wake).

`/metrics` serves every `treadle:*` metric in the Prometheus text format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import time
from types import FrameType
from typing import Annotated, Any, AsyncIterator, Literal

import psutil
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

import treadle
from treadle.engine.async_llm import AsyncLLM
from treadle.engine.errors import EngineBusyError, EngineDeadError
from treadle.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from treadle.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from treadle.entrypoints.openai.errors import OpenAIError, error_response
from treadle.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest,
                                                  UpdateWeightsRequest)
from treadle.entrypoints.openai.reasoning import ReasoningParser, get_reasoning_parser
from treadle.entrypoints.openai.serving import OpenAIServing
from treadle.entrypoints.openai.console import add_console, is_public
from treadle.entrypoints.openai.serving_chat import (ChatServing, check_default_template_kwargs,
                                                     encode_messages)
from treadle.entrypoints.openai.tool_parsers import get_tool_parser
from treadle.entrypoints.openai.tool_parsers.base import ToolParser
from treadle.entrypoints.openai.serving_completion import CompletionServing
from treadle.entrypoints.openai.weight_transfer_routes import add_weight_transfer_routes
from treadle.gc_freeze import freeze_startup_heap
from treadle.models.loader import prepare_model

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"   # the embedded model, when no MODEL is given


class APIKeyMiddleware:
    """Every path but /health, /metrics and the console's page needs `Authorization: Bearer
    <key>`. /metrics is open as in vLLM, where Prometheus scrapers expect it without a key;
    `metrics_require_api_key` guards it too. Plain ASGI, so streamed responses and disconnects
    pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_api_key: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = {"/health"} if metrics_require_api_key else {"/health", "/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self.open_paths
                and not is_public(scope["path"])):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key "
                                               "(expected 'Authorization: Bearer <key>')")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, model_names: list[str], model_path: str,
              api_key: str | None = None, max_log_len: int | None = None,
              log_requests: bool = False, tool_parser: ToolParser | None = None,
              reasoning_parser: ReasoningParser | None = None,
              console: bool = True, metrics_require_api_key: bool = False,
              max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              default_template_kwargs: dict[str, Any] | None = None) -> FastAPI:
    """The app serving `engine`; it shuts the engine down when the app stops. `tool_parser`
    finds tool calls for tool_choice "auto" (None: "auto" is refused), `reasoning_parser` a
    thinking model's chain of thought in chat replies (None: all content); `console`: the web
    console at / (the status endpoint it polls is always there); `metrics_require_api_key`:
    /metrics needs `api_key` too; a request body over `max_body_bytes` is a 413;
    `default_template_kwargs`: chat template variables a request gets unless it sets them."""
    serving = OpenAIServing(engine, model_names, max_log_len, log_requests)
    serving.default_template_kwargs = check_default_template_kwargs(default_template_kwargs or {},
                                                                    serving.template_variables)
    completions = CompletionServing(serving)
    chat = ChatServing(serving, tool_parser, reasoning_parser)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with history:
            yield
        serving.close()
        engine.shutdown()

    app = FastAPI(title="treadle", version=treadle.__version__, lifespan=lifespan)
    app.state.serving = serving   # _Server flags it at shutdown
    history = add_console(app, engine, serve_page=console, api_key_required=bool(api_key))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           metrics_require_api_key=metrics_require_api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)   # outermost: first
    _add_error_handlers(app)

    # -- OpenAI API --------------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "treadle",
             "root": model_path, "parent": None, "max_model_len": engine.max_model_len}
            for name in model_names]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    # -- tokenizer ---------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_request(body, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            # As chat requests (and vLLM's /tokenize): no special tokens on top of the
            # template's unless asked; TokenizeRequest's default True is the prompt's.
            add = "add_special_tokens" in body.model_fields_set and body.add_special_tokens
            _, tokens, _ = await encode_messages(serving, body, add)
        else:
            for name in ("continue_final_message", "chat_template_kwargs", "documents", "tools"):
                if getattr(body, name):
                    raise OpenAIError(400, f"{name} applies to messages, not to a prompt", name)
            tokens = await serving.off_loop(serving.encode, body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_request(body, body.model)
        vocab = len(serving.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens contains {bad[0]}, outside the vocabulary [0, {vocab})",
                              "tokens")
        return {"prompt": await serving.off_loop(serving.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = serving.tokenizer
        return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
                "model_max_length": engine.max_model_len, "bos_token": tok.bos_token,
                "bos_token_id": tok.bos_token_id, "eos_token": tok.eos_token,
                "eos_token_id": engine.input_processor.eos_token_id, "pad_token": tok.pad_token,
                "unk_token": tok.unk_token, "chat_template": tok.chat_template}

    # -- service -----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if serving.shutting_down:
            return error_response(503, "the server is shutting down")
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(503, f"the engine is unhealthy: {e}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": treadle.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    # -- RL controls -------------------------------------------------------------------------
    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort",
                    clear_cache: bool = True) -> dict:
        await _control(engine.pause_generation(mode=mode, clear_cache=clear_cache))
        return {"status": "paused", "mode": mode}

    @app.post("/resume")
    async def resume() -> dict:
        await engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": await engine.is_paused()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> dict:
        return {"success": await _control(engine.reset_prefix_cache(reset_running_requests))}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict:
        serving.check_request(body, None)
        count, version = await _control(engine.labelled("load_weights", body.path,
                                                        body.weight_version))
        return {"success": True, "num_tensors": count, "weight_version": version}

    @app.get("/weight_version")
    async def weight_version() -> dict:
        return {"weight_version": await engine.get_weight_version()}

    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        await _control(engine.sleep(level))
        return {"status": "sleeping", "level": level}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict:
        await _control(engine.wake_up(tags))
        return {"status": "awake"}

    add_weight_transfer_routes(app, engine)
    return app


async def _control(call: Any) -> Any:
    """An RL control: bad arguments are a 400, a state that forbids it (running requests) a 409."""
    try:
        return await call
    except (ValueError, OSError) as e:
        raise OpenAIError(400, str(e)) from None
    except EngineDeadError:
        raise
    except RuntimeError as e:
        raise OpenAIError(409, str(e)) from None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON: {first.get('ctx', {}).get('error', '')}")
        messages = []
        for e in errors:
            loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "query"))
            messages.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or _named_at_start(first)
        return error_response(400, "; ".join(messages), param)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineBusyError)
    async def engine_busy(_: Request, exc: EngineBusyError) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        # Unavailable, as /health says, and for good: a supervisor restarts the server.
        logger.error("%s %s: %s", request.method, request.url.path, exc)
        return error_response(503, f"the engine failed and serves nothing more: {exc}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this response is sent, and uvicorn logs the traceback.
        logger.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
        return error_response(500, "internal server error; see the server log")


_REQUEST_FIELDS = frozenset().union(*(model.model_fields for model in (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
    UpdateWeightsRequest)))


def _named_at_start(error: dict) -> str | None:
    """The field a whole-body validator's error starts with ("`messages.0.content` is not
    valid ...", "stream_options can only be set ..."): such an error has no location of its
    own, and its `param` would otherwise be null."""
    cause = error.get("ctx", {}).get("error")
    if not isinstance(cause, ValueError):
        return None
    name = re.match(r"`([^`]+)`|(\w+)", str(cause))
    if name is None:
        return None
    return name.group(1) or (name.group(2) if name.group(2) in _REQUEST_FIELDS else None)


class _Server(uvicorn.Server):
    """uvicorn's server, with a graceful shutdown that ends open streams cleanly.

    On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections; here new
    generation requests also get 503, running ones have `shutdown_timeout` seconds to finish,
    then the rest are aborted, so their streams end with finish_reason "abort" and [DONE].
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncLLM,
                 shutdown_timeout: float, phases: list[tuple[str, float]]) -> None:
        super().__init__(config)
        self._app = app
        self._engine = engine
        self._shutdown_timeout = shutdown_timeout
        self._phases = phases   # (start-up phase, process age at its end)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        host, port = sockets[0].getsockname()[:2]   # the port the OS chose, for --port 0
        logger.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
        ready = process_age()
        parts, begin = [], 0.0
        for name, end in [*self._phases, ("HTTP server", ready)]:
            parts.append(f"{name} {end - begin:.1f} s")
            begin = end
        logger.info("ready to serve %s, %.1f s after the process started: %s",
                    ", ".join(self._app.state.serving.model_names), ready, ", ".join(parts))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler, except that it does not keep the signal to re-raise after
        # serve() returns: a signal is how this server is meant to stop, and it exits 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        self._app.state.serving.shutting_down = True   # new generation requests get 503
        drain = asyncio.create_task(self._drain())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._shutdown_timeout
        engine = self._engine
        while engine.output_processor.has_unfinished_requests() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.output_processor.has_unfinished_requests():
            logger.info("aborting the requests still running after %.1f s", self._shutdown_timeout)
            # Pausing in abort mode ends every request, and refuses any that races in.
            await engine.pause_generation(mode="abort", clear_cache=False)


def _stage_done(phases: list[tuple[str, float]], name: str, detail: str = "") -> None:
    """Mark the end of a start-up stage, and log it now: a start-up on a loaded machine can take
    a minute, and should not look hung."""
    end = process_age()
    took = end - (phases[-1][1] if phases else 0.0)
    phases.append((name, end))
    logger.info("start-up: %s in %.1f s%s (%.1f s since the process started)", name, took,
                f": {detail}" if detail else "", end)


def process_age() -> float:
    """Seconds since this process started, the interpreter's own start-up included."""
    try:
        # Linux: the start in clock ticks since boot. psutil adds a boot time rounded to the
        # second, too coarse for a start-up that takes a few.
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()


def run_server(ns: argparse.Namespace, engine_args: dict[str, Any], sock: socket.socket) -> int:
    """Build the engine, then serve on `sock` (bound, not yet listening) until SIGTERM/SIGINT;
    returns the exit code."""
    phases: list[tuple[str, float]] = []
    _stage_done(phases, "imports")
    # A Hub model may be downloaded, and a GGUF is converted once per content, ~20 s; timed on
    # their own, as they take ms afterwards.
    model_path = prepare_model(engine_args.get("model"), engine_args.get("revision"),
                               engine_args.get("download_dir"))
    _stage_done(phases, "model files", model_path)
    logger.info("loading the engine")
    engine = AsyncLLM(**{**engine_args, "model": model_path}, engine_process=ns.engine_process)
    _stage_done(phases, "engine")
    if ns.chat_template is not None:   # read and parsed by `treadle serve` before the load
        engine.get_tokenizer().chat_template = ns.chat_template
    names = ns.served_model_name or [engine_args.get("model") or DEFAULT_SERVED_NAME]
    tool_parser = get_tool_parser(ns.tool_call_parser) if ns.enable_auto_tool_choice else None
    app = build_app(engine, names, model_path, api_key=ns.api_key, max_log_len=ns.max_log_len,
                    log_requests=ns.enable_log_requests, tool_parser=tool_parser,
                    reasoning_parser=(get_reasoning_parser(ns.reasoning_parser)
                                      if ns.reasoning_parser is not None else None),
                    console=not ns.no_console, max_body_bytes=ns.max_request_body_bytes,
                    metrics_require_api_key=ns.metrics_require_api_key,
                    default_template_kwargs=ns.default_chat_template_kwargs)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            timeout_graceful_shutdown=ns.shutdown_timeout + 10)
    freeze_startup_heap("the server")
    _stage_done(phases, "garbage collector")
    _Server(config, app, engine, ns.shutdown_timeout, phases).run(sockets=[sock])
    return 0
