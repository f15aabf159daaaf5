"""This rank's stages of a model on a mesh with a ``"pp"`` axis: :func:`split_model`.

The checks run on every rank before any collective (one agreement through the store); then the
embedding group (Megatron-LM's: the first and last stage's ranks of each pipeline) when a tied
head lives on another rank than its embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from ..agree import agree
from ..hf_modules import base_model_and_prefix, config_get
from ..info import tp_info_of
from ..mesh import cp_size_of, dp_mesh, pp_group_of, pp_size_of
from ..recipe import Recipe, available_recipes, load_recipe
from ..sharding import is_dtensor
from .plan import PipelineError, layer_ranges, pipeline_plan, stage_indices
from .stage import StageModule, build_stage, n_layers_of

__all__ = ["PipelineInfo", "split_model", "plan_stages", "STAGE_STYLES"]

#: How stages are placed on the pipeline ranks (:func:`tpify.pipeline.plan.stage_indices`): the
#: loop (stage ``s`` on rank ``s % pp``: GPipe, 1F1B, the interleaved schedules) or the V (rank ``r``
#: holds stages ``r`` and ``2 pp - 1 - r``: ZBVZeroBubble, DualPipeV).
STAGE_STYLES = ("loop", "v")


@dataclass
class PipelineInfo:
    """What :func:`split_model` decided, kept on the schedule (``schedule.tpify_pipeline``).

    ``stages``: this rank's :class:`StageModule` s; ``ranges``: every stage's layers; ``dp_group``:
    the data-parallel replicas of this rank's stages (the mesh's dp axes at this pp, cp, tp);
    ``embedding_group``: the first and last stage's ranks of this pipeline when a tied head
    lives on another rank than its embedding (None otherwise, or when this rank holds neither);
    ``tied_params``: this rank's tied embedding / head parameter(s) whose gradient is summed over it;
    ``data_parallel``: the engine on the stages (None, ``"fsdp"``, ``"replicate"``:
    :mod:`tpify.pipeline.data_parallel`); ``specs``: ``{id(parameter): ShardSpec or None}`` once
    the engine replaced the parameters by DTensors (the global norm's).
    """

    mesh: object
    stages: list[StageModule]
    ranges: list[range]
    num_stages: int
    pp_group: object
    tp_group: object = None
    dp_group: object = None
    vocab_size: int = 0
    embedding_group: object = None
    tied_params: list = field(default_factory=list)
    style: str = "loop"
    plan: object = None
    data_parallel: str | None = None
    specs: dict | None = None


def _recipe_of(model: nn.Module, recipe) -> Recipe | None:
    """The recipe whose ``[pipeline]`` table applies: ``recipe``, the one the model was
    parallelized with, or the shipped recipe of its ``model_type`` (None: transformers' plan)."""
    if recipe is not None:
        return load_recipe(recipe)
    info = tp_info_of(model)
    if info is not None and info.layout is not None:
        return info.layout.recipe
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return load_recipe(kind) if kind in available_recipes() else None


def _tied(model: nn.Module, plan) -> bool:
    """Whether the head's weight is the input embedding's (one Parameter); on a model
    :func:`tpify.pipeline.from_pretrained` cut (one of them absent), what its config says."""
    head = getattr(model, plan.head, None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or embed is None:
        return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    return getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)


def plan_stages(model: nn.Module, mesh, n_virtual: int, split_points, style: str, recipe, data_parallel=...):
    """``(plan, every stage's layers, this rank's stages)``: the checks of :func:`split_model`,
    pure and the same on every rank.

    Raises:
        PipelineError: as :func:`split_model`.
    """
    pp = pp_size_of(mesh)
    if pp < 2:
        raise PipelineError(f"a pipeline needs a mesh with a 'pp' axis of 2 or more ranks (got pp = {pp}): "
                            f"build it with tpify.init_mesh(tp_size, pp_size=P)")
    if cp_size_of(mesh) > 1:
        raise PipelineError(f"pipeline stages with context parallelism (cp = {cp_size_of(mesh)}) are not built: the "
                            f"stages would each need the sequence split and the labels shifted before it; build the "
                            f"mesh with cp_size=1")
    if style not in STAGE_STYLES:
        raise PipelineError(f"style {style!r}: use one of {STAGE_STYLES}")
    if not isinstance(n_virtual, int) or isinstance(n_virtual, bool) or n_virtual < 1:
        raise PipelineError(f"n_virtual = {n_virtual!r}: a positive number of stages per rank")
    if style == "v" and n_virtual != 2:
        raise PipelineError(f"style='v' places exactly two stages per rank (r and 2 pp - 1 - r), got n_virtual = "
                            f"{n_virtual}: use n_virtual=2")
    _check_model(model)
    if data_parallel is not ...:  # the engine pipeline() will apply: after the model's own checks
        from .data_parallel import check_data_parallel

        check_data_parallel(mesh, data_parallel)
    cut = getattr(model, "tpify_pipeline_cut", None)  # (ranges, this rank's stages, plan) of a model loaded by stage
    plan = cut[2] if cut is not None else pipeline_plan(model, _recipe_of(model, recipe))
    ranges = layer_ranges(n_layers_of(base_model_and_prefix(model)[0], plan), pp * n_virtual, split_points)
    if style == "v" and data_parallel not in (..., None) and dp_mesh(mesh).size() > 1 and _tied(model, plan):
        raise PipelineError(f"{type(model).__name__}: its tied embedding and head are one parameter on the first and "
                            f"last stage, which the V placement puts on the same rank (pipeline rank 0), so the "
                            f"two stages share it; data_parallel={data_parallel!r} wraps each stage alone and would "
                            f"hold two copies (not built): use a loop schedule (1F1B, Interleaved1F1B, "
                            f"InterleavedZeroBubble) with data parallelism, or untie the head")
    mine = stage_indices(mesh["pp"].get_local_rank(), pp, n_virtual, style)
    if cut is not None and cut[:2] != (tuple(ranges), tuple(mine)):
        raise PipelineError(f"{type(model).__name__} was loaded for the stages {[list(r) for r in cut[0]]} (this rank: "
                            f"{list(cut[1])}), but is split into {[list(r) for r in ranges]} (this rank: {mine}): pass "
                            f"the same n_virtual, split_points and style to tpify.pipeline.from_pretrained and pipeline")
    return plan, ranges, mine


def _check_model(model: nn.Module) -> None:
    """What the stages would compute wrongly: refused. Raises PipelineError."""
    if not hasattr(model, "config") or any(is_dtensor(p) for p in model.parameters()):
        raise PipelineError(f"{type(model).__name__}: a pipeline cuts the Hugging Face model itself; this one is wrapped "
                            f"(DDP) or FSDP2-sharded (DTensor parameters). Cut the plain (or tpify.parallelize-d) "
                            f"model and pass data_parallel='fsdp' or 'replicate' to tpify.pipeline.pipeline: the engines "
                            f"go on each stage (tpify.pipeline.shard_stages / replicate_stages), not on the model")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "output_router_logits", False):
        raise PipelineError(f"{type(model).__name__}: config.output_router_logits is True, so the dense model adds "
                            f"the router's auxiliary loss to the LM loss; the pipeline's last stage computes the LM "
                            f"loss alone (the aux loss is not built): set output_router_logits=False")
    # what transformers applies to the LM head's output (tpify.recipe.logit_ops_of): not applied by the last stage
    ops = {n: getattr(config, n, None) for n in ("logit_scale", "lm_head_multiplier", "logits_scaling",
                                                 "final_logit_softcapping")}
    active = {n: v for n, v in ops.items() if v is not None and not (n != "final_logit_softcapping" and v == 1)}
    if active:
        raise PipelineError(f"{type(model).__name__}: the model applies {active} to its logits, which the pipeline's "
                            f"last stage does not (not built)")
    info = tp_info_of(model)
    if info is not None:
        layout = info.layout
        if getattr(layout, "sequence_parallel", False):
            raise PipelineError(f"{type(model).__name__}: sequence parallelism with pipeline stages is not built "
                                f"(the split and exit points lie on the first and last stage); parallelize with "
                                f"sequence_parallel=False")
        if getattr(layout, "lm_loss_chunk", None):
            raise PipelineError(f"{type(model).__name__}: parallelized with lm_loss_chunk, which the model's labels= "
                                f"call uses; a pipeline computes its loss on the last stage: parallelize without it and "
                                f"pass lm_loss_chunk to tpify.pipeline.pipeline (or build_schedule)")
        if layout.recipe.logit_ops:
            raise PipelineError(f"{type(model).__name__}: the recipe declares ops on the logits "
                                f"({list(layout.recipe.logit_ops)}), which the pipeline's last stage does not apply")


def split_model(model: nn.Module, mesh, *, n_virtual: int = 1, split_points: list[int] | None = None,
                style: str = "loop", recipe=None, data_parallel=...) -> PipelineInfo:
    """This rank's pipeline stages of ``model`` (a causal LM, dense or :func:`tpify.parallelize`-d
    over ``mesh``'s tp axis), for ``mesh``'s ``"pp"`` axis of ``pp`` ranks.

    The model is cut into ``pp * n_virtual`` stages (``style="loop"``: stage ``s`` on pipeline rank
    ``s % pp``; ``"v"``: two per rank, ``r`` and ``2 pp - 1 - r``, for the V schedules) of
    balanced layer counts, or at ``split_points`` (the first layer of each stage but the first),
    from the recipe's ``[pipeline]`` table or transformers' ``base_model_pp_plan``
    (:func:`tpify.pipeline.plan.pipeline_plan`). Each stage is a :class:`StageModule` sharing
    ``model``'s parameters (drop ``model`` afterwards: the other stages' layers are then freed).

    ``data_parallel``: when given (None, ``"fsdp"``, ``"replicate"``: the engine the caller applies
    next, :mod:`tpify.pipeline.data_parallel`), checked against the mesh's dp size with the other
    checks (:func:`tpify.pipeline.pipeline` passes its own); left out, :func:`build_schedule`
    checks the stages.

    Communication: one agreement (the store) on the checks and the stage layout; then, when the
    head is tied to the embedding and they are on different ranks, the embedding groups
    (``new_subgroups_by_enumeration``, collective over the world).

    Raises:
        PipelineError: on every rank: a mesh without a ``"pp"`` axis of more than one rank; more
            stages than layers; bad ``split_points``, ``n_virtual`` or ``style``; a model without a
            pipeline plan (naming the recipe key to add) or without an LM head; sequence
            parallelism, ``lm_loss_chunk`` or logit ops on the parallel model; the router's aux
            loss (``output_router_logits``); a DDP-wrapped or FSDP2-sharded model (the engines go on
            the stages: :mod:`tpify.pipeline.data_parallel`); dp > 1 with ``data_parallel=None``, an
            unknown ``data_parallel``; a mesh with
            context parallelism (not built).
        AgreementError: another rank failed, or the ranks disagree on the layout.
    """
    error, ranges, plan, mine, pp = None, None, None, [], pp_size_of(mesh)
    try:
        plan, ranges, mine = plan_stages(model, mesh, n_virtual, split_points, style, recipe, data_parallel)
    except Exception as e:  # noqa: BLE001 - re-raised by agree on this rank, reported on the others
        error = e
    agree("tpify.pipeline.split_model", {"stages": [(r.start, r.stop) for r in ranges] if ranges else None,
                                         "style": style}, error)
    num_stages = len(ranges)
    tied = _tied(model, plan)
    stages = [build_stage(model, plan, ranges[s], s, num_stages, tied) for s in mine]
    info = tp_info_of(model)
    out = PipelineInfo(mesh, stages, ranges, num_stages, pp_group_of(mesh), plan=plan,
                       tp_group=info.tp_group if info is not None else mesh["tp"].get_group(),
                       dp_group=dp_mesh(mesh).get_group(),
                       vocab_size=int(config_get(model.config.get_text_config(), "vocab_size")), style=style)
    first_rank = stage_indices(0, pp, n_virtual, style)
    apart = tied and not (0 in first_rank and num_stages - 1 in first_rank)
    if apart:  # Megatron-LM's embedding group: pipeline rank 0 and the rank holding the last stage, per pipeline
        holder = next(r for r in range(pp) if num_stages - 1 in stage_indices(r, pp, n_virtual, style))
        grid = mesh.mesh.reshape(pp, -1)
        groups = [[int(grid[0, i]), int(grid[holder, i])] for i in range(grid.shape[1])]
        group, _ = dist.new_subgroups_by_enumeration(groups)
        if any(s.is_first or s.is_last for s in stages):
            out.embedding_group = group
            head = stages[-1].model if stages[-1].is_last else None
            out.tied_params = [getattr(head, plan.head).weight] if head is not None else \
                [stages[0].model.get_input_embeddings().weight]
    return out
