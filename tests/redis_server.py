"""A real redis-server for the KV tier tests: on 127.0.0.1, a free port, in a temporary folder,
without persistence; stopped (and waited for) at the end. `make test` installs redis-server,
so a missing one fails the tests rather than skipping them."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        assert Path(REDIS_SERVER).exists(), f"{REDIS_SERVER} is missing: run `make redis`"
        self.folder = folder
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--dir",
             str(self.folder), "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                assert self.proc.poll() is None, (self.folder / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server did not start within 10 s"
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill it (as a crash would: SIGKILL) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
