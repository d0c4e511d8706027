"""Batch job: reprocess a raw dataset in object storage into a Zarr dataset store, on a cluster.

    python pipelines/reprocess.py s3://raw/mnist s3://curated/mnist.zarr \\
        [--augmented-epochs 10 [--augmented s3://curated/mnist-augmented]] \\
        [--scheduler ADDRESS | --gateway URL] [--storage-options JSON] [--overwrite]

1. **The dataset.** SRC (MNIST-style IDX files or class folders, any fsspec URL) is ingested
   into the dataset store DEST by :func:`adam_dask.data.ingest.ingest`, its blocks written by
   Dask tasks on the cluster.
2. **Augmented epochs** (``--augmented-epochs N``). For each epoch ``e < N``, DEST's train
   split distorted by the ``adam.augment`` settings (draws fixed by the seed, the epoch and the
   image's index) is written as a dataset store of its own, ``AUG/epoch-NNNN`` (train split
   only, the same chunking and codecs as DEST), so later runs can read it instead of augmenting
   again. AUG defaults to DEST's URL with ``-augmented`` in place of ``.zarr``.

Run it again after a crash and it continues where it stopped; it never leaves a store that
looks complete but is not:

* A complete DEST (every split marked complete, the root's ``splits`` written last by ingest)
  made from SRC is kept. A store left by an interrupted ingest is removed and ingested again.
  A dataset from another source, or anything else at DEST, is refused unless ``--overwrite``.
* An augmented epoch is written in blocks of whole storage shards; each block task leaves a
  marker under ``AUG/_progress/`` after its data, so a rerun writes only the blocks without
  one. The epoch's split is marked complete (with its sha256) after all of them, and
  ``AUG/augmented.json``, listing the finished epochs, is written last.
* The settings the epochs are made with (DEST's sha256, the augment ranges, the seed, the block
  size) are kept in ``AUG/_progress/plan.json``; a rerun with other settings is refused unless
  ``--overwrite``, which makes DEST and every epoch again.

Without ``--scheduler``/``--gateway`` it runs on the embedded cluster. The last line on stdout
is one JSON object (``dest``, ``dataset``, ``augmented``, ``seconds``); exit statuses are
:mod:`adam_dask.jobs`' (0 done, 1 unforeseen failure, 2 an error with its ``error:`` line, 130,
143). Credentials (``--storage-options``, the AWS variables) never appear in the output.
"""

from __future__ import annotations

import argparse
import json
import logging
import posixpath
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from adam_dask import config
from adam_dask.jobs import (
    ArgumentParser,
    Redactor,
    json_object,
    positive_int,
    run_job,
    setup_logging,
    size,
)

logger = logging.getLogger("pipelines.reprocess")

__all__ = ["build_parser", "main", "reprocess"]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pipelines/reprocess.py", description=__doc__.splitlines()[0])
    p.add_argument("src", help="raw dataset: IDX files or class folders (any fsspec URL)")
    p.add_argument("dest", help="the dataset store to write (any fsspec URL)")
    p.add_argument(
        "--augmented-epochs",
        type=positive_int,
        default=None,
        metavar="N",
        help="also write N pre-augmented epochs of the train split (adam.augment settings)",
    )
    p.add_argument("--augmented", metavar="URL", default=None, help="where the epochs go")
    p.add_argument("--seed", type=int, default=None, help="augmentation seed (adam.train.seed)")
    p.add_argument("--overwrite", action="store_true", help="make DEST and the epochs again")
    p.add_argument("--num-classes", type=positive_int, default=None)
    p.add_argument("--on-bad-image", choices=("fail", "skip"), default=None)
    p.add_argument("--image-size", type=size, default=None, metavar="HxW")
    p.add_argument("--image-mode", choices=("L", "RGB"), default=None)
    p.add_argument("--storage-options", type=json_object, default=None, metavar="JSON")
    p.add_argument("--dest-storage-options", type=json_object, default=None, metavar="JSON")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS")
    where.add_argument("--gateway", metavar="URL")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


# -- the dataset ---------------------------------------------------------------------------------


