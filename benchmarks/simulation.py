"""Benchmark: the deterministic simulation of the PS protocol (adam_dask.testing.simulation) over
many seeds: every invariant after every step, and the healing bound (every shard back at its
copies within HEAL_BOUND simulated seconds of the end of the last fault).

Runs seeds ``--first`` .. ``--first + --seeds - 1`` over ``--processes`` processes (stopping
early, after a whole number of seeds from the first, when ``--max-seconds`` have passed: a
shared machine may not give it the time) and prints one JSON line, appended to
benchmarks/results/simulation.jsonl: the seeds run, the wall seconds,
the failing seeds (a few shown, with the first one's message), the bound and the worst healing
time seen (with its seed). A failing seed replays with
``adam_dask.testing.simulation.simulate(seed, trace=True)``.

    python benchmarks/simulation.py [--seeds 100000] [--first 0] [--processes 2]
        [--optimizer nesterov] [--rounds 3]

``--rounds R``: each push is one replica's share of a synchronous step, R shares a step (its
mark says so), so the server optimizer takes each step as one round; the line records it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

SHOWN = 10  # failing seeds shown in the line


def _run(job: tuple[int, str, int]) -> tuple[int, str | None, float, int]:
    """(seed, the failure's first line or None, healed_after, restored shards) of ``job``
    (seed, server optimizer, synchronous rounds)."""
    from adam_dask.ps.protocol.optimizer import ServerOptimizer
    from adam_dask.testing.simulation import SimulationFailure, simulate

    seed, optimizer, rounds = job
    try:
        r = simulate(seed, optimizer=ServerOptimizer.resolve(optimizer).to_dict(), rounds=rounds)
    except SimulationFailure as exc:
        return seed, str(exc).splitlines()[0], 0.0, 0
    return seed, None, r["healed_after"], r["restored"]


def sweep(
    first: int,
    seeds: int,
    processes: int,
    max_seconds: float,
    optimizer: str = "sum",
    rounds: int = 0,
) -> dict:
    from adam_dask.testing.simulation import HEAL_BOUND

    failures: list[tuple[int, str]] = []
    worst = (0.0, first)
    healed: list[float] = []
    restored = 0
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    done = 0
    with multiprocessing.Pool(processes) as pool:
        # in order, so the seeds run are first .. first + done - 1 whenever it stops
        for i, (seed, error, after, rs) in enumerate(
            pool.imap(
                _run, [(s, optimizer, rounds) for s in range(first, first + seeds)], chunksize=100
            ),
            1,
        ):
            done = i
            if error is not None:
                failures.append((seed, error))
            else:
                healed.append(after)
                restored += rs
                worst = max(worst, (after, -seed))
            if i % 10000 == 0:
                print(
                    f"{i} seeds, {time.perf_counter() - t0:.0f} s, {len(failures)} failures",
                    file=sys.stderr,
                )
            if time.perf_counter() - t0 > max_seconds:
                pool.terminate()
                break
    seconds = time.perf_counter() - t0
    failures.sort()
    healed.sort()
    n = len(healed)
    return {
        "first_seed": first,
        "optimizer": optimizer,
        **({"rounds": rounds} if rounds else {}),
        "seeds": done,
        "seeds_asked": seeds,
        "processes": processes,
        "seconds": round(seconds, 1),
        "seeds_per_second": round(done / seconds, 1),
        "parent_cpu_seconds": round(time.process_time() - cpu0, 1),
        "failures": [s for s, _ in failures[:SHOWN]],
        "failure_count": len(failures),
        "first_failure": failures[0][1] if failures else None,
        "heal_bound_seconds": HEAL_BOUND,
        "worst_healing_seconds": round(worst[0], 3),
        "worst_healing_seed": -worst[1],
        "healing_p99_seconds": round(healed[int(0.99 * (n - 1))], 3) if n else None,
        "shards_restored": restored,
    }


def main() -> None:
    from _common import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100_000)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-seconds", type=float, default=float("inf"))
    ap.add_argument("--optimizer", default="sum", help="the server optimizer (adam.ps.optimizer)")
    ap.add_argument("--rounds", type=int, default=0, help="shares per synchronous step (0: none)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    line = sweep(
        args.first, args.seeds, args.processes, args.max_seconds, args.optimizer, args.rounds
    )
    record("simulation", line, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
