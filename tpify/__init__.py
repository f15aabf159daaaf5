"""tpify: Megatron-style tensor parallelism for Hugging Face models, by model surgery.

``tpify.parallelize(model)`` swaps the model's linear layers and embeddings for column-,
row- and vocab-parallel equivalents following a per-architecture recipe (``recipes/``), so a
pretrained model runs across ranks without rewriting it (Shoeybi et al., arXiv:1909.08053).
``tpify.from_pretrained(path)`` loads a local safetensors checkpoint with each rank reading only
its slices; ``tpify.save_pretrained(model, path)`` writes it back in the Hugging Face layout.
"""

from .api import TPInfo, get_tp_info, parallelize, remove_hooks
from .agree import AgreementError
from .comm import count_collectives
from .engine import PlanError
from .layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .io import CheckpointError
from .loading import from_pretrained, save_pretrained
from .loss import vocab_parallel_cross_entropy
from .random import manual_seed
from .recipe import RecipeError, load_recipe

__all__ = [
    "parallelize",
    "remove_hooks",
    "from_pretrained",
    "save_pretrained",
    "CheckpointError",
    "get_tp_info",
    "TPInfo",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ColumnParallelEmbedding",
    "count_collectives",
    "vocab_parallel_cross_entropy",
    "load_recipe",
    "PlanError",
    "RecipeError",
    "AgreementError",
    "manual_seed",
]
__version__ = "0.1.0"
