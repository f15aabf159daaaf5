"""The public entry point :func:`parallelize`, and the pipeline it shares with loading.

One pipeline, in two halves with the agreement between them:

1. :func:`prepare` (local, no collective): refuse what cannot be parallelized, resolve the tp
   size, load the recipe, build the :class:`~tpify.layout.Layout`;
2. ``comm.agree`` (every rank learns every rank's outcome and fingerprint);
3. :func:`finish` (collective: groups): surgery by the layout, ``model.tp_info``, the parallel LM
   loss, the HF methods.

:func:`tpify.parallelize` runs 1-2-3 on a loaded model; :func:`tpify.from_pretrained` runs 1 on
a meta model next to its checkpoint checks, agrees once on both, runs 3, then reads the shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import nn

from . import comm
from .engine import apply_layout
from .layout import Layout, build_layout
from .integrations.model import check_before_parallelize
from .integrations.model import install as install_hf_methods
from .loss import install_parallel_lm_loss
from .mesh import init_tp_mesh, resolve_tp_size
from .recipe import Recipe, available_recipes, load_recipe

__all__ = ["parallelize", "TPInfo", "get_tp_info", "remove_hooks", "prepare", "finish", "resolve_recipe"]


@dataclass
class TPInfo:
    """What tpify did to a model; stored as ``model.tp_info`` (the one attribute tpify sets on the
    root model; a model is parallelized by tpify exactly when it has one).

    Attributes:
        tp_size, tp_rank: the TP group's size and this process's rank in it.
        tp_group, dp_group: the process groups (``None``: the default group / no DP group).
        layout: the :class:`~tpify.layout.Layout` the model was split by.
        rng: the model's dropout-stream tracker (:class:`tpify.random.RNGStreamTracker`).
        hooks: every hook handle tpify added (dropout streams, the parallel LM loss, the DDP
            guard); :func:`remove_hooks` removes them.
    """

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    layout: Layout
    rng: object = None
    hooks: list = field(default_factory=list)


def get_tp_info(model: nn.Module) -> TPInfo:
    """The :class:`TPInfo` of a parallelized model.

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    info = getattr(model, "tp_info", None)
    if not isinstance(info, TPInfo):
        raise ValueError(f"{type(model).__name__} was not parallelized by tpify (no tp_info)")
    return info


def resolve_recipe(model: nn.Module, recipe: "str | Path | dict | Recipe | None" = None) -> Recipe:
    """The recipe :func:`parallelize` uses for ``model``: ``recipe`` when given (a name, a path,
    a mapping or a Recipe), else the shipped recipe of ``config.model_type``, else transformers'
    own TP plan imported (:func:`tpify.hf_plan.recipe_for_unshipped`, with a notice). Local.

    Raises:
        RecipeError: none of these exists, or a malformed recipe; ValueError: no model_type.
    """
    if recipe is not None:
        return load_recipe(recipe)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        raise ValueError(f"{type(model).__name__} has no config.model_type; pass recipe='path/to/recipe.toml'")
    if model_type not in available_recipes():  # transformers' own TP plan, imported with a notice (tpify/hf_plan.py)
        from .hf_plan import recipe_for_unshipped

        return recipe_for_unshipped(model, model_type)
    return load_recipe(model_type)


def fingerprint(model: nn.Module, layout: Layout | None, tp_size: int | None, tp_group=None) -> dict:
    """What every rank must share to parallelize ``model`` together (compared by ``comm.agree``).

    The tp size, the model class, a digest of its config (without paths), of the recipe and of
    the layout, the parameters' dtypes and device types, and the TP group's ranks.
    """
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)) if config is not None else {}
    config_dict = {k: v for k, v in raw.items() if k != "_name_or_path"}
    params = list(model.parameters())
    out = {"tp_size": tp_size, "model class": type(model).__name__, "config": comm.digest(config_dict),
           "dtypes": sorted({str(p.dtype) for p in params}), "device types": sorted({p.device.type for p in params})}
    if layout is not None:
        out["recipe"] = comm.digest(layout.recipe.digest_data())
        out["layout"] = layout.digest()
    if tp_group is not None:
        out["tp_group ranks"] = sorted(dist.get_process_group_ranks(tp_group))
    return out


