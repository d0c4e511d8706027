"""Pushes from a parameter-server handle, and with ``ack="replay"`` their replay: each push a
primary acknowledged is kept (a :class:`~adam_dask.ps._replay.ReplayLog`) until that primary
reports it durable (every copy holds it, and the checkpoint when there is one), and sent again,
with its push id, to a new primary after a fail-over or a restore from the checkpoint. A
background task keeps settling while pushes are held, so they are replayed even when the pusher
pushes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import config
from ..errors import ShardUnavailable
from ._client import Transport
from ._replay import HeldPush
from .state import Mark

logger = logging.getLogger(__name__)

__all__ = ["Pushing"]

_settlers: set[asyncio.Task] = set()  # background settle tasks, kept alive until they finish


class Pushing(Transport):
    """Push, pull and flush of a handle (mixed into ParameterServer)."""

    size: int
    ack: str
    copies: int
    checkpoint: str | None
    _rng: Any

    async def _push(
        self,
        rpc: Any,
        sched: Any,
        delta: np.ndarray,
        ack: str | None,
        mark: Mark | None = None,
        push_id: int | None = None,
        sids: Iterable[int] | None = None,
        nonzero: np.ndarray | None = None,
    ) -> None:
        """Push ``delta`` to the primaries of ``sids`` (all shards by default) with actor calls;
        ``push_id``: the id the data plane already used for this push (the shards it could not
        deliver come here); ``nonzero``: which shards hold a non-zero value (scanned once by
        the caller)."""
        push_id = self._rng.getrandbits(62) if push_id is None else push_id
        ack = ack or self.ack

        # A shard whose part of the delta is all zeros (the weights of dense layers whose update
        # goes as activations and errors, push_outer) gets None: the push is recorded (its id,
        # its mark, a version) without sending or adding zeros.
        if nonzero is None:
            zero = {s for s, (a, b) in enumerate(self.shards) if not delta[a:b].any()}
        else:
            zero = {s for s in range(len(self.shards)) if not nonzero[s]}

        def part(s: int) -> np.ndarray | None:
            return None if s in zero else delta[self.shards[s][0] : self.shards[s][1]]

        def args(sids: list[int]) -> tuple:
            return ({s: part(s) for s in sids}, push_id, ack, self._stamps(sids), mark)

        def payload(sid: int) -> tuple[Any, int]:
            p = part(sid)
            return (None, 0) if p is None else (p.copy(), p.nbytes)

        sids = range(len(self.shards)) if sids is None else sorted(sids)
        await self._send_push(rpc, sched, sids, "push", args, push_id, ack, payload, mark)

    async def _push_outer(
        self,
        rpc: Any,
        sched: Any,
        parts: dict,
        offset: int,
        out: int,
        inp: int,
        errors: np.ndarray,
        activations: np.ndarray,
        scale: float,
        ack: str | None,
        mark: Mark | None = None,
    ) -> None:
        push_id = self._rng.getrandbits(62)
        ack = ack or self.ack

        def cols(s: int) -> np.ndarray:
            return np.ascontiguousarray(errors[:, parts[s].row0 : parts[s].row1])

        def args(sids: list[int]) -> tuple:
            c = {s: cols(s) for s in sids}
            stamps = self._stamps(sids)
            return (c, offset, out, inp, activations, scale, push_id, ack, stamps, mark)

        def payload(sid: int) -> tuple[Any, int]:
            c = cols(sid).copy()
            return (c, offset, out, inp, activations, scale), c.nbytes + activations.nbytes

        await self._send_push(rpc, sched, parts, "push_outer", args, push_id, ack, payload, mark)

    async def _pull(self, rpc: Any, sched: Any, sids: list[int], out: np.ndarray) -> None:
        if self._log:
            await self._replay_moved(rpc, sched)

        def args(s: list[int]) -> tuple:
            return (s, self._stamps(s))

        got = await self._each_primary(rpc, sched, sids, "pull", args)
        for sid, values in got.items():
            a, b = self.shards[sid]
            out[a:b] = values

    async def _flush(
        self, rpc: Any, sched: Any, timeout: float, checkpoint: bool = True
    ) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        wait_heal = time.monotonic() + min(timeout, float(config.get("ps.failover-timeout")))
        while True:
            await self._refresh(sched)
            if self._healthy or time.monotonic() > wait_heal:
                break
            await asyncio.sleep(0.1)
        if not self._healthy:
            logger.warning(
                "server %s: flushing with fewer than %d copies of some shards (a "
                "PS worker is missing)",
                self.server_id,
                self.copies,
            )
        await self._replay_moved(rpc, sched)
        remaining = max(deadline - time.monotonic(), 1.0)

        def flushed(addr: str, reply: dict) -> None:  # every copy holds the flushed versions
            self._confirm(addr, reply, "per_shard")

        return await self._each_primary(
            rpc,
            sched,
            range(len(self.shards)),
            "flush",
            lambda s: (s,),
            call_timeout=remaining + 5,
            on_reply=flushed,
            limit=remaining,
            checkpoint=checkpoint,
        )

    async def _marks(
        self, rpc: Any, sched: Any, epoch: int
    ) -> dict[int, dict[int, tuple[Mark, ...]]]:
        return await self._each_primary(
            rpc, sched, range(len(self.shards)), "marks", lambda s: (s, int(epoch))
        )

    async def _commit(self, rpc: Any, sched: Any, epoch: Any, meta: dict | None) -> dict:
        return await sched.adam_ps_commit(server_id=self.server_id, epoch=epoch, meta=meta)

    async def _send_push(
        self,
        rpc: Any,
        sched: Any,
        sids: Iterable[int],
        method: str,
        args: Callable[[list[int]], tuple],
        push_id: int,
        ack: str,
        payload: Callable[[int], tuple[Any, int]],
        mark: Mark | None = None,
    ) -> None:
        """Send one push to the primaries of ``sids``; with ``ack="replay"`` keep each shard's
        part (``payload(sid)`` -> (payload, nbytes)) and its ``mark`` until every copy holds
        it."""
        keep = ack == "replay"
        limit = int(config.get("ps.replay-bytes"))
        if keep and self._log.nbytes > limit:
            self._shed(limit)
            if self._log.nbytes > limit:
                await self._settle(rpc, sched, below=limit)

        def on_reply(addr: str, reply: dict) -> None:
            if keep:
                for sid, version in reply["per_shard"].items():
                    part, nbytes = payload(int(sid))
                    gen = int(reply["gens"][sid])
                    held = HeldPush(push_id, method, part, addr, gen, int(version), nbytes, mark)
                    self._log.add(int(sid), held)
            self._confirm(addr, reply)

        await self._each_primary(rpc, sched, sids, method, args, on_reply=on_reply)
        if keep:
            await self._replay_moved(rpc, sched)
            await self._keep_settling(rpc, sched)

    async def _keep_settling(self, rpc: Any, sched: Any) -> None:
        """Start the background settler unless it runs (pushes are held)."""
        if self._log and (self._settler is None or self._settler.done()):
            self._settler = asyncio.ensure_future(self._settle_in_background(rpc, sched))
            _settlers.add(self._settler)
            self._settler.add_done_callback(_settlers.discard)

    def _confirm(self, addr: str, reply: dict, key: str = "confirmed") -> None:
        """Drop the held pushes ``reply`` says are durable, and mark replicated those it says
        every copy holds (``reply[key]``: {sid: version}; ``reply["durable"]``: {sid: version
        the checkpoint holds too});
        ``reply["gens"]`` names the generation of the answering primary."""
        durable = reply.get("durable")
        for sid, version in (reply.get(key) or {}).items():
            d = None if durable is None else int(durable.get(sid, -1))
            self._log.confirm(int(sid), addr, int(reply["gens"][sid]), int(version), d)

    def _shed(self, below: int) -> None:
        """Over the byte budget: let go of the pushes every copy holds that wait for the
        checkpoint alone (its write-back is behind: a storage outage, or a slow store)."""
        gone = self._log.shed(below)
        if not gone:
            return
        self._shed_count = getattr(self, "_shed_count", 0) + gone
        now = time.monotonic()
        if now - getattr(self, "_shed_logged", -60.0) >= 60.0:  # once a minute in an outage
            self._shed_logged = now
            logger.warning(
                "server %s: the checkpoint is behind; %d push(es) every copy holds are no longer "
                "kept against the loss of all copies (adam.ps.replay-bytes)",
                self.server_id,
                self._shed_count,
            )
            self._shed_count = 0

    async def _replay_moved(self, rpc: Any, sched: Any) -> int:
        """Send the held pushes of shards whose primary changed to the new primary (same push
        ids: a push the survivors or the checkpoint already hold is applied once). Returns how
        many were sent."""
        sent = 0
        while True:
            moved = self._log.moved(self._primary_of())
            if not moved:
                return sent
            for sid, items in moved.items():
                for h in items:
                    await self._replay_one(rpc, sched, sid, h)
                    sent += 1
                    self._log.replayed += 1

    async def _replay_one(self, rpc: Any, sched: Any, sid: int, h: HeldPush) -> None:
        def args(sids: list[int]) -> tuple:
            stamps = self._stamps([sid])
            if h.method == "push":
                return ({sid: h.payload}, h.push_id, "replay", stamps, h.mark)
            cols, offset, out, inp, activations, scale = h.payload
            rest = (h.push_id, "replay", stamps, h.mark)
            return ({sid: cols}, offset, out, inp, activations, scale, *rest)

        def on_reply(addr: str, reply: dict) -> None:
            for s, version in reply["per_shard"].items():
                self._log.acknowledged(int(s), h.push_id, addr, int(reply["gens"][s]), int(version))
            self._confirm(addr, reply)

        logger.info(
            "server %s: replaying push %x to the new primary of shard %d",
            self.server_id,
            h.push_id,
            sid,
        )
        await self._each_primary(rpc, sched, [sid], h.method, args, on_reply=on_reply)

    async def _settle(
        self, rpc: Any, sched: Any, below: int = 0, *, copies_only: bool = False
    ) -> None:
        """Until the held pushes take at most ``below`` bytes (``copies_only``: until every
        copy holds each one, the checkpoint may lag): replay moved ones, ask the
        primaries what every copy and the checkpoint hold. :class:`ShardUnavailable` after the
        fail-over timeout without progress while some copy still lacks a push (the held bytes
        going down restarts it: copies that confirm slowly, a large model's pushes on a busy
        machine, are not a failure). A push waiting for room sheds the pushes every copy holds
        that wait for the checkpoint alone (:meth:`_shed`); the background settler waits for the
        checkpoint as long as it takes."""
        timeout = float(config.get("ps.failover-timeout"))
        deadline = time.monotonic() + timeout
        interval = float(config.get("ps.forward-interval"))
        held = self._log.nbytes
        while self._log and self._log.nbytes > below:
            if copies_only and not self._log.unreplicated:
                return
            if self._log.nbytes < held:
                held = self._log.nbytes
                deadline = time.monotonic() + timeout
            await self._refresh(sched)
            await self._replay_moved(rpc, sched)
            sids = self._log.shards()
            if sids:
                await self._each_primary(
                    rpc,
                    sched,
                    sids,
                    "confirmed",
                    lambda s: (s,),
                    on_reply=lambda a, r: self._confirm(a, r, "per_shard"),
                )
            if below > 0:  # room for a push: those waiting for the checkpoint alone go first
                self._shed(below)
            if not self._log or self._log.nbytes <= below:
                return
            if copies_only and not self._log.unreplicated:
                return
            if time.monotonic() > deadline:
                if not self._log.unreplicated:
                    # every copy holds what is left; only the checkpoint is behind: keep waiting
                    deadline = time.monotonic() + timeout
                    continue
                sid = self._log.shards()[0]
                raise ShardUnavailable(
                    f"server {self.server_id}: the copies of shard {sid} did not confirm "
                    f"{len(self._log)} acknowledged push(es) in time",
                    "check the PS workers (adam.ps.failover-timeout)",
                    shard=sid,
                )
            await asyncio.sleep(interval / 2)

    async def _settle_in_background(self, rpc: Any, sched: Any) -> None:
        """Keep settling while pushes are held (so they are replayed after a fail-over even
        when no more pushes come); ends when every held push is durable."""
        interval = float(config.get("ps.forward-interval"))
        while self._log and not self._closed:
            await asyncio.sleep(interval)
            if time.monotonic() - self._plane_answered < interval:
                continue  # pushes flow: their answers confirm the held ones (no calls needed)
            try:
                await self._settle(rpc, sched)
            except KeyError as exc:
                if "no parameter server" not in str(exc):
                    logger.warning("server %s: replaying held pushes: %r", self.server_id, exc)
                    continue
                # the scheduler knows the server no more: it was closed
                logger.info(
                    "server %s was closed; %d held push(es) no longer replayed",
                    self.server_id,
                    len(self._log),
                )
                return
            except Exception as exc:
                logger.warning(
                    "server %s: %d held push(es) not confirmed yet (%s); still trying",
                    self.server_id,
                    len(self._log),
                    exc,
                )
