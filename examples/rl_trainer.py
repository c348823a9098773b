"""The trainer of the RL examples (rl_loop.py, rl_http.py), in a process of its own.

It holds a transformers copy of the policy and steps it with AdamW on a GRPO loss: rollouts come
in groups per prompt, each rollout's advantage is its reward against its group's mean and
spread, and the loss is minus the advantage times the rollout's token log-probabilities. It is
rank 0 of the weight-transfer group (treadle.rl.WeightSender) and broadcasts each new version.

It also keeps every version's weights, to check the engine: a rollout's tokens carry the
weight_version that produced them, and at every position the engine's most likely token (where
known: the OpenAI API names tokens by text), its log-probability and the sampled token's must be
transformers' under that version's weights.

The parent talks to it through a pipe (`Trainer`); each command gets one reply.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
from dataclasses import dataclass, field
from typing import Any

import torch

# A logprob computed by two fp32 programs (GEMMs summed in other orders) differs by a few ulps.
LOGPROB_TOLERANCE = 1e-3
PROMPTS = ["Write one sentence about the sea.", "Name a few colours you like.",
           "Tell me something about cats.", "Describe a quiet morning."]


@dataclass
class Rollout:
    prompt_ids: list[int]
    group: int                  # rollouts of one prompt share a group
    token_ids: list[int] = field(default_factory=list)
    versions: list[Any] = field(default_factory=list)      # the weight_version of each token
    top_ids: list[int | None] = field(default_factory=list)   # the engine's most likely token
    top_logprobs: list[float] = field(default_factory=list)   # ... and its logprob
    logprobs: list[float] = field(default_factory=list)       # the sampled token's logprob
    reward: float = 0.0


def vowel_reward(text: str) -> float:
    """The toy reward: the share of vowels among the letters (a policy can learn it fast)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(1, len(letters))


def _trainer_main(conn, model_path: str, world_size: int, lr: float) -> None:
    from transformers import AutoModelForCausalLM

    from treadle.rl import WeightSender

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    checker = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    version = 0
    kept = {version: {n: p.detach().clone() for n, p in policy.named_parameters()}}
    with WeightSender(world_size) as sender:
        conn.send(sender.init_info)
        sender.connect()
        conn.send("connected")
        while True:
            command, *args = conn.recv()
            if command == "exit":
                return
            if command == "train":
                _grpo_step(policy, optimizer, args[0])
                version += 1
                kept[version] = {n: p.detach().clone() for n, p in policy.named_parameters()}
                conn.send(version)
            elif command == "send":   # the update_info first: the engine receives while we send
                pairs = list(kept[version].items())
                conn.send((version, sender.update_info(pairs, packed=True)))
                sender.send(pairs, packed=True)
                conn.send("sent")
            elif command == "check":
                conn.send(_check(checker, kept, args[0]))


def _grpo_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
               rollouts: list[Rollout]) -> None:
    groups: dict[int, list[float]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r.reward)
    optimizer.zero_grad()
    tokens = sum(len(r.token_ids) for r in rollouts)
    for r in rollouts:
        rewards = torch.tensor(groups[r.group])
        advantage = (r.reward - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
        if not r.token_ids or advantage == 0:
            continue
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        logits = policy(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])
        (-(advantage * logprobs.sum()) / tokens).backward()
    optimizer.step()


@torch.inference_mode()
def _check(model: torch.nn.Module, kept: dict[Any, dict[str, torch.Tensor]],
           rollouts: list[Rollout]) -> dict[str, Any]:
    """Each token against transformers under the weights of its own version."""
    checked: dict[Any, int] = {}
    mismatches: list[str] = []
    params = dict(model.named_parameters())
    for version in sorted({v for r in rollouts for v in r.versions}):
        for name, tensor in kept[version].items():
            params[name].copy_(tensor)
        for i, r in enumerate(rollouts):
            positions = [j for j, v in enumerate(r.versions) if v == version]
            if not positions:
                continue
            ids = torch.tensor([r.prompt_ids + r.token_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
            logprobs = torch.log_softmax(logits, -1)
            for j in positions:
                top = int(logits[j].argmax())
                error = max(abs(float(logprobs[j, r.token_ids[j]]) - r.logprobs[j]),
                            abs(float(logprobs[j, top]) - r.top_logprobs[j]))
                if r.top_ids[j] not in (None, top) or error > LOGPROB_TOLERANCE:
                    mismatches.append(f"rollout {i} token {j} (version {version}): top {top} vs "
                                      f"{r.top_ids[j]}, logprobs off by {error:.2e}")
            checked[version] = checked.get(version, 0) + len(positions)
    return {"checked": checked, "mismatches": mismatches}


class Trainer:
    """The trainer process, from the engine's side."""

    def __init__(self, model_path: str, engine_world_size: int, lr: float = 1e-4) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_main,
                                args=(child, model_path, 1 + engine_world_size, lr), daemon=True)
        self.proc.start()
        self.init_info: dict[str, Any] = self._reply()

    def _reply(self, timeout: float = 600) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the trainer did not answer")
        return self.conn.recv()

    def connected(self) -> None:
        """Wait for the trainer to see every worker join (after the engine's init)."""
        assert self._reply() == "connected"

    def train(self, rollouts: list[Rollout]) -> int:
        """One optimizer step on these rollouts; returns the new version."""
        self.conn.send(("train", rollouts))
        return self._reply()

    def start_send(self) -> tuple[int, dict[str, Any]]:
        """Start broadcasting the newest version: (version, update_info). The engine's
        update_weights must run while the trainer sends; then call sent()."""
        self.conn.send(("send",))
        return self._reply()

    def sent(self) -> None:
        assert self._reply() == "sent"

    def check(self, rollouts: list[Rollout]) -> dict[str, Any]:
        self.conn.send(("check", rollouts))
        return self._reply()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    from treadle.models.loader import default_model_path

    parser.add_argument("--model", default=default_model_path(), help="HF folder or GGUF")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)


def quiet_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("treadle", "transformers", "openai", "httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def report_round(round_: int, rollouts: list[Rollout], sent: Any, report: dict[str, Any]) -> bool:
    """Log a round's outcome; True if any token disagreed with transformers."""
    mixed = sum(len(set(r.versions)) > 1 for r in rollouts)
    reward = sum(r.reward for r in rollouts) / len(rollouts)
    logging.info("round %d: mean reward %.3f; weights sent mid-way: %s; rollouts on two "
                 "versions: %d; tokens checked by version: %s; mismatches: %d", round_, reward,
                 sent, mixed, report["checked"], len(report["mismatches"]))
    for line in report["mismatches"][:5]:
        logging.error("  %s", line)
    return bool(report["mismatches"])


def final_word(failed: bool) -> int:
    logging.info("some tokens did not match transformers" if failed
                 else "every rollout token matched transformers under its own weights")
    return 1 if failed else 0
