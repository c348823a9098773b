"""Connectors by name, as `kv_transfer_config["kv_connector"]` names them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from treadle.kv_transfer.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from treadle.config import TreadleConfig

# name -> "module:class", imported only when used.
_REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "treadle.kv_transfer.shared_storage:SharedStorageConnector",
}


def register_connector(name: str, target: str) -> None:
    """Make a connector class ("package.module:Class") available under `name`."""
    _REGISTRY[name] = target


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def connector_class(name: str) -> type[KVConnectorBase]:
    if name not in _REGISTRY:
        raise ValueError(f"kv_transfer_config.kv_connector must be one of "
                         f"{', '.join(connector_names())}; got {name!r}")
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_connector(config: TreadleConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    if config.kv_transfer is None:
        return None
    return connector_class(config.kv_transfer.kv_connector)(config, role)
