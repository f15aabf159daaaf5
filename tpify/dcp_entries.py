"""Each parameter's :class:`~tpify.sharding.ShardSpec` as torch.distributed.checkpoint (DCP)
entries that reshard on load: one logical tensor per part.

* no spec (replicated): the tensor itself (DCP writes one copy of the identical entries);
* one part, split evenly or by torch.chunk's rule (``ceil(n / p)`` per rank, DTensor's uneven
  ``Shard``): ``DTensor.from_local`` with ``Shard(dim)`` on the TP mesh, no copy, no communication;
* packed parts (GPT-2's ``c_attn`` ``[Q | K | V]``, ``gate_up_proj``): rank ``r`` holds
  ``[Q_r | K_r | V_r]``, no slice of the packed tensor, so each part is its own tensor
  ``NAME.part<i>``, split as above; a replicated part (multi-query K/V) is a plain tensor;
* a padded vocabulary (``V`` rows padded to ``Vp``): the logical tensor is the ``V`` real rows,
  DTensor's uneven ``Shard(0)`` chunks when ``Vp / p == ceil(V / p)`` (``pad_vocab_multiple=1``);
  otherwise the **dense-order fallback**: one all-gather over TP per tensor, each rank offering
  DTensor's canonical chunk of the dense rows (one more when loading).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from .sharding import ShardSpec, chunk_range, is_dtensor

__all__ = ["PART", "ShardContext", "save_entries", "load_targets", "tp_shard", "is_whole_entry"]


#: The suffix of a packed parameter's parts: ``NAME.part<i>``.
PART = ".part"


@dataclass
class ShardContext:
    """What describing a rank's shards needs: the TP mesh, size and rank (``mesh`` None at tp 1)."""

    mesh: object
    tp_size: int
    tp_rank: int


