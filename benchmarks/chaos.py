"""Benchmark: a training run through a stream of machine faults, at default settings.

``Trainer.fit`` trains the paper's network on real MNIST on the default embedded cluster
(``adam_dask.cluster.local()``, sized from this machine) with a file checkpoint, twice with the
same seed: once undisturbed (``clean``), once while this process (from outside the workers) sends
a fault about every ``--every`` seconds (uniformly 0.5x to 1.5x), one at a time, each drawn from
``--kinds``:

* ``kill-ps``, ``kill-data``, ``kill-train``: SIGKILL one worker of that role (its nanny starts
  a fresh one under a new address, as a replaced machine would join);
* ``freeze-ps``, ``freeze-data``, ``freeze-train``: SIGSTOP one worker of that role for
  ``--freeze`` seconds (a stalled VM: sockets open, nothing answers), then SIGCONT;
* ``kill-shard``: SIGKILL every holder of one shard at once (all of its copies gone: the
  controller rebuilds it from the checkpoint).

With ``--netns`` the cluster runs in Linux network namespaces (``adam_dask.testing.NetnsCluster``,
root needed; 3 PS, 1 DATA, 1 TRAIN worker with 2 threads) and these network faults join, each
lasting ``--freeze`` seconds:

* ``cut-ps``, ``cut-data``, ``cut-train``, ``cut-scheduler``: that host's link down;
* ``partition-ps``: a PS primary cut from the scheduler (the controller) only, still reachable
  by the trainers (the deposed-primary case);
* ``flap-ps``: a PS host's link down 1 s, up 1 s;
* ``slow-ps``: a PS host's packets delayed 100 ms, 1% lost each way;
* ``overlap``: two at once, a shard's every copy killed (a restore under way) while a PS worker
  is frozen: another host's, or with every host holding the shard (3 copies on 3 PS hosts),
  the first fresh worker that joins (the restore's target).

The victim is drawn among the role's workers at that moment. The first fault waits for the
replicas' first progress report; none is sent after ``fit`` returns. ``--kinds none`` sends none
of these (``--throttle`` alone).

Noisy neighbours (``adam_dask.testing.noise``):

* ``--load N``: N busy processes per core run beside both runs (the clean one too, so the ratio
  compares like with like);
* ``--throttle ROLE`` (PS, DATA or TRAIN): in the faulted run, from the first progress report,
  one worker of that role (PS: the primary of shard 0; else the role's first worker) is held to
  ``--throttle-fraction`` of a core (``CpuQuota``: a cgroup's CFS quota, or SIGSTOP/SIGCONT) for
  ``--throttle-seconds`` or until ``fit`` returns; a fault of kind ``throttle-ps`` (``-data``,
  ``-train``) in the log, with ``began`` (its second when the hold began) and ``quota`` (the
  quota's record). It runs beside the other faults, not one of their turns.

One JSON line (appended to ``benchmarks/results/chaos.jsonl``): ``completed`` (the faulted run
returned its history without an error) and ``error``; per epoch, ``images_applied`` (images
whose updates the parameter server applied: the split's size when each image counted exactly
once) beside the clean run's, ``images_retrained`` and ``test_accuracy``; ``seconds`` and
``clean_seconds``; ``faults`` (each with its second when it was over, kind and victims) and the
parameter server's figures after the run (``declared_dead``, ``restored`` shards,
``restore_lacked_at_least`` (updates after the last write-back that the restored shards lacked,
known from heartbeats), ``healthy``, ``heartbeat_gap_max`` (the longest silence between a PS
worker's heartbeats), with ``--netns`` ``workers_retired``: PS workers the controller removed);
``epoch_seconds`` and ``clean_epoch_seconds`` (each epoch's seconds) and ``epoch_ratio_max`` (the
faulted run's slowest epoch over the clean run's median epoch); ``load_per_core`` and
``busy_processes`` (started) and ``busy_alive`` (the fewest seen running, sampled each second
of each run: ``{"clean": n, "faulted": n}``); ``load_measured`` (the
1-minute load average sampled each second of each run: ``{"clean": [median, max], "faulted":
[median, max]}``) and ``load_average`` (its highest); ``throttle`` (role, fraction, seconds asked,
the quota's record) or null.

Usage: ``python benchmarks/chaos.py [--epochs 4] [--every 20] [--freeze 15] [--seed 0]
[--kinds kill-ps,freeze-ps,...|none] [--n-train N] [--load N] [--throttle PS|DATA|TRAIN
[--throttle-fraction 0.1] [--throttle-seconds 20]]``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import sys
import tempfile
import threading
import time

from _common import mnist_store, mnist_subset_store, record, wait_for_training

KINDS = (
    "kill-ps",
    "freeze-ps",
    "kill-data",
    "freeze-data",
    "kill-train",
    "freeze-train",
    "kill-shard",
)

NET_KINDS = (
    "cut-ps",
    "cut-data",
    "cut-train",
    "cut-scheduler",
    "partition-ps",
    "flap-ps",
    "slow-ps",
    "overlap",
)

logger = logging.getLogger("chaos")


class LoadSampler(threading.Thread):
    """The machine's 1-minute load average and how many of ``busy``'s processes run, sampled
    every second until :meth:`stop`."""

    def __init__(self, busy):
        super().__init__(daemon=True, name="chaos-load")
        self.busy = busy
        self.samples: list[float] = []
        self.alive: list[int] = []
        self.halt = threading.Event()

    def run(self) -> None:
        from adam_dask.testing.noise import load_average

        while True:
            self.samples.append(load_average())
            self.alive.append(self.busy.alive)
            if self.halt.wait(1.0):
                return

    def stop(self) -> tuple[list[float] | None, int]:
        """Stop sampling: ([median, max] of the load samples, None without one; the fewest
        busy processes seen running)."""
        self.halt.set()
        self.join()
        s = self.samples
        return ([round(statistics.median(s), 2), max(s)] if s else None), min(self.alive, default=0)


class Injector(threading.Thread):
    """Sends the faults, one at a time, until :attr:`done` is set; :attr:`log` lists them."""

    def __init__(self, client, trainer, args: argparse.Namespace, net=None):
        super().__init__(daemon=True, name="chaos-injector")
        self.client, self.trainer, self.args, self.net = client, trainer, args, net
        self.rng = random.Random(args.seed)
        self.kinds = kinds(args.kinds)
        self.done = threading.Event()
        self.log: list[dict] = []
        self.failures: list[str] = []  # a fault that could not be sent (no victim, a timeout)
        self.t0 = time.monotonic()

    def second(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def run(self) -> None:
        wait_for_training(self.client, self.done)
        holder = None
        if self.args.throttle and not self.done.is_set():
            kind = f"throttle-{self.args.throttle.lower()}"
            holder = threading.Thread(target=self.attempt, args=(kind, self.throttle), daemon=True)
            holder.start()
        while self.kinds and not self.done.wait(self.args.every * self.rng.uniform(0.5, 1.5)):
            kind = self.rng.choice(self.kinds)
            self.attempt(kind, lambda kind=kind: (self.send(kind), {}))
        if holder is not None:
            holder.join()

    def attempt(self, kind: str, send) -> None:
        """One fault: ``send()`` gives (its victims, what else to log); logged, with the second
        it was over, when it had a victim; one that raises is recorded as not sent."""
        began = self.second()
        try:
            victims, extra = send()
        except Exception as exc:  # recorded: the line says which faults were not sent
            self.failures.append(f"{kind}: {type(exc).__name__}: {exc}")
            return
        if victims:
            extra = {"began": began, **extra} if kind.startswith("throttle-") else extra
            self.log.append({"second": self.second(), "kind": kind, "victims": victims, **extra})

    def throttle(self) -> tuple[list[str], dict]:
        """One worker of the ``--throttle`` role held under a CPU quota for ``--throttle-seconds``
        (or until ``fit`` returns): PS, the primary of shard 0; else the role's first worker."""
        from adam_dask.cluster import workers_with_role
        from adam_dask.testing import worker_pids
        from adam_dask.testing.noise import CpuQuota

        role = self.args.throttle
        if role == "PS":
            victims = self.trainer.server.routing_info()["routing"][0][:1]
        else:
            victims = workers_with_role(self.client, role)[:1]
        if not victims:
            return [], {}
        pids = list(worker_pids(self.client, victims).values())
        with CpuQuota(pids, self.args.throttle_fraction) as quota:
            self.done.wait(self.args.throttle_seconds)
        return victims, {"quota": quota.stats.as_record()}

    def send(self, kind: str) -> list[str]:
        from adam_dask.cluster import DATA, PS, TRAIN, workers_with_role
        from adam_dask.testing import freeze, hard_kill, thaw

        if kind in NET_KINDS:
            return self.send_net(kind)
        action, role = kind.split("-")
        if role == "shard":
            placement = self.trainer.server.placement()
            shard = self.rng.choice(sorted(placement))
            victims = list(placement[shard])
        else:
            workers = workers_with_role(self.client, {"ps": PS, "data": DATA, "train": TRAIN}[role])
            if not workers:
                return []
            victims = [self.rng.choice(workers)]
        if action == "kill":
            hard_kill(self.client, victims, wait=True, timeout=60)
        else:
            pids = freeze(self.client, victims)
            try:
                self.done.wait(self.args.freeze)
            finally:
                thaw(pids)
        return victims

    def send_net(self, kind: str) -> list[str]:
        """A network fault on the namespace cluster; returns its victims (host names)."""
        from adam_dask.cluster import DATA, PS, TRAIN, workers_with_role
        from adam_dask.testing import freeze, hard_kill, thaw

        net, hold = self.net, self.args.freeze
        if net is None:
            raise RuntimeError(f"{kind} needs --netns")
        if kind == "overlap":
            host = ""  # its victims are drawn below
        elif kind == "cut-scheduler":
            host = "scheduler"
        elif kind == "partition-ps":
            host = net.host_of(self.trainer.server.placement()[self.rng.choice([0, 1])][0])
        else:
            role = kind.split("-")[1]
            workers = workers_with_role(self.client, {"ps": PS, "data": DATA, "train": TRAIN}[role])
            if not workers:
                return []
            host = net.host_of(self.rng.choice(workers))
        if kind == "overlap":  # a restore under way while a PS worker is frozen
            placement = self.trainer.server.placement()
            shard = self.rng.choice(sorted(placement))
            victims = list(placement[shard])
            hard_kill(self.client, victims, wait=False)
            # another host's worker; with three copies on three hosts there is none, so the
            # first fresh worker a nanny starts (where the controller puts the shard back)
            deadline = time.monotonic() + 60
            others: list[str] = []
            while not others and time.monotonic() < deadline and not self.done.is_set():
                others = [w for w in workers_with_role(self.client, PS) if w not in victims]
                if not others:
                    time.sleep(0.1)
            frozen = freeze(self.client, others[:1]) if others else {}
            try:
                self.done.wait(hold)
            finally:
                thaw(frozen)
            return [net.host_of(v) for v in victims] + [net.host_of(w) for w in frozen]
        try:
            if kind.startswith("cut-"):
                net.cut(host)
                self.done.wait(hold)
            elif kind == "partition-ps":
                net.partition(host, "scheduler")
                self.done.wait(hold)
            elif kind == "flap-ps":
                end = time.monotonic() + hold
                while time.monotonic() < end and not self.done.is_set():
                    net.cut(host)
                    self.done.wait(1.0)
                    net.reconnect(host)
                    self.done.wait(1.0)
            elif kind == "slow-ps":
                net.shape(host, delay=0.1, loss=0.01)
                self.done.wait(hold)
        finally:
            net.heal()
        return [host]


