"""Roles, the embedded local cluster, and connecting to an existing one.

A Project Adam cluster has three roles, expressed as Dask worker resources:

* ``PS``: parameter-server workers holding copies of the shards (PSNode actors),
* ``DATA``: data-serving workers (DataServer actors),
* ``TRAIN``: model-training workers, one model replica each (a seceded long-running task).

:func:`local` starts all of them on this machine. Each PS worker binds a distinct loopback host
(127.0.0.2, 127.0.0.3, ...), so "three copies on distinct hosts" is real even on one box; the
whole 127.0.0.0/8 range is loopback on Linux. The embedded cluster serves the Dask dashboard
(``adam.cluster.dashboard-address``) and, when asked (``tls=True``, ``adam.cluster.tls``), speaks
TLS between every scheduler, worker and client with certificates made for this cluster only.

:func:`connect` reaches an existing scheduler or creates a cluster on a dask-gateway;
:func:`client_for` picks one of the three for a job (the CLI and the pipelines use it), and
:func:`assign_roles` gives roles to workers started without them.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

from distributed import Client, Nanny, Scheduler

from .. import config, sizing
from .._worker_preload import task_profiler_allowed
from ..errors import ClusterError, ConfigError
from ._embedded import EmbeddedClient, EmbeddedCluster

logger = logging.getLogger(__name__)

__all__ = [
    "DATA",
    "PS",
    "ROLES",
    "TRAIN",
    "EmbeddedClient",
    "assign_roles",
    "client_for",
    "connect",
    "dashboard_link",
    "local",
    "local_spec",
    "resolve_data_nodes",
    "resolve_trainers",
    "workers_with_role",
]

PS, DATA, TRAIN = "PS", "DATA", "TRAIN"
ROLES = (PS, DATA, TRAIN)


def _free_dashboard_address(address: str) -> str:
    """``address`` when its port is free (or 0), else the same host on a free port.

    distributed would fall back by itself, but with a ``UserWarning`` (an error where warnings
    are errors) and only after binding failed; asking first keeps the start quiet.
    """
    from distributed.utils import clean_dashboard_address

    first = clean_dashboard_address(address)[0]
    host, port = first["address"], int(first["port"])
    if port == 0:
        return address
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            logger.info("dashboard port %d is in use; serving on a free port", port)
            return f"{host}:0"
    return address


def _trainers(trainers: Any, threads: Any) -> tuple[int, int]:
    """Trainer count and threads from settings that may be ``"auto"`` (see :mod:`.sizing`)."""
    auto_trainers, auto_threads = sizing.size_trainers(sizing.machine_cores())
    n = auto_trainers if str(trainers).lower() == sizing.AUTO else _count("trainers", trainers)
    t = auto_threads if str(threads).lower() == sizing.AUTO else _count("trainer_threads", threads)
    return n, t


def resolve_trainers(value: Any) -> int:
    """The TRAIN worker count a setting (``adam.cluster.trainers``) names: a number, or
    ``"auto"`` for the count this machine is sized for (:mod:`.sizing`)."""
    return _trainers(value, 1)[0]


def _role_counts(
    ps_nodes: Any = None, data_nodes: Any = None, trainers: Any = None, threads: Any = None
) -> tuple[int, int, int, int]:
    """(PS workers, DATA workers, TRAIN workers, threads per TRAIN worker): each value given,
    else its ``adam.cluster`` setting; ``auto`` trainers and threads sized from this machine,
    ``auto`` DATA workers from those replicas' demand."""
    ps = int(config.get("cluster.ps-nodes", ps_nodes))
    train, t = _trainers(
        config.get("cluster.trainers", trainers), config.get("cluster.trainer-threads", threads)
    )
    data = resolve_data_nodes(config.get("cluster.data-nodes", data_nodes), train, t)
    return ps, data, train, t


def resolve_data_nodes(value: Any, trainers: int, threads: int) -> int:
    """The DATA worker count a setting (``adam.cluster.data-nodes``) names: a number, or
    ``"auto"`` for the count ``trainers`` replicas of ``threads`` Hogwild threads need
    (:func:`.sizing.size_data_nodes`). Every reader of the setting comes here."""
    if str(value).lower() == sizing.AUTO:
        return sizing.size_data_nodes(trainers, max(1, threads))
    return _count("data_nodes", value)


