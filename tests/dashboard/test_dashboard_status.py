"""The Adam page's status dict and HTML, from given controller state (no cluster)."""

from __future__ import annotations

import json

import pytest

from adam_dask.dashboard import RateMeter, build_status, render_page, render_tables, training_runs

A, B, C, D = (f"tcp://127.0.0.{i}:4000" for i in (2, 3, 4, 5))
WORKERS = {
    A: {"name": "ps-0", "host": "127.0.0.2", "resources": {"PS": 1}},
    B: {"name": "ps-1", "host": "127.0.0.3", "resources": {"PS": 1}},
    C: {"name": "ps-2", "host": "127.0.0.4", "resources": {"PS": 1}},
    "tcp://127.0.0.1:5000": {"name": "train-0", "host": "127.0.0.1", "resources": {"TRAIN": 1}},
    "tcp://127.0.0.1:5001": {"name": "data-0", "host": "127.0.0.1", "resources": {"DATA": 1}},
}
SECRET = "s3cr3t-never-shown"


def routing(**over):
    r = {
        "routing": [[A, B, C], [B, C, A], [C, A, B], [A, C, B]],
        "nodes": {A: "k-a", B: "k-b", C: "k-c"},
        "pending": [],
        "lost": [],
        "healthy": True,
        "target": 3,
        "generation": 2,
        "heal_times": [1.5],
        "info": {
            "checkpoint": "s3://bucket/ckpt",
            "storage_options": {"key": "id", "secret": SECRET},
            "meta": {"run": "run-1"},
        },
    }
    r.update(over)
    return r


def stats(pushes, **over):
    s = {
        "pushes": pushes,
        "uptime": 10.0,
        "replication_lag": 1,
        "writeback_lag_versions": 2,
        "writeback_lag_seconds": 0.5,
        "writeback_errors": 0,
        "versions": {0: 7, 1: 6},
    }
    s.update(over)
    return s


def test_rate_meter_over_a_window_restarts_when_a_counter_goes_down():
    m = RateMeter(window=4.0)
    assert m.add("n", 0.0, 0) is None
    assert m.add("n", 1.0, 10) == 10.0
    assert m.add("n", 2.0, 30) == 15.0
    m.add("n", 4.0, 40)
    # samples older than the window drop out, one at or before its start stays
    assert m.add("n", 8.0, 80) == pytest.approx((80 - 40) / (8 - 4))
    assert m.add("n", 9.0, 5) is None  # a new node under the same key
    m.forget(["other"])
    assert m.add("n", 10.0, 50) is None


def test_status_rows_follow_the_routing_and_tolerate_missing_stats():
    st = build_status(
        now=100.0,
        workers=WORKERS,
        servers={"srv": routing()},
        node_stats={"srv": {A: stats(40), B: "unreachable (TimeoutError)", C: {"pushes": 3}}},
        rates={"srv": {A: 4.0}},
    )
    json.dumps(st, allow_nan=False)  # JSON-safe
    (srv,) = st["servers"]
    assert srv["placement"] == {"0": [A, B, C], "1": [B, C, A], "2": [C, A, B], "3": [A, C, B]}
    rows = {r["address"]: r for r in srv["nodes"]}
    assert rows[A]["primaries"] == [0, 3] and rows[A]["backups"] == [1, 2]
    assert rows[B]["primaries"] == [1] and rows[B]["backups"] == [0, 2, 3]
    assert all(r["copies"] == 4 for r in rows.values())
    assert rows[A]["pushes_per_second"] == 4.0 and rows[A]["replication_lag"] == 1
    assert rows[B]["error"].startswith("unreachable") and rows[B]["pushes"] is None
    assert rows[C]["replication_lag"] is None  # a field the node did not report
    assert rows[C]["pushes_per_second"] is None  # no rate and no uptime to average over
    assert srv["totals"]["pushes"] == 43 and srv["totals"]["max_replication_lag"] == 1
    assert srv["shard_versions"] == {"0": {A: 7}, "1": {A: 6}}
    assert srv["checkpoint"] == "s3://bucket/ckpt" and srv["run"] == "run-1"
    assert SECRET not in json.dumps(st)  # storage options stay on the scheduler
    roles = [(w["name"], w["role"]) for w in st["workers"]]
    assert roles == [
        ("ps-0", "PS"),
        ("ps-1", "PS"),
        ("ps-2", "PS"),
        ("data-0", "DATA"),
        ("train-0", "TRAIN"),
    ]


def test_a_node_seen_once_reports_its_average_rate_since_start():
    st = build_status(
        now=0.0, workers=WORKERS, servers={"srv": routing()}, node_stats={"srv": {A: stats(40)}}
    )
    rows = {r["address"]: r for r in st["servers"][0]["nodes"]}
    assert rows[A]["pushes_per_second"] == pytest.approx(4.0)  # 40 pushes in 10 s of uptime


def test_a_lost_worker_and_its_events():
    events = [(float(i), {"event": "worker-lost", "worker": D, "server": "srv"}) for i in range(30)]
    events.append((31.0, {"event": "healed", "server": "srv", "seconds": 2.0}))
    r = routing(routing=[[B, C], [B, C, A]], pending=[], healthy=False)
    st = build_status(now=0.0, workers=WORKERS, servers={"srv": r}, ps_events=events, max_events=5)
    assert [e["event"] for e in st["events"]] == ["healed"] + ["worker-lost"] * 4  # newest first
    assert st["events"][0]["time"] == 31.0
    srv = st["servers"][0]
    assert srv["healthy"] is False
    assert {n["address"] for n in srv["nodes"]} == {A, B, C}


