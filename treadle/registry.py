"""Classes by name, imported only when asked for: a registry maps each name to "module:Class",
so the module that looks a name up imports none of the classes it names."""

from __future__ import annotations

import importlib


def lookup(registry: dict[str, str], name: str, field: str) -> type:
    """The class registered under `name`; a ValueError naming `field` and the choices if none is."""
    if name not in registry:
        raise ValueError(f"{field} must be one of {', '.join(sorted(registry))}; got {name!r}")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)