def kinds(text: str) -> list[str]:
    """The fault kinds of ``--kinds`` (``none``: no fault of these)."""
    return [k.strip() for k in text.split(",") if k.strip() and k.strip() != "none"]


def run(url: str, args: argparse.Namespace, faults: bool, busy) -> dict:
    import adam_dask

    with tempfile.TemporaryDirectory(prefix="adam-chaos-") as tmp, contextlib.ExitStack() as stack:
        net = None
        if args.netns:
            from adam_dask.testing import NetnsCluster

            net = stack.enter_context(
                NetnsCluster(ps_nodes=3, data_nodes=1, trainers=1, trainer_threads=2)
            )
            cm = contextlib.nullcontext(net.client())
        else:
            cm = adam_dask.cluster.local()
        with cm as client:
            trainer = adam_dask.Trainer(
                url, client=client, checkpoint=f"{tmp}/ckpt", progress=False, seed=args.seed
            )
            injector = Injector(client, trainer, args, net) if faults else None
            sampler = LoadSampler(busy)
            sampler.start()
            t0 = time.perf_counter()
            history, error = None, None
            try:
                if injector is not None:
                    injector.start()
                try:
                    history = trainer.fit(epochs=args.epochs)
                except Exception as exc:  # the line records it: a run that ends is a result
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    logger.exception("the run ended")
                seconds = time.perf_counter() - t0
                load, alive = sampler.stop()
                if injector is not None:
                    injector.done.set()
                    injector.join(timeout=120)
                stats = trainer.server.stats() if trainer.server is not None else {}
            finally:
                trainer.close()
            # PS workers the controller asked Dask to remove (it logs each on the scheduler)
            removed = None if net is None else net.log("scheduler").count("removing the silent")
    records = list(history.records) if history is not None else []
    return {
        "completed": history is not None and error is None,
        "error": error,
        "seconds": seconds,
        "epochs_done": len(records),
        "test_accuracy": [r.get("test_accuracy") for r in records],
        "images_applied": [r.get("images_applied") for r in records],
        "images_retrained": [r.get("images_retrained") for r in records],
        "epoch_seconds": [r.get("seconds") for r in records],
        # where a slow epoch's time went: replicas waiting for images, or for their exchange
        "stall_fraction": [r.get("stall_fraction") for r in records],
        "exchange_seconds": [r.get("exchange_seconds") for r in records],
        "load": load,
        "busy_alive": alive,
        "faults": sorted(injector.log, key=lambda f: f["second"]) if injector is not None else [],
        "faults_not_sent": injector.failures if injector is not None else [],
        "ps": {
            "declared_dead": stats.get("declared_dead"),
            "healthy": stats.get("healthy"),
            "generation": stats.get("generation"),
            "restored": len(stats.get("restored", [])),
            # updates the restored shards lacked (known from heartbeats); the pushers on the
            # TRAIN workers replay what they hold, which images_applied shows
            "restore_lacked_at_least": stats.get("updates_lost_at_least"),
            "heartbeat_gap_max": stats.get("heartbeat_gap_max"),
            "workers_retired": removed,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--freeze", type=float, default=15.0, help="seconds a frozen worker stays so")
    p.add_argument("--seed", type=int, default=0, help="the training seed and the faults' draws")
    p.add_argument("--kinds", default=None, help="default: every kind (with --netns, network too)")
    p.add_argument("--netns", action="store_true", help="a cluster of network namespaces (root)")
    p.add_argument("--n-train", type=int, default=None, help="a subset of MNIST's training set")
    p.add_argument("--load", type=float, default=0.0, help="busy processes per core, both runs")
    p.add_argument("--throttle", type=str.upper, choices=("PS", "DATA", "TRAIN"), default=None)
    p.add_argument("--throttle-fraction", type=float, default=0.1, help="of one core")
    p.add_argument("--throttle-seconds", type=float, default=20.0)
    args = p.parse_args(argv)
    known = KINDS + NET_KINDS if args.netns else KINDS
    if args.kinds is None:
        args.kinds = ",".join(known)
    unknown = set(kinds(args.kinds)) - set(known)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; choose from none, {', '.join(known)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    url = mnist_subset_store(args.n_train) if args.n_train else mnist_store()
    from adam_dask.testing.noise import BusyLoad

    with BusyLoad(args.load) as busy:
        clean = run(url, args, faults=False, busy=busy)
        hit = run(url, args, faults=True, busy=busy)
    throttle = None
    if args.throttle:
        held = [f.get("quota") for f in hit["faults"] if f["kind"].startswith("throttle-")]
        throttle = {
            "role": args.throttle,
            "fraction": args.throttle_fraction,
            "seconds": args.throttle_seconds,
            "quota": held[0] if held else None,
        }
    clean_median = statistics.median(clean["epoch_seconds"]) if clean["epoch_seconds"] else None
    record(
        "chaos",
        {
            "epochs": args.epochs,
            "seed": args.seed,
            "every_seconds": args.every,
            "freeze_seconds": args.freeze,
            "kinds": kinds(args.kinds),
            "load_per_core": args.load,
            "busy_processes": busy.count,
            # the fewest seen running in each run (one that dies is not replaced)
            "busy_alive": {"clean": clean["busy_alive"], "faulted": hit["busy_alive"]},
            "throttle": throttle,
            "netns": bool(args.netns),
            "n_train": args.n_train or 60000,
            **{k: v for k, v in hit.items() if k not in ("load", "busy_alive")},
            "load_measured": {"clean": clean["load"], "faulted": hit["load"]},
            # the highest sampled: what report.py shows and judges a line's load by
            "load_average": max((r["load"][1] for r in (clean, hit) if r["load"]), default=None),
            "fault_count": len(hit["faults"]),
            "clean_completed": clean["completed"],
            "clean_seconds": clean["seconds"],
            "clean_test_accuracy": clean["test_accuracy"],
            "clean_images_applied": clean["images_applied"],
            "clean_epoch_seconds": clean["epoch_seconds"],
            "clean_stall_fraction": clean["stall_fraction"],
            "clean_exchange_seconds": clean["exchange_seconds"],
            "epoch_ratio_max": max(hit["epoch_seconds"]) / clean_median
            if hit["epoch_seconds"] and clean_median
            else None,
            "every_image_applied_once": hit["images_applied"] == clean["images_applied"]
            and len(hit["images_applied"]) == args.epochs,
        },
    )
    return 0 if hit["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
