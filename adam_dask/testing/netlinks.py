"""The kernel's side of a namespace cluster (:class:`~adam_dask.testing.netns.NetnsCluster`):
namespaces, veth links and bridges (iproute2's ``ip``), the rules that drop packets (nftables'
``nft``), the rates (``tc`` token buckets) and the user-space delay
(:mod:`adam_dask.testing.netdelay`), as functions of explicit arguments. Each command that fails
raises :class:`~adam_dask.errors.ClusterError`; what the cluster is made of (its hosts, their
processes) is :mod:`adam_dask.testing.netns`'s.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from ..errors import ClusterError

__all__ = [
    "Host",
    "add_bridge",
    "add_link",
    "add_namespace",
    "clear_faults",
    "drop",
    "netns_problem",
    "remove_host",
    "remove_stale",
    "run",
    "set_rate",
    "start_delayer",
]


def netns_problem() -> str | None:
    """Why a namespace cluster can not start here (one line), or None."""
    if os.geteuid() != 0:
        return "a network-namespace cluster needs root (ip netns add); run the tests as root"
    tools = (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables"), ("iptables", "iptables"))
    for tool, package in tools:
        if shutil.which(tool) is None:
            return f"a network-namespace cluster needs {tool!r}: apt-get install -y {package} (tools/test installs it)"
    return None


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; :class:`ClusterError` with its error output when it fails (``check``)."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(
            f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.returncode}",
            "check that this runs as root with iproute2 and nftables",
        )
    return proc


@dataclass
class Host:
    """One machine: a namespace, its address, the root-side end of its link, its process."""

    name: str
    ns: str
    ip: str
    veth: str
    role: str | None = None
    proc: subprocess.Popen | None = None
    storage_veth: str | None = None
    delayer: subprocess.Popen | None = None


# -- building ------------------------------------------------------------------------------------


def add_bridge(bridge: str, ip: str) -> None:
    """A bridge, up, with address ``ip`` (/24) for this process."""
    run("ip", "link", "add", bridge, "type", "bridge")
    run("ip", "addr", "add", f"{ip}/24", "dev", bridge)
    run("ip", "link", "set", bridge, "up")


def add_namespace(ns: str, veth: str, ip: str, bridge: str) -> None:
    """A namespace whose ``eth0`` (address ``ip``) is the far end of ``veth`` on ``bridge``."""
    run("ip", "netns", "add", ns)
    run("ip", "-n", ns, "link", "set", "lo", "up")
    add_link(ns, veth, "eth0", ip, bridge)


def add_link(ns: str, veth: str, link: str, ip: str, bridge: str) -> None:
    """A veth pair from ``bridge`` (``veth``) into namespace ``ns`` (``link``, address ``ip``)."""
    run("ip", "link", "add", veth, "type", "veth", "peer", "name", link, "netns", ns)
    run("ip", "link", "set", veth, "master", bridge)
    run("ip", "link", "set", veth, "up")
    run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", link)
    run("ip", "-n", ns, "link", "set", link, "up")


# -- faults --------------------------------------------------------------------------------------


def drop(ns: str, rule: str) -> None:
    """Add an nftables rule (``... drop``) to namespace ``ns``: chain ``cut`` holds what comes
    in, ``out`` what goes out (the table and its chains made at the first rule)."""
    nft = ["ip", "netns", "exec", ns, "nft"]
    if run(*nft, "list", "table", "inet", "adam", check=False).returncode != 0:
        run(*nft, "add", "table", "inet", "adam")
        run(*nft, "add chain inet adam cut { type filter hook input priority 0 ; }")
        run(*nft, "add chain inet adam out { type filter hook output priority 0 ; }")
    run(*nft, rule)


def set_rate(host: Host, outer: str, link: str, rate: str) -> None:
    """Both ends of a link of ``host`` (``outer`` in this namespace, ``link`` in its own) at
    ``rate`` (a ``tc`` token bucket, e.g. ``"10mbit"``)."""
    for argv in (
        ["tc", "qdisc", "replace", "dev", outer, "root"],
        ["ip", "netns", "exec", host.ns, "tc", "qdisc", "replace", "dev", link, "root"],
    ):
        run(*argv, "tbf", "rate", rate, "burst", "64kb", "latency", "400ms")


def start_delayer(host: Host, queue: int, delay: float, jitter: float) -> None:
    """Hold each packet ``host`` sends ``delay`` seconds (plus up to ``jitter``) in user space:
    an iptables NFQUEUE rule hands them to :mod:`adam_dask.testing.netdelay` (this kernel has
    no netem)."""
    host.delayer = subprocess.Popen(
        ["ip", "netns", "exec", host.ns, sys.executable, "-m", "adam_dask.testing.netdelay"]
        + ["--queue", str(queue), "--delay", str(delay), "--jitter", str(jitter)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert host.delayer.stdout is not None
    if host.delayer.stdout.readline().strip() != "ready":
        err = host.delayer.stderr.read() if host.delayer.stderr else ""
        host.delayer = None
        raise ClusterError(f"the link delay of {host.name} did not start: {err[-500:]}")
    run(
        "ip", "netns", "exec", host.ns, "iptables", "-A", "OUTPUT", "-j", "NFQUEUE",
        "--queue-num", str(queue), "--queue-bypass",
    )  # fmt: skip


def _stop_delayer(host: Host) -> None:
    if host.delayer is None:
        return
    run("ip", "netns", "exec", host.ns, "iptables", "-F", "OUTPUT", check=False)
    host.delayer.terminate()
    try:
        host.delayer.wait(5)
    except subprocess.TimeoutExpired:
        host.delayer.kill()
    host.delayer = None


def clear_faults(host: Host) -> None:
    """``host``'s link up, its drop rules, rates and delay gone."""
    in_ns = ["ip", "netns", "exec", host.ns]
    run("ip", "link", "set", host.veth, "up", check=False)
    run(*in_ns, "nft", "delete", "table", "inet", "adam", check=False)
    _stop_delayer(host)
    for outer, link in ((host.veth, "eth0"), (host.storage_veth, "eth1")):
        if outer is None:
            continue
        run("tc", "qdisc", "del", "dev", outer, "root", check=False)
        run(*in_ns, "tc", "qdisc", "del", "dev", link, "root", check=False)


