"""What a state machine did and why, kept in a bounded log: "why was shard 3 promoted at
generation 5?" answered from the system itself, not by a rerun.

Each :class:`~adam_dask.ps.protocol.messages.Event` a machine handles (the frequent data-path
ones only when they change something of note: see the machines' ``handle``) becomes one
:class:`Entry`: its stimulus id, the event in a line, the shards it touched and the actions it
led to. ``story(sid)`` is the entries that touched shard ``sid``, oldest first, with the
machine-wide ones (a node retired, a worker lost) among them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Entry", "Story", "shards_of"]

STORY_LENGTH = 256  # entries a machine keeps (one per event of note, so hours of a healthy run)


@dataclass(frozen=True, slots=True)
class Entry:
    """One event of note: its ``stimulus`` id, ``event`` in one line, the ``shards`` it and its
    actions touched (empty: the whole machine) and the ``actions`` it led to, by name."""

    stimulus: str
    event: str
    shards: tuple[int, ...]
    actions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "stimulus": self.stimulus,
            "event": self.event,
            "shards": list(self.shards),
            "actions": list(self.actions),
        }


def shards_of(obj: Any) -> set[int]:
    """The shard ids a message names: its ``sid``, ``sids``, or the keys of ``shards``, ``gens``,
    ``held``, ``refused``."""
    out: set[int] = set()
    sid = getattr(obj, "sid", None)
    if isinstance(sid, int):
        out.add(sid)
    for name in ("sids", "shards", "gens", "held", "refused"):
        v = getattr(obj, name, None)
        if isinstance(v, dict | list | tuple | set | frozenset):
            out.update(int(s) for s in v if isinstance(s, int))
    return out


def _line(event: Any) -> str:
    """``Name(field=value, ...)`` of the event's small fields (no arrays, no long payloads)."""
    parts = []
    for f in fields(event):
        if f.name in ("stimulus_id", "values", "pushes", "doc", "ids", "marks", "positions"):
            continue
        v = getattr(event, f.name)
        text = repr(v)
        parts.append(f"{f.name}={text if len(text) <= 60 else text[:57] + '...'}")
    return f"{type(event).__name__}({', '.join(parts)})"


class Story:
    """A machine's bounded log of the events of note (see the module doc)."""

    def __init__(self, prefix: str, length: int = STORY_LENGTH):
        self.prefix = prefix
        self._entries: deque[Entry] = deque(maxlen=length)
        self._ids = itertools.count(1)

    def stimulus(self, event: Any) -> str:
        """``event``'s stimulus id, or a new one of this machine's when it came with none."""
        given = getattr(event, "stimulus_id", "")
        return given or f"{self.prefix}-{type(event).__name__}-{next(self._ids)}"

    def record(
        self, event: Any, shards: Iterable[int], actions: Iterable[Any], stimulus: str = ""
    ) -> None:
        """Note ``event`` under ``stimulus`` (its stimulus id by default), with the
        ``shards`` it and its ``actions`` touched."""
        stimulus = stimulus or self.stimulus(event)
        names = tuple(_action_line(a) for a in actions)
        self._entries.append(Entry(stimulus, _line(event), tuple(sorted(set(shards))), names))

    def __call__(self, sid: int | None = None) -> list[Entry]:
        """The entries that touched ``sid`` (and the machine-wide ones); all with ``None``."""
        if sid is None:
            return list(self._entries)
        return [e for e in self._entries if not e.shards or sid in e.shards]

    def __len__(self) -> int:
        return len(self._entries)


def _action_line(action: Any) -> str:
    method = getattr(action, "method", None)  # a controller's call names what it asks
    addr = getattr(action, "addr", None)
    name = type(action).__name__
    if method is not None:
        return f"{name}({method} -> {addr})"
    return name if addr is None else f"{name}({addr})"
