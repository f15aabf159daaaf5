"""Data parallelism of pipeline stages: torch's FSDP2 (or HSDP) or its composable ``replicate`` on
each stage module.

What torchtitan does: each stage module is sharded with FSDP2's ``fully_shard`` over the mesh's
``dp_shard`` axis (HSDP over ``("dp_replicate", "dp_shard")``: :func:`shard_stages`) or
replicated over the flattened dp axes (:func:`replicate_stages`: torch's
``replicate_with_fsdp``, DDP's semantics) before the schedule is built. torch's pipelining then
drives the engine across the microbatches (``torch/distributed/pipelining/stage.py``): every
backward runs with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``,
and ``perform_reduce_grad`` runs the post-backward (the reduce-scatter over ``dp_shard``, the
all-reduce over ``dp_replicate`` or the replicas) once after the last microbatch.

The engines sum instead of averaging: each replica's loss is its part of the global batch's
mean (its summed token losses over the global batch's target count, :func:`tpify.pipeline.step`),
so the dense gradient is the replicas' sum: ``set_gradient_divide_factor(1.0)`` with
``set_force_sum_reduction_for_comms(True)`` (plain SUM collectives, which NCCL and gloo take) on
every FSDP2 module of the stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from ..data_parallel import transformer_blocks
from ..mesh import dp_mesh, fsdp_mesh
from ..sharding import is_dtensor, shard_spec_of
from .plan import PipelineError
from .split import PipelineInfo

__all__ = ["DATA_PARALLEL", "dp_size_of", "shard_stages", "replicate_stages", "check_data_parallel",
           "apply_data_parallel"]

#: ``pipeline(..., data_parallel=)``: FSDP2 / HSDP (:func:`shard_stages`) or replicas (:func:`replicate_stages`).
DATA_PARALLEL = ("fsdp", "replicate")


def dp_size_of(mesh) -> int:
    """The data-parallel replicas of a stage on ``mesh``: ``dp_replicate * dp_shard``. Local."""
    names = mesh.mesh_dim_names or ()
    return int(mesh["dp_replicate"].size() if "dp_replicate" in names else 1) * \
        int(mesh["dp_shard"].size() if "dp_shard" in names else 1)


def check_data_parallel(mesh, data_parallel) -> None:
    """Whether ``data_parallel`` fits ``mesh`` (pure; the same on every rank).

    Raises:
        PipelineError: an unknown value; a mesh with dp > 1 and no engine (tpify does not sum
            the replicas' gradients itself: data parallelism is torch's).
    """
    if data_parallel is not None and data_parallel not in DATA_PARALLEL:
        raise PipelineError(f"data_parallel={data_parallel!r}: use None, 'fsdp' (FSDP2 / HSDP: "
                            f"tpify.pipeline.shard_stages) or 'replicate' (DDP's semantics: tpify.pipeline.replicate_stages)")
    dp = dp_size_of(mesh)
    if dp > 1 and data_parallel is None:
        raise PipelineError(f"the mesh has {dp} data-parallel replicas of each stage (dp_replicate x dp_shard), but "
                            f"no data-parallel engine is applied to the stages: pass data_parallel='fsdp' (FSDP2 / "
                            f"HSDP, tpify.pipeline.shard_stages) or data_parallel='replicate' (DDP's semantics, "
                            f"tpify.pipeline.replicate_stages) to tpify.pipeline.pipeline, or call one of them "
                            f"between split_model and build_schedule")


def _check_stages(info: PipelineInfo, what: str) -> None:
    """Refuse stages an engine holds already (the same on every rank). Raises PipelineError."""
    if info.data_parallel is not None:
        raise PipelineError(f"{what}: the stages are already under {info.data_parallel!r}; apply one engine once")
    for stage in info.stages:
        if any(is_dtensor(p) for p in stage.parameters()):
            raise PipelineError(f"{what}: stage {stage.stage_index} holds DTensor parameters already (fully_shard "
                                f"applied): apply {what} once, to the stages split_model returned")


def shard_stages(info: PipelineInfo, *, reshard_after_forward: bool = False, mp_policy=None, offload_policy=None,
                 blocks=None) -> PipelineInfo:
    """FSDP2's ``fully_shard`` on each of this rank's stages, in place; returns ``info``.

    Every transformer block of the stage (:func:`tpify.data_parallel.transformer_blocks`: the
    model's ``_no_split_modules``, or ``blocks``) is one unit, then the stage module itself (its
    embeddings, final norm and head) the root unit, over :func:`tpify.mesh.fsdp_mesh` of the
    pipeline's mesh: 1-D ``"dp_shard"``, or HSDP ``("dp_replicate", "dp_shard")`` when
    ``dp_replicate > 1``. Each parameter (a TP shard, or the dense tensor at tp 1) becomes a
    DTensor split along dim 0 over ``dp_shard``; the gradients are summed, not averaged, over dp
    (``set_gradient_divide_factor(1.0)``, SUM collectives). ``reshard_after_forward`` defaults to
    False (torchtitan's default with pipelining: the microbatches' forwards gather each unit
    once). The ShardSpecs of the TP shards are kept by parameter for the global norm
    (``info.specs``); a tied head's parameter (``info.tied_params``) is the sharded one. The
    first and last stage's copies of a tied weight have the same shape, so the same dim-0 split
    over ``dp_shard``: :func:`tpify.pipeline.step` sums their local gradients over the embedding
    group. Nothing at dp 1. Build the optimizer after this call.

    Communication: none here (FSDP2's all-gathers and reduce-scatters run in the schedule).

    Raises:
        PipelineError: the stages are already sharded or wrapped; a stage without a transformer
            block (pass ``blocks=``); ``mp_policy`` / ``offload_policy`` of the wrong type.
    """
    _check_stages(info, "tpify.pipeline.shard_stages")
    kwargs = _policies(mp_policy, offload_policy, "shard_stages")
    if dp_size_of(info.mesh) == 1:
        return info
    kwargs.update(mesh=fsdp_mesh(info.mesh), reshard_after_forward=reshard_after_forward)

    def wrap(stage):
        units = transformer_blocks(stage.model, blocks)
        if not units:
            raise PipelineError(f"shard_stages: no transformer block found in stage {stage.stage_index} (looked for "
                                f"classes {blocks or getattr(stage.model, '_no_split_modules', None)}); pass blocks= "
                                f"the block classes to shard one by one")
        for _, unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(stage, **kwargs)
    return _apply(info, wrap, "fsdp")


def _policies(mp_policy, offload_policy, what: str) -> dict:
    """``fully_shard`` / ``replicate``'s policy keywords, checked. Raises PipelineError."""
    kwargs = {}
    for name, value, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                              ("offload_policy", offload_policy, OffloadPolicy)):
        if value is not None and not isinstance(value, kind):
            raise PipelineError(f"{what}: {name} must be a torch {kind.__name__}, got {type(value).__name__}")
        if value is not None:
            kwargs[name] = value
    return kwargs


