"""Python's cyclic garbage collector in a process that serves one engine for its whole life.

A full collection walks every object the collector tracks: after start-up, about 390,000 of
them (torch, transformers and the model's modules), and it takes 100-200 ms with the GIL held,
a stalled step for every request (docs/performance.md, "Full garbage collections"). Once the
engine is up, what the process holds is frozen (`gc.freeze`): later collections leave it out,
as vLLM does in its engine and server processes. Objects that reference counting frees are
still freed; only cycles among the frozen objects would stay, and start-up's are collected just
before.

Where memory is let go on purpose (sleep), cycles among the frozen objects are collected too
(`collect_frozen_garbage`): a frozen cycle holding a tensor would keep its memory for good.

Only where the engine lives as long as the process (`treadle serve`, worker processes): an
`LLM` in a user's process may be one of several, built and dropped, and a dropped engine's
cycles (its weights among them) must stay collectable. There the heap is frozen only while
`LLM.generate` runs (`frozen_while_running`), and given back as it returns.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_frozen_here = False   # freeze_startup_heap has run in this process


def freeze_startup_heap(what: str) -> None:
    """Collect what start-up left, then leave every object there is now out of later
    collections. `what`: the process, for the log line."""
    global _frozen_here
    start = time.perf_counter()
    # Twice: a collection returns at once, collecting nothing, while another thread's is under
    # way (one paused in a finalizer), and what it left would then be frozen for good.
    gc.collect()
    gc.collect()
    gc.freeze()
    if not _frozen_here:
        # At exit the interpreter's last collections see them again, so that extension modules
        # that count their objects at teardown find them released.
        atexit.register(gc.unfreeze)
        _frozen_here = True
    logger.info("%s: froze %d start-up objects out of garbage collection (%.2fs)", what,
                gc.get_freeze_count(), time.perf_counter() - start)


def collect_frozen_garbage() -> None:
    """Collect cycles among the frozen objects too, then freeze what is left again: where the
    engine lets memory go (sleep), a frozen cycle holding a tensor must not keep it. What is
    alive then (requests kept across the sleep) is frozen with the rest."""
    if _frozen_here:   # this process froze its heap here (a user's own freeze is theirs)
        gc.unfreeze()
        gc.collect()
        gc.freeze()


# A loop of generate calls with little between them would never reach a full collection (each
# freeze sets the collector's counts back to zero), so a call makes one first where none of them
# has for this long: 100-200 ms a minute at most.
FULL_COLLECTION_EVERY_S = 60.0
_last_full_collection = time.monotonic()   # by frozen_while_running


@contextlib.contextmanager
def frozen_while_running() -> Iterator[None]:
    """Leave every object there is now out of collections until the block ends, then give them
    back: a full collection in a long run (LLM.generate) walks only what the run made.

    What was frozen goes back to the oldest generation as the block ends, young garbage
    included, and only a full collection frees it from there. So the young generations are
    collected first (milliseconds), and the whole heap where FULL_COLLECTION_EVERY_S has passed
    since a call last did. A full collection while frozen counts only the unfrozen objects as
    the heap's size, so the first one after the block walks everything, once, when the
    collector's counts next call for it. Where objects are frozen already (this module in a
    serving process, or the user's own freeze), they are theirs to undo, and nothing is done;
    a freeze made by another thread while the block runs is undone with it."""
    global _last_full_collection
    if gc.get_freeze_count():   # walks the frozen list: paid only where something froze it
        yield
        return
    now = time.monotonic()
    if now - _last_full_collection > FULL_COLLECTION_EVERY_S:
        gc.collect()
        _last_full_collection = now
    else:
        gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
