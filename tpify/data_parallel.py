"""PyTorch's data-parallel engines on a tensor-parallel model: DDP over the DP group, FSDP2 and HSDP
(docs/scaling-out.md).

* :func:`replicate_data_parallel`: ``DistributedDataParallel(model, process_group=dp_group)``:
  every rank keeps its TP shard whole; DDP averages gradients over the DP group in buckets,
  overlapped with the backward.
* :func:`shard_data_parallel`: FSDP2's ``fully_shard`` per transformer block, then on the model,
  over the DP axes of the model's mesh (:func:`tpify.mesh.fsdp_mesh`): each TP shard split again
  along dim 0 over ``dp_shard`` and, with ``dp_replicate > 1``, replicated (HSDP). Under context
  parallelism over ``dp_shard x cp`` (torchtitan's): the CP group's partial gradients are added by
  FSDP2's reduce-scatter, which divides by the DP size only, instead of tpify's own CP sum.

What tpify does to gradients itself (replicated parameters summed inside a sharded or
sequence-parallel region: tensor hooks that run before ``AccumulateGrad``, or sums inside the
autograd graph) finishes before either engine reads a gradient, so each replica's gradient is
the dense model's gradient of its batch. Clipping: :func:`tpify.training.clip_grad_norm_`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .agree import agree
from .info import TPUsageError, find_tp_model, get_tp_info, record_specs
from .mesh import fsdp_mesh, init_mesh, mesh_device_type
from .quantized import is_quantized
from .sharding import is_dtensor

__all__ = ["replicate_data_parallel", "shard_data_parallel", "transformer_blocks", "planned_dp_shard"]


def _tp_model(model: nn.Module, what: str) -> nn.Module:
    tp_model = find_tp_model(model)
    if tp_model is None:
        raise TPUsageError(f"{what}: {type(model).__name__} was not parallelized by tpify; call tpify.parallelize "
                           f"(or tpify.from_pretrained) first, then {what}")
    return tp_model


def _refuse_wrapped(model: nn.Module, what: str) -> None:
    if isinstance(model, DistributedDataParallel) or any(isinstance(m, DistributedDataParallel)
                                                         for m in model.modules()):
        raise TPUsageError(f"{what}: the model is already inside a DistributedDataParallel; apply one data-parallel "
                           f"engine to the tpify model")
    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError(f"{what}: {type(model).__name__}'s parameters are DTensors already (fully_shard or a "
                           f"DTensor plan was applied); apply {what} once, to the model tpify.parallelize returned")


def replicate_data_parallel(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """``torch.nn.parallel.DistributedDataParallel`` over the model's DP group.

    Each rank keeps its TP shard whole; DDP averages every gradient over the DP group in buckets
    overlapped with the backward, and broadcasts DP rank 0's parameters at construction. Use the
    returned module for forward and backward (``no_sync()`` for accumulation),
    :func:`tpify.training.clip_grad_norm_` and :func:`tpify.save_pretrained` on the model. With no
    DP group the model is returned unwrapped. ``ddp_kwargs`` go to ``DistributedDataParallel``,
    except ``process_group`` (the DP group).

    Communication: one agreement before DDP's construction (which broadcasts over the DP group);
    per backward, DDP's bucketed all-reduces over the DP group.

    Raises:
        TPUsageError: on every rank: not a tpify model, already inside a DDP or sharded by FSDP2,
            ``process_group`` passed.
        AgreementError: another rank failed, or the ranks disagree on the DP size.
    """
    error, info = None, None
    try:
        info = get_tp_info(_tp_model(model, "replicate_data_parallel"))
        _refuse_wrapped(model, "replicate_data_parallel")
        if "process_group" in ddp_kwargs:
            raise TPUsageError("replicate_data_parallel: process_group is the model's DP group "
                               "(model.tp_info.dp_group); do not pass it")
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    dp_size = dist.get_world_size(info.dp_group) if info is not None and info.dp_group is not None else 1
    agree("tpify.replicate_data_parallel", {"dp_size": dp_size, "options": sorted(ddp_kwargs)}, error)
    if dp_size == 1:
        return model
    return DistributedDataParallel(model, process_group=info.dp_group, **ddp_kwargs)


def transformer_blocks(model: nn.Module, classes=None) -> list[tuple[str, nn.Module]]:
    """``[(fqn, module)]``: the outermost modules of ``model`` whose class (or class name) is in
    ``classes``; default the model's ``_no_split_modules`` (Hugging Face's list of its transformer
    block classes, which accelerate's FSDP auto-wrap uses too). Local."""
    tp_model = find_tp_model(model) or model
    if classes is None:
        classes = getattr(tp_model, "_no_split_modules", None) or []
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    found, inside = [], []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix + ".") for prefix in inside):
            continue
        if type(module).__name__ in names:
            found.append((fqn, module))
            inside.append(fqn)
    return found


