"""Expert parallelism: token rows ``(N, ...)`` moved between the ranks of a group, uneven sizes
allowed (whole experts per rank: Lepikhin et al., arXiv:2006.16668; Fedus et al.,
arXiv:2101.03961). Autograd operators; the table is in :mod:`tpify.comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import exchange_rows, all_gather_dim
from .groups import group_rank, group_size

__all__ = ["row_range", "scatter_rows", "gather_rows", "all_to_all_rows"]


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows rank ``rank`` of ``world`` takes of ``rows`` token rows:
    ``[rank * rows // world, (rank + 1) * rows // world)`` (sizes differ by at most one; a rank may
    get none)."""
    return rank * rows // world, (rank + 1) * rows // world


def _gather_uneven_rows(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's :func:`row_range` slice ``x`` of ``rows`` rows, concatenated in rank order: one
    all-gather of the slices padded to ``ceil(rows / p)`` rows."""
    world = group_size(group)
    chunk = -(-rows // world)
    pad = chunk - x.shape[0]
    padded = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]) if pad else x
    gathered = all_gather_dim(padded, 0, group).view((world, chunk) + tuple(x.shape[1:]))
    sizes = [b - a for a, b in (row_range(rows, world, r) for r in range(world))]
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        a, b = row_range(x.shape[0], group_size(group), group_rank(group))
        return x[a:b].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_uneven_rows(grad.contiguous(), ctx.rows, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, group):
        ctx.group, ctx.rows = group, rows
        return _gather_uneven_rows(x.contiguous(), rows, group)

    @staticmethod
    def backward(ctx, grad):
        a, b = row_range(ctx.rows, group_size(ctx.group), group_rank(ctx.group))
        return grad[a:b].contiguous(), None, None


def scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's token rows of a replicated ``(N, ...)`` tensor: rows ``row_range(N, p, r)``.

    Forward: no communication. Backward: one all-gather of the row gradients (padded to
    ``ceil(N/p)`` rows), so the replicated input gets the gradient of every rank's rows.
    """
    if group_size(group) == 1:
        return x
    return _ScatterRows.apply(x, group)


def gather_rows(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ``rows`` token rows of every rank (:func:`row_range` slices), in rank order: ``(N_r, ...)``
    -> ``(N, ...)``, replicated. Forward: one all-gather (slices padded to ``ceil(N/p)`` rows).
    Backward: this rank's rows of the (replicated) gradient, no communication."""
    if group_size(group) == 1:
        return x
    return _GatherRows.apply(x, rows, group)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.send_sizes, ctx.recv_sizes, ctx.group = send_sizes, recv_sizes, group
        return exchange_rows(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.recv_sizes, ctx.send_sizes, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send rows ``[sum(send_sizes[:j]), sum(send_sizes[:j+1]))`` of ``x`` ``(M, ...)`` to rank ``j``;
    return the rows received, ``recv_sizes[j]`` from rank ``j``, in rank order ``(sum(recv_sizes), ...)``.

    Forward: one all-to-all (``all_to_all_single`` with split sizes, counted as ``all_to_all``).
    Backward: the reverse exchange of the gradient (one all-to-all): a permutation of rows
    across ranks, whose adjoint is the inverse permutation. ``recv_sizes`` must be what the other
    ranks send (:func:`all_to_all_counts`).
    """
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, list(send_sizes), list(recv_sizes), group)
