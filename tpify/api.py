"""The verbs: :func:`parallelize`, :func:`from_pretrained`, :func:`save_pretrained`,
:func:`load_weights_`, :func:`remove_hooks`: one pipeline, in one module.

One pipeline, in halves with an agreement between them:

1. :func:`prepare` (local, no collective): refuse what cannot be parallelized, resolve the tp
   size, load the recipe, build the :class:`~tpify.layout.Layout`;
2. :func:`tpify.agree.agree` (every rank learns every rank's outcome and fingerprint);
3. :func:`finish` (collective: groups): surgery by the layout (:mod:`tpify.surgery`),
   ``model.tp_info``, the hooks (:mod:`tpify.hooks`), the guards, the HF methods.

:func:`parallelize` runs 1-2-3 on a loaded model. :func:`from_pretrained` builds the dense model
on the meta device (:mod:`tpify.meta_model`), runs 1 there next to its checkpoint checks
(:mod:`tpify.io`), agrees once on both, runs 3, then reads this rank's slices
(:mod:`tpify.io.reader`) and agrees again. :func:`save_pretrained` gathers each file's tensors
to their dense layout and writes a standard HF directory atomically (:mod:`tpify.io.save`).
Every step that may fail on one rank is followed by an agreement, so it fails on every rank.
Megatron-LM, arXiv:1909.08053, section 3.
"""

from __future__ import annotations

import hashlib
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import comm, hf_methods, hooks
from .agree import agree, agreement, digest
from .context import CallState, TPContext
from .grad_sums import SummedGrads
from .hf_methods import check_before_parallelize
from .hooks import guards
from .info import TPInfo, TPUsageError, foreign_shards, get_tp_info, param_specs, record_specs
from .io.files import Snapshot, TensorHeader, open_checkpoint, stored_float_dtype
from .io.keys import dense_shapes, match_checkpoint, replicated_head, saved_tensors
from .io.reader import check_loaded, materialize
from .io.save import gather_dense, plan_shards, shard_size_limit, staged
from .layers import ColumnParallelInput
from .layout import Layout, build_layout
from .mesh import (INFER, agreement_scope, check_dp_group, check_mesh, check_replica_groups, mesh_device_type,
                   replica_groups, resolve_groups, resolve_tp_size)
from .meta_model import build_meta_model, init_missing, resolve_class, resolve_dtype
from .random import new_tracker
from .recipe import Recipe, available_recipes, load_recipe
from .sharding import is_dtensor, shard_spec_of
from .surgery import apply_layout

__all__ = ["parallelize", "from_pretrained", "save_pretrained", "load_weights_", "remove_hooks", "prepare", "finish",
           "resolve_recipe", "fingerprint", "weights_digest"]


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
    if model_type not in available_recipes():  # transformers' own TP plan, imported with a notice (tpify/hf_plan/)
        from .hf_plan import recipe_for_unshipped

        return recipe_for_unshipped(model, model_type)
    return load_recipe(model_type)


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
            sequence_parallel: bool = False, dp_group: "dist.ProcessGroup | None | str" = INFER,
            lm_loss_chunk: int | str | None = None, mesh=None, ep_size: int = 1) -> tuple[int, Layout]:
    """The local half of the pipeline: ``(tp_size, layout)``; no collective.

    Raises:
        ValueError, TPUsageError, RecipeError, PlanError: as :func:`parallelize`.
    """
    if getattr(model, "tp_info", None) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized")
    check_before_parallelize(model)
    if mesh is not None:
        size = check_mesh(mesh, tp_size, tp_group, dp_group)
    else:
        size = resolve_tp_size(tp_size, tp_group)
        check_dp_group(dp_group, tp_group)
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    layout = build_layout(model, resolve_recipe(model, recipe), size, pad_vocab_multiple=pad_vocab_multiple,
                          sequence_parallel=sequence_parallel, lm_loss_chunk=lm_loss_chunk, ep_size=ep_size)
    if mesh is None:
        check_replica_groups(layout.replica_shards(), tp_group, dp_group)
    return size, layout