def _fsdp_mesh_for(info, dp_replicate: int | None):
    """``(mesh, dp_replicate, dp_shard, needs_new)``: the model's DeviceMesh, or the shape
    :func:`tpify.mesh.init_mesh` must build, after local checks.

    Raises:
        ValueError: ``dp_replicate`` does not divide the DP size; the model's groups are not the
            contiguous layout a mesh has (groups passed by hand).
    """
    world = dist.get_world_size()
    dp = world // (info.tp_size * info.cp_size)
    if dp_replicate is not None and (not isinstance(dp_replicate, int) or dp_replicate < 1 or dp % dp_replicate):
        cp = f" / cp_size {info.cp_size}" if info.cp_size > 1 else ""
        raise ValueError(f"shard_data_parallel: dp_replicate = {dp_replicate!r} must be a positive divisor of the "
                         f"data-parallel size {dp} (world {world} / tp_size {info.tp_size}{cp}); dp_shard = dp / "
                         f"dp_replicate")
    mesh = info.mesh
    if mesh is not None:
        current = mesh["dp_replicate"].size() if "dp_replicate" in (mesh.mesh_dim_names or ()) else 1
        if dp_replicate is None or dp_replicate == current:
            return mesh, current, dp // current, False
        return None, dp_replicate, dp // dp_replicate, True
    rank, tp = dist.get_rank(), info.tp_size
    tp_ranks = sorted(dist.get_process_group_ranks(info.tp_group)) if info.tp_group is not None else list(range(world))
    dp_ranks = sorted(dist.get_process_group_ranks(info.dp_group)) if info.dp_group is not None else [rank]
    contiguous = (tp_ranks == list(range(rank - rank % tp, rank - rank % tp + tp))
                  and dp_ranks == list(range(rank % tp, world, tp)))
    if not contiguous:
        raise ValueError(f"shard_data_parallel needs the model's groups laid out as a mesh (TP groups of contiguous "
                         f"ranks, the DP group every {tp}-th rank); this rank's TP group is {tp_ranks} and its DP "
                         f"group {dp_ranks}. Parallelize with mesh=tpify.init_mesh(tp_size, dp_replicate) (or "
                         f"tp_size=) instead of groups made by hand")
    replicate = dp_replicate or 1
    return None, replicate, dp // replicate, True


def planned_dp_shard(model: nn.Module, dp_replicate: int | None = None) -> int:
    """How many ranks :func:`shard_data_parallel` would split each TP shard of ``model`` over with
    this ``dp_replicate`` (local; raises as :func:`shard_data_parallel` would)."""
    return _fsdp_mesh_for(get_tp_info(_tp_model(model, "shard_data_parallel")), dp_replicate)[2]


