"""Vocab-parallel losses and per-token statistics: from logits (or hidden states) split over the vocabulary.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, "output embedding"): the LM head's
logits stay split over the vocabulary, shape ``(B, T, V/p)`` per rank, and the softmax and what
is computed from it come from the shards with two all-reduces of ``B*T``-sized vectors instead of
gathering ``B*T*V`` logits on every rank. The hook that makes ``model(input_ids,
labels=labels).loss`` of a parallelized model use it is :mod:`tpify.hooks.lm_loss`.

Every function is built from the same named steps, each written once (:mod:`tpify.loss.steps`,
as Megatron's ``cross_entropy.py`` is cut into static steps shared by its fused and unfused paths).

| module             | what                                                                          |
| ------------------ | ----------------------------------------------------------------------------- |
| ``steps``          | the named steps, the argument checks, :func:`mean_or_nan`, ``_outside_graph`` |
| ``cross_entropy``  | :func:`vocab_parallel_cross_entropy` (from a logits shard)                    |
| ``statistics``     | :func:`vocab_parallel_log_probs`, :func:`vocab_parallel_entropy`,             |
|                    | :func:`vocab_parallel_kl`, :func:`vocab_parallel_is_top1`                     |
| ``chunked``        | :func:`vocab_parallel_linear_cross_entropy` (from the hidden states and the   |
|                    | head's weight shard, over token chunks), :func:`default_chunk_size`           |
"""

from .chunked import MIN_CHUNK, default_chunk_size, linear_cross_entropy_deferred, vocab_parallel_linear_cross_entropy
from .cross_entropy import cross_entropy_deferred, vocab_parallel_cross_entropy
from .statistics import vocab_parallel_entropy, vocab_parallel_is_top1, vocab_parallel_kl, vocab_parallel_log_probs
from .steps import LOGIT_OPS, _outside_graph, mean_or_nan

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_log_probs", "vocab_parallel_entropy", "vocab_parallel_kl",
           "vocab_parallel_is_top1", "vocab_parallel_linear_cross_entropy", "default_chunk_size", "mean_or_nan",
           "LOGIT_OPS", "MIN_CHUNK"]
