"""PyTorch's data-parallel engines on a tensor-parallel model: DDP over the DP group, FSDP2 and HSDP.

tpify splits one model replica over the ranks of a TP group; data parallelism over the replicas
is torch's own, applied here to the parallelized model (never an engine of tpify's):

* :func:`replicate_data_parallel`: ``DistributedDataParallel(model, process_group=dp_group)``.
  Every rank keeps its TP shard whole; DDP all-reduces (averages) the gradients over the DP group
  in buckets, each launched as soon as its parameters' gradients are accumulated, so the
  reduction overlaps the rest of the backward; ``no_sync()`` skips it for accumulation steps.
* :func:`shard_data_parallel`: FSDP2's ``fully_shard`` per transformer block, then on the model,
  over the data-parallel axes of the model's DeviceMesh (:func:`tpify.mesh.fsdp_mesh`): each TP
  shard is split further along its dim 0 over ``dp_shard`` ranks (parameters, gradients and the
  optimizer state that follows them), and, with ``dp_replicate > 1``, replicated over the
  ``dp_replicate`` groups (HSDP: reduce-scatter inside a group, all-reduce across groups).

What tpify does to gradients itself finishes before either engine reads a gradient: the
all-reduces of replicated parameters inside a sharded region or a sequence-parallel stretch are
tensor hooks on the parameter (torch runs them before ``AccumulateGrad``; DDP's reducer is a
post-hook of that node, FSDP2's reduce-scatter runs after the block's backward), and the
row-parallel bias under sequence parallelism, the packed replicated parts and LoRA's factors are
summed inside the autograd graph (:func:`tpify.comm.sum_grad_ranges`,
:func:`tpify.comm.copy_many_to_tp_region`). Each DP replica's gradient is therefore the dense
model's gradient of its batch before the engine averages it over DP.

Gradient clipping by the dense model's norm is :func:`tpify.training.clip_grad_norm_` under both
(under FSDP2 it sums the gradients' squares over the shard axis, then over TP); saving,
:func:`tpify.save_pretrained` (under FSDP2 each tensor is gathered over DP, then over TP).
"""

from __future__ import annotations

from torch import nn

from .agree import agree
from .context_parallel import refuse as refuse_context_parallel
from .info import TPUsageError, find_tp_model, get_tp_info
from .sharding import is_dtensor

__all__ = ["replicate_data_parallel", "shard_data_parallel", "transformer_blocks", "planned_dp_shard"]


def _tp_model(model: nn.Module, what: str) -> nn.Module:
    tp_model = find_tp_model(model)
    if tp_model is None:
        raise TPUsageError(f"{what}: {type(model).__name__} was not parallelized by tpify; call tpify.parallelize "
                           f"(or tpify.from_pretrained) first, then {what}")
    return tp_model


