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
partition over its worker's budget, naming it. A dense layer that alone outweighs a fair share is split by
output neurons across several partitions (the paper's Figure 6): each slice holds its rows of
the weights (the last one the layer's bias too), see :class:`~adam_dask.model.stage.Stage`.

Pure: no Dask, no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import PartitionError
from .network import Network

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_BYTES",
    "Partition",
    "PartitionPlan",
    "plan_partitions",
    "profitable_offload",
    "whole_plan",
]

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
    rows: tuple[int, int] = (0, 0)  # a dense layer's output rows [r0, r1); (0, 0): whole layers

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

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """[(first, stop, r0, r1), ...]: layer ranges, and the rows of a split dense layer
        (r1 > 0), for :func:`~adam_dask.model.stage.stages_of`."""
        return [(p.first, p.stop, *p.rows) for p in self.partitions]

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
                    "rows": list(p.rows),
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


def _split(weights: list[int], P: int, splittable: list[int]) -> list[tuple[int, int, int]]:
    """``P`` consecutive pieces of the layers ``weights`` (parameters per layer) that minimise
    the largest piece: runs of whole layers, or one layer ``j`` cut into ``m`` slices of
    ``weights[j] / m`` when ``splittable[j]`` (its outputs; 0: not a dense layer) allows and a
    run cannot do as well. Returns ``[(first, stop, m), ...]`` (m = 1: a run), in order."""
    L = len(weights)
    prefix = np.concatenate([[0], np.cumsum(weights, dtype=np.int64)])
    INF = np.iinfo(np.int64).max
    # best[k][j]: the smallest largest piece of layers [0, j) in k pieces; how[k][j]: the last
    best = np.full((P + 1, L + 1), INF, np.int64)
    how: dict[tuple[int, int], tuple[int, int]] = {}
    best[0][0] = 0
    for k in range(1, P + 1):
        for j in range(1, L + 1):
            for i in range(j - 1, -1, -1):  # a run [i, j); later cuts first on ties
                if best[k - 1][i] == INF:
                    continue
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], how[(k, j)] = v, (i, 1)
            for m in range(2, min(k, splittable[j - 1]) + 1):  # layer j - 1 in m slices
                if best[k - m][j - 1] == INF:
                    continue
                v = max(best[k - m][j - 1], -(-weights[j - 1] // m))
                if v < best[k][j]:
                    best[k][j], how[(k, j)] = v, (j - 1, m)
    if best[P][L] == INF:
        raise PartitionError(f"{P} partitions for a network of {L} layers")
    out = []
    k, j = P, L
    while j > 0:
        i, m = how[(k, j)]
        out.append((i, j, m))
        k, j = k - m, i
    return out[::-1]


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
    mini-batches' work buffers (default ``partitions * threads``: every thread of every stage
    busy when the stages are balanced; ``adam.train.partition-window``), and the process itself
    (:data:`BASE_BYTES`)."""
    P, T, B = int(partitions), int(threads), int(batch_size)
    layers = net.layers
    if P < 1:
        raise PartitionError(f"partitions={P}", "use at least 1")
    W = int(window) if window is not None else P * T
    sizes = []
    for L in layers:
        s = 0
        if L.has_params:
            s = net.layout[f"{L.index}.weight"].size + net.layout[f"{L.index}.bias"].size
        sizes.append(s)
    # a dense layer may be split by output neurons (paper Figure 6), not the logits' layer
    wide = [
        L.out_shape[0] if L.kind == "fc" and j < len(layers) - 1 else 0
        for j, L in enumerate(layers)
    ]
    if P > len(layers) + sum(max(0, o - 1) for o in wide):
        raise PartitionError(
            f"{P} partitions for a network of {len(layers)} layers",
            "use fewer partitions (each holds a layer, or a slice of a dense layer's outputs)",
        )
    pieces: list[tuple[int, int, int, int]] = []  # (first, stop, r0, r1)
    for a, b, m in _split(sizes, P, wide):
        if m == 1:
            pieces.append((a, b, 0, 0))
            continue
        O = layers[a].out_shape[0]
        bounds = [O * q // m for q in range(m + 1)]
        pieces += [(a, b, bounds[q], bounds[q + 1]) for q in range(m)]
    parts = []
    offset = 0
    for k, (a, b, r0, r1) in enumerate(pieces):
        L0 = layers[a]
        if r1:  # a slice: its rows' weights, and the whole bias in the last one
            I, O = L0.in_size, L0.out_shape[0]
            n = (r1 - r0) * I + (O if r1 == O else 0)
            ctx = _F * B * (3 * O + 2 * I + (r1 - r0) + I + r1)
            tokens: tuple[str, ...] = (f"{L0.token}[{r0}:{r1}]",)
            in_size = I if r0 == 0 else I + r0
            out_size = O if r1 == O else I + r1
        else:
            n = sum(sizes[a:b])
            ctx = _context_bytes(layers[a:b], B, net.classes)
            tokens = tuple(L.token for L in layers[a:b])
            in_size = int(np.prod(L0.in_shape))
            out_size = int(np.prod(layers[b - 1].out_shape))
        mem = _F * n * (1 + 2 * T + 2 + 1) + W * ctx
        parts.append(
            Partition(
                index=k,
                first=a,
                stop=b,
                start=offset,
                stop_param=offset + n,
                tokens=tokens,
                in_size=0 if k == 0 else in_size,
                out_size=0 if k == len(pieces) - 1 else out_size,
                memory=BASE_BYTES + mem,
                rows=(r0, r1),
            )
        )
        offset += n
    if offset != net.layout.size:  # the pieces tile the flat layout exactly
        raise AssertionError(f"partition spans cover {offset} of {net.layout.size} parameters")
    return PartitionPlan(tuple(parts), net.layout.size, T, B, W)


def whole_plan(
    params: int, *, threads: int, batch_size: int, window: int | None = None
) -> PartitionPlan:
    """The plan of a model of ``params`` parameters with no layer list to split (a PyTorch
    module) as the pipeline's one stage: one partition of every parameter. Its memory is what
    :func:`plan_partitions` counts for the parameters (weights, two accumulators per thread,
    two exchange buffers, the replay log's copy) and the process; the module's work buffers
    are not estimated."""
    T, n = int(threads), int(params)
    part = Partition(
        index=0,
        first=0,
        stop=0,
        start=0,
        stop_param=n,
        tokens=("module",),
        in_size=0,
        out_size=0,
        memory=BASE_BYTES + _F * n * (1 + 2 * T + 2 + 1),
    )
    W = int(window) if window is not None else T
    return PartitionPlan((part,), n, T, int(batch_size), W)


def profitable_offload(net: Network, push_every: int) -> list[str]:
    """The dense layers worth offloading: those whose ``k * (in + out)`` floats of activations
    and error terms per push are fewer than the ``in * out`` of their weight delta (the paper's
    rule for sending terms instead of updates). None for a torch model (numba engine only)."""
    if getattr(net, "engine", None) is not None:
        return []
    out = []
    for name, view in net.parameters.items():
        if name.endswith(".weight") and view.ndim == 2:
            o, i = view.shape
            if push_every * (i + o) < i * o:
                out.append(name.rsplit(".", 1)[0])
    return out