def finish(model: nn.Module, size: int, layout: Layout, tp_group: dist.ProcessGroup | None,
           dp_group: "dist.ProcessGroup | None | str" = INFER, tp_groups: list | None = None,
           mesh=None) -> nn.Module:
    """The collective half of the pipeline, after the agreement: groups, surgery, ``tp_info``, the
    parallel LM loss, the HF methods and the guards.

    ``tp_groups``: every rank's TP-group ranks, as the agreement shared them
    (:func:`agreement_scope`), when the DP group must be inferred; ``mesh``: the DeviceMesh
    passed to :func:`parallelize` (else :func:`tpify.mesh.init_mesh` builds one when no group
    was given)."""
    tp_group, dp_group, dp_source, mesh = resolve_groups(size, tp_group, dp_group, tp_groups, mesh,
                                                         device_type=mesh_device_type(model))
    if dp_source == "argument":  # the DP peers must hold the same shard of the same model
        agree("tpify.parallelize (the DP group passed as dp_group)",
              {"tp_size": size, "tp rank": comm.group_rank(tp_group), "layout": layout.digest(),
               "model class": type(model).__name__}, group=dp_group)
    shards = layout.replica_shards()
    ctx = TPContext(tp_group, region_input=ColumnParallelInput(), state=CallState(),
                    replica_groups=replica_groups(shards, tp_group, mesh, tp_groups), summed_grads=SummedGrads(tp_group))
    ctx.rng = new_tracker(ctx.rank)
    apply_layout(model, layout, ctx)  # surgery: swap, tie, divide
    info = TPInfo(size, ctx.rank, tp_group, dp_group, layout, ctx.rng, dp_source=dp_source, state=ctx.state,
                  mesh=mesh, foreign_shards=foreign_shards(model), replica_groups=ctx.replica_groups,
                  model_ref=weakref.ref(model))  # the repr's bytes per rank; a weakref: no cycle through the model
    model.tp_info = info
    record_specs(model)  # each parameter's ShardSpec by name, for once FSDP2 has replaced them
    info.hooks = hooks.install(model, layout, ctx)  # what makes the model compute what the dense one does
    info.guards = guards.install(model, info)  # before every other hook: what would be silently wrong
    hf_methods.install(model, save_pretrained)  # TP-aware save_pretrained, gradient checkpointing; resize refused
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


