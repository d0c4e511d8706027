"""Where the time goes in ``adam-dask train`` on the embedded cluster: py-spy on every process.

    python benchmarks/profile_train.py                       # MNIST, defaults, 30 s of samples
    python benchmarks/profile_train.py --seconds 40 -- --threads 2 --push-every 128

Starts ``adam-dask train --data STORE --epochs E --no-progress [ARGS after --]`` on real MNIST,
waits until a replica is stepping, then samples the CLI process and all its subprocesses (the
scheduler runs in the CLI process; workers are its children) with three concurrent py-spy
recordings (``--nonblocking``, raw stacks with thread ids):

* ``all``: every thread, idle or not (wall time);
* ``active``: threads the OS has running or runnable (not sleeping on a lock, a queue, a socket
  or the GIL);
* ``gil``: the thread holding the GIL.

Each sample's stack is put in one category (first rule that matches, see ``RULES``): the
engine's kernels (numba, ``step_into`` / ``forward``), PS push / pull (``ps/client/server.py``,
``train/_stage_exchange.py``), update bookkeeping (a stage exchange's take and install), serialization
(``distributed/protocol``, pickle), comm I/O (``distributed/comm``, tornado streams), data
(``data/serving``, zarr, augmentation), the event loop, waiting (queue / lock / select / sleep).
Per process role and thread, a category's wall samples split into *GIL held*, *running without
the GIL* (numba kernels, socket writes), *GIL wait* (sleeping at a line that is not a blocking
call: the thread waits for the GIL) and *blocked* (sleeping in a blocking call). Counts come
from independent recordings of the same seconds, so small differences are noise.

Prints one JSON line (``_common.record("profile", ..., save=False)``: the note
benchmarks/results/profile.md holds the read of it) and a Markdown table per role.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# (category, pattern on one frame "Class.function (file:line)"): a stack goes to the first rule,
# in this order, that matches any of its frames
RULES = [
    ("numba compile/load", re.compile(r"numba/core/")),
    ("kernels", re.compile(r"\(adam_dask/model/(fused|kernels|network)\.py")),
    ("serialization", re.compile(r"distributed/protocol/|pickle|msgpack|\b(dumps|loads) \(")),
    ("comm", re.compile(r"distributed/comm/|tornado/iostream|asyncio/(selector_events|sslproto)")),
    ("exchange wait", re.compile(r"_wait_barrier \(adam_dask/train/_stage_exchange\.py")),
    ("updates", re.compile(r"\b(take|install|summed) \(adam_dask/train/_stage_exchange\.py")),
    ("ps push", re.compile(r"\bpush(_range|_outer)? \(adam_dask/ps/client/server\.py")),
    ("ps pull", re.compile(r"\bpull(_range)? \(adam_dask/ps/client/server\.py")),
    ("ps node", re.compile(r"adam_dask/ps/")),
    ("data", re.compile(r"adam_dask/data/|zarr/|numcodecs/|fsspec/")),
    ("replica", re.compile(r"adam_dask/train/")),
    ("event loop", re.compile(r"asyncio/|tornado/")),
]
_PROCESS = re.compile(r'process (\d+):"[^"]*";')
# a sleeping thread whose leaf frame is one of these is blocked (waiting for work or I/O), not
# waiting for the GIL
BLOCKING = re.compile(
    r"^(?:[\w<>]+\.)*(wait|get|put|acquire|select|poll|sleep|_worker|join|recv|recv_into|"
    r"accept|read|_wait_for_tstate_lock|run_forever|_run_once|epoll|main|_recv|_recv_bytes|"
    r"readinto|_poll|hold|__enter__) \("
)


def parse(path: Path) -> dict[tuple[int, str], dict[str, dict[tuple[str, bool], int]]]:
    """Raw py-spy output -> {(pid, thread): {stack: {(category, blocking leaf): samples}}}."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    if not path.exists():
        return out
    lines: list[str] = []
    for line in path.read_text().splitlines():  # a frame's name may hold a newline: rejoin it
        if lines and not line.startswith(("process ", "thread ")):
            lines[-1] += line
        else:
            lines.append(line)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        pid = 0
        while m := _PROCESS.match(stack):  # process chain, outermost first (quoted cmdlines)
            pid = int(m[1])
            stack = stack[m.end() :]
        if not stack:
            continue
        parts = stack.split(";")
        th = parts[0] if parts[0].startswith("thread ") else "thread (?)"
        frames = [p for p in parts if not p.startswith("thread ")]
        cat = next((c for c, rx in RULES if any(rx.search(f) for f in frames)), "other")
        blocking = bool(frames) and bool(BLOCKING.match(frames[-1]))
        out[(pid, th)][";".join(frames)][(cat, blocking)] += int(count)
    return out


