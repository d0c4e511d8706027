"""The communicator thread a replica's stages exchange through: items sent in order, at most one
waiting behind the one in flight, the first error kept and every later item dropped."""

from __future__ import annotations

import threading

import pytest

from adam_dask.train._communicator import Communicator


def test_items_are_sent_in_order_and_close_sends_what_was_put():
    sent: list[int] = []
    comm: Communicator[int] = Communicator(sent.append, name="t", on_error=pytest.fail)
    for i in range(50):
        comm.put(i)
    comm.close()
    assert sent == list(range(50)) and comm.error is None
    comm.close()  # a second close does nothing


def test_a_put_waits_while_one_item_waits_behind_the_one_in_flight():
    release = threading.Event()
    started = threading.Event()

    def send(item: int) -> None:
        started.set()
        release.wait(10)

    comm: Communicator[int] = Communicator(send, name="t", on_error=pytest.fail)
    comm.put(0)
    assert started.wait(10)  # item 0 in flight
    comm.put(1)  # waits in the queue
    third = threading.Thread(target=comm.put, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # blocked: one item already waits
    release.set()
    third.join(10)
    assert not third.is_alive()
    comm.close()


def test_the_first_error_is_kept_and_reported_and_later_items_are_dropped_unsent():
    sent: list[int] = []
    dropped: list[int] = []
    errors: list[BaseException] = []

    def send(item: int) -> None:
        if item == 3:
            raise ValueError("boom")
        sent.append(item)

    comm: Communicator[int] = Communicator(
        send, name="t", on_error=errors.append, drop=dropped.append
    )
    for i in range(8):
        comm.put(i)
    comm.close()
    assert sent == [0, 1, 2] and dropped == [4, 5, 6, 7]
    assert isinstance(comm.error, ValueError) and errors == [comm.error]
