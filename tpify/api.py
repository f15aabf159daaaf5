"""The verbs: :func:`parallelize`, :func:`from_pretrained`, :func:`save_pretrained`,
:func:`load_weights_`, :func:`remove_hooks`: one pipeline, in one module.

1. :func:`prepare` (local, no collective): refuse what cannot be parallelized, resolve the tp
   size, load the recipe, build the :class:`~tpify.layout.Layout`;
2. :func:`tpify.agree.agree`: every rank learns every rank's outcome and fingerprint;
3. :func:`finish` (collective: groups): the :class:`~tpify.context.TPContext`, surgery
   (:mod:`tpify.surgery`), ``model.tp_info`` (:func:`tpify.info.set_tp_info`), the hooks, the
   guards, the HF methods.

:func:`from_pretrained` runs 1 on a meta model next to its checkpoint checks (:mod:`tpify.io`),
agrees once on both, runs 3, reads this rank's slices and agrees again; :func:`save_pretrained`
gathers each file's tensors and writes an HF directory atomically (:mod:`tpify.io.save`).
Megatron-LM, arXiv:1909.08053, section 3.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig

from . import comm, hf_methods, hooks
from .agree import agree, agreement, digest
from .context import CallState, TPContext
from .grad_sums import SummedGrads
from .hf_methods import check_before_parallelize
from .hf_plan import recipe_for_unshipped
from .hooks import guards
from .info import (TPInfo, TPUsageError, foreign_shards, get_tp_info, param_specs, record_specs, set_tp_info,
                   tp_info_of)
from .io.files import Snapshot, TensorHeader, open_checkpoint, stored_float_dtype
from .io.keys import dense_shapes, match_checkpoint, replicated_head, saved_tensors
from .io.reader import check_loaded, materialize
from .io.save import gather_dense, plan_shards, shard_size_limit, staged
from .layers import ColumnParallelInput
from .layout import Layout, build_layout
from .context_parallel import check_model as check_context_parallel
from .mesh import (INFER, agreement_scope, check_dp_group, check_mesh, check_replica_groups, cp_group_of, cp_size_of,
                   cp_tp_group_of, mesh_device_type, replica_groups, resolve_groups, resolve_tp_size)
from .meta_model import build_meta_model, init_missing, resolve_class, resolve_dtype
from .quantized import (check_layout, load_prequantized_, plan_prequantized, quantization_spec, quantize_,
                        refuse_if_quantized, saved_quantization)
from .quantized_int8 import Int8Spec, int8_spec, is_int8_config, quantize_int8_
from .quantized_torchao import TorchAoSpec, check_torchao_layout, is_torchao_config, quantize_torchao_, torchao_spec
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

        return recipe_for_unshipped(model, model_type)
    return load_recipe(model_type)


#: Elements of each tensor that :func:`weights_digest` samples.
_SAMPLES_PER_TENSOR = 16


def weights_digest(tensors) -> str | None:
    """A digest of up to 16 evenly spaced values of each tensor, as float64 (exact up to 2**53),
    or None if any is on the meta device: ranks that built ``from_config`` without a common seed
    differ there. One device-to-host copy; no collective.
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
            lm_loss_chunk: int | str | None = None, mesh=None, ep_size: int = 1,
            grad_reduce_dtype: torch.dtype | None = None, cp_attention: str = "allgather") -> tuple[int, Layout]:
    """The local half of the pipeline: ``(tp_size, layout)``; no collective.

    Raises:
        ValueError, TPUsageError, RecipeError, PlanError: as :func:`parallelize`.
    """
    if tp_info_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized")
    check_grad_reduce_dtype(grad_reduce_dtype)
    check_before_parallelize(model)
    if mesh is not None:
        size = check_mesh(mesh, tp_size, tp_group, dp_group)
        check_context_parallel(model, cp_size_of(mesh), cp_attention, size)
    else:
        size = resolve_tp_size(tp_size, tp_group)
        check_dp_group(dp_group, tp_group)
        check_context_parallel(model, 1, cp_attention)  # the value checked; no CP group without a mesh
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    layout = build_layout(model, resolve_recipe(model, recipe), size, pad_vocab_multiple=pad_vocab_multiple,
                          sequence_parallel=sequence_parallel, lm_loss_chunk=lm_loss_chunk, ep_size=ep_size)
    if mesh is None:
        check_replica_groups(layout.replica_shards(), tp_group, dp_group)
    return size, layout


