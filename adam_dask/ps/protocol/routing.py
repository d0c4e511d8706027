"""The client's copy of the controller's routing table: which node is the primary of each shard
in which generation, which shards wait for a primary (a fail-over) or are lost. Pure: the
client reads it from the scheduler (``adam_ps_routing``) and hands it here."""

from __future__ import annotations

__all__ = ["Routing"]


class Routing:
    """Who holds what, as this handle last heard it from the controller."""

    def __init__(self, server_id: str):
        self.server_id = server_id
        self.table: list[list[str]] = []  # sid -> [primary, backup, ...]
        self.gens: list[int] = []  # sid -> the shard's generation (a node refuses older ones)
        self.nodes: dict[str, str] = {}  # addr -> the node's actor key
        self.pending: set[int] = set()  # shards without a primary now (a fail-over)
        self.lost: set[int] = set()  # shards without any copy and nothing to rebuild from
        self.generation = -1  # the controller's counter of routing changes
        self.healthy = False  # every shard has all its copies

    def set(self, r: dict) -> None:
        self.table = [list(h) for h in r["routing"]]
        self.gens = [int(g) for g in r["gens"]]
        self.nodes = dict(r["nodes"])
        self.pending = set(r["pending"])
        self.lost = set(r["lost"])
        self.generation = int(r["generation"])
        self.healthy = bool(r["healthy"])

    @property
    def known(self) -> bool:
        return bool(self.table)

    def is_lost(self, sid: int) -> bool:
        return sid in self.lost

    def primaries(self) -> dict[int, tuple[str, int]]:
        """{sid: (primary address, generation)} of the shards that have a primary now."""
        return {
            s: (h[0], self.gens[s])
            for s, h in enumerate(self.table)
            if h and s not in self.pending and s not in self.lost
        }

    def stamps(self, sids: object) -> dict[int, int]:
        """{sid: generation} as this handle knows them: a node refuses older ones."""
        return {int(s): self.gens[int(s)] for s in sids}  # type: ignore[attr-defined]

    def key(self, addr: str) -> str:
        return self.nodes.get(addr, "")

    def holders(self) -> dict[str, list[int]]:
        """{node address: the shards it holds a copy of}."""
        out: dict[str, list[int]] = {}
        for s, holders in enumerate(self.table):
            for a in holders:
                out.setdefault(a, []).append(s)
        return out