def _count(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a count", 'give a number or "auto"') from None


def local_spec(
    ps_nodes: int | None = None,
    data_nodes: int | None = None,
    trainers: int | None = None,
    *,
    trainer_threads: int | None = None,
    memory_limit: str | int | None = None,
    dashboard_address: str | None = None,
    security: Any = None,
) -> tuple[dict, dict]:
    """The scheduler and worker specs of the embedded cluster (for :class:`SpecCluster`).

    PS worker ``i`` binds ``127.0.0.{2+i}``; DATA and TRAIN workers bind 127.0.0.1. The
    scheduler serves the dashboard at ``dashboard_address`` (``""`` or ``"none"`` turns it off);
    workers serve none, as in :class:`distributed.LocalCluster`. A
    :class:`distributed.security.Security` makes every connection TLS.
    """
    ps_nodes, data_nodes, trainers, trainer_threads = _role_counts(
        ps_nodes, data_nodes, trainers, trainer_threads
    )
    memory_limit = config.get("cluster.memory-limit", memory_limit)
    if str(memory_limit).lower() == sizing.AUTO:
        memory_limit = sizing.size_memory_limit(
            sizing.machine_memory(), max(1, ps_nodes + data_nodes + trainers)
        )
    dashboard_address = config.get("cluster.dashboard-address", dashboard_address)
    if str(dashboard_address).lower() in ("", "none", "false"):
        dashboard_address = None
    for name, n in (("ps_nodes", ps_nodes), ("data_nodes", data_nodes), ("trainers", trainers)):
        if n < 0:
            raise ConfigError(f"{name}={n} is negative", "give a count of 0 or more")
    if ps_nodes > 250:
        raise ConfigError(
            f"ps_nodes={ps_nodes} exceeds the 250 loopback hosts available",
            "use a real cluster for more PS workers",
        )
    if ps_nodes + data_nodes + trainers == 0:
        raise ConfigError("the cluster would have no workers", "ask for at least one worker")
    # the workers' preload reads it: a bad setting fails here, not in each worker's start
    task_profiler_allowed(config.get("cluster.task-profiler"))
    if dashboard_address is not None:
        dashboard_address = _free_dashboard_address(str(dashboard_address))
    tls = {"protocol": "tls://", "security": security} if security is not None else {}

    scheduler = {
        "cls": Scheduler,
        "options": {
            "host": "127.0.0.1",
            "dashboard": dashboard_address is not None,
            "dashboard_address": dashboard_address,
            **tls,
        },
    }
    workers: dict[str, dict] = {}

    def add(name: str, host: str, role: str, nthreads: int) -> None:
        workers[name] = {
            "cls": Nanny,
            "options": {
                "host": host,
                "nthreads": nthreads,
                "resources": {role: 1},
                "memory_limit": memory_limit,
                "name": name,
                "dashboard": False,
                # the user's SIGINT (kernel stop, Ctrl-C) reaches the whole process group:
                # it is meant for the training call, not the workers (_worker_preload)
                "preload": ["adam_dask._worker_preload"],
                **tls,
            },
        }

    for i in range(ps_nodes):
        add(f"ps-{i}", f"127.0.0.{2 + i}", PS, 1)
    for i in range(data_nodes):
        add(f"data-{i}", "127.0.0.1", DATA, 1)
    for i in range(trainers):
        # one slot for the seceded replica task, the Hogwild threads run inside it
        add(f"train-{i}", "127.0.0.1", TRAIN, max(1, trainer_threads))
    return scheduler, workers


def _temporary_security() -> Any:
    """TLS credentials made for one cluster: a self-signed certificate and key, in memory only
    (never written to disk or logged), required for every connection."""
    from distributed.security import Security

    try:
        return Security.temporary()
    except ImportError as exc:  # pragma: no cover - cryptography is a dependency
        raise ConfigError(
            "TLS for the embedded cluster needs the cryptography package",
            "pip install cryptography",
        ) from exc


def local(
    ps_nodes: int | None = None,
    data_nodes: int | None = None,
    trainers: int | None = None,
    *,
    trainer_threads: int | None = None,
    memory_limit: str | int | None = None,
    dashboard_address: str | None = None,
    tls: bool | None = None,
    timeout: float | None = None,
) -> EmbeddedClient:
    """Start the embedded Adam cluster on this machine and return a client that owns it.

    Use it as a context manager; leaving the block closes client and cluster::

        with adam_dask.cluster.local(ps_nodes=3, data_nodes=1, trainers=2) as client:
            print(client.dashboard_link)

    With ``tls=True`` every connection (client, scheduler, workers, actors) is TLS with a
    certificate made for this cluster, and the scheduler's address is ``tls://...``.
    Parameters default to the ``adam.cluster`` section of the configuration.
    """
    tls = bool(config.get("cluster.tls", tls))
    security = _temporary_security() if tls else None
    scheduler, workers = local_spec(
        ps_nodes,
        data_nodes,
        trainers,
        trainer_threads=trainer_threads,
        memory_limit=memory_limit,
        dashboard_address=dashboard_address,
        security=security,
    )
    timeout = float(config.get("cluster.start-timeout", timeout))
    logger.info(
        "starting the embedded cluster%s: %s", " (TLS)" if tls else "", ", ".join(sorted(workers))
    )
    try:
        cluster = EmbeddedCluster(
            workers=workers, scheduler=scheduler, name="adam-local", security=security
        )
    except RuntimeError as exc:
        # the dashboard's port was free when asked and taken since (a cluster before this one
        # still closing, on a loaded machine): once more, on a free port
        if "already in use" not in str(exc) or not scheduler["options"].get("dashboard"):
            raise
        logger.info("the dashboard's port was taken while the cluster started; a free one")
        host = str(scheduler["options"]["dashboard_address"]).rpartition(":")[0]
        scheduler["options"]["dashboard_address"] = f"{host}:0"
        cluster = EmbeddedCluster(
            workers=workers, scheduler=scheduler, name="adam-local", security=security
        )
    try:
        client = EmbeddedClient(cluster, direct_to_workers=True, security=security)
        client.wait_for_workers(len(workers), timeout=timeout)
        from ..dashboard import register  # the Adam page (/adam) beside the Dask dashboard

        register(client)
    except Exception as exc:
        cluster.close()
        raise ClusterError(
            f"the embedded cluster did not start: {exc}",
            "check free memory and that 127.0.0.x addresses are usable",
        ) from exc
    return client


def dashboard_link(client: Client) -> str | None:
    """The URL of the cluster's Dask dashboard, or ``None`` when it serves none."""
    try:
        info = client.scheduler_info(n_workers=0)
    except Exception:  # a closed or unreachable scheduler has no dashboard to show
        return None
    if "dashboard" not in info.get("services", {}):
        return None
    return client.dashboard_link


def connect(address: str | None = None, *, gateway: str | None = None, **kwargs) -> Client:
    """A client for an existing cluster: a scheduler ``address``, or a dask-gateway URL.

    With ``gateway``, a new cluster is created on the gateway (``kwargs`` go to
    ``Gateway.new_cluster``; ``workers=N`` scales it, by default to the configured PS + DATA +
    TRAIN counts), the call waits for the workers, and closing the client shuts the cluster down.
    Authentication comes from dask-gateway's own configuration (``gateway.auth.*``).
    Roles are given to workers that have none with :func:`assign_roles`.
    """
    if (address is None) == (gateway is None):
        raise ConfigError(
            "give exactly one of a scheduler address or a gateway URL",
            "use --scheduler ADDRESS or --gateway URL",
        )
    if address is not None:
        try:
            return Client(address, timeout=config.get("cluster.start-timeout"))
        except OSError as exc:
            raise ClusterError(
                f"cannot reach the Dask scheduler at {address}: {exc}",
                "check the address and that the scheduler is running",
            ) from exc
    try:
        from dask_gateway import Gateway
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "connecting to a gateway needs the dask-gateway package",
            "pip install 'adam_dask[gateway]'",
        ) from exc
    n = kwargs.pop("workers", None)
    if n is None:
        n = sum(_role_counts()[:3])

    # This gateway client is closed here, never by the garbage collector: a Gateway's __del__
    # stops its loop runner, and run from inside distributed's LoopRunner.start (a collection can
    # happen anywhere) it waits for the lock start holds, and the process hangs; after close() it
    # raises. The gateway is asked first (an unreachable one fails here, before new_cluster makes
    # a GatewayCluster whose own client a failed start would leave open); the cluster keeps its own.
    class _Gateway(Gateway):
        def __del__(self) -> None:
            pass

    gw = _Gateway(gateway, **{k: kwargs.pop(k) for k in ("auth", "proxy_address") if k in kwargs})
    try:
        gw.cluster_options()
        cluster = gw.new_cluster(**kwargs)
    except Exception as exc:  # aiohttp's and the gateway's own errors are not OSErrors
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterError(
            f"cannot create a cluster on the dask-gateway at {gateway}: {text}",
            "check the URL, that the gateway is up, and dask-gateway's auth settings",
        ) from None
    finally:
        gw.close()
    try:
        cluster.scale(int(n))
        client = cluster.get_client()
        client.wait_for_workers(int(n), timeout=config.get("cluster.start-timeout"))
    except BaseException:
        cluster.shutdown()
        raise
    _close = client.close

    def close(*args, **kw):  # the job's cluster ends with its client
        try:
            return _close(*args, **kw)
        finally:
            cluster.shutdown()

    client.close = close
    return client


