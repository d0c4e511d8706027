"""The Adam page on a real embedded cluster: ``/adam/status.json`` over HTTP against the
parameter server's own placement, the page in headless Chromium, and the page through a
fail-over (a PS worker SIGKILLed while training runs).

``ADAM_DASHBOARD_SCREENSHOT=docs/adam-dashboard.png pytest -k dashboard_fail_over`` also
saves the page after the fail-over there (the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

import adam_dask
import adam_dask.dashboard
from adam_dask.testing import hard_kill, synthetic_store

pytestmark = pytest.mark.slow

SPEC = "conv5x5:6,maxpool2,fc32,fc10"
SHARD_BYTES = 16384  # 7 shards for this network
SECRET = "dashboard-test-secret-9f2c"  # moto does not check it; it must never be shown
PRIMARY_BLUE, BACKUP_BLUE = (0x2F, 0x80, 0xED), (0xC9, 0xE2, 0xFF)  # the page's P and B cells


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        assert r.status == 200
        return r.read().decode()


def status_of(url: str) -> tuple[dict, str]:
    text = get(url + "/status.json")
    return json.loads(text), text


def server_status(st: dict, server_id: str) -> dict:
    (srv,) = [s for s in st["servers"] if s["id"] == server_id]
    return srv


@pytest.fixture(scope="module")
def trained(tmp_path_factory, s3_server):
    """A run of 2 epochs on the embedded cluster, checkpointing to S3 (moto) with storage
    options that hold a secret, the parameter server stepping with Nesterov momentum; the page
    registered from the client."""
    import s3fs

    tmp = tmp_path_factory.mktemp("dashboard")
    opts = dict(s3_server["options"], secret=SECRET)
    s3fs.S3FileSystem(**opts).mkdir("adam-dashboard")
    store = synthetic_store(tmp, n_train=512, n_test=128)
    with adam_dask.cluster.local(
        ps_nodes=3, data_nodes=1, trainers=1, dashboard_address="127.0.0.1:0"
    ) as client:
        url = adam_dask.dashboard.register(client)
        trainer = adam_dask.Trainer(
            store,
            model=SPEC,
            client=client,
            checkpoint="s3://adam-dashboard/run",
            storage_options=opts,
            progress=False,
            shard_bytes=SHARD_BYTES,
            server_optimizer="nesterov",
        )
        try:
            trainer.fit(epochs=2)
            yield SimpleNamespace(client=client, url=url, trainer=trainer)
        finally:
            trainer.close()


def test_dashboard_status_json_matches_the_parameter_server(trained):
    server = trained.trainer.server
    assert trained.url.endswith("/adam")
    st, text = status_of(trained.url)
    srv = server_status(st, server.server_id)
    placement = server.placement()
    assert {int(s): h for s, h in srv["placement"].items()} == placement
    assert srv["shards"] == len(placement) == 7 and srv["copies"] == 3 and srv["healthy"]
    # every PS worker's row: the shards it leads and backs up, as the placement says
    rows = {r["address"]: r for r in srv["nodes"]}
    assert set(rows) == {a for h in placement.values() for a in h}
    for addr, row in rows.items():
        assert row["primaries"] == [s for s, h in placement.items() if h[0] == addr]
        assert row["backups"] == [s for s, h in placement.items() if addr in h[1:]]
        assert row["error"] is None and row["pushes"] is not None
    assert srv["totals"]["pushes"] > 0
    assert srv["totals"]["max_replication_lag"] is not None
    roles = sorted(w["role"] for w in st["workers"])
    assert roles == ["DATA", "PS", "PS", "PS", "TRAIN"]
    # the training curves: 2 epochs, loss and accuracy from the run's checkpoint history
    (run,) = [r for r in st["training"] if r["run"] == srv["run"]]
    history = trained.trainer.history.records
    assert [e["epoch"] for e in run["epochs"]] == [r["epoch"] for r in history] == [0, 1]
    for e, r in zip(run["epochs"], history):
        assert e["test_accuracy"] == pytest.approx(r["test_accuracy"])
        assert e["loss"] == pytest.approx(r["loss"])
        assert e["images"] == 512 and e["finished"]
    assert srv["checkpoint"] == "s3://adam-dashboard/run"
    opt = server.optimizer
    assert srv["optimizer"] == f"nesterov (lr {opt.lr:g}, momentum {opt.momentum:g})"
    assert SECRET not in text and SECRET not in get(trained.url)
    # the same dict from the client, through the scheduler handler
    via_client = server_status(adam_dask.dashboard.status(trained.client), server.server_id)
    assert {s: list(h) for s, h in via_client["placement"].items()} == srv["placement"]


def test_dashboard_page_in_headless_chromium(trained, chromium, html_tables, tmp_path):
    from PIL import Image

    placement = trained.trainer.server.placement()
    png = tmp_path / "adam.png"
    chromium(trained.url, screenshot=png)
    assert png.exists() and png.stat().st_size > 0
    img = Image.open(png).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20  # not blank
    counts = {c: n for n, c in colors}
    assert counts.get(PRIMARY_BLUE, 0) > 100 and counts.get(BACKUP_BLUE, 0) > 100  # the table

    tables = html_tables(chromium(trained.url, dump_dom=True))
    head, *rows = tables["shard-table"]
    assert [text for _, text in head[1:]] == [str(s) for s in range(len(placement))]
    grid = {row[0][1]: row[1:] for row in rows}
    assert set(grid) == {a for h in placement.values() for a in h}
    for addr, cells in grid.items():
        for s, (cls, text) in enumerate(cells):
            holders = placement[s]
            want = "P" if holders[0] == addr else "B" if addr in holders else ""
            assert text == want and cls == {"P": "primary", "B": "backup", "": ""}[want]
    epochs = tables["epochs"][1:]
    assert [row[0][1] for row in epochs] == ["1", "2"]
    # the server optimizer, as the page shows it
    opt = trained.trainer.server.optimizer
    label = f"nesterov (lr {opt.lr:g}, momentum {opt.momentum:g})"
    assert label in chromium(trained.url, dump_dom=True)


def test_dashboard_follows_a_fail_over(trained, chromium, tmp_path):
    """A PS worker is SIGKILLed while training runs; the page shows the loss, the new
    primaries and the heal, and its placement is the server's own again."""
    server, url = trained.trainer.server, trained.url
    before = server.placement()
    victim = before[0][0]  # the primary of shard 0
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trained.trainer.fit(epochs=4)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    runner = threading.Thread(target=fit)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # until epoch 3 is under way
            st, _ = status_of(url)
            run = [
                r for r in st["training"] if r["run"] == server_status(st, server.server_id)["run"]
            ]
            if any(e["epoch"] == 2 and e["images"] for e in run[0]["epochs"]):
                break
            assert runner.is_alive() and time.monotonic() < deadline, errors
            time.sleep(0.2)
        assert server_status(st, server.server_id)["totals"]["pushes_per_second"] is not None
        hard_kill(trained.client, [victim])
        deadline = time.monotonic() + 120
        while True:
            st, _ = status_of(url)
            srv = server_status(st, server.server_id)
            held = {a for h in srv["placement"].values() for a in h}
            lost = [e for e in st["events"] if e.get("event") == "worker-lost"]
            if victim not in held and srv["healthy"] and lost:
                break
            assert time.monotonic() < deadline, srv
            time.sleep(0.25)
    finally:
        runner.join(300)
    assert not runner.is_alive() and not errors, errors
    assert lost[0]["worker"] == victim
    st, _ = status_of(url)
    srv = server_status(st, server.server_id)
    assert {int(s): h for s, h in srv["placement"].items()} == server.placement()
    assert all(len(h) == 3 for h in srv["placement"].values())
    assert srv["heal_times"] and srv["generation"] > 0
    assert [e["epoch"] for r in st["training"] if r["run"] == srv["run"] for e in r["epochs"]] == [
        0,
        1,
        2,
        3,
    ]
    png = tmp_path / "adam.png"
    chromium(url, screenshot=png, size=(1400, 1500))
    assert png.stat().st_size > 0
    if os.environ.get("ADAM_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(png, os.environ["ADAM_DASHBOARD_SCREENSHOT"])
