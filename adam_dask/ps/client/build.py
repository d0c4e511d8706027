"""Making a parameter server: its settings, the checkpoint (a new one, or the one it keeps
writing to), the nodes (through the controller in the scheduler) and their first values. The
classmethods ``ParameterServer.create`` and ``ParameterServer.restore`` build through here.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from typing import Any

import dask.config
import numpy as np

from ... import config
from ..._secrets import redact_url
from ..._worker_preload import RedactLogs, TaskProfiler
from ...errors import ConfigError, StorageError, UpdateRejected
from ...model.layout import ParameterLayout, shard_ranges
from ...storage import normalize_url
from ..checkpoint import init_checkpoint, read_checkpoint, read_marks, read_states
from ..protocol.optimizer import ServerOptimizer
from ..protocol.policy import PLUGIN_NAME
from ..protocol.shard_kernels import first_nonfinite
from ..runtime.plugin import ShardPlacement

logger = logging.getLogger(__name__)

__all__ = [
    "ACKS",
    "attach_server",
    "build_server",
    "resolve_copies",
    "resolve_size",
    "restore_server",
    "shard_of",
]

ACKS = ("replay", "all", "primary")
"""When a push returns (``adam.ps.ack``, ``ack=``) and what a lost primary may take with it:

* ``"replay"`` (the default): once the primary applied it; the handle keeps the push until the
  primary reports every copy holds it, and sends it again to the new primary after a fail-over
  (:mod:`adam_dask.ps.protocol.replay`). No acknowledged update is lost while one copy or the pusher
  survives, at the cost of a copy of each push kept for about a ``forward-interval``.
* ``"all"``: once every copy holds it; nothing acknowledged is lost while one copy survives,
  but every push waits for a forward.
* ``"primary"``: once the primary applied it, as in the paper; the updates of the last
  ``forward-interval`` are lost when that primary dies before forwarding.

A shard whose copies are all lost is rebuilt from its last write-back in the checkpoint while
training goes on; the updates after that write-back are lost (``stats()["restored"]``).
"""


def resolve_copies(copies: int | None, replicas: int | None) -> int:
    """``copies``, or the ``replicas=`` alias, or ``adam.ps.copies`` (the deprecated key
    ``adam.ps.replicas`` still counts, with a warning)."""
    if copies is None and replicas is not None:
        copies = replicas
    if copies is None:
        old = dask.config.get("adam.ps.replicas", None)
        if old is not None:
            warnings.warn(
                "the setting adam.ps.replicas is deprecated: the copies of a shard are "
                "adam.ps.copies",
                DeprecationWarning,
                stacklevel=4,
            )
            copies = old
    n = int(config.get("ps.copies", copies))
    if n < 1:
        raise ConfigError(f"copies={n}", "keep at least one copy of every shard")
    return n


def shard_of(shards: list[tuple[int, int]], index: int) -> int:
    per = shards[0][1] - shards[0][0]
    return min(index // per, len(shards) - 1)


def load(
    courier: Any,
    shards: list[tuple[int, int]],
    values: np.ndarray,
    versions: dict[int, int],
    marks: dict[int, Any],
    states: dict[int, np.ndarray],
) -> None:
    """Send a new server's first values (with the data positions they hold and the
    optimizer's state) to every holder of every shard."""
    calls = {}
    for a, sids in courier.routing.holders().items():
        part = {s: values[shards[s][0] : shards[s][1]] for s in sids}
        vs = {s: versions[s] for s in sids}
        ms = {s: list(marks.get(s, ())) for s in sids}
        sts = {s: states[s] for s in sids if s in states}
        calls[a] = (courier.routing.key(a), "load", part, vs, ms, sts)
    timeout = float(config.get("ps.call-timeout"))
    for a, r in courier.control.each(calls, timeout).items():
        if isinstance(r, BaseException):
            raise r


