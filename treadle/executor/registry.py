"""Executors by name, as `distributed_executor_backend` names them: "module:Class" targets,
imported only when chosen. It imports no executor, so that config.py can check a name."""

from __future__ import annotations

EXECUTORS: dict[str, str] = {
    "uni": "treadle.executor.uniproc:UniProcExecutor",
    "mp": "treadle.executor.mp:MultiprocExecutor",
    "ray": "treadle.executor.ray:RayExecutor",
}