def check_grad_reduce_dtype(value) -> None:
    """``parallelize(grad_reduce_dtype=...)``: None or a floating ``torch.dtype``.

    Raises:
        ValueError: anything else (naming it), on every rank before any collective.
    """
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"grad_reduce_dtype must be None (the dtype of the matmul that made each gradient) or a "
                         f"floating torch.dtype such as torch.float32, got {value!r}")


def finish(model: nn.Module, size: int, layout: Layout, tp_group: dist.ProcessGroup | None,
           dp_group: "dist.ProcessGroup | None | str" = INFER, tp_groups: list | None = None,
           mesh=None, grad_reduce_dtype: torch.dtype | None = None, cp_attention: str = "allgather") -> nn.Module:
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
    # context parallelism: replicated parameters' partial gradients summed over cp x tp
    ctx = TPContext(tp_group, region_input=ColumnParallelInput(), state=CallState(),
                    replica_groups=replica_groups(shards, tp_group, mesh, tp_groups),
                    summed_grads=SummedGrads(cp_tp_group_of(mesh, tp_group)), cp_group=cp_group_of(mesh),
                    grad_reduce_dtype=grad_reduce_dtype, cp_attention=cp_attention)
    ctx.rng = new_tracker(ctx.rank)
    apply_layout(model, layout, ctx)  # surgery: swap, tie, divide
    info = TPInfo(ctx, dp_group, layout, dp_source=dp_source, mesh=mesh, foreign_shards=foreign_shards(model))
    set_tp_info(model, info)
    record_specs(model)  # each parameter's ShardSpec by name, for once FSDP2 has replaced them
    info.hooks = hooks.install(model, layout, ctx)  # what makes the model compute what the dense one does
    info.guards = guards.install(model, info)  # before every other hook: what would be silently wrong
    hf_methods.install(model, save_pretrained)  # TP-aware save_pretrained, gradient checkpointing; resize refused
    return model