def _apply(info: PipelineInfo, wrap, engine: str) -> PipelineInfo:
    """``wrap`` each stage (FSDP2 / replicate), the gradients summed over dp, the ShardSpecs kept by
    parameter (``info.specs``), the tied parameters found again (they are new DTensor Parameters)."""
    specs_by_name = [{n: _spec(s, n, p) for n, p in s.named_parameters(remove_duplicate=False)} for s in info.stages]
    tied_names = _names_of(info, info.tied_params)
    for stage in info.stages:
        wrap(stage)
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # the replicas' gradients summed: each holds its part
                module.set_force_sum_reduction_for_comms(True)  # SUM collectives (no PREMUL_SUM: gloo too)
    info.specs = {id(p): specs_by_name[i][n] for i, s in enumerate(info.stages)
                  for n, p in s.named_parameters(remove_duplicate=False)}
    info.tied_params = [p for i, s in enumerate(info.stages) for n, p in s.named_parameters()
                        if (i, n) in tied_names]
    info.data_parallel = engine
    return info


def _spec(stage: nn.Module, name: str, p: torch.Tensor):
    """A parameter's ShardSpec: its attribute, else what tpify recorded by name on the model."""
    spec = shard_spec_of(p)
    if spec is None:
        recorded = getattr(getattr(stage.model, "tp_info", None), "specs", None) or {}
        spec = recorded.get(name.removeprefix("model."))
    return spec


def _names_of(info: PipelineInfo, params) -> set[tuple[int, str]]:
    """``{(stage position, name)}`` of ``params`` in this rank's stages."""
    ids = {id(p) for p in params}
    return {(i, n) for i, s in enumerate(info.stages) for n, p in s.named_parameters() if id(p) in ids}


def replicate_stages(info: PipelineInfo, *, mp_policy=None, offload_policy=None) -> PipelineInfo:
    """Replicate each of this rank's stages over the data-parallel replicas (the mesh's dp axes
    flattened, ``info.dp_group``) with torch's composable ``replicate``
    (``torch.distributed._composable.replicate_with_fsdp``: DDP's semantics on FSDP2's machinery,
    which torch's pipelining drives as it drives FSDP2); returns ``info``.

    Each parameter becomes a DTensor replicated over dp (every rank holds the whole TP shard);
    the stage's gradients are all-reduced with SUM over dp once per step, after the last
    microbatch's backward (``set_gradient_divide_factor(1.0)``: each replica's loss is its part of
    the global batch's mean). Replicas must start equal (they are, when every rank builds the
    model from one seed or one checkpoint). Nothing at dp 1. Build the optimizer after this call.

    Why not ``torch.nn.parallel.DistributedDataParallel``: torch 2.13's pipelining runs its
    first-step shape inference through the wrapped module's forward outside ``no_sync()``, which
    arms DDP's reducer, so the first microbatch's backward all-reduces its partial gradient and
    the step's gradients come out wrong (measured: 1.26 to 1.4 times the dense ones at pp 2 x dp 2);
    ``replicate`` has no such state.

    Communication: none here; per step, one all-reduce per stage over dp (in the schedule).

    Raises:
        PipelineError: the stages are already sharded or replicated; ``mp_policy`` /
            ``offload_policy`` of the wrong type.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    _check_stages(info, "tpify.pipeline.replicate_stages")
    kwargs = _policies(mp_policy, offload_policy, "replicate_stages")
    if dp_size_of(info.mesh) == 1:
        return info
    mesh = dp_mesh(info.mesh)  # 1-D: replicate takes one replicate axis

    def wrap(stage):
        replicate(stage, mesh=mesh, **kwargs)
    return _apply(info, wrap, "replicate")


def apply_data_parallel(info: PipelineInfo, data_parallel) -> PipelineInfo:
    """:func:`shard_stages` (``"fsdp"``), :func:`replicate_stages` (``"replicate"``) or nothing (None),
    with their defaults. Raises: PipelineError as :func:`check_data_parallel` and those."""
    check_data_parallel(info.mesh, data_parallel)
    if data_parallel == "fsdp":
        return shard_stages(info)
    if data_parallel == "replicate":
        return replicate_stages(info)
    return info
