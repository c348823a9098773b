"""The grammar backends by name, imported only when asked for.

There is one backend per process, model and choice of engine (`get_backend`), so the engine
core, which compiles off the step path, and an in-process worker, which asks for the same
grammar when the request arrives, share one compile cache.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.structured_output.backend import GrammarBackend

BACKENDS = ("xgrammar", "guidance")

_building = threading.Lock()


def get_backend(name: str, model_path: str, vocab_size: int) -> GrammarBackend:
    """This process's backend for a model (built once: reading a vocabulary takes a while).
    Compile threads ask for it at once: the first builds it, the others wait for that one."""
    with _building:
        return _build_backend(name, model_path, vocab_size)


@functools.lru_cache(maxsize=4)
def _build_backend(name: str, model_path: str, vocab_size: int) -> GrammarBackend:
    from treadle.models.loader import default_eos_token_id, load_hf_config, load_tokenizer

    cls = backend_class(name)
    tokenizer = load_tokenizer(model_path)
    return cls(tokenizer, vocab_size, default_eos_token_id(tokenizer, load_hf_config(model_path)))


def check_backend(name: str) -> None:
    """Raise ValueError for a name that is no backend, or for one whose library is missing.
    xgrammar is not imported here: the engine runs without it (a GPU machine may lack it)
    until a request asks for a grammar."""
    if name != "xgrammar":
        backend_class(name)


def backend_class(name: str) -> type[GrammarBackend]:
    if name == "xgrammar":
        from treadle.structured_output.xgrammar_backend import XgrammarBackend
        return XgrammarBackend
    if name == "guidance":
        try:
            from treadle.structured_output.guidance_backend import GuidanceBackend
        except ImportError as e:
            raise ValueError(f"structured_outputs_config.backend 'guidance' needs llguidance "
                             f"(pip install 'treadle[guidance]'): {e}") from None
        return GuidanceBackend
    raise ValueError(f"structured_outputs_config.backend must be one of {', '.join(BACKENDS)}; "
                     f"got {name!r}")
