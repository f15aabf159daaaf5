"""Training utilities for DP x TP: gradient averaging over the DP group, global-norm clipping.

With ``world = dp * tp`` (see :mod:`tpify.mesh`), the ranks of one TP group hold the shards of
one model replica and see the same batch; the ``dp`` replicas see different batches. After
``loss.backward()`` each shard's gradient is averaged over its DP group
(:func:`sync_gradients`), and the gradient norm used for clipping is that of the whole dense
model: squares of sharded gradients summed over the TP group, replicated ones counted once
(:func:`clip_grad_norm_`; MECHANICS.md "Parameters, gradients, memory").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import comm
from .sharding import shard_spec_of

__all__ = ["sync_gradients", "grad_norm", "clip_grad_norm_"]


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # parameters() yields a tied one once


def _groups(model: nn.Module):
    info = getattr(model, "tp_info", None)
    return (info.tp_group, info.dp_group) if info is not None else (None, None)


def sync_gradients(model: nn.Module) -> None:
    """Average every gradient over the model's DP group, in place.

    Gradients are flattened into one buffer per dtype, so a step issues one all-reduce per
    dtype (of all gradient elements this rank holds) instead of one per parameter.

    Communication: one all-reduce (sum) per gradient dtype over the DP group; none when
    ``dp == 1`` or the model was not parallelized with a DP group.
    """
    _, dp_group = _groups(model)
    dp_size = comm.get_tp_size(dp_group)
    if dp_group is None or dp_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in _unique_params(model):
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, dp_group)
        flat /= dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The L2 norm of the gradient of the whole dense model, identical on every rank.

    ``sqrt(sum over TP of ||g_sharded||^2 + ||g_replicated||^2)``: replicated gradients are the
    same on every TP rank and are counted once. Padded vocabulary rows have zero gradient.
    Returns a float32 scalar tensor on the gradients' device.

    Communication: one all-reduce (sum) of one float over the TP group.

    Raises:
        NotImplementedError: ``norm_type`` other than 2.
    """
    if norm_type != 2.0:
        raise NotImplementedError("tpify.grad_norm supports the L2 norm (norm_type=2) only")
    tp_group, _ = _groups(model)
    params = [p for p in _unique_params(model) if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        sq = p.grad.detach().float().pow(2).sum()
        if shard_spec_of(p) is not None:
            sharded += sq
        else:
            replicated += sq
    comm.all_reduce(sharded, tp_group)
    return (sharded + replicated).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale all gradients so the dense model's gradient norm is at most ``max_norm``.

    Same rule as :func:`torch.nn.utils.clip_grad_norm_` (coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1), applied with the TP-global norm of :func:`grad_norm`. Returns the norm before
    clipping. Communication: that of :func:`grad_norm`.
    """
    total = grad_norm(model)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if math.isfinite(float(total)):
        for p in _unique_params(model):
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return total
