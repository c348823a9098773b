"""Running a test module's functions in a fresh Python: how the Triton tests choose between the
interpreter and the compiler. Triton decides when a kernel is defined whether it is interpreted
(TRITON_INTERPRET), so a case that needs the other mode than this process's runs elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def in_fresh_python(module: str, calls: list[tuple[str, list]], interpret: bool) -> list:
    """Run `module`'s functions `calls` ((name, args) pairs, JSON in and out) in a fresh Python,
    under Triton's interpreter or not, and return their results."""
    code = ("import json, sys\n"
            f"import {module} as m\n"
            "calls = json.loads(sys.stdin.read())\n"
            "print(json.dumps([getattr(m, name)(*args) for name, args in calls]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(calls), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
