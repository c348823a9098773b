"""The RL examples run as a user runs them: examples/rl_loop.py (AsyncLLM) and
examples/rl_http.py (`treadle serve` and the openai SDK), each with a trainer process that
steps a transformers copy of the model and streams the weights in mid-rollout. Each example
checks every token against transformers under the weights that made it, and exits 1 if one
disagrees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("example", ["rl_loop.py", "rl_http.py"])
def test_rl_example_streams_weights_mid_rollout_and_stays_exact(llama, example):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--model", llama, "--rounds", "2",
         "--group", "2", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "every rollout token matched transformers under its own weights" in log
    # The second round's rollouts began on version 0 and finished on version 1.
    mixed = re.search(r"round 1: .*weights sent mid-way: 1; rollouts on two versions: (\d+); "
                      r"tokens checked by version: \{0: \d+, 1: \d+\}; mismatches: 0", log)
    assert mixed is not None and int(mixed.group(1)) > 0, log[-3000:]
