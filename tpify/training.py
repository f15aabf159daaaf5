"""Training utilities for DP x TP: global-norm clipping, the replica check, a DP-average fallback.

With ``world = dp * tp`` (see :mod:`tpify.mesh`), the ranks of one TP group hold the shards of
one model replica and see the same batch; the ``dp`` replicas see different batches. Data
parallelism is torch's (:mod:`tpify.data_parallel`: DDP over the DP group, FSDP2/HSDP over the
mesh's DP axes). The gradient norm used for clipping is that of the whole dense model: squares
of sharded gradients summed over the TP group (under FSDP2 over its shard axis first),
replicated ones counted once (:func:`clip_grad_norm_`; docs/mechanics.md "Gradients, clipping,
memory"). The Trainer and accelerate adapters (:mod:`tpify.integrations`) call these same
functions. :func:`sync_gradients` averages gradients over DP after the backward, in one flat
all-reduce: a fallback for loops that cannot run the model inside DDP.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from . import comm
from .agree import AgreementError
from .hooks.guards import flush_checks
from .info import TPUsageError, param_specs, tp_info_of
from .sharding import is_dtensor, shard_spec_of

__all__ = ["sync_gradients", "grad_norm", "clip_grad_norm_", "params_grad_norm", "clip_params_grad_norm_",
           "check_replicas"]


def _trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out, seen = [], set()
    for p in params:
        if p.requires_grad and id(p) not in seen:  # a tied parameter once
            seen.add(id(p))
            out.append(p)
    return out


def _groups(model: nn.Module):
    info = tp_info_of(model)
    return (info.tp_group, info.dp_group) if info is not None else (None, None)


def _refuse_fsdp(model: nn.Module, what: str) -> None:
    """Raise when FSDP2 manages ``model``'s parameters (they are DTensors): it reduces gradients
    itself."""
    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError(f"{what}: {type(model).__name__}'s parameters are DTensors (FSDP2's fully_shard): FSDP2 "
                           f"reduces the gradients over the data-parallel dimension itself; do not call {what} on it")


def sync_gradients(model: nn.Module) -> None:
    """Average every gradient over the model's DP group, in place, after the backward: a fallback
    for loops that cannot run the model inside DDP (prefer
    :func:`tpify.data_parallel.replicate_data_parallel`, which overlaps the reduction with the
    backward; benchmarks/bench_scaling.py measures both).

    One buffer per gradient dtype, one all-reduce each. Parameters that hold a gradient may differ
    between replicas (a module one batch did not use): a presence mask is all-reduced first, a
    missing gradient counts as zero, and a parameter no replica has a gradient for keeps
    ``grad=None``. Idempotent on values already averaged.

    Communication: over the DP group, one all-reduce of one int per trainable parameter, then one
    all-reduce (sum) per gradient dtype; none when ``dp == 1`` or there is no DP group.

    Raises:
        TPUsageError: FSDP2 wraps the model (DTensor parameters): it reduces gradients itself.
    """
    _refuse_fsdp(model, "tpify.training.sync_gradients")
    _, dp_group = _groups(model)
    dp_size = comm.group_size(dp_group)
    if dp_group is None or dp_size == 1:
        return
    params = _trainable(model.parameters())
    if not params:
        return
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    comm.all_reduce(present, dp_group, op="max")
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p, has in zip(params, present.tolist()):
        if not has:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        comm.all_reduce(flat, dp_group)
        flat /= dp_size
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset: offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``: a DTensor's local shard (FSDP2), or ``t`` itself."""

    return t.to_local() if is_dtensor(t) else t


def _sharded_groups(t: torch.Tensor) -> tuple:
    """The process groups over which a DTensor ``t`` is split (its mesh dimensions with a
    ``Shard`` placement: FSDP2's data-parallel dimension); ``()`` for a plain tensor or a
    replicated DTensor."""

    if not is_dtensor(t):
        return ()
    return tuple(t.device_mesh.get_group(i) for i, placement in enumerate(t.placements) if placement.is_shard())


def _replicated_ranges(grad: torch.Tensor, spec) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges, along ``spec.dim`` of this rank's local gradient, of the
    replicated parts: :meth:`ShardSpec.replicated_local_ranges` for a plain tensor; for FSDP2's
    DTensor (its TP shard split over DP), those ranges intersected with the rows it holds where
    FSDP2 splits ``spec.dim`` (other dimensions keep every index of ``spec.dim``)."""
    ranges = spec.replicated_local_ranges()
    if not is_dtensor(grad):
        return ranges

    shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
    start, stop = offset[spec.dim], offset[spec.dim] + shape[spec.dim]
    return [(max(a, start) - start, min(b, stop) - start) for a, b in ranges if min(b, stop) > max(a, start)]


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of ``[0, size)`` outside the sorted, disjoint ``ranges``."""
    out, at = [], 0
    for a, b in ranges:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, size)] if size > at else [])


