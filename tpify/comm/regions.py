"""Megatron-LM's region operators and the sequence-parallel ones, each an autograd function over
an explicit process group (Shoeybi et al., arXiv:1909.08053, section 3, figure 3; Korthikanti
et al., arXiv:2205.05198, section 4.2.2). The table is in :mod:`tpify.comm`. With a one-rank
group every operator is the identity and issues nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import reduce_scatter_dim, split_dim, all_gather_dim, all_gather_last_dim, all_reduce
from .groups import group_size

__all__ = ["grad_reduce_dtype", "copy_to_tp_region", "copy_many_to_tp_region", "reduce_from_tp_region",
           "scatter_to_tp_region", "gather_from_tp_region", "sum_grad_ranges", "scatter_to_sequence_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region"]


def grad_reduce_dtype(compute: torch.dtype, floor: torch.dtype | None = None) -> torch.dtype:
    """The dtype an input gradient is summed over the group in: the dtype of the matmul that made
    it (``compute``: autocast's ``bfloat16`` under autocast, else the layer's dtype), or the wider
    of that and ``floor`` (``parallelize(grad_reduce_dtype=torch.float32)``: never narrower than
    float32; a float64 model keeps float64). Local."""
    return compute if floor is None else torch.promote_types(compute, floor)


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A copy (autograd may hand the same gradient tensor to other consumers too), in the dtype to reduce in.
        dtype = ctx.reduce_dtype or grad.dtype
        if dtype == grad.dtype:
            return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None, None
        return all_reduce(grad.to(dtype, memory_format=torch.contiguous_format), ctx.group).to(grad.dtype), None, None


class _CopyManyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, reduce_dtypes, *xs):
        ctx.group, ctx.reduce_dtypes = group, reduce_dtypes
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        needed = [(i, g) for i, (g, need) in enumerate(zip(grads, ctx.needs_input_grad[2:])) if need]
        out = [None, None] + [None] * len(grads)
        if not needed:
            return tuple(out)
        if ctx.reduce_dtypes is None:  # all in the widest of their dtypes, one all-reduce
            widest = needed[0][1].dtype
            for _, g in needed[1:]:
                widest = torch.promote_types(widest, g.dtype)
            targets = [widest] * len(needed)
        else:  # each in its own reduce dtype: one all-reduce per dtype
            targets = [ctx.reduce_dtypes[i] or g.dtype for i, g in needed]
        for dtype in dict.fromkeys(targets):
            members = [(i, g) for (i, g), t in zip(needed, targets) if t == dtype]
            flat = torch.cat([g.reshape(-1).to(dtype) for _, g in members])
            all_reduce(flat, ctx.group)
            offset = 0
            for i, g in members:
                out[2 + i] = flat[offset: offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
        return tuple(out)


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, -1, ctx.group), None


class _SumGradRanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, where, *xs):
        ctx.group, ctx.where = group, where
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else g.clone(memory_format=torch.contiguous_format) for g in grads]
        pieces = [(g, dim, a, b) for g, (dim, ranges) in zip(grads, ctx.where) if g is not None for a, b in ranges]
        if pieces:  # one all-reduce for every slice of every tensor
            flat = torch.cat([g.narrow(dim, a, b - a).reshape(-1) for g, dim, a, b in pieces])
            all_reduce(flat, ctx.group)
            offset = 0
            for g, dim, a, b in pieces:
                view = g.narrow(dim, a, b - a)
                view.copy_(flat[offset: offset + view.numel()].view_as(view))
                offset += view.numel()
        return (None, None, *grads)


def sum_grad_ranges(xs: list[torch.Tensor], where: list[tuple[int, list[tuple[int, int]]]],
                    group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Identity forward; backward, sum over the group the gradient slices ``where`` names.

    ``where[i] = (dim, [(start, stop), ...])`` names the slices of ``xs[i]``, along ``dim``, that
    hold a replicated value whose gradient each rank computes only in part: the K/V parts of a
    multi-query ``[Q_r | K | V]`` projection, read by this rank's query heads only. The true
    gradient of those slices is the sum over the group; the other slices are left as they are.
    Communication: backward, one all-reduce (sum) of all the named slices of all the tensors
    together; forward none.
    """
    if group_size(group) == 1:
        return tuple(xs)
    return _SumGradRanges.apply(group, tuple(where), *xs)


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, partial_grad):
        ctx.group, ctx.partial_grad = group, partial_grad
        return all_gather_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grad:  # each rank holds part of the gradient of every token: sum, keep mine
            return reduce_scatter_dim(grad, 1, ctx.group), None, None
        return split_dim(grad, 1, ctx.group), None, None  # the same full gradient on every rank


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


def scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism: keep this rank's chunk of the tokens, ``(B, T, H) -> (B, T/p, H)``.

    Forward: no communication. Backward: one all-gather of the gradient along ``T``
    (Korthikanti et al., arXiv:2205.05198, section 4.2.2).

    Raises:
        ValueError: ``T`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                partial_grad: bool = True) -> torch.Tensor:
    """Sequence parallelism: all-gather the tokens, ``(B, T/p, H) -> (B, T, H)``.

    Forward: one all-gather along ``T`` (Megatron's ``g``). Backward: with ``partial_grad``
    (the input of column-parallel layers, whose input gradients are partial sums per rank) one
    reduce-scatter along ``T`` (Megatron's ``g-bar``), which replaces the column-parallel
    all-reduce; without (the gathered output feeds replicated computation) a split, no
    communication.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, partial_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism: sum the partial outputs of a row-parallel layer and keep this rank's
    tokens, ``(B, T, H) -> (B, T/p, H)``: one reduce-scatter forward (half an all-reduce's
    traffic), one all-gather of the gradient backward.

    Raises:
        ValueError: ``T`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                      reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward.

    Placed where a replicated activation ``(B, T, H)`` enters a column-parallel region, so that
    the partial gradients each rank computes for it are summed. One all-reduce of ``B*T*H``
    values in backward, none in forward: in ``reduce_dtype`` (the gradient cast to it, summed,
    cast back to its own dtype), default the gradient's own dtype. Column-parallel layers pass
    the dtype their matmul ran in (autocast's ``bfloat16`` over ``float32`` activations: the
    partial gradient is a ``bfloat16`` matmul's output, exact in it), as Megatron-LM all-reduces
    the input gradient in the dtype of the matmul that made it.
    """
    if group_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group, reduce_dtype)


def copy_many_to_tp_region(xs: list[torch.Tensor], group: dist.ProcessGroup | None,
                           reduce_dtypes: list[torch.dtype | None] | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`copy_to_tp_region` of several replicated tensors with one all-reduce in backward.

    Used where a column-parallel region starts from more than one replicated activation, e.g. a
    LoRA adapter on a column-parallel layer: the input ``X (B, T, H)`` and the adapter's
    ``h = A X (B, T, r)`` both enter the region, and the gradients of both are summed over the
    group in a single all-reduce of ``B*T*(H + r)`` values (in the widest of their dtypes).
    With ``reduce_dtypes`` (one per tensor; None: the gradient's own dtype) each gradient is
    summed in its own reduce dtype instead: one all-reduce per distinct dtype (a ``bfloat16``
    base's ``dX`` and PEFT's ``float32`` adapters' ``dh``: two), one when they agree.
    Forward: identity, no communication.
    """
    if group_size(group) == 1:
        return tuple(xs)
    return _CopyManyToTPRegion.apply(group, None if reduce_dtypes is None else tuple(reduce_dtypes), *xs)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward.

    Sums the partial outputs ``(B, T, H)`` of a row-parallel layer or vocab-parallel embedding.
    One all-reduce of the output's size in forward, none in backward.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: ``(..., n) -> (..., n / p)``.

    No communication forward; one all-gather of the gradient backward.

    Raises:
        ValueError: the last dim is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim in rank order: ``(..., n / p) -> (..., n)``.

    One all-gather forward; backward keeps this rank's chunk of the gradient (no communication).
    """
    if group_size(group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, group)
