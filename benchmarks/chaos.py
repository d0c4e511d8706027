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

The victim is drawn among the role's workers at that moment. The first fault waits for the
replicas' first progress report; none is sent after ``fit`` returns.

One JSON line (appended to ``benchmarks/results/chaos.jsonl``): ``completed`` (the faulted run
returned its history without an error) and ``error``; per epoch, ``images_applied`` (images
whose updates the parameter server applied: the split's size when each image counted exactly
once) beside the clean run's, ``images_retrained`` and ``test_accuracy``; ``seconds`` and
``clean_seconds``; ``faults`` (each with its second, kind and victims) and the parameter
server's figures after the run (``declared_dead``, ``restored`` shards, ``restore_lacked_at_least``
(updates after the last write-back that the restored shards lacked, known from heartbeats),
``healthy``).

Usage: ``python benchmarks/chaos.py [--epochs 4] [--every 20] [--freeze 15] [--seed 0]
[--kinds kill-ps,freeze-ps,...] [--n-train N]``.
"""

from __future__ import annotations

import argparse
import logging
import random
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

logger = logging.getLogger("chaos")


class Injector(threading.Thread):
    """Sends the faults, one at a time, until :attr:`done` is set; :attr:`log` lists them."""

    def __init__(self, client, trainer, args: argparse.Namespace):
        super().__init__(daemon=True, name="chaos-injector")
        self.client, self.trainer, self.args = client, trainer, args
        self.rng = random.Random(args.seed)
        self.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        self.done = threading.Event()
        self.log: list[dict] = []
        self.failures: list[str] = []  # a fault that could not be sent (no victim, a timeout)
        self.t0 = time.monotonic()

    def run(self) -> None:
        wait_for_training(self.client, self.done)
        while not self.done.wait(self.args.every * self.rng.uniform(0.5, 1.5)):
            kind = self.rng.choice(self.kinds)
            try:
                victims = self.send(kind)
            except Exception as exc:  # recorded: the line says which faults were not sent
                self.failures.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            if victims:
                self.log.append(
                    {
                        "second": round(time.monotonic() - self.t0, 1),
                        "kind": kind,
                        "victims": victims,
                    }
                )

    def send(self, kind: str) -> list[str]:
        from adam_dask.cluster import DATA, PS, TRAIN, workers_with_role
        from adam_dask.testing import freeze, hard_kill, thaw

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


def run(url: str, args: argparse.Namespace, faults: bool) -> dict:
    import adam_dask

    with tempfile.TemporaryDirectory(prefix="adam-chaos-") as tmp:
        with adam_dask.cluster.local() as client:
            trainer = adam_dask.Trainer(
                url, client=client, checkpoint=f"{tmp}/ckpt", progress=False, seed=args.seed
            )
            injector = Injector(client, trainer, args) if faults else None
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
                if injector is not None:
                    injector.done.set()
                    injector.join(timeout=120)
                stats = trainer.server.stats() if trainer.server is not None else {}
            finally:
                trainer.close()
    records = list(history.records) if history is not None else []
    return {
        "completed": history is not None and error is None,
        "error": error,
        "seconds": seconds,
        "epochs_done": len(records),
        "test_accuracy": [r.get("test_accuracy") for r in records],
        "images_applied": [r.get("images_applied") for r in records],
        "images_retrained": [r.get("images_retrained") for r in records],
        "faults": injector.log if injector is not None else [],
        "faults_not_sent": injector.failures if injector is not None else [],
        "ps": {
            "declared_dead": stats.get("declared_dead"),
            "healthy": stats.get("healthy"),
            "generation": stats.get("generation"),
            "restored": len(stats.get("restored", [])),
            # updates the restored shards lacked (known from heartbeats); the pushers on the
            # TRAIN workers replay what they hold, which images_applied shows
            "restore_lacked_at_least": stats.get("updates_lost_at_least"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--freeze", type=float, default=15.0, help="seconds a frozen worker stays so")
    p.add_argument("--seed", type=int, default=0, help="the training seed and the faults' draws")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--n-train", type=int, default=None, help="a subset of MNIST's training set")
    args = p.parse_args(argv)
    unknown = set(k.strip() for k in args.kinds.split(",")) - set(KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    url = mnist_subset_store(args.n_train) if args.n_train else mnist_store()
    clean = run(url, args, faults=False)
    hit = run(url, args, faults=True)
    record(
        "chaos",
        {
            "epochs": args.epochs,
            "seed": args.seed,
            "every_seconds": args.every,
            "freeze_seconds": args.freeze,
            "kinds": args.kinds.split(","),
            "n_train": args.n_train or 60000,
            **hit,
            "fault_count": len(hit["faults"]),
            "clean_completed": clean["completed"],
            "clean_seconds": clean["seconds"],
            "clean_test_accuracy": clean["test_accuracy"],
            "clean_images_applied": clean["images_applied"],
            "every_image_applied_once": hit["images_applied"] == clean["images_applied"]
            and len(hit["images_applied"]) == args.epochs,
        },
    )
    return 0 if hit["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
