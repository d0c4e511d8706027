"""The partition plan of a model replica spread over several training workers (paper 3.2,
Figure 6): which consecutive layers each partition holds, its span of the flat parameters, and
the memory it needs on its worker.

>>> from adam_dask.model import Network
>>> net = Network.from_spec("conv5x5:10,maxpool2,fc400,fc10", input_shape=(1, 28, 28))
>>> plan = plan_partitions(net, 2, threads=1, batch_size=8)
>>> [(p.first, p.stop) for p in plan.partitions]
[(0, 3), (3, 4)]

The layers are split into ``P`` consecutive stages so that the largest partition's parameters
are as few as they can be (the memory is what does not fit; a partition's compute is about its
parameters times the batch for dense layers). :meth:`PartitionPlan.check` refuses a plan with a
partition over its worker's budget, naming it. A dense layer wider than one worker is the
paper's split by output neurons; that split is not built yet: such a layer is refused with the
partition that holds it.

Pure: no Dask, no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import PartitionError
from .network import Network

logger = logging.getLogger(__name__)

__all__ = ["BASE_BYTES", "Partition", "PartitionPlan", "plan_partitions"]

#: A TRAIN worker process before it holds a partition: Python, numpy, numba's compiled
#: kernels, Dask's worker and a data stream (a training worker measured 230-260 MB RSS here).
BASE_BYTES = 300 << 20
_F = 4  # bytes per float32


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition: layers ``[first, stop)`` and parameters ``[start, stop_param)``."""

    index: int
    first: int
    stop: int
    start: int
    stop_param: int
    tokens: tuple[str, ...]
    in_size: int  # floats per image in (activations received; 0 for the first)
    out_size: int  # floats per image out (activations sent; 0 for the last)
    memory: int  # estimated bytes on its worker

    @property
    def params(self) -> int:
        return self.stop_param - self.start


@dataclass(frozen=True, slots=True)
class PartitionPlan:
    """The partitions of a replica, with what the estimate assumed."""

    partitions: tuple[Partition, ...]
    params: int
    threads: int
    batch_size: int
    window: int  # mini-batches in flight through the replica

    def __len__(self) -> int:
        return len(self.partitions)

    def bounds(self) -> list[tuple[int, int]]:
        """Layer ranges [(first, stop), ...] (for :func:`~adam_dask.model.stage.stages_of`)."""
        return [(p.first, p.stop) for p in self.partitions]

    def cross_bytes_per_image(self) -> int:
        """Bytes crossing partitions per image: activations forward and errors back."""
        return sum(2 * _F * p.out_size for p in self.partitions[:-1])

    def describe(self, budget: int | None = None) -> str:
        """The plan as lines of text (printed when training starts)."""
        P = len(self.partitions)
        head = (
            f"partition plan: {self.params:,} parameters over {P} partition(s), "
            f"{self.threads} thread(s) each, {self.window} mini-batches of "
            f"{self.batch_size} in flight"
        )
        if budget is not None:
            head += f"; budget {_mib(budget)} per worker"
        lines = [head]
        for p in self.partitions:
            toks = ",".join(p.tokens)
            if len(toks) > 60:
                toks = toks[:57] + "..."
            lines.append(
                f"  partition {p.index}: layers {p.first}-{p.stop - 1} ({toks}), "
                f"params [{p.start:,}, {p.stop_param:,}) = {p.params:,}, "
                f"~{_mib(p.memory)}; sends {p.out_size:,} floats/image forward"
            )
        lines.append(f"  cross-partition traffic: {self.cross_bytes_per_image():,} bytes/image")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-safe (the dashboard shows it)."""
        return {
            "params": self.params,
            "threads": self.threads,
            "batch_size": self.batch_size,
            "window": self.window,
            "cross_bytes_per_image": self.cross_bytes_per_image(),
            "partitions": [
                {
                    "index": p.index,
                    "layers": [p.first, p.stop],
                    "tokens": list(p.tokens),
                    "span": [p.start, p.stop_param],
                    "params": p.params,
                    "memory": p.memory,
                }
                for p in self.partitions
            ],
        }

    def check(self, budget: int) -> None:
        """Raise :class:`PartitionError` naming the first partition whose estimate exceeds
        ``budget`` bytes."""
        for p in self.partitions:
            if p.memory > budget:
                P = len(self.partitions)
                raise PartitionError(
                    f"partition {p.index} of {P} (layers {p.first}-{p.stop - 1}, "
                    f"{p.params:,} parameters) needs ~{_mib(p.memory)} but a TRAIN worker "
                    f"has {_mib(budget)} to give",
                    "train with more partitions (--partitions / adam.train.partitions), fewer "
                    "threads, or workers with more memory",
                    partition=p.index,
                )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _split(weights: list[int], P: int) -> list[int]:
    """Cut points [0, c1, ..., L] of ``weights`` into ``P`` non-empty consecutive runs that
    minimise the largest run's sum (then, among those, prefer later cuts for earlier runs)."""
    L = len(weights)
    prefix = np.concatenate([[0], np.cumsum(weights, dtype=np.int64)])
    INF = np.iinfo(np.int64).max
    # best[k][j]: the smallest max-sum of splitting weights[:j] into k runs
    best = np.full((P + 1, L + 1), INF, np.int64)
    cut = np.zeros((P + 1, L + 1), np.int64)
    best[0][0] = 0
    for k in range(1, P + 1):
        for j in range(k, L + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == INF:
                    continue
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] or (v == best[k][j] and i > cut[k][j]):
                    best[k][j], cut[k][j] = v, i
    cuts = [L]
    j = L
    for k in range(P, 0, -1):
        j = int(cut[k][j])
        cuts.append(j)
    return cuts[::-1]


