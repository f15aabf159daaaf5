"""Tensor-parallel layers: column- and row-parallel linear layers, vocab-parallel embedding.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3). The layers hold only this rank's
shard of each weight and talk to other ranks only through :mod:`tpify.comm`'s region
operators. Every sharded parameter carries its :class:`~tpify.sharding.ShardSpec` as the attribute
``tp_shard_spec`` (read it with :func:`~tpify.sharding.shard_spec_of`), so the spec follows
the parameter wherever it is tied; parameters without one are replicated.

The layers accept the two weight layouts found in Hugging Face models and keep the one they
were built from, so parameter names and layouts stay those of the checkpoint:

* ``weight_layout="linear"``: ``nn.Linear``, weight ``[out, in]``;
* ``weight_layout="conv1d"``: ``transformers.pytorch_utils.Conv1D`` (GPT-2), weight ``[in, out]``.

| module          | what                                                                                 |
| --------------- | ------------------------------------------------------------------------------------ |
| ``common``      | the weight layouts and their matmul, autocast's dtype, shard parameters              |
| ``region``      | :class:`ColumnParallelInput` (the shared region entry), the overlapped backward      |
| ``linear``      | :class:`ColumnParallelLinear`, :class:`RowParallelLinear`                            |
| ``embedding``   | :class:`VocabParallelEmbedding`, :class:`ColumnParallelEmbedding`                    |
"""

from .common import _autocast_inputs, _matmul, matmul_dtype
from .embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .region import MAX_CONNECTIONS_ENV, ColumnParallelInput, check_overlap_environment, overlap_environment

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ColumnParallelEmbedding",
           "ColumnParallelInput", "MAX_CONNECTIONS_ENV", "overlap_environment", "check_overlap_environment"]
