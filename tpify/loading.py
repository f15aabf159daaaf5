"""Loading a Hugging Face safetensors checkpoint tensor-parallel, and saving one back: the
sequences of :mod:`tpify.io` calls behind :func:`from_pretrained`, :func:`load_weights_` and
:func:`save_pretrained`.

Data flows ``config -> meta model -> recipe surgery (on meta) -> read this rank's slices``.
:func:`from_pretrained` never materialises the dense model: it builds it on the meta device
(:func:`tpify.meta_model.build_meta_model`), parallelizes it there with the pipeline of
:func:`tpify.parallelize` (``api.prepare`` -> one agreement -> ``api.finish``), then each rank
reads only its own bytes (:mod:`tpify.io.reader`) from the checkpoint transformers 5 would
load, every file opened once (:mod:`tpify.io.files`), keys matched as transformers matches
them (:mod:`tpify.io.keys`). :func:`save_pretrained` gathers each file's tensors to their dense
layout and writes a standard HF directory atomically (:mod:`tpify.io.save`). Every step that
may fail on one rank is followed by an agreement (:mod:`tpify.agree`), so it fails on every
rank. Megatron-LM, arXiv:1909.08053, section 3 (the layouts sharded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .agree import agreement, digest
from .io.files import Snapshot, TensorHeader, open_checkpoint, stored_float_dtype
from .io.keys import dense_shapes, match_checkpoint, replicated_head, saved_tensors
from .io.reader import check_loaded, materialize
from .io.save import gather_dense, plan_shards, staged
from .layout import Layout
from .meta_model import build_meta_model, init_missing, resolve_class, resolve_dtype
from .sharding import is_dtensor, shard_spec_of

__all__ = ["from_pretrained", "save_pretrained", "load_weights_"]


def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: "dist.ProcessGroup | None | str" = "infer",
    torch_dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    recipe=None,
    pad_vocab_multiple: int = 1,
    sequence_parallel: bool = False,
    disable_mmap: bool = False,
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
        tp_size, tp_group, dp_group: as in :func:`tpify.parallelize` (default: the whole world).
        torch_dtype: dtype of the floating parameters; each slice is converted as it is read.
            Default (``None``/``"auto"``): ``config.dtype``, else the checkpoint's dtype.
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
        CheckpointError: no safetensors weights; a truncated/corrupt file (named); tensors the
            model needs that the checkpoint lacks; tensors whose shape differs from the model's;
            an index that lists a tensor in two files, a tensor stored in two files, a file the
            index names that is missing, files of different saves (:func:`tpify.io.files.open_checkpoint`).
        PlanError, RecipeError, ValueError: as :func:`tpify.parallelize`.
        AgreementError: on the other ranks, when one rank raised one of these; when the ranks'
            checkpoints or arguments differ.
    Warns:
        UserWarning: checkpoint tensors the model does not use (like transformers' "unexpected").
    """
    from .api import agreement_scope, finish

    path = Path(path)
    group, share = agreement_scope(tp_group, dp_group)
    with agreement("tpify.from_pretrained", group=group, share=share) as checked:  # every local check first
        load = _prepare_load(path, model_class, torch_dtype, recipe, tp_size, tp_group,
                             (pad_vocab_multiple, sequence_parallel, dp_group), group)
        checked.fingerprint = load.fingerprint
    model = load.model
    try:  # the files stay open from the headers to the last slice: one save, never a mix
        finish(model, load.tp_size, load.layout, tp_group, dp_group, checked.shared)  # groups, surgery, hooks
        with agreement("reading the checkpoint in tpify.from_pretrained", group=tp_group) as read:
            materialize(model, load.snap, load.source, load.headers, load.dtype, copy=disable_mmap)
            init_missing(model, load.to_init, load.dtype)
            check_loaded(model)
            read.fingerprint = _replicated_fingerprint(model)
    finally:
        load.snap.close()
    return model


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


