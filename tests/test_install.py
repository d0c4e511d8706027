"""The README's two set-up commands: the first installs what the main job needs and nothing of
the test stack, and that job runs without it; the second installs the test stack and runs the
tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from adam_dask.testing import synthetic_store

ROOT = Path(__file__).parents[1]
# what the tests, the notebooks and the optional engine need, and the main job does not
NOT_FOR_THE_JOB = {
    "torch", "pytest", "pytest-timeout", "ruff", "mypy", "moto", "hypothesis", "nbclient",
    "nbformat", "ipykernel", "ipywidgets", "jupyter", "dask-gateway-server", "dask-kubernetes",
    "jsonschema", "matplotlib",
}  # fmt: skip
# their import names, refused in every process of the job (the cluster's workers included)
BLOCKED = ["torch", "pytest", "moto", "hypothesis", "nbclient", "nbformat", "ipykernel",
           "ipywidgets", "IPython", "jupyter_client", "dask_gateway", "dask_gateway_server",
           "dask_kubernetes", "jsonschema", "matplotlib", "mypy", "ruff"]  # fmt: skip


def setup_commands() -> list[str]:
    """The README's set-up commands (the bash block under "Set-up: two commands")."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up: two commands", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_command_1_installs_the_job_without_the_test_stack():
    first, second = setup_commands()
    install = re.match(r'pip install "?\.(\[(?P<extras>[\w,-]+)\])?"?( |$)', first)
    assert install, first
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in (install["extras"] or "").split(","):
        if extra:
            wanted += project["optional-dependencies"][extra]
    assert requirement_names(wanted) & NOT_FOR_THE_JOB == set(), first
    assert "adam-dask ingest" in first and "adam-dask train" in first
    # the second command installs the test stack, then runs the tests
    assert second.strip() == "bash tools/test"
    script = (ROOT / "tools" / "test").read_text()
    code = [line.strip() for line in script.splitlines() if not line.strip().startswith("#")]
    install = [i for i, line in enumerate(code) if re.search(r"pip install .*\.\[test\]", line)]
    run = [i for i, line in enumerate(code) if "-m pytest" in line]
    assert install, "tools/test does not install the test stack"
    assert run and install[0] < run[0]


def test_the_main_job_runs_without_the_test_stack(tmp_path):
    """``adam-dask ingest`` and ``adam-dask train`` with every package of the test stack (and
    torch, matplotlib) made unimportable in the command's process and its cluster's workers."""
    store = synthetic_store(tmp_path / "data", n_train=512, n_test=128)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {BLOCKED!r}\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'{name} is not installed (test_install)', name=name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(ROOT), env.get("PYTHONPATH", "")])
    env["DASK_ADAM__TRAIN__RUNS_DIR"] = str(tmp_path / "runs")
    cmd = [sys.executable, "-m", "adam_dask.cli"]
    proc = subprocess.run(
        [*cmd, "ingest", str(Path(store).parent / "src"), str(tmp_path / "again.zarr")],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env
    )
    assert "is not installed (test_install)" in probe.stderr  # the hook is in force
    proc = subprocess.run(
        [*cmd, "train", "--data", store, "--model", "conv5x5:6,maxpool2,fc32,fc10"]
        + ["--epochs", "1", "--push-every", "64", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.3, result
    assert "is not installed (test_install)" not in proc.stderr, proc.stderr[-3000:]
