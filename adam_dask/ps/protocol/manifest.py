"""The checkpoint's manifest as its one writer, the controller, keeps it: pure, no I/O.

Each shard's entry names a block ``(path, generation, version)``; an entry changes only to a
newer ``(generation, version)``, and each written document has a larger ``sequence``, so the
manifest never goes back. A block replaced in the manifest is deleted once two written
manifests and ``grace`` seconds have gone by without it: a reader of the previous manifest still
finds its data.
"""

from __future__ import annotations

import logging
from typing import Any

from .messages import DeleteBlocks, Reply, WriteManifest

logger = logging.getLogger(__name__)

__all__ = ["Manifest"]


class Manifest:
    """The manifest document ``doc`` (as written when the server was made) and its writes."""

    def __init__(self, doc: dict, *, grace: float):
        self.doc = dict(doc)
        for k in ("versions", "generations", "blocks"):
            self.doc[k] = list(self.doc[k])
        self.grace = float(grace)
        self.seq = int(self.doc.get("sequence", 0))
        self.written_seq = self.seq
        self.dirty = False
        self.writing: int | None = None
        self.errors = 0
        self.failing = 0  # failed writes since the last one written: an outage while > 0
        self.last_error: str | None = None
        # (block path, first manifest sequence without it, when it was replaced)
        self.superseded: list[tuple[str, int, float]] = []
        self.commits: list[tuple[Any, int]] = []  # (request, sequence that answers it)

    def position(self, sid: int) -> tuple[int, int]:
        return (int(self.doc["generations"][sid]), int(self.doc["versions"][sid]))

    def block(self, sid: int) -> tuple[str, int, int]:
        """(path, generation, version) of the block the manifest names for ``sid``."""
        return (self.doc["blocks"][sid], *self.position(sid))

    def name(self, sid: int, gen: int, version: int, path: str, now: float) -> None:
        """Name the block ``path`` of ``sid`` at ``(gen, version)`` if that is newer."""
        if (gen, version) <= self.position(sid):
            return
        old = self.doc["blocks"][sid]
        self.doc["blocks"][sid] = path
        self.doc["generations"][sid], self.doc["versions"][sid] = gen, version
        if old and old != path:
            self.superseded.append((old, self.seq + 1, now))
        self.dirty = True

    def commit(self, req: Any, epoch: Any, meta: dict | None) -> None:
        """Store ``epoch``/``meta`` (when not None); ``req`` is answered once it is written."""
        if epoch is not None:
            self.doc["epoch"] = epoch
        if meta is not None:
            self.doc["meta"] = meta
        self.dirty = True
        self.commits.append((req, self.seq + 1))

    def written(self, seq: int) -> list:
        """The write of ``seq`` is done: answer the commits it holds."""
        self.writing = None
        self.failing = 0
        self.written_seq = max(self.written_seq, seq)
        out, keep = [], []
        for req, s in self.commits:
            if s <= self.written_seq:
                out.append(Reply(req, dict(self.doc)))
            else:
                keep.append((req, s))
        self.commits = keep
        return out

    def failed(self, error: str) -> None:
        self.writing = None
        self.dirty = True
        self.errors += 1
        self.failing += 1
        self.last_error = error

    def actions(self, now: float, ready: bool) -> list:
        """The next write (one at a time, when ``ready``) and the blocks to delete."""
        out: list = []
        if self.dirty and self.writing is None and ready:
            self.seq += 1
            self.doc["sequence"] = self.seq
            self.dirty = False
            self.writing = self.seq
            doc = dict(self.doc)
            for k in ("versions", "generations", "blocks"):
                doc[k] = list(self.doc[k])
            out.append(WriteManifest(self.seq, doc))
        doomed, keep = [], []
        for path, first, since in self.superseded:
            if first + 1 <= self.written_seq and now - since >= self.grace:
                doomed.append(path)
            else:
                keep.append((path, first, since))
        self.superseded = keep
        if doomed:
            out.append(DeleteBlocks(tuple(doomed)))
        return out
