"""Network faults on a cluster of Linux network namespaces (adam_dask.testing.NetnsCluster): the
scheduler and every worker on a network stack of its own, links cut, partitioned and made slow
or lossy by the kernel while pushes go on, at the default settings. Each test checks safety, as
Jepsen does (every acknowledged push is in the final values exactly once, the float32 sums are
exact), and liveness (the parameter server heals: every shard back at 3 copies, the time taken
logged)."""

from __future__ import annotations

import logging
import time

import pytest

from adam_dask.ps import ParameterServer
from adam_dask.testing import NetnsCluster, PushLoad, netns_problem, push_on, stop_and_check_sum

logger = logging.getLogger(__name__)

SHARD = 1 << 16
N = 5 * (SHARD // 4) + 77  # 6 shards


@pytest.fixture(scope="module")
def net():
    problem = netns_problem()
    if problem is not None:
        pytest.fail(problem)
    with NetnsCluster(ps_nodes=3, data_nodes=0, trainers=0, memory_limit="1GiB") as cluster:
        yield cluster


@pytest.fixture
def server(net):
    from adam_dask.cluster import PS
    from adam_dask.testing import wait_role_workers

    net.heal()
    client = net.client()
    # a PS worker retired by the previous test's fault is replaced by its nanny: wait for it,
    # so the server starts with three hosts for its three copies
    wait_role_workers(client, PS, 3, timeout=90)
    s = ParameterServer.create(client, size=N, shard_bytes=SHARD)
    yield s
    net.heal()
    s.close()
    client.close()


def wait_healed(server: ParameterServer, timeout: float = 90) -> tuple[dict, float]:
    """(routing, seconds) once every shard has a primary and 3 copies on distinct hosts and the
    controller says healthy."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        info = server.routing_info()
        hosts_ok = all(
            len({a.split("//")[1].rsplit(":", 1)[0] for a in h}) == 3 for h in info["routing"]
        )
        if info["healthy"] and not info["pending"] and hosts_ok:
            return info, time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"not healed after {timeout}s: {server.routing_info()}")


def test_a_primary_cut_from_the_scheduler_but_not_from_the_pushers(net, server):
    """The controller hears no heartbeat from ps-X, fences it and promotes a backup, while ps-X
    goes on answering the pushers. Every acknowledged push lands once; after the heal the
    deposed primary's values never win."""
    pushers = [PushLoad(server, 1), PushLoad(server, 2)]
    for p in pushers:
        p.start()
    push_on(pushers, 10)
    before, _ = wait_healed(server)  # the primary and generation the pushers are using now
    victim, gen_before = net.host_of(before["routing"][0][0]), before["gens"][0]
    net.partition(victim, "scheduler")
    t_cut = time.monotonic()
    # the old primary keeps serving the pushers while the controller fails it over
    deadline = time.monotonic() + 60
    while True:
        info = server.routing_info()
        primary = info["routing"][0][0] if info["routing"][0] else None
        if primary is not None and net.host_of(primary) != victim and info["gens"][0] > gen_before:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    promoted_in = time.monotonic() - t_cut
    # the deposed primary went on acknowledging pushes while the controller failed it over
    acked_in_the_gap = sum(
        1 for p in pushers for t0, t1 in list(p.times) if t_cut < t1 < t_cut + promoted_in
    )
    assert acked_in_the_gap > 0
    push_on(pushers, 10)  # pushes go on against the new primary
    time.sleep(2)
    net.heal()
    info, healed_in = wait_healed(server)
    push_on(pushers, 10)
    stop_and_check_sum(server, pushers)
    # what it acknowledged in the gap reached the new primary by replay, once (the sum is exact)
    assert server.stats()["replayed"] > 0
    logger.warning(
        "primary %s cut from the scheduler: promoted in %.1fs, healed %.1fs after the link "
        "came back; %d pushes",
        victim,
        promoted_in,
        healed_in,
        sum(p.count for p in pushers),
    )


def test_a_primary_cut_from_the_pushers_only(net, server):
    """ps-X still heartbeats the controller but the pushers (this process) can not reach it:
    pushes to its shards wait and go through after the heal (or after a fail-over), nothing
    acknowledged is lost and nothing is applied twice."""
    victim = net.host_of(server.placement()[0][0])
    pushers = [PushLoad(server, 3)]
    pushers[0].start()
    push_on(pushers, 10)
    net.partition(victim, "client")
    time.sleep(5)
    net.heal()
    push_on(pushers, 10, timeout=120)
    info, healed_in = wait_healed(server)
    stop_and_check_sum(server, pushers)
    logger.warning("primary %s cut from the pushers for 5 s: healed in %.1fs", victim, healed_in)


def test_a_slow_lossy_link_to_one_ps_node(net, server):
    """One PS node behind a link that delays every packet it sends by 100 ms and drops 1% of
    packets each way: pushes slow down but every acknowledged one lands exactly once."""
    victim = net.host_of(server.placement()[0][0])
    net.shape(victim, delay=0.1, loss=0.01)
    pushers = [PushLoad(server, 4)]
    pushers[0].start()
    push_on(pushers, 5, timeout=180)
    net.heal()
    push_on(pushers, 5)
    stop_and_check_sum(server, pushers)


def test_a_flapping_link(net, server):
    """A PS node's link down 1 s, up 1 s, for a minute while pushes go on."""
    victim = net.host_of(server.placement()[1][0])
    pushers = [PushLoad(server, 5)]
    pushers[0].start()
    push_on(pushers, 5)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        net.cut(victim)
        time.sleep(1)
        net.reconnect(victim)
        time.sleep(1)
    info, healed_in = wait_healed(server)
    push_on(pushers, 10)
    stop_and_check_sum(server, pushers)
    logger.warning("flapping link of %s: healed %.1fs after it stopped", victim, healed_in)
