"""Benchmark: Table 1's recipe in PyTorch, to screen options before the engine gets them.

The paper's MNIST network (``_common.torch_model``), trained the way ``table1.py --engine`` trains
it: plain SGD on mini-batches of ``--batch-size`` (8), lr ``--lr`` on a cosine to ``lr *
--lr-floor`` over ``--epochs`` (moved every step), adam_dask's own augmentation
(``Augment.default()`` with ``adam.augment.enabled``: the same draws per seed and epoch as the data
servers), He-normal weights, zero biases, one thread. What it adds, each off by default:

* ``--batch-norm conv`` / ``all``: batch normalisation after each convolution (before its
  pooling and activation), and with ``all`` after each hidden dense layer too;
* ``--label-smoothing EPS``: the cross-entropy's target is ``1 - EPS`` on the label and ``EPS /
  classes`` spread over every class. The engine has it now (``adam.model.label-smoothing``): on
  the asynchronous system it did not carry over (benchmarks/results/table1.jsonl).

The same recipe without them is the baseline that ties this runner to the engine's numbers
(benchmarks/results/table1_engine.jsonl). One seed is not a result: run the baseline and an
option on the same seeds. Appends one line per run to benchmarks/results/table1_torch.jsonl.

    pip install -e .[bench]
    python benchmarks/table1_torch.py --seed 0 --batch-norm conv
"""

from __future__ import annotations

import argparse
import sys
import time

import dask
import numpy as np
from _common import load_mnist_arrays, mnist_store, record, torch_accuracy, torch_model


def build(torch, batch_norm: str):
    """The paper's network, with BatchNorm inserted after the convolutions (``conv``) and the
    hidden dense layers too (``all``)."""
    nn = torch.nn
    base = list(torch_model(torch, "relu"))
    last = [m for m in base if isinstance(m, nn.Linear)][-1]  # gives the logits: never normalised
    layers = []
    for m in base:
        layers.append(m)
        if isinstance(m, nn.Conv2d) and batch_norm in ("conv", "all"):
            layers.append(nn.BatchNorm2d(m.out_channels))
        elif isinstance(m, nn.Linear) and batch_norm == "all" and m is not last:
            layers.append(nn.BatchNorm1d(m.out_features))
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--lr-floor", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batch-norm", choices=("none", "conv", "all"), default="none")
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("table1_torch.py needs PyTorch: pip install -e .[bench]")
    from adam_dask.data.augment import Augment, to_float
    from adam_dask.train.schedule import Schedule

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    with dask.config.set({"adam.augment.enabled": True}):
        augment = Augment.default()
    xtr, ytr, xte, yte = load_mnist_arrays(mnist_store())
    model = build(torch, args.batch_norm)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    lossf = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    xt = torch.from_numpy(np.ascontiguousarray(to_float(xte)[:, None]))
    y = torch.from_numpy(ytr)
    n, bs = len(xtr), args.batch_size
    steps = n // bs
    schedule = Schedule(args.lr, args.epochs, "cosine", args.lr_floor)
    rng = np.random.default_rng(args.seed)
    index = np.arange(n)
    curve, losses = [], []
    t0 = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        x = torch.from_numpy(
            np.ascontiguousarray(augment.apply(xtr, index, seed=args.seed, epoch=epoch)).reshape(
                n, 1, *xtr.shape[1:3]
            )
        )
        order = torch.from_numpy(rng.permutation(n))
        model.train()
        total_loss = 0.0
        for b in range(steps):
            for g in opt.param_groups:
                g["lr"] = schedule.at(step / steps)
            j = order[b * bs : (b + 1) * bs]
            loss = lossf(model(x[j]), y[j])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            total_loss += float(loss.detach())
        curve.append(torch_accuracy(torch, model, xt, yte))
        losses.append(total_loss / steps)
        sys.stderr.write(f"epoch {epoch + 1}: loss {losses[-1]:.4f}, test {curve[-1]:.2%}\n")
    return record(
        "table1_torch",
        {
            "epochs": args.epochs,
            "seed": args.seed,
            "lr": args.lr,
            "lr_schedule": "cosine",
            "lr_floor": args.lr_floor,
            "batch_size": bs,
            "batch_norm": args.batch_norm,
            "label_smoothing": args.label_smoothing,
            "accuracy": curve[-1],
            "best_accuracy": max(curve),
            "best_epoch": int(np.argmax(curve)) + 1,
            "seconds": time.perf_counter() - t0,
            "torch": torch.__version__,
            "curve": curve,
            "loss_curve": losses,
        },
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
