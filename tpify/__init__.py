"""tpify: Megatron-style tensor parallelism for Hugging Face models, by model surgery.

``tpify.parallelize(model)`` swaps the model's linear layers and embeddings for column-,
row- and vocab-parallel equivalents following a per-architecture recipe (``recipes/``), so a
pretrained model runs across ranks without rewriting it (Shoeybi et al., arXiv:1909.08053).
``tpify.from_pretrained(path)`` loads a local safetensors checkpoint with each rank reading only
its slices; ``tpify.save_pretrained(model, path)`` writes it back in the Hugging Face layout
(its files written by several ranks); ``tpify.dense_state_dict(model)`` gathers the dense tensors
and ``tpify.sharded_state_dict(model)`` describes the shards for torch.distributed.checkpoint
(training checkpoints that resume at any layout: :mod:`tpify.checkpoint`).

What a user calls is here: the verbs, the errors and the integrations' entry points
``TPTrainer``, ``TPAccelerator`` and ``get_peft_model``, each imported on first use (so that
``import tpify`` imports neither torch nor transformers, and the integrations bring in
transformers' Trainer, accelerate or peft only when asked for). The layers are
:mod:`tpify.layers`, the collectives and their counter :mod:`tpify.comm`, the training utilities
(global-norm clipping, replica checks) :mod:`tpify.training`; data parallelism on torch's engines
(:func:`init_mesh`, :func:`replicate_data_parallel` for DDP, :func:`shard_data_parallel` for
FSDP2/HSDP) :mod:`tpify.data_parallel`; pipeline stages on torch's schedules (``init_mesh(...,
pp_size=P)``) :mod:`tpify.pipeline`; the map of the package is docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "parallelize",
    "from_pretrained",
    "save_pretrained",
    "remove_hooks",
    "dense_state_dict",
    "sharded_state_dict",
    "init_mesh",
    "replicate_data_parallel",
    "shard_data_parallel",
    "get_tp_info",
    "TPInfo",
    "vocab_parallel_cross_entropy",
    "manual_seed",
    "load_recipe",
    "PlanError",
    "RecipeError",
    "CheckpointError",
    "AgreementError",
    "TPUsageError",
    "TPTrainer",
    "TPAccelerator",
    "get_peft_model",
]
__version__ = "0.1.0"

# Each public name -> the module that defines it, imported on first use (PEP 562): ``import tpify``
# itself imports neither torch nor transformers, so the ``tpify`` command parses its arguments (and
# prints ``--help``) before anything heavy is loaded. The integrations stay lazy as before.
_EXPORTS = {
    "parallelize": "api", "from_pretrained": "api", "save_pretrained": "api", "remove_hooks": "api",
    "dense_state_dict": "checkpoint", "sharded_state_dict": "checkpoint",
    "replicate_data_parallel": "data_parallel", "shard_data_parallel": "data_parallel",
    "TPInfo": "info", "TPUsageError": "info", "get_tp_info": "info",
    "CheckpointError": "io", "PlanError": "layout", "vocab_parallel_cross_entropy": "loss", "init_mesh": "mesh",
    "manual_seed": "random", "load_recipe": "recipe", "RecipeError": "recipe", "AgreementError": "agree",
    "TPTrainer": "integrations.trainer", "TPAccelerator": "integrations.accelerate",
    "get_peft_model": "integrations.peft",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from .agree import AgreementError
    from .api import from_pretrained, parallelize, remove_hooks, save_pretrained
    from .checkpoint import dense_state_dict, sharded_state_dict
    from .data_parallel import replicate_data_parallel, shard_data_parallel
    from .info import TPInfo, TPUsageError, get_tp_info
    from .io import CheckpointError
    from .layout import PlanError
    from .loss import vocab_parallel_cross_entropy
    from .mesh import init_mesh
    from .random import manual_seed
    from .recipe import RecipeError, load_recipe


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        if not module.startswith("integrations."):  # cached; the integrations are looked up each time, as before
            globals()[name] = value
        return value
    try:  # tpify.comm, tpify.layers, ...: a submodule, as an eager package would have had it imported
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'tpify' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
