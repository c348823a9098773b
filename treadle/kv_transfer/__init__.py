"""KV connectors: KV that crosses the engine's boundary (offload, prefill/decode disaggregation)."""

from treadle.kv_transfer.base import (KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
                                      KVConnectorRole, LoadFaultInjector)
from treadle.kv_transfer.factory import create_connector
from treadle.kv_transfer.registry import connector_names, register_connector

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "LoadFaultInjector", "connector_names", "create_connector", "register_connector"]
