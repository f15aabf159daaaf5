"""Hugging Face's own methods on a parallelized model, and the guard against a DDP over the world.

A parallelized model is still the user's ``PreTrainedModel``; a few of its inherited methods
would silently do the wrong thing on shards, so :func:`install` (called by
:func:`tpify.parallelize`) gives the model instance its own versions (the class and every HF
``forward`` are untouched):

* ``model.save_pretrained(dir)`` writes the full dense checkpoint, exactly what
  :func:`tpify.save_pretrained` writes (a collective: every rank calls it, global rank 0 writes).
* ``model.resize_token_embeddings(...)`` raises before anything changes: the vocabulary is sharded
  (and padded) over the TP group; resize the dense model before :func:`tpify.parallelize`.
* ``model.gradient_checkpointing_enable(...)`` (also reached through
  ``activation_checkpointing_enable`` and Trainer's ``gradient_checkpointing=True``) checkpoints
  non-reentrantly with the model's ``tp_info.rng.checkpoint_context_fn``, which restores tpify's
  dropout streams in the recomputed forward.
* TRL's fused LM head (``model(..., fused_lm_head=True)``, installed by ``trl``'s
  ``add_fused_lm_head``) multiplies by ``lm_head.weight``, a vocabulary shard here: the call
  raises :class:`TPUsageError` naming TRL, on every rank, before any collective.
* A ``DistributedDataParallel`` wrapper whose process group is not the model's DP group (what
  ``transformers.Trainer`` and ``accelerate.Accelerator.prepare`` build over the whole world)
  would have broadcast rank 0's shards to every rank at construction and would average gradients
  of different shards; the model's first forward under such a wrapper raises, on every rank,
  before any tensor-parallel collective. DDP over ``model.tp_info.dp_group`` (any group that holds
  no other rank of this model's TP group) is allowed.

``model.state_dict()`` is not changed: it returns this rank's shards (sharded parameters carry
their :class:`~tpify.sharding.ShardSpec` as ``tp_shard_spec``), so loading it into the dense
model fails on the shapes instead of loading wrong values.
"""

from __future__ import annotations

import types

import torch.distributed as dist
from torch import nn

from ..hf_modules import is_peft
from ..info import TPUsageError, find_tp_model

__all__ = ["install", "check_before_parallelize", "TPUsageError", "is_peft", "tp_model_of", "save_dense",
           "load_dense_"]


def tp_model_of(model):
    """The tpify-parallelized model inside ``model`` (itself, a PEFT model's base, a DDP's or a
    compiled module's module), or None (:func:`tpify.info.find_tp_model`)."""
    return find_tp_model(model)


def save_dense(model: nn.Module, directory, max_shard_size="2GB") -> None:
    """Write what a tpify model is, densely: its Hugging Face checkpoint, or, for a PEFT model on
    one, its dense adapter (:func:`tpify.integrations.peft.save_adapter`). A collective."""
    if is_peft(model):
        from .peft import save_adapter

        save_adapter(model, directory)
    else:
        from ..loading import save_pretrained

        save_pretrained(tp_model_of(model), directory, max_shard_size=max_shard_size)


def load_dense_(model: nn.Module, directory) -> None:
    """Read back, in place and slice by slice, what :func:`save_dense` wrote (no communication)."""
    if is_peft(model):
        from .peft import load_adapter_

        load_adapter_(model, directory, adapter_name=model.active_adapter)
    else:
        from ..loading import load_weights_

        load_weights_(tp_model_of(model), directory)


# Options of PreTrainedModel.save_pretrained that are harmless at their default values.
_SAVE_DEFAULTS = {"variant": None, "token": None, "save_peft_format": True, "save_original_format": True,
                  "distributed_checkpoint": False}


def _save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                     max_shard_size="2GB", safe_serialization: bool = True, **kwargs):
    """Save the dense Hugging Face checkpoint of this tensor-parallel model (= tpify.save_pretrained).

    A collective: every rank of the world calls it; global rank 0 writes. ``is_main_process`` is
    accepted for compatibility and ignored (the writer is always global rank 0).

    Raises:
        TPUsageError: ``state_dict`` given (a state dict of local shards cannot be written as the
            dense checkpoint), ``push_to_hub``, ``safe_serialization=False`` or other options of
            ``PreTrainedModel.save_pretrained`` that tpify does not implement.
    """
    from ..loading import save_pretrained

    unsupported = [k for k, v in kwargs.items() if k not in _SAVE_DEFAULTS or v != _SAVE_DEFAULTS[k]]
    problems = []
    if state_dict is not None:
        problems.append("state_dict= (a state dict of this rank's shards cannot be written as the dense "
                        "checkpoint; call model.save_pretrained(dir) without it on every rank)")
    if push_to_hub:
        problems.append("push_to_hub=True (save locally, then upload the directory)")
    if not safe_serialization:
        problems.append("safe_serialization=False (tpify writes safetensors only)")
    if unsupported:
        problems.append(f"options {sorted(unsupported)}")
    if problems:
        raise TPUsageError(f"{type(self).__name__}.save_pretrained on a tensor-parallel model does not support "
                           + "; ".join(problems))
    save_pretrained(self, save_directory, max_shard_size=max_shard_size)


