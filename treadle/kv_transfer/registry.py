"""Connectors by name, as `kv_transfer_config["kv_connector"]` names them: "module:class" targets,
imported only when used. It imports no connector, so that config.py can check a name."""

from __future__ import annotations

from treadle.registry import lookup

_REGISTRY: dict[str, str] = {
    "SharedStorageConnector": "treadle.kv_transfer.shared_storage:SharedStorageConnector",
    "OffloadingConnector": "treadle.kv_transfer.offloading:OffloadingConnector",
    "MultiConnector": "treadle.kv_transfer.multi:MultiConnector",
    "RedisConnector": "treadle.kv_transfer.redis:RedisConnector",
}


def register_connector(name: str, target: str) -> None:
    """Make a connector class ("package.module:Class") available under `name`."""
    _REGISTRY[name] = target


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def connector_class(name: str) -> type:
    """The KVConnectorBase subclass registered under `name`."""
    return lookup(_REGISTRY, name, "kv_transfer_config.kv_connector")
