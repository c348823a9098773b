"""The `treadle` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from typing import NoReturn

from treadle.entrypoints.engine_cli_args import add_engine_args, engine_args_from


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [default: 0]")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace):
    from treadle.sampling_params import SamplingParams

    return SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, n=ns.n, seed=ns.sampling_seed,
        stop=ns.stop, presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        repetition_penalty=ns.repetition_penalty, ignore_eos=ns.ignore_eos)


def cmd_generate(ns: argparse.Namespace) -> int:
    from treadle import LLM

    params = sampling_params_from(ns)
    template = _chat_template(ns)
    llm = LLM(**engine_args_from(ns))
    if ns.raw:
        outputs = llm.generate(ns.prompts, params, use_tqdm=not ns.quiet)
    else:
        conversations = [[{"role": "user", "content": p}] for p in ns.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=not ns.quiet, chat_template=template)
    for prompt, out in zip(ns.prompts, outputs):
        sys.stdout.write(f"### {prompt}\n")
        for c in out.outputs:
            sys.stdout.write(f"{c.text}\n[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]\n")
        sys.stdout.write("\n")
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from treadle.entrypoints.chat import run_chat

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    return run_chat(engine_args_from(ns), sampling_params_from(ns), ns.system, _chat_template(ns))


def _chat_template(ns: argparse.Namespace) -> str | None:
    from treadle.entrypoints.chat_template import load_chat_template

    return load_chat_template(ns.chat_template) if ns.chat_template is not None else None


def _tree_size(path: str) -> int:
    if not os.path.isdir(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def _cache_entries(ns: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(kind, path, description) of every cached conversion and kernel build asked for."""
    from treadle.kernels.cpu import build_name, kernel_root
    from treadle.models.loader import gguf_cache_dir, gguf_source

    both = not (ns.gguf or ns.kernels)
    entries = []
    gguf_dir, kernel_dir = gguf_cache_dir(), str(kernel_root())
    if (both or ns.gguf) and os.path.isdir(gguf_dir):
        for name in sorted(os.listdir(gguf_dir)):
            path = os.path.join(gguf_dir, name)
            source = gguf_source(path)
            entries.append(("gguf", path, f"from {source}" if source else "unfinished or old format"))
    if (both or ns.kernels) and os.path.isdir(kernel_dir):
        # Only our own builds: TREADLE_KERNEL_DIR may point at a folder that holds other things.
        current = build_name()
        for name in sorted(os.listdir(kernel_dir)):
            if name.startswith("treadle_cpu_"):
                entries.append(("kernels", os.path.join(kernel_dir, name),
                                "built for this torch and CPU" if name == current else
                                "built for another torch installation, source or CPU"))
    return entries