def _dataset_state(src: str, dest: str, so: dict | None) -> tuple[str, dict]:
    """What is at ``dest``: ``absent``, ``complete`` (from ``src``), ``partial`` (an
    interrupted ingest), ``other-source`` or ``foreign``; with details for the result."""
    import zarr

    from adam_dask.data.datasets import open_split
    from adam_dask.errors import DatasetError
    from adam_dask.storage import describe_storage_error, filesystem, normalize_url, zarr_store

    fs, path = filesystem(dest, so)
    try:
        if not fs.exists(path) or (fs.isdir(path) and not fs.ls(path)):
            return "absent", {}
    except Exception as exc:  # botocore's connection errors are not OSErrors
        raise describe_storage_error(dest, exc) from exc
    try:
        attrs: dict[str, Any] = dict(
            zarr.open_group(store=zarr_store(dest, so), mode="r", zarr_format=3).attrs
        )
    except Exception:
        return "foreign", {}
    if "splits" not in attrs:  # ingest creates the root with it
        return "foreign", {}
    if not attrs["splits"]:  # written last by ingest
        return "partial", {}
    try:
        splits = {name: open_split(dest, name, so) for name in attrs["splits"]}
    except DatasetError:
        return "partial", {}
    sources = {name: str(s.attrs.get("source")) for name, s in splits.items()}
    base = normalize_url(src)
    if src != "mnist" and not all(v == base or v.startswith(base + "/") for v in sources.values()):
        return "other-source", {"sources": sources}
    return "complete", {
        "images": sum(len(s) for s in splits.values()),
        "sha256": {name: s.attrs.get("sha256") for name, s in splits.items()},
    }


def _dataset(args: argparse.Namespace, client: Any, say: Callable[[str], None]) -> dict:
    from adam_dask.data.ingest import ingest
    from adam_dask.errors import DestinationExistsError

    dso = _dest_options(args)
    state, detail = _dataset_state(args.src, args.dest, dso)
    if state == "complete" and not args.overwrite:
        say(f"{args.dest} is complete: kept")
        return {"ingested": False, **detail}
    if state == "other-source" and not args.overwrite:
        first = next(iter(detail["sources"].values()))
        raise DestinationExistsError(
            f"{args.dest} holds a dataset made from {first}, not from {args.src}",
            "pass --overwrite to replace it, or choose another DEST",
        )
    if state == "foreign" and not args.overwrite:
        raise DestinationExistsError(
            f"{args.dest} exists and is not a dataset store",
            "pass --overwrite to replace it, or choose another DEST",
        )
    if state == "partial" and not args.overwrite:
        say(f"{args.dest} was left by an interrupted ingest: ingesting again")
    summary = ingest(
        args.src,
        args.dest,
        client=client,
        overwrite=state != "absent",
        storage_options=args.storage_options,
        dest_storage_options=dso,
        num_classes=args.num_classes,
        on_bad_image=args.on_bad_image,
        image_size=args.image_size,
        image_mode=args.image_mode,
    )
    return {"ingested": True, "images": summary["images"], "sha256": summary["sha256"]}


# -- augmented epochs -------------------------------------------------------------------------


def _augment_block(
    source: str,
    so: dict | None,
    epoch_url: str,
    marker: str,
    start: int,
    stop: int,
    augment: Any,
    seed: int,
    epoch: int,
) -> int:
    """Task: augment images ``[start:stop)`` of ``source``'s train split for ``epoch`` and write
    them (whole storage shards) into the epoch's store; then leave the block's marker."""
    import numpy as np
    import zarr

    from adam_dask.data.datasets import open_split
    from adam_dask.storage import filesystem, zarr_store

    images, labels = open_split(source, "train", so).read(start, stop)
    x = augment.apply(images, np.arange(start, stop), seed=seed, epoch=epoch)  # (B, C, H, W)
    out = np.rint(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    if images.ndim == 3:
        out = out[..., 0]
    g: Any = zarr.open_group(store=zarr_store(epoch_url, so, read_only=False), mode="r+")["train"]
    g["images"][start:stop] = out
    g["labels"][start:stop] = labels
    fs, path = filesystem(marker, so)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, b"")  # after the data: a marker means its block is written
    return stop - start