def role_of(stacks: list[str]) -> str:
    text = "\n".join(stacks)
    if "adam_dask/train/replica.py" in text or "adam_dask/train/task.py" in text:
        return "TRAIN"
    if "adam_dask/data/serving" in text:
        return "DATA"
    if "adam_dask/ps/runtime/node.py" in text or "adam_dask/ps/protocol/node_" in text:
        return "PS"
    if "adam_dask/cli" in text or "adam_dask/train/trainer.py" in text:
        return "client+scheduler"
    return "other"


def thread_label(th: str, stacks: list[str]) -> str:
    """What a thread does: ``training`` (a replica's step loop), else its name without ids."""
    text = "\n".join(stacks)
    if "HogwildReplica._loop" in text:
        return "training"
    name = th.split(":", 1)[1].strip() if ":" in th else th
    return re.sub(r"[-_ ]?\d+(-\d+)*$", "", name) or name


def cpu_times(pid: int) -> dict[str, dict[int, float]]:
    """CPU seconds so far of ``pid`` and its descendants: ``procs`` {pid: s} (exited threads
    included) and ``threads`` {thread id: s} (live threads)."""
    import psutil

    out: dict[str, dict[int, float]] = {"procs": {}, "threads": {}, "ps": {}, "root": {pid: 1.0}}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out["procs"][p.pid] = t.user + t.system
            # the embedded cluster's PS workers listen on 127.0.0.2 and up (their nannies, in
            # the root process, too)
            if p.pid != pid and any(
                c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "0.0.0.0")
                for c in p.net_connections("tcp4")
            ):
                out["ps"][p.pid] = 1.0
            for th in p.threads():
                out["threads"][th.id] = th.user_time + th.system_time
        except psutil.Error:
            continue
    return out


def cpu_delta(a: dict, b: dict) -> dict[str, dict[int, float]]:
    """CPU seconds used between two :func:`cpu_times` snapshots (new ones count from 0)."""
    d = {k: {i: v - a[k].get(i, 0.0) for i, v in b[k].items()} for k in ("procs", "threads")}
    d["ps"], d["root"] = dict(b["ps"]), dict(b["root"])
    return d


def cpu_merge(old: dict, new: dict) -> dict:
    """The newest value of every process and thread seen in either snapshot (a thread that
    ended keeps its last value)."""
    return {k: {**old.get(k, {}), **new.get(k, {})} for k in set(old) | set(new)}


def breakdown(raw: dict[str, Path], cpu: dict[str, dict[int, float]] | None = None) -> dict:
    """Per role and thread: samples by category (see the module docstring), and the CPU
    seconds used over the window when ``cpu`` (:func:`cpu_delta`) is given: per role from the
    processes, per thread label from the live threads."""
    recs = {k: parse(p) for k, p in raw.items()}
    stacks_by_pid: dict[int, list[str]] = defaultdict(list)
    labels: dict[tuple[int, str], str] = {}
    for (pid, th), stacks in recs["all"].items():
        stacks_by_pid[pid].extend(stacks)
        labels[(pid, th)] = thread_label(th, list(stacks))
    roles = {pid: role_of(st) for pid, st in stacks_by_pid.items()}
    for pid in (cpu or {}).get("ps", {}):
        roles[pid] = "PS"
    for pid in (cpu or {}).get("root", {}):
        roles[pid] = "client+scheduler"
    # role -> thread label -> category -> {"all", "active", "gil", "blocked_leaf"}
    table: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(int))))
    procs: dict[str, set[int]] = defaultdict(set)
    threads: dict[tuple[str, str], set] = defaultdict(set)
    cpu_s: dict[tuple[str, str], float] = defaultdict(float)
    cpu_role: dict[str, float] = defaultdict(float)
    for (pid, th), label in labels.items():
        m = re.match(r"thread \((\d+)\)", th)
        if cpu is not None and m and int(m[1]) in cpu["threads"]:
            cpu_s[(roles.get(pid, "other"), label)] += cpu["threads"][int(m[1])]
    for kind, rec in recs.items():
        for (pid, th), stacks in rec.items():
            role = roles.get(pid, "other")
            label = labels.get((pid, th), thread_label(th, []))
            procs[role].add(pid)
            threads[(role, label)].add((pid, th))
            for cats in stacks.values():
                for (cat, blocking), n in cats.items():
                    table[role][label][cat][kind] += n
                    if kind == "all" and blocking:
                        table[role][label][cat]["blocked_leaf"] += n
    if cpu is not None:
        for pid, v in cpu["procs"].items():
            cpu_role[roles.get(pid, "other")] += v
    result: dict = {}
    for role, groups in table.items():
        r: dict = {"processes": len(procs[role]), "threads": {}}
        if cpu is not None:
            r["cpu_s"] = round(cpu_role[role], 2)
        for label, cats in groups.items():
            total = sum(c["all"] for c in cats.values())
            busy = sum(c["active"] for c in cats.values())
            if total == 0 or busy < 0.01 * total:
                continue  # threads that only sleep (pools, watchers) are left out
            row: dict = {"threads": len(threads[(role, label)]), "samples": total}
            if cpu is not None:
                row["cpu_s"] = round(cpu_s[(role, label)], 2)
            for cat, c in sorted(cats.items(), key=lambda kv: -kv[1]["all"]):
                share = c["all"] / total
                if share < 0.005:
                    continue
                idle = max(c["all"] - c["active"], 0)
                blocked = min(c["blocked_leaf"], idle)
                row[cat] = {
                    "wall": round(share, 3),
                    "gil": round(min(c["gil"], c["active"]) / total, 3),
                    "nogil": round(max(c["active"] - c["gil"], 0) / total, 3),
                    "gil_wait": round((idle - blocked) / total, 3),
                    "blocked": round(blocked / total, 3),
                }
            r["threads"][label] = row
        result[role] = r
    return result