def _canonical(size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of a dimension of ``size`` DTensor's ``Shard`` gives ``tp_rank``
    (``torch.chunk``'s sizes: ``ceil(size / tp_size)``, the last ones shorter or empty), the rule
    an uneven :class:`~tpify.sharding.ShardSpec` splits by."""
    return chunk_range(size, tp_size, tp_rank)


@dataclass
class _Part:
    """One logical tensor of a parameter: ``key``; its dense shape; this rank's ``[start, stop)``
    along ``dim`` within it and where they sit in the local TP shard (``local_offset``)."""

    key: str
    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    local_offset: int
    replicated: bool  # the same whole tensor on every TP rank (no spec, tp 1, a replicated part)
    even: bool = True  # every TP rank's rows are DTensor's Shard chunk (else: the dense-order fallback)


def _parts(key: str, shard_shape: tuple[int, ...], spec: ShardSpec | None, ctx: ShardContext) -> list[_Part]:
    """The logical tensors ``key``'s TP shard (of ``shard_shape``) holds a piece of."""
    if spec is None:
        return [_Part(key, tuple(shard_shape), 0, 0, shard_shape[0] if shard_shape else 0, 0, True)]
    dense = list(shard_shape)
    if spec.padded_size is not None or len(spec.parts) == 1:
        dense[spec.dim] = spec.global_size
        # Decided from every rank's rows, so that every rank takes the same path (the fallback's collectives).
        every = [(spec.ranges(r) or [(spec.global_size, spec.global_size)])[0] for r in range(ctx.tp_size)]
        even = all(rows == _canonical(spec.global_size, ctx.tp_size, r) for r, rows in enumerate(every))
        start, stop = every[ctx.tp_rank]
        return [_Part(key, tuple(dense), spec.dim, start, stop, 0, ctx.tp_size == 1, even)]
    out, offset, local = [], 0, 0
    for i, (size, (a, b)) in enumerate(zip(spec.parts, spec.ranges(ctx.tp_rank))):
        dense[spec.dim] = size
        grouped = i in spec.replicated and spec.replica_group_size < ctx.tp_size  # a KV head per group of ranks
        replicated = ctx.tp_size == 1 or (i in spec.replicated and not grouped)
        out.append(_Part(f"{key}{PART}{i}", tuple(dense), spec.dim, a - offset, b - offset, local, replicated,
                         not grouped))
        offset += size
        local += b - a
    return out  # packed parts are unpadded: each split evenly (or by torch.chunk's rule), or KV heads per group


def is_whole_entry(key: str, shard_shape, spec: ShardSpec | None, ctx: ShardContext) -> bool:
    """Whether a TP shard of ``shard_shape`` is its own one DCP entry, unchanged: no spec
    (replicated over TP), or at tp 1 a spec of one part without padding rows. Such a tensor may
    be saved and loaded as a DTensor of a data-parallel engine (over the dp mesh) as it is. Local."""
    parts = _parts(key, tuple(shard_shape), spec, ctx)
    return (len(parts) == 1 and parts[0].replicated and parts[0].key == key
            and parts[0].shape == tuple(shard_shape))


def _dtensor(local: torch.Tensor, part: _Part, ctx: ShardContext) -> DTensor:
    """``local`` as this rank's piece of ``part`` on the TP mesh (no copy, no communication)."""
    return DTensor.from_local(local, ctx.mesh, [Shard(part.dim)], run_check=False, shape=torch.Size(part.shape),
                              stride=torch.empty(part.shape, device="meta").stride())


def save_entries(key: str, shard: torch.Tensor, spec: ShardSpec | None, ctx: ShardContext) -> dict:
    """DCP entries for one TP shard (a plain tensor: this rank's whole shard)."""
    out, full = {}, None
    for part in _parts(key, tuple(shard.shape), spec, ctx):
        piece = shard.narrow(part.dim, part.local_offset, part.stop - part.start) if spec is not None else shard
        if part.replicated:
            out[part.key] = piece
        elif part.even:
            out[part.key] = _dtensor(piece, part, ctx)
        else:  # dense-order fallback: the dense rows, DTensor's canonical chunk of them
            if full is None:
                full = _gather_dense(shard, spec, ctx)
            base = sum(spec.parts[: int(part.key.rsplit(PART, 1)[1])]) if part.key != key else 0
            a, b = _canonical(part.shape[part.dim], ctx.tp_size, ctx.tp_rank)
            out[part.key] = _dtensor(full.narrow(part.dim, base + a, b - a).clone(), part, ctx)
    return out


def _gather_dense(shard: torch.Tensor, spec: ShardSpec, ctx: ShardContext) -> torch.Tensor:
    """The dense tensor of a TP shard: one all-gather over the TP group (:meth:`ShardSpec.gather`)."""
    return spec.gather(shard, ctx.mesh.get_group())


def load_targets(key: str, shard_shape, dtype, device, spec: ShardSpec | None,
                  ctx: ShardContext) -> tuple[dict, Callable[[], torch.Tensor]]:
    """``(entries, assemble)``: empty DCP entries for one TP shard, and a function that, after
    ``dcp.load`` filled them, returns this rank's TP shard (padding rows zero)."""
    parts = _parts(key, tuple(shard_shape), spec, ctx)
    entries, pieces = {}, []
    for part in parts:
        if part.replicated:
            buffer = torch.empty(part.shape, dtype=dtype, device=device)
            entries[part.key] = buffer
            pieces.append(lambda buffer=buffer: buffer)
            continue
        a, b = _canonical(part.shape[part.dim], ctx.tp_size, ctx.tp_rank)
        local = list(part.shape)
        local[part.dim] = b - a
        target = _dtensor(torch.empty(local, dtype=dtype, device=device), part, ctx)
        entries[part.key] = target
        if part.even:
            pieces.append(lambda target=target: target.to_local())
        else:  # dense-order fallback: all-gather the canonical chunks, take this rank's rows
            pieces.append(lambda part=part, target=target: target.full_tensor().narrow(
                part.dim, part.start, part.stop - part.start))

    def assemble() -> torch.Tensor:
        got = [p() for p in pieces]
        if spec is None:
            return got[0]
        have = sum(t.shape[spec.dim] for t in got)
        size = spec.local_size_of(ctx.tp_rank)
        if have < size:  # the padding rows of a vocabulary: zeros
            pad = list(shard_shape)
            pad[spec.dim] = size - have
            got.append(torch.zeros(pad, dtype=dtype, device=device))
        return torch.cat(got, dim=spec.dim) if len(got) > 1 else got[0]

    return entries, assemble


def tp_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's whole TP shard of ``t``: ``t`` itself, or, for FSDP2's DTensor over the DP
    mesh, its slices all-gathered over that mesh (``full_tensor``)."""
    t = t.detach()
    return t.full_tensor() if is_dtensor(t) else t
