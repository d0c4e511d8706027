"""The data plane (adam_dask/ps/plane/channels.py, ps/plane/server.py): pushes and pulls from the calling
thread to the PS nodes' sockets, values in shared memory on the same machine or after the
header over TCP, with the Dask actor path behind it. Real clusters, real signals."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import dask
import numpy as np
import pytest

from adam_dask.ps import ParameterServer
from adam_dask.testing import PushLoad, push_on, stop_and_check_sum

SHARD = 1 << 16
N = 3 * (SHARD // 4) + 101  # 4 shards


@pytest.mark.parametrize("mode", ["auto", "tcp", "dask"])
def test_every_mode_sums_exactly_and_the_plane_carries_the_calls(ps_client, mode):
    with dask.config.set({"adam.ps.data-plane": mode}):
        s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD)
        try:
            pushers = [PushLoad(s, 1), PushLoad(s, 2)]
            for p in pushers:
                p.start()
            push_on(pushers, 40)
            stop_and_check_sum(s, pushers)
            zeros = np.zeros(N, np.float32)
            zeros[5] = 1.0  # shards of zeros are recorded, not sent
            before = s.pull()
            s.push(zeros)
            np.testing.assert_array_equal(s.pull() - before, zeros)
            # a replica's round trip: the values read back hold the push
            out = np.full(N, -7.0, np.float32)
            got = s.push_pull(zeros * 2, out)
            assert got is out
            np.testing.assert_array_equal(out - before, zeros * 3)
            # ack="all": the push returns once every backup holds it (no flush before asking)
            s.push(zeros, ack="all")
            assert s.stats()["max_replication_lag"] == 0
            np.testing.assert_array_equal(s.pull() - before, zeros * 4)
            s.flush()  # every backup holds every push: the forwards went through
            stats = s.stats()
            plane = stats["data_plane"]
            forwards = [n["plane_forwards"] for n in stats["nodes"].values()]
        finally:
            s.close()
    if mode == "dask":
        assert plane is None
        assert forwards == [None] * 3  # the forwards are actor calls too
    else:
        assert plane["pushes"] >= 40 and plane["pulls"] >= 2, plane
        assert plane["to_dask"] == 0 and plane["failed_calls"] == 0, plane
        # the primaries' forwards to their backups went over the plane, none failed
        assert sum(f["plane"] for f in forwards) > 0 and not any(f["failed"] for f in forwards)
        by = [n["by_transport"] for n in stats["nodes"].values()]
        assert sum(b["plane"] for b in by) > 0 and sum(b["dask"] for b in by) == 0, by


def test_a_tls_cluster_moves_pushes_pulls_and_forwards_over_tls_on_the_plane():
    """On a ``tls://`` cluster the plane's TCP connections are TLS with Dask's certificates
    (forced onto TCP here: on one machine the Unix path would carry them); a plane connection
    without TLS is refused there and changes nothing."""
    import socket

    import adam_dask
    from adam_dask.ps.runtime.rpc import call_actor

    with (
        dask.config.set({"adam.ps.data-plane": "tcp"}),
        adam_dask.cluster.local(
            ps_nodes=3, data_nodes=0, trainers=1, trainer_threads=1, memory_limit="1 GiB", tls=True
        ) as client,
    ):
        s = ParameterServer.create(client, size=N, shard_bytes=SHARD)
        try:
            pushers = [PushLoad(s, 1), PushLoad(s, 2)]
            for p in pushers:
                p.start()
            push_on(pushers, 20)
            stop_and_check_sum(s, pushers)
            s.flush()
            stats = s.stats()
            addr = next(iter(stats["nodes"]))
            ep = client.sync(call_actor, client.rpc, addr, s.routing_info()["nodes"][addr], "plane")
            before = s.pull()
            raw = socket.create_connection(tuple(ep["tcp"]), timeout=5)
            raw.sendall(b"\x10\x00\x00\x00" + b"x" * 16)  # not a TLS handshake
            raw.settimeout(5)
            try:
                assert raw.recv(1) in (b"", b"\x15")  # closed, or a TLS alert
            except ConnectionResetError:
                pass
            raw.close()
            np.testing.assert_array_equal(s.pull(), before)
        finally:
            s.close()
    assert ep["tls"] and ep["tcp"]
    plane = stats["data_plane"]
    assert plane["pushes"] >= 20 and plane["to_dask"] == 0 and plane["failed_calls"] == 0, plane
    by = [n["by_transport"] for n in stats["nodes"].values()]
    assert sum(b["plane"] for b in by) > 0 and sum(b["dask"] for b in by) == 0, by
    forwards = [n["plane_forwards"] for n in stats["nodes"].values()]
    assert sum(f["plane"] for f in forwards) > 0 and not any(f["failed"] for f in forwards)


def test_a_buffer_is_held_not_copied_and_reused_once_durable(ps_client):
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD)
    try:
        seen = set()
        for _ in range(20):
            buf = s.buffer()
            seen.add(id(buf))
            buf[:] = 0.5
            s.push(buf)
            s.release(buf)
            s.settle()  # every copy holds it: the buffer is free again
        assert len(seen) <= 3, len(seen)  # handed out again, not a new one per push
        s.flush()
        np.testing.assert_array_equal(s.pull(), np.full(N, 10.0, np.float32))
        bad = s.buffer()
        bad[:] = 1.0
        bad[N - 3] = np.nan
        with pytest.raises(Exception, match="non-finite"):
            s.push(bad)
        np.testing.assert_array_equal(s.pull(), np.full(N, 10.0, np.float32))
    finally:
        s.close()


PUSHER = textwrap.dedent(
    """
    import sys, numpy as np
    from distributed import Client
    from adam_dask.ps import ParameterServer
    client = Client(sys.argv[1])
    s = ParameterServer.attach(client, sys.argv[2])
    buf = s.buffer()
    n = 0
    while True:
        buf[:] = 1.0  # every push adds exactly 1 to every value: a torn one would not
        s.push(buf)
        n += 1
        if n == 20:
            print("pushing", flush=True)
    """
)


def _memfd_maps(pid: int, creator: int) -> int:
    """How many segments made by the process ``creator`` the process ``pid`` maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum(f"memfd:adam-ps-{creator}-" in line for line in f)
    except FileNotFoundError:
        return 0


