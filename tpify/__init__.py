"""tpify: Megatron-style tensor parallelism for Hugging Face models, by model surgery.

``tpify.parallelize(model)`` swaps the model's linear layers and embeddings for column-,
row- and vocab-parallel equivalents following a per-architecture recipe (``recipes/``), so a
pretrained model runs across ranks without rewriting it (Shoeybi et al., arXiv:1909.08053).
``tpify.from_pretrained(path)`` loads a local safetensors checkpoint with each rank reading only
its slices; ``tpify.save_pretrained(model, path)`` writes it back in the Hugging Face layout
(its files written by several ranks); ``tpify.dense_state_dict(model)`` gathers the dense tensors
and ``tpify.sharded_state_dict(model)`` describes the shards for torch.distributed.checkpoint
(training checkpoints that resume at any layout: :mod:`tpify.checkpoint`).

What a user calls is here: the verbs, the errors, and (imported on first use, so that
``import tpify`` imports neither transformers' Trainer nor accelerate nor peft) the
integrations' entry points ``TPTrainer``, ``TPAccelerator`` and ``get_peft_model``. The layers are
:mod:`tpify.layers`, the collectives and their counter :mod:`tpify.comm`, the training utilities
(global-norm clipping, replica checks) :mod:`tpify.training`; data parallelism on torch's engines
(:func:`init_mesh`, :func:`replicate_data_parallel` for DDP, :func:`shard_data_parallel` for
FSDP2/HSDP) :mod:`tpify.data_parallel`; the map of the package is docs/architecture.md.
"""

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

_INTEGRATIONS = {"TPTrainer": "trainer", "TPAccelerator": "accelerate", "get_peft_model": "peft"}


def __getattr__(name: str):
    if name in _INTEGRATIONS:
        import importlib

        return getattr(importlib.import_module(f".integrations.{_INTEGRATIONS[name]}", __name__), name)
    raise AttributeError(f"module 'tpify' has no attribute {name!r}")