def build_server(
    cls: Any,
    client: Any,
    *,
    size: int,
    layout: ParameterLayout | None,
    shard_bytes: int | None,
    copies: int,
    checkpoint: str | None,
    storage_options: dict | None,
    init: np.ndarray | None,
    meta: dict | None,
    ack: str | None,
    name: str | None,
    epoch: Any,
    versions: list[int] | None = None,
    manifest: dict | None = None,
    generation: int = 0,
    marks: dict[int, Any] | None = None,
    optimizer: ServerOptimizer | None = None,
    states: dict[int, np.ndarray] | None = None,
) -> Any:
    """Make the server: a new checkpoint unless ``manifest`` (one to keep writing to) is
    given, the nodes, and their initial values at ``versions`` with the data positions
    ``marks`` {sid: [Mark]} and the optimizer's ``states`` {sid: momentum} they hold."""
    optimizer = optimizer if optimizer is not None else ServerOptimizer()
    if optimizer.state_vectors == 0:
        states = None
    shard_bytes = int(config.get("ps.shard-bytes", shard_bytes))
    ack = config.get("ps.ack", ack)
    if ack not in ACKS:
        raise ConfigError(
            f"ack={ack!r} is not one of {ACKS}", "use ack='replay', 'all' or 'primary'"
        )
    shards = shard_ranges(size, shard_bytes)
    if init is not None:
        init = np.ascontiguousarray(init, dtype=np.float32).reshape(-1)
        if init.shape[0] != size:
            raise ConfigError(f"init has {init.shape[0]} values, the server {size}")
        bad = first_nonfinite(init)
        if bad >= 0:
            raise UpdateRejected(
                f"init holds a non-finite value at index {bad}", shard=shard_of(shards, bad)
            )
    checkpoint = str(checkpoint) if checkpoint is not None else None
    server_id = name or uuid.uuid4().hex[:12]
    layout_doc = layout.to_dict() if layout is not None else None
    if checkpoint is not None and manifest is None:
        manifest = init_checkpoint(
            checkpoint,
            storage_options,
            size=size,
            shard_bytes=shard_bytes,
            shards=shards,
            values=init,
            versions=versions,
            generation=generation,
            epoch=epoch,
            meta=meta,
            layout=layout_doc,
            server_id=server_id,
            optimizer=optimizer.to_dict(),
            states=states,
        )
    node_config = {
        "forward_interval": float(config.get("ps.forward-interval")),
        "writeback_interval": float(config.get("ps.writeback-interval")),
        "heartbeat_interval": float(config.get("ps.heartbeat-interval")),
        "retry_base": float(config.get("ps.retry-base")),
        "retry_max": float(config.get("ps.retry-max")),
        "forward_retry_max": float(config.get("ps.forward-retry-max")),
        "call_timeout": float(config.get("ps.call-timeout")),
        "data_plane": str(config.get("ps.data-plane")),
        "dedup_window": int(config.get("ps.dedup-window")),
        "optimizer": optimizer.to_dict(),
        "ack": ack,
        "checkpoint": checkpoint,
        "storage_options": storage_options,
    }
    info = {
        "size": size,
        "shards": [list(s) for s in shards],
        "shard_bytes": shard_bytes,
        "copies": copies,
        "ack": ack,
        "checkpoint": checkpoint,
        "storage_options": storage_options,
        "meta": meta or {},
        "layout": layout_doc,
        "optimizer": optimizer.to_dict(),
    }
    client.register_plugin(ShardPlacement(), name=PLUGIN_NAME)
    client.register_plugin(RedactLogs())  # the workers of any cluster redact their logs
    client.register_plugin(TaskProfiler())  # and run no profiler that can deadlock them
    routing = client.sync(
        client.scheduler.adam_ps_create,
        server_id=server_id,
        shards=[list(s) for s in shards],
        copies=copies,
        node_config=node_config,
        info=info,
        manifest=manifest,
        generation=generation,
    )
    if "refused" in routing:  # the scheduler, the manifest's writer, can not reach it
        raise StorageError(
            f"the scheduler can not reach the checkpoint at {redact_url(str(checkpoint))} "
            f"({routing['refused']})",
            "the scheduler writes the checkpoint's manifest: give it the storage the workers "
            "and this process reach (the same volume or bucket, endpoint and credentials)",
        )
    server = cls(
        server_id,
        size,
        shards,
        shard_bytes=shard_bytes,
        copies=copies,
        ack=ack,
        checkpoint=checkpoint,
        storage_options=storage_options,
        layout=layout,
        meta=meta,
        client=client,
        optimizer=optimizer,
    )
    server._courier.routing.set(routing)
    if init is not None or versions is not None:
        values = init if init is not None else np.zeros(size, dtype=np.float32)
        vs = {i: int(v) for i, v in enumerate(versions or [0] * len(shards))}
        load(server._courier, shards, values, vs, marks or {}, states or {})
    server.epoch = epoch
    logger.info("created %r", server)
    return server


