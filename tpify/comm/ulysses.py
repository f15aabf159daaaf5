"""The all-to-all between a sequence split and a head split (DeepSpeed-Ulysses, arXiv:2309.14509).

:func:`all_to_all_dims` turns a tensor split over the ranks of a group along one dimension (the
tokens) into one split along another (the heads): rank ``r`` sends its ``j``-th slice of
``scatter_dim`` to rank ``j`` and concatenates what it receives along ``gather_dim`` in rank
order. Its backward is the reverse exchange, so it is an autograd region operator like those of
:mod:`tpify.comm.regions`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .counting import record
from .groups import group_size

__all__ = ["all_to_all_dims"]


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """The forward exchange (no autograd): ``scatter_dim`` of size ``n`` -> ``n / p``, ``gather_dim``
    of size ``m`` -> ``p * m`` (the received slices in rank order)."""
    world = group_size(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    send = x.unflatten(scatter_dim, (world, x.shape[scatter_dim] // world)).movedim(scatter_dim, 0).contiguous()
    out = torch.empty_like(send)  # out[j]: rank j's slice for this rank
    record("all_to_all", send)
    dist.all_to_all_single(out, send, group=group)
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` split along ``scatter_dim`` into ``p`` slices, slice ``j`` sent to rank ``j``; the slices
    received concatenated along ``gather_dim`` in rank order.

    Shapes (Ulysses, sequence -> heads): ``(B, n, T/p, d)`` with ``scatter_dim=1, gather_dim=2``
    -> ``(B, n/p, T, d)``; the reverse call (``scatter_dim=2, gather_dim=1``) goes back.
    Communication: forward one all-to-all of ``x.numel()`` values; backward the reverse all-to-all
    of the gradient. Identity for a one-rank group.

    Raises:
        ValueError: ``x.shape[scatter_dim]`` not divisible by the group size.
    """
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all_to_all_dims: dimension {scatter_dim} of size {x.shape[scatter_dim]} cannot be split "
                         f"over {world} ranks")
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
