"""glibc's malloc keeps what a step frees (worker/malloc.py): activations a layer frees are the
next layer's without new page faults. Each case runs in a fresh interpreter, since the setting
is process-wide and the thresholds glibc moves by itself depend on what the process did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, resource, sys, torch
from treadle.worker.malloc import keep_freed_memory
# both cases start from glibc's first threshold, held fixed: left to move, it follows the
# process's history, and a fresh clone's run once kept every block without the tuning
ctypes.CDLL(None).mallopt(-3, 128 << 10)
if sys.argv[1] == "1":
    assert keep_freed_memory()
faults = []
for layer in range(8):   # a layer's activations: three of 8 MiB live at once, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    live = [torch.empty(8 << 18, dtype=torch.float32).fill_(1.0) for _ in range(3)]
    del live
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[5:]))   # once both settings have settled (the tuned heap takes up to four layers)
"""


def _late_faults(tuned: bool) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_come_back_without_page_faults():
    block_pages = (8 << 20) // 4096
    assert _late_faults(tuned=False) > 3 * block_pages   # each block unmapped, faulted again
    assert _late_faults(tuned=True) < block_pages // 4


def test_malloc_tuned_by_the_user_is_left_alone():
    probe = "from treadle.worker.malloc import keep_freed_memory; print(keep_freed_memory())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert done.stdout.split()[-1] == "False", done.stderr



TRIM_PROBE = """
import torch
from treadle.worker.malloc import keep_freed_memory, return_freed_memory
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))
assert keep_freed_memory()
loading = [torch.empty(4 << 18, dtype=torch.float32).fill_(1.0) for _ in range(64)]  # 256 MiB
del loading
kept = rss()
return_freed_memory()
print(kept, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_start_up_temporaries_go_back_to_the_kernel():
    """The heap keeps what loading freed (it is under the trim threshold) until the runner
    returns it once after start-up, as `init_kv_cache` does."""
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    kept, after = map(int, done.stdout.split()[-2:])
    assert kept - after > 200 << 20, (kept, after)


# Waves of eight prompts of 256 tokens (fp32), each a step of 2,048 tokens, on the thread that
# steps the model: `AsyncLLM`'s engine thread, or the worker thread of async scheduling under
# `LLM`. The probe prints each wave's page faults; the first grows the heap. AsyncLLM is paused
# (keep) while a wave's prompts queue: its engine thread would otherwise start a step on the
# first to arrive, and a wave split that way needs less heap, so the next whole wave grows it
# (CI counted 6,150 faults in a second wave so). The test takes the least of the later waves:
# a thread on an arena of its own takes its faults again in every wave, while faults from
# elsewhere come and go (seen here once under async scheduling: 1,923 and 1,540 in both later
# waves of a run, their source not found).
STEP_PROBE = """
import asyncio, random, resource, sys
from treadle import LLM, SamplingParams
from treadle.engine.async_llm import AsyncLLM
from treadle.models.loader import prepare_model

WAVES, PROMPTS = 4, 8

def prompts(seed):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(256)]} for _ in range(PROMPTS)]

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

args = dict(dtype="float32", enable_prefix_caching=False, max_model_len=512)
params = SamplingParams(temperature=0.0, max_tokens=1)
per_wave = []
if sys.argv[1] == "AsyncLLM":
    async def main():
        llm = AsyncLLM(prepare_model(None), **args)
        async def one(rid, p):
            async for _ in llm.generate(p, params, request_id=rid):
                pass
        for seed in range(WAVES):
            before = faults()
            await llm.pause_generation(mode="keep", clear_cache=False)
            wave = [asyncio.create_task(one(f"{seed}-{i}", p)) for i, p in enumerate(prompts(seed))]
            while len(llm.core.scheduler.requests) < PROMPTS:
                await asyncio.sleep(0.01)
            await llm.resume_generation()
            await asyncio.gather(*wave)
            per_wave.append(faults() - before)
        llm.shutdown()
    asyncio.run(main())
else:
    llm = LLM(prepare_model(None), async_scheduling=True, **args)
    for seed in range(WAVES):
        before = faults()
        llm.generate(prompts(seed), params, use_tqdm=False)
        per_wave.append(faults() - before)
print(*per_wave)
"""


def _wave_faults(engine: str, extra_env: dict[str, str]) -> list[int]:
    """Each wave's page faults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", STEP_PROBE, engine], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1", **extra_env})
    assert done.returncode == 0, done.stderr
    return [int(n) for n in done.stdout.splitlines()[-1].split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("engine", ["AsyncLLM", "async_scheduling"])
def test_a_step_on_another_thread_takes_no_page_faults(engine):
    """The engine thread and the async worker thread allocate from the main arena: after the
    first wave, which grows the heap (so the probe is seen to count that thread's faults), a
    wave takes almost no page faults. The control once run here, the thresholds alone through
    GLIBC_TUNABLES, gave the engine thread an arena of its own whose heaps were faulted in again
    in every wave on the Zen 5 (73,744-86,030 a wave), but not on the AMX Xeon ([6198, 1, 1, 1]
    on Nov 28): a machine's fact, not treadle's, so it is no longer asserted. A later wave is
    held to a fifth of the first: faults from elsewhere came to 1,152-3,330 a wave in a suite
    run in two workers ([21836, 3330, 2304, 1152], Nov 30), where a heap faulted in again takes
    about the first wave's."""
    waves = _wave_faults(engine, {})
    assert waves[0] > 1_000 and min(waves[1:]) < waves[0] // 5, waves
