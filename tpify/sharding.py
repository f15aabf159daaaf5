"""How one tensor is split over a tensor-parallel group.

A :class:`ShardSpec` is the single description of a sharded parameter that the parallel layers
(slicing), the loader (this rank's bytes of a safetensors file) and the saver (gathering back
to the dense Hugging Face layout) all use (Megatron-LM, arXiv:1909.08053, section 3). It covers
packed parts (``[Q_r | K_r | V_r]``), replicated parts (KV heads held by groups of ranks),
padded vocabularies and uneven splits (``torch.chunk``'s rule); each case: docs/mechanics.md,
"Linear layers", "Uneven splits", "Embeddings and the LM head".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm

__all__ = ["ShardSpec", "shard_spec_of", "is_dtensor", "copy_local_", "KeepsShardSpecs", "divide", "pad_vocab_size",
           "valid_tp_sizes", "chunk_range", "column_specs", "row_spec", "vocab_rows_spec", "embedding_columns_spec",
           "lora_factor_spec"]


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator // denominator``, raising when the division is not exact.

    Raises:
        ValueError: ``numerator % denominator != 0``; the message names ``what``.
    """
    if numerator % denominator:
        raise ValueError(f"{what} = {numerator} is not divisible by tp_size = {denominator}")
    return numerator // denominator


