"""adam_dask._secrets: what a credential looks like in URLs, storage options and text, and the
redaction of every log record of a process."""

from __future__ import annotations

import io
import logging

import pytest

from adam_dask import _secrets
from adam_dask._secrets import Redactor, redact_options, redact_url, redact_urls, scrub

S = "SENTINEL-c0ffee42"


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://bucket/d.zarr", "s3://bucket/d.zarr"),
        ("/data/d.zarr", "/data/d.zarr"),
        (f"https://bob:{S}@example.org/d.zarr", "https://***@example.org/d.zarr"),
        (f"https://{S}@example.org/d", "https://***@example.org/d"),
        (
            f"https://b.s3.amazonaws.com/k?X-Amz-Credential={S}&X-Amz-Signature={S}&part=2",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&part=2",
        ),
        (
            f"https://acct.blob.core.windows.net/c/d?sv=2022&sig={S}",
            "https://acct.blob.core.windows.net/c/d?sv=2022&sig=***",
        ),
        (f"gs://b/d?token={S}#frag", "gs://b/d?token=***#frag"),
        (
            f"http://h/x?X-Amz-Security-Token={S}&key={S}",
            "http://h/x?X-Amz-Security-Token=***&key=***",
        ),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_options_blanks_credentials_at_any_depth():
    opts = {
        "key": S,
        "secret": S,
        "token": S,
        "anon": False,
        "endpoint_url": f"http://u:{S}@127.0.0.1:9",
        "client_kwargs": {"aws_session_token": S, "region_name": "us-east-1"},
        "config_kwargs": {"signature_version": "s3v4"},
        "credentials": {"private_key": S, "client_email": "me@example.org"},
    }
    shown = redact_options(opts)
    assert S not in repr(shown)
    assert shown["client_kwargs"]["region_name"] == "us-east-1"
    assert shown["config_kwargs"] == {"signature_version": "s3v4"}
    assert shown["anon"] is False and shown["endpoint_url"] == "http://***@127.0.0.1:9"
    assert opts["key"] == S  # a copy


def test_redactor_text_known_values_pairs_and_environment():
    r = Redactor([{"client_kwargs": {"aws_secret_access_key": f"{S}-a"}}], environ={})
    assert r(f"failed with {S}-a") == "failed with ***"
    # a dict's repr, botocore's headers, JSON: the values of credential names
    text = f"{{'token': 'abc', 'key': 'x-1', 'X-Amz-Security-Token': b'{S}-t'}}"
    assert r(text) == "{'token': '***', 'key': 'x-1', 'X-Amz-Security-Token': b'***'}"
    assert r('{"password": "hunter22", "user": "bob"}') == '{"password": "***", "user": "bob"}'
    assert r(f"Authorization: AWS4-HMAC-SHA256 Credential={S}-id/2026") == (
        "Authorization: AWS4-HMAC-SHA256 Credential=***/2026"
    )
    env = {"AWS_SECRET_ACCESS_KEY": f"{S}-env"}
    assert Redactor(environ=env)(f"x {S}-env y") == "x *** y"
    assert Redactor(environ={})("short ab and key words stay") == "short ab and key words stay"


def test_stored_documents_keep_everything_but_url_credentials():
    doc = {
        "meta": {"data": f"https://u:{S}@h/d.zarr", "spec": "fc10", "key": "kept"},
        "storage_options": {"secret": S, "anon": False},
        "blocks": ["shards/0/g0-v1"],
    }
    assert redact_urls(doc) == {
        "meta": {"data": "https://***@h/d.zarr", "spec": "fc10", "key": "kept"},
        "storage_options": {"secret": "***", "anon": False},
        "blocks": ["shards/0/g0-v1"],
    }
    r = Redactor([{"secret": S}], environ={})
    assert scrub({"a": [f"x{S}", 1, None], "b": {"c": S}}, r) == {
        "a": ["x***", 1, None],
        "b": {"c": "***"},
    }


