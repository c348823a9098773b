"""The RL loop of rl_loop.py against `treadle serve`: rollouts through the openai SDK, weights
through the server's weight-transfer routes (vLLM's: /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update), pauses through /pause and /resume.

    .venv/bin/python examples/rl_http.py [--model PATH] [--rounds 3] [--group 4] [--max-tokens 32]
    .venv/bin/python examples/rl_http.py --url http://host:8000 --model PATH   # a running server

Without --url it starts `treadle serve --weight-transfer-config '{"backend": "gloo"}'` on a free
port itself. A server started by hand needs that option, and --model must be the folder it
serves (the trainer loads the same weights). Each streamed chunk carries `weight_version`, so
every token is checked against transformers under the weights that made it. Exits 1 if any
token disagrees.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aiohttp  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from rl_trainer import (PROMPTS, Rollout, Trainer, add_loop_arguments, final_word,  # noqa: E402
                        quiet_logging, report_round, vowel_reward)

from treadle.models.loader import load_tokenizer, prepare_model  # noqa: E402

def start_server(path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="treadle-rl-http-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "treadle.entrypoints.cli", "serve", path,
                             "--port", str(port), "--dtype", "float32", "--seed", "0",
                             "--weight-transfer-config", '{"backend": "gloo"}'],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"treadle serve exited; its log: {log.name}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"treadle serve did not start; its log: {log.name}")


async def rollout(client: AsyncOpenAI, model: str, r: Rollout, seed: int, max_tokens: int,
                  tokenizer) -> None:
    stream = await client.completions.create(
        model=model, prompt=r.prompt_ids, max_tokens=max_tokens, temperature=1.0, seed=seed,
        logprobs=1, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        for choice in chunk.choices:
            lps = choice.logprobs
            for k, token in enumerate(choice.token_ids or []):
                r.token_ids.append(token)
                r.versions.append(chunk.weight_version)
                r.logprobs.append(lps.token_logprobs[k])
                r.top_ids.append(None)   # named by text here: the check compares logprobs
                r.top_logprobs.append(max(lps.top_logprobs[k].values()))
    r.reward = vowel_reward(tokenizer.decode(r.token_ids))


async def post(http: aiohttp.ClientSession, route: str, **body) -> dict:
    async with http.post(route, json=body or None) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {route}: {response.status} {await response.text()}")
        return await response.json()


async def transfer(http: aiohttp.ClientSession, trainer: Trainer) -> int:
    """Pause (requests kept), receive the trainer's newest weights, resume."""
    await post(http, "/pause?mode=keep")
    await post(http, "/start_weight_update")
    version, update_info = trainer.start_send()
    await post(http, "/update_weights", update_info=update_info)
    trainer.sent()
    await post(http, "/finish_weight_update", weight_version=version)
    await post(http, "/resume")
    return version


async def run(ns: argparse.Namespace) -> int:
    path = prepare_model(ns.model)
    tokenizer = load_tokenizer(path)
    server, url = (None, ns.url) if ns.url else start_server(path)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=ns.api_key or "none")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    trainer = Trainer(path, engine_world_size=ns.engine_world_size, lr=ns.lr)
    failed = False
    try:
        async with aiohttp.ClientSession(base_url=url, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            model = (await client.models.list()).data[0].id
            await post(http, "/init_weight_transfer_engine", init_info=trainer.init_info)
            trainer.connected()
            trained = None
            for round_ in range(ns.rounds):
                prompts = [tokenizer.encode(p) for p in PROMPTS]
                rollouts = [Rollout(ids, g) for g, ids in enumerate(prompts) for _ in range(ns.group)]
                tasks = [asyncio.create_task(rollout(client, model, r, 1000 * round_ + i,
                                                     ns.max_tokens, tokenizer))
                         for i, r in enumerate(rollouts)]
                sent = None
                if trained is not None:
                    while sum(len(r.token_ids) for r in rollouts) < len(rollouts) * ns.max_tokens / 3:
                        await asyncio.sleep(0.005)
                    sent = await transfer(http, trainer)
                await asyncio.gather(*tasks)
                failed |= report_round(round_, rollouts, sent, trainer.check(rollouts))
                trained = trainer.train(rollouts)
    finally:
        trainer.stop()
        if server is not None:
            server.terminate()
            server.wait(30)
    return final_word(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_loop_arguments(parser)
    parser.add_argument("--url", default=None, help="a running treadle serve [default: start one]")
    parser.add_argument("--api-key", default=os.environ.get("TREADLE_API_KEY"))
    parser.add_argument("--engine-world-size", type=int, default=1,
                        help="the server's workers (pipeline x tensor parallel) [default: 1]")
    ns = parser.parse_args()
    quiet_logging()
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