def _resize_token_embeddings(self, *args, **kwargs):
    raise TPUsageError(
        f"{type(self).__name__}.resize_token_embeddings cannot run after tpify.parallelize: the vocabulary is split "
        f"(and padded) over the TP group. Resize the dense model first, then parallelize: "
        f"model.resize_token_embeddings(n); tpify.parallelize(model). Nothing was changed.")


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
    """HF's activation checkpointing with tpify's dropout streams restored in the recomputation.

    Same arguments as ``PreTrainedModel.gradient_checkpointing_enable``; checkpointing is
    non-reentrant with the model's ``tp_info.rng.checkpoint_context_fn`` as ``context_fn`` (Megatron restores its
    RNG tracker the same way), so gradients are bitwise those of the run without checkpointing.

    Raises:
        TPUsageError: ``use_reentrant=True`` or a ``context_fn`` of the caller's (tpify needs its own);
            a model parallelized with ``sequence_parallel=True``.
    """
    from transformers import PreTrainedModel

    kw = dict(gradient_checkpointing_kwargs or {})
    if self.tp_info.layout.sequence_parallel is not None:
        raise TPUsageError("gradient checkpointing with sequence parallelism is not supported yet (the recomputation "
                           "would run without the sequence split); parallelize without sequence_parallel=True to "
                           "use gradient checkpointing")
    if kw.get("use_reentrant", False) or "context_fn" in kw:
        raise TPUsageError("gradient checkpointing of a tensor-parallel model must be non-reentrant and use tpify's "
                           "context_fn (it restores the dropout streams in the recomputation); drop use_reentrant=True "
                           "and context_fn from gradient_checkpointing_kwargs")
    kw.update(use_reentrant=False, context_fn=self.tp_info.rng.checkpoint_context_fn)
    enable = getattr(PreTrainedModel, "_activation_checkpointing_enable", None)
    if enable is not None:
        enable(self, kw, **kwargs)
    else:  # transformers without the v5.2x split: the public method is the implementation
        PreTrainedModel.gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=kw, **kwargs)


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _refuse_foreign_ddp(model: nn.Module, args, kwargs):
    """Forward pre-hook: raise when run inside a DDP whose group is not the model's DP group."""
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = getter() if getter is not None else None
    if ddp is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not any(m is model for m in ddp.module.modules()):
        return None
    info = model.tp_info
    ddp_ranks = _ranks(ddp.process_group)
    tp_ranks = _ranks(info.tp_group) if info.tp_group is not None else [dist.get_rank()]
    if set(ddp_ranks) & set(tp_ranks) != {dist.get_rank()}:  # a DDP peer holds another shard of this replica
        dp_ranks = _ranks(info.dp_group) if info.dp_group is not None else "(none)"
        raise TPUsageError(
            f"{type(model).__name__} is tensor-parallel (tp_size = {info.tp_size}) but runs inside a "
            f"DistributedDataParallel over ranks {ddp_ranks}, not over its DP group {dp_ranks}: DDP broadcast rank 0's "
            f"shards to the other TP ranks and would average gradients of different shards. Use "
            f"tpify.integrations.TPTrainer instead of transformers.Trainer, tpify.integrations.TPAccelerator instead of "
            f"accelerate.Accelerator, or DistributedDataParallel(model, process_group=model.tp_info.dp_group). "
            f"Reload the model: its shards were overwritten.")
    return None


def _refuse_fused_lm_head(model: nn.Module, args, kwargs):
    """Forward pre-hook: raise on TRL's fused LM head call (``fused_lm_head=True``) when the LM
    head is split over the vocabulary."""
    if not kwargs.get("fused_lm_head"):
        return None
    info = model.tp_info
    head = info.layout.lm_head
    raise TPUsageError(
        f"{type(model).__name__} was called with fused_lm_head=True: TRL's fused LM head (trl's add_fused_lm_head, "
        f"used by SFTTrainer, DPOTrainer, GRPOTrainer and others) multiplies the hidden states by "
        f"{head or 'the LM head'}.weight directly, which on this tensor-parallel model (tp_size = {info.tp_size}) is "
        f"this rank's shard of the vocabulary: its log-probs and loss would be silently wrong. TRL trainers on tpify "
        f"models are not supported yet; train with tpify.integrations.TPTrainer")


def check_before_parallelize(model: nn.Module) -> None:
    """Refuse, before anything changes, a model whose HF state tpify cannot take over.

    Raises:
        TPUsageError: gradient checkpointing was enabled before parallelizing (its recomputation
            would not restore tpify's dropout streams); DTensor parameters (FSDP2 or a DTensor
            TP plan applied first).
    """
    from torch.distributed.tensor import DTensor

    dtensors = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise TPUsageError(f"{type(model).__name__} holds DTensor parameters ({dtensors[:3]}"
                           f"{' ...' if len(dtensors) > 3 else ''}): it was sharded by FSDP2 (fully_shard) or a DTensor "
                           f"TP plan before tpify.parallelize. Parallelize the plain model first, then shard it with "
                           f"fully_shard over the DP dimension")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise TPUsageError(f"{type(model).__name__} has gradient checkpointing enabled: enable it after "
                           f"tpify.parallelize (model.gradient_checkpointing_enable()), so that the recomputed "
                           f"forward restores tpify's dropout streams")


def install(model: nn.Module) -> list:
    """Give a freshly parallelized model its TP-aware HF methods and the guards (see module doc):
    the DDP guard, and, when the LM head is split over the vocabulary, the refusal of TRL's
    fused LM head. Returns the guards' hook handles (registered first, ``prepend=True``, so they
    run before any hook that communicates)."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable = types.MethodType(_gradient_checkpointing_enable, model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_save_pretrained, model)
    if hasattr(model, "resize_token_embeddings"):
        model.resize_token_embeddings = types.MethodType(_resize_token_embeddings, model)
    guards = []
    info = model.tp_info
    if info.tp_size > 1 and info.layout.lm_head is not None:
        guards.append(model.register_forward_pre_hook(_refuse_fused_lm_head, with_kwargs=True, prepend=True))
    guards.append(model.register_forward_pre_hook(_refuse_foreign_ddp, with_kwargs=True, prepend=True))
    return guards