def _hub_entries() -> list[tuple[str, str, str]]:
    """(kind, path, description) of the models in the Hugging Face cache (HF_HUB_CACHE)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:
        return []
    return [("hub", str(repo.repo_path), f"{repo.repo_id}, {len(repo.revisions)} revision(s)")
            for repo in sorted(repos, key=lambda r: r.repo_id) if repo.repo_type == "model"]


def cmd_cache(ns: argparse.Namespace) -> int:
    entries = _cache_entries(ns)
    if ns.cache_command == "list" and not (ns.gguf or ns.kernels):
        entries += _hub_entries()   # listed only: `hf cache rm` removes them
    total = 0
    for kind, path, description in entries:
        size = _tree_size(path)
        total += size
        if ns.cache_command == "clean":
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            sys.stdout.write(f"removed {path} ({size / 2**20:.1f} MiB)\n")
        else:
            sys.stdout.write(f"{kind:8s} {size / 2**20:9.1f} MiB  {path}  ({description})\n")
    if ns.cache_command == "clean":
        sys.stdout.write(f"removed {len(entries)} cache entries, {total / 2**20:.1f} MiB\n")
    else:
        sys.stdout.write(f"{len(entries)} cache entries, {total / 2**20:.1f} MiB\n")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from treadle.entrypoints.chat_template import load_chat_template
    from treadle.entrypoints.openai.cli_args import bind_socket
    from treadle.validate import json_dict
    from treadle.entrypoints.openai.tool_parsers import tool_parser_names

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(tool_parser_names())})")
    if ns.chat_template is not None:   # before the model loads: a typo costs a second
        ns.chat_template = load_chat_template(ns.chat_template)
    if ns.default_chat_template_kwargs is not None:
        ns.default_chat_template_kwargs = json_dict("--default-chat-template-kwargs",
                                                    ns.default_chat_template_kwargs,
                                                    kind="a JSON object")
    sock = bind_socket(ns.host, ns.port)
    from treadle.entrypoints.openai.server import run_server   # the web stack: seconds
    # A server's start-up stages (the engine's too) and request logs are its normal output, so
    # they show without -v.
    logging.getLogger("treadle").setLevel(logging.INFO)
    return run_server(ns, engine_args_from(ns), sock)


def cmd_disagg_proxy(ns: argparse.Namespace) -> int:
    from treadle.entrypoints import disagg_proxy   # the web stack, only when it runs

    return disagg_proxy.main(ns)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line: `treadle serve`'s full usage is dozens of lines of flags, and
    printed first it buries the one that was wrong. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="treadle",
        description="treadle: LLM inference on a paged KV cache. Runs the embedded "
                    "SmolLM2-135M-Instruct when no --model is given.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate completions for prompts",
                         description="Generate a reply for each prompt (through the chat template "
                                     "unless --raw).")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    gen.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                     help="chat template (a file, or inline) in place of the tokenizer's")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat REPL, streaming each reply",
                          description="Chat with the model, each reply streamed as it comes. "
                                      "/help in the chat lists its commands; Ctrl-C stops a "
                                      "reply, Ctrl-D leaves.")
    chat.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                      help="HF folder, .gguf file or Hugging Face Hub id (same as --model)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="chat template (a file, or inline) in place of the tokenizer's")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from treadle.entrypoints.openai import cli_args as serve_args
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description=serve_args.DESCRIPTION)
    serve_args.add_cli_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser(
        "disagg-proxy", help="prefill/decode disaggregation proxy",
        description="An OpenAI-compatible proxy in front of a prefill server (kv_producer) and a "
                    "decode server (kv_consumer): each request is prefilled on one with "
                    "max_tokens=1, then generated on the other, which loads the prompt's KV.")
    proxy.add_argument("--prefill", required=True, metavar="URL",
                       help="the prefill server, e.g. http://127.0.0.1:8100")
    proxy.add_argument("--decode", required=True, metavar="URL",
                       help="the decode server, e.g. http://127.0.0.1:8200")
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind [default: 127.0.0.1]")
    proxy.add_argument("--port", type=serve_args.port_number, default=8000,
                       help="port to bind [default: 8000]")
    proxy.set_defaults(func=cmd_disagg_proxy)

    cache = sub.add_parser(
        "cache", help="list or remove cached GGUF conversions and CPU kernel builds",
        description="GGUF conversions live in $TREADLE_CACHE_DIR/gguf (default ~/.cache/treadle), "
                    "CPU kernel builds in $TREADLE_KERNEL_DIR (default the cache's kernels/). "
                    "Both are rebuilt on demand. `list` also shows the models in the Hugging "
                    "Face cache, which `clean` leaves to `hf cache rm`.")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    for name, text in (("list", "show cached entries and their sizes"),
                       ("clean", "remove cached entries (all, unless --gguf or --kernels)")):
        p = cache_sub.add_parser(name, help=text, description=text)
        p.add_argument("--gguf", action="store_true", help="only GGUF conversions")
        p.add_argument("--kernels", action="store_true", help="only CPU kernel builds")
        p.set_defaults(func=cmd_cache)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    from treadle.bench import (floor, kv_tiers, kv_transfer, latency, parallel,
                               serve as bench_serve, spec_decode, structured, throughput,
                               weight_transfer)
    for name, module, text, takes_engine_args in (
            ("throughput", throughput, "offline throughput on a synthetic workload", True),
            ("latency", latency, "end-to-end latency of one batch", True),
            ("floor", floor, "batch-1 decode TPOT against the memory-bandwidth floor", True),
            ("spec", spec_decode, "n-gram speculative decoding against plain decoding", True),
            ("kv", kv_transfer, "TTFT of a long prefix loaded from a KV store vs recomputed", True),
            ("kv-tiers", kv_tiers, "multi-turn chats past the device cache: no KV tier, host "
             "memory, Redis, both", True),
            ("parallel", parallel, "mp executor step overhead; pipeline stages on long prefills",
             True),
            ("structured", structured, "the cost of a JSON-schema constraint per step, and "
             "of compiling one", True),
            ("weight-transfer", weight_transfer, "a full weight transfer from a trainer process "
             "over gloo, against an in-process update_weights", True),
            ("serve", bench_serve, "drive a running server over HTTP (TTFT, TPOT, ITL)", False)):
        p = bench_sub.add_parser(name, help=text, description=module.__doc__)
        module.add_cli_args(p)
        if takes_engine_args:
            add_engine_args(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except ValueError as e:
        parser.exit(2, f"treadle: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