def _context_bytes(layers: list, batch_size: int, classes: int) -> int:
    """Bytes of one mini-batch's work buffers in a stage (:class:`StageContext`)."""
    B = batch_size
    n = B * int(np.prod(layers[0].in_shape)) + B * classes
    for L in layers:
        n += 2 * B * int(np.prod(L.out_shape))
        if L.kind == "conv":
            ckk = L.in_shape[0] * L.kernel[0] * L.kernel[1]
            n += (B + 1) * ckk * L.out_shape[1] * L.out_shape[2]
        if L.kind == "fc":
            n += L.in_size
    return n * _F


def plan_partitions(
    net: Network,
    partitions: int,
    *,
    threads: int,
    batch_size: int,
    window: int | None = None,
) -> PartitionPlan:
    """Split ``net``'s layers into ``partitions`` consecutive stages, balanced by parameters,
    with each one's memory estimate on its worker: its weights, two accumulators per thread
    (the push group being summed and the next), two exchange buffers (a push being sent and
    one queued), the copy the replay log keeps until every copy holds a push, ``window``
    mini-batches' work buffers (default ``2 * partitions * threads``), and the process itself
    (:data:`BASE_BYTES`)."""
    P, T, B = int(partitions), int(threads), int(batch_size)
    layers = net.layers
    if P < 1:
        raise PartitionError(f"partitions={P}", "use at least 1")
    if P > len(layers):
        raise PartitionError(
            f"{P} partitions for a network of {len(layers)} layers",
            f"use at most {len(layers)} partitions (each holds at least one layer)",
        )
    W = int(window) if window is not None else 2 * P * T
    sizes = []
    for L in layers:
        s = 0
        if L.has_params:
            s = net.layout[f"{L.index}.weight"].size + net.layout[f"{L.index}.bias"].size
        sizes.append(s)
    cuts = _split(sizes, P)
    parts = []
    offset = 0
    for k in range(P):
        a, b = cuts[k], cuts[k + 1]
        n = sum(sizes[a:b])
        mem = _F * n * (1 + 2 * T + 2 + 1) + W * _context_bytes(layers[a:b], B, net.classes)
        parts.append(
            Partition(
                index=k,
                first=a,
                stop=b,
                start=offset,
                stop_param=offset + n,
                tokens=tuple(L.token for L in layers[a:b]),
                in_size=0 if k == 0 else int(np.prod(layers[a].in_shape)),
                out_size=0 if k == P - 1 else int(np.prod(layers[b - 1].out_shape)),
                memory=BASE_BYTES + mem,
            )
        )
        offset += n
    return PartitionPlan(tuple(parts), net.layout.size, T, B, W)
