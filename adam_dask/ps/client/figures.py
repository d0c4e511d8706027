"""What a parameter server's handle reports: its figures, put together from what the controller
and every node report (:meth:`~adam_dask.ps.client.server.ParameterServer.stats` documents
each key), and the one line that names the checkpoint's storage when it is the cause."""

from __future__ import annotations

from typing import Any

from ..._secrets import redact_url
from ...errors import StorageError

__all__ = ["RETRIED", "server_figures", "storage_error"]

RETRIED = "the updates are kept and written back when it answers"


def server_figures(
    server: Any,
    courier: Any,
    nodes: dict,
    routing: dict,
    now: float,
    last: tuple[float, int] | None,
) -> dict:
    """The figures of ``server`` (its id, shards and copies) from its ``nodes``' stats, the
    controller's ``routing`` and what its ``courier`` holds and sent; ``last``: (when, pushes
    applied) at the previous call, for the update rate (None: since the nodes started).

    The keys: ``pushes_applied`` (shard updates
    applied by primaries), ``update_rate`` (shard updates/s since the previous ``stats()``,
    or since the nodes started), ``max_replication_lag`` (versions a backup is behind its
    primary), ``writeback_lag_versions`` / ``writeback_lag_seconds`` (how far the checkpoint
    is behind), ``writeback_errors``, ``healthy``, ``heal_times``, ``restored`` (shards
    rebuilt from the checkpoint, each with ``lost_at_least``: updates after its last
    write-back the heartbeats had reported), ``updates_lost_at_least``, ``declared_dead``, ``heartbeat_gap_max`` (the longest silence
    between two heartbeats of a member node, seconds),
    ``refused_stale`` (calls refused for a stale generation), ``manifest_errors`` /
    ``manifest_failing`` / ``last_manifest_error`` (see ``ParameterServer.routing_info``), ``replayed`` /
    ``held_pushes`` / ``held_bytes`` (this handle's pushes sent again to a new primary, and
    those it keeps until they are durable: ``ack="replay"``), ``data_plane`` (what this
    handle sent, one count per primary a request reached: ``pushes``, ``pulls``,
    ``to_dask`` (those that went as Dask actor calls: the plane could not reach the node),
    ``failed_calls`` (plane calls given up: the node died, froze or was dropped)),
    ``nodes`` (each node's figures, ``by_transport`` among them: the pushes and pulls it
    served over the plane and as Dask actor calls; ``outer_products``: the dense offload's
    updates it computed from activations and errors; ``pushes_with_bases``: those that named
    the versions their pusher read, the server optimizer's staleness)."""
    ok = [n for n in nodes.values() if isinstance(n, dict)]
    total = sum(n["pushes"] for n in ok)
    if last is None:
        span = max((n["uptime"] for n in ok), default=0.0)
        rate = total / span if span > 0 else 0.0
    else:
        t0, c0 = last
        rate = (total - c0) / (now - t0) if now > t0 else 0.0
    return {
        "server": server.server_id,
        "shards": len(server.shards),
        "copies": server.copies,
        "pushes_applied": total,
        "update_rate": rate,
        "max_replication_lag": max((n["replication_lag"] for n in ok), default=0),
        "writeback_lag_versions": max((n["writeback_lag_versions"] for n in ok), default=0),
        "writeback_lag_seconds": max((n["writeback_lag_seconds"] for n in ok), default=0.0),
        "writeback_errors": sum(n["writeback_errors"] for n in ok),
        "healthy": routing["healthy"],
        "heal_times": routing["heal_times"],
        "generation": routing["generation"],
        "restored": routing["restored"],
        "updates_lost_at_least": sum(r["lost_at_least"] for r in routing["restored"]),
        "declared_dead": routing["declared_dead"],
        "heartbeat_gap_max": routing.get("heartbeat_gap_max", 0.0),
        "refused_writes": routing["refused_writes"],
        "manifest_errors": routing["manifest_errors"],
        "manifest_failing": routing.get("manifest_failing", 0),
        "last_manifest_error": routing.get("last_manifest_error"),
        "refused_stale": sum(n["refused_stale"] for n in ok) + routing["refused_writes"],
        "replayed": courier.log.replayed,
        "held_pushes": len(courier.log),
        "held_bytes": courier.log.nbytes,
        "data_plane": (dict(courier.channels.counts) if courier.channels is not None else None),
        "nodes": nodes,
    }


def storage_error(checkpoint: str | None, exc: BaseException) -> StorageError:
    """One line that names the checkpoint's storage (its URL without secrets) as the cause of
    ``exc``."""
    text = " ".join(str(getattr(exc, "message", None) or exc).split())
    if text.startswith("storage "):
        return exc if isinstance(exc, StorageError) else StorageError(text)
    return StorageError(
        f"storage {redact_url(str(checkpoint))}: {text}",
        f"{RETRIED}; check its endpoint, credentials and network",
    )
