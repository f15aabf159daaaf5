"""The tensor-parallel embeddings: :class:`VocabParallelEmbedding` (rows of the vocabulary split,
one all-reduce forward; Megatron-LM, arXiv:1909.08053, section 3) and
:class:`ColumnParallelEmbedding` (the embedding dimension split, one all-gather forward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..context import TPContext
from ..sharding import KeepsShardSpecs, divide, embedding_columns_spec, vocab_rows_spec
from .common import _copy_shards, _new_param, _resolve_context


class VocabParallelEmbedding(KeepsShardSpecs, nn.Module):
    """Embedding table split by rows (vocabulary entries) over the TP group.

    Rank ``r`` holds the rows of ids ``[vocab_start_index, vocab_end_index)`` of the table padded
    to ``padded_num_embeddings`` rows (a multiple of ``tp_size``). Ids outside this rank's range
    are looked up as row 0 and their output zeroed; the partial outputs are then summed with
    ``reduce`` (Megatron-LM, arXiv:1909.08053, section 3, "input embedding"). Padded rows are
    zeros that no id reaches.

    ``output_scale`` multiplies the output by a constant, after the reduce, as the scaled
    embeddings of some families do (Gemma's ``GemmaTextScaledWordEmbedding``: the lookup times
    ``sqrt(hidden_size)``). A tensor (the dense module's own 0-dim buffer) is kept as a
    non-persistent buffer, so dtype conversions of the model treat it as they treat the dense
    module's; a float is taken as float32. Either is cast to the weight's dtype before the
    multiply, as there.

    Shapes:
        input: ``(B, T)`` integer ids in ``[0, num_embeddings)``.
        output: ``(B, T, embedding_dim)``, identical on every rank.
    Communication:
        forward: one all-reduce (sum) of the output. backward: none.
    Raises:
        IndexError: (forward) an id outside ``[0, num_embeddings)``, as ``nn.Embedding``, on every
            rank before the output's all-reduce; inside a parallelized model's call (ids its
            :class:`~tpify.hooks.guards.BatchCheck` compares) at the model's next call instead
            (read one call late, :class:`~tpify.comm.DeferredChecks`: no host sync; the ids
            outside every rank's rows embed as zeros meanwhile).
        ValueError: (forward) the ranks of the TP group were given different ids (or shapes):
            each would sum the embeddings of different tokens. Checked by one all-reduce of 5
            values (the bounds ride on it) before the output's (:func:`tpify.comm.check_same_inputs`),
            unless the model's own call checked these ids already (:class:`tpify.hooks.guards.BatchCheck`).
        NotImplementedError: the dense embedding uses ``max_norm``, ``scale_grad_by_freq`` or
            ``sparse``, which cannot be computed from one shard of the table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        padded_num_embeddings: int | None = None,
        output_scale: float | torch.Tensor | None = None,
        context: TPContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        if isinstance(output_scale, torch.Tensor):  # a buffer, as the dense module's: .to()/.double() convert it alike
            self.register_buffer("output_scale", output_scale.detach().clone(), persistent=False)
        else:
            self.output_scale = output_scale
        _resolve_context(self, tp_group, context)
        self.padded_num_embeddings = padded_num_embeddings or num_embeddings
        spec = vocab_rows_spec(num_embeddings, self.tp_size, self.padded_num_embeddings)
        self.num_embeddings_per_partition = spec.local_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = _new_param((self.num_embeddings_per_partition, embedding_dim), spec, device, dtype)

    @property
    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is not None and self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return self.padding_idx - self.vocab_start_index
        return None

    @classmethod
    def from_dense(cls, module: nn.Embedding, tp_group: dist.ProcessGroup | None, **kwargs) -> "VocabParallelEmbedding":
        """Build this rank's shard from a dense ``nn.Embedding`` (rows copied exactly)."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"expected nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse")
        layer = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, tp_group=tp_group,
                    device="meta", dtype=module.weight.dtype, **kwargs)
        return _copy_shards(layer, module, layer.tp_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, embedding_dim)`` embeddings, replicated.

        Raises:
            IndexError: an id outside ``[0, num_embeddings)``, as ``nn.Embedding`` raises (every
                rank holds the same ids, so every rank raises, before the all-reduce; within a
                parallelized model's call, at its next call: see the class).
        """
        if self.tp_size == 1:
            return self._scaled(F.embedding(input_ids, self.weight, self.padding_idx))
        if input_ids.numel():
            low, high = torch.aminmax(input_ids)
            bad = (low < 0) | (high >= self.num_embeddings)
            message = f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings}) (index out of range in self)"
            if self.ctx.state.checked.holds(input_ids):
                # the model's call compares these ids across the TP group (tpify.hooks.guards.BatchCheck): the
                # bounds are read at its next call, no host sync (ids outside every rank's rows embed as zeros)
                comm.raise_unless(~bad, IndexError, message, defer=self.ctx.state.checks,
                                  detail=((low, high), lambda lo, hi: f"this rank: min {lo}, max {hi}"))
            else:
                # called alone: check that every rank holds these ids, with the bounds riding on the check, so
                # that every rank raises alike (a host sync, as the dense lookup's bounds check)
                bad = comm.check_same_inputs([("input_ids", input_ids)], self.tp_group, "VocabParallelEmbedding",
                                             flag=bad)
                comm.raise_unless(~bad, IndexError, message,
                                  detail=lambda: f"this rank: min {int(low)}, max {int(high)}")
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._scaled(comm.reduce_from_tp_region(out, self.tp_group))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """``out * output_scale`` in the weight's dtype (a float scale rounded to float32 first, as
        HF's ``torch.tensor(scale)``); a float scale's tensor is made once per device and dtype, so a
        step copies nothing from the host."""
        scale = self.output_scale
        if scale is None:
            return out
        if isinstance(scale, torch.Tensor):
            return out * scale.to(device=out.device, dtype=self.weight.dtype)
        key = (out.device, self.weight.dtype, scale)
        cache = self.__dict__.setdefault("_scale_tensors", {})
        if key not in cache:
            cache[key] = torch.tensor(scale, dtype=torch.float32).to(device=out.device, dtype=self.weight.dtype)
        return out * cache[key]

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, padded={self.padded_num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, vocab_range=[{self.vocab_start_index}, "
                f"{self.vocab_end_index}), tp_size={self.tp_size}"
                + (f", output_scale={float(self.output_scale)}" if self.output_scale is not None else ""))


class ColumnParallelEmbedding(KeepsShardSpecs, nn.Module):
    """Embedding table split by columns (``embedding_dim``) over the TP group; output left sharded.

    For tables whose columns are attention heads: T5's ``relative_attention_bias``
    (``nn.Embedding(num_buckets, n_heads)``) gives, per relative-position bucket, one bias per
    head. Rank ``r`` holds columns ``[r*D/p, (r+1)*D/p)`` (its heads, as the column-parallel
    q/k/v projections give it heads ``r*n/p ..``), so the lookup yields exactly the biases of the
    local heads. Only those heads read them, so each rank's weight gradient is complete: no
    communication at all (the extension of Megatron's column split, arXiv:1909.08053 section 3,
    to a lookup table).

    Shapes:
        input: ``(...)`` integer ids in ``[0, num_embeddings)``, replicated.
        output: ``(..., embedding_dim // tp_size)``, this rank's columns.
    Communication: none, forward or backward (the input is integer: it has no gradient).
    Raises:
        ValueError: ``embedding_dim`` is not divisible by ``tp_size``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None = None,
                 tp_group: dist.ProcessGroup | None = None, context: TPContext | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        _resolve_context(self, tp_group, context)
        self.embedding_dim_per_partition = divide(embedding_dim, self.tp_size, "embedding_dim")
        spec = embedding_columns_spec(embedding_dim, self.tp_size)
        self.weight = _new_param((num_embeddings, self.embedding_dim_per_partition), spec, device, dtype)

    @classmethod
    def from_dense(cls, module: nn.Embedding, tp_group: dist.ProcessGroup | None, **kwargs) -> "ColumnParallelEmbedding":
        """Build this rank's columns from a dense ``nn.Embedding`` (copied exactly).

        Raises:
            NotImplementedError: ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` (they need whole rows).
        """
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("ColumnParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse")
        layer = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, tp_group=tp_group,
                    device="meta", dtype=module.weight.dtype, **kwargs)
        return _copy_shards(layer, module, layer.tp_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(...)`` ids -> ``(..., embedding_dim // tp_size)``, this rank's columns."""
        return F.embedding(input_ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"embedding_dim_per_partition={self.embedding_dim_per_partition}, tp_size={self.tp_size}")
