"""Hugging Face's own methods on a parallelized model: the versions a tensor-parallel model needs.

:func:`install` (called by :func:`tpify.parallelize`) gives the model instance its own
``save_pretrained`` (the dense checkpoint, a collective), ``resize_token_embeddings`` (raises:
the vocabulary is split) and ``gradient_checkpointing_enable`` (non-reentrant, restoring the
dropout streams and the call's state); class and ``forward`` untouched.
:func:`check_before_parallelize` refuses a model whose HF state tpify cannot take over. The
state dict's behaviour: :mod:`tpify.hooks.state_dict`; details: docs/parallelize.md,
"tpify/hf_methods.py".
"""

from __future__ import annotations

import functools
import types

from torch import nn

from .info import TPUsageError, get_tp_info

__all__ = ["install", "check_before_parallelize"]


# Options of PreTrainedModel.save_pretrained that are harmless at their default values.
_SAVE_DEFAULTS = {"variant": None, "token": None, "save_peft_format": True, "save_original_format": True,
                  "distributed_checkpoint": False}


def _save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                     max_shard_size="2GB", safe_serialization: bool = True, *, save, **kwargs):
    """Save the dense Hugging Face checkpoint of this tensor-parallel model (= tpify.save_pretrained).

    A collective: every rank of the world calls it; global rank 0 writes. ``is_main_process`` is
    accepted for compatibility and ignored (the writer is always global rank 0).

    Raises:
        TPUsageError: ``state_dict`` given (a state dict of local shards cannot be written as the
            dense checkpoint), ``push_to_hub``, ``safe_serialization=False`` or other options of
            ``PreTrainedModel.save_pretrained`` that tpify does not implement.
    """
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
    save(self, save_directory, max_shard_size=max_shard_size)


def _resize_token_embeddings(self, *args, **kwargs):
    raise TPUsageError(
        f"{type(self).__name__}.resize_token_embeddings cannot run after tpify.parallelize: the vocabulary is split "
        f"(and padded) over the TP group. Resize the dense model first, then parallelize: "
        f"model.resize_token_embeddings(n); tpify.parallelize(model). Nothing was changed.")


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
    """HF's activation checkpointing with tpify's per-call state restored in the recomputation.

    Same arguments as ``PreTrainedModel.gradient_checkpointing_enable``; checkpointing is
    non-reentrant with a ``context_fn`` (:meth:`tpify.random.RNGStreamTracker.checkpoint_context_fn`)
    that restores, for the recomputed forward, the dropout streams (Megatron restores its RNG
    tracker the same way) and the model's :class:`~tpify.context.CallState` (whether the tokens
    were split: sequence parallelism recomputes its stretch as it ran), so gradients are bitwise
    those of the run without checkpointing.

    Raises:
        TPUsageError: ``use_reentrant=True`` or a ``context_fn`` of the caller's (tpify needs its own).
    """
    from functools import partial

    from transformers import PreTrainedModel

    kw = dict(gradient_checkpointing_kwargs or {})
    if kw.get("use_reentrant", False) or "context_fn" in kw:
        raise TPUsageError("gradient checkpointing of a tensor-parallel model must be non-reentrant and use tpify's "
                           "context_fn (it restores the dropout streams and the sequence split in the recomputation); "
                           "drop use_reentrant=True and context_fn from gradient_checkpointing_kwargs")
    info = get_tp_info(self)
    kw.update(use_reentrant=False, context_fn=partial(info.rng.checkpoint_context_fn, info.state))
    enable = getattr(PreTrainedModel, "_activation_checkpointing_enable", None)
    if enable is not None:
        enable(self, kw, **kwargs)
    else:  # transformers without the v5.2x split: the public method is the implementation
        PreTrainedModel.gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=kw, **kwargs)


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


def install(model: nn.Module, save) -> None:
    """Give a freshly parallelized model its TP-aware HF methods (see the module docstring);
    ``save``: :func:`tpify.save_pretrained`, which its ``save_pretrained`` calls."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable = types.MethodType(_gradient_checkpointing_enable, model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(functools.partial(_save_pretrained, save=save), model)
    if hasattr(model, "resize_token_embeddings"):
        model.resize_token_embeddings = types.MethodType(_resize_token_embeddings, model)
