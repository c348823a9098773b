"""`treadle serve` flags. Kept apart from server.py so that `treadle --help` does not import
FastAPI and uvicorn."""

from __future__ import annotations

import argparse
import os
import socket

from treadle.structured_output.reasoning import reasoning_parser_names
from treadle.entrypoints.openai.tool_parsers import tool_parser_names

# Bodies past this are refused (413) before they are read: parsing and tokenizing a prompt costs
# about a second per MB, and a 1M-token context is only a few MB of text or JSON token ids.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
               "/v1/chat/completions, ...) plus the RL controls (/pause, /resume, ...). "
               "With no MODEL, the embedded SmolLM2-135M-Instruct.")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {port}")
    return port


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF folder, .gguf file or Hugging Face Hub id (same as --model)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind [default: 127.0.0.1]")
    g.add_argument("--port", type=port_number, default=8000,
                   help="port to bind, 0..65535 (0: any free port) [default: 8000]")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported in responses "
                        "[default: MODEL as given, or SmolLM2-135M-Instruct]")
    g.add_argument("--api-key", default=os.environ.get("TREADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "and /metrics [default: $TREADLE_API_KEY, else none]")
    g.add_argument("--metrics-require-api-key", action="store_true",
                   help="with --api-key, require it on /metrics too (Prometheus then needs "
                        "the key: its scrape config's authorization) [default: /metrics is "
                        "open, as in vLLM]")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request (prompts, sampling params) and each disconnect at INFO "
                        "[default: off; they log at DEBUG]")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="longest prompt (chars or token ids) shown in request logs [default: all]")
    g.add_argument("--max-request-body-bytes", type=positive_int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help="refuse request bodies larger than this with HTTP 413, before reading them "
                        f"[default: {DEFAULT_MAX_REQUEST_BODY_BYTES} (32 MiB)]")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM/SIGINT before "
                        "they are aborted [default: 10]")
    g.add_argument("--no-console", action="store_true",
                   help="do not serve the web console (chat playground and dashboard) at /")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs '
                        "--tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="how tool calls look in the model's text [default: none]")
    g.add_argument("--reasoning-parser", default=None, choices=reasoning_parser_names(),
                   help="how a thinking model's chain of thought is marked in its text: chat "
                        "replies carry it in `reasoning` (and `reasoning_content`), the answer "
                        "in `content`; grammars bind after it [default: none]")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template to serve with, from a file or given inline, in place "
                        "of the tokenizer's [default: the tokenizer's]")
    g.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help='template variables every chat request gets unless it sets them in its '
                        'chat_template_kwargs, e.g. \'{"enable_thinking": false}\' [default: none]')
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own, as vLLM does, so that the "
                        "HTTP event loop and the step loop share no GIL; --no-engine-process "
                        "steps it on a thread of the server's process [default: on]")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (access log at info) [default: info]")


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound first: a port in use is an error in a second, not after the
    engine has loaded. uvicorn listens on it (SO_REUSEADDR, as on a socket of its own)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"treadle serve: error: cannot listen on {host}:{port}: "
                         f"{e.strerror or e}") from None
    return sock