def test_sigkill_of_the_pusher_mid_push_leaves_no_torn_value_and_no_segment(ps_client):
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD, name="plane-kill")
    proc = subprocess.Popen(
        [sys.executable, "-c", PUSHER, ps_client.scheduler.address, s.server_id],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "pushing"
        pids = ps_client.run(os.getpid)
        ps_pids = [pids[a] for a in s.routing_info()["nodes"]]
        deadline = time.monotonic() + 30
        while not any(_memfd_maps(p, proc.pid) for p in ps_pids):  # the nodes map its segments
            assert time.monotonic() < deadline, "no node mapped a segment of the pusher"
            time.sleep(0.05)
        time.sleep(0.5)  # in the middle of pushing
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        s.flush()
        values = s.pull()
        for a, b in s.shards:  # each push added 1 to all of a shard or to none of it
            part = values[a:b]
            assert part[0] >= 20 and np.all(part == part[0]), (a, b, np.unique(part)[:5])
        deadline = time.monotonic() + 30  # the nodes let go of the dead pusher's segments
        while any(_memfd_maps(p, proc.pid) for p in ps_pids):
            assert time.monotonic() < deadline, {p: _memfd_maps(p, proc.pid) for p in ps_pids}
            time.sleep(0.1)
        s.push(np.ones(N, np.float32))  # and serve on
        np.testing.assert_array_equal(s.pull(), values + 1)
    finally:
        if proc.poll() is None:
            proc.kill()
        s.close()


def test_a_connection_without_the_nodes_token_is_closed_and_changes_nothing(ps_client):
    import socket

    from adam_dask.net.framing import send_msg
    from adam_dask.ps.runtime.rpc import call_actor

    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD)
    try:
        s.push(np.ones(N, np.float32))
        before = s.pull()
        addr, key = next(iter(s.routing_info()["nodes"].items()))
        ep = ps_client.sync(call_actor, ps_client.rpc, addr, key, "plane", timeout=30)
        assert ep["token"] and ep["unix"]
        for token in ("", "0" * 32):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect("\0" + ep["unix"])
            send_msg(sock, {"op": "hello", "token": token})
            parts = [[sid, a, b - a] for sid, (a, b) in enumerate(s.shards)]
            header = {"op": "push", "server": s.server_id, "push_id": 7, "ack": "primary"}
            header.update(stamps={}, mark=None, parts=parts)
            try:
                send_msg(sock, header)
            except OSError:
                pass  # closed already
            try:  # closed, never answered
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass  # closed with our push unread
            sock.close()
        np.testing.assert_array_equal(s.pull(), before)
        s.push(np.ones(N, np.float32))  # the pushers that hold the token are served
        np.testing.assert_array_equal(s.pull(), before + 1)
    finally:
        s.close()