def remove_hooks(model: nn.Module) -> int:
    """Remove the hooks that make a parallelized model compute what the dense one does; return how many.

    The parallel layers stay (same forward); dropout in sharded regions then draws from the
    default stream and ``labels=`` gives HF's loss on the gathered logits. The guards stay
    (``tp_info.guards``): what would train silently wrong is still refused.

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
    grad_reduce_dtype: torch.dtype | None = None,
    quantization_config=None,
    cp_attention: str = "allgather",
) -> nn.Module:
    """Make a Hugging Face model tensor-parallel in place, by module surgery, and return it.

    Megatron-LM (arXiv:1909.08053, section 3): the recipe of ``config.model_type`` (or ``recipe``)
    picks the modules that become ``ColumnParallelLinear``, ``RowParallelLinear`` and
    ``VocabParallelEmbedding``; each rank keeps its shard, tied weights stay tied, HF ``forward``
    is untouched (``model(...)``, ``labels=``, ``generate()`` behave as on the dense model). The
    model must be loaded identically on every rank of the TP group. Every argument, and what
    ``model.tp_info`` holds: docs/parallelize.md. ``quantization_config`` (a
    ``transformers.BitsAndBytesConfig``, 4-bit, or ``transformers.TorchAoConfig(Int8WeightOnlyConfig())``):
    each rank then holds its shards quantized, equal to the dense quantized weight's slices, every
    parameter frozen for QLoRA (docs/quantization.md).
    ``cp_attention`` (with a ``mesh`` whose ``"cp"`` axis is larger than 1): how attention runs
    over the split sequence, ``"allgather"`` (default), ``"ring"`` or ``"alltoall"``
    (docs/context-parallelism.md).

    Shapes: ``.logits`` ``(B, T, V)`` on every rank (vocabulary padding stripped); with ``labels=``
    the loss is vocab-parallel (:mod:`tpify.loss`) and ``.logits`` this rank's shard
    ``(B, T, V_padded / tp_size)`` (None with ``lm_loss_chunk``).
    Communication: one agreement (:func:`tpify.agree.agree`, the rendezvous store: no collective),
    then the TP/DP groups and the KV replica groups (collective over the world); with double
    quantization one all-gather of statistics over the TP group per quantized layer; with torchao
    int8 one all-gather of per-row ``(min, max)`` per row-parallel layer, with torchao NF4 one of the
    block absmax per quantized layer.

    Raises:
        RecipeError: no recipe for the model type, or a malformed recipe.
        PlanError: a PEFT model; uncovered modules; indivisible head counts or features (naming the
            module, the numbers and the tp sizes that work); ``pad_vocab_multiple`` outside 1 to 65,536;
            a quantized layer whose split would cut a quantization block, or of a style with no
            quantized form (:func:`tpify.quantized.check_layout`).
        ImportError, NotImplementedError: ``quantization_config`` needs bitsandbytes, or asks for
            what is not built (torchao other than int8 weight-only per row and NF4; 8-bit options: :func:`tpify.quantized.quantization_spec`,
            :func:`tpify.quantized_int8.int8_spec`,
            :func:`tpify.quantized_torchao.torchao_spec`).
        TPUsageError: gradient checkpointing enabled before; DTensor parameters (FSDP2 applied first);
            ``cp_attention="alltoall"`` with query heads per TP rank that ``cp_size`` does not divide.
        ValueError: inconsistent ``tp_size`` / ``tp_group`` / ``dp_group`` / ``mesh``; ``tp_size > 1``
            without torch.distributed; TP groups that do not split the world evenly; a
            ``grad_reduce_dtype`` that is not None or a floating dtype; a ``cp_attention`` other
            than ``"allgather"``, ``"ring"``, ``"alltoall"``.
        AgreementError: another rank failed its checks, or the ranks disagree (listed per rank).
    """
    error, layout, size, shared, quant = None, None, None, {}, None
    group, share = agreement_scope(tp_group, dp_group)
    try:  # every local check, then one agreement: the same outcome on every rank, before any other collective
        size, layout = prepare(model, tp_size, tp_group, recipe, pad_vocab_multiple, sequence_parallel, dp_group,
                               lm_loss_chunk, mesh, ep_size, grad_reduce_dtype, cp_attention)
        quant = _check_quantization(model, layout, quantization_config)
        shared = fingerprint(model, layout, size, group) | {"grad_reduce_dtype": str(grad_reduce_dtype),
                                                            "cp_attention": cp_attention}
        shared |= {"quantization": repr(quant[1])} if quant else {}
    except Exception as e:  # noqa: BLE001 - re-raised by agree on this rank, reported on the others
        error = e
    tp_groups = agree("tpify.parallelize", shared, error, group=group, share=share)
    finish(model, size, layout, tp_group, dp_group, tp_groups, mesh, grad_reduce_dtype, cp_attention)
    return _quantize(model, *quant) if quant is not None else model


def _check_quantization(model: nn.Module, layout: Layout, config) -> tuple[list[str], object] | None:
    """``(the FQNs to quantize, the QuantizationSpec)`` of ``quantization_config``, or None without one;
    pure (:func:`tpify.quantized.check_layout`)."""
    if config is None:
        return None
    if is_torchao_config(config):  # dispatch on the config class: torchao int8 weight-only
        return check_torchao_layout(model, layout, torchao_spec(config))
    if is_int8_config(config):  # bitsandbytes 8-bit (LLM.int8): tpify.quantized_int8
        spec = int8_spec(config)
        return check_layout(model, layout, spec), spec
    qspec = quantization_spec(config)
    return check_layout(model, layout, qspec), qspec


def _quantize(model: nn.Module, fqns: list[str], qspec) -> nn.Module:
    """Quantize the checked layers with the spec's library (:mod:`tpify.quantized`, :mod:`tpify.quantized_int8`, :mod:`tpify.quantized_torchao`)."""
    if isinstance(qspec, TorchAoSpec):
        return quantize_torchao_(model, fqns, qspec)
    if isinstance(qspec, Int8Spec):
        return quantize_int8_(model, fqns, qspec)
    return quantize_(model, fqns, qspec)


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
    grad_reduce_dtype: torch.dtype | None = None,
    torch_dtype: torch.dtype | str | None = None,
    quantization_config=None,
    cp_attention: str = "allgather",
    stage_cut=None,
) -> nn.Module:
    """Load a local Hugging Face safetensors checkpoint tensor-parallel, each rank reading its slices.

    The dense model is built on the meta device and parallelized there as :func:`parallelize`
    does; each parameter is then read through its :class:`~tpify.sharding.ShardSpec` with
    ``safe_open(file).get_slice(name)``: rank ``r`` reads only its rows or columns (one-range
    shards as zero-copy views of the file's mapping unless ``disable_mmap``), never the dense
    model. ``dtype`` (or its deprecated name ``torch_dtype``), ``model_class`` and the key mapping
    behave as transformers 5's; ``tp_size``, ``tp_group``, ``dp_group``, ``mesh``, ``recipe``,
    ``pad_vocab_multiple``, ``sequence_parallel``, ``lm_loss_chunk``, ``ep_size``,
    ``grad_reduce_dtype``, ``quantization_config``, ``cp_attention`` as in :func:`parallelize` (the slices are read
    dense, then quantized: peak memory per rank is the dense shard's). A checkpoint saved 4-bit by
    transformers (bitsandbytes, its ``config.json`` holding the ``quantization_config``) is read as
    stored: each rank reads only its blocks' codes and absmax. ``stage_cut``: a function called
    with the parallel meta model before anything is read, which removes the modules this rank does
    not hold (:func:`tpify.pipeline.from_pretrained` passes its cut: only the stage's tensors are
    read). Every argument: docs/loading-and-saving.md. Returns the parallelized model, in eval mode.

    Communication: one agreement on the local checks (the checkpoint's names, shapes and dtype),
    :func:`parallelize`'s groups, no collective while reading, one agreement after it.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: ``dtype`` and ``torch_dtype`` both given; a dtype that is not floating.
        NotImplementedError: a pre-quantized checkpoint tpify cannot read by slices
            (:func:`tpify.quantized.plan_prequantized`: not bitsandbytes 4-bit, a tensor's state
            unlike the config's, Conv1D layers, other skipped modules).
        CheckpointError: no safetensors weights; a truncated or corrupt file; tensors missing or of
            another shape; an index and its files that disagree (:func:`tpify.io.files.open_checkpoint`).
        PlanError, RecipeError, ValueError: as :func:`parallelize`.
        AgreementError: on the other ranks when one raised; the ranks' checkpoints or arguments differ.
    Warns:
        UserWarning: checkpoint tensors the model does not use; FutureWarning: ``torch_dtype=``.
    """
    path = Path(path)
    group, share = agreement_scope(tp_group, dp_group)
    with agreement("tpify.from_pretrained", group=group, share=share) as checked:  # every local check first
        dtype, argument = _dtype_argument(dtype, torch_dtype)
        saved_quant = saved_quantization(path)  # a checkpoint saved 4-bit: its layers read by slices, as stored
        if saved_quant is not None and quantization_config is not None:
            raise ValueError(f"{path} is saved quantized already ({saved_quant}); drop quantization_config")
        load = _prepare_load(path, model_class, (dtype, argument), recipe, tp_size, tp_group,
                             (pad_vocab_multiple, sequence_parallel, dp_group, lm_loss_chunk, mesh, ep_size,
                              grad_reduce_dtype, cp_attention), group, saved_quant)
        quant = _check_quantization(load.model, load.layout, quantization_config)
        if saved_quant is not None:
            quant = None
        checked.fingerprint = load.fingerprint | {"grad_reduce_dtype": str(grad_reduce_dtype),
                                                  "cp_attention": cp_attention}
        checked.fingerprint |= {"quantization": repr(quant[1])} if quant else {}
    model = load.model
    try:  # the files stay open from the headers to the last slice: one save, never a mix
        finish(model, load.tp_size, load.layout, tp_group, dp_group, checked.shared, mesh,  # groups, surgery, hooks
               grad_reduce_dtype, cp_attention)
        if stage_cut is not None:  # pipeline stages: the modules of other stages go before anything is read
            stage_cut(model)
            held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
            load.to_init = [f for f in load.to_init if f in held]
        with agreement("reading the checkpoint in tpify.from_pretrained", group=tp_group) as read:
            materialize(model, load.snap, load.source, load.headers, load.dtype, copy=disable_mmap)
            if load.prequantized is not None:
                load_prequantized_(model, load.prequantized, saved_quant, load.snap)
            init_missing(model, load.to_init, load.dtype)
            check_loaded(model)
            if stage_cut is None:
                read.fingerprint = _replicated_fingerprint(model)
        if stage_cut is not None:  # stages hold other tensors: their replicated values compared within the TP group
            agree("the replicated weights read in tpify.from_pretrained", _replicated_fingerprint(model),
                  group=get_tp_info(model).tp_group)
    finally:
        load.snap.close()
    return _quantize(model, *quant) if quant is not None else model


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
    prequantized: dict | None = None  # layer FQN -> its 4-bit tensors in a pre-quantized checkpoint