def chunk_range(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(start, stop)``: the indices of a dimension of ``size`` that ``torch.chunk`` (and DTensor's
    ``Shard``) gives rank ``tp_rank`` of ``tp_size``: chunks of ``ceil(size / tp_size)``, the last
    ones shorter or empty (``chunk_range(37, 2, 1) == (19, 37)``, ``chunk_range(5, 4, 3) == (5, 5)``)."""
    chunk = -(-size // tp_size)
    start = min(size, chunk * tp_rank)
    return start, min(size, start + chunk)


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Smallest multiple of ``multiple * tp_size`` that is ``>= vocab_size``.

    Megatron-LM pads to a multiple of ``128 * tp_size`` for fast GEMMs; tpify pads by default to
    a multiple of ``tp_size`` only, the least padding that makes the rows divisible.
    """
    step = multiple * tp_size
    return int(math.ceil(vocab_size / step) * step)


def valid_tp_sizes(*values: int, kv_heads=(), limit: int = 64) -> list[int]:
    """The tp sizes up to ``limit`` that divide every one of ``values`` and, for each of
    ``kv_heads``, divide it or are a multiple of it (KV heads held by groups of ranks); for error
    messages."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if not g and not kv_heads:
        return [1]
    sizes = [d for d in range(1, (min(g, limit) if g else limit) + 1) if not g or g % d == 0]
    return [d for d in sizes if all(kv % d == 0 or d % kv == 0 for kv in kv_heads)] or [1]


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter's tensor dimension ``dim`` is split over ``tp_size`` ranks.

    Attributes:
        dim: the tensor dimension that is split (0 for ``nn.Linear`` column-parallel weights,
            1 for row-parallel ``nn.Linear`` and column-parallel ``Conv1D`` weights).
        parts: global sizes, along ``dim``, of the packed parts (one part when not packed). Each
            part is split in ``tp_size`` equal chunks (``uneven``: by :func:`chunk_range`).
        padded_size: global size after vocab padding, or ``None``. Only for one part.
        tp_size: number of ranks the tensor is split over.
        replicated: indices of the parts replicated over groups of ranks (grouped-query K/V at
            ``tp_size`` above the KV heads; multi-query K/V whole on every rank).
        replica_shards: the slices (KV heads) each replicated part is cut into; each slice is held
            by :attr:`replica_group_size` consecutive ranks, rank ``r`` holding slice
            ``r // replica_group_size``. 1: the replicated parts whole on every rank. Must divide
            ``tp_size`` and every replicated part.
        uneven: the parts need not be divisible by ``tp_size``: each is split by torch.chunk's rule
            (:func:`chunk_range`), so the local size depends on the rank (:meth:`local_size_of`;
            :attr:`local_size` raises where it differs). Not with padding nor replicated parts.
            A part ``tp_size`` divides is split as without it.

    Raises:
        ValueError: (construction) a part ``tp_size`` (or ``replica_shards``) does not divide,
            without ``uneven``; padding with packed or replicated parts, or with ``uneven``;
            replicated parts with ``uneven``; ``replica_shards`` not dividing ``tp_size``.
    """

    dim: int
    parts: tuple[int, ...]
    tp_size: int
    padded_size: int | None = None
    replicated: tuple[int, ...] = ()
    replica_shards: int = 1
    uneven: bool = False

    def __post_init__(self):
        if self.uneven and (self.padded_size is not None or self.replicated):
            raise ValueError("an uneven split cannot also be padded or hold replicated parts (it splits no heads)")
        if self.padded_size is not None and len(self.parts) != 1:
            raise ValueError("a padded dimension cannot also be packed")
        if self.replicated and (len(set(self.replicated)) != len(self.replicated)
                                or not all(0 <= i < len(self.parts) for i in self.replicated)):
            raise ValueError(f"replicated parts {list(self.replicated)} must be distinct indices of the "
                             f"{len(self.parts)} parts")
        if self.replicated and self.padded_size is not None:
            raise ValueError("a padded dimension cannot also be replicated")
        if self.replica_shards < 1 or self.tp_size % self.replica_shards:
            raise ValueError(f"replica_shards = {self.replica_shards} must divide tp_size = {self.tp_size} (each "
                             f"replicated slice held by tp_size / replica_shards ranks)")
        if self.padded_size is None:
            for i, size in enumerate(self.parts if not self.uneven else ()):
                divide(size, self.replica_shards if i in self.replicated else self.tp_size,
                       "a part of the sharded dimension")
        elif self.padded_size % self.tp_size or self.padded_size < self.parts[0]:
            raise ValueError(f"padded size {self.padded_size} must be a multiple of {self.tp_size} >= {self.parts[0]}")

    @property
    def global_size(self) -> int:
        """Unpadded size of the dimension in the dense tensor."""
        return sum(self.parts)

    @property
    def local_size(self) -> int:
        """Size of the dimension on each rank (padding included).

        Raises:
            ValueError: an uneven split whose ranks hold different sizes: use :meth:`local_size_of`.
        """
        if self.padded_size is not None:
            return self.padded_size // self.tp_size
        sizes = self.local_sizes()
        if len(set(sizes)) > 1:
            raise ValueError(f"the split of {list(self.parts)} over tp_size = {self.tp_size} is uneven: the ranks hold "
                             f"{sizes}; ask for one rank's size with local_size_of(tp_rank)")
        return sizes[0]

    def local_size_of(self, tp_rank: int) -> int:
        """Size of the dimension on rank ``tp_rank`` (padding included): :attr:`local_size`, or for
        an uneven split the sum of this rank's chunks (torch.chunk's rule)."""
        if self.padded_size is not None:
            return self.padded_size // self.tp_size
        return sum(b - a for a, b in (self._part_range(i, tp_rank) for i in range(len(self.parts))))

    def local_sizes(self) -> list[int]:
        """:meth:`local_size_of` of every rank, in rank order (non-increasing for an uneven split)."""
        return [self.local_size_of(r) for r in range(self.tp_size)]

    @property
    def is_uniform(self) -> bool:
        """Whether every rank holds the same size (always, unless ``uneven`` and a part ``tp_size``
        does not divide)."""
        return self.padded_size is not None or len(set(self.local_sizes())) == 1

    @property
    def replica_group_size(self) -> int:
        """Ranks holding each slice of a replicated part (``tp_size // replica_shards``; the
        whole group for multi-query K/V); 1 when nothing is replicated."""
        return self.tp_size // self.replica_shards if self.replicated else 1

    def _local_part(self, i: int) -> int:
        """The local size of part ``i`` on every rank (not for an uneven split: :meth:`_part_range`)."""
        return self.parts[i] // (self.replica_shards if i in self.replicated else self.tp_size)

    def _part_range(self, i: int, tp_rank: int) -> tuple[int, int]:
        """``[start, stop)`` of part ``i`` (relative to the part) that rank ``tp_rank`` holds."""
        if self.uneven:
            return chunk_range(self.parts[i], self.tp_size, tp_rank)
        chunk, k = self._local_part(i), self._slice_of(i, tp_rank)
        return k * chunk, (k + 1) * chunk

    def _slice_of(self, i: int, tp_rank: int) -> int:
        """Which of part ``i``'s slices rank ``tp_rank`` holds."""
        return tp_rank // self.replica_group_size if i in self.replicated else tp_rank

    def replicated_local_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges, along :attr:`dim` of a rank's shard, of the replicated parts
        (the same values on every rank of a replica group); empty when nothing is replicated."""
        out, offset = [], 0
        for i in range(len(self.parts)):
            if i in self.replicated:
                out.append((offset, offset + self._local_part(i)))
            offset += self._local_part(i)
        return out

    def ranges(self, tp_rank: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of the dense dimension that rank ``tp_rank`` holds, in order,
        one per part (an uneven split's empty chunk as an empty range ``(n, n)``).

        Their lengths add up to :meth:`local_size_of` minus the padding rows of this rank.
        """
        if self.padded_size is not None:
            chunk = self.padded_size // self.tp_size
            start = tp_rank * chunk
            stop = min(start + chunk, self.parts[0])
            return [(start, stop)] if stop > start else []
        out, offset = [], 0
        for i, size in enumerate(self.parts):
            a, b = self._part_range(i, tp_rank)
            out.append((offset + a, offset + b))
            offset += size
        return out

    def local_shape(self, global_shape: tuple[int, ...] | torch.Size, tp_rank: int | None = None) -> tuple[int, ...]:
        """Shape of rank ``tp_rank``'s shard given the dense tensor's shape (``tp_rank`` may be left
        out where every rank holds the same size).

        Raises:
            ValueError: the dense dimension has another size; an uneven split without ``tp_rank``.
        """
        shape = list(global_shape)
        if shape[self.dim] != self.global_size:
            raise ValueError(f"dimension {self.dim} has size {shape[self.dim]}, expected {self.global_size}")
        shape[self.dim] = self.local_size if tp_rank is None else self.local_size_of(tp_rank)
        return tuple(shape)

    def _assemble(self, pieces: list[torch.Tensor], template: torch.Tensor, tp_rank: int) -> torch.Tensor:
        shape = list(template.shape)
        have = sum(p.shape[self.dim] for p in pieces)
        size = self.local_size_of(tp_rank)
        if have < size:  # padding rows of the vocabulary
            shape[self.dim] = size - have
            pieces = pieces + [torch.zeros(shape, dtype=template.dtype, device=template.device)]
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0].clone()

    def slice_dense(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """This rank's shard of the dense tensor ``full`` (a new tensor, not a view)."""
        self.local_shape(full.shape, tp_rank)
        pieces = [full.narrow(self.dim, a, b - a) for a, b in self.ranges(tp_rank)]
        if not pieces:
            pieces = [full.narrow(self.dim, 0, 0)]
        return self._assemble(pieces, full, tp_rank).contiguous()

    def read(self, file_slice, tp_rank: int, dtype: torch.dtype | None = None,
             block_bytes: int = 1 << 24, itemsize: int = 4) -> torch.Tensor:
        """Read this rank's shard from a safetensors ``safe_open(...).get_slice(name)``.

        Only the bytes of this rank's ranges are read, in blocks of about ``block_bytes`` along
        :attr:`dim`, each converted to ``dtype`` and copied straight into the preallocated shard
        (padding rows zero), so the memory in flight is one block, not a second copy of the shard.
        ``itemsize``: bytes per element as stored in the file, which sizes the blocks
        (:mod:`tpify.io.reader` passes the stored dtype's; 4, float32's, when not given).
        """
        shape = list(file_slice.get_shape())
        size = self.local_shape(shape, tp_rank)[self.dim]
        ndim = len(shape)
        per_index = max(1, math.prod(shape) // max(1, shape[self.dim])) * itemsize
        step = max(1, block_bytes // per_index)
        out, offset = None, 0
        for a, b in self.ranges(tp_rank) or [(0, 0)]:
            for start in range(a, max(b, a + 1), step):
                stop = min(start + step, b)
                index = [slice(None)] * ndim
                index[self.dim] = slice(start, stop)
                piece = file_slice[tuple(index)]
                if out is None:
                    local = list(shape)
                    local[self.dim] = size
                    out = torch.empty(local, dtype=dtype or piece.dtype, device=piece.device)
                out.narrow(self.dim, offset, stop - start).copy_(piece)
                offset += stop - start
                del piece
        if offset < size:  # padding rows of the vocabulary
            out.narrow(self.dim, offset, size - offset).zero_()
        return out

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """All-gather the shards of every rank and return the dense, unpadded, unpacked tensor.

        An uneven split's shards are first padded with zeros to the largest rank's size (rank 0's),
        since an all-gather takes equal sizes from every rank (NCCL's ``all_gather_into_tensor``),
        and each rank's padding is stripped after.

        Communication: one all-gather of the (padded) shard over ``group`` (every rank must call it).
        """
        sizes = self.local_sizes()
        width = max(sizes)
        if local.shape[self.dim] < width:  # an uneven split: pad this rank's shard for the all-gather
            pad = list(local.shape)
            pad[self.dim] = width - local.shape[self.dim]
            local = torch.cat([local, local.new_zeros(pad)], dim=self.dim)
        moved = local.movedim(self.dim, -1)
        gathered = comm.all_gather_last_dim(moved, group).movedim(-1, self.dim)
        if self.padded_size is not None:
            return gathered.narrow(self.dim, 0, self.parts[0]).contiguous()
        shards = gathered.chunk(self.tp_size, dim=self.dim)
        pieces = []
        offsets = [0] * self.tp_size  # where the next part starts in each rank's shard
        for i in range(len(self.parts)):
            lengths = [b - a for a, b in (self._part_range(i, r) for r in range(self.tp_size))]
            # a replicated part: the first rank of each replica group holds its slice (copies are equal)
            holders = range(0, self.tp_size, self.replica_group_size) if i in self.replicated else range(self.tp_size)
            pieces.extend(shards[r].narrow(self.dim, offsets[r], lengths[r]) for r in holders)
            offsets = [o + n for o, n in zip(offsets, lengths)]
        return torch.cat(pieces, dim=self.dim).contiguous()


# ---------------------------------------------------------------------------------------------
# The specs of each kind of split, written once: the layers attach them to their parameters, the
# styles put them in the layout (tpify.styles), LoRA derives its factors' from them.

def column_specs(out_features: int, tp_size: int, weight_layout: str = "linear", parts=None, padded_size=None,
                 replicated: tuple[int, ...] = (), replica_shards: int = 1,
                 uneven: bool = False) -> tuple[ShardSpec, ShardSpec]:
    """``(weight spec, bias spec)`` of a column-parallel layer (Megatron's ``A = [A_1 ... A_p]``):
    the output features split, each packed part separately, padded to ``padded_size`` (an LM
    head over a vocabulary ``p`` does not divide), ``replicated`` parts cut into
    ``replica_shards`` slices held by groups of ranks (grouped-query K/V), or (``uneven``) each part
    split by torch.chunk's rule (an intermediate size ``tp_size`` does not divide). The weight is
    split along dim 0 for ``nn.Linear`` (``[out, in]``), dim 1 for ``Conv1D`` (``[in, out]``).

    Raises:
        ValueError: as :class:`ShardSpec` (a part not divisible by ``tp_size`` without ``uneven``, ...).
    """
    parts = tuple(parts) if parts else (out_features,)
    if sum(parts) != out_features:
        raise ValueError(f"partition_sizes {list(parts)} do not add up to out_features = {out_features}")
    bias = ShardSpec(0, parts, tp_size, padded_size, tuple(replicated), replica_shards, uneven)
    weight = ShardSpec(0 if weight_layout == "linear" else 1, parts, tp_size, padded_size, tuple(replicated),
                       replica_shards, uneven)
    return weight, bias


def row_spec(in_features: int, tp_size: int, weight_layout: str = "linear", uneven: bool = False) -> ShardSpec:
    """The weight spec of a row-parallel layer: the input features split (dim 1 of an
    ``nn.Linear`` weight ``[out, in]``, dim 0 of a ``Conv1D`` weight ``[in, out]``; ``uneven``: by
    torch.chunk's rule); its bias is replicated (no spec).

    Raises:
        ValueError: ``in_features`` not divisible by ``tp_size`` (without ``uneven``).
    """
    return ShardSpec(1 if weight_layout == "linear" else 0, (in_features,), tp_size, uneven=uneven)


def vocab_rows_spec(num_embeddings: int, tp_size: int, padded_size: int | None = None) -> ShardSpec:
    """The weight spec of a vocab-parallel embedding: rows (vocabulary entries) split, the table
    padded to ``padded_size`` rows (default, or ``padded_size == num_embeddings``: unpadded, the
    same spec as a column-parallel LM head over that vocabulary, which a tied head shares)."""
    padded = padded_size if padded_size and padded_size != num_embeddings else None
    if padded is None and num_embeddings % tp_size:
        raise ValueError(f"num_embeddings = {num_embeddings} rows cannot be split over tp_size = {tp_size}: pad the "
                         f"table to a multiple of {tp_size} rows (padded_num_embeddings >= {num_embeddings})")
    return ShardSpec(0, (num_embeddings,), tp_size, padded)


def embedding_columns_spec(embedding_dim: int, tp_size: int) -> ShardSpec:
    """The weight spec of a column-parallel embedding (columns are heads: T5's relative attention
    bias)."""
    return ShardSpec(1, (embedding_dim,), tp_size)


def lora_factor_spec(base_weight_spec: ShardSpec, base_is_row: bool, in_features: int) -> tuple[str, ShardSpec]:
    """``(factor, spec)``: which LoRA factor of an adapter on a parallel layer is sharded, and how.

    A column-parallel base splits its output rows: ``lora_B`` ``(out, r)`` is split along dim 0
    exactly as the base's output (packed parts and padding alike), ``lora_A`` is replicated. A
    row-parallel base splits its input: ``lora_A`` ``(r, in)`` is split along dim 1, ``lora_B``
    replicated. An uneven base splits its factor unevenly alike (torch.chunk's rule). Megatron's rule
    for adapters (docs/mechanics.md, "LoRA on split layers").
    """
    if base_is_row:
        return "lora_A", ShardSpec(1, (in_features,), base_weight_spec.tp_size, uneven=base_weight_spec.uneven)
    spec = base_weight_spec
    return "lora_B", ShardSpec(0, spec.parts, spec.tp_size, spec.padded_size, spec.replicated, spec.replica_shards,
                               spec.uneven)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (a parameter or gradient FSDP2's ``fully_shard`` manages: it has
    lost the ``tp_shard_spec`` attribute; see :func:`tpify.api.param_specs`)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def copy_local_(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value``, this rank's whole TP shard of a tensor, into ``target`` in place: into a
    plain tensor as it is; into a DTensor (a parameter FSDP2 shards over the data-parallel axes),
    the slice of ``value`` this rank holds (``distribute_tensor`` with ``src_data_rank=None``:
    each rank slices its own copy, no communication). Converted to ``target``'s dtype."""
    if not is_dtensor(target):
        target.copy_(value)
        return
    from torch.distributed.tensor import distribute_tensor

    mine = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    target.to_local().copy_(mine.to_local())


def shard_spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` a parallel layer attached to a parameter, or ``None`` if replicated."""
    return getattr(tensor, "tp_shard_spec", None)


class KeepsShardSpecs(comm.SharesProcessGroups):
    """Mixin for modules holding sharded parameters: ``copy.deepcopy`` keeps their ``tp_shard_spec``.

    ``nn.Parameter.__deepcopy__`` rebuilds a parameter from its data and ``requires_grad`` only,
    so a deep copy of a parallelized model would hold shards without specs, which the gradient
    norm, the replica check and saving would then treat as replicated. This ``__deepcopy__``
    copies the module as ``copy.deepcopy`` would (sharing its process group:
    :class:`~tpify.comm.SharesProcessGroups`), then puts each spec back.
    """

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)
        for name, param in self.named_parameters(remove_duplicate=False):  # children's too (LoRA factors)
            spec = shard_spec_of(param)
            if spec is not None:
                new.get_parameter(name).tp_shard_spec = spec
        return new
