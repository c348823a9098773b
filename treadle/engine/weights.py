"""Which weights the engine serves: their identity, the user's label, and where they came from.

The identity is what KV is keyed by: the prefix cache is emptied whenever it changes, and a KV
connector's store names each block with it. So it must change with every weight change, and
never repeat for other weights. It is a digest chained over every change since the
checkpoint: the same changes from the same checkpoint give the same identity (two instances
fed the same updates by a trainer still share a KV store), and any other weights give another.
The user's `weight_version` is a label shown with outputs, never a key: clients repeat labels,
or give none.

A restart of the workers must bring back the weights that were served. The checkpoint and the
files of a `load_weights` can be read again; weights copied in place (`update_weights`) live
only in the workers, so after one a restart is refused (`restart_refusal`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from treadle.validate import MAX_NESTING, too_deep

CHECKPOINT_IDENTITY = "checkpoint"


def check_label(label: Any, field: str = "weight_version") -> None:
    """A weight_version goes out with every output, in the server's JSON: refuse one whose
    text cannot be (half a surrogate pair in a string, NaN) before any weight changes. Other
    objects (a numpy integer, a date) stay fine offline, as their text."""
    if too_deep([label]) is not None:   # the server's responses serialize ~255 levels
        raise ValueError(f"{field} nests objects and lists more than {MAX_NESTING} deep")
    try:
        json.dumps(label, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
    except (TypeError, ValueError) as e:   # UnicodeEncodeError is a ValueError
        raise ValueError(f"{field} {label!r} must be JSON text (valid Unicode, finite "
                         f"numbers): {e}") from None


@dataclass(frozen=True)
class ServedWeights:
    identity: str = CHECKPOINT_IDENTITY
    label: Any = 0            # weight_version, as the user named it (or counted)
    source: str | None = None  # the last load_weights path; None: the model's checkpoint
    source_stamp: str = ""     # its files' names, sizes and times when they were loaded
    kept: bool = True          # False once changed in place: no file holds these weights
    checkpoint: str | None = None   # the model's files, stamped at start-up (source None)

    def updated(self, named_tensors: Iterable[tuple[str, torch.Tensor]], label: Any
                ) -> ServedWeights:
        """After update_weights with these tensors."""
        digest = update_digest()
        for name, tensor in named_tensors:
            add_to_digest(digest, name, tensor)
        return self.transferred(digest.hexdigest(), label)

    def transferred(self, digest: str, label: Any) -> ServedWeights:
        """After a change in place whose tensors hash to `digest` (update_digest): the same
        tensors from a trainer's broadcast give the same identity as update_weights."""
        return dataclasses.replace(self, identity=self._chain(digest),
                                   label=self._next_label(label), kept=False)

    def loaded(self, path: str, label: Any) -> ServedWeights:
        """After load_weights from `path` (every weight comes from its files)."""
        stamp = files_stamp(path)
        return ServedWeights(identity=self._chain(f"load {stamp}"), label=self._next_label(label),
                             source=path, source_stamp=stamp, kept=True,
                             checkpoint=self.checkpoint)

    def restart_refusal(self) -> str | None:
        """Why new workers could not serve these weights, or None."""
        if not self.kept:
            return (f"the weights were updated in place (weight_version={self.label!r}) and no "
                    "file holds them, so new workers would serve other weights")
        path = self.source or self.checkpoint
        if path is not None and self.source_stamp and files_stamp(path) != self.source_stamp:
            what = ("the files of the last load_weights" if self.source is not None
                    else "the model's checkpoint files")
            return f"{what} ({path}) changed since, so new workers would serve other weights"
        return None

    def _chain(self, change: str) -> str:
        return hashlib.sha256(f"{self.identity}\n{change}".encode()).hexdigest()

    def _next_label(self, label: Any) -> Any:
        if label is not None:
            return label
        counted = isinstance(self.label, int) and not isinstance(self.label, bool)
        return self.label + 1 if counted else None


def update_digest() -> Any:
    """A fresh digest for the tensors of one change in place (add_to_digest)."""
    return hashlib.sha256(b"update")


def add_to_digest(digest: Any, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().contiguous()
    digest.update(repr((name, str(t.dtype), tuple(t.shape))).encode())
    digest.update(t.reshape(-1).view(torch.uint8).cpu().numpy())


def files_stamp(path: str) -> str:
    """The names, sizes and modification times of a model folder's (or file's) files."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    entries = []
    for f in files:
        st = f.stat()
        entries.append(f"{os.path.realpath(f)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()
