"""The notebooks run top to bottom in a real Jupyter kernel (on a small synthetic store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adam_dask.testing import synthetic_store

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the [test] extra")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs the [test] extra")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def test_train_mnist_notebook(tmp_path, monkeypatch):
    store = synthetic_store(tmp_path, n_train=512, n_test=128)
    monkeypatch.setenv("ADAM_NOTEBOOK_DATA", store)
    monkeypatch.setenv("ADAM_NOTEBOOK_SPEC", "conv5x5:6,maxpool2,fc32,fc10")
    monkeypatch.setenv("ADAM_NOTEBOOK_EPOCHS", "2")
    nb = nbformat.read(NOTEBOOKS / "train_mnist.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError on any failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "restored" in text and "epochs 2" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot was drawn