def _prepare_load(path: Path, model_class, asked, recipe, tp_size, tp_group, options, agree_group,
                  saved_quant=None) -> _Load:
    """The local part of :func:`from_pretrained` (``asked``: the dtype asked for and the name of its
    argument, :func:`_dtype_argument`): config, the checkpoint's files and headers, the
    meta model, its layout (``api.prepare``; ``options``: its pad_vocab_multiple,
    sequence_parallel, dp_group, lm_loss_chunk, mesh, ep_size, grad_reduce_dtype and cp_attention),
    the key map, and the fingerprint every rank must share (the
    checkpoint's and :func:`tpify.api.fingerprint`). No collective; the files are closed again
    on an error.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        CheckpointError, ValueError, PlanError, RecipeError: as :func:`from_pretrained`.
    """
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
        prequantized = None
        if saved_quant is not None:  # the quantized weights matched by their dense shapes, read apart
            headers, prequantized = plan_prequantized(model, layout, saved_quant, snap, headers)
        source, to_init = match_checkpoint(model, headers, dense_shapes(model), path, cls.__name__, layout.renames,
                                           may_init=lambda fqns: replicated_head(model, fqns, layout))
        shared = {**fingerprint(model, layout, size, agree_group), "dtype": str(dtype),
                  "checkpoint tensors": _checkpoint_digest(headers)}
        for fqn in prequantized or ():
            source.pop(f"{fqn}.weight", None)
        return _Load(model, size, layout, snap, headers, source, to_init, dtype, shared, prequantized)
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

    Each rank reads only its slices (as :func:`from_pretrained`) and copies them into the existing
    parameters and persistent buffers (converted to their dtype), so optimizers keep pointing at
    them. Communication: one agreement over the TP group after the local checks, one after reading.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`from_pretrained`.
        TPUsageError: the parameters are DTensors (FSDP2).
        AgreementError: on the other ranks when one raised; the ranks' checkpoints differ.
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
    """Save a parallelized model as a standard Hugging Face directory, its files written by several ranks.

    Every tensor is gathered to its dense layout (:meth:`ShardSpec.gather`: padding stripped,
    packed ``[Q|K|V]`` packed again), grouped into files of at most ``max_shard_size`` written in
    rounds of one file per rank (a rank holds one file's dense tensors at a time); transformers and
    :func:`from_pretrained` (any tp size) load the result. ``path`` goes from the checkpoint it
    holds to the new one atomically (:mod:`tpify.io.save`): a failure on any rank leaves it
    untouched; files other than weights and configs are kept. Details: docs/loading-and-saving.md.

    Communication: per tensor one all-gather over the TP group (under FSDP2 first one over DP);
    small object gathers and one agreement per round of files over the world. Every rank calls it.

    Raises:
        ValueError: ``path`` is a file; ``max_shard_size`` is not a positive size (every rank, first).
        AgreementError: on the other ranks when one raised; the ranks hold different models.
        RuntimeError: on the other ranks, when a rank failed writing or rank 0 failed moving the
            checkpoint in (``path`` then holds one whole checkpoint).
    """
    path = Path(path)
    refuse_if_quantized(model, "tpify.save_pretrained")  # every rank alike, before any collective
    entries = saved_tensors(model)
    with agreement("tpify.save_pretrained") as checked:  # every local check first
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_pretrained: {path} exists and is not a directory; pass a directory path")
        shard_size_limit(max_shard_size)  # a positive size, before anything is gathered or written

        specs = param_specs(model)
        checked.fingerprint = {"saved tensors": digest([(k, _dense_shape(t, specs), str(t.dtype)) for k, t in entries]),
                               "max_shard_size": str(max_shard_size)}
    info = tp_info_of(model)
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

