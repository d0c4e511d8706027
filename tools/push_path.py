"""The functions one push crosses, measured: a real push of the paper's MNIST net, both legs.

Starts a small embedded cluster (3 PS workers, the data plane on), creates a parameter server
for the default net, and builds a whole replica's one stage and its
:class:`~adam_dask.train._stage_exchange.StageExchange` in this process as a TRAIN task's
pipeline does. After a warm-up push (connections opened, kernels compiled), it profiles every
thread here and every *new* thread on the PS workers (``threading.setprofile``, installed on
the workers before any handle connects, so their connection threads are profiled), makes a
fresh handle as a TRAIN task gets one, trains a push group of mini-batches untraced, and then
traces one exchange: the group's ``take`` on this thread (what the training thread that
applied the group's last mini-batch calls), the exchange thread's push-and-pull and install,
and each node's connection thread serving it. The forward to the
backups is not part of the push (it goes on the forwarder's timer, set to a minute here so
that none falls in the window measured).

Prints each thread's adam_dask functions (``file:qualname``, in first-call order), and one JSON
line: how many distinct functions and files the push crossed, by leg and in all.
Comprehensions, generator expressions and lambdas count as part of their function.

The spine is what docs/push_path.md lists (``--write`` makes it, ``--check`` fails when the
code's path is no longer the one it lists); docs/design.md walks it.

Usage: ``python tools/push_path.py [--json-only | --write | --check]``
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent / "adam_dask") + os.sep
SKIP = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")
# A push's landmarks: the steps that do its work (take the group's update, check it, send and
# read it on the wire, keep it for replay, apply it, read the weights back, install them). The
# functions on the stack at a landmark are the push's spine: what a reader follows; the rest
# are helpers those call.
LANDMARKS = {
    "StageExchange.take",
    "first_nonfinite",
    "send_msg",
    "recv_msg",
    "ReplayLog.add",
    "apply_all",
    "NodeState.read_into",
    "StageExchange.install",
}


def _recorder(root: str, calls: list, since: list) -> object:
    """A profile function appending (seconds, thread name, file, qualname) of each call into
    a module under ``root`` to ``calls``, once ``since[0]`` is set."""

    def profile(frame, event, arg):
        if event != "call" or not since:
            return
        code = frame.f_code
        if not code.co_filename.startswith(root) or code.co_name in SKIP:
            return
        name = getattr(code, "co_qualname", code.co_name)
        stack: tuple = ()
        if name in LANDMARKS:
            stack = tuple(_stack(frame.f_back, root))
        calls.append(
            (time.monotonic(), threading.current_thread().name, code.co_filename, name, stack)
        )

    return profile


def _stack(frame, root: str):
    """(file, qualname) of the package's frames from ``frame`` outwards."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(root) and code.co_name not in SKIP:
            yield code.co_filename, getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back


def _node_install(root: str, dask_worker) -> None:
    """On a PS worker, before any handle connects: profile every thread started from now on
    (recording nothing until :func:`_node_record`). The lists live on the worker: ``client.run``
    ships these functions by value, each call with globals of its own."""
    calls: list = []
    since: list = []
    dask_worker.adam_push_path = (calls, since)
    threading.setprofile(_recorder(root, calls, since))


def _node_record(dask_worker) -> None:
    """On a PS worker: record from now on."""
    calls, since = dask_worker.adam_push_path
    calls.clear()
    since.append(True)


def _node_calls(t0: float, t1: float, dask_worker) -> list:
    """On a PS worker: the calls recorded between ``t0`` and ``t1`` (the monotonic clock is
    the machine's), and no more recording."""
    calls, since = dask_worker.adam_push_path
    since.clear()
    threading.setprofile(None)
    return [c for c in calls if t0 <= c[0] <= t1]