def parallelize(
    model: nn.Module,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: "dist.ProcessGroup | None | str" = INFER,
    recipe: "str | Path | dict | Recipe | None" = None,
    pad_vocab_multiple: int = 1,
    sequence_parallel: bool = False,
    lm_loss_chunk: int | str | None = None,
    mesh=None,
    ep_size: int = 1,
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
            GPUs). Default 1: the least padding that makes the rows divisible; at most 65,536
            (:data:`tpify.layout.MAX_PAD_VOCAB_MULTIPLE`). The padded rows
            are zeros no id reaches, never in the loss, stripped from gathered logits and saves.
        sequence_parallel: also split along the tokens what tensor parallelism leaves
            replicated (LayerNorms, dropout, residual adds; Korthikanti et al.,
            arXiv:2205.05198), where the recipe marks it (``[sequence_parallel]``): all-reduces
            become reduce-scatter + all-gather pairs (same bytes), activation memory there
            ``1/tp_size``. Training batches need ``T`` divisible by ``tp_size``
            (:class:`tpify.hooks.sequence_parallel.SequenceParallel`).
        lm_loss_chunk: compute the ``labels=`` loss from the LM head's input in chunks of this
            many tokens (:func:`tpify.loss.vocab_parallel_linear_cross_entropy`): with labels the
            head does not run, no ``(B, T, V/p)`` logits exist, and ``.logits`` is None; without
            labels nothing changes (``generate`` works). ``"auto"``: the chunk
            :func:`tpify.loss.default_chunk_size` picks from the tokens and ``H``. Default None:
            the loss from the logits shard (docs/loss.md).
        mesh: a ``("dp_replicate", "dp_shard", "tp")`` DeviceMesh of the whole world
            (:func:`tpify.init_mesh`), instead of ``tp_size``/``tp_group``: its ``"tp"`` axis is
            the TP group, its data-parallel axes flattened the DP group, and
            :func:`tpify.shard_data_parallel` shards over them (HSDP with ``dp_replicate > 1``).
            Default: ``tpify.init_mesh(tp_size)`` when no ``tp_group`` is given.
        ep_size: for the recipe's ``experts`` modules (fused MoE experts): 1 (default),
            tensor-parallel experts (every expert's intermediate dimension split, the output
            all-reduced); or ``tp_size``, expert parallelism over the TP group (rank ``r`` holds
            experts ``[r E/p, (r+1) E/p)`` whole; each rank routes its share of the tokens to the
            experts' ranks with all-to-all; :mod:`tpify.styles.experts`). Attention and the rest
            are tensor-parallel either way. With ``world = dp * tp``, the DP replicas hold the
            same experts on the same TP rank.

    The model's ``save_pretrained`` then writes the dense checkpoint (collective, like
    :func:`tpify.save_pretrained`), ``resize_token_embeddings`` raises, and running it inside a
    ``DistributedDataParallel`` over other ranks than its DP group raises
    (:mod:`tpify.integrations.model`). ``state_dict()`` returns this rank's shards, tagged with
    their tp rank and layout; ``load_state_dict`` loads a rank's own, slices dense tensors to this
    rank's shard and refuses other ranks' shards on every rank (:mod:`tpify.hooks.state_dict`).

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
            the tp sizes that would work); a ``pad_vocab_multiple`` outside 1 to 65,536 (on
            every rank, before anything is allocated or communicated).
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
        size, layout = prepare(model, tp_size, tp_group, recipe, pad_vocab_multiple, sequence_parallel, dp_group,
                               lm_loss_chunk, mesh, ep_size)
        shared = fingerprint(model, layout, size, group)
    except Exception as e:  # noqa: BLE001 - re-raised by agree on this rank, reported on the others
        error = e
    tp_groups = agree("tpify.parallelize", shared, error, group=group, share=share)
    return finish(model, size, layout, tp_group, dp_group, tp_groups, mesh)


# ---------------------------------------------------------------------------------------------
# Loading and saving: the same pipeline on a meta model next to its checkpoint, and back to files.

