"""The notebook habit: a fit interrupted mid-epoch by the kernel's stop button (a real Jupyter
kernel, ``KernelManager.interrupt_kernel``), then run again in the same kernel. The interrupted
replicas stop before ``fit`` raises, so nothing reaches the parameter server between the
interrupt and the second ``fit``, and the second ``fit`` applies every image of its epochs."""

from __future__ import annotations

import json
import time

import pytest

from adam_dask.testing import synthetic_store

# beside three busy processes per core (tests/conftest.py): noisy neighbours, the bounds
# those of a quiet machine
pytestmark = pytest.mark.usefixtures("busy_load")

N_TRAIN = 768

SETUP = """
import json, adam_dask
from adam_dask.train.trainer import Trainer

client = adam_dask.cluster.local(ps_nodes=3, data_nodes=1, trainers=1, trainer_threads=1)
trainer = Trainer({store!r}, client=client, progress=False, push_every=64, batch_size=8,
                  slow_replicas={{0: 0.4}}, seed=0)
print(json.dumps({{"scheduler": client.scheduler.address}}))
"""

REFIT = """
trainer.fit(epochs=2)
print(json.dumps({"applied": trainer.history.column("images_applied"),
                  "n": len(trainer.train_split)}))
"""


def _run(kc, code: str, timeout: float = 300) -> tuple[dict, list[dict]]:
    """Execute ``code``; (the reply's content, the JSON lines it printed)."""
    msg_id = kc.execute(code)
    lines: list[dict] = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            for line in msg["content"]["text"].splitlines():
                if line.startswith("{"):
                    lines.append(json.loads(line))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    return reply["content"], lines


def _applied(client, server_id: str) -> int:
    from adam_dask.ps import ParameterServer

    return int(ParameterServer.attach(client, server_id).stats()["pushes_applied"])


@pytest.mark.slow
def test_an_interrupted_fit_leaves_no_replica_running_and_the_next_fit_is_exact(tmp_path):
    from distributed import Client
    from jupyter_client import KernelManager

    store = synthetic_store(tmp_path, n_train=N_TRAIN, n_test=128)
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    client = None
    try:
        kc.wait_for_ready(timeout=120)
        content, lines = _run(kc, SETUP.format(store=store))
        assert content["status"] == "ok", content
        client = Client(lines[0]["scheduler"])
        msg_id = kc.execute("trainer.fit(epochs=3)")
        server_id = None
        deadline = time.monotonic() + 180
        while server_id is None:  # the server exists once the first epoch started
            assert time.monotonic() < deadline, "fit never started"
            time.sleep(0.5)
            names = client.run_on_scheduler(  # the plugin, too, may not be registered yet
                lambda dask_scheduler: sorted(
                    getattr(dask_scheduler.plugins.get("adam-ps-placement"), "servers", ())
                )
            )
            server_id = names[0] if names else None
        while _applied(client, server_id) < 3:  # mid-epoch: replicas training and pushing
            assert time.monotonic() < deadline, "no pushes"
            time.sleep(0.2)
        km.interrupt_kernel()
        while True:  # fit raised KeyboardInterrupt in the kernel
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        at_return = _applied(client, server_id)
        time.sleep(4)  # longer than a replica's stop poll and a push period
        assert _applied(client, server_id) == at_return, "a replica kept pushing after fit raised"

        content, lines = _run(kc, REFIT)
        assert content["status"] == "ok", content
        got = lines[-1]  # every epoch recorded, the interrupted one continued, applied exactly
        assert len(got["applied"]) >= 2 and all(a == got["n"] for a in got["applied"]), got
    finally:
        if client is not None:
            client.close()
        kc.stop_channels()
        km.shutdown_kernel(now=True)
