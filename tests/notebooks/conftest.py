"""Run a notebook top to bottom in a real Jupyter kernel and keep every message it sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@dataclass
class Run:
    """An executed notebook and its kernel's iopub messages, in order."""

    nb: Any
    messages: list[tuple[int, str, dict]] = field(default_factory=list)  # (cell, type, content)

    def outputs(self, cell: int | None = None) -> list[dict]:
        cells = [c for c in self.nb.cells if c.cell_type == "code"]
        if cell is not None:
            cells = [self.nb.cells[cell]]
        return [o for c in cells for o in c.get("outputs", [])]

    def text(self, cell: int | None = None) -> str:
        return "".join(
            o.get("text", "") for o in self.outputs(cell) if o["output_type"] == "stream"
        )

    def html(self) -> list[str]:
        return [o["data"]["text/html"] for o in self.outputs() if "text/html" in o.get("data", {})]

    def cell_index(self, source_start: str) -> int:
        (i,) = [i for i, c in enumerate(self.nb.cells) if c.source.startswith(source_start)]
        return i


@pytest.fixture(scope="session")
def run_notebook():
    """``run_notebook(name) -> Run``: executes ``notebooks/<name>`` in the ``python3`` kernel
    (cwd: ``notebooks/``, the test's environment); a failing cell fails the test."""
    import nbclient
    import nbformat

    class Recording(nbclient.NotebookClient):
        def process_message(self, msg, cell, cell_index):
            self.recorded.append((cell_index, msg["msg_type"], msg["content"]))
            return super().process_message(msg, cell, cell_index)

    def run(name: str, timeout: int = 600) -> Run:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
            f"{name} is saved with outputs; clear them"
        )
        client = Recording(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        )
        client.recorded = []
        client.execute()  # raises CellExecutionError on any failing cell
        return Run(nb, client.recorded)

    return run