def _sum_of_squares(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``sum_i ||t_i||^2`` as a 0-dim ``dtype`` tensor on ``device``: one ``torch._foreach_norm`` per
    (device, dtype) group, accumulated in ``dtype`` (no copy of a tensor in that dtype is made)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    total = torch.zeros((), dtype=dtype, device=device)
    for group in groups.values():
        norms = torch._foreach_norm(group, 2.0, dtype=dtype)
        total = total + torch.stack(norms).square().sum().to(device)
    return total


def params_grad_norm(params: Iterable[torch.Tensor], tp_group, norm_type: float = 2.0,
                     specs: dict | None = None) -> torch.Tensor:
    """The L2 norm of the dense gradient of ``params``, identical on every rank of ``tp_group``.

    ``sqrt(sum over TP of ||g_sharded||^2 + ||g_replicated||^2)``: a shard (a parameter with a
    :class:`~tpify.sharding.ShardSpec`) is summed over TP, a replicated parameter or replicated
    part (multi-query K/V) counted once (KV heads held by groups of ``g`` ranks: ``1/g`` of their
    squares per rank); uneven splits and padded rows need nothing more. Under FSDP2 a gradient split
    over the DP dimension is summed over it first (``torch.nn.utils.clip_grad_norm_`` would give each
    TP rank its own norm, and the replicas would drift apart). Squares from ``torch._foreach_norm``
    per (device, dtype), accumulated in the result's dtype: a float32 scalar (float64 when a gradient
    is) on the gradients' device; no host sync.

    ``specs``: ``{id(parameter): ShardSpec or None}`` (:func:`tpify.info.param_specs`), needed for
    FSDP2's DTensors; default each parameter's attribute.

    Communication: one all-reduce of one value over ``tp_group``; under FSDP2, before it, one of
    two values over each data-parallel group the gradients are split over.

    Raises:
        NotImplementedError: ``norm_type`` other than 2.
    """
    if norm_type != 2.0:
        raise NotImplementedError("tpify: the tensor-parallel gradient norm supports the L2 norm (norm_type=2) only")
    params = [p for p in _trainable(params) if p.grad is not None]
    device = _local(params[0].grad).device if params else torch.device("cpu")
    dtype = torch.float64 if any(p.grad.dtype == torch.float64 for p in params) else torch.float32
    # DP groups the gradients are split over -> (summed over TP, counted once, {g: 1/g of it per rank})
    lists: dict[tuple, tuple[list, list, dict]] = {}
    for p in params:
        spec = specs[id(p)] if specs is not None else shard_spec_of(p)
        grad = _local(p.grad).detach()
        sharded, once, partial = lists.setdefault(_sharded_groups(p.grad), ([], [], {}))
        if spec is None:
            once.append(grad)
            continue
        rep = _replicated_ranges(p.grad, spec)
        if not rep:
            sharded.append(grad)
            continue
        # Replicated parts (K/V) hold the same gradient on each of the replica_group_size ranks holding
        # their KV head: counted once (multi-query: on every rank alike; else 1/g of it per rank, summed over TP).
        # Under FSDP2 this rank holds some rows of them: their squares, summed over DP below.
        sharded += [grad.narrow(spec.dim, a, b - a) for a, b in _complement(rep, grad.shape[spec.dim])]
        slices = [grad.narrow(spec.dim, a, b - a) for a, b in rep]
        if spec.replica_group_size == spec.tp_size:
            once += slices
        else:
            partial.setdefault(spec.replica_group_size, []).extend(slices)
    total_sharded = torch.zeros((), dtype=dtype, device=device)
    total_once = torch.zeros((), dtype=dtype, device=device)
    for groups, (sharded, once, partial) in lists.items():
        part_sharded = _sum_of_squares(sharded, dtype, device)
        for g, slices in partial.items():
            part_sharded = part_sharded + _sum_of_squares(slices, dtype, device) / g
        packed = torch.stack([part_sharded, _sum_of_squares(once, dtype, device)])
        for group in groups:  # FSDP2: each rank holds a slice of the gradient along the DP dimension
            comm.all_reduce(packed, group)
        total_sharded += packed[0]
        total_once += packed[1]
    comm.all_reduce(total_sharded, tp_group)
    return (total_sharded + total_once).sqrt()


def clip_params_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, tp_group,
                           specs: dict | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their dense norm is at most ``max_norm``.

    Same rule as :func:`torch.nn.utils.clip_grad_norm_` (coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1), applied with the TP-global norm of :func:`params_grad_norm` (``specs``: as
    there); nothing is scaled when the norm is not finite (the coefficient is 1 there). Returns
    the norm before clipping, on the device. The coefficient is computed and applied on the
    device (``torch._foreach_mul_`` per (device, dtype) group, in the gradients' dtype): no host
    sync. Communication: that of :func:`params_grad_norm`.
    """
    params = _trainable(params)
    total = params_grad_norm(params, tp_group, specs=specs)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = _local(p.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return total


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """:func:`params_grad_norm` of all the trainable parameters of a parallelized ``model`` (also
    one FSDP2's ``fully_shard`` wraps over the data-parallel dimension)."""
    tp_group, _ = _groups(model)
    return params_grad_norm(model.parameters(), tp_group, norm_type, specs=param_specs(model))


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """:func:`clip_params_grad_norm_` of all the trainable parameters of a parallelized ``model``
    (also one FSDP2's ``fully_shard`` wraps over the data-parallel dimension: use this, not
    ``torch.nn.utils.clip_grad_norm_``, which would clip each TP rank by its own norm)."""
    tp_group, _ = _groups(model)
    return clip_params_grad_norm_(model.parameters(), max_norm, tp_group, specs=param_specs(model))


def _digest(t: torch.Tensor) -> str:
    local = _local(t).detach().cpu().contiguous()
    return hashlib.sha1(local.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _replicated_groups(t: torch.Tensor) -> tuple:
    """The process groups over which a DTensor ``t`` is replicated (HSDP's replicate axis)."""

    return tuple(t.device_mesh.get_group(i) for i, placement in enumerate(t.placements) if placement.is_replicate())


def check_replicas(model: nn.Module) -> None:
    """Check, bit for bit (a SHA-1 of each parameter's bytes), that the copies that should be equal are.

    A replicated parameter must be identical on the ranks of a TP group, and every parameter on the
    DP replicas of a TP rank; they drift apart silently when ranks apply different updates (a
    per-rank clipping norm, a DDP over the wrong group, another batch on one TP rank). Under FSDP2
    each rank compares its local slice (over DP, only the replicas HSDP keeps). First it raises what
    the model's last call's data checks found (:func:`tpify.hooks.guards.flush_checks`).
    ``tpify finetune`` calls it after loading and before every save.

    Communication: at tp > 1 one all-reduce of 4 values on the host (the last call's inputs); one
    ``all_gather_object`` of the digests over the TP group, the DP group (HSDP: the replicate group)
    and each KV group; then the problems found over TP and DP, so that every rank learns them.

    Raises:
        AgreementError: on every rank of the model, naming the parameters that differ and the ranks.
        ValueError, IndexError, TPUsageError: what the last call's data checks found.
    """
    flush_checks(model)  # what the last call's data checks found (else raised at the next call)
    tp_group, dp_group = _groups(model)
    specs = param_specs(model)
    digests, replicated = {}, set()
    kv_groups: dict[int, set] = {}  # KV heads -> names equal within each group of ranks holding one
    copies: dict = {}  # a DP-side group -> names whose local bytes must be equal across it
    for name, p in model.named_parameters():
        digests[name] = _digest(p)
        dp_side = _replicated_groups(p) if is_dtensor(p) else (dp_group,)
        keys = [name]
        spec = specs[id(p)]
        if spec is None:
            replicated.add(name)
        elif spec.replicated:  # the replicated parts (K/V): equal on the ranks holding the same KV head
            key = f"{name} (replicated parts)"
            local = _local(p).detach()
            digests[key] = _digest(torch.cat([local.narrow(spec.dim, a, b - a)
                                              for a, b in _replicated_ranges(p, spec)] or [local[:0]], dim=spec.dim))
            if spec.replica_group_size == spec.tp_size:
                replicated.add(key)
            else:
                kv_groups.setdefault(spec.replica_shards, set()).add(key)
            keys.append(key)
        for group in dp_side:
            copies.setdefault(group, set()).update(keys)
    problems = []
    checks = [(tp_group, replicated, "TP ranks")] + [(g, names, "DP replicas") for g, names in copies.items()]
    info = tp_info_of(model)
    checks += [(info.replica_groups[n], names, f"TP ranks holding the same of {n} KV heads")
               for n, names in kv_groups.items()]
    for group, names, what in checks:
        if group is None or comm.group_size(group) == 1:  # None: no such group (not the world)
            continue
        everyone = comm.all_gather_objects({n: digests[n] for n in sorted(names)}, group)
        ranks = dist.get_process_group_ranks(group)
        for n in sorted(names):
            values = [d[n] for d in everyone]
            if len(set(values)) > 1:
                groups = {}
                for r, v in zip(ranks, values):
                    groups.setdefault(v, []).append(r)
                problems.append(f"{n} differs between {what} ({', '.join(f'ranks {g}' for g in groups.values())})")
    # A drift is found by the ranks of the group it happened in only (one TP group, one KV group,
    # one DP group): every rank of the model learns every rank's findings, over TP then over DP
    # (each DP group holds one rank of every TP group), so every rank raises here, none goes on alone.
    for group in (tp_group, dp_group):
        if group is not None and comm.group_size(group) > 1:
            problems = sorted({p for found in comm.all_gather_objects(problems, group) for p in found})
    if problems:
        raise AgreementError(f"replicated parameters differ across ranks: {problems[:10]}"
                             f"{' ...' if len(problems) > 10 else ''}; the replicas have drifted apart")
