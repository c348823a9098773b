"""The engine runs where the CPU-only extras are missing, as on the GPU machines (issue 45: no
FastAPI, uvicorn, xgrammar, llguidance or gguf there). A fresh interpreter whose imports of
those packages fail serves a tiny model offline; the server and grammars are the only parts
that need them, and only when used."""

from __future__ import annotations

import subprocess
import sys

MISSING = ("fastapi", "uvicorn", "xgrammar", "llguidance", "gguf")

PROBE = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {missing!r}:
            raise ImportError(f"no module named {{name!r}} on this machine")
sys.meta_path.insert(0, Missing())
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
