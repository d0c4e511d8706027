"""Machines that are really apart: a Dask cluster whose scheduler and workers each run in a
Linux network namespace of their own, joined by veth links to one bridge.

Every "host" has its own network stack and address (``10.X.Y.i``); this process (the client)
reaches them through the bridge's address. Each link can be cut and healed at any moment, a
pair of hosts can be partitioned from each other while both keep every other link, and a link can
be made slow (a rate, ``tc`` token bucket) or lossy (nftables dropping a random share of
packets). The faults come from outside the processes: the kernel drops or queues their packets.

Needs root (``ip netns``), iproute2's ``ip`` and ``tc`` and, for loss, nftables' ``nft``
(Debian's ``nftables``; ``tools/test`` installs it). Without them :class:`NetnsCluster` raises
:class:`~adam_dask.errors.ClusterError` with one line saying what is missing. Links are named
from this process's id, so runs side by side do not meet.

This module holds the cluster (its hosts, their processes, started again when they end, its
clients, the faults named by host); the commands that build and break the links are
:mod:`adam_dask.testing.netlinks`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from ..errors import ClusterError
from .netlinks import (
    Host,
    add_bridge,
    add_link,
    add_namespace,
    clear_faults,
    drop,
    netns_problem,
    remove_host,
    remove_stale,
    run,
    set_rate,
    start_delayer,
)

logger = logging.getLogger(__name__)

__all__ = ["NetnsCluster"]

SCHEDULER_PORT = 8786


class NetnsCluster:
    """A scheduler, ``ps_nodes`` PS, ``data_nodes`` DATA and ``trainers`` TRAIN workers, each in
    its own network namespace.

    Use as a context manager; :meth:`client` connects from this process::

        with NetnsCluster(ps_nodes=3, data_nodes=1, trainers=1) as net:
            client = net.client()
            net.partition("ps-0", "scheduler")   # both sides keep every other link
            net.heal()

    Host names: ``scheduler``, ``ps-0``..., ``data-0``..., ``train-0``...; ``client`` is this
    process (the root namespace, behind the bridge).
    """

    def __init__(
        self,
        ps_nodes: int = 3,
        data_nodes: int = 1,
        trainers: int = 1,
        *,
        trainer_threads: int = 1,
        memory_limit: str = "1.5GiB",
        worker_env: dict[str, str] | None = None,
        start_timeout: float = 60.0,
        storage: str | None = None,
    ):
        problem = netns_problem()
        if problem is not None:
            raise ClusterError(problem)
        tag = os.getpid() % 100000
        self.tag = f"a{tag:05d}"  # short: interface names hold 15 characters
        octet2, octet3 = 100 + (tag // 250) % 50, tag % 250
        self._subnet = f"10.{octet2}.{octet3}"
        self._storage_subnet = f"10.{octet2 + 50}.{octet3}"
        self.bridge = f"{self.tag}br"
        self.bridge_ip = f"{self._subnet}.254"
        if storage not in (None, "shared", "isolated"):
            raise ValueError(f"storage={storage!r}: None, 'shared' or 'isolated'")
        # an S3 server (moto) on a host of its own: "shared", on the one network every update
        # crosses; "isolated", on a storage network of its own that only the PS hosts join,
        # through a second link each (the paper's separate NIC for persistence, 3.3.4)
        self.storage = storage
        self.storage_bridge = f"{self.tag}sb"
        self.s3_endpoint: str | None = None
        self.hosts: dict[str, Host] = {}
        self._spec: list[tuple[str, str | None, int]] = [("scheduler", None, 0)]
        self._spec += [(f"ps-{i}", "PS", 1) for i in range(ps_nodes)]
        self._spec += [(f"data-{i}", "DATA", 1) for i in range(data_nodes)]
        self._spec += [(f"train-{i}", "TRAIN", max(1, trainer_threads)) for i in range(trainers)]
        self.memory_limit = memory_limit
        self.worker_env = dict(worker_env or {})
        self.start_timeout = float(start_timeout)
        self._clients: list[Any] = []
        self._started = False
        self._argv: dict[str, list[str]] = {}
        self._closing = threading.Event()
        self.restarts: dict[str, int] = {}  # host -> worker processes started again

    # -- lifetime ----------------------------------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{self.hosts['scheduler'].ip}:{SCHEDULER_PORT}"

    def start(self) -> None:
        remove_stale()
        self._started = True
        try:
            add_bridge(self.bridge, self.bridge_ip)
            for i, (name, role, _) in enumerate(self._spec):
                self._add_host(name, role, i + 1)
            if self.storage is not None:
                self._add_storage()
            self._start_processes()
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, role: str | None, index: int) -> None:
        ns, veth, ip = f"{self.tag}-{name}", f"{self.tag}v{index}", f"{self._subnet}.{index}"
        host = Host(name, ns, ip, veth, role)
        self.hosts[name] = host
        add_namespace(ns, veth, ip, self.bridge)

    def _add_storage(self) -> None:
        """The S3 host, and in "isolated" mode its network: a bridge, a second link (``eth1``)
        into each PS host, and the bridge's address for this process."""
        if self.storage == "shared":
            self._add_host("s3", None, 200)
            ip = self.hosts["s3"].ip
        else:
            sb, sub = self.storage_bridge, self._storage_subnet
            add_bridge(sb, f"{sub}.254")
            ns, veth, ip = f"{self.tag}-s3", f"{self.tag}s0", f"{sub}.200"
            self.hosts["s3"] = Host("s3", ns, ip, veth)
            add_namespace(ns, veth, ip, sb)
            for i, (name, role, _) in enumerate(self._spec):
                if role != "PS" and name != "scheduler":  # the controller writes the manifest
                    continue
                host = self.hosts[name]
                host.storage_veth = f"{self.tag}s{i + 1}"
                add_link(host.ns, host.storage_veth, "eth1", f"{sub}.{i + 1}", sb)
        s3 = self.hosts["s3"]
        s3.proc = self._spawn(s3, [sys.executable, "-m", "moto.server", "-H", ip, "-p", "5000"])
        self._wait_port(ip, 5000, s3)
        self.s3_endpoint = f"http://{ip}:5000"

    def storage_options(self) -> dict:
        """fsspec options for the S3 host (moto accepts any key)."""
        if self.s3_endpoint is None:
            raise ClusterError("this cluster has no storage host", "pass storage='shared'")
        return {"key": "testing", "secret": "testing", "endpoint_url": self.s3_endpoint}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.worker_env)
        # these processes are machines of their own: the test's SIGINT is not theirs
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spawn(self, host: Host, argv: list[str]) -> subprocess.Popen:
        with open(self._log_path(host), "wb") as log:  # the child keeps its own copy
            return subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )

    def _log_path(self, host: Host) -> str:
        return f"/tmp/{self.tag}-{host.name}.log"

    def log(self, name: str) -> str:
        """What host ``name``'s process has printed so far."""
        try:
            with open(self._log_path(self.hosts[name]), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def _start_processes(self) -> None:
        py = sys.executable
        sched = self.hosts["scheduler"]
        sched.proc = self._spawn(
            sched,
            [py, "-m", "distributed.cli.dask_scheduler", "--host", sched.ip]
            + ["--port", str(SCHEDULER_PORT), "--no-dashboard", "--no-show"],
        )
        self._wait_port(sched.ip, SCHEDULER_PORT, sched)
        for name, role, nthreads in self._spec[1:]:
            self._argv[name] = (
                [py, "-m", "distributed.cli.dask_worker", self.scheduler_address]
                + ["--host", self.hosts[name].ip, "--name", name, "--nthreads", str(nthreads)]
                + ["--resources", f"{role}=1", "--memory-limit", self.memory_limit]
                + ["--no-dashboard", "--nanny", "--preload", "adam_dask._worker_preload"]
                + ["--death-timeout", "600"]
            )
            self.hosts[name].proc = self._spawn(self.hosts[name], self._argv[name])
        # the cluster manager's part (Kubernetes restarts a pod that exits): a worker process
        # that ended (its nanny gave up on a broken link) is started again on its host
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()
        client = self.client()
        try:
            client.wait_for_workers(len(self._spec) - 1, timeout=self.start_timeout)
        except Exception as exc:
            logs = {h: self.log(h)[-400:] for h in self.hosts}
            raise ClusterError(
                f"the namespace cluster did not start: {exc}; last output: {logs}"
            ) from None

    def _supervise(self) -> None:
        while not self._closing.wait(1.0):
            for name, argv in self._argv.items():
                host = self.hosts.get(name)
                if host is None or host.proc is None or host.proc.poll() is None:
                    continue
                if self._closing.is_set():
                    return
                logger.info(
                    "%s's worker process ended (%s); starting it again", name, host.proc.returncode
                )
                self.restarts[name] = self.restarts.get(name, 0) + 1
                host.proc = self._spawn(host, argv)

    def _wait_port(self, ip: str, port: int, host: Host) -> None:
        import socket

        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if host.proc is not None and host.proc.poll() is not None:
                raise ClusterError(f"{host.name} exited: {self.log(host.name)[-1000:]}")
            try:
                socket.create_connection((ip, port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise ClusterError(f"{host.name} did not listen on {ip}:{port} in {self.start_timeout}s")

    def client(self, **kwargs: Any) -> Any:
        """A new client for this cluster (closed with it)."""
        from distributed import Client

        c = Client(self.scheduler_address, timeout=self.start_timeout, **kwargs)
        self._clients.append(c)
        return c

    def close(self) -> None:
        self._closing.set()
        for c in self._clients:
            try:
                c.close(timeout=5)
            except Exception:  # pragma: no cover - best effort
                logger.debug("closing a client failed", exc_info=True)
        self._clients.clear()
        for host in self.hosts.values():
            remove_host(host)
        if self._started:
            run("ip", "link", "del", self.bridge, check=False)
            if self.storage == "isolated":
                run("ip", "link", "del", self.storage_bridge, check=False)
        self.hosts.clear()

    # -- who is where ------------------------------------------------------------------------------

    def address_of(self, name: str) -> str:
        """The Dask address of the worker on host ``name``."""
        from distributed import Client

        ip = self.hosts[name].ip
        c: Client = self._clients[0] if self._clients else self.client()
        for addr in c.scheduler_info()["workers"]:
            if addr.split("://")[1].rsplit(":", 1)[0] == ip:
                return addr
        raise KeyError(f"no worker on {name} ({ip}) now")

    def host_of(self, address: str) -> str:
        """The host name of a Dask address (``tcp://10.X.Y.i:port``)."""
        ip = address.split("://")[-1].rsplit(":", 1)[0]
        for h in self.hosts.values():
            if h.ip == ip:
                return h.name
        raise KeyError(address)

    def _ip(self, name: str) -> str:
        return self.bridge_ip if name == "client" else self.hosts[name].ip

    # -- faults --------------------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Cut host ``name``'s link: nothing in or out, for everyone (its cable pulled)."""
        run("ip", "link", "set", self.hosts[name].veth, "down")

    def reconnect(self, name: str) -> None:
        """Plug host ``name``'s link back in."""
        run("ip", "link", "set", self.hosts[name].veth, "up")

    def partition(self, a: str, b: str) -> None:
        """``a`` and ``b`` no longer reach each other (each drops the other's packets both
        ways); every other link stays. ``client`` names this process."""
        for x, y in ((a, b), (b, a)):
            if x == "client":
                continue
            drop(self.hosts[x].ns, f"add rule inet adam cut ip saddr {self._ip(y)} drop")
            drop(self.hosts[x].ns, f"add rule inet adam out ip daddr {self._ip(y)} drop")

    def heal(self) -> None:
        """Every partition, cut link, rate and loss gone."""
        for host in self.hosts.values():
            clear_faults(host)

    def shape(
        self,
        name: str,
        *,
        rate: str | None = None,
        loss: float = 0.0,
        delay: float = 0.0,
        jitter: float = 0.0,
        link: str = "eth0",
    ) -> None:
        """Make host ``name``'s link slow (``rate``, e.g. ``"10mbit"``, both ways), lossy
        (``loss``: the share of packets dropped, each way, on every link of the host) and/or
        long (``delay`` seconds, plus up to ``jitter``, on every packet the host sends: this
        kernel has no netem, so :mod:`adam_dask.testing.netdelay` holds them in user space).
        ``link="eth1"``: a PS host's link to the storage network."""
        host = self.hosts[name]
        if delay > 0 and host.delayer is None:
            start_delayer(host, 1 + list(self.hosts).index(name), delay, jitter)
        outer = host.veth if link == "eth0" else host.storage_veth
        if outer is None:
            raise ClusterError(f"{name} has no {link}")
        if rate is not None:
            set_rate(host, outer, link, rate)
        if loss > 0:
            per_mille = max(1, round(loss * 1000))
            drop(host.ns, f"add rule inet adam cut numgen random mod 1000 < {per_mille} drop")
            drop(host.ns, f"add rule inet adam out numgen random mod 1000 < {per_mille} drop")

    def pid_of(self, name: str) -> int:
        """The process id of the Dask worker (not its nanny) on host ``name``."""
        c = self._clients[0] if self._clients else self.client()
        addr = self.address_of(name)
        return int(c.run(os.getpid, workers=[addr])[addr])
