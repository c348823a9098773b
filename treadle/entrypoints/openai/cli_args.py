"""`treadle serve` flags. Kept apart from server.py so that `treadle --help` does not import
FastAPI and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os

from treadle.entrypoints.openai.tool_parsers import tool_parser_names

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
               "/v1/chat/completions, ...) plus the RL controls (/pause, /resume, ...). "
               "With no MODEL, the embedded SmolLM2-135M-Instruct.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF folder or .gguf file (same as --model)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind [default: 127.0.0.1]")
    g.add_argument("--port", type=int, default=8000, help="port to bind [default: 8000]")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported in responses "
                        "[default: MODEL as given, or SmolLM2-135M-Instruct]")
    g.add_argument("--api-key", default=os.environ.get("TREADLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "[default: $TREADLE_API_KEY, else none]")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request (prompts, sampling params) and each disconnect at INFO "
                        "[default: off; they log at DEBUG]")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="longest prompt (chars or token ids) shown in request logs [default: all]")
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
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (access log at info) [default: info]")


def main(ns: argparse.Namespace) -> int:
    from treadle.entrypoints.cli import engine_args_from
    from treadle.entrypoints.openai.server import run_server

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(tool_parser_names())})")
    # A server's startup and request logs are its normal output, so they show without -v.
    logging.getLogger("treadle.entrypoints.openai").setLevel(logging.INFO)
    return run_server(ns, engine_args_from(ns))