def _finish_epoch(epoch_url: str, so: dict | None, step: int) -> str:
    """Task: hash the epoch's images, mark its split complete, then list it in the root."""
    import hashlib

    import numpy as np
    import zarr

    from adam_dask.storage import zarr_store

    root = zarr.open_group(store=zarr_store(epoch_url, so, read_only=False), mode="r+")
    g: Any = root["train"]
    images = g["images"]
    h = hashlib.sha256()
    for i in range(0, images.shape[0], step):
        h.update(np.ascontiguousarray(images[i : i + step]).data)
    g.attrs.update({"sha256": h.hexdigest(), "complete": True})
    root.attrs["splits"] = ["train"]  # written last: the epoch's store is complete
    return h.hexdigest()


def _create_epoch_store(epoch_url: str, so: dict | None, split: Any, attrs: dict) -> None:
    """The epoch's store with empty arrays laid out like ``split``'s (chunks, shards, codecs)."""
    import zarr

    from adam_dask.storage import zarr_store

    root_attrs = dict(
        zarr.open_group(store=zarr_store(split.url, so), mode="r", zarr_format=3).attrs
    )
    root = zarr.open_group(
        store=zarr_store(epoch_url, so, read_only=False),
        mode="w",
        zarr_format=3,
        attributes={**root_attrs, "splits": []},
    )
    g = root.create_group("train", attributes={**attrs, "complete": False})
    for name, a in (("images", split.images), ("labels", split.labels)):
        g.create_array(
            name,
            shape=a.shape,
            dtype=a.dtype,
            chunks=a.chunks,
            shards=a.shards,
            compressors=a.compressors,
            dimension_names=a.metadata.dimension_names,
            fill_value=a.fill_value,
        )


def _epoch_state(epoch_url: str, so: dict | None) -> str:
    """``complete``, ``started`` (its arrays exist) or ``absent``."""
    import zarr

    from adam_dask.data.datasets import open_split
    from adam_dask.errors import DatasetError
    from adam_dask.storage import zarr_store

    try:
        open_split(epoch_url, "train", so)
        return "complete"
    except DatasetError:
        pass
    try:
        g: Any = zarr.open_group(store=zarr_store(epoch_url, so), mode="r", zarr_format=3)["train"]
        g["images"], g["labels"]
    except Exception:
        return "absent"
    return "started"


def _read_json(fs: Any, path: str) -> Any:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def _augmented_url(args: argparse.Namespace) -> str:
    from adam_dask.storage import normalize_url

    if args.augmented:
        return normalize_url(args.augmented)
    dest = normalize_url(args.dest)
    return (dest[: -len(".zarr")] if dest.endswith(".zarr") else dest) + "-augmented"


