"""Errors the engine raises to its callers."""


class EngineBusyError(RuntimeError):
    """Retryable: the engine is paused (mode "abort" or "wait") or shutting down."""


class EngineDeadError(RuntimeError):
    """The engine core failed; no request can be served any more."""