def _ordered(calls: list) -> dict[str, list[str]]:
    """{thread name: [file:qualname, in first-call order]}."""
    out: dict[str, list[str]] = {}
    for _, thread, path, name, _ in calls:
        seen = out.setdefault(thread, [])
        if _fn(path, name) not in seen:
            seen.append(_fn(path, name))
    return out


def _fn(path: str, name: str) -> str:
    return f"{os.path.relpath(path, ROOT)}:{name}"


def _spine(calls: list) -> list[str]:
    """The functions on the stack at the push's landmarks, the landmarks included, in
    first-call order."""
    on: set[str] = set()
    for _, _, path, name, stack in calls:
        if name in LANDMARKS:
            on.add(_fn(path, name))
            on.update(_fn(p, n) for p, n in stack)
    order = [_fn(path, name) for _, _, path, name, _ in calls]
    return sorted(on, key=lambda fn: order.index(fn) if fn in order else -1)


def measure() -> dict:
    import pickle

    import dask
    import numpy as np

    import adam_dask
    from adam_dask.model.network import Network
    from adam_dask.ps import ParameterServer

    net = Network.from_spec()
    rng = np.random.default_rng(0)
    x = rng.random((256, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 256)

    # the forward to the backups is not part of the push: out of the window it is measured in
    with (
        dask.config.set({"adam.ps.forward-interval": 60.0}),
        adam_dask.cluster.local(
            ps_nodes=3, data_nodes=0, trainers=1, trainer_threads=1, memory_limit="2 GiB"
        ) as client,
    ):
        client.run(_node_install, ROOT, workers=_ps_workers(client))
        server = ParameterServer.create(client, layout=net.layout, init=net.flat)
        try:
            warm = _Replica(net, server, replica=0)
            warm.group(x, y)  # connections opened, kernels compiled
            warm.wait(1)
            warm.close()

            client.run(_node_record, workers=_ps_workers(client))
            here: list = []
            since: list = []
            profile = _recorder(ROOT, here, since)
            threading.setprofile(profile)
            fresh = pickle.loads(pickle.dumps(server))  # a TRAIN task's handle
            first = _Replica(net, fresh, replica=1)
            first.group(x, y)  # this handle's first push opens its connections: not measured
            first.wait(1)
            t0 = time.monotonic()
            since.append(True)
            sys.setprofile(profile)
            first.group(x, y)
            sys.setprofile(None)
            first.wait(2)
            since.clear()
            t1 = time.monotonic()
            threading.setprofile(None)
            first.close()
            fresh.settle(checkpoint=False)
            node = client.run(_node_calls, t0, t1, workers=_ps_workers(client))
        finally:
            server.close()
    return {"client": here, "nodes": [c for calls in node.values() for c in calls]}


class _Replica:
    """A whole replica's one stage and its exchange, as a TRAIN task's pipeline builds them:
    :meth:`group` trains one push group (eight mini-batches of 32, untraced) on this thread
    and takes it, as the training thread that applies a group's last mini-batch does; the
    exchange's thread pushes it, reads the weights back in the same round trip and installs
    them."""

    def __init__(self, net, server, replica: int):
        from adam_dask.model.stage import WholeStage
        from adam_dask.train._stage_exchange import StageExchange

        self.stage = WholeStage(net.copy(), ())
        self.ctx = self.stage.context(32)
        self.errors: list = []
        self.left: list = []
        self.g = 0
        self.exchange = StageExchange(
            self.stage,
            server,
            part=(0, 1),
            threads=1,
            mark=(0, replica, 2),
            dropped=lambda: False,
            on_error=self.errors.append,
            on_left=lambda: self.left.append(1),
        )

    def group(self, x, y) -> None:
        acc = self.exchange.acc(0, self.g)
        tracing = sys.getprofile()
        sys.setprofile(None)  # the training steps are not the push
        for a in range(0, 256, 32):
            self.stage.step(self.ctx, x[a : a + 32], y[a : a + 32], 32, 0.01, acc)
        sys.setprofile(tracing)
        self.exchange.take(self.g, self.g + 1, [[[0, self.g, 256]]], 256)
        self.g += 1

    def wait(self, n: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while len(self.left) < n:
            if self.errors:
                raise self.errors[0]
            if time.monotonic() > end:
                raise TimeoutError(f"the exchange pushed {len(self.left)} groups of {n}")
            time.sleep(0.001)

    def close(self) -> None:
        self.exchange.close()


def _ps_workers(client) -> list[str]:
    info = client.scheduler_info()["workers"]
    return [a for a, w in info.items() if "PS" in (w.get("resources") or {})]


def summary(legs: dict) -> dict:
    """How many functions and files the push crossed, each leg and in all: every function
    (``all``) and the spine."""
    out: dict = {}
    every: dict[str, set[str]] = {"all": set(), "spine": set()}
    for leg, calls in legs.items():
        fns = {"all": {f for seen in _ordered(calls).values() for f in seen}}
        fns["spine"] = set(_spine(calls))
        out[leg] = {kind: _count(f) for kind, f in fns.items()}
        for kind, f in fns.items():
            every[kind] |= f
    out.update({kind: _count(f) for kind, f in every.items()})
    return out


def _count(fns: set[str]) -> dict:
    files = {fn.split(":")[0] for fn in fns}
    return {
        "functions": len(fns),
        "files": len(files),
        "packages": len({os.path.dirname(f) for f in files}),
    }


DOC = Path(__file__).resolve().parent.parent / "docs" / "push_path.md"


def document(legs: dict) -> str:
    """docs/push_path.md: each leg's spine, then every function the push crossed."""
    counts = summary(legs)
    lines = [
        "# One push, measured",
        "",
        "Generated by `python tools/push_path.py --write` (do not edit): one push-and-pull of",
        "the default net by a whole replica's stage exchange on the data plane, every thread",
        "profiled (docs/design.md, *One push, function by function*, walks it).",
        "",
        f"**The spine** (the functions on the stack where the push does its work): "
        f"{counts['spine']['functions']} functions in {counts['spine']['files']} files. "
        f"**Every function** it crossed, helpers included: {counts['all']['functions']} in "
        f"{counts['all']['files']} files.",
        "",
    ]
    for leg, title in (("client", "The replica"), ("nodes", "A PS node")):
        spine = _spine(legs[leg])
        lines += [f"## {title}: the spine", ""]
        lines += [f"1. `{fn}`" for fn in spine]
        helpers = sorted({f for seen in _ordered(legs[leg]).values() for f in seen} - set(spine))
        lines += ["", f"{title}'s helpers: " + ", ".join(f"`{fn}`" for fn in helpers), ""]
    return "\n".join(lines)


def spines(text: str) -> list[str]:
    """The spines' functions a document lists (its numbered lines)."""
    return [ln[4:-1] for ln in text.splitlines() if ln.startswith("1. `")]


def main() -> int:
    import logging

    logging.getLogger("distributed").setLevel(logging.WARNING)
    legs = measure()
    if "--write" in sys.argv:
        DOC.write_text(document(legs))
    elif "--check" in sys.argv:
        want = set(spines(document(legs)))
        have = set(spines(DOC.read_text())) if DOC.exists() else set()
        if want != have:
            print(
                f"{DOC.name} lists another path than a push takes now (new: "
                f"{sorted(want - have)}, gone: {sorted(have - want)}); "
                "run python tools/push_path.py --write"
            )
            return 1
    elif "--json-only" not in sys.argv:
        for leg, calls in legs.items():
            spine = _spine(calls)
            print(f"# {leg}: the spine, {len(spine)} functions")
            for fn in spine:
                print(f"  {fn}")
            for thread, seen in _ordered(calls).items():
                print(f"# {leg}, thread {thread}: every function, {len(seen)}")
                for fn in seen:
                    print(f"  {fn}" + ("" if fn in spine else "  (helper)"))
    print(json.dumps(summary(legs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