def _augmented(args: argparse.Namespace, client: Any, say: Callable[[str], None]) -> dict:
    from distributed import as_completed

    from adam_dask.data.augment import Augment
    from adam_dask.data.datasets import open_split
    from adam_dask.errors import ConfigError, DestinationExistsError
    from adam_dask.storage import filesystem, normalize_url

    so = _dest_options(args)
    augment = Augment.from_config()
    if augment.is_identity:
        raise ConfigError(
            "the adam.augment settings are the identity: the epochs would be copies of DEST",
            "set adam.augment.rotation, translation, ... (e.g. DASK_ADAM__AUGMENT__ROTATION=10)",
        )
    seed = int(config.get("train.seed", args.seed))
    source = open_split(args.dest, "train", so)
    step = int(source.images.shards[0] if source.images.shards else source.images.chunks[0])
    block = max(step, int(config.get("data.ingest-block-images")) // step * step)
    url = _augmented_url(args)
    fs, root = filesystem(url, so)
    progress = posixpath.join(root, "_progress")
    plan = {
        "source": normalize_url(args.dest),
        "source_sha256": source.attrs.get("sha256"),
        "augment": asdict(augment),
        "seed": seed,
        "block_images": block,
    }
    old = _read_json(fs, posixpath.join(progress, "plan.json"))
    there = fs.exists(root) and bool(fs.ls(root))
    if there and (args.overwrite or (old is not None and old != plan)):
        if not args.overwrite:
            changed = sorted(k for k in plan if plan[k] != old.get(k))
            raise DestinationExistsError(
                f"the augmented epochs at {url} were made with other settings ({', '.join(changed)})",
                "pass --overwrite to make them again, or choose another --augmented URL",
            )
        fs.rm(root, recursive=True)
        there = False
    elif there and old is None:
        raise DestinationExistsError(
            f"{url} exists but holds no augmented epochs of this pipeline",
            "pass --overwrite to replace it, or choose another --augmented URL",
        )
    if not there or old is None:
        fs.makedirs(progress, exist_ok=True)
        fs.pipe_file(posixpath.join(progress, "plan.json"), json.dumps(plan).encode())

    n, epochs = len(source), int(args.augmented_epochs)
    starts = list(range(0, n, block))
    futures, finished, skipped = [], [], 0
    todo_epochs = []
    for e in range(epochs):
        epoch_url = f"{url}/epoch-{e:04d}"
        markers = posixpath.join(progress, f"epoch-{e:04d}")
        state = _epoch_state(epoch_url, so)
        if state == "complete":
            finished.append(e)
            skipped += len(starts)
            continue
        if state == "absent":  # no block can be written yet: any marker is stale
            if fs.exists(markers):
                fs.rm(markers, recursive=True)
            attrs = {
                "classes": source.classes,
                "source": f"{normalize_url(args.dest)}/train",
                "augment": asdict(augment),
                "seed": seed,
                "epoch": e,
            }
            if "image_mode" in source.attrs:
                attrs["image_mode"] = source.attrs["image_mode"]
            _create_epoch_store(epoch_url, so, source, attrs)
        done = {
            posixpath.basename(p)
            for p in (fs.ls(markers, detail=False) if fs.exists(markers) else [])
        }
        todo_epochs.append((e, epoch_url))
        for start in starts:
            name = f"block-{start:012d}"
            if name in done:
                skipped += 1
                continue
            futures.append(
                client.submit(
                    _augment_block,
                    normalize_url(args.dest),
                    so,
                    epoch_url,
                    f"{url}/_progress/epoch-{e:04d}/{name}",
                    start,
                    min(start + block, n),
                    augment,
                    seed,
                    e,
                    pure=False,
                )
            )
    say(f"augmented epochs at {url}: {len(futures)} blocks to write, {skipped} already written")
    try:
        for fut in as_completed(futures):
            fut.result()  # a failed block raises here; its marker is not written
        finishing = [client.submit(_finish_epoch, u, so, step, pure=False) for _, u in todo_epochs]
        client.gather(finishing)
    finally:
        for f in futures:
            f.cancel()
    finished = sorted(finished + [e for e, _ in todo_epochs])
    listed = _read_json(fs, posixpath.join(root, "augmented.json")) or {}
    every = sorted(set(listed.get("epochs", [])) | set(finished))
    fs.pipe_file(
        posixpath.join(root, "augmented.json"),
        json.dumps({"epochs": every, "plan": plan}).encode(),
    )  # written last
    return {
        "url": url,
        "epochs": every,
        "blocks_written": len(futures),
        "blocks_skipped": skipped,
    }


# -- the job ------------------------------------------------------------------------------------


def _dest_options(args: argparse.Namespace) -> dict | None:
    return args.storage_options if args.dest_storage_options is None else args.dest_storage_options


def reprocess(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the job for ``args`` (see the module docstring); returns the JSON result."""
    from adam_dask.cluster import client_for, dashboard_link

    t0 = time.perf_counter()
    client = client_for(args.scheduler, args.gateway, roles=False)
    assert client is not None  # the embedded cluster is the default
    link = dashboard_link(client)
    if link:
        say(f"dashboard: {link}")
    try:
        dataset = _dataset(args, client, say)
        augmented = _augmented(args, client, say) if args.augmented_epochs else None
    finally:
        client.close()
    return {
        "src": args.src,
        "dest": args.dest,
        "dataset": dataset,
        "augmented": augmented,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns its exit status."""
    args = build_parser().parse_args(argv)
    redactor = Redactor([args.storage_options, args.dest_storage_options])
    setup_logging(args.verbose, redactor)

    def say(line: str) -> None:
        sys.stderr.write(redactor(line) + "\n")

    return run_job(lambda: reprocess(args, say), redactor, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
