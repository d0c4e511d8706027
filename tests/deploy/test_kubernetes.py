"""Kubernetes deployment: the Dask operator manifests against the CRDs dask-kubernetes ships,
the image's and manifests' commands against the programs they run, and the dask-gateway values
on a real dask-gateway-server (local backend) training with data servers."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from adam_dask import config
from adam_dask.testing import synthetic_store

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ROLES = {"PS", "DATA", "TRAIN"}


# -- the Dask operator's manifests ---------------------------------------------------------------


def _crds() -> dict[str, dict]:
    """{kind: CRD} of the CustomResourceDefinitions the installed dask-kubernetes ships."""
    import dask_kubernetes

    base = Path(dask_kubernetes.__file__).parent / "operator"
    found = {}
    for path in base.rglob("crds/*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if doc and doc.get("kind") == "CustomResourceDefinition":
            found[doc["spec"]["names"]["kind"]] = doc
    return found


def _strict(schema: dict) -> dict:
    """The CRD's structural schema with Kubernetes' pruning turned into errors: an object that
    lists its properties (and does not preserve unknown fields) rejects any other field, as
    ``kubectl apply --validate=strict`` does, instead of dropping it silently."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        if schema.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "operator").glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _validate(doc: dict, crds: dict[str, dict]) -> None:
    import jsonschema

    crd = crds[doc["kind"]]
    group = crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    assert doc["apiVersion"] == f"{group}/{version['name']}"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema.setdefault("properties", {}).update(
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
        }
    )
    jsonschema.validate(doc, schema)


def _containers(pod_spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec["containers"]}


def _argv(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def _worker_groups(docs) -> dict[tuple[str, str], dict]:
    """{(cluster, group): worker spec} for every worker group: each DaskCluster's (and DaskJob
    cluster's) default group and every DaskWorkerGroup."""
    groups = {}
    for _, d in docs:
        name = d["metadata"]["name"]
        if d["kind"] == "DaskCluster":
            groups[(name, "default")] = d["spec"]["worker"]
        elif d["kind"] == "DaskJob":
            groups[(name, "default")] = d["spec"]["cluster"]["spec"]["worker"]
        elif d["kind"] == "DaskWorkerGroup":
            groups[(d["spec"]["cluster"], name)] = d["spec"]["worker"]
    return groups


def test_kubernetes_operator_manifests_validate_against_the_dask_kubernetes_crds():
    crds = _crds()
    assert {"DaskCluster", "DaskWorkerGroup", "DaskJob"} <= set(crds)
    docs = _documents()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds.count("DaskCluster") == 1 and kinds.count("DaskJob") == 1
    for name, doc in docs:
        try:
            _validate(doc, crds)
        except Exception as exc:
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}") from exc


def test_kubernetes_strict_validation_catches_a_misspelt_field():
    crds = _crds()
    (doc,) = [d for _, d in _documents() if d["kind"] == "DaskCluster"]
    bad = json.loads(json.dumps(doc))
    bad["spec"]["worker"]["spec"]["containers"][0]["arg"] = ["dask", "worker"]
    with pytest.raises(Exception, match="arg"):
        _validate(bad, crds)


def test_kubernetes_clusters_have_a_ps_a_data_and_a_train_worker_group():
    from distributed.cli.dask_scheduler import main as dask_scheduler
    from distributed.cli.dask_worker import main as dask_worker

    docs = _documents()
    groups = _worker_groups(docs)
    clusters = {c for c, _ in groups}
    assert len(clusters) == 2  # the DaskCluster's and the DaskJob's
    for cluster in clusters:
        roles = {}
        for (c, g), worker in groups.items():
            if c != cluster:
                continue
            (container,) = worker["spec"]["containers"]
            argv = _argv(container)
            assert argv[:2] == ["dask", "worker"], argv
            dask_worker.make_context("dask worker", argv[2:])  # the options exist
            (resources,) = _option(argv, "--resources")
            (role,) = [r.split("=")[0] for r in resources.split()]
            assert role in ROLES and resources == f"{role}=1"
            roles[role] = worker["replicas"]
        assert set(roles) == ROLES, (cluster, roles)
        assert roles["PS"] >= 3  # three copies of every shard on distinct workers
    # the schedulers preload the PS controller and the Adam page
    schedulers = [d["spec"]["scheduler"] for _, d in docs if d["kind"] == "DaskCluster"]
    schedulers += [
        d["spec"]["cluster"]["spec"]["scheduler"] for _, d in docs if d["kind"] == "DaskJob"
    ]
    for sched in schedulers:
        argv = _argv(_containers(sched["spec"])["scheduler"])
        assert argv[:2] == ["dask", "scheduler"], argv
        dask_scheduler.make_context("dask scheduler", argv[2:])
        preloads = _option(argv, "--preload")
        assert preloads == ["adam_dask.ps.placement", "adam_dask.dashboard"]
        for module in preloads:
            assert callable(importlib.import_module(module).dask_setup)


