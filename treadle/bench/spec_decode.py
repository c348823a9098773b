"""N-gram speculative decoding against plain decoding, on four workloads, in one process:
  - rewrite: chat prompts asking the model to copy a code snippet (drafts should hit);
  - chat: open questions through the chat template (natural text, few repeats);
  - chat-sampled: the same questions sampled at temperature 1 with a seed (the least
    repetitive: most drafts are rejected, so this shows what failed drafts cost);
  - random: prompts of random ordinary tokens (small models often loop on these).
Each request generates exactly --output-len tokens (ignore_eos). Reports output
tokens/s with and without drafts, the speed-up, the acceptance rate and the mean accepted
length (tokens per verifying step, bonus included), and checks the outputs are identical."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from treadle.bench.throughput import machine, make_workload
from treadle.core.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

_SNIPPETS = [
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n        self.items = {}\n\n"
    "    def get(self, key):\n        if key not in self.items:\n            return None\n"
    "        value = self.items.pop(key)\n        self.items[key] = value\n        return value\n\n"
    "    def put(self, key, value):\n        if key in self.items:\n            self.items.pop(key)\n"
    "        elif len(self.items) >= self.capacity:\n            oldest = next(iter(self.items))\n"
    "            self.items.pop(oldest)\n        self.items[key] = value\n",
    "def merge_sort(values):\n    if len(values) <= 1:\n        return values\n    middle = len(values) // 2\n"
    "    left = merge_sort(values[:middle])\n    right = merge_sort(values[middle:])\n    merged = []\n"
    "    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n            i += 1\n        else:\n            merged.append(right[j])\n"
    "            j += 1\n    merged.extend(left[i:])\n    merged.extend(right[j:])\n    return merged\n",
    "def word_counts(path):\n    counts = {}\n    with open(path) as f:\n        for line in f:\n"
    "            for word in line.lower().split():\n                word = word.strip('.,;:!?')\n"
    "                if not word:\n                    continue\n                counts[word] = counts.get(word, 0) + 1\n"
    "    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)\n"
    "    for word, count in ranked[:10]:\n        print(f'{word}: {count}')\n    return ranked\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n"
    "            raise IndexError('pop from an empty stack')\n        return self.items.pop()\n\n"
    "    def peek(self):\n        if not self.items:\n            return None\n        return self.items[-1]\n\n"
    "    def __len__(self):\n        return len(self.items)\n",
]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=4, help="requests per workload [default: 4]")
    g.add_argument("--batch-size", type=int, default=1,
                   help="requests running at once (max_num_seqs) [default: 1]")
    g.add_argument("--output-len", type=int, default=128, help="tokens per request [default: 128]")
    g.add_argument("--random-input-len", type=int, default=64,
                   help="prompt length of the random workload [default: 64]")
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="k [default: 3]")
    g.add_argument("--prompt-lookup-min", type=int, default=2)
    g.add_argument("--prompt-lookup-max", type=int, default=4)
    g.add_argument("--output-json", default=None, metavar="PATH", help="also save the figures here")


_QUESTIONS = [
    "Why do leaves change colour in autumn?",
    "Give three tips for a first-time gardener.",
    "What was the Silk Road, and why did it matter?",
    "How does a bicycle stay upright while moving?",
]


def chat_prompts(tokenizer: Any, contents: list[str], system: str | None = None) -> list[list[int]]:
    prompts = []
    for content in contents:
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


_REWRITE_SYSTEM = ("You copy code. Reply with the code exactly as given, in a python code block, "
                   "and nothing else.")


def rewrite_prompts(tokenizer: Any, num: int) -> list[list[int]]:
    """Snippets of 104-142 tokens, about as long as the default output, so the answer is
    mostly the copy (with a 60-token snippet, half the answer was the model's chatter)."""
    return chat_prompts(tokenizer, [f"```python\n{_SNIPPETS[i % len(_SNIPPETS)]}```" for i in range(num)],
                        system=_REWRITE_SYSTEM)


def _timed(llm: Any, prompts: list[list[int]], output_len: int,
           temperature: float = 0.0) -> tuple[float, list[list[int]]]:
    from treadle import SamplingParams

    # Seeded, so sampled output is identical with and without drafts (and checked to be).
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                            seed=0 if temperature > 0 else None)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main(ns: argparse.Namespace) -> int:
    from treadle import LLM
    from treadle.entrypoints.engine_cli_args import engine_args_from

    engine_args = engine_args_from(ns) | {"max_num_seqs": ns.batch_size}
    spec = {"method": "ngram", "num_speculative_tokens": ns.num_speculative_tokens,
            "prompt_lookup_min": ns.prompt_lookup_min, "prompt_lookup_max": ns.prompt_lookup_max}
    host = machine()
    plain = LLM(**(engine_args | {"speculative_config": None}))
    drafted = LLM(**(engine_args | {"speculative_config": spec}))
    tokenizer = plain.get_tokenizer()
    seed = engine_args.get("seed") or 0
    questions = chat_prompts(tokenizer, [_QUESTIONS[i % len(_QUESTIONS)] for i in range(ns.num_prompts)])
    workloads = {   # name: (prompts, temperature)
        "rewrite": (rewrite_prompts(tokenizer, ns.num_prompts), 0.0),
        "chat": (questions, 0.0),
        "chat-sampled": (questions, 1.0),
        "random": (make_workload(tokenizer, ns.num_prompts, (ns.random_input_len,) * 2,
                                 (ns.output_len,) * 2, seed).prompts, 0.0),
    }
    for llm in (plain, drafted):   # untimed warm-up
        _timed(llm, [workloads["random"][0][0][:8]], 4)

    results: dict[str, Any] = {}
    for name, (prompts, temperature) in workloads.items():
        tokens = ns.num_prompts * ns.output_len
        t_plain, out_plain = _timed(plain, prompts, ns.output_len, temperature)
        before = drafted.get_stats().spec_decoding
        t_spec, out_spec = _timed(drafted, prompts, ns.output_len, temperature)
        if out_spec != out_plain:
            raise RuntimeError(f"{name}: output differs with speculative decoding")
        after = drafted.get_stats().spec_decoding
        run = SpecDecodingStats(num_drafts=after.num_drafts - before.num_drafts,
                                num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
                                num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens)
        results[name] = {
            "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
            "speedup": t_plain / t_spec, "acceptance_rate": run.acceptance_rate,
            "mean_accepted_length": run.mean_accepted_length, "verifying_steps": run.num_drafts,
            "draft_tokens": run.num_draft_tokens, "accepted_tokens": run.num_accepted_tokens,
        }

    out = sys.stdout
    out.write(f"{ns.num_prompts} requests x {ns.output_len} tokens per workload, batch size "
              f"{ns.batch_size}, k={ns.num_speculative_tokens}, n in [{ns.prompt_lookup_min}, "
              f"{ns.prompt_lookup_max}]; {host['cpu']}, {host['cores']} cores, torch {host['torch']} "
              f"({host['torch_threads']} threads)\n\n")
    out.write("| workload | plain tok/s | ngram tok/s | speed-up | acceptance | mean accepted length |\n"
              "|---|---|---|---|---|---|\n")
    for name, r in results.items():
        out.write(f"| {name} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
                  f"{r['acceptance_rate']:.0%} | {r['mean_accepted_length']:.2f} |\n")
    out.write("\noutput identical with and without drafts on every workload\n")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"command": " ".join(["treadle", *sys.argv[1:]]), "machine": host,
                       "engine_args": engine_args, "speculative_config": spec,
                       "results": results}, f, indent=2, default=str)
    return 0
