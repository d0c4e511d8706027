"""The DataService: one DataServer actor per DATA worker, their generations, and closing.

Each partition ``p`` has a *generation* ``g``: the actor keyed ``{service}-p{p}-g{g}``,
published as the Dask dataset ``{service}-p{p}`` (which also keeps it alive) together with its
generation and the worker holding it. When a stream finds a server gone or frozen it asks
:meth:`DataService.replacement` for a newer one: a newer generation that another stream already
published, or a new actor on a live DATA worker (one whose heartbeats reach the scheduler),
under the next key, so that only one is made however many streams notice. With no live DATA
worker left the stream serves the partition itself (:meth:`DataService.local_server`) and comes
back when one is.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from ... import config
from ...cluster import DATA, workers_with_role
from ...errors import ClusterError, ConfigError, DatasetError
from ..augment import Augment
from ..datasets import open_split
from ._actor import DataServer
from ._layout import PartitionLayout, check_share
from ._partition import PartitionServer, ServerSettings
from ._stream import BatchStream
from ._types import ServerRef

logger = logging.getLogger(__name__)

__all__ = ["DataService"]


def _as_augment(augment: Augment | bool | None) -> Augment | None:
    if augment is None:
        return Augment.default()
    if augment is True:
        return Augment.from_config()
    if augment is False:
        return None
    if not isinstance(augment, Augment):
        raise ConfigError(
            f"augment={augment!r} is not an Augment",
            "pass adam_dask.data.Augment(...), True, False or None",
        )
    return augment


def _client() -> Any:
    from distributed import get_client

    return get_client()


class DataService:
    """The data-serving layer of one dataset split: one :class:`DataServer` per DATA worker.

    Create it with :meth:`create`. It pickles (actor handles travel), so a replica task on a
    TRAIN worker calls :meth:`stream` itself and talks to the servers peer-to-peer.
    """

    def __init__(
        self,
        *,
        name: str,
        url: str,
        split: str,
        storage_options: dict | None,
        layout: PartitionLayout,
        settings: ServerSettings,
        batch_size: int,
        input_shape: tuple[int, int, int],
        num_classes: int,
    ):
        self.name, self.url, self.split = name, url, split
        self.storage_options = storage_options
        self.layout, self.settings, self.batch_size = layout, settings, int(batch_size)
        self.input_shape, self.num_classes = tuple(input_shape), int(num_classes)
        self._refs: list[ServerRef] | None = None  # None: local serving (no DATA workers)
        self._futures: list[Any] = []  # driver side only: keeps generation 0 alive
        self._closed = False

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        client: Any,
        url: str,
        *,
        split: str = "train",
        storage_options: dict | None = None,
        augment: Augment | bool | None = None,
        seed: int | None = None,
        batch_size: int | None = None,
        buffer_batches: int | None = None,
        cache_bytes: int | None = None,
        threads: int | None = None,
        timeout: float | None = None,
        wait: bool = True,
    ) -> DataService:
        """Start serving split ``split`` of the store at ``url``.

        One :class:`DataServer` actor per DATA worker (pinned to it), each owning a partition;
        with no DATA workers (``client`` may also be ``None``) streams serve locally.

        Parameters
        ----------
        augment : Augment, bool or None
            The augmentation; ``None`` follows ``adam.augment`` (``enabled`` decides), ``False``
            means none, ``True`` means ``Augment.from_config()``.
        seed : int
            Seeds the epoch orders and the augmentation (with epoch and image index);
            ``adam.serving.seed`` by default.
        batch_size, buffer_batches, cache_bytes, threads
            Default to ``adam.serving.batch-size``, ``buffer-batches`` (ready batches per stream),
            ``cache-bytes`` (in-memory bound per server) and ``threads`` (producers per server).
        timeout : float
            Seconds to wait for the actors (``adam.serving.create-timeout``).
        wait : bool
            Wait until every server has loaded its partition (when it fits the cache) and its
            kernels, so the first epoch does not start with a stall.
        """
        settings = ServerSettings.from_config(
            augment=_as_augment(augment),
            seed=seed,
            buffer_batches=buffer_batches,
            cache_bytes=cache_bytes,
            threads=threads,
        )
        batch_size = int(config.get("serving.batch-size", batch_size))
        timeout = float(config.get("serving.create-timeout", timeout))
        if batch_size < 1:
            raise ConfigError(
                f"batch_size={batch_size} must be at least 1", "set it or adam.serving.batch-size"
            )
        s = open_split(url, split, storage_options)  # a clear DatasetError for a bad store
        if len(s) == 0:
            raise DatasetError(f"{s.url}/{split} holds no images", "ingest some data", url=s.url)
        workers = workers_with_role(client, DATA) if client is not None else []
        partitions = max(1, len(workers))
        image_bytes = int(np.prod(s.image_shape))
        layout = PartitionLayout(len(s), s.chunk_images, partitions)
        biggest = max(b - a for a, b in map(layout.partition, range(partitions)))
        if biggest * image_bytes > settings.cache_bytes:
            window = max(1, settings.cache_bytes // (2 * s.chunk_images * image_bytes))
            layout = PartitionLayout(len(s), s.chunk_images, partitions, window)
            logger.info(
                "a partition (%d MB) exceeds cache_bytes=%d: chunk-windowed order, %d "
                "chunks per window",
                biggest * image_bytes >> 20,
                settings.cache_bytes,
                window,
            )
        service = cls(
            name=f"adam-data-{uuid.uuid4().hex[:10]}",
            url=s.url,
            split=split,
            storage_options=storage_options,
            layout=layout,
            settings=settings,
            batch_size=batch_size,
            input_shape=s.input_shape,
            num_classes=s.num_classes,
        )
        if not workers:
            logger.info("no DATA workers: %s is served locally by each stream", s.url)
            return service
        futures = [service._start(client, p, 0, addr) for p, addr in enumerate(workers)]
        try:
            actors = [f.result(timeout=timeout) for f in futures]
        except DatasetError:
            client.cancel(futures)
            raise
        except Exception as exc:
            client.cancel(futures)
            raise ClusterError(
                f"the DataServers did not start within {timeout} s: {type(exc).__name__}: {exc}",
                "check the DATA workers (memory, logs) or raise adam.serving.create-timeout",
            ) from exc
        if wait:
            try:
                for w in [a.ready(timeout) for a in actors]:
                    w.result(timeout=timeout + float(config.get("serving.probe-timeout")))
            except Exception as exc:
                logger.warning("the DataServers did not finish warming up: %s", exc)
        for p, (f, addr) in enumerate(zip(futures, workers)):
            client.publish_dataset(**{service._dataset(p): (f, 0, addr)}, override=True)
        service._refs = [ServerRef(p, a, 0, w) for p, (a, w) in enumerate(zip(actors, workers))]
        service._futures = futures
        logger.info(
            "serving %s/%s from %d DataServers (%s)", s.url, split, len(actors), service.name
        )
        return service

    def _key(self, p: int, gen: int) -> str:
        return f"{self.name}-p{p}-g{gen}"

    def _dataset(self, p: int) -> str:
        return f"{self.name}-p{p}"

    def _start(self, client: Any, p: int, gen: int, addr: str) -> Any:
        """Submit generation ``gen`` of partition ``p``'s DataServer, pinned to ``addr``."""
        return client.submit(
            DataServer,
            self.url,
            self.split,
            self.storage_options,
            self.layout,
            p,
            self.settings,
            key=self._key(p, gen),
            actor=True,
            workers=[addr],
            allow_other_workers=False,
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_futures"] = []
        return state

    # -- properties ---------------------------------------------------------------------------------

    @property
    def local(self) -> bool:
        """True when streams serve locally (no DATA workers)."""
        return self._refs is None

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def augment(self) -> Augment | None:
        return self.settings.augment

    def __len__(self) -> int:
        return self.layout.n

    def servers(self) -> list[str]:
        """The worker address of each partition's DataServer (as this copy knows it)."""
        return [] if self._refs is None else [r.address for r in self._refs]

    def generation(self, p: int) -> int:
        """The newest published generation of partition ``p``'s DataServer (0 when it never
        had to be replaced); -1 when serving locally."""
        return -1 if self._refs is None else self.server(p).generation

    def stream(
        self,
        replica: int = 0,
        replicas: int = 1,
        epoch: int = 0,
        batch_size: int | None = None,
        *,
        prefetch: int | None = None,
        return_index: bool = False,
        return_key: bool = False,
        resume: dict[tuple[int, int], int] | None = None,
        only: dict[tuple[int, int], tuple[int, int]] | None = None,
    ) -> BatchStream:
        """Replica ``replica``'s share (of ``replicas``) of epoch ``epoch``, as a
        :class:`BatchStream` of ``(x float32 (B, C, H, W) in [0, 1], y int64 (B,))``
        (``(x, y, idx)`` with ``return_index``, idx the global image indices; ``(x, y,
        (p, k))`` with ``return_key``: batch ``k`` of partition ``p``, its identity in every
        run of the share). ``resume`` {(p, k): images done}: the share from a data position
        (batches done are not served, partly done ones from their next image); ``only`` {(p,
        k): (first, stop)}: these images of these batches and nothing else."""
        if self._closed:
            raise ClusterError(f"the DataService {self.name} is closed", "create a new one")
        check_share(replica, replicas, epoch)
        bs = int(batch_size or self.batch_size)
        if bs < 1:
            raise ConfigError(f"batch_size={bs} must be at least 1", "give a positive batch size")
        return BatchStream(
            self,
            replica,
            replicas,
            epoch,
            bs,
            prefetch=prefetch,
            return_index=return_index,
            return_key=return_key,
            resume=resume,
            only=only,
        )

    # -- generations: what a stream asks for -------------------------------------------------------

    def _refs_or_fail(self) -> list[ServerRef]:
        if self._refs is None:
            raise ConfigError(
                f"the DataService {self.name} serves locally: it has no DataServers",
                "serve through DATA workers (adam_dask.cluster.local(data_nodes=...))",
            )
        return self._refs

    def _published(self, client: Any, p: int) -> tuple[Any, int, str]:
        """(future, generation, address) published for partition ``p``."""
        pub = client.get_dataset(self._dataset(p), default=None)
        if pub is None:  # create() always publishes: it was closed since
            raise ClusterError(
                f"the DataService {self.name} was closed", "close streams before the service"
            )
        fut, gen, addr = pub
        return fut, int(gen), str(addr)

    def server(self, p: int) -> ServerRef:
        """Partition ``p``'s current DataServer (the newest published generation)."""
        refs = self._refs_or_fail()
        try:
            fut, gen, addr = self._published(_client(), p)
            if gen > refs[p].generation and fut.status != "error":
                actor = fut.result(timeout=float(config.get("serving.recover-timeout")))
                refs[p] = ServerRef(p, actor, gen, addr)
        except ClusterError:
            raise
        except Exception as exc:  # the scheduler is unreachable: use what this copy knows
            logger.debug("partition %d: no published generation (%s)", p, exc)
        return refs[p]

    def live_data_workers(self, silence: float | None = None) -> list[str] | None:
        """DATA workers whose heartbeats reach the scheduler: the last one arrived less than
        ``silence`` seconds ago (``adam.serving.heartbeat-timeout``; by the scheduler's clock,
        on which it stamps them; ``math.inf``: every DATA worker the scheduler has and that is
        not closing). ``None`` when the scheduler cannot say."""
        silence = float(config.get("serving.heartbeat-timeout", silence))
        client = _client()
        try:
            info = client.scheduler_info(n_workers=-1)["workers"]
        except Exception as exc:
            logger.debug("no worker list from the scheduler (%s)", exc)
            return None
        now = 0.0
        if not math.isinf(silence):  # members only: no clock needed
            try:
                now = float(client.run_on_scheduler(time.time))
            except Exception as exc:  # not allowed here: the newest heartbeat of any worker
                logger.debug("no clock from the scheduler (%s)", exc)
                now = max((float(w.get("last_seen", 0.0)) for w in info.values()), default=0.0)
        return sorted(
            a
            for a, w in info.items()
            if w.get("resources", {}).get(DATA)
            and not str(w.get("status", "running")).startswith("clos")
            and now - float(w.get("last_seen", now)) <= silence
        )

    def replacement(self, p: int, failed: ServerRef) -> ServerRef | None:
        """A DataServer for partition ``p`` newer than ``failed``: one another stream already
        published, else a new generation on a live DATA worker other than ``failed``'s (the
        one with the fewest of this service's servers). ``None`` when no DATA worker can take
        it within ``adam.serving.recover-timeout``: the caller serves the partition itself.

        One stream at a time replaces a partition's server (a lock per partition on the
        scheduler, released when its holder's process dies): every replica's stream loses the
        same server at once, and each starting a generation of its own would load the
        partition once per replica; the others wait and take the one it published."""
        from distributed import Lock

        self._refs_or_fail()
        client = _client()
        timeout = float(config.get("serving.recover-timeout"))
        claim = Lock(f"{self._dataset(p)}-replacing")
        if not claim.acquire(timeout=timeout):
            logger.warning("partition %d: another stream's replacement took over %ss", p, timeout)
            return None
        try:
            return self._replace(client, p, failed, timeout)
        finally:
            claim.release()

    def _replace(self, client: Any, p: int, failed: ServerRef, timeout: float) -> ServerRef | None:
        refs = self._refs_or_fail()
        avoid = {failed.address}
        for _ in range(2):  # a second try covers a target that died meanwhile
            fut, gen, addr = self._published(client, p)
            if gen > failed.generation:  # another stream was first
                if fut.status != "error":
                    try:
                        refs[p] = ServerRef(p, fut.result(timeout=timeout), gen, addr)
                        return refs[p]
                    except Exception as exc:
                        logger.warning("partition %d: generation %d is unusable: %s", p, gen, exc)
                avoid.add(addr)
                failed = ServerRef(p, None, gen, addr)
            live = [a for a in self.live_data_workers() or () if a not in avoid]
            if not live:
                return None
            load = Counter(r.address for r in refs)
            target = min(live, key=lambda a: (load[a], a))
            gen = max(gen, failed.generation) + 1
            logger.warning("partition %d: starting DataServer generation %d on %s", p, gen, target)
            fut = self._start(client, p, gen, target)
            try:
                actor = fut.result(timeout=timeout)
            except DatasetError:
                raise
            except Exception as exc:
                logger.warning("partition %d: generation %d did not start: %s", p, gen, exc)
                avoid.add(target)
                failed = ServerRef(p, None, gen, target)
                continue
            where = client.who_has([fut]).get(fut.key) or [target]  # where it really runs
            client.publish_dataset(**{self._dataset(p): (fut, gen, where[0])}, override=True)
            refs[p] = ServerRef(p, actor, gen, where[0])
            return refs[p]
        return None

    def local_server(self, p: int) -> PartitionServer:
        """A :class:`PartitionServer` of partition ``p`` in this process (the last resort)."""
        return PartitionServer(
            self.url, self.split, self.storage_options, self.layout, p, self.settings
        )

    # -- stats, close ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Per-server figures (images served, buffer occupancy, cache) and totals."""
        if self._refs is None:
            return {"servers": [], "images_served": 0, "local": True}
        timeout = float(config.get("serving.call-timeout"))
        servers: list[dict] = []
        calls = []
        for p in range(self.layout.partitions):
            try:
                calls.append((p, self.server(p).actor.stats()))
            except Exception as exc:
                servers.append({"partition": p, "error": f"{type(exc).__name__}: {exc}"})
        for p, call in calls:
            try:
                servers.append(call.result(timeout=timeout))
            except Exception as exc:
                servers.append({"partition": p, "error": f"{type(exc).__name__}: {exc}"})
        servers.sort(key=lambda d: int(d["partition"]))
        return {
            "servers": servers,
            "local": False,
            "images_served": sum(s.get("images_served", 0) for s in servers),
            "buffer_occupancy": [s.get("buffer_occupancy") for s in servers],
        }

    def close(self) -> None:
        """Stop the servers and release the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._refs is None:
            return
        try:
            client = _client()
        except ValueError:
            return
        timeout = float(config.get("serving.probe-timeout"))  # a frozen server is skipped
        for p in range(self.layout.partitions):
            try:
                self.server(p).actor.shutdown().result(timeout=timeout)
            except Exception as exc:
                logger.debug("partition %d: shutdown failed (%s)", p, exc)
            try:
                # bounded: closing must not hang on a scheduler that does not answer
                client.unpublish_dataset(self._dataset(p), callback_timeout=10 * timeout)
            except Exception as exc:
                logger.debug("partition %d: unpublish failed (%s)", p, exc)
        for f in self._futures:  # with the datasets unpublished, the actors are released
            f.release()
        self._futures = []

    def __enter__(self) -> DataService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "local" if self.local else f"{self.layout.partitions} DataServers"
        return f"<DataService {self.name} {self.url}/{self.split}: {self.layout.n} images, {where}>"
