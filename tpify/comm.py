"""Communication primitives for tensor parallelism.

This is the only module of tpify that calls ``torch.distributed`` collectives. It holds the
four region operators of Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, figure 3),
each an autograd function over an explicit process group, and the few plain collectives the
vocab-parallel loss needs.

| operator                 | forward                          | backward                          |
| ------------------------ | -------------------------------- | --------------------------------- |
| ``copy_to_tp_region``    | identity (Megatron's ``f``)      | all-reduce (sum) over the group   |
| ``reduce_from_tp_region``| all-reduce (sum) (Megatron's ``g``) | identity                       |
| ``scatter_to_tp_region`` | split the last dim, keep chunk r | all-gather the last dim           |
| ``gather_from_tp_region``| all-gather the last dim, concat  | split the last dim, keep chunk r  |

With a group of one rank (or ``group=None`` and no initialised process group) every operator
is the identity and issues nothing, so a ``tp_size == 1`` model runs without ``torch.distributed``.

Every collective issued here is recorded by :func:`count_collectives`, which tests and
benchmarks use to compare what a step really issues with the analytic minimum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "get_tp_size",
    "get_tp_rank",
    "copy_to_tp_region",
    "copy_many_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "all_reduce",
    "all_gather_last_dim",
    "barrier",
    "all_gather_objects",
    "count_collectives",
    "agree",
    "digest",
    "AgreementError",
]

_counters: list[Counter] = []


def _record(op: str, tensor: torch.Tensor) -> None:
    for counter in _counters:
        counter[op] += 1
        counter[op + "_numel"] += tensor.numel()


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives tpify issues inside the ``with`` block.

    Yields a :class:`collections.Counter` with, per operation (``all_reduce``,
    ``all_gather``, ``barrier``, ``all_gather_object``), the number of calls and, under ``"<op>_numel"``, the total
    number of elements communicated. Backward passes run inside the block are counted too.
    Operators on a one-rank group issue nothing and count nothing.
    """
    counter: Counter = Counter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def get_tp_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def get_tp_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` (no autograd rule).

    Args:
        tensor: any shape and dtype; reduced in place and returned.
        group: the process group; a one-rank group is a no-op.
        op: ``"sum"`` or ``"max"``.
    """
    if get_tp_size(group) == 1:
        return tensor
    _record("all_reduce", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather equal-sized shards along the last dim and concatenate them in rank order.

    Shapes: input ``(..., n)`` on each of the ``p`` ranks, output ``(..., p * n)``.
    """
    world = get_tp_size(group)
    if world == 1:
        return tensor
    tensor = tensor.contiguous()
    _record("all_gather", tensor)
    chunks = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(chunks, tensor, group=group)
    return torch.cat(chunks, dim=-1)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (default: the world); a no-op without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        _record("barrier", torch.empty(0))
        dist.barrier(group=group)


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order (for reports, not for tensors on a hot path)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    _record("all_gather_object", torch.empty(0))
    dist.all_gather_object(out, obj, group=group)
    return out


class AgreementError(RuntimeError):
    """Ranks that must agree do not: different arguments, models, recipes or tp sizes, or another
    rank failed before the first collective. Raised on every rank at the same point."""


def digest(value) -> str:
    """A short digest of a JSON-able value, for the fingerprints :func:`agree` compares."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def agree(what: str, fingerprint: dict, error: BaseException | None = None,
          group: dist.ProcessGroup | None = None) -> None:
    """The first communication of a tpify entry point: every rank learns every rank's outcome.

    Each rank brings what it checked locally: a ``fingerprint`` (small, picklable values that must
    be equal on every rank: the tp size, a digest of the config, the recipe and the plan, the
    dtype, a path) and the ``error`` its own checks raised, if any. One all-gather of these, then
    every rank decides alike: a rank that failed raises its own error, the others raise an
    :class:`AgreementError` naming that rank and its error; if the fingerprints differ, every rank
    raises an :class:`AgreementError` listing each differing value per rank. So bad input on one
    rank, or ranks launched with different arguments, stop every rank with an error instead of a
    hang or a collective mismatch.

    Without torch.distributed (or a one-rank group) it only re-raises ``error``.

    Communication: one ``all_gather_object`` over ``group`` (default: the world).
    """
    if not (dist.is_available() and dist.is_initialized()) or get_tp_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = (None, f"{type(error).__name__}: {error}") if error is not None else (fingerprint, None)
    everyone = all_gather_objects(mine, group)
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    failed = [(ranks[i], message) for i, (_, message) in enumerate(everyone) if message is not None]
    if failed:
        rank, message = failed[0]
        raise AgreementError(f"{what} failed on rank(s) {[r for r, _ in failed]} (rank {rank}: {message.strip()}); "
                             f"this rank stops here too instead of waiting for it")
    keys = sorted({k for fp, _ in everyone for k in fp})
    differing = [k for k in keys if len({repr(fp.get(k)) for fp, _ in everyone}) > 1]
    if differing:
        parts = [f"{k}: " + ", ".join(f"rank {ranks[i]} {fp.get(k)!r}" for i, (fp, _) in enumerate(everyone))
                 for k in differing]
        raise AgreementError(f"the ranks disagree on {what}: " + "; ".join(parts) + ". Launch every rank with the "
                             f"same model, checkpoint, recipe, tp_size, dtype and arguments.")


def raise_unless(ok: torch.Tensor, error: type[Exception], message: str, detail=None) -> None:
    """Raise ``error(message)`` unless the 0-dim bool tensor ``ok`` is true.

    For data checks whose tensor every rank holds alike (the result of an all-reduce, or the same
    batch), so that every rank raises at the same point. Eagerly it costs one host sync, and
    ``detail()`` (values read from the data) is appended to the message. Under ``torch.compile``
    it becomes ``torch._assert_async(ok, message)``, which stays in the graph (no graph break) and
    raises ``RuntimeError(message)`` when the compiled code runs.
    """
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise error(message if detail is None else f"{message} ({detail()})")


def _split_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = get_tp_size(group)
    if world == 1:
        return tensor
    size = tensor.shape[-1]
    if size % world:
        raise ValueError(f"cannot split a last dimension of {size} over {world} ranks: it is not divisible")
    return tensor.chunk(world, dim=-1)[get_tp_rank(group)].contiguous()


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _CopyManyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        needed = [g for g, need in zip(grads, ctx.needs_input_grad[1:]) if need]
        if not needed:
            return (None,) * (len(grads) + 1)
        dtype = needed[0].dtype
        for g in needed[1:]:
            dtype = torch.promote_types(dtype, g.dtype)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in needed])  # one all-reduce for all of them
        all_reduce(flat, ctx.group)
        out, offset = [None], 0
        for g, need in zip(grads, ctx.needs_input_grad[1:]):
            if not need:
                out.append(None)
                continue
            out.append(flat[offset: offset + g.numel()].view_as(g).to(g.dtype))
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
        return _split_last_dim(x, group)

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
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward.

    Placed where a replicated activation ``(B, T, H)`` enters a column-parallel region, so that
    the partial gradients each rank computes for it are summed. One all-reduce of ``B*T*H``
    values in backward, none in forward.
    """
    if get_tp_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group)


def copy_many_to_tp_region(xs: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """:func:`copy_to_tp_region` of several replicated tensors with one all-reduce in backward.

    Used where a column-parallel region starts from more than one replicated activation, e.g. a
    LoRA adapter on a column-parallel layer: the input ``X (B, T, H)`` and the adapter's
    ``h = A X (B, T, r)`` both enter the region, and the gradients of both are summed over the
    group in a single all-reduce of ``B*T*(H + r)`` values (in the widest of their dtypes).
    Forward: identity, no communication.
    """
    if get_tp_size(group) == 1:
        return tuple(xs)
    return _CopyManyToTPRegion.apply(group, *xs)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward.

    Sums the partial outputs ``(B, T, H)`` of a row-parallel layer or vocab-parallel embedding.
    One all-reduce of the output's size in forward, none in backward.
    """
    if get_tp_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: ``(..., n) -> (..., n / p)``.

    No communication forward; one all-gather of the gradient backward.

    Raises:
        ValueError: the last dim is not divisible by the group size.
    """
    if get_tp_size(group) == 1:
        return x
    return _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim in rank order: ``(..., n / p) -> (..., n)``.

    One all-gather forward; backward keeps this rank's chunk of the gradient (no communication).
    """
    if get_tp_size(group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, group)
