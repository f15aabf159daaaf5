"""The embedding styles: ``embedding_rowwise`` (vocabulary rows) and ``embedding_colwise`` (columns).

Megatron-LM (arXiv:1909.08053, section 3): a vocabulary-parallel table holds the rows
``[s_r, e_r)``, masks the ids outside them and all-reduces the lookup (padded to a multiple of
``pad_vocab_multiple * tp_size`` rows, Megatron pads to 128); a table whose columns are heads
(T5's relative attention bias) is split by columns, no communication. docs/recipes.md.
"""

from __future__ import annotations

from ..layers import ColumnParallelEmbedding, VocabParallelEmbedding
from ..sharding import embedding_columns_spec, pad_vocab_size, vocab_rows_spec
from .base import Style

__all__ = ["EmbeddingRowwise", "EmbeddingColwise"]


class _Embedding(Style):
    """An ``nn.Embedding`` split; ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` (which need
    the whole table) are plan errors."""

    kind = "embedding"

    def _sizes(self, ctx, fqn, module, rule, entry):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            ctx.errors.append(f"{fqn}: {self.name} cannot shard an nn.Embedding with max_norm, scale_grad_by_freq or "
                              f"sparse (they need the whole table); use 'replicate'")
            return False
        return self._table_sizes(ctx, fqn, module, entry)

    def _table_sizes(self, ctx, fqn, module, entry) -> bool:
        return True


class EmbeddingRowwise(_Embedding):
    """``embedding_rowwise``: :class:`VocabParallelEmbedding`, the vocabulary rows split and padded
    to a multiple of ``pad_vocab_multiple * tp_size``; one all-reduce forward. A scaled subclass
    (``[subclasses]`` forward = 'scaled': Gemma's ``embed_scale``) hands its factor to the layer."""

    name = "embedding_rowwise"
    vocab_rows = True
    scales_output = True
    tied_head = "colwise_rep"  # the style of an LM head tied to it (the same rows split alike)
    hf_note = "HF {hf_style}: vocabulary rows split"

    def _table_sizes(self, ctx, fqn, module, entry):
        entry.padded_size = pad_vocab_size(module.num_embeddings, ctx.tp_size, ctx.pad_vocab_multiple)
        return True

    def param_specs(self, module, entry, tp_size):
        return {"weight": vocab_rows_spec(module.num_embeddings, tp_size, entry.padded_size)}

    def build(self, module, entry, ctx):
        scale = getattr(module, entry.scale_attr) if entry.scale_attr else None
        return VocabParallelEmbedding.from_dense(module, ctx.group, padded_num_embeddings=entry.padded_size,
                                                 output_scale=scale, context=ctx)

    def from_hf(self, imp, entry):
        if imp.kinds(entry) != {"embedding"}:
            raise imp.error(f"{entry.where}: {entry.hf_style} applies to an nn.Embedding")
        super().from_hf(imp, entry)


class EmbeddingColwise(_Embedding):
    """``embedding_colwise``: :class:`ColumnParallelEmbedding`, a table whose columns are heads
    (T5's relative attention bias) split by columns; no communication."""

    name = "embedding_colwise"
    region = "start"
    sequence_parallel = False
    sequence_parallel_refusal = "relative attention biases are built for all (T, T) positions"

    def _table_sizes(self, ctx, fqn, module, entry):
        ctx.need_divisible(f"{fqn}.embedding_dim ({type(module).__name__}, embedding_colwise)", module.embedding_dim)
        return True

    def param_specs(self, module, entry, tp_size):
        return {"weight": embedding_columns_spec(module.embedding_dim, tp_size)}

    def build(self, module, entry, ctx):
        return ColumnParallelEmbedding.from_dense(module, ctx.group, context=ctx)