def _prepare_load(path: Path, model_class, torch_dtype, recipe, tp_size, tp_group, options, agree_group) -> _Load:
    """The local part of :func:`from_pretrained`: config, the checkpoint's files and headers, the
    meta model, its layout (``api.prepare``; ``options``: its pad_vocab_multiple,
    sequence_parallel and dp_group), the key map, and the fingerprint every rank must share (the
    checkpoint's and :func:`tpify.api.fingerprint`). No collective; the files are closed again
    on an error.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        CheckpointError, ValueError, PlanError, RecipeError: as :func:`from_pretrained`.
    """
    from transformers import AutoConfig

    from .api import fingerprint, prepare

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: from_pretrained needs a local Hugging Face model "
                                f"directory (config.json + model.safetensors); nothing is downloaded")
    config = AutoConfig.from_pretrained(str(path))
    cls = resolve_class(config, model_class)
    snap, weight_map, headers = open_checkpoint(path)  # every file opened once, for the whole load
    try:
        dtype = resolve_dtype(config, stored_float_dtype(headers, weight_map), torch_dtype)
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


def _checkpoint_digest(headers: dict[str, TensorHeader]) -> str:
    """A digest of the checkpoint's tensor names and shapes, for the agreement."""
    return digest(sorted((key, list(header.shape)) for key, header in headers.items()))


def _replicated_fingerprint(model: nn.Module) -> dict:
    """A sample of the values every rank read whole (replicated parameters and buffers), to
    compare across the TP group: a copy of the checkpoint that differs on one host (same names
    and shapes, other values) would otherwise make the replicas disagree silently."""
    from .api import weights_digest

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
    from .api import get_tp_info

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
        from .info import TPUsageError

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
    """Save a (parallelized) model as a standard Hugging Face directory, from global rank 0.

    Every tensor is gathered to its dense layout with :meth:`ShardSpec.gather` (vocab padding
    stripped, packed ``[Q|K|V]`` re-packed), so ``transformers.AutoModel*.from_pretrained(path)``
    loads it, and :func:`from_pretrained` loads it at any valid tp size. Tied copies
    (``lm_head.weight``) are not stored, as transformers 5 does. Tensors are grouped in files of
    at most ``max_shard_size`` (``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``; one ``model.safetensors`` when all fit); files are gathered
    and written one at a time, so the writing rank never holds the whole dense model.

    What it touches: rank 0 writes every file into a temporary directory ``.NAME.tmp-<id>``
    beside ``path`` (beside the directory a symlinked ``path`` points to), first removing such
    directories that no live save holds (left by a killed save). A new ``path`` is that
    directory renamed. An existing ``path`` goes from the checkpoint it holds to the new one by
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
    must call this function); per file, one all-reduce of one int over the world, so a failure
    on the writing rank raises on every rank instead of hanging them.

    Raises:
        ValueError: ``path`` is an existing file.
        AgreementError: on the other ranks, when ``path`` is a file on one rank; when the ranks
            hold different models (the first communication compares them, :func:`tpify.agree.agree`).
        RuntimeError: on ranks other than 0, when rank 0 failed (rank 0 raises its own error);
            ``path`` then holds one whole checkpoint (the old one unless the failure came after
            the switch), at worst with unused new shard files the next save removes.
    """
    path = Path(path)
    entries = saved_tensors(model)
    with agreement("tpify.save_pretrained") as checked:  # every local check first
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_pretrained: {path} exists and is not a directory; pass a directory path")
        from .api import param_specs  # under FSDP2 the parameters lost their specs: those recorded by name

        specs = param_specs(model)
        checked.fingerprint = {"saved tensors": digest([(k, list(t.shape), str(t.dtype)) for k, t in entries]),
                               "max_shard_size": str(max_shard_size)}
    info = getattr(model, "tp_info", None)
    group = info.tp_group if info is not None else None
    plan = plan_shards(entries, specs, max_shard_size)
    with staged(path, next((t.device for _, t in entries), torch.device("cpu"))) as stage:
        for name, file_entries in plan.files:  # one file's dense tensors at a time, on the writing rank
            stage.write(name, gather_dense(file_entries, specs, group, keep=stage.writing))
        stage.commit(model, plan.index(stage.save_id))

