"""benchmarks/report.py: the figures of the README and docs/ come from the stored lines, and
Table 1 is shown seed by seed for one recipe."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str):
    """benchmarks/NAME.py as a module, with benchmarks/ on sys.path while it loads (as when it
    runs as a script: report imports report_rules and the rest)."""
    path = str(ROOT / "benchmarks")
    sys.path.insert(0, path)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # as an import does (dataclasses look their module up)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(path)
    return mod


def _report():
    return _bench("report")


def _line(seed, a, s, *, epochs=30, commit="c", best=0.999):
    def run(sd, acc):
        return {"seed": sd, "accuracy": acc, "best_accuracy": best}

    line = {"date": "2026-11-24T00:00:00Z", "commit": commit, "epochs": epochs, "lr": 0.05}
    if isinstance(seed, list):  # a --seeds line
        line.update(
            seed=seed,
            **{"async": [run(x, y) for x, y in zip(seed, a)]},
            sync=[run(x, y) for x, y in zip(seed, s)],
        )
    else:
        line.update(seed=seed, **{"async": run(seed, a)}, sync=run(seed, s))
    return line


def test_table1_shows_the_newest_pair_of_each_seed_of_the_newest_recipe():
    report = _report()
    lines = [
        _line(0, 0.9950, 0.9944, commit="old"),  # replaced by the newer seed-0 pair below
        _line(5, 0.9900, 0.9800, epochs=12),  # another recipe: left out
        _line([0, 1], [0.9936, 0.9948], [0.9941, 0.9949], commit="new"),
        {"date": "x", "commit": "one-mode", "epochs": 30, "async": {"seed": 2}},  # no sync
        _line(2, 0.9960, 0.9940, commit="last"),
    ]
    text = report.table1_by_seed(lines)
    rows = [
        r for r in text.splitlines() if r.startswith("| ") and not r.startswith(("| seed", "| ---"))
    ]
    assert [r.split(" | ")[0] for r in rows] == ["| 0", "| 1", "| 2", "| mean of 3"]
    assert "new | 99.36 (99.90) | 99.41 (99.90) | -0.05 |" in rows[0]
    assert "old" not in text and "| 5 |" not in text
    assert rows[3].endswith("| 99.48 | 99.43 | +0.05 |")  # (-0.05 - 0.01 + 0.20) / 3


def test_table1_is_shown_without_unnamed_regularisers_too():
    report = _report()
    smoothed = _line([0, 1], [0.9970, 0.9966], [0.9950, 0.9952], commit="ls")
    smoothed["label_smoothing"] = 0.1
    lines = [_line([0, 1], [0.9957, 0.9967], [0.9942, 0.9944], commit="plain"), smoothed]
    text = report.table1_block(lines)
    plain, _, rest = text.partition("The newest recipe, with label_smoothing 0.1:")
    assert rest, text
    assert "plain" in plain and "ls" not in plain and "| mean of 2 | | 99.62 | 99.43 |" in plain
    assert "ls" in rest and "plain" not in rest and "| mean of 2 | | 99.68 | 99.51 |" in rest
    # the newest recipe without a regulariser: one table, as before
    assert report.table1_block(lines[:1]) == report.table1_by_seed(lines[:1])
    # a line from before label_smoothing was recorded is the same recipe as one with 0
    zero = _line([2], [0.9950], [0.9940], commit="zero")
    zero["label_smoothing"] = 0.0
    assert "plain" in report.table1_block([lines[0], zero])


def test_table1_shows_each_server_optimizer_beside_the_sum():
    report = _report()
    plain = _line([0, 1], [0.9950, 0.9960], [0.9940, 0.9944], commit="sum")
    opt = _line([0, 1], [0.9956, 0.9964], [0.9952, 0.9950], commit="nest")
    opt["server_optimizer"] = "nesterov+staleness"
    other = _line([0], [0.9900], [0.9910], commit="nest12", epochs=12)
    other["server_optimizer"] = "nesterov"
    text = report.table1_block([plain, opt, other])
    sums, _, rest = text.partition("With `nesterov+staleness` on the parameter server")
    # the sum's table keeps the sum's runs: the newer optimizer line replaces none of its seeds
    assert "| mean of 2 | | 99.55 | 99.42 |" in sums and "nest" not in sums
    assert "| mean of 2 | | 99.60 | 99.51 |" in rest
    assert (
        "`nesterov+staleness` beside `sum` (mean final accuracy over 2 and 2 seeds): "
        "async 99.60 vs 99.55 (+0.05), sync 99.51 vs 99.42 (+0.09)." in rest
    )
    # another recipe (12 epochs) gets its table but no sentence setting it beside the sum
    twelve = rest.partition("With `nesterov` on the parameter server")[2]
    assert "| mean of 1 | | 99.00 | 99.10 |" in twelve and "beside" not in twelve
    assert report.table1_block([opt]).startswith("No table1 line with both modes and `sum`")


def test_the_curves_plot_draws_each_shown_recipe(tmp_path):
    mod = _bench("plot_table1")
    a, b = _line([0, 1], [0.9957, 0.9967], [0.9942, 0.9944]), _line([0], [0.997], [0.995])
    b["label_smoothing"] = 0.1
    for ln, base in ((a, 0.990), (b, 0.992)):
        for mode in ("async", "sync"):
            for i, run in enumerate(ln[mode]):
                run["curve"] = [base + 0.001 * e + 0.0001 * i for e in range(5 - i)]
    assert mod.mean_curve(a["async"]) == pytest.approx([0.99005, 0.99105, 0.99205, 0.99305])
    opt = _line([0], [0.996], [0.994])
    opt["server_optimizer"] = "nesterov+staleness"
    for mode in ("async", "sync"):
        opt[mode][0]["curve"] = [0.99, 0.995]
    labels = mod.plot([a, b, opt], tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels[:6] == [
        "async, no unnamed regulariser (mean of 2 seeds)",
        "sync, no unnamed regulariser (mean of 2 seeds)",
        "async, label_smoothing 0.1 (mean of 1 seed)",
        "sync, label_smoothing 0.1 (mean of 1 seed)",
        "async, server nesterov+staleness (mean of 1 seed)",
        "sync, server nesterov+staleness (mean of 1 seed)",
    ]
    with pytest.raises(SystemExit, match="no table1 line"):
        mod.plot([], tmp_path / "none.png")


def test_the_readme_and_docs_show_what_the_stored_lines_say():
    report = _report()
    assert set(report.PAGES) == {
        ROOT / "README.md",
        ROOT / "docs" / "setup.md",
        ROOT / "docs" / "table1.md",
        ROOT / "docs" / "benchmarks.md",
    }
    for page in report.PAGES:
        text = page.read_text()
        assert report.render(text, page=page) == text, f"{page}: run python benchmarks/report.py"
    # each block is on one page, once
    names = [name for names in report.PAGES.values() for name in names]
    assert sorted(names) == ["figures", "scaling", "server-optimizer", "sizing", "table1"]
    for page, held in report.PAGES.items():
        text = page.read_text()
        for name in names:
            start, end = report.markers(name)
            assert text.count(start) == text.count(end) == (name in held), (page, name)


# --- the headline table, from small synthetic lines ---


def _stamp(commit, **kw):
    return {"date": "2026-11-25T00:00:00Z", "commit": commit, "cpus": 2, **kw}


def _tta(commit, ours, torch=None, engine=None, **kw):
    line = _stamp(commit, target=0.99, ours_seconds_to_target=ours, ours_epochs=3, **kw)
    if torch is not None:
        line.update(torch_seconds_to_target=torch, torch_epochs=4, torch_threads=2)
    if engine is not None:
        line.update(engine_seconds_to_target=engine, engine_epochs=4)
    return line


def _capacity_line(ours=4, sink=8):
    def point(r, p99, within):
        return {"replicas": r, "mb_per_s": 30.0 * r, "push_ms_p99": p99, "within": within}

    return _stamp(
        "cap",
        replicas_served=ours,
        sink_replicas_served=sink,
        p99_bound_ms=100,
        curve=[point(1, 5.0, True), point(4, 60.0, True), point(8, 400.0, False)],
        sink_curve=[point(1, 1.0, True), point(8, 20.0, True), point(16, 300.0, False)],
    )


def _rows(text, claim):
    return [r for r in text.splitlines() if r.startswith(f"| {claim}")]


def test_each_claim_is_ours_beside_its_named_peer_in_words():
    report = _report()
    results = {
        "time_to_accuracy": [_tta("t1", 34.69, torch=41.24, engine=23.28, ours_over_torch=0.841)],
        "engine": [_stamp("e1", threads=2, images_per_s=12660.9, torch_images_per_s=5453.5)],
        "ps": [
            _stamp(
                "p1",
                push_mb_per_s=300.0,
                raw_push_mb_per_s=600.0,
                pull_mb_per_s=500.0,
                raw_pull_mb_per_s=1000.0,
                push_vs_raw=0.5,
                goals={"push_vs_raw": 0.8},
            )
        ],
    }
    text = report.headline(results)
    (tta,) = _rows(text, "Time to 99% MNIST")
    # the line's own ratio (from unrounded seconds) is the one shown
    assert "34.7 s (3 epochs) | PyTorch, same network, 2 threads: 41.2 s (4 epochs) |" in tta
    assert "| 0.84x the time PyTorch takes |" in tta
    assert "2026-11-25, t1, 2 CPUs" in tta
    (engine,) = _rows(text, "Engine training images/s")
    assert (
        "| 12,661 images/s | PyTorch, same network: 5,454 images/s | 2.32x the images/s of PyTorch |"
        in engine
    )
    (push,) = _rows(text, "PS push")
    assert "0.50x the MB/s of a raw actor round trip (goal: at least 0.80x)" in push
    (pull,) = _rows(text, "PS pull")  # no ratio key: ours / peer
    assert "0.50x the MB/s of a raw actor round trip |" in pull
    # the engine-alone row comes from the same line; without the engine run it says so
    assert "1.49x the time the engine alone takes" in text
    text = report.headline({"time_to_accuracy": [_tta("t2", 23.0)]})
    assert "| 23 s (3 epochs) | PyTorch: not run | no peer in this run |" in text


def test_a_benchmark_without_a_line_has_no_row():
    report = _report()
    results = {"engine": [_stamp("e1", images_per_s=2.0, torch_images_per_s=1.0)]}
    text = report.headline(results)
    assert "capacity" not in "".join(_rows(text, ""))
    assert "No stored line measures these yet:" in text and "`capacity`" in text
    text = report.headline({**results, "capacity": [_capacity_line()]})
    (row,) = _rows(text, "PS capacity")
    assert "| 4 replicas (120 MB/s, p99 push 60 ms) |" in row
    assert "a socket sink (the machine's limit): 8 replicas (240 MB/s, p99 push 20 ms)" in row
    assert "0.50x the replicas the socket sink serves" in row
    assert "`capacity`" not in text.partition("No stored line")[2].partition("\n")[0]
    # a stored file no claim reads is named, not dropped silently
    assert "`table1_torch` (1 lines)" in report.headline({"table1_torch": [_stamp("x")]})


def test_every_stored_run_is_listed_not_only_the_newest():
    report = _report()
    lines = [
        _tta("old", 900.0),  # no peer: still listed
        _tta("mid", 30.0, torch=20.0),  # slower than PyTorch: still listed
        _tta("new", 34.69, torch=41.24),
    ]
    block = report.every_run("time_to_accuracy", lines)
    rows = [r for r in block.splitlines() if r.startswith("| 2026")]
    assert [r.split(", ")[1] for r in rows] == ["old", "mid", "new"]
    assert "| 900 s | 900 s | — |" in rows[0]
    assert "30 s vs 20 s (1.50x)" in rows[1]
    assert "all 3 stored runs" in block and block.startswith("<details>")
    assert "| 3 in `time_to_accuracy` |" in report.headline(
        {"time_to_accuracy": lines}
    )  # the runs column


def test_the_data_plane_rows_compare_with_a_socket_when_the_ps_line_measures_it():
    report = _report()
    line = _stamp("p", push_mb_per_s=300.0, raw_push_mb_per_s=600.0)
    assert "Data plane" not in report.headline({"ps": [line]})
    mnist = {"mb": 1.19, "socket_push_mb_per_s": 2000.0, "auto": {"push_donated_mb_per_s": 1500.0}}
    line.update(push_vs_socket=0.75, push_4mb_vs_socket=1.2, plane={"mnist": mnist})
    line["goals"] = {"push_vs_socket": 0.8}
    (push,) = _rows(report.headline({"ps": [line]}), "Data plane push")
    assert (
        "1,500 MB/s" in push and "a plain TCP socket between the same two processes: 2,000" in push
    )
    assert "0.75x the MB/s of a plain TCP socket (goal: at least 0.80x); 4 MB: 1.20x" in push
    assert "0.75x socket, 4 MB 1.20x" in report.every_run("ps", [line])


def test_chaos_and_quorum_say_what_happened():
    report = _report()
    ended = _stamp("c1", completed=False, error="ShardUnavailable: no primary", fault_count=3)
    ended.update(epochs_done=0, clean_test_accuracy=[0.99], clean_seconds=10.0)
    done = _stamp("c2", completed=True, error=None, fault_count=21, seconds=300.0)
    done.update(test_accuracy=[0.98, 0.993], clean_test_accuracy=[0.9921], clean_seconds=200.0)
    done["every_image_applied_once"] = True
    text = report.headline({"chaos": [ended, done]})
    assert "+0.09 points of accuracy, 1.50x the time the undisturbed run takes" in text
    assert "| ended (ShardUnavailable) |" in report.every_run("chaos", [ended, done])
    q = _stamp("q", replicas=4, slow_replica_delay_per_batch=0.02)
    q.update(epoch_seconds_quorum_1_0=20.0, epoch_seconds_quorum_0_75=8.0)
    q.update(accuracy_quorum_1_0=0.98, accuracy_quorum_0_75=0.975)
    q["detail"] = {
        "1.0": {"epoch_seconds": [40.0, 10.0, 10.0]},
        "0.75": {"epoch_seconds": [9, 7, 7]},
    }
    (row,) = _rows(report.headline({"quorum": [q]}), "Epoch quorum")
    assert "0.40x the time quorum 1.0 takes, -0.50 points of accuracy" in row
    assert "0.70x without each run's first epoch (7 s vs 10 s)" in row


def test_the_sizing_sentence_counts_every_small_machine_run():
    report = _report()
    lines = [
        _tta(c, 20.0, ours_replicas=r, ours_images_per_second=ips) | {"ours_epochs": e}
        for c, r, e, ips in (("a", 1, 2, 5000.0), ("b", 2, 4, 6000.0), ("c", 1, 3, 5200.0))
    ]
    lines.append(_tta("big", 9.0, ours_replicas=4) | {"cpus": 8})  # 4 CPUs or more: left out
    text = report.sizing_sentence(lines)
    assert text == (
        "On 2 CPUs the stored `time_to_accuracy` runs reached 99% in 2, 3 epochs with 1 replica "
        "(median 5,100 images/s) and in 4 epochs with 2 replicas (median 6,000 images/s)."
    )
    assert "No stored" in report.sizing_sentence([])


def test_render_links_a_plot_only_when_its_data_is_stored():
    report = _report()
    readme = "a\n<!-- figures:start -->\nold dump\n<!-- figures:end -->\nz"
    benchmarks = "<!-- server-optimizer:start -->\n<!-- server-optimizer:end -->\n" + (
        "<!-- scaling:start -->\n<!-- scaling:end -->"
    )
    tta = _tta("t", 30.0, torch=40.0) | {"ours_curve": [0.98, 0.991], "torch_curve": [0.99]}
    out = report.render(readme, {"time_to_accuracy": [tta]})
    assert "old dump" not in out and "docs/time-to-accuracy.png" in out
    assert "docs/capacity.png" not in out
    out = report.render(readme, {"time_to_accuracy": [tta], "capacity": [_capacity_line()]})
    assert "docs/capacity.png" in out
    assert report.render(out, {"time_to_accuracy": [tta], "capacity": [_capacity_line()]}) == out
    out = report.render(benchmarks, {}, report.BENCHMARKS_MD)
    assert "scaling.png" not in out and "No stored `scaling` run yet" in out
    # docs/benchmarks.md links its plot beside it
    assert "](scaling.png)" in report.render(
        benchmarks, {"scaling": [_scaling()]}, report.BENCHMARKS_MD
    )
    with pytest.raises(SystemExit, match=r"docs/table1\.md has no <!-- table1:start -->"):
        report.render(readme, {}, report.TABLE1_MD)


def test_the_plots_draw_from_synthetic_lines(tmp_path):
    cap = _bench("plot_capacity")
    labels = cap.plot(_capacity_line(), tmp_path / "cap.png")
    assert (tmp_path / "cap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels == ["ours (serves 4)", "socket sink (serves 8)", "bound 100 ms"]
    with pytest.raises(SystemExit, match="no capacity line"):
        cap.plot({}, tmp_path / "none.png")
    tta = _bench("plot_time_to_accuracy")
    line = _tta("t", 30.0, torch=40.0) | {"ours_curve": [0.98, 0.991], "torch_curve": [0.97, 0.99]}
    labels = tta.plot(line, tmp_path / "tta.png")
    assert labels == [
        "ours: adam-dask train, embedded cluster (99% in 30 s)",
        "PyTorch (99% in 40 s)",
        "target 99%",
    ]
    with pytest.raises(SystemExit, match="no time_to_accuracy line"):
        tta.plot({}, tmp_path / "none.png")


# --- every generated sentence is true of its line (issue 39) ---


def _chaos_line(kinds, **kw):
    line = _stamp("ch", completed=True, error=None, seconds=30.0, epochs=2, n_train=1024)
    line.update(test_accuracy=[0.97, 0.98], clean_test_accuracy=[0.97, 0.981], clean_seconds=20.0)
    line.update({"every_image_applied_once": True, "faults_not_sent": [], **kw})
    line["faults"] = [
        {"second": 1.0 + i, "kind": k, "victims": ["tcp://x"]} for i, k in enumerate(kinds)
    ]
    line["fault_count"] = len(kinds)
    return line


def test_a_chaos_row_names_only_the_faults_its_line_sent():
    report = _report()
    readme = (ROOT / "README.md").read_text()
    one = _chaos_line(["freeze-ps"])
    out = report.render(readme, {"chaos": [one]})
    (row,) = _rows(out, "Training through")
    assert "Training through 1 fault sent from outside (freeze-ps)," in row, row
    # no sentence of the README claims faults the line did not send
    for claim in ("every role", "SIGKILLs and SIGSTOPs of every"):
        assert claim not in out, claim
    for kind in ("kill-ps", "kill-shard", "freeze-data"):
        assert kind not in out.partition("<!-- figures:start -->")[2], kind
    # faults the line could not send are said, not counted as sent
    missed = _chaos_line(
        ["kill-ps", "kill-ps"], faults_not_sent=["kill-shard: TimeoutError: no victim"]
    )
    (row,) = _rows(report.headline({"chaos": [missed]}), "Training through")
    assert (
        "Training through 2 faults sent from outside (2x kill-ps); 1 not sent (kill-shard)" in row
    )
    # a line without the list of faults names no kind
    bare = _chaos_line([])
    bare["fault_count"] = 3
    del bare["faults"]
    (row,) = _rows(report.headline({"chaos": [bare]}), "Training through")
    assert "Training through 3 faults sent from outside, 2 epochs" in row


def test_a_loaded_lines_row_shows_its_load():
    report = _report()
    busy = _capacity_line() | {"load_before": 9.04, "load_after": 3.1}
    (row,) = _rows(report.headline({"capacity": [busy]}), "PS capacity")
    assert "2 CPUs, load 9.0" in row  # the highest load the line recorded, in any of its keys
    # a timing measured on a machine this busy (more than 2 runnable per CPU) is not a claim
    assert "no claim of speed: measured at load 9.0 on 2 CPUs" in row
    assert "0.50x the replicas" not in row
    assert "2 CPUs, load 9.0, no claim of speed |" in report.every_run("capacity", [busy])
    (row,) = _rows(report.headline({"capacity": [_capacity_line()]}), "PS capacity")
    assert "2 CPUs, load not recorded" in row and "0.50x the replicas the socket sink serves" in row


def _frozen(epoch_seconds, baseline, load=None):
    line = _stamp("sf", scenario="trainer", data_nodes=1, epoch_seconds=epoch_seconds)
    line["baseline_epoch_seconds"] = baseline
    if load is not None:
        line["load_average"] = load
    return line


def test_a_difference_within_noise_makes_no_claim():
    report = _report()
    # the stored line: a frozen data server "made the epoch faster" at load 21 on 2 CPUs
    (row,) = _rows(
        report.headline({"serving_faults": [_frozen([155.7, 137.5], [250.7, 261.0], 21.0)]}),
        "Epoch seconds",
    )
    assert "| 147 s | the undisturbed epoch: 256 s |" in row
    assert "no claim of speed: measured at load 21.0 on 2 CPUs" in row
    assert "0.57x the time" not in row and "faster" not in row
    # quiet, but the epochs of the two runs overlap: within noise
    (row,) = _rows(
        report.headline({"serving_faults": [_frozen([10.0, 14.0], [12.0, 13.0], 1.0)]}),
        "Epoch seconds",
    )
    assert "within noise: the runs overlap (10-14 s vs 12-13 s)" in row
    # quiet and apart: the claim stands
    (row,) = _rows(
        report.headline({"serving_faults": [_frozen([20.0, 21.0], [12.0, 13.0], 1.0)]}),
        "Epoch seconds",
    )
    assert "1.64x the time the undisturbed epoch takes" in row
    # one run each, less than 10% apart: within noise, not "1.04x the time PyTorch takes"
    text = report.headline(
        {"time_to_accuracy": [_tta("t", 18.68, torch=17.94, ours_over_torch=1.041, load=[1.0])]}
    )
    (row,) = _rows(text, "Time to 99% MNIST")
    assert "within noise: 1.04x the time PyTorch takes, under 10% apart" in row
    # accuracies of several seeds that overlap: the difference is within noise
    part = _stamp("p", part="mnist", seeds=3, images=20000, epochs=2, load=[1.0])
    part.update(accuracy_p1=[0.9735, 0.972, 0.974], accuracy_p2=[0.975, 0.968, 0.967])
    part.update(mean_accuracy_p1=0.9732, mean_accuracy_p2=0.97, rate_ratio_p2_vs_p1=0.81)
    part.update(
        images_per_second_p1=[3988.0, 4501.0, 4348.0], images_per_second_p2=[3438.0, 3574.0, 3425.0]
    )
    (row,) = _rows(report.headline({"partitions": [part]}), "The paper's MNIST net")
    assert "-0.32 points, within noise: the seeds overlap (96.70-97.50% vs 97.20-97.40%)" in row
    assert "images/s 0.81x of P = 1" in row


def test_the_engines_images_per_second_say_which_run_they_come_from():
    report = _report()
    tta = _tta("t", 18.7, torch=17.9, engine=20.5, load=[1.0])
    tta.update(ours_images_per_second=7100.9, engine_images_per_second=10256.9, engine_threads=2)
    tta.update(activation="relu")
    engine = _stamp("e", threads=2, images=20000, batch_size=8, images_per_s=12660.9)
    engine.update(torch_images_per_s=5453.5, load=[1.0])
    text = report.headline({"time_to_accuracy": [tta], "engine": [engine]})
    (rate,) = _rows(text, "Training images/s")
    assert (
        "the engine alone in the same `time_to_accuracy` run (relu, 4 epochs, 2 threads): 10,257"
        in rate
    )
    (eng,) = _rows(text, "Engine training images/s")
    assert "`engine.py`, not the `time_to_accuracy` run" in eng and "20000 images" in eng


# --- report.py as data (issue 40): claims are records, every stored run is in docs/results.md ---


def test_a_claim_record_that_can_not_be_read_fails_with_one_clear_line():
    _report()
    rec = sys.modules["report_record"]
    good = {"bench": "ps", "name": "push", "what": "PS push", "ours": "push_mb_per_s"}
    good.update(peer="raw_push_mb_per_s", unit="MB/s", peer_name="a raw actor round trip")
    rec.Claim(**good)  # reads
    broken = {
        "claim ps/push: no what": {"what": ""},
        "claim ps/push: no unit (a claim with a peer or a ratio shows its figures in a unit)": {
            "unit": ""
        },
        "claim ps/push: no peer_name (the peer 'raw_push_mb_per_s' is named in its words)": {
            "peer_name": ""
        },
        "claim ps/push: reads nothing (no ours, needs, values or figure)": {"ours": "", "peer": ""},
        "claim ps/push: brief: unknown format 'nm' in {ours:nm}": {"brief": "{ours:nm}"},
        "claim ps/push: words: a stray '}' in '{ratio:x} the MB/s}'": {
            "words": "{ratio:x} the MB/s}"
        },
        "claim ps/push: more: a stray '[[' in '[[; 4 MB {r:x}'": {"more": "[[; 4 MB {r:x}"},
        "claim ps/push: speed 'fast' is not one of noise, load, none": {"speed": "fast"},
    }
    for message, change in broken.items():
        with pytest.raises(rec.ClaimError) as err:
            rec.Claim(**(good | change))
        assert str(err.value) == message
    # a record without a required field does not build either, in one line
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'what'"):
        rec.Claim(bench="ps", name="push", ours="push_mb_per_s")


def test_the_claims_are_records_the_same_rules_apply_to():
    report = _report()
    rec = sys.modules["report_record"]
    assert all(isinstance(c, rec.Claim) for c in report.CLAIMS)
    assert len({(c.bench, c.name) for c in report.CLAIMS}) == len(report.CLAIMS)
    # templates: a field's value, formatted; a [[...]] part left out when a field is missing
    line = {"a": 1234.5, "b": {"c": 0.5}}
    assert rec.fill("{a:num} MB[[, {b/c:x}]][[, {b/d:x}]], {e}", [line]) == "1,234 MB, 0.50x, ?"
    # the busy rule reads the line's load even where a claim's figures sit in a part of it
    big = _stamp("lm", model="10M", load=[34.4], offload_sent_bytes_ratio=1.13)
    big["ps"] = {"payload_mb": 40.0, "push_mb_per_s": 19.3, "raw_push_mb_per_s": 113.0}
    (row,) = _rows(report.headline({"large_model": [big]}), "10M-parameter dense net")
    assert "no claim of speed: measured at load 34.4 on 2 CPUs" in row
    assert "the MB/s of a raw actor transfer" not in row
    assert row.count("; the dense offload sends 1.13x the bytes per image") == 1


def test_a_mean_has_the_same_digits_on_every_python():
    """Python 3.12 sums floats with compensation and 3.11 does not: the pages' means must not
    depend on which one made them (3.11 wrote +0.04 and 3.12 +0.03 from the same lines)."""
    _report()
    rules = sys.modules["report_rules"]
    assert rules.mean([0.1] * 10) == 0.1  # a plain sum on 3.11: 0.09999999999999999


def test_docs_results_lists_every_stored_run():
    report = _report()
    rules = sys.modules["report_rules"]
    results = report.load_results()
    page = (ROOT / "docs" / "results.md").read_text()
    assert report.results_page(results) == page, "run python benchmarks/report.py"
    for bench, lines in results.items():
        head = f"<code>{bench}</code>: all {len(lines)} stored run"
        assert page.count(head) == 1, bench
        section = page.partition(head)[2].partition("</details>")[0]
        rows = [
            r
            for r in section.splitlines()
            if r.startswith("| ") and not r.startswith(("| run (date", "| ---"))
        ]
        assert len(rows) == len(lines), bench
        for ln, row in zip(lines, rows):
            assert row.startswith(f"| {rules.run_stamp(ln)}"), (bench, row)
    # the README keeps the headline table and links to the page, not the lists
    readme = (ROOT / "README.md").read_text()
    block = readme.partition("<!-- figures:start -->")[2].partition("<!-- figures:end -->")[0]
    assert "(docs/results.md)" in block and "<details>" not in block


def test_check_finds_a_stale_readme_or_results_page():
    report = _report()
    results = report.load_results()
    assert report.stale(results) == []
    assert report.main(["--check"]) == 0
    fewer = {**results, "engine": results["engine"][:-1]}
    assert report.stale(fewer) == [report.README, report.RESULTS_MD]
    # a line no README row reads: only the page is stale
    sim = results["simulation"]
    changed = {**results, "simulation": [*sim[:-1], sim[-1] | {"seeds": 1}]}
    assert report.stale(changed) == [report.RESULTS_MD]


def _sopt(opt, k, accs, *, replicas=4, epochs=10, lr=None):
    line = {
        "date": "2026-11-26T00:00:00Z",
        "commit": "c",
        "cpus": 2,
        "optimizer": opt,
        "push_every": k,
        "replicas": replicas,
        "threads": 1,
        "epochs": epochs,
        "accuracies": accs,
        "bytes_pushed_per_image": 4 * 298090 / k,
    }
    if lr is not None:
        line.update(server_lr=lr, server_momentum=0.9)
    return line


def test_the_server_optimizer_block_shows_every_run_and_says_whether_the_goal_holds():
    mod = _bench("report_optimizer")
    assert "not measured" in mod.optimizer_block([_sopt("nesterov", 4096, [0.98], lr=0.2)])
    base = _sopt("sum", 512, [0.984, 0.986])
    slow = _sopt("sum", 4096, [0.97, 0.975])
    nes = _sopt("nesterov", 4096, [0.985, 0.987], lr=0.2)
    block = mod.optimizer_block([base, slow, nes])
    assert block.count("| 2026-11-26") == 3  # every run, a row each
    assert "nesterov (lr 0.2, momentum 0.9)" in block and "98.50, 98.70" in block
    goal = block.splitlines()[-1]
    assert "`nesterov`, averaged 98.60% over 2 seeds against 98.50% for `sum` at 512" in goal
    assert "8x fewer bytes" in goal and goal.endswith("met.")
    missed = mod.communication_goal([base, slow])  # the best at 4096 is the sum, behind
    assert "`sum`, averaged 97.25%" in missed and missed.endswith("missed by 1.25 points.")
    # another recipe (epochs) is not compared with the base
    assert "not measured" in mod.communication_goal(
        [base, _sopt("nesterov", 4096, [1.0], epochs=3, lr=0.2)]
    )


def test_runs_to_a_target_say_their_seconds_and_epochs_and_make_no_claim_when_busy():
    mod = _bench("report_optimizer")
    line = _sopt("nesterov", 512, [0.9903, 0.991], replicas=1, lr=0.2)
    line.update(target=0.99, seconds_to_target=[32.6, None], epochs_to_target=[3, None])
    line["load"] = [7.0, 5.0]
    text = mod.time_to_target([line])
    assert "seconds 33 (mean 32.6), epochs 3 (mean 3.0); 1 seed never reached it" in text
    assert "no claim of speed" in text
    block = mod.optimizer_block([_sopt("sum", 512, [0.98]), line])
    assert "10 at most (stops at 99%)" in block
    # a run to a target is no run of the communication goal (it stopped early)
    assert "No stored run at push every 4096 beside it" in block


def _slow(opt, k, seconds, *, rate="20mbit", lr=None):
    line = _sopt(opt, k, [0.991] * len(seconds), replicas=2, lr=lr)
    epochs = [None if s is None else 4 for s in seconds]
    line.update(target=0.99, seconds_to_target=seconds, epochs_to_target=epochs)
    line.update(cluster="netns", link_rate=rate, links_shaped="ps", load=[1.0])
    return line


def test_the_bandwidth_goal_compares_times_to_the_target_on_slow_links():
    mod = _bench("report_optimizer")
    base = _slow("sum", 512, [200.0, 220.0])
    best = _slow("nesterov+staleness", 4096, [90.0, 100.0], lr=0.2)
    worse = _slow("nesterov", 4096, [150.0, 170.0], lr=0.2)
    goal = mod.bandwidth_goal([base, worse, best])
    assert "`nesterov+staleness`, reached 99% in 95.0 s on average over 2 seeds" in goal
    assert "against 210.0 s for `sum` at 512 over 2 seeds: 0.45x the time; met." in goal
    assert mod.bandwidth_goal([base, worse]).endswith("0.76x the time; missed (the goal is 0.5x).")
    # a seed of the best that never reached the target misses the goal, whatever the others did
    never = _slow("nesterov+staleness", 4096, [90.0, None], lr=0.2)
    text = mod.bandwidth_goal([base, never])
    assert "in 90.0 s on average over the 1 seeds that reached it against 210.0 s" in text
    assert text.endswith("0.43x the time; missed: 1 of its 2 seeds never reached 99% in 10 epochs.")
    # one of the sum's: nothing to compare with
    assert "not measured, since a seed of `sum`" in mod.bandwidth_goal(
        [_slow("sum", 512, [200.0, None]), best]
    )
    # the embedded cluster's runs answer neither this goal nor are compared with these
    embedded = _sopt("sum", 512, [0.98])
    assert mod.bandwidth_goal([embedded]) == ""
    block = mod.optimizer_block([embedded, base, best])
    assert "2 x 1, namespace cluster, PS links 20mbit" in block
    assert "No stored run at push every 4096 beside it" in block  # the communication goal
    assert "threads, PS links 20mbit, to 99%" in block
    # another rate is another experiment: the newest rate's lines only
    assert "not measured" in mod.bandwidth_goal(
        [base, _slow("nesterov", 4096, [9.0], rate="5mbit")]
    )


def _scaling(**kw):
    """A made-up scaling line: defaults 8 x 2 on 16 CPUs, DDP 8 x 2, a sweep of 1 and 8."""
    line = {
        "date": "2026-11-27T00:00:00Z",
        "commit": "c",
        "cpus": 16,
        "config": "defaults",
        "target": 0.99,
        "epochs": 10,
        "replicas": 8,
        "threads": 2,
        "data_nodes": 2,
        "accuracy": [0.981, 0.9904],
        "images_per_second": [30000.0, 40000.0],
        "images_per_second_median": 40000.0,
        "stall_fraction": [0.2, 0.04, 0.06],
        "epochs_to_target": 2,
        "seconds_to_target": 12.5,
        "engine_images_per_second": 50000.0,
        "images_per_second_vs_engine": 0.8,
        "peer": "ddp",
        "peer_processes": 8,
        "peer_threads": 2,
        "peer_accuracy": [0.97, 0.985, 0.991],
        "peer_epochs_to_target": 3,
        "peer_seconds_to_target": 30.0,
        "peer_images_per_second": 20000.0,
        "seconds_vs_peer": 12.5 / 30.0,
        "sweep": [
            {
                "replicas": 8,
                "threads": 2,
                "epochs_to_target": None,
                "seconds_to_target": None,
                "images_per_second": 41000.0,
                "accuracy": [0.97, 0.985],
                "stall_fraction": 0.05,
            },
            {
                "replicas": 1,
                "threads": 16,
                "epochs_to_target": 2,
                "seconds_to_target": 40.0,
                "images_per_second": 9000.0,
                "accuracy": [0.985, 0.9912],
                "stall_fraction": 0.01,
            },
        ],
        "missing": [],
        "load": [1.0, 2.0],
        "goals": {
            "defaults_reach_target": True,
            "seconds_vs_peer_le_0_5": True,
            "sweep_all_within_4_epochs": False,
            "stall_le_0_1": True,
            "images_per_second_vs_engine_ge_0_8": None,
        },
    }
    return line | kw


def test_the_scaling_block_shows_every_line_and_its_sweep_from_the_line(tmp_path):
    mod = _bench("report_scaling")
    assert mod.scaling_block([]).startswith("No stored `scaling` run yet")
    busy = _scaling(
        commit="busy",
        load=[40.0],
        peer_accuracy=None,
        peer_epochs_to_target=None,
        peer_seconds_to_target=None,
        seconds_vs_peer=None,
        missing=["torch: No module named 'torch' (pip install '.[bench]')"],
        epochs_to_target=None,
        seconds_to_target=None,
        accuracy=[0.95, 0.98],
        sweep=[],
    )
    block = mod.scaling_block([_scaling(), busy])
    rows = [r for r in block.splitlines() if r.startswith("| 2026-11-27")]
    assert len(rows) == 4  # two lines, then the first line's sweep of two
    first, second, r8, r1 = rows
    assert first.startswith(
        "| 2026-11-27, c, 16 CPUs, load 2.0 | 8 x 2 | 2 | 99% | 2 epochs, 12.5 s |"
    )
    assert "| 8 x 2: 3 epochs, 30 s | 0.42x the time |" in first
    assert "| 0.06 (median of 3 epochs) | 0.80x (40,000 vs 50,000 images/s) |" in first
    assert "met: the defaults reach the target, at most 0.5x DDP's seconds" in first
    assert "missed: every swept replica count within 4 epochs" in first
    assert "not measured: images/s at least 0.8x the engine's" in first
    assert second.startswith("| 2026-11-27, busy, 16 CPUs, load 40.0, no claim of speed | 8 x 2")
    assert "99% not reached in 2 epochs (last 98.00%)" in second
    assert "8 x 2: not run (torch: No module named 'torch'" in second
    # a busy line claims no goal of speed, whatever it judged
    assert "met: the defaults reach the target, every swept" not in second
    assert second.endswith(
        "not measured: images/s at least 0.8x the engine's; "
        "not claimed from a busy machine: at most 0.5x DDP's seconds |"
    )
    assert (
        "| 8 x 2 | 99% not reached in 2 epochs (last 98.50%) | 41,000 | 0.05 | 97.00, 98.50 |" in r8
    )
    assert "| 1 x 16 | 2 epochs, 40 s | 9,000 | 0.01 | 98.50, 99.12 |" in r1
    assert "from the 2 stored `scaling` lines with a sweep" in block
    series = mod.scaling_series(_scaling())
    assert series["ours"] == {
        "replicas": [1, 8],
        "images_per_second": [9000.0, 41000.0],
        "epochs_to_target": [2, None],
    }
    assert series["ddp"]["replicas"] == [8] and series["defaults"]["epochs_to_target"] == [2]
    assert "ddp" not in mod.scaling_series(busy)
    plot = _bench("plot_scaling")
    labels = plot.plot([_scaling(), busy], tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels[0] == "ours, --trainers R (2026-11-27, c, 16 CPUs; target missed at R = 8)"
    assert "PyTorch DDP (2026-11-27, c, 16 CPUs)" in labels
    with pytest.raises(SystemExit, match="no scaling line"):
        plot.plot([], tmp_path / "none.png")


def test_the_scaling_benchmark_judges_its_goals_from_its_line():
    mod = _bench("scaling")
    goals = mod.goals(_scaling())
    assert goals == {
        "defaults_reach_target": True,
        "seconds_vs_peer_le_0_5": True,
        "sweep_all_within_4_epochs": False,
        "stall_le_0_1": True,
        "images_per_second_vs_engine_ge_0_8": True,
    }
    bare = mod.goals({"accuracy": [0.9], "epochs_to_target": None, "stall_fraction": [0.3]})
    assert bare == {
        "defaults_reach_target": False,
        "seconds_vs_peer_le_0_5": None,
        "sweep_all_within_4_epochs": None,
        "stall_le_0_1": False,
        "images_per_second_vs_engine_ge_0_8": None,
    }
    assert mod.parse_sweep("") == [] and mod.parse_sweep("1, 2,8") == [1, 2, 8]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings (outside code blocks)."""
    out, fenced = set(), False
    for ln in page.read_text().splitlines():
        fenced ^= ln.startswith("```")
        if not fenced and re.match(r"#+ ", ln):
            out.add(re.sub(r"[^\w\- ]", "", ln.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """The README links the pages its content moved to (docs/), and they link back: every
    relative link names a file that exists, and every #anchor a heading of it."""
    pages = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
    bad = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and anchor not in _anchors(target)):
                bad.append(f"{page.relative_to(ROOT)}: {link}")
    assert bad == []
