"""The public entry point :func:`parallelize`, and the pipeline it shares with loading.

One pipeline, in two halves with the agreement between them:

1. :func:`prepare` (local, no collective): refuse what cannot be parallelized, resolve the tp
   size, load the recipe, build the :class:`~tpify.layout.Layout`;
2. :func:`tpify.agree.agree` (every rank learns every rank's outcome and fingerprint);
3. :func:`finish` (collective: groups): surgery by the layout, ``model.tp_info``, the parallel LM
   loss, the HF methods.

:func:`tpify.parallelize` runs 1-2-3 on a loaded model; :func:`tpify.from_pretrained` runs 1 on
a meta model next to its checkpoint checks, agrees once on both, runs 3, then reads the shards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from . import hf_methods, hooks
from .agree import agree, digest
from .context import CallState, TPContext
from .hooks import guards
from .layout import Layout, build_layout
from .hf_methods import check_before_parallelize
from .layers import ColumnParallelInput
from .mesh import init_tp_mesh, resolve_tp_size
from .random import new_tracker
from .recipe import Recipe, available_recipes, load_recipe
from .info import TPInfo, TPUsageError, find_tp_model, get_tp_info, param_specs  # noqa: F401 - the public names
from .sharding import shard_spec_of
from .surgery import apply_layout

__all__ = ["parallelize", "TPInfo", "get_tp_info", "remove_hooks", "prepare", "finish", "resolve_recipe"]


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


#: The default of ``dp_group``: with a ``tp_group`` smaller than the world, find the DP group from
#: every rank's TP group (``None`` says: no data parallelism).
INFER = "infer"

#: Elements of each tensor that :func:`weights_digest` samples.
_SAMPLES_PER_TENSOR = 16


def weights_digest(tensors) -> str | None:
    """A digest of a sample of the values of ``tensors`` (``None`` if any is on the meta device).

    The ranks of a TP group must start from the same dense weights: a model built with
    ``from_config`` without a common seed holds different random weights on each rank, and its
    shards would make a model that exists nowhere, with replicated weights that differ. Up to
    16 evenly spaced elements of each tensor (first and last included) are compared, by their
    values converted to float64 (exact for every floating and integer dtype up to 2**53): any
    two independent random initialisations differ there. One gather of the samples (one
    device-to-host copy), no collective.
    """
    tensors = list(tensors)
    if not tensors or any(t.is_meta for t in tensors):
        return None
    samples = []
    for t in tensors:
        flat = t.detach().reshape(-1)  # a view for contiguous tensors (nearly all); else one copy
        n = flat.numel()
        if n == 0:
            continue
        k = min(n, _SAMPLES_PER_TENSOR)
        index = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)  # evenly spaced, exact in int64
        samples.append(flat[index].to(torch.float64))
    if not samples:
        return None
    values = torch.cat(samples).cpu()
    return hashlib.sha1(values.numpy().tobytes()).hexdigest()[:16]


def fingerprint(model: nn.Module, layout: Layout | None, tp_size: int | None, tp_group=None) -> dict:
    """What every rank must share to parallelize ``model`` together (compared by :func:`~tpify.agree.agree`).

    The tp size, the model class, a digest of its config (without paths), of the recipe and of
    the layout, the parameters' dtypes and device types, a sample of the weights
    (:func:`weights_digest`; not on the meta device, where the checkpoint's own checks apply),
    and the TP group's ranks (when the agreement is over the TP group).
    """
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)) if config is not None else {}
    config_dict = {k: v for k, v in raw.items() if k != "_name_or_path"}
    params = list(model.parameters())
    out = {"tp_size": tp_size, "model class": type(model).__name__, "config": digest(config_dict),
           "dtypes": sorted({str(p.dtype) for p in params}), "device types": sorted({p.device.type for p in params})}
    weights = weights_digest([*model.parameters(), *model.buffers()])
    if weights is not None:
        out["weights (a sample of every tensor; seed from_config alike on every rank)"] = weights
    if layout is not None:
        out["recipe"] = digest(layout.recipe.digest_data())
        out["layout"] = layout.digest()
    if tp_group is not None:
        out["tp_group ranks"] = sorted(dist.get_process_group_ranks(tp_group))
    return out


def prepare(model: nn.Module, tp_size: int | None, tp_group: dist.ProcessGroup | None,
            recipe: "str | Path | dict | Recipe | None", pad_vocab_multiple: int = 1,
            sequence_parallel: bool = False, dp_group: "dist.ProcessGroup | None | str" = INFER) -> tuple[int, Layout]:
    """The local half of the pipeline: ``(tp_size, layout)``; no collective.

    Raises:
        ValueError, TPUsageError, RecipeError, PlanError: as :func:`parallelize`.
    """
    if getattr(model, "tp_info", None) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized")
    check_before_parallelize(model)
    size = resolve_tp_size(tp_size, tp_group)
    check_dp_group(dp_group, tp_group)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    return size, build_layout(model, resolve_recipe(model, recipe), size, pad_vocab_multiple=pad_vocab_multiple,
                              sequence_parallel=sequence_parallel)


def finish(model: nn.Module, size: int, layout: Layout, tp_group: dist.ProcessGroup | None,
           dp_group: "dist.ProcessGroup | None | str" = INFER, tp_groups: list | None = None) -> nn.Module:
    """The collective half of the pipeline, after the agreement: groups, surgery, ``tp_info``, the
    parallel LM loss, the HF methods and the guards.

    ``tp_groups``: every rank's TP-group ranks, as the agreement shared them
    (:func:`agreement_scope`), when the DP group must be inferred."""
    tp_group, dp_group, dp_source = resolve_groups(size, tp_group, dp_group, tp_groups)
    if dp_source == "argument":  # the DP peers must hold the same shard of the same model
        agree("tpify.parallelize (the DP group passed as dp_group)",
              {"tp_size": size, "tp rank": comm.group_rank(tp_group), "layout": layout.digest(),
               "model class": type(model).__name__}, group=dp_group)
    ctx = TPContext(tp_group, region_input=ColumnParallelInput(), state=CallState())
    ctx.rng = new_tracker(ctx.rank)
    apply_layout(model, layout, ctx)  # surgery: swap, tie, divide
    specs = {name: shard_spec_of(p) for name, p in model.named_parameters(remove_duplicate=False)}
    info = TPInfo(size, ctx.rank, tp_group, dp_group, layout, ctx.rng, specs=specs, dp_source=dp_source,
                  state=ctx.state)
    model.tp_info = info
    info.hooks = hooks.install(model, layout, ctx)  # what makes the model compute what the dense one does
    info.guards = guards.install(model, info)  # before every other hook: what would be silently wrong
    hf_methods.install(model)  # TP-aware save_pretrained, gradient checkpointing; resize refused
    return model


def remove_hooks(model: nn.Module) -> int:
    """Remove the hooks tpify added to a parallelized model to compute what the dense model does;
    return how many.

    Afterwards the model still computes the same forward (the parallel layers stay), but dropout
    in sharded regions draws from the default stream and ``labels=`` gives HF's own loss on the
    gathered logits. The guards stay (``tp_info.guards``): inputs that differ between the ranks
    of the TP group, a DDP over other ranks than the model's DP group and TRL's fused LM head
    (which reads the vocabulary shard ``lm_head.weight`` as if it were the whole head) are still
    refused, since without them the model would train silently wrong.

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    info = get_tp_info(model)
    for handle in info.hooks:
        handle.remove()
    count, info.hooks = len(info.hooks), []
    return count


def check_dp_group(dp_group, tp_group: dist.ProcessGroup | None) -> None:
    """Local checks of a ``dp_group`` argument; no collective.

    Raises:
        ValueError: ``dp_group`` without ``tp_group`` (the mesh makes both), a DP group that does
            not contain this process, or one that shares another rank with the TP group (a DP
            replica must hold the same shard on other ranks); a string other than ``"infer"``.
    """
    if isinstance(dp_group, str) and dp_group != INFER:
        raise ValueError(f"dp_group must be a process group, None (no data parallelism) or {INFER!r}, "
                         f"got {dp_group!r}")
    if dp_group is None or dp_group == INFER:
        return
    if tp_group is None:
        raise ValueError("dp_group= needs tp_group= too: without tp_group tpify makes both groups itself, on a "
                         "('dp', 'tp') DeviceMesh; pass tp_size= alone, or both groups")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(dp_group) < 0:
        raise ValueError("dp_group does not contain this process: pass each rank its own DP group (the ranks that "
                         "hold the same TP rank)")
    shared = set(dist.get_process_group_ranks(dp_group)) & set(dist.get_process_group_ranks(tp_group))
    if shared != {dist.get_rank()}:
        raise ValueError(f"dp_group and tp_group share ranks {sorted(shared - {dist.get_rank()})}: a DP group holds "
                         f"one rank of each TP group (the ranks that hold the same shard)")


def agreement_scope(tp_group: dist.ProcessGroup | None, dp_group):
    """``(group, share)`` for the entry point's agreement: over the TP group, or over the whole
    world when the DP group must be inferred (a ``tp_group`` smaller than the world and
    ``dp_group="infer"``), with each rank's TP-group ranks to share. Local; no collective."""
    if tp_group is None or dp_group != INFER or not (dist.is_available() and dist.is_initialized()):
        return tp_group, None
    if dist.get_world_size(tp_group) == dist.get_world_size():
        return tp_group, None
    ranks = tuple(sorted(dist.get_process_group_ranks(tp_group))) if dist.get_rank(tp_group) >= 0 else ()
    return None, ranks


def _infer_dp_group(tp_groups: list[tuple[int, ...]]):
    """The DP group from every rank's TP-group ranks (the same list on every rank): the ranks
    that hold the same TP rank, one of each TP group (collective: one ``new_group`` per DP group,
    in the same order on every rank).

    Raises:
        ValueError: on every rank alike, when the TP groups do not split the world into groups of
            one size (a rank in two groups, sizes that differ).
    """
    world = len(tp_groups)
    groups = sorted(set(tp_groups))
    size = len(groups[0])
    ok = (all(len(g) == size for g in groups) and sorted(r for g in groups for r in g) == list(range(world))
          and all(r in tp_groups[r] for r in range(world)))
    if not ok:
        raise ValueError(f"cannot infer the DP group: the ranks' TP groups {groups} do not split the world of {world} "
                         f"ranks into groups of one size; pass dp_group= (the ranks holding the same TP rank)")
    dp_lists = [[g[i] for g in groups] for i in range(size)]
    mine, _ = dist.new_subgroups_by_enumeration(dp_lists)
    return mine


def resolve_groups(tp_size: int, tp_group: dist.ProcessGroup | None, dp_group=INFER, tp_groups: list | None = None):
    """``(tp_group, dp_group, dp_source)`` for a validated ``tp_size``; creates the mesh or the DP
    groups when needed (collective). See :attr:`TPInfo.dp_source`."""
    if not (dist.is_available() and dist.is_initialized()):
        return tp_group, None, "none"
    if tp_group is None:
        mesh = init_tp_mesh(tp_size)
        return mesh["tp"].get_group(), mesh["dp"].get_group(), "mesh"
    if dp_group is None:  # the caller says: no data parallelism
        return tp_group, None, "none"
    if dp_group != INFER:
        return tp_group, dp_group, "argument"
    if tp_groups is None:  # the TP group is the whole world
        return tp_group, None, "none"
    return tp_group, _infer_dp_group(tp_groups), "inferred"


def parallelize(
    model: nn.Module,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: "dist.ProcessGroup | None | str" = INFER,
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
        dp_group: with ``tp_group``, the DP group (the ranks holding the same TP rank, one of each
            TP group; they must hold the same shard: checked by an agreement over it), or ``None``
            for no data parallelism (ranks outside the TP group do something else). Default
            ``"infer"``: with ``tp_group`` smaller than the world, inferred from every rank's TP
            group (every rank of the world must then call ``parallelize``; the agreement is over
            the world); without ``tp_group``, the mesh's. ``model.tp_info.dp_source`` says which.
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
            (:class:`tpify.hooks.sequence_parallel.SequenceParallel`).

    The model's ``save_pretrained`` then writes the dense checkpoint (collective, like
    :func:`tpify.save_pretrained`), ``resize_token_embeddings`` raises, and running it inside a
    ``DistributedDataParallel`` over other ranks than its DP group raises
    (:mod:`tpify.integrations.model`). ``state_dict()`` returns this rank's shards.

    Communication: first one agreement (:func:`tpify.agree.agree`: the rendezvous store, or one
    all-gather of a small object over the world, or over ``tp_group``): every rank learns every rank's local outcome, so bad input on
    one rank, or ranks launched with different models, configs, recipes, tp sizes or dtypes,
    raise on every rank (:class:`~tpify.agree.AgreementError` on the others) instead of hanging;
    then creating the TP/DP groups (collective over the world).

    Raises:
        RecipeError: no recipe for the model type, or a malformed recipe.
        TPUsageError: gradient checkpointing enabled before parallelizing (enable it after).
        PlanError: a PEFT model (parallelize first, then add adapters), uncovered modules,
            indivisible head counts or features (the message names the module, the numbers and
            the tp sizes that would work).
        TPUsageError: a model whose parameters are already DTensors (FSDP2's ``fully_shard``
            or a DTensor TP plan applied before ``parallelize``: shard with FSDP after it).
        ValueError: inconsistent ``tp_size``/``tp_group``, ``tp_size > 1`` without
            ``torch.distributed``, a ``dp_group`` without ``tp_group``, not containing this rank
            or sharing ranks with the TP group, TP groups that do not split the world evenly
            (when the DP group is inferred).
        AgreementError: another rank failed its checks, or the ranks disagree (listed per rank:
            tp size, config, recipe, dtypes, a sample of the weights, ...).
    """
    error, layout, size, shared = None, None, None, {}
    group, share = agreement_scope(tp_group, dp_group)
    try:  # every local check, then one agreement: the same outcome on every rank, before any other collective
        size, layout = prepare(model, tp_size, tp_group, recipe, pad_vocab_multiple, sequence_parallel, dp_group)
        shared = fingerprint(model, layout, size, group)
    except Exception as e:  # noqa: BLE001 - re-raised by agree on this rank, reported on the others
        error = e
    tp_groups = agree("tpify.parallelize", shared, error, group=group, share=share)
    return finish(model, size, layout, tp_group, dp_group, tp_groups)