# -- taking down ---------------------------------------------------------------------------------


def _kill_all_in(ns: str) -> None:
    for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_host(host: Host) -> None:
    """``host``'s processes killed (its delay, its worker and anything left in its namespace),
    its namespace and links removed."""
    if host.delayer is not None:
        host.delayer.kill()
    if host.proc is not None and host.proc.poll() is None:
        try:
            os.killpg(host.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        host.proc.wait(10)
    _kill_all_in(host.ns)  # a worker killed under its nanny: any process left goes too
    run("ip", "netns", "del", host.ns, check=False)
    run("ip", "link", "del", host.veth, check=False)
    if host.storage_veth is not None:
        run("ip", "link", "del", host.storage_veth, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces and links of namespace clusters whose process is gone (killed
    before it could clean up); returns the namespaces removed."""
    removed = []
    names = run("ip", "netns", "list", check=False).stdout.split()
    tags = {m.group(1) for n in names if (m := re.fullmatch(r"a(\d{5})-.*", n))}
    dead = {t for t in tags if not _alive_tag(int(t))}
    for n in names:
        m = re.fullmatch(r"a(\d{5})-.*", n)
        if m and m.group(1) in dead:
            _kill_all_in(n)
            run("ip", "netns", "del", n, check=False)
            removed.append(n)
    links = run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    for line in links:
        m = re.match(r"\d+: (a(\d{5})[a-z]+\d*)[@:]", line)
        if m and m.group(2) in dead:
            run("ip", "link", "del", m.group(1), check=False)
    return removed


def _alive_tag(tag: int) -> bool:
    """Whether a process whose id ends in ``tag`` (pid % 100000) runs."""
    return any(int(p) % 100000 == tag for p in os.listdir("/proc") if p.isdigit())