def markdown(result: dict) -> str:
    lines = []
    for role, r in sorted(result.items()):
        cpu = f", {r['cpu_s']} CPU s" if "cpu_s" in r else ""
        lines.append(f"\n**{role}** ({r['processes']} process(es){cpu})\n")
        lines.append(
            "| thread | category | wall | GIL held | running, no GIL | GIL wait | blocked |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for g, row in sorted(r["threads"].items(), key=lambda kv: -kv[1]["samples"]):
            who = f"{g} (x{row['threads']}" + (
                f", {row['cpu_s']} CPU s)" if "cpu_s" in row else ")"
            )
            for cat, c in row.items():
                if cat in ("samples", "threads", "cpu_s"):
                    continue
                lines.append(
                    f"| {who} | {cat} | {c['wall']:.1%} | {c['gil']:.1%} | "
                    f"{c['nogil']:.1%} | {c['gil_wait']:.1%} | {c['blocked']:.1%} |"
                )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="py-spy sampling time (20)")
    ap.add_argument("--rate", type=int, default=25, help="samples per second (25)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs of the run (2)")
    ap.add_argument(
        "--idle-seconds", type=float, default=20.0, help="idle-cluster baseline (20; 0: skip)"
    )
    ap.add_argument("--store", default=None, help="dataset store (default: ingest MNIST once)")
    ap.add_argument("--keep", default=None, help="folder for the raw py-spy files")
    ap.add_argument("--analyse", default=None, help="only read the raw files in this folder")
    ap.add_argument("train_args", nargs="*", help="more `adam-dask train` arguments, after --")
    args = ap.parse_args(argv)
    if args.analyse:
        cpu_file = Path(args.analyse) / "cpu.json"
        cpu = (
            {
                k: {int(i): v for i, v in d.items()}
                for k, d in json.loads(cpu_file.read_text()).items()
            }
            if cpu_file.exists()
            else None
        )
        result = breakdown(
            {k: Path(args.analyse) / f"{k}.txt" for k in ("all", "active", "gil")}, cpu
        )
        print(json.dumps(result))
        print(markdown(result))
        return
    from _common import load_mnist_arrays, mnist_store, record

    store = args.store or mnist_store()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="adam-profile-"))
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = ["adam-dask", "train", "--data", store, "--epochs", str(args.epochs), "--no-progress"]
    cmd += ["--metrics-out", str(metrics), *args.train_args]
    load = [round(v, 2) for v in os.getloadavg()]
    raw = {k: folder / f"{k}.txt" for k in ("all", "active", "gil")}
    flags = {"all": ["--idle"], "active": [], "gil": ["--gil"]}
    with open(folder / "train.out", "w") as out, open(folder / "train.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        try:
            wait_records(metrics, 1, proc, 1200)  # epoch 1: start-up, compilation, warm-up
            cpu0 = cpu_times(proc.pid)
            spies = [
                subprocess.Popen(
                    ["py-spy", "record", "-p", str(proc.pid), "-s", "-t", "--nonblocking"]
                    + ["-r", str(args.rate), "-d", str(int(args.seconds)), "-f", "raw"]
                    + ["-o", str(raw[k])]
                    + flags[k],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for k in raw
            ]
            # epoch 2: what is measured; threads are polled, since a replica's ends with it
            snap = {"cpu": cpu0}

            def poll():
                snap["cpu"] = cpu_merge(snap["cpu"], cpu_times(proc.pid))

            rec = wait_records(metrics, 2, proc, 1200, poll=poll)
            cpu1 = snap["cpu"]
            for spy in spies:
                spy.wait()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    cpu = cpu_delta(cpu0, cpu1)
    (folder / "cpu.json").write_text(json.dumps(cpu))
    result = breakdown(raw, cpu)
    images = int(rec["images"])
    per_k = {role: round(1e6 * r["cpu_s"] / images, 1) for role, r in result.items()}
    training = sum(r["threads"].get("training", {}).get("cpu_s", 0.0) for r in result.values())
    xtr, ytr, _, _ = load_mnist_arrays(store)
    engine = engine_cpu_ms_per_1000(xtr[:8000], ytr[:8000])
    idle = idle_cluster_cores(args.idle_seconds) if args.idle_seconds else None
    seconds = float(rec.get("seconds") or 0.0)
    cores = {role: round(r["cpu_s"] / seconds, 3) for role, r in result.items()} if seconds else {}
    total = sum(per_k.values())
    line = {
        "command": " ".join(cmd[1:]),
        "epoch2_images": images,
        "epoch2_seconds": rec.get("seconds"),
        "epoch2_images_per_s": rec.get("images_per_second"),
        "cpu_ms_per_1000_images": per_k,
        "cores_used": cores,
        "idle_cluster_cores": idle,
        "training_threads_cpu_ms_per_1000_images": round(1e6 * training / images, 1),
        "engine_alone_cpu_ms_per_1000_images": engine,
        "training_share_of_cpu": round(1e6 * training / images / total, 3) if total else None,
        "py_spy_seconds": args.seconds,
        "rate": args.rate,
        "load": load,
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "raw": str(folder),
        "roles": result,
    }
    record("profile", line, save=False)
    print(markdown(result))
    (folder / "breakdown.json").write_text(json.dumps(line, indent=1))
    sys.stdout.flush()


IDLE = """
import time, adam_dask
with adam_dask.cluster.local() as client:
    print("ready", flush=True)
    time.sleep({seconds})
"""


def idle_cluster_cores(seconds: float) -> dict:
    """Cores used per role by the embedded cluster at its defaults doing nothing (heartbeats,
    monitors, Dask's own profiler, the dashboard): the part of the tax that runs by the
    second, not by the image."""
    proc = subprocess.Popen(
        [sys.executable, "-c", IDLE.format(seconds=seconds + 30)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "ready"
        time.sleep(5)
        a = cpu_times(proc.pid)
        time.sleep(seconds)
        b = cpu_times(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    d = cpu_delta(a, b)
    out: dict[str, float] = defaultdict(float)
    for pid, v in d["procs"].items():
        role = "client+scheduler" if pid in d["root"] else "PS" if pid in d["ps"] else "TRAIN/DATA"
        out[role] += v / seconds
    return {k: round(v, 3) for k, v in out.items()}


def wait_records(path: Path, n: int, proc: subprocess.Popen, timeout: float, poll=None) -> dict:
    """The ``n``-th epoch record of the run's --metrics-out file, once it is written; calls
    ``poll()`` every half second meanwhile."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if poll is not None:
            poll()
        if path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            if len(lines) >= n:
                return json.loads(lines[n - 1])
        if proc.poll() is not None:
            raise SystemExit(f"adam-dask train ended (status {proc.returncode}) before epoch {n}")
        time.sleep(0.5)
    raise SystemExit(f"epoch {n} did not end within {timeout:.0f} s")


def engine_cpu_ms_per_1000(x, y) -> float:
    """CPU milliseconds per 1000 images of the engine alone: one HogwildReplica thread in this
    process, the run's default network and mini-batch (after a warm-up)."""
    from adam_dask.model import Network
    from adam_dask.train.replica import HogwildReplica

    net = Network.from_spec(None, (1, 28, 28), None, seed=0)
    rep = HogwildReplica(net, threads=1, lr=0.01, momentum=0.0)
    rep.train_images(x[:512], y[:512])
    t0 = time.process_time()
    st = rep.train_images(x, y)
    return round(1000 * (time.process_time() - t0) / st.images * 1000, 1)


if __name__ == "__main__":
    main()
