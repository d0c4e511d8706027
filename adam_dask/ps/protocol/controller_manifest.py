"""The controller as the manifest's only writer, pure like
:class:`~adam_dask.ps.protocol.controller.ServerState`, as functions of its state: a write-back
is named only when its writer is the shard's primary of the current generation; positions and
the sequence number never go back; a commit (the trainer's epoch) is answered once the
manifest naming it is written; a failing write is retried with a back-off, logged once, and the
job told (``manifest_failing``), never blocking training."""

from __future__ import annotations

import logging

from .controller import ServerState
from .messages import Action, Commit, ManifestDone, ManifestFailed, Reply, WriteReport
from .node_state import NOT_MEMBER
from .replies import ReportReply

logger = logging.getLogger(__name__)

__all__ = [
    "manifest_actions",
    "on_commit",
    "on_manifest_done",
    "on_manifest_failed",
    "on_write_report",
]


def on_write_report(state: ServerState, ev: WriteReport) -> list[Action]:
    accepted: dict[int, int] = {}
    refused: dict[int, int] = {}
    for sid, (gen, version, path) in ev.blocks.items():
        if ev.addr not in state.nodes:
            refused[sid] = NOT_MEMBER
        elif (
            state.manifest is None
            or state.routing[sid][:1] != [ev.addr]
            or gen != state.gens[sid]
            or sid in state.pending()
        ):
            rnd = state.rounds.get(sid)
            refused[sid] = max(state.gens[sid], rnd.gen if rnd else -1)
        else:
            accepted[sid] = version
            state.manifest.name(sid, gen, version, path, state.now)
        state.last_seen[sid] = max(state.last_seen.get(sid, (-1, -1)), (gen, version))
    if refused:
        state.refused_writes += len(refused)
        logger.warning(
            "server %s: refused write-backs of shards %s from %s (stale generation or not "
            "a member)",
            state.server_id,
            sorted(refused),
            ev.addr,
        )
    return [Reply(ev.req, ReportReply(accepted, refused))]


def on_commit(state: ServerState, ev: Commit) -> list[Action]:
    if state.manifest is None:
        return [Reply(ev.req, None)]
    state.manifest.commit(ev.req, ev.epoch, ev.meta)
    return []


def on_manifest_done(state: ServerState, ev: ManifestDone) -> list[Action]:
    state.failures.pop("manifest", None)
    if state.manifest is None:
        return []
    if state.manifest.failing:
        logger.warning(
            "server %s: the manifest is written again, after %d failed tries",
            state.server_id,
            state.manifest.failing,
        )
    return state.manifest.written(ev.seq)


def on_manifest_failed(state: ServerState, ev: ManifestFailed) -> list[Action]:
    """A failed write is tried again after a back-off (``retry_base`` doubling up to
    ``retry_max``); the write-back and training go on. An outage is logged once, at its
    first failure (the further ones at DEBUG), and once more when a write succeeds."""
    state.now = max(state.now, ev.now)
    if state.manifest is not None:
        state.manifest.failed(ev.error)
    state.backoff("manifest")
    failing = state.manifest.failing if state.manifest is not None else 1
    if failing == 1:
        logger.warning(
            "server %s: writing the manifest failed (%s); the write-back and training go "
            "on, and the manifest is tried again every %gs at most until storage answers",
            state.server_id,
            ev.error,
            state.retry_max,
        )
    else:
        logger.debug(
            "server %s: writing the manifest failed again (%d in a row): %s",
            state.server_id,
            failing,
            ev.error,
        )
    return []


def manifest_actions(state: ServerState) -> list[Action]:
    if state.manifest is None:
        return []
    return state.manifest.actions(state.now, state.ready("manifest"))
