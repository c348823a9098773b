"""A GRPO-shaped RL loop on the CPU: AsyncLLM generates rollouts, a trainer process improves the
policy with a real optimizer step on a toy reward, and the new weights stream into the engine
mid-rollout (vLLM's weight-transfer protocol over gloo).

    .venv/bin/python examples/rl_loop.py [--model PATH] [--rounds 3] [--group 4] [--max-tokens 32]

Each round samples `--group` rollouts for each prompt. From the second round on, once a third
of the round's tokens have arrived, the engine pauses with its requests kept, the trainer
broadcasts the weights it trained on the previous round, and the engine resumes: the rollouts
finish on the new weights. Every token carries the weight_version that made it, and the trainer
checks each against transformers under that version's weights (examples/rl_trainer.py). Exits 1
if any token disagrees.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_trainer import (PROMPTS, Rollout, Trainer, add_loop_arguments, final_word,  # noqa: E402
                        quiet_logging, report_round, vowel_reward)

from treadle import AsyncLLM, SamplingParams  # noqa: E402
from treadle.models.loader import load_tokenizer, prepare_model  # noqa: E402
from treadle.sampling_params import RequestOutputKind  # noqa: E402

async def rollout(engine: AsyncLLM, r: Rollout, request_id: str, params: SamplingParams,
                  tokenizer) -> None:
    """Stream one rollout, keeping each token's weight_version, top token and logprob."""
    async for out in engine.generate({"prompt_token_ids": r.prompt_ids}, params, request_id):
        delta = out.outputs[0]
        for token, entry in zip(delta.token_ids, delta.logprobs or []):
            r.token_ids.append(token)
            r.versions.append(out.weight_version)
            r.logprobs.append(entry[token].logprob)
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            r.top_ids.append(top)
            r.top_logprobs.append(entry[top].logprob)
    r.reward = vowel_reward(tokenizer.decode(r.token_ids))


async def transfer(engine: AsyncLLM, trainer: Trainer) -> int:
    """Pause (requests kept), receive the trainer's newest weights, resume."""
    await engine.pause_generation(mode="keep")
    await engine.start_weight_update()
    version, update_info = trainer.start_send()
    await engine.update_weights({"update_info": update_info})
    trainer.sent()
    await engine.finish_weight_update(weight_version=version)
    await engine.resume_generation()
    return version


async def run(ns: argparse.Namespace) -> int:
    path = prepare_model(ns.model)
    tokenizer = load_tokenizer(path)
    engine = AsyncLLM(path, dtype="float32", seed=0, weight_transfer_config={"backend": "gloo"})
    trainer = Trainer(path, engine_world_size=1, lr=ns.lr)
    failed = False
    try:
        await engine.init_weight_transfer_engine({"init_info": trainer.init_info})
        trainer.connected()
        trained = None   # the version trained on the last round, sent mid-way through this one
        for round_ in range(ns.rounds):
            prompts = [tokenizer.encode(p) for p in PROMPTS]
            rollouts = [Rollout(ids, g) for g, ids in enumerate(prompts) for _ in range(ns.group)]
            tasks = [asyncio.create_task(rollout(
                engine, r, f"r{round_}-{i}",
                SamplingParams(temperature=1.0, max_tokens=ns.max_tokens, ignore_eos=True,
                               logprobs=1, seed=1000 * round_ + i,
                               output_kind=RequestOutputKind.DELTA), tokenizer))
                for i, r in enumerate(rollouts)]
            start = time.perf_counter()
            sent = None
            if trained is not None:
                while sum(len(r.token_ids) for r in rollouts) < len(rollouts) * ns.max_tokens / 3:
                    await asyncio.sleep(0.005)
                sent = await transfer(engine, trainer)
            await asyncio.gather(*tasks)
            logging.info("round %d: %d rollouts in %.1fs", round_, len(rollouts),
                         time.perf_counter() - start)
            failed |= report_round(round_, rollouts, sent, trainer.check(rollouts))
            trained = trainer.train(rollouts)
    finally:
        trainer.stop()
        engine.shutdown()
    return final_word(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_loop_arguments(parser)
    ns = parser.parse_args()
    quiet_logging()
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