def test_kubernetes_daskjob_runs_the_training_pipeline_with_arguments_it_accepts():
    (job,) = [d for _, d in _documents() if d["kind"] == "DaskJob"]
    (container,) = job["spec"]["job"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    env["DASK_SCHEDULER_ADDRESS"] = "tcp://adam-train-scheduler:8786"  # the operator sets it
    script = " ".join(_argv(container))
    argv = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], script))
    i = argv.index("pipelines/train.py")
    assert argv[i - 1] == "python"
    spec = importlib.util.spec_from_file_location("pipeline_train", ROOT / "pipelines" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(argv[i + 1 :])
    # it first waits for every worker of the job's cluster (roles are fixed by their groups)
    waits = re.search(r"wait_for_workers\((\d+)", script)
    groups = _worker_groups(_documents())
    replicas = sum(w["replicas"] for (c, _), w in groups.items() if c == job["metadata"]["name"])
    assert waits is not None and int(waits.group(1)) == replicas
    assert args.scheduler == env["DASK_SCHEDULER_ADDRESS"]
    assert args.data.startswith("s3://") and args.checkpoint.startswith("s3://")


def test_kubernetes_image_copies_what_exists_and_installs_known_extras():
    text = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _ = line.split()
        for src in sources:
            assert (ROOT / src).exists(), src
    extras = _pyproject()["project"]["optional-dependencies"]
    for names in re.findall(r"\.\[([\w,-]+)\]", text):
        assert set(names.split(",")) <= set(extras), names


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# -- dask-gateway ------------------------------------------------------------------------------

# dask-gateway 2026.3 with distributed 2026.8: a closed Gateway raises in ``__del__`` (it reads
# ``LoopRunner.loop`` after stopping it). Objects kept here are collected at interpreter exit,
# where ``__del__`` does nothing.
_KEEP_UNTIL_EXIT: list = []


def test_kubernetes_gateway_values_embed_the_options_file_and_adam_defaults(values_python):
    values = yaml.safe_load((DEPLOY / "gateway" / "values.yaml").read_text())
    extra = values["gateway"]["extraConfig"]
    assert extra["00-adam-options"] == (DEPLOY / "gateway" / "options.py").read_text(), (
        "paste deploy/gateway/options.py into values.yaml's gateway.extraConfig.00-adam-options"
    )
    # the values' Python, as the chart runs it: every block in key order, with a config ``c``
    from traitlets.config import Config

    from adam_dask.cluster import resolve_data_nodes
    from adam_dask.sizing import size_trainers

    c = Config()
    exec(compile(values_python, "values.yaml", "exec"), {"c": c})
    assert list(c.ClusterConfig.scheduler_cmd) == [
        "dask",
        "scheduler",
        "--preload",
        "adam_dask.ps.placement",
        "--preload",
        "adam_dask.dashboard",
    ]
    opts = c.Backend.cluster_options
    defaults = {f["field"]: f["default"] for f in opts.get_specification()}
    trainers, threads = size_trainers(4)  # adam.yaml's "auto" for 4 cores of TRAIN workers
    worker_memory = defaults.pop("worker_memory")
    assert defaults == {
        "ps_nodes": config.get("cluster.ps-nodes"),
        # adam.yaml's "auto" for those replicas
        "data_nodes": resolve_data_nodes(config.get("cluster.data-nodes"), trainers, threads),
        "trainers": trainers,
        "worker_cores": threads,
    }
    assert 1 <= worker_memory <= 64
    out = opts.get_configuration(opts.parse_options({"trainers": 4, "worker_memory": 2}), None)
    assert out["cluster_max_workers"] == 3 + 1 + 4 and out["worker_memory"] == 2 * 2**30
    assert out["environment"]["DASK_ADAM__CLUSTER__TRAINERS"] == "4"
    with pytest.raises(ValueError, match="ps_nodes"):
        opts.parse_options({"ps_nodes": 0})


@pytest.mark.slow
def test_kubernetes_gateway_cluster_trains_with_data_servers(gateway, tmp_path):
    """A cluster from the gateway with the values' options: 3 PS + 1 DATA + 1 TRAIN workers of
    1 core and 1.5 GiB; the scheduler preloaded the PS controller and the Adam page; roles
    given after start-up from the counts the options handler put in the cluster's config."""
    from dask_gateway import Gateway
    from dask_gateway.auth import BasicAuth

    url, password = gateway
    store = synthetic_store(tmp_path, n_train=512, n_test=128)
    gw = Gateway(url, auth=BasicAuth("alice", password))
    _KEEP_UNTIL_EXIT.append(gw)
    with gw:
        options = gw.cluster_options()
        options.update(ps_nodes=3, data_nodes=1, trainers=1, worker_cores=1, worker_memory=1.5)
        cluster = gw.new_cluster(options)
        _KEEP_UNTIL_EXIT.append(cluster)
        try:
            cluster.scale(5)
            with cluster.get_client() as client:
                client.wait_for_workers(5, timeout=120)
                _train_on_the_gateway_cluster(client, store, tmp_path, url)
        finally:
            cluster.shutdown()


def _train_on_the_gateway_cluster(client, store: str, tmp_path: Path, url: str) -> None:
    import adam_dask
    import adam_dask.dashboard
    from adam_dask.cluster import (
        DATA,
        PS,
        TRAIN,
        assign_roles,
        resolve_data_nodes,
        workers_with_role,
    )

    # the options reached the cluster: the role counts in the scheduler's configuration (a
    # lambda, pickled by value; "auto" DATA workers resolved as every reader resolves them),
    # each worker's threads and memory
    counts = client.run_on_scheduler(
        lambda: {
            "ps-nodes": int(config.get("cluster.ps-nodes")),
            "data-nodes": resolve_data_nodes(config.get("cluster.data-nodes"), 1, 1),
            "trainers": int(config.get("cluster.trainers")),
        }
    )
    assert counts == {"ps-nodes": 3, "data-nodes": 1, "trainers": 1}
    info = client.scheduler_info(n_workers=-1)["workers"]
    assert len(info) == 5
    assert {w["nthreads"] for w in info.values()} == {1}
    assert {w["memory_limit"] for w in info.values()} == {int(1.5 * 2**30)}
    # the values' scheduler preloads ran before any parameter server existed
    plugins = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
    assert {"adam-ps-placement", "adam-dashboard"} <= set(plugins)
    roles = assign_roles(client, ps_nodes=counts["ps-nodes"], data_nodes=counts["data-nodes"])
    assert sorted(roles.values()) == ["DATA", "PS", "PS", "PS", "TRAIN"]

    trainer = None
    try:
        trainer = adam_dask.Trainer(
            store,
            model="conv5x5:6,maxpool2,fc32,fc10",
            client=client,
            checkpoint=str(tmp_path / "ck"),
            progress=False,
            shard_bytes=16384,
        )
        history = trainer.fit(epochs=2)
        assert len(history) == 2 and history[-1]["test_accuracy"] >= 0.8
        assert (tmp_path / "ck" / "manifest.json").exists()
        # the batches came from the DataServer on the DATA worker
        served = trainer.dataservice.stats()
        assert not served["local"] and served["images_served"] >= 2 * 512
        assert set(trainer.dataservice.servers()) <= set(workers_with_role(client, DATA))
        assert {a for h in trainer.server.placement().values() for a in h} == set(
            workers_with_role(client, PS)
        )
        assert len(workers_with_role(client, TRAIN)) == 1
        # the Adam page, through the gateway's proxy
        page = adam_dask.dashboard.url(client)
        assert page is not None and page.startswith(url + "/clusters/")
        with urllib.request.urlopen(page + "/status.json", timeout=60) as r:
            status = json.loads(r.read())
        (srv,) = [s for s in status["servers"] if s["id"] == trainer.server.server_id]
        assert {int(s): h for s, h in srv["placement"].items()} == trainer.server.placement()
    finally:
        if trainer is not None:
            trainer.close()


@pytest.mark.slow
def test_kubernetes_gateway_connect_notebook(gateway, tmp_path, monkeypatch):
    """notebooks/03_connect.ipynb's gateway path in a real kernel: ``client_for(gateway=...)``
    on a cluster with the values' default options (3 PS + 1 DATA + 2 TRAIN)."""
    import nbclient
    import nbformat

    url, password = gateway
    monkeypatch.setenv("ADAM_NOTEBOOK_GATEWAY", url)
    monkeypatch.setenv("DASK_GATEWAY__AUTH__TYPE", "basic")
    monkeypatch.setenv(
        "DASK_GATEWAY__AUTH__KWARGS", json.dumps({"username": "alice", "password": password})
    )
    monkeypatch.setenv("ADAM_NOTEBOOK_DATA", synthetic_store(tmp_path, 512, 128))
    monkeypatch.setenv("ADAM_NOTEBOOK_CHECKPOINT", str(tmp_path / "ck"))
    monkeypatch.setenv("ADAM_NOTEBOOK_SPEC", "conv5x5:6,maxpool2,fc32,fc10")
    monkeypatch.setenv("ADAM_NOTEBOOK_EPOCHS", "2")
    nb = nbformat.read(ROOT / "notebooks" / "03_connect.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    roles = dict(re.findall(r"^(PS|DATA|TRAIN) +(\[.*\])$", text, re.M))
    counts = {role: addrs.count("tls://") for role, addrs in roles.items()}
    assert counts == {"PS": 3, "DATA": 1, "TRAIN": 2}  # the values' defaults, adam.yaml's
    assert re.search(rf"Adam page: {re.escape(url)}/clusters/\S+/adam", text)
    accuracies = re.findall(r"^epoch \d: loss \S+, test accuracy (\d+\.\d+)%", text, re.M)
    assert len(accuracies) == 2 and float(accuracies[-1]) >= 80
    assert (tmp_path / "ck" / "manifest.json").exists()
    # closing the client shut the gateway cluster down
    from dask_gateway import Gateway
    from dask_gateway.auth import BasicAuth

    gw = Gateway(url, auth=BasicAuth("alice", password))
    _KEEP_UNTIL_EXIT.append(gw)
    deadline = time.monotonic() + 60
    while gw.list_clusters() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert gw.list_clusters() == []
