"""The raw collectives tpify issues, without autograd rules: all-reduce, all-gather and
reduce-scatter along a dimension (also started asynchronously), all-to-all of counts and rows,
barrier, object gathers. Each is recorded for :func:`~tpify.comm.counting.count_collectives`;
on a one-rank group (or without torch.distributed) each is the identity and issues nothing.
The autograd region operators (:mod:`tpify.comm.regions`, :mod:`tpify.comm.rows`) are built on these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .counting import record
from .groups import collective_device, group_rank, group_size

__all__ = ["all_reduce", "all_reduce_async", "all_gather_dim", "all_gather_dim_async", "PendingGather",
           "all_gather_last_dim", "reduce_scatter_dim_async", "all_to_all_counts", "barrier", "all_gather_objects"]


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (``"sum"`` or ``"max"``) of ``tensor`` (any shape, dtype) over
    ``group``, returned; no autograd rule. A one-rank group: nothing issued.

    Raises:
        ValueError: another ``op``.
    """
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
    if group_size(group) == 1:
        return tensor
    record("all_reduce", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Start an in-place all-reduce (sum) of ``tensor``: its work handle (``.wait()`` before
    reading ``tensor``), or None for a one-rank group. The column-parallel backward overlaps it
    with the weight gradient (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``).
    """
    if group_size(group) == 1:
        return None
    record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather equal shards along the last dim in rank order: ``(..., n)`` -> ``(..., p * n)``."""
    return all_gather_dim(tensor, -1, group)


def all_gather_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather equal shards along ``dim`` in rank order: ``(..., n, ...)`` -> ``(..., p * n, ...)``,
    contiguous (one copy unless ``dim`` is the outermost non-trivial one). One all-gather of
    ``tensor.numel()`` values per rank; no autograd rule.
    """
    world = group_size(group)
    if world == 1:
        return tensor
    out, shape = _all_gather_start(tensor, group, async_op=False)[:2]
    return _merge_gathered(out, shape, dim % tensor.dim(), world)


class PendingGather:
    """An all-gather started by :func:`all_gather_dim_async`: :meth:`wait` returns its result."""

    __slots__ = ("_out", "_shape", "_dim", "_world", "_work", "_result")

    def __init__(self, out, shape, dim, world, work, result=None):
        self._out, self._shape, self._dim, self._world, self._work = out, shape, dim, world, work
        self._result = result

    def wait(self) -> torch.Tensor:
        """The gathered tensor, as :func:`all_gather_dim` returns it (waits for the collective
        the first time)."""
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = _merge_gathered(self._out, self._shape, self._dim, self._world)
            self._out = self._work = None
        return self._result


def all_gather_dim_async(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> PendingGather:
    """Start :func:`all_gather_dim`; ``.wait()`` on the result gives the gathered tensor
    (``tensor`` itself for a one-rank group). The column-parallel backward under sequence
    parallelism gathers its saved ``(B, T/p, H)`` input again while it computes the input gradient.
    """
    world = group_size(group)
    if world == 1:
        return PendingGather(None, None, None, 1, None, result=tensor)
    out, shape, work = _all_gather_start(tensor, group, async_op=True)
    return PendingGather(out, shape, dim % tensor.dim(), world, work)


def _all_gather_start(tensor: torch.Tensor, group, async_op: bool):
    """Issue the all-gather of ``tensor`` into a ``(p * shape[0], *shape[1:])`` buffer: (buffer, shape, work)."""
    shard = tensor.contiguous()
    record("all_gather", shard)
    shape = tuple(shard.shape)
    # gloo wants the output as the shards stacked along dim 0: (p * shape[0], *shape[1:])
    out = torch.empty((group_size(group) * shape[0],) + shape[1:], dtype=shard.dtype, device=shard.device)
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, shard, group=group, async_op=True) if async_op else gather(out, shard, group=group)
    return out, shape, work


def _merge_gathered(out: torch.Tensor, shape: tuple, dim: int, world: int) -> torch.Tensor:
    """The gathered buffer ``(p * shape[0], ...)`` as one tensor with the rank axis merged into ``dim``."""
    return out.view((world,) + shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_dim_async(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None):
    """Start a reduce-scatter (sum) along ``dim``: ``(out, work)``; ``out`` ``(..., n/p, ...)`` holds
    this rank's chunk of the sum once ``work.wait()`` returns (``work`` None and ``out`` the input
    for a one-rank group). The input is laid out once as ``(p, ..., n/p, ...)`` (a copy unless
    ``dim`` is outermost).

    Raises:
        ValueError: ``n`` is not divisible by the group size.
    """
    world = group_size(group)
    if world == 1:
        return tensor, None
    chunks, out = _reduce_scatter_layout(tensor, dim, world)
    # the input as the chunks stacked along dim 0: (p * chunk.shape[0], *chunk.shape[1:])
    work = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        out, chunks.flatten(0, 1), group=group, async_op=True)
    return out, work


def reduce_scatter_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """:func:`reduce_scatter_dim_async`, waited for: synchronous, so that ``torch.compile`` traces
    it (dynamo does not trace ``async_op=True``).
    """
    world = group_size(group)
    if world == 1:
        return tensor
    chunks, out = _reduce_scatter_layout(tensor, dim, world)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, chunks.flatten(0, 1), group=group)
    return out


def _reduce_scatter_layout(tensor: torch.Tensor, dim: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` laid out as ``(p, ..., n/p, ...)`` (rank r's chunk contiguous) and the empty
    output chunk; the collective recorded."""
    dim = dim % tensor.dim()
    if tensor.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter a dimension of {tensor.shape[dim]} over {world} ranks")
    chunks = tensor.unflatten(dim, (world, tensor.shape[dim] // world)).movedim(dim, 0).contiguous()
    record("reduce_scatter", chunks)
    return chunks, torch.empty(tuple(chunks.shape[1:]), dtype=chunks.dtype, device=chunks.device)


def split_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of ``dim`` (a new contiguous tensor); no communication."""
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world:
        which = "a last dimension" if dim % tensor.dim() == tensor.dim() - 1 else f"dimension {dim}"
        raise ValueError(f"cannot split {which} of {tensor.shape[dim]} over {world} ranks: it is not divisible")
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (default: the world); a no-op without torch.distributed.
    Over NCCL alone on this rank's current CUDA device (``device_ids``), never one torch guesses.
    """
    if dist.is_available() and dist.is_initialized():
        record("barrier", torch.empty(0))
        device = collective_device(group)
        if device.type == "cuda":
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order, over ``group`` (for reports, not for tensors
    on a hot path), on :func:`~tpify.comm.groups.collective_device`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    record("all_gather_object", torch.empty(0))
    dist.all_gather_object(out, obj, group=group)
    return out


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange per-destination counts: ``counts`` ``(p, ...)`` integer, row ``j`` for rank ``j``;
    returns ``(p, ...)``, row ``j`` received from rank ``j``. One all-to-all of ``counts.numel()``
    values (counted as ``all_to_all``); no autograd."""
    if group_size(group) == 1:
        return counts.clone()
    send = counts.contiguous()
    out = torch.empty_like(send)
    record("all_to_all", send)
    dist.all_to_all_single(out, send, group=group)
    return out


def exchange_rows(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    """One all-to-all of the rows of ``x`` ``(M, ...)``: ``send_sizes[j]`` rows to rank ``j``, ``recv_sizes[j]``
    from it, ``(sum(recv_sizes), ...)`` out; no autograd (:func:`tpify.comm.rows.all_to_all_rows` has it)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
    record("all_to_all", x)
    dist.all_to_all_single(out, x, recv_sizes, send_sizes, group=group)
    return out
