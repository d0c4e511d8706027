"""A fit that stalls in a test says where: :func:`adam_dask.testing.join_fit` reports the stack of
every thread here and on each worker."""

from __future__ import annotations

import threading
import time

import pytest

from adam_dask.testing import join_fit, thread_stacks


def _parked_in_a_recognisable_wait(seconds: float) -> None:
    time.sleep(seconds)


def test_a_fit_still_running_fails_with_every_threads_stack(local_client):
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, name="a-stalled-fit", daemon=True)
    th.start()
    running = local_client.submit(_parked_in_a_recognisable_wait, 30, pure=False)
    try:
        deadline = time.monotonic() + 30
        while not any(local_client.processing().values()):
            assert time.monotonic() < deadline, "the task did not start"
            time.sleep(0.05)
        with pytest.raises(AssertionError) as info:
            join_fit(th, local_client, 0.2)
        report = str(info.value)
        assert "did not end within 0.2 s" in report
        assert "--- thread a-stalled-fit" in report  # this process's threads
        for addr in local_client.scheduler_info()["workers"]:
            assert f"=== worker {addr}" in report
        assert "_parked_in_a_recognisable_wait" in report  # where the worker's task waits
    finally:
        stop.set()
        running.cancel()


def test_a_fit_that_ended_passes(local_client):
    th = threading.Thread(target=lambda: None)
    th.start()
    join_fit(th, local_client, 10)  # no AssertionError
    assert "=== this process" in thread_stacks(local_client)
