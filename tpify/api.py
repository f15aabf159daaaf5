"""The public entry points: :func:`parallelize` (and, later, loading and saving)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from . import comm
from .engine import Plan, apply_plan, build_plan
from .integrations.model import check_before_parallelize
from .integrations.model import install as install_hf_methods
from .loss import install_parallel_lm_loss
from .mesh import init_tp_mesh, resolve_tp_size
from .recipe import Recipe, load_recipe

__all__ = ["parallelize", "TPInfo", "get_tp_info"]


@dataclass
class TPInfo:
    """What tpify did to a model; stored as ``model.tp_info``."""

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    plan: Plan


def get_tp_info(model: nn.Module) -> TPInfo:
    """The :class:`TPInfo` of a parallelized model.

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    info = getattr(model, "tp_info", None)
    if not isinstance(info, TPInfo):
        raise ValueError(f"{type(model).__name__} was not parallelized by tpify (no tp_info)")
    return info


def _model_recipe(model: nn.Module, recipe: "str | Path | dict | Recipe | None") -> Recipe:
    if recipe is not None:
        return load_recipe(recipe)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        raise ValueError(f"{type(model).__name__} has no config.model_type; pass recipe='path/to/recipe.toml'")
    return load_recipe(model_type)


def fingerprint(model: nn.Module, plan: Plan | None, tp_size: int | None, tp_group=None) -> dict:
    """What every rank must share to parallelize ``model`` together (compared by ``comm.agree``).

    The tp size, the model class, a digest of its config (without paths), of the recipe's rules
    and of the plan, the parameters' dtypes and device types, and the TP group's ranks.
    """
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)) if config is not None else {}
    config_dict = {k: v for k, v in raw.items() if k != "_name_or_path"}
    params = list(model.parameters())
    out = {"tp_size": tp_size, "model class": type(model).__name__, "config": comm.digest(config_dict),
           "dtypes": sorted({str(p.dtype) for p in params}), "device types": sorted({p.device.type for p in params})}
    if plan is not None:
        out["recipe"] = comm.digest([(r.patterns, r.style, r.parts, r.divide, r.optional) for r in plan.recipe.rules]
                                + [plan.recipe.model_type, list(plan.recipe.divisible)])
        out["plan"] = comm.digest(sorted((f, e.style, e.partition_sizes, e.padded_size) for f, e in plan.entries.items()))
    if tp_group is not None:
        out["tp_group ranks"] = sorted(dist.get_process_group_ranks(tp_group))
    return out


def resolve_groups(tp_size: int, tp_group: dist.ProcessGroup | None):
    """(tp_group, dp_group) for a validated ``tp_size``; creates the mesh when needed (collective)."""
    if tp_group is not None or not (dist.is_available() and dist.is_initialized()):
        return tp_group, None
    mesh = init_tp_mesh(tp_size)
    return mesh["tp"].get_group(), mesh["dp"].get_group()


def parallelize(
    model: nn.Module,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    recipe: "str | Path | dict | Recipe | None" = None,
) -> nn.Module:
    """Make a Hugging Face model tensor-parallel in place, by module surgery, and return it.

    The model must be loaded, identically, on every rank of the TP group. The recipe for
    ``config.model_type`` (or ``recipe``) decides which modules become
    ``ColumnParallelLinear``/``RowParallelLinear``/``VocabParallelEmbedding`` (Megatron-LM,
    arXiv:1909.08053, section 3); each rank keeps only its shard and the dense weights are freed.
    Tied weights stay tied. HF ``forward`` methods are untouched, so ``model(...)``,
    ``model(..., labels=...).loss`` and ``model.generate()`` behave as on the dense model.
    Without labels ``.logits`` hold the full vocabulary (padding stripped) on every rank; with
    ``labels`` the loss is computed by ``vocab_parallel_cross_entropy`` from the vocab-sharded
    logits and ``.logits`` is this rank's shard ``(B, T, V_padded/tp_size)`` (see tpify/loss.py).

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (or any module with a matching recipe).
        tp_size: ranks per TP group; default the whole world (or ``tp_group``'s size). With
            ``tp_size < world``, TP groups of contiguous ranks are made and the rest is DP.
        tp_group: an existing process group to use as the TP group.
        recipe: a ``model_type`` name, a path to a ``.toml`` recipe, a mapping, or a Recipe.

    The model's ``save_pretrained`` then writes the dense checkpoint (collective, like
    :func:`tpify.save_pretrained`), ``resize_token_embeddings`` raises, and running it inside a
    ``DistributedDataParallel`` over other ranks than its DP group raises
    (:mod:`tpify.integrations.model`). ``state_dict()`` returns this rank's shards.

    Communication: first one agreement (``comm.agree``, one all-gather of a small object over the
    world, or over ``tp_group``): every rank learns every rank's local outcome, so bad input on
    one rank, or ranks launched with different models, configs, recipes, tp sizes or dtypes,
    raise on every rank (:class:`~tpify.comm.AgreementError` on the others) instead of hanging;
    then creating the TP/DP groups (collective over the world).

    Raises:
        RecipeError: no recipe for the model type, or a malformed recipe.
        TPUsageError: gradient checkpointing enabled before parallelizing (enable it after).
        PlanError: a PEFT model (parallelize first, then add adapters), uncovered modules,
            indivisible head counts or features (the message names the module, the numbers and
            the tp sizes that would work).
        ValueError: inconsistent ``tp_size``/``tp_group``, or ``tp_size > 1`` without
            ``torch.distributed``.
        AgreementError: another rank failed its checks, or the ranks disagree (listed per rank).
    """
    error, plan, size = None, None, None
    try:  # every local check, then one agreement: the same outcome on every rank, before any other collective
        if getattr(model, "tp_info", None) is not None:
            raise ValueError(f"{type(model).__name__} is already parallelized")
        check_before_parallelize(model)
        size = resolve_tp_size(tp_size, tp_group)
        plan = build_plan(model, _model_recipe(model, recipe), size)
    except Exception as e:  # noqa: BLE001 - re-raised by comm.agree on this rank, reported on the others
        error = e
    comm.agree("tpify.parallelize", fingerprint(model, plan, size, tp_group) if error is None else {}, error,
               group=tp_group)
    tp_group, dp_group = resolve_groups(size, tp_group)
    apply_plan(model, plan, tp_group)
    model.tp_info = TPInfo(size, comm.get_tp_rank(tp_group), tp_group, dp_group, plan)
    install_parallel_lm_loss(model, plan)  # labels= -> loss from vocab-sharded logits (tpify/loss.py)
    install_hf_methods(model)  # TP-aware save_pretrained, resize_token_embeddings refused, DDP guard
    return model
