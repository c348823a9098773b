"""A grammar compile on a thread of its own: how both the engine core's gate (gate.py) and a
worker's compile-ahead (compile_ahead.py) keep compiles off the step."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

from treadle.structured_output.backend import GrammarBackend
from treadle.structured_output.params import StructuredOutputsParams

# How much nicer than the engine's threads a compile runs (and the grammar engine's threads it
# starts, which inherit it): on a machine of few cores, slow compiles (and abandoned ones,
# which run on) must not slow every running request's steps.
COMPILE_NICENESS = 10


def compile_on_thread(get_backend: Callable[[], GrammarBackend], params: StructuredOutputsParams,
                      name: str, done: Callable[[Any, Exception | None], None]) -> None:
    """Compile `params` on a new thread, then call done(compiled, None), or done(None, error)
    if the compile raised, on that thread.

    The thread is not a daemon: the interpreter's exit waits for it, as a grammar engine's C++
    thread still running when the process exits aborts it. On Linux it runs COMPILE_NICENESS
    nicer than the process (a thread's nice value is its own there).
    """
    def run() -> None:
        if sys.platform == "linux":
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
        try:
            compiled, error = get_backend().compile(params), None
        except Exception as e:   # the request's error: `done` decides who hears of it
            compiled, error = None, e
        done(compiled, error)

    threading.Thread(target=run, name=name).start()