def _refuse_wrapped(model: nn.Module, what: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or any(isinstance(m, DistributedDataParallel)
                                                         for m in model.modules()):
        raise TPUsageError(f"{what}: the model is already inside a DistributedDataParallel; apply one data-parallel "
                           f"engine to the tpify model")
    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError(f"{what}: {type(model).__name__}'s parameters are DTensors already (fully_shard or a "
                           f"DTensor plan was applied); apply {what} once, to the model tpify.parallelize returned")


def replicate_data_parallel(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """``torch.nn.parallel.DistributedDataParallel`` over the model's DP group.

    Each rank keeps its TP shard whole; DDP averages every gradient over the DP group (the ranks
    holding the same shard), in buckets overlapped with the backward, and broadcasts DP rank 0's
    parameters and buffers at construction (the same shard of the same dense model). Use the
    returned module for forward and backward (``ddp.module`` is the model; ``ddp.no_sync()`` for
    gradient accumulation), :func:`tpify.training.clip_grad_norm_` on either, and
    :func:`tpify.save_pretrained` on the model. tpify's own gradient work is finished before DDP
    reads a gradient (module docstring). With no DP group (``dp == 1``) the model is returned
    unwrapped.

    Args:
        model: a tpify model, or a PEFT model on one (its TP/DP groups are the model's).
        ddp_kwargs: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``device_ids``,
            ...), except ``process_group``, which is the DP group.

    Communication: one agreement (:func:`tpify.agree.agree`, the store) before DDP's construction
    (which checks shapes and broadcasts over the DP group); per backward, DDP's bucketed
    all-reduces over the DP group (one float per gradient element).

    Raises:
        TPUsageError: on every rank: not a tpify model, already inside a DDP or sharded by FSDP2,
            ``process_group`` passed.
        AgreementError: another rank failed, or the ranks disagree on the DP size.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

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
    import torch.distributed as dist

    world = dist.get_world_size()
    dp = world // info.tp_size
    if dp_replicate is not None and (not isinstance(dp_replicate, int) or dp_replicate < 1 or dp % dp_replicate):
        raise ValueError(f"shard_data_parallel: dp_replicate = {dp_replicate!r} must be a positive divisor of the "
                         f"data-parallel size {dp} (world {world} / tp_size {info.tp_size}); dp_shard = dp / "
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

    ``fully_shard`` on every transformer block (:func:`transformer_blocks`, in module order), then
    on the tpify model itself (the root unit: embeddings, the LM head, tied or not, in one unit,
    and the final norm), over :func:`tpify.mesh.fsdp_mesh` of the model's mesh: 1-D
    ``"dp_shard"`` (FSDP2), or 2-D ``("dp_replicate", "dp_shard")`` when ``dp_replicate > 1``
    (HSDP). FSDP2 then holds, per rank, ``1/dp_shard`` of each of its TP shards (dim 0, padded
    evenly) as DTensors; the optimizer built afterwards holds its state for those slices only.
    The forward all-gathers a unit's slices over ``dp_shard`` just before the unit runs (tpify's
    layers see their whole TP shard, as without FSDP), the backward reduce-scatters its gradient
    (HSDP: then all-reduces it over ``dp_replicate``), averaged over the whole DP group. Build the
    optimizer after this call; add LoRA adapters (:func:`tpify.integrations.get_peft_model`)
    before it.

    Then: :func:`tpify.training.clip_grad_norm_` clips by the dense model's norm (shard axis,
    then TP); :func:`tpify.training.check_replicas` compares each rank's slices;
    :func:`tpify.save_pretrained` gathers each tensor over DP, then TP; ``generate`` works (every
    rank of the world calls it: each forward all-gathers over DP).

    Args:
        model: a tpify model (or a PEFT model on one), not yet wrapped.
        dp_replicate: replicas of the sharded model (HSDP); ``dp_shard = dp / dp_replicate``.
            Default: the model's mesh's (1 for a mesh :func:`tpify.parallelize` made: FSDP2 over
            the whole DP group). Another value builds the mesh of that shape
            (:func:`tpify.mesh.init_mesh`; the same ranks: its DP axes flattened are the model's
            DP group).
        reshard_after_forward, mp_policy, offload_policy: ``fully_shard``'s own arguments, passed
            through to every unit (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``: bf16 compute, fp32 gradient reduction;
            ``CPUOffloadPolicy()``: parameters, gradients and optimizer state on the host).
            ``None``: FSDP2's defaults.
        blocks: the block classes (or class names) to shard one by one; default the model's
            ``_no_split_modules``.

    Communication: one agreement (:func:`tpify.agree.agree`, the store) on the arguments before
    any collective; the mesh's groups when it is new; ``fully_shard`` itself issues none. Per
    step, FSDP2's all-gathers and reduce-scatters over ``dp_shard`` (and all-reduces over
    ``dp_replicate``), one per unit each way.

    Raises:
        TPUsageError: on every rank: not a tpify model; already sharded or inside a DDP; no
            transformer block found (pass ``blocks=``); a context-parallel model (not supported yet).
        ValueError: on every rank: ``dp_replicate`` not dividing the DP size; groups made by hand
            that are not a mesh's layout.
        AgreementError: another rank failed, or the ranks passed other arguments.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from .info import record_specs
    from .mesh import fsdp_mesh, init_mesh, mesh_device_type

    error, info, shape, units = None, None, None, []
    try:
        tp_model = _tp_model(model, "shard_data_parallel")
        info = get_tp_info(tp_model)
        refuse_context_parallel(info, "tpify.shard_data_parallel (FSDP2)")
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
        mesh = init_mesh(info.tp_size, replicate, device_type=info.mesh.device_type if info.mesh is not None
                         else mesh_device_type(find_tp_model(model)))
    kwargs = {"mesh": fsdp_mesh(mesh), "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for _, unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(find_tp_model(model), **kwargs)
    return model
