"""docs/push_path.md lists the functions one push crosses (its spine, both legs), and a real
push on a small cluster crosses those: tools/push_path.py profiles every thread of one
push-and-pull by a whole replica's stage exchange and of the nodes serving it. The test fails when
the code's path changes and the document (which docs/design.md walks) was not made again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "push_path.py"


def _tool():
    spec = importlib.util.spec_from_file_location("push_path_under_test", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_documented_path_is_the_one_a_push_takes():
    tool = _tool()
    legs = tool.measure()
    measured = set(tool.spines(tool.document(legs)))
    listed = set(tool.spines(tool.DOC.read_text()))
    # both legs were seen: the replica's exchange and a node applying the push
    assert "train/_stage_exchange.py:StageExchange.take" in measured
    assert "ps/protocol/shard_kernels.py:apply_all" in measured
    assert measured == listed, (
        f"new: {sorted(measured - listed)}, gone: {sorted(listed - measured)}; "
        "run python tools/push_path.py --write and walk the change in docs/design.md"
    )