def prepare(model: nn.Module, tp_size: int | None, tp_group: dist.ProcessGroup | None,
            recipe: "str | Path | dict | Recipe | None", pad_vocab_multiple: int = 1,
            sequence_parallel: bool = False) -> tuple[int, Layout]:
    """The local half of the pipeline: ``(tp_size, layout)``; no collective.

    Raises:
        ValueError, TPUsageError, RecipeError, PlanError: as :func:`parallelize`.
    """
    if getattr(model, "tp_info", None) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized")
    check_before_parallelize(model)
    size = resolve_tp_size(tp_size, tp_group)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    return size, build_layout(model, resolve_recipe(model, recipe), size, pad_vocab_multiple=pad_vocab_multiple,
                              sequence_parallel=sequence_parallel)


def finish(model: nn.Module, size: int, layout: Layout, tp_group: dist.ProcessGroup | None) -> nn.Module:
    """The collective half of the pipeline, after the agreement: groups, surgery, ``tp_info``, the
    parallel LM loss and the HF methods."""
    tp_group, dp_group = resolve_groups(size, tp_group)
    tracker, hooks = apply_layout(model, layout, tp_group)
    model.tp_info = TPInfo(size, comm.get_tp_rank(tp_group), tp_group, dp_group, layout, tracker, hooks)
    hooks += install_parallel_lm_loss(model, layout)  # labels= -> loss from vocab-sharded logits (tpify/loss.py)
    hooks += install_hf_methods(model)  # TP-aware save_pretrained, resize_token_embeddings refused, DDP guard
    return model


def remove_hooks(model: nn.Module) -> int:
    """Remove every hook tpify added to a parallelized model; return how many.

    Afterwards the model still computes the same forward (the parallel layers stay), but dropout
    in sharded regions draws from the default stream, ``labels=`` gives HF's own loss on the
    gathered logits, and nothing refuses a foreign DDP.

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    info = get_tp_info(model)
    for handle in info.hooks:
        handle.remove()
    count, info.hooks = len(info.hooks), []
    return count


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
    pad_vocab_multiple: int = 1,
    sequence_parallel: bool = False,
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
        pad_vocab_multiple: pad vocabulary-split tables (embedding, LM head) to a multiple of
            ``pad_vocab_multiple * tp_size`` rows (Megatron-LM's ``make_vocab_size_divisible_by``,
            128 there, keeps every rank's GEMM width a multiple of a tile; 64 suits current
            GPUs). Default 1: the least padding that makes the rows divisible. The padded rows
            are zeros no id reaches, never in the loss, stripped from gathered logits and saves.
        sequence_parallel: also split along the tokens what tensor parallelism leaves
            replicated (LayerNorms, dropout, residual adds; Korthikanti et al.,
            arXiv:2205.05198), where the recipe marks it (``[sequence_parallel]``): all-reduces
            become reduce-scatter + all-gather pairs (same bytes), activation memory there
            ``1/tp_size``. Training batches need ``T`` divisible by ``tp_size``
            (:class:`tpify.engine.SequenceParallel`).

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
    error, layout, size = None, None, None
    try:  # every local check, then one agreement: the same outcome on every rank, before any other collective
        size, layout = prepare(model, tp_size, tp_group, recipe, pad_vocab_multiple, sequence_parallel)
    except Exception as e:  # noqa: BLE001 - re-raised by comm.agree on this rank, reported on the others
        error = e
    comm.agree("tpify.parallelize", fingerprint(model, layout, size, tp_group) if error is None else {}, error,
               group=tp_group)
    return finish(model, size, layout, tp_group)
