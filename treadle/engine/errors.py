"""Errors the engine raises to its callers."""


class EngineBusyError(RuntimeError):
    """Retryable: generation is paused in mode "abort" or "wait"."""


class EngineDeadError(RuntimeError):
    """The engine core failed; no request can be served any more."""