def shard_data_parallel(model: nn.Module, *, dp_replicate: int | None = None, reshard_after_forward=None,
                        mp_policy=None, offload_policy=None, blocks=None) -> nn.Module:
    """FSDP2 (or HSDP) over the data-parallel axes of a tensor-parallel model, in place; returns it.

    ``fully_shard`` on every transformer block (:func:`transformer_blocks`), then on the tpify
    model (embeddings, LM head and final norm in one root unit), over :func:`tpify.mesh.fsdp_mesh`:
    1-D ``"dp_shard"``, or 2-D ``("dp_replicate", "dp_shard")`` when ``dp_replicate > 1``. Each rank
    then holds ``1/dp_shard`` of each TP shard (dim 0) as a DTensor; tpify's layers still see
    their whole TP shard in the forward. Build the optimizer after this call; add LoRA adapters
    before it.

    Under context parallelism (a model on ``tpify.init_mesh(tp, cp_size=cp)``) the shard axis is
    ``"dp_shard_cp"`` (``dp_shard x cp`` ranks, torchtitan's): each rank holds ``1/(dp_shard x cp)``
    of each TP shard. Each rank of a CP group computes the gradient of its own tokens' terms of the
    dense loss; FSDP2's reduce-scatter sums them over the CP group and the DP ranks and divides by
    the DP size only (``set_gradient_divide_factor(dp_replicate x dp_shard)``, sum reductions), and
    tpify's own sum over the CP group is handed off (:meth:`tpify.grad_sums.SummedGrads.hand_off`;
    the TP group's sum of partial gradients, sequence parallelism's, then runs over TP only).

    Args:
        model: a tpify model (or a PEFT model on one), not yet wrapped.
        dp_replicate: replicas of the sharded model (HSDP); default the model's mesh's (1 for the
            mesh :func:`tpify.parallelize` made); another value builds that mesh (same ranks).
        reshard_after_forward, mp_policy, offload_policy: ``fully_shard``'s own, passed to every unit.
        blocks: the block classes (or names) to shard one by one; default ``_no_split_modules``.

    Communication: one agreement on the arguments first; the mesh's groups when new. Per step,
    FSDP2's all-gathers and reduce-scatters over ``dp_shard`` (``dp_shard x cp`` under context
    parallelism; all-reduces over ``dp_replicate``).

    Raises:
        TPUsageError: on every rank: not a tpify model; already sharded or inside a DDP; no
            transformer block found (pass ``blocks=``); a quantized base (:mod:`tpify.quantized`).
        ValueError: on every rank: ``dp_replicate`` not dividing the DP size; hand-made groups that
            are not a mesh's layout.
        AgreementError: another rank failed, or the ranks passed other arguments.
    """
    error, info, shape, units = None, None, None, []
    try:
        tp_model = _tp_model(model, "shard_data_parallel")
        info = get_tp_info(tp_model)
        if is_quantized(model):
            raise TPUsageError("shard_data_parallel (FSDP2) over a quantized tensor-parallel base is not built (its "
                               "4-bit shards are buffers FSDP2 would not shard); use DDP over the DP group "
                               "(tpify.replicate_data_parallel) or more tensor parallelism")
        _refuse_wrapped(model, "shard_data_parallel")
        units = transformer_blocks(model, blocks)
        if not units:
            raise TPUsageError(f"shard_data_parallel: no transformer block found in {type(tp_model).__name__} (looked "
                               f"for classes {blocks or getattr(tp_model, '_no_split_modules', None)}); pass blocks= "
                               f"the block classes to shard one by one")
        for name, value, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                                  ("offload_policy", offload_policy, OffloadPolicy)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"shard_data_parallel: {name} must be a torch {kind.__name__}, got "
                                f"{type(value).__name__}")
        shape = _fsdp_mesh_for(info, dp_replicate)
        record_specs(tp_model)  # the ShardSpecs by name, read back once the parameters are DTensors
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree("tpify.shard_data_parallel",
          {"dp_replicate x dp_shard": shape[1:3] if shape else None, "units": [n for n, _ in units],
           "reshard_after_forward": reshard_after_forward, "mp_policy": repr(mp_policy),
           "offload_policy": repr(offload_policy)}, error)
    mesh, replicate, _, needs_new = shape
    if needs_new:
        mesh = init_mesh(info.tp_size, replicate, cp_size=info.cp_size,
                         device_type=info.mesh.device_type if info.mesh is not None
                         else mesh_device_type(find_tp_model(model)))
    kwargs = {"mesh": fsdp_mesh(mesh), "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for _, unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(find_tp_model(model), **kwargs)
    if info.cp_size > 1:
        _context_parallel_grads_to_fsdp(info, [unit for _, unit in units] + [find_tp_model(model)],
                                        dp=_dp_size(info))
    return model


def _dp_size(info) -> int:
    """The data-parallel size of a tpify model's layout: ``world / (tp x cp)``. Local."""
    return dist.get_world_size() // (info.tp_size * info.cp_size)


def _context_parallel_grads_to_fsdp(info, fsdp_modules: list, dp: int) -> None:
    """FSDP2 over ``dp_shard x cp`` adds the CP group's partial gradients in its reduce-scatter:
    divide by the DP size only (sum reductions, the division after), hand tpify's own sum over the
    CP group off, and sum the TP group's partial gradients (sequence parallelism's) over TP only.
    Local; the same on every rank."""
    from .grad_sums import SummedGrads

    for module in fsdp_modules:
        module.set_gradient_divide_factor(float(dp))
        module.set_force_sum_reduction_for_comms(True)
    tp_summed = info.ctx.summed_grads
    for handle in info.hooks:
        if isinstance(handle, SummedGrads) and handle is not tp_summed:
            handle.hand_off()  # context parallelism's (tpify.hooks.context_parallel)
    if tp_summed is not None:
        tp_summed.group = info.tp_group