def _memfds(creator: int, pid: int | None = None) -> int:
    """How many descriptors of segments made by ``creator`` the process ``pid`` (default: this
    one) holds open."""
    fd_dir = f"/proc/{pid or os.getpid()}/fd"
    n = 0
    for fd in os.listdir(fd_dir):
        try:
            n += os.readlink(f"{fd_dir}/{fd}").startswith(f"/memfd:adam-ps-{creator}-")
        except OSError:  # closed meanwhile
            pass
    return n


def test_a_closed_or_dropped_handle_lets_go_of_its_segments(ps_client):
    """Closing a handle closes the descriptors of its segments (free ones, those the replay log
    held, the caller's buffer once the caller drops it), here and in the PS nodes' forwarders;
    a copy of the handle (a task's) that is dropped unclosed lets go of its own when collected:
    a notebook that trains again and again, or a worker that serves run after run, does not
    gather shared memory."""
    me = os.getpid()
    nodes = ps_client.run(os.getpid)

    def on_nodes() -> dict:
        return {a: ps_client.run(_memfds, p, workers=[a])[a] for a, p in nodes.items()}

    before, before_nodes = _memfds(me), on_nodes()
    s = ParameterServer.create(ps_client, size=N, shard_bytes=SHARD, name="plane-close")
    try:
        kept = s.buffer()  # the caller's, never given back
        kept[:] = 1.0
        s.push(kept)
        out = np.zeros(N, np.float32)
        for _ in range(5):
            s.push_pull(np.ones(N, np.float32), out)
        assert _memfds(me) > before  # the segments, shared with the nodes
        mine = _memfds(me)
        copy = pickle.loads(pickle.dumps(s))  # as a task gets it: a courier of its own
        copy.push(np.ones(N, np.float32))
        copy.flush()
        np.testing.assert_array_equal(copy.pull(), np.full(N, 7.0, np.float32))
        assert _memfds(me) > mine
        del copy  # unclosed: collected once its settler thread ends
        _until(lambda: _memfds(me), mine)
    finally:
        s.close()
    np.testing.assert_array_equal(kept, np.ones(N, np.float32))  # still the caller's to read
    del kept  # its mapping holds a descriptor of its own until then
    _until(lambda: _memfds(me), before)
    _until(on_nodes, before_nodes)  # the nodes' forwarders close theirs as the nodes stop


def _until(read, want, timeout: float = 60.0) -> None:
    """Until ``read()`` gives ``want`` (segment descriptors: a dropped handle's go when the
    collector finds them, a node's when it stops)."""
    deadline = time.monotonic() + timeout
    while (got := read()) != want:
        assert time.monotonic() < deadline, f"{got}, not {want}"
        gc.collect()
        time.sleep(0.2)
