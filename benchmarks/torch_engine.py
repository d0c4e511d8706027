"""Benchmark: the torch engine (any ``nn.Module``) on real MNIST, through the Trainer on the
embedded cluster, against a peer measured in the same run.

Two parts, one JSON line each:

* ``paper`` (``benchmarks/results/torch_engine.jsonl``): the paper's network as an ``nn.Module``
  (:class:`adam_dask.model.torch_examples.PaperNet`) on the torch engine against the same
  network spec on the numba engine: images/s and seconds to ``--target`` (default 0.99), both
  through ``Trainer.fit`` with the defaults (lr, schedule, batch size, push-every, threads) on
  one embedded cluster, one after the other (``--torch-batch-size`` gives the torch run
  another mini-batch). ``torch_over_numba_seconds`` and ``torch_over_numba_rate`` are the
  ratios.
* ``resnet`` (``benchmarks/results/torch_resnet.jsonl``): a small ResNet-style module (padding,
  a strided convolution, residual blocks with batch norm:
  :func:`~adam_dask.model.torch_examples.tiny_residual_net`) through the Trainer, against the
  same module in plain single-process PyTorch (SGD, batch 32, ``--torch-lr`` decayed
  ``--torch-lr-decay`` per epoch, all the machine's cores as intra-op threads): seconds to
  ``--target`` (default 0.98) from the start of training, evaluated after each epoch by both.
  Ours runs the Trainer's defaults except the peer's recipe: ``--batch-size`` 32 (a PyTorch
  step has a fixed cost that 8 images do not amortize), ``lr`` = ``--torch-lr`` and an
  exponential schedule with ``lr_floor = --torch-lr-decay ** planned epochs`` (the same
  per-epoch decay as the peer's).
  ``ours_over_torch`` is the ratio of those seconds.

Wall seconds on a shared machine are noisy: ``load`` (1-minute load averages before and after)
says how to read them. Every run is stored.

    nice python benchmarks/torch_engine.py paper [--target 0.99] [--epochs 10] [--no-save]
    nice python benchmarks/torch_engine.py resnet [--target 0.98] [--epochs 4] [--no-save]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PAPER = "adam_dask.model.torch_examples:paper_net"
RESNET = "adam_dask.model.torch_examples:tiny_residual_net"


def trainer_run(store: str, client, model: str, target: float, epochs: int, **kw) -> dict:
    """``Trainer(store, model=model, **kw).fit(epochs, target_accuracy=target)`` on ``client``:
    seconds to the target from the start of ``fit``, the curve, and images/s (trained images
    over the epochs' training seconds)."""
    from adam_dask.train import Trainer

    t = Trainer(store, model=model, client=client, checkpoint=False, progress=False, **kw)
    try:
        t0 = time.perf_counter()
        h = t.fit(epochs=epochs, target_accuracy=target)
        wall = time.perf_counter() - t0
    finally:
        t.close()
    images = sum(r["images"] for r in h.records)
    seconds = sum(r["seconds"] for r in h.records)
    return {
        "seconds_to_target": t.seconds_to_target,
        "seconds": wall,
        "epochs": len(h.records),
        "curve": [round(r["test_accuracy"], 4) for r in h.records],
        "images_per_second": images / seconds if seconds else None,
        "replicas": h.records[-1]["replicas"] if h.records else None,
        "parameters": t.net.layout.size,
    }


def torch_fit(xtr, ytr, xte, yte, *, factory: str, target, epochs, threads, lr, lr_decay) -> dict:
    """The module of ``factory`` (seed 0) in plain PyTorch: SGD, batch 32, ``lr * lr_decay **
    epoch``, ``threads`` intra-op threads, evaluated (eval mode) after each epoch until test
    accuracy >= ``target``."""
    import numpy as np
    import torch

    from adam_dask.model.torch_engine import load_factory

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = load_factory(factory)()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()
    X = torch.from_numpy(xtr[:, None].astype(np.float32) / 255)
    Y = torch.from_numpy(ytr)
    Xt = torch.from_numpy(xte[:, None].astype(np.float32) / 255)
    t0 = time.perf_counter()
    curve, reached, images, train_seconds = [], None, 0, 0.0
    for epoch in range(epochs):
        for g in opt.param_groups:
            g["lr"] = lr * lr_decay**epoch
        model.train()
        t1 = time.perf_counter()
        perm = torch.randperm(len(X))
        for i in range(0, len(X), 32):
            idx = perm[i : i + 32]
            opt.zero_grad()
            lossf(model(X[idx]), Y[idx]).backward()
            opt.step()
        train_seconds += time.perf_counter() - t1
        images += len(X)
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(Xt[i : i + 1000]).argmax(1) for i in range(0, len(Xt), 1000)])
        acc = float((pred.numpy() == yte).mean())
        curve.append(round(acc, 4))
        print(f"torch epoch {epoch + 1}: test accuracy {acc:.4f}", file=sys.stderr, flush=True)
        if acc >= target:
            reached = time.perf_counter() - t0
            break
    return {
        "seconds_to_target": reached,
        "epochs": len(curve),
        "curve": curve,
        "images_per_second": images / train_seconds if train_seconds else None,
    }


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def main() -> None:
    from _common import load_mnist_arrays, mnist_subset_store, record

    import adam_dask

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("paper", "resnet"))
    ap.add_argument("--target", type=float, default=None, help="paper 0.99, resnet 0.98")
    ap.add_argument("--epochs", type=int, default=None, help="paper 10, resnet 4 (planned)")
    ap.add_argument("--images", type=int, default=60000, help="MNIST training images")
    ap.add_argument("--batch-size", type=int, default=32, help="resnet: ours' mini-batch")
    ap.add_argument(
        "--torch-batch-size",
        type=int,
        default=None,
        help="paper: the torch engine's mini-batch (default the Trainer's, as the numba run's)",
    )
    ap.add_argument("--torch-lr", type=float, default=0.1)
    ap.add_argument("--torch-lr-decay", type=float, default=0.7)
    ap.add_argument("--no-save", action="store_true", help="print the line, do not append it")
    args = ap.parse_args()
    paper = args.part == "paper"
    target = args.target or (0.99 if paper else 0.98)
    epochs = args.epochs or (10 if paper else 4)
    store = mnist_subset_store(args.images)
    load_before = os.getloadavg()[0]
    out: dict = {"target": target, "planned_epochs": epochs}
    if args.images < 60000:
        out["images"] = args.images
    with adam_dask.cluster.local() as client:
        if paper:
            spec = adam_dask.config.get("model.spec")
            numba = trainer_run(store, client, spec, target, epochs)
            kw = {} if args.torch_batch_size is None else {"batch_size": args.torch_batch_size}
            torch_ = trainer_run(store, client, PAPER, target, epochs, **kw)
            out.update({f"numba_{k}": v for k, v in numba.items()})
            out.update({f"torch_{k}": v for k, v in torch_.items()})
            out["spec"] = spec
            out["torch_over_numba_seconds"] = _ratio(
                torch_["seconds_to_target"], numba["seconds_to_target"]
            )
            out["torch_over_numba_rate"] = _ratio(
                torch_["images_per_second"], numba["images_per_second"]
            )
        else:
            ours = trainer_run(
                store,
                client,
                RESNET,
                target,
                epochs,
                batch_size=args.batch_size,
                lr=args.torch_lr,
                lr_schedule="exponential",
                lr_floor=args.torch_lr_decay**epochs,
            )
            out.update({f"ours_{k}": v for k, v in ours.items()})
    if not paper:
        xtr, ytr, xte, yte = load_mnist_arrays(store)
        th = torch_fit(
            xtr,
            ytr,
            xte,
            yte,
            factory=RESNET,
            target=target,
            epochs=epochs,
            threads=os.cpu_count() or 2,
            lr=args.torch_lr,
            lr_decay=args.torch_lr_decay,
        )
        out.update({f"torch_{k}": v for k, v in th.items()})
        out["torch_threads"] = os.cpu_count() or 2
        out["module"] = RESNET
        out["ours_over_torch"] = _ratio(ours["seconds_to_target"], th["seconds_to_target"])
    out["batch_size"] = adam_dask.config.get("train.batch-size", None if paper else args.batch_size)
    if paper and args.torch_batch_size is not None:
        out["torch_batch_size"] = args.torch_batch_size
    out["lr"] = adam_dask.config.get("train.lr", None if paper else args.torch_lr)
    if not paper:
        out["lr_floor"] = round(args.torch_lr_decay**epochs, 4)
    out["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    record("torch_engine" if paper else "torch_resnet", out, save=not args.no_save)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