def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: "dist.ProcessGroup | None | str" = "infer",
    dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    recipe=None,
    pad_vocab_multiple: int = 1,
    sequence_parallel: bool = False,
    disable_mmap: bool = False,
    lm_loss_chunk: int | str | None = None,
    mesh=None,
    ep_size: int = 1,
    torch_dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Load a local Hugging Face safetensors checkpoint tensor-parallel, each rank reading its slice.

    The model is built on the meta device, parallelized there by the recipe (the same sequence
    as :func:`tpify.parallelize`), and every parameter is then read with
    ``safe_open(file).get_slice(name)`` through its :class:`~tpify.sharding.ShardSpec`: rank
    ``r`` reads only the rows/columns it holds (packed ``[Q|K|V]`` per part, padded vocabularies
    padded with zero rows), replicated parameters are read whole. Shards that are one range of
    their split dimension in the stored dtype (replicated tensors, unpadded vocabulary rows,
    column-parallel ``nn.Linear`` weights: contiguous; row-parallel ``nn.Linear`` weights: a
    strided slice of every row, not contiguous) are zero-copy views of a private
    (copy-on-write) mapping of the file, read from the page cache when first used, as
    transformers 5 does for a whole model; the others (packed parts, padded vocabularies, a
    dtype conversion) are copied into owned memory. A rank's peak memory is about its shard
    (plus, for strided views, the page-cache pages its rows share with the next rank's) plus
    one block (16 MiB) in flight, never the dense model.
    As with transformers, replacing or deleting the files afterwards is safe, rewriting them in
    place while the model lives is not (``disable_mmap=True`` copies everything). Tied parameters
    (``lm_head.weight`` = ``wte.weight``) are read once and stay one Parameter. Non-persistent
    buffers (BERT ``position_ids``, rotary ``inv_freq``) are computed by the model's constructor
    exactly as transformers does. Keys are mapped as transformers 5 maps them: the base-model
    prefix (``bert.``) is added or stripped, legacy ``LayerNorm.gamma/beta`` are renamed;
    checkpoint tensors stored for non-persistent buffers (old ``position_ids``) are ignored.

    Args:
        path: local directory with ``config.json`` and ``model.safetensors`` or several files
            plus ``model.safetensors.index.json`` (``weight_map``). Nothing is downloaded. Where
            several are present, the one transformers 5 loads is read (``transformers_weights``
            in config.json, then ``model.safetensors``, then the index), and only its files.
        tp_size, tp_group, dp_group, pad_vocab_multiple, sequence_parallel, lm_loss_chunk, mesh, ep_size:
            as in :func:`tpify.parallelize` (default: the whole world).
        dtype: dtype of the floating parameters (a ``torch.dtype``, its name, or ``"auto"``), as in
            transformers 5; each slice is converted as it is read, and ``config.dtype`` says it
            (what :func:`save_pretrained` writes). Default (``None``/``"auto"``): ``config.dtype``,
            else the checkpoint's dtype.
        torch_dtype: the deprecated name of ``dtype`` (transformers 4's), accepted with a
            ``FutureWarning``; passing both is an error.
        model_class: the ``transformers`` class to build; default ``config.architectures[0]``.
            A head class loads a base-model checkpoint (keys without ``bert.``) and vice versa.
            Head parameters absent from a base checkpoint are initialised by the model's
            ``_init_weights`` under a fixed seed (identical on every rank) with a warning, as
            transformers does; they must be replicated (a missing sharded tensor is an error).
        recipe: a recipe name, path, mapping or Recipe; default ``config.model_type``.
        disable_mmap: copy every shard into owned memory, none left as a view of the file's
            mapping (transformers' ``disable_mmap``): the model then no longer depends on the
            files at all, at the cost of a copy (slower where first-touching new memory is slow).

    Returns:
        The parallelized model (``model.tp_info`` set), in eval mode like transformers' loads.

    Communication: one agreement (:func:`tpify.agree.agree`) after the local checks, so a rank whose copy
    of the checkpoint is missing, truncated or different (tensor names and shapes, dtype) stops
    every rank with an error instead of a hang; then :func:`tpify.parallelize`'s agreement and
    groups; reading issues no collective, and one more agreement after it reports a file that
    failed while reading on any rank to every rank.

    Raises:
        FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
        ValueError: ``dtype`` and ``torch_dtype`` both given; a dtype that is not floating.
        CheckpointError: no safetensors weights; a truncated/corrupt file (named); tensors the
            model needs that the checkpoint lacks; tensors whose shape differs from the model's;
            an index that lists a tensor in two files, a tensor stored in two files, a file the
            index names that is missing, files of different saves (:func:`tpify.io.files.open_checkpoint`).
        PlanError, RecipeError, ValueError: as :func:`tpify.parallelize`.
        AgreementError: on the other ranks, when one rank raised one of these; when the ranks'
            checkpoints or arguments differ.
    Warns:
        UserWarning: checkpoint tensors the model does not use (like transformers' "unexpected").
        FutureWarning: ``torch_dtype=`` (use ``dtype=``).
    """
    path = Path(path)
    group, share = agreement_scope(tp_group, dp_group)
    with agreement("tpify.from_pretrained", group=group, share=share) as checked:  # every local check first
        dtype, argument = _dtype_argument(dtype, torch_dtype)
        load = _prepare_load(path, model_class, (dtype, argument), recipe, tp_size, tp_group,
                             (pad_vocab_multiple, sequence_parallel, dp_group, lm_loss_chunk, mesh, ep_size), group)
        checked.fingerprint = load.fingerprint
    model = load.model
    try:  # the files stay open from the headers to the last slice: one save, never a mix
        finish(model, load.tp_size, load.layout, tp_group, dp_group, checked.shared, mesh)  # groups, surgery, hooks
        with agreement("reading the checkpoint in tpify.from_pretrained", group=tp_group) as read:
            materialize(model, load.snap, load.source, load.headers, load.dtype, copy=disable_mmap)
            init_missing(model, load.to_init, load.dtype)
            check_loaded(model)
            read.fingerprint = _replicated_fingerprint(model)
    finally:
        load.snap.close()
    return model


def _dtype_argument(dtype, torch_dtype) -> tuple[object, str]:
    """``(the dtype asked for, the name of the argument it came in)``: ``dtype=``, or its deprecated
    name ``torch_dtype=`` (transformers 5 renamed it; a ``FutureWarning`` at the caller's line).

    Raises:
        ValueError: both given.
    """
    if torch_dtype is None:
        return dtype, "dtype"
    if dtype is not None:
        raise ValueError(f"from_pretrained: dtype={dtype!r} and torch_dtype={torch_dtype!r} both given; torch_dtype is "
                         f"the deprecated name of dtype (transformers 5): pass dtype= alone")
    warnings.warn("tpify.from_pretrained: torch_dtype is deprecated, use dtype= (its name in transformers 5)",
                  FutureWarning, stacklevel=3)  # the line that called from_pretrained
    return torch_dtype, "torch_dtype"


@dataclass
class _Load:
    """What :func:`_prepare_load` found: the dense meta model, its layout, the opened checkpoint
    and what each model tensor reads from it."""

    model: nn.Module
    tp_size: int
    layout: Layout
    snap: Snapshot
    headers: dict[str, TensorHeader]
    source: dict[str, str]  # model fqn -> checkpoint key
    to_init: list[str]
    dtype: torch.dtype
    fingerprint: dict


def _prepare_load(path: Path, model_class, asked, recipe, tp_size, tp_group, options, agree_group) -> _Load:
    """The local part of :func:`from_pretrained` (``asked``: the dtype asked for and the name of its
    argument, :func:`_dtype_argument`): config, the checkpoint's files and headers, the
    meta model, its layout (``api.prepare``; ``options``: its pad_vocab_multiple,
    sequence_parallel, dp_group, lm_loss_chunk, mesh and ep_size), the key map, and the fingerprint every rank must share (the
    checkpoint's and :func:`tpify.api.fingerprint`). No collective; the files are closed again
    on an error.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        CheckpointError, ValueError, PlanError, RecipeError: as :func:`from_pretrained`.
    """
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: from_pretrained needs a local Hugging Face model "
                                f"directory (config.json + model.safetensors); nothing is downloaded")
    config = AutoConfig.from_pretrained(str(path))
    cls = resolve_class(config, model_class)
    snap, weight_map, headers = open_checkpoint(path)  # every file opened once, for the whole load
    try:
        dtype = resolve_dtype(config, stored_float_dtype(headers, weight_map), *asked)
        model = build_meta_model(config, cls, dtype)
        size, layout = prepare(model, tp_size, tp_group, recipe, *options)
        source, to_init = match_checkpoint(model, headers, dense_shapes(model), path, cls.__name__, layout.renames,
                                           may_init=lambda fqns: replicated_head(model, fqns, layout))
        shared = {**fingerprint(model, layout, size, agree_group), "dtype": str(dtype),
                  "checkpoint tensors": _checkpoint_digest(headers)}
        return _Load(model, size, layout, snap, headers, source, to_init, dtype, shared)
    except BaseException:
        snap.close()
        raise


def _dense_shape(t: torch.Tensor, specs: dict) -> list[int]:
    """The dense shape of a tensor this rank holds a shard of (the same on every rank, also where a
    split is uneven and the shards differ), or its own shape."""
    spec = specs.get(id(t), shard_spec_of(t))
    shape = list(t.shape)
    if spec is not None:
        shape[spec.dim] = spec.global_size
    return shape


def _checkpoint_digest(headers: dict[str, TensorHeader]) -> str:
    """A digest of the checkpoint's tensor names and shapes, for the agreement."""
    return digest(sorted((key, list(header.shape)) for key, header in headers.items()))


def _replicated_fingerprint(model: nn.Module) -> dict:
    """A sample of the values every rank read whole (replicated parameters and buffers), to
    compare across the TP group: a copy of the checkpoint that differs on one host (same names
    and shapes, other values) would otherwise make the replicas disagree silently."""
    replicated = [t for t in [*model.parameters(), *model.buffers()] if shard_spec_of(t) is None]
    return {"replicated weights read (a sample)": weights_digest(replicated)}


def load_weights_(model: nn.Module, path: str | os.PathLike) -> None:
    """Read a dense Hugging Face safetensors checkpoint into a parallelized model, in place.

    Each rank reads only its slices (as :func:`from_pretrained`) and copies them into the
    existing parameters and persistent buffers, converted to their dtype, so optimizers and other
    holders keep pointing at the same tensors (used to resume a Trainer run). Every tensor the
    model needs must be in the checkpoint with its dense shape.

    Communication: as :func:`from_pretrained`, one agreement (:func:`tpify.agree.agree`, over
    the model's TP group) after the local checks, so a rank whose copy is missing, truncated or
    different stops every rank, and one after reading. Call it on every rank of the TP group.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`from_pretrained`.
        AgreementError: on the other ranks, when one rank raised; when the ranks' checkpoints differ.
    """
    info = get_tp_info(model)  # raises for a model tpify did not parallelize
    path = Path(path)
    with agreement("tpify.load_weights_", group=info.tp_group) as checked:  # every local check first
        snap, source, headers = _open_for_load_weights(model, path, info.layout.renames)
        checked.fingerprint = {"checkpoint tensors": _checkpoint_digest(headers)}
    try:
        with agreement("reading the checkpoint in tpify.load_weights_", group=info.tp_group):
            materialize(model, snap, source, headers, None, in_place=True)
            check_loaded(model)
    finally:
        snap.close()


def _open_for_load_weights(model: nn.Module, path: Path, renames) -> tuple[Snapshot, dict[str, str], dict]:
    """The local part of :func:`load_weights_`: ``(opened checkpoint, {fqn: key}, headers)``,
    every tensor the model holds matched at its dense shape. No collective; the files are closed
    again on an error.

    Raises:
        TPUsageError: the model's parameters are DTensors (FSDP2).
        FileNotFoundError, CheckpointError: as :func:`from_pretrained`.
    """
    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError(f"load_weights_: {type(model).__name__}'s parameters are DTensors (FSDP2's "
                           f"fully_shard); reading a checkpoint into a model FSDP2 shards is not supported yet: "
                           f"load it with tpify.from_pretrained, then shard it with fully_shard")
    if not path.is_dir():
        raise FileNotFoundError(f"load_weights_: {path} is not a directory")
    snap, _, headers = open_checkpoint(path)
    try:
        source, _ = match_checkpoint(model, headers, dense_shapes(model), path, type(model).__name__, renames)
        return snap, source, headers
    except BaseException:
        snap.close()
        raise


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "2GB") -> None:
    """Save a (parallelized) model as a standard Hugging Face directory, its files written by several ranks.

    Every tensor is gathered to its dense layout with :meth:`ShardSpec.gather` (vocab padding
    stripped, packed ``[Q|K|V]`` re-packed), so ``transformers.AutoModel*.from_pretrained(path)``
    loads it, and :func:`from_pretrained` loads it at any valid tp size. Tied copies
    (``lm_head.weight``) are not stored, as transformers 5 does. Tensors are grouped in files of
    at most ``max_shard_size`` (``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``; one ``model.safetensors`` when all fit). The files are
    assigned to the ranks in turn (every rank that sees the temporary directory: one host, or a
    shared filesystem; else rank 0 alone) and written in rounds of one file per rank, in
    parallel: a rank holds the dense tensors of one file at a time, never the whole dense model.

    What it touches: global rank 0 creates a temporary directory ``.NAME.tmp-<id>`` beside
    ``path`` (beside the directory a symlinked ``path`` points to), first removing such
    directories that no live save holds (left by a killed save); every writer writes its files
    into it; once every rank's files are complete (an agreement after each round), rank 0 writes
    the index and the configs and moves the checkpoint in. A failure on any rank raises on every
    rank before anything is moved: ``path`` is untouched. A new ``path`` is that directory renamed. An existing ``path`` goes from the checkpoint it holds to the new one by
    one atomic rename or unlink (:mod:`tpify.io.save`): at every instant, a kill included,
    ``path`` holds one whole checkpoint, the old one or the new one, and transformers and
    :func:`from_pretrained` load the same one. Then ``config.json`` and
    ``generation_config.json`` are replaced (each atomically), and the weight files of earlier
    saves that the new checkpoint does not use (``model*.safetensors``, its index,
    ``pytorch_model*.bin``) are removed. Every other file (tokenizer, notes, Trainer
    ``checkpoint-*`` directories) is kept, as transformers' ``save_pretrained`` does. Shard files
    get the standard names when no file in ``path`` has them, else
    ``model-<id>-0000i-of-0000n.safetensors`` (``<id>``: 8 hex digits of this save's id), so
    a save never overwrites a file the current checkpoint uses; repeated saves alternate. Every
    file of one save carries its id (``tpify_save_id`` in the safetensors and index metadata).
    Not synced to disk (``fsync``), as transformers does not: the guarantee holds against a
    killed process, not a power cut.

    Under FSDP2 (``fully_shard`` over the DP dimension, parameters that are DTensors) each tensor
    is first gathered over the DP dimension (``DTensor.full_tensor``), then over TP.

    Communication: per tensor, one all-gather over the TP group (every rank of every TP group
    must call this function); two all-gathers of small objects (the save's id, who sees the
    directory) and, per round of files, one all-gather of each rank's outcome over the world; one
    all-reduce of one int around the creation of the directory and one around the move, so a
    failure on any rank raises on every rank instead of hanging them.

    Raises:
        ValueError: ``path`` is an existing file; ``max_shard_size`` is not a positive size (an
            int of bytes, or a string such as ``"2GB"``, ``"500MB"``, ``"5GiB"``), on every rank
            before any communication.
        AgreementError: on the other ranks, when ``path`` is a file on one rank; when the ranks
            hold different models (the first communication compares them, :func:`tpify.agree.agree`).
        RuntimeError: on the other ranks, when a rank failed writing its files (that rank raises
            its own error; ``path`` is untouched), or when rank 0 failed moving the checkpoint in
            (``path`` then holds one whole checkpoint, the old one unless the failure came after
            the switch, at worst with unused new shard files the next save removes).
    """
    path = Path(path)
    entries = saved_tensors(model)
    with agreement("tpify.save_pretrained") as checked:  # every local check first
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_pretrained: {path} exists and is not a directory; pass a directory path")
        shard_size_limit(max_shard_size)  # a positive size, before anything is gathered or written

        specs = param_specs(model)
        checked.fingerprint = {"saved tensors": digest([(k, _dense_shape(t, specs), str(t.dtype)) for k, t in entries]),
                               "max_shard_size": str(max_shard_size)}
    info = getattr(model, "tp_info", None)
    group = info.tp_group if info is not None else None
    plan = plan_shards(entries, specs, max_shard_size)
    with staged(path, next((t.device for _, t in entries), torch.device("cpu"))) as stage:
        for batch in stage.rounds(plan.files):  # a rank holds one file's dense tensors at a time: the one it writes
            mine = None
            for writer, name, file_entries in batch:
                dense = gather_dense(file_entries, specs, group, keep=writer == comm.group_rank(None))
                mine = (name, dense) if dense else mine
            stage.write_own(mine)
        stage.commit(model, plan.index(stage.save_id))