def client_for(
    scheduler: str | None = None,
    gateway: str | None = None,
    *,
    ps_nodes: int | None = None,
    data_nodes: int | None = None,
    trainers: int | None = None,
    roles: bool = True,
    embedded: bool = True,
    **local_kwargs: Any,
) -> Client | None:
    """The client a job runs on, and the one place that decides where that is.

    * ``scheduler``: the Dask scheduler at that address (TLS credentials for a ``tls://``
      address come from dask's own ``distributed.comm.tls`` settings);
    * ``gateway``: a new cluster on the dask-gateway at that URL with ``ps_nodes + data_nodes +
      trainers`` workers, shut down when the client closes;
    * neither: the embedded cluster (:func:`local`, which takes ``local_kwargs`` such as
      ``tls=True``; they size and secure the embedded cluster only), or ``None`` when
      ``embedded`` is false (the job then makes its own).

    With ``roles``, workers of an existing or gateway cluster are given roles
    (:func:`assign_roles`) when none of them is a PS worker yet. Role counts default to the
    ``adam.cluster`` settings. Closing the returned client releases whatever was started.
    """
    if scheduler and gateway:
        raise ConfigError(
            "give a scheduler address or a gateway URL, not both",
            "use one of --scheduler ADDRESS and --gateway URL",
        )
    # "auto" trainers and threads: sized from this machine's cores (the embedded cluster's
    # machine; for a new gateway cluster, give counts: its workers are other machines), and
    # "auto" DATA workers from their demand
    ps, data, train, _ = _role_counts(
        ps_nodes, data_nodes, trainers, local_kwargs.get("trainer_threads")
    )
    if not scheduler and not gateway:
        if not embedded:
            return None
        return local(ps, data, train, **local_kwargs)
    if local_kwargs.get("tls"):
        raise ConfigError(
            "TLS (--tls) applies to the embedded cluster only",
            "an existing cluster's TLS is set on its own side; the client's certificates "
            "come from dask's distributed.comm.tls settings",
        )
    client = (
        connect(scheduler) if scheduler else connect(gateway=gateway, workers=ps + data + train)
    )
    try:
        if roles and not workers_with_role(client, PS):
            assign_roles(client, ps_nodes=ps, data_nodes=data)
    except BaseException:
        client.close()
        raise
    return client


