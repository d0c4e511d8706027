"""A Network's public passes from several threads: each thread has work buffers of its own, and
a Network the garbage collector frees inside ``sys._current_frames()`` (Dask's task profiler
calls it every 10 ms on a worker whose replica runs) does not deadlock the process, as a
``threading.local`` freed there does on CPython 3.11 (gh-106883)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np

from adam_dask.model import Network

# a new Network, used, made cyclic garbage, then collected in sys._current_frames(): the
# collector runs on the first allocation with a threshold of 1, and the frame object that
# call makes for probe() under the interpreter's thread-list lock is one
COLLECTED_INSIDE = textwrap.dedent(
    """
    import gc, sys
    import numpy as np
    from adam_dask.model import Network

    def probe():
        return sys._current_frames()

    for i in range(200):
        gc.disable()
        net = Network.from_spec("fc8,fc10", input_shape=(1, 4, 4))
        net.forward(np.zeros((2, 1, 4, 4), np.float32))
        net.cycle = net
        del net
        gc.set_threshold(1)
        gc.enable()
        probe()
        gc.set_threshold(700)
    print("ok")
    """
)


def test_a_network_collected_inside_current_frames_does_not_deadlock():
    try:
        out = subprocess.run(
            [sys.executable, "-c", COLLECTED_INSIDE], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "the process deadlocked collecting a Network inside sys._current_frames()"
        ) from None
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_threads_passing_at_once_each_get_their_own_buffers():
    net = Network.from_spec("conv3x3:3,maxpool2,fc6,fc3", input_shape=(1, 8, 8))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((5, 1, 8, 8)).astype(np.float32) for _ in range(4)]
    want = [net.forward(x) for x in xs]  # one thread alone
    got: dict[int, list[np.ndarray]] = {}
    start = threading.Barrier(len(xs))

    def passes(i: int) -> None:
        start.wait()
        got[i] = [net.forward(xs[i]) for _ in range(50)]

    threads = [threading.Thread(target=passes, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == list(range(len(xs)))
    for i, outs in got.items():
        for out in outs:
            np.testing.assert_array_equal(out, want[i])
