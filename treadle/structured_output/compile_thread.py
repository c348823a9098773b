"""A grammar compile on a thread of its own: how both the engine core's gate (gate.py) and a
worker's compile-ahead (compile_ahead.py) keep compiles off the step."""

from __future__ import annotations

import threading
from typing import Any, Callable

from treadle.structured_output.backend import GrammarBackend
from treadle.structured_output.params import StructuredOutputsParams


def compile_on_thread(get_backend: Callable[[], GrammarBackend], params: StructuredOutputsParams,
                      name: str, done: Callable[[Any, Exception | None], None]) -> None:
    """Compile `params` on a new thread, then call done(compiled, None), or done(None, error)
    if the compile raised, on that thread.

    The thread is not a daemon: the interpreter's exit waits for it, as a grammar engine's C++
    thread still running when the process exits aborts it.
    """
    def run() -> None:
        try:
            compiled, error = get_backend().compile(params), None
        except Exception as e:   # the request's error: `done` decides who hears of it
            compiled, error = None, e
        done(compiled, error)

    threading.Thread(target=run, name=name).start()
