"""A connector for an engine's config and role (connectors by name: registry.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from treadle.kv_transfer.base import KVConnectorBase, KVConnectorRole
from treadle.kv_transfer.registry import connector_class

if TYPE_CHECKING:
    from treadle.config import TreadleConfig


def create_connector(config: TreadleConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    if config.kv_transfer is None:
        return None
    return connector_class(config.kv_transfer.kv_connector)(config, role)