def test_every_record_of_the_process_is_redacted_whatever_its_handler():
    """After install(), a handler added later (as Dask's, botocore's or a notebook's are) shows
    no known secret: not in the message, its arguments, nor an exception's traceback."""
    _secrets.remember({"secret": f"{S}-remembered"})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("adam_dask.tests.secrets")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        log.debug("options %s", {"secret": "wJal-x", "endpoint_url": "http://h", "key": "k1"})
        log.warning("request signed with %s-remembered", S)
        try:
            raise OSError(f"denied for {S}-remembered")
        except OSError:
            log.exception("write failed at %s", f"https://u:{S}-pw@h/x")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert S not in text and "wJal-x" not in text, text
    assert "denied for ***" in text and "Traceback" in text and "https://***@h/x" in text
    # what is not a credential stays; a bare "key" in text is Dask's task key
    assert "'endpoint_url': 'http://h', 'key': 'k1'" in text


def test_errors_show_urls_without_credentials(tmp_path):
    from adam_dask.data.datasets import open_split
    from adam_dask.errors import AdamError
    from adam_dask.ps.checkpoint import read_manifest

    with pytest.raises((AdamError, OSError)) as e:
        open_split(f"http://bob:{S}@127.0.0.1:9/d.zarr?token={S}", "train")
    assert S not in str(e.value) and "http://***@127.0.0.1:9/d.zarr" in str(e.value)
    with pytest.raises(AdamError) as e:
        read_manifest(f"http://bob:{S}@127.0.0.1:9/ckpt")
    assert S not in str(e.value) and "***@127.0.0.1:9" in str(e.value)


def _log_on_worker(text: str) -> str:
    """What a handler of this worker process shows for a warning saying ``text``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("adam_dask.tests.secrets.worker")
    log.addHandler(handler)
    try:
        log.warning("%s", text)
    finally:
        log.removeHandler(handler)
    return stream.getvalue()


def test_workers_of_any_cluster_redact_their_logs(local_client):
    """A plain LocalCluster has no preload of ours: the worker plugin a parameter server
    registers makes its workers redact, with the AWS variables they inherited too."""
    from adam_dask._worker_preload import RedactLogs

    local_client.register_plugin(RedactLogs())
    shown = local_client.run(_log_on_worker, f"task args {{'secret': '{S}', 'anon': False}}")
    assert shown and all(S not in t and "'secret': '***'" in t for t in shown.values()), shown


def _library_warning_as_shown(text: str) -> list[str]:
    """The lines this worker's handlers of the library's logger write for a warning."""
    lib = logging.getLogger("adam_dask")
    handlers = [h for h in lib.handlers if isinstance(h, logging.StreamHandler)]
    record = logging.getLogger("adam_dask.tests.stamp").makeRecord(
        "adam_dask.tests.stamp", logging.WARNING, __file__, 1, "%s", (text,), None
    )
    return [h.format(record) for h in handlers]


def test_workers_show_the_librarys_records_with_time_and_logger(local_client):
    """A worker shows the library's warnings as Dask shows its own (time, logger, level), not
    as Python's bare last resort does: a stream's recovery is placed in time."""
    import re

    from adam_dask._worker_preload import RedactLogs

    local_client.register_plugin(RedactLogs())  # what a parameter server registers
    shown = local_client.run(_library_warning_as_shown, "the DataServer is lost")
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - adam_dask\.tests\.stamp - WARNING - "
    for lines in shown.values():
        assert len(lines) == 1 and re.match(stamp + "the DataServer is lost$", lines[0]), lines


FAILING_THREAD_AND_WARNING = """
import threading, warnings, sys
from adam_dask import _secrets
_secrets.remember({"secret": sys.argv[1] + "-thread"})
def fail():
    raise RuntimeError(f"cannot read https://u:{sys.argv[1]}-pw@h/x with {sys.argv[1]}-thread")
t = threading.Thread(target=fail, name="reader")
t.start()
t.join()
warnings.warn(f"slow answer from https://u:{sys.argv[1]}-pw@h/x", UserWarning)
"""


def test_what_python_prints_itself_shows_no_secret():
    """A thread's uncaught exception and a warning, printed by Python, not by logging (in a
    process of its own: pytest replaces both printers while a test runs)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_THREAD_AND_WARNING, S],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "Exception in thread reader" in err and "RuntimeError" in err, err
    assert "UserWarning: slow answer from https://***@h/x" in err, err
    assert S not in err, err
