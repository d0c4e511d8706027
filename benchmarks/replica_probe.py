"""Probe (issue 47): ``adam-dask train`` at chosen replicas x threads and flags, one JSON line
per run in ``benchmarks/results/replica_probe.jsonl``.

``benchmarks/scaling.py`` runs the defaults and the sweep the issue's goals are judged by; this
runs the settings around them that a rule is chosen from (the rate per stream, the push
period), each as a user would: the real CLI on the embedded cluster, stopping at ``--target``
or after ``--epochs`` (default ``adam.train.epochs``, the schedule planned over them: a run
planned over fewer epochs decays its rate sooner, and is no measure of the defaults). Each line: ``replicas``,
``threads``, ``flags``, the test accuracy, images/s, stall fraction, images per push, seconds
per exchange and the lowest damping of a replica's rate per epoch, ``epochs_to_target``.

    python benchmarks/replica_probe.py 8x2 "4x4:--lr-streams 4" [--epochs 10] [--target 0.99]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys


def parse(spec: str) -> tuple[int, int, list[str]]:
    """``RxT`` or ``RxT:flags`` -> (R, T, flags).

    >>> parse("8x2:--lr-streams 4")
    (8, 2, ['--lr-streams', '4'])
    """
    shape, _, flags = spec.partition(":")
    r, _, t = shape.lower().partition("x")
    try:
        return int(r), int(t), shlex.split(flags)
    except ValueError:
        raise SystemExit(
            f"replica_probe: {spec!r} is not RxT[:flags]; write e.g. 8x2 or '4x4:--lr-streams 4'"
        ) from None


def main(argv: list[str] | None = None) -> int:
    from _common import mnist_store, record
    from scaling import cli_run

    from adam_dask import config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="+", help="RxT or 'RxT:flags' for adam-dask train")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--epochs", type=int, default=None, help="(adam.train.epochs)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    runs = [parse(s) for s in args.settings]
    epochs = args.epochs or int(config.get("train.epochs"))
    store = mnist_store()
    for r, t, flags in runs:
        print(f"replica_probe: {r} x {t} {' '.join(flags)}", file=sys.stderr, flush=True)
        try:
            out = cli_run(
                store,
                args.target,
                epochs,
                "--trainers",
                str(r),
                "--threads",
                str(t),
                *flags,
            )
        except subprocess.SubprocessError as exc:  # pragma: no cover - reported in the line
            out = {"error": str(exc)}
        setting = f"{r}x{t} {' '.join(flags)}".strip()
        line = {"setting": setting, "replicas": r, "threads": t, "flags": flags, "epochs": epochs}
        line.update(out)
        line["load"] = [round(v, 2) for v in os.getloadavg()]
        record("replica_probe", line, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