def test_training_runs_join_replica_progress_and_the_checkpoint_history():
    progress = [
        (1.0, {"run": "r", "epoch": 0, "replica": 0, "images": 100, "seconds": 1.0}),
        (1.5, {"run": "r", "epoch": 0, "replica": 1, "images": 120, "seconds": 1.2}),
        (2.0, {"run": "r", "epoch": 0, "replica": 0, "images": 256, "seconds": 2.0, "final": True}),
        (2.1, {"run": "r", "epoch": 0, "replica": 1, "images": 256, "seconds": 2.0, "final": True}),
        (3.0, {"run": "r", "epoch": 1, "replica": 0, "images": 50, "seconds": 0.5}),
        (3.0, {"run": "other", "epoch": 0, "replica": 0, "images": 9, "seconds": 1.0}),
        (3.1, "not a dict"),
        (3.2, {"run": "r"}),  # incomplete
    ]
    history = {"r": [{"epoch": 0, "loss": 0.5, "test_accuracy": 0.9, "images_per_second": 300.0}]}
    runs = training_runs(progress, history)
    assert [r["run"] for r in runs] == ["r", "other"]
    e0, e1 = runs[0]["epochs"]
    assert (e0["images"], e0["replicas"], e0["finished"]) == (512, 2, True)
    assert (e0["loss"], e0["test_accuracy"], e0["images_per_second"]) == (0.5, 0.9, 300.0)
    assert (e1["images"], e1["finished"], e1["loss"]) == (50, False, None)
    assert e1["images_per_second"] == 100.0


def test_history_alone_gives_the_curves_of_a_run_without_progress_events():
    runs = training_runs([], {"r": [{"epoch": 0, "loss": 1.0}, {"epoch": 1, "loss": 0.5}]})
    assert [(e["epoch"], e["loss"]) for e in runs[0]["epochs"]] == [(0, 1.0), (1, 0.5)]


def test_the_shard_table_marks_primaries_and_backups_and_escapes_names(html_tables):
    workers = dict(WORKERS)
    workers[A] = dict(workers[A], name="<script>alert(1)</script>")
    st = build_status(now=0.0, workers=workers, servers={"srv": routing()}, progress=[])
    page = render_page(st, refresh=2)
    assert "<script>alert(1)" not in page and "&lt;script&gt;" in page
    rows = html_tables(page)["shard-table"][1:]  # after the header row
    grid = {row[0][1]: [cls for cls, _ in row[1:]] for row in rows}
    assert grid[A] == ["primary", "backup", "backup", "primary"]
    assert grid[C] == ["backup", "backup", "primary", "backup"]
    assert [text for _, text in rows[0][1:]] == ["P", "B", "B", "P"]


def test_a_wide_server_shows_counts_instead_of_the_shard_table():
    st = build_status(now=0.0, workers=WORKERS, servers={"srv": routing()})
    html = render_tables(st, max_columns=3)
    assert 'class="shard-table"' not in html and "4 shards" in html


def test_a_partitioned_replicas_plan_is_shown_with_its_server(html_tables):
    from adam_dask.model import Network
    from adam_dask.model.partition import plan_partitions

    net = Network.from_spec("conv5x5:6,maxpool2,fc32,fc10", input_shape=(1, 12, 12))
    plan = plan_partitions(net, 2, threads=1, batch_size=8).as_dict()
    r = routing()
    r["info"]["meta"]["partition_plan"] = plan
    st = build_status(now=0.0, workers=WORKERS, servers={"srv": r})
    json.dumps(st, allow_nan=False)
    assert st["servers"][0]["partition_plan"] == plan
    rows = html_tables(render_page(st, refresh=2))["partition-plan"][1:]
    assert [[text for _, text in row] for row in rows] == [
        ["0", "0-2 conv5x5:6,maxpool2,fc32", f"{plan['partitions'][0]['params']:,}", rows[0][3][1]],
        ["1", "3-3 fc10", "330", rows[1][3][1]],
    ]
    assert "256 bytes per image" in render_page(st, refresh=2)
    assert (
        build_status(now=0.0, workers=WORKERS, servers={"srv": routing()})["servers"][0][
            "partition_plan"
        ]
        is None
    )


def test_the_controllers_story_is_shown_newest_first(html_tables):
    story = [
        {"stimulus": f"s-{i}", "event": f"Tick(now={i})", "shards": [i % 4], "actions": []}
        for i in range(20)
    ]
    story[-1] = {
        "stimulus": "controller-srv-WorkerRemoved-9",
        "event": "WorkerRemoved(addr='<b>gone</b>')",
        "shards": [],
        "actions": ["Call(fence -> tcp://b:1)", "Call(fence -> tcp://c:1)"],
    }
    st = build_status(
        now=0.0, workers=WORKERS, servers={"srv": routing()}, stories={"srv": story}, max_events=5
    )
    shown = st["servers"][0]["story"]
    assert [e["stimulus"] for e in shown] == [
        "controller-srv-WorkerRemoved-9",
        "s-18",
        "s-17",
        "s-16",
        "s-15",
    ]
    page = render_page(st, refresh=2)
    assert "<b>gone</b>" not in page  # escaped
    rows = html_tables(page)["ps-story"][1:]
    assert [text for _, text in rows[0]] == [
        "controller-srv-WorkerRemoved-9",
        "WorkerRemoved(addr='<b>gone</b>')",
        "all",
        "Call(fence -> tcp://b:1); Call(fence -> tcp://c:1)",
    ]
    assert "ps-story" not in render_page(
        build_status(now=0.0, workers=WORKERS, servers={"srv": routing()}), refresh=2
    )