def workers_with_role(client: Client, role: str) -> list[str]:
    """Addresses of the running workers that have the resource ``role``, sorted (a worker
    still starting, e.g. setting up its plugins, takes no task yet: counted, it would have its
    replica queued behind another's)."""
    # asked of the scheduler directly: Client.scheduler_info() returns a cache that the client's
    # periodic refresh (n_workers=0, no workers) can overwrite just before it is read
    info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return sorted(
        a
        for a, w in info.items()
        if w.get("resources", {}).get(role) and w.get("status", "running") == "running"
    )


async def _set_role(dask_worker, role: str) -> None:
    await dask_worker.set_resources(**{role: 1})


def assign_roles(
    client: Client, *, ps_nodes: int, data_nodes: int = 0, workers: Iterable[str] | None = None
) -> dict[str, str]:
    """Give roles to workers that have none (dask-gateway and plain ``dask worker`` clusters).

    The first ``ps_nodes`` role-less workers (preferring distinct hosts) become PS, the next
    ``data_nodes`` DATA, the rest TRAIN. Returns {address: role} for the workers relabelled.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    free = [
        a for a in (workers or sorted(info)) if not set(info[a].get("resources", {})) & set(ROLES)
    ]
    # spread PS over hosts: round-robin by host
    by_host: dict[str, list[str]] = {}
    for a in free:
        by_host.setdefault(info[a]["host"], []).append(a)
    spread: list[str] = []
    while any(by_host.values()):
        for h in sorted(by_host):
            if by_host[h]:
                spread.append(by_host[h].pop(0))
    if len(spread) < ps_nodes:
        raise ClusterError(
            f"{len(spread)} role-less workers, but {ps_nodes} PS workers are needed",
            "scale the cluster up or ask for fewer PS nodes",
        )
    roles = {}
    for i, addr in enumerate(spread):
        roles[addr] = PS if i < ps_nodes else DATA if i < ps_nodes + data_nodes else TRAIN
    for addr, role in roles.items():
        client.run(_set_role, role=role, workers=[addr])
    logger.info("assigned roles: %s", roles)
    return roles
