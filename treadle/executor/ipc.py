"""A private folder for ZeroMQ ipc sockets, short enough for the kernel's path limit.

An AF_UNIX socket's path holds at most 107 bytes (108 with the NUL, on Linux). A folder under a
long TMPDIR (a CI runner's work tree, a deep home) passes that, and the bind fails with a bare
'File name too long'. Such a folder falls back to /tmp, which is short everywhere, with a
warning saying why.
"""
from __future__ import annotations

import logging
import os
import tempfile

import zmq

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = getattr(zmq, "IPC_PATH_MAX_LEN", 107)   # sizeof(sockaddr_un.sun_path) - 1
LONGEST_SOCKET_NAME = 16         # "/" + the longest name bound inside the folder, with room
RANDOM_PART = 8                  # what mkdtemp appends to the prefix
FALLBACK_DIR = "/tmp"


def _fits(parent: str, prefix: str) -> bool:
    return len(os.path.join(parent, prefix)) + RANDOM_PART + LONGEST_SOCKET_NAME <= MAX_SOCKET_PATH


def socket_folder(prefix: str) -> str:
    """mkdtemp(prefix) under the usual temporary folder, or under /tmp where the usual one is
    too long for the sockets bound inside it; raises OSError naming the limit where neither fits."""
    parent = tempfile.gettempdir()
    if not _fits(parent, prefix):
        if not (_fits(FALLBACK_DIR, prefix) and os.access(FALLBACK_DIR, os.W_OK | os.X_OK)):
            raise OSError(
                f"no folder for treadle's ipc sockets: the temporary folder {parent!r} is "
                f"{len(parent)} characters, too long for a socket path (at most "
                f"{MAX_SOCKET_PATH} bytes), and {FALLBACK_DIR} is not writable; set TMPDIR "
                "to a shorter folder")
        logger.warning("the temporary folder %r is too long for ipc socket paths (at most %d "
                       "bytes): treadle's sockets go under %s", parent, MAX_SOCKET_PATH,
                       FALLBACK_DIR)
        parent = FALLBACK_DIR
    return tempfile.mkdtemp(prefix=prefix, dir=parent)