def restore_server(
    cls: Any,
    client: Any,
    url: str,
    storage_options: dict | None,
    checkpoint: str | None,
    kwargs: dict,
) -> Any:
    """``ParameterServer.restore``: a new server of class ``cls`` holding the last complete
    checkpoint at ``url``, writing back to ``checkpoint`` (default: ``url``); ``kwargs``: the
    other keywords of ``create``."""
    manifest, values = read_checkpoint(url, storage_options)
    opt = kwargs.pop("optimizer", None)
    optimizer = (
        ServerOptimizer.from_dict(manifest.get("optimizer"))
        if opt is None
        else ServerOptimizer.resolve(opt)
    )
    layout = ParameterLayout.from_dict(manifest["layout"]) if manifest.get("layout") else None
    target = checkpoint if checkpoint is not None else url
    shard_bytes = int(kwargs.pop("shard_bytes", None) or manifest["shard_bytes"])
    same_shards = shard_bytes == int(manifest["shard_bytes"])
    keep = (
        normalize_url(str(target)) == normalize_url(str(url))
        and same_shards
        and int(manifest.get("format_version", 1)) >= 2
    )
    server = build_server(
        cls,
        client,
        size=int(manifest["size"]),
        layout=layout,
        shard_bytes=shard_bytes,
        copies=resolve_copies(kwargs.pop("copies", None), kwargs.pop("replicas", None)),
        checkpoint=target,
        storage_options=storage_options,
        init=values,
        meta=manifest.get("meta") or {},
        ack=kwargs.pop("ack", None),
        name=kwargs.pop("name", None),
        epoch=manifest.get("epoch"),
        versions=[int(v) for v in manifest["versions"]] if same_shards else None,
        manifest=manifest if keep else None,
        generation=max(manifest.get("generations") or [0]) + 1,
        marks=read_marks(url, storage_options, manifest) if same_shards else None,
        optimizer=optimizer,
        states=read_states(url, storage_options, manifest) if same_shards else None,
    )
    if kwargs:
        raise ConfigError(f"restore() got unexpected keywords {sorted(kwargs)}")
    logger.info("restored %r from %s (epoch %s)", server, url, server.epoch)
    return server


def attach_server(cls: Any, client: Any, name: str) -> Any:
    """``ParameterServer.attach``: a handle of class ``cls`` on the running server ``name``."""
    routing = client.sync(client.scheduler.adam_ps_routing, server_id=name)
    info = routing["info"]
    layout = ParameterLayout.from_dict(info["layout"]) if info.get("layout") else None
    server = cls(
        name,
        info["size"],
        [tuple(s) for s in info["shards"]],
        shard_bytes=info["shard_bytes"],
        copies=info["copies"],
        ack=info["ack"],
        checkpoint=info["checkpoint"],
        storage_options=None,  # the controller sends them to no one
        layout=layout,
        meta=info["meta"],
        client=client,
        optimizer=ServerOptimizer.from_dict(info.get("optimizer")),
    )
    server._courier.routing.set(routing)
    return server


def resolve_size(size: int | None, layout: ParameterLayout | None) -> int:
    """The server's size: ``size``, or the layout's (which ``size`` must then match)."""
    if layout is not None:
        if size is not None and int(size) != layout.size:
            raise ConfigError(
                f"size={size} does not match the layout's {layout.size} floats",
                "give one of size= or layout=",
            )
        size = layout.size
    if size is None:
        raise ConfigError("a parameter server needs size= or layout=")
    return int(size)
