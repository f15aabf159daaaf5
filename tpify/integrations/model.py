"""Helpers the integrations share: the tpify model inside a wrapper, its dense save and load.

``tp_model_of`` finds the parallelized model inside a PEFT model, a DDP or a compiled module;
``save_dense`` / ``load_dense_`` write and read back what a tpify model is, densely: its Hugging
Face checkpoint, or, for a PEFT model on one, its dense adapter. (The methods tpify gives a
parallelized model and its guards are core: :mod:`tpify.hf_methods`, :mod:`tpify.hooks.guards`.)
"""

from __future__ import annotations

from torch import nn

from ..hf_modules import is_peft
from ..info import TPUsageError, find_tp_model

__all__ = ["TPUsageError", "is_peft", "tp_model_of", "save_dense", "load_dense_"]


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
        from ..api import save_pretrained

        save_pretrained(tp_model_of(model), directory, max_shard_size=max_shard_size)


def load_dense_(model: nn.Module, directory) -> None:
    """Read back, in place and slice by slice, what :func:`save_dense` wrote (no communication)."""
    if is_peft(model):
        from .peft import load_adapter_

        load_adapter_(model, directory, adapter_name=model.active_adapter)
    else:
        from ..api import load_weights_

        load_weights_(tp_model_of(model), directory)
