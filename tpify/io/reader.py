"""This rank's slice of each checkpoint tensor, read from a load's opened files into a model.

A shard that is one range of its split dimension in the stored dtype becomes a zero-copy
view of a private (copy-on-write) mapping of its file, as transformers 5 loads a whole model;
any other shard (packed ``[Q|K|V]`` parts at tp > 1, padded vocabularies, a dtype conversion)
is copied by :meth:`tpify.sharding.ShardSpec.read`, block by block, with blocks sized by the
stored dtype's item size. :func:`materialize` puts the slices into the model (new tensors, or
copies into the existing ones). Local: no communication. Megatron-LM, arXiv:1909.08053,
section 3 (the layouts sharded).
"""

from __future__ import annotations

import math

import torch
from safetensors import safe_open
from torch import nn

from ..info import get_tp_info
from ..sharding import ShardSpec, shard_spec_of
from . import CheckpointError
from .files import Snapshot, TensorHeader

__all__ = ["materialize", "check_loaded"]


class _FileTensor:
    """A ``get_slice``-like handle on one tensor of an opened file, for the copying reads.

    Each ``[index]`` maps the file anew (``safe_open`` of the load's opened descriptor,
    :class:`~tpify.io.files.Snapshot`, so every block comes from the file the load opened even
    if a save replaced it since) and returns a view of just that block (safetensors >= 0.7
    returns views, no copy). :meth:`ShardSpec.read` copies the view into the preallocated shard
    and drops it, which unmaps it, so the source pages a copy touched leave this process's
    resident set: a load holds its shards plus one block (``block_bytes``, 16 MiB) in flight,
    never a whole tensor's pages.
    """

    def __init__(self, file: str, key: str, header: TensorHeader):
        self.file, self.key, self.shape = file, key, tuple(header.shape)
        self.itemsize = _item_size(header.dtype)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return safe_open(self.file, framework="pt", device="cpu").get_slice(self.key)[index]

    def read_whole(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole tensor (a replicated parameter) copied into owned memory, converted to ``dtype``."""
        if not self.shape:  # a 0-d tensor
            value = safe_open(self.file, framework="pt", device="cpu").get_tensor(self.key)
            return value.to(dtype) if dtype is not None else value.clone()
        return ShardSpec(0, (self.shape[0],), 1).read(self, 0, dtype, itemsize=self.itemsize)  # one "rank": all

    def read(self, spec: ShardSpec | None, tp_rank: int, dtype: torch.dtype | None) -> torch.Tensor:
        """This rank's shard (``spec``; ``None``: the whole tensor), copied into owned memory and
        converted to ``dtype`` (``None``: as stored), in blocks sized by the stored item size."""
        if spec is None:
            return self.read_whole(dtype)
        return spec.read(self, tp_rank, dtype, itemsize=self.itemsize)


def _item_size(stored: torch.dtype | None) -> int:
    """Bytes per element of a tensor stored as ``stored`` (1 for a dtype torch cannot hold)."""
    return stored.itemsize if stored is not None else 1


def _single_range(spec: ShardSpec | None, shape: tuple[int, ...], tp_rank: int) -> tuple[int, int] | None:
    """``(start, stop)`` along ``spec.dim`` when this rank's shard is one range of that dimension
    of the dense tensor (so a view of the file's bytes can hold it), else ``None``.

    One range: a replicated tensor (the whole of dim 0); a split whose ranges, adjacent ones
    merged (packed ``[Q|K|V]`` parts at tp = 1, the last rank's query chunk next to replicated
    K/V), make one range with no padding rows. Along dimension 0 (column-parallel ``nn.Linear``
    weights, vocabulary rows) the shard is one contiguous byte range of the file; along a later
    dimension (row-parallel ``nn.Linear``, column-parallel ``Conv1D``) it is a strided one, a
    slice of every row. Not one range: packed parts at tp > 1 (``[Q_r|K_r|V_r]``), vocabulary
    padding rows."""
    if not shape:
        return None
    if spec is None:
        return 0, shape[0]
    merged: list[list[int]] = []
    for a, b in spec.ranges(tp_rank):
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    if len(merged) != 1 or merged[0][1] - merged[0][0] != spec.local_size_of(tp_rank):
        return None
    return merged[0][0], merged[0][1]


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a view of a mapped file, contiguous or strided) as a tensor whose storage spans
    only the bytes from its first element to its last, not the whole dense tensor's: ``torch.save``
    of a shard then writes those bytes only, and for a contiguous shard ``untyped_storage().nbytes()``
    is the shard's size (for a strided one, the span of its rows, the other ranks' columns in
    between included). Shares the memory, copies nothing; keeps the strides."""
    size = view.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(view.shape, view.stride())) if view.numel() else 0
    start = view.storage_offset() * size
    raw = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())  # numpy has no bfloat16: bytes
    flat = torch.from_numpy(raw.numpy()[start:start + span * size]).view(view.dtype)
    return flat.as_strided(view.shape, view.stride())


# Shards smaller than this are copied even when contiguous: a view keeps the page-cache pages it
# touched mapped, counted whole (a kernel with large folios maps up to 2 MiB around a touched
# byte), so a 4 KiB LayerNorm weight would cost up to 2 MiB of resident set; a copy costs 4 KiB.
_VIEW_MIN_BYTES = 1 << 20


class _Reader:
    """Reads this rank's slice of each checkpoint tensor from the load's opened files.

    A shard that is one range of its split dimension, of at least ``_VIEW_MIN_BYTES`` (1 MiB) and
    stored in the dtype asked for, is a zero-copy view of a private (copy-on-write) mapping of the
    file, as transformers 5 does; any other shard (packed parts at tp > 1, padded vocabularies, a
    dtype conversion, ``in_place`` loads, ``views`` false) is copied block by block
    (:meth:`ShardSpec.read` through a :class:`_FileTensor`). The page-cache cost of strided views,
    ``disable_mmap`` and rewriting a file in place: docs/loading-and-saving.md, "_Reader".
    """

    def __init__(self, snap: Snapshot, headers: dict[str, TensorHeader], tp_rank: int, views: bool = True):
        self.snap, self.headers, self.tp_rank, self.views = snap, headers, tp_rank, views
        self.maps: dict[str, object] = {}  # file name -> safe_open handle whose mapping the views share

    def read(self, key: str, spec: ShardSpec | None, dtype: torch.dtype | None,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``key``, converted to ``dtype`` (``None``: as
        stored); with ``into``, copied into that tensor (converted to its dtype) and returned."""
        header = self.headers[key]
        shape, file, stored = header
        where = self.snap.where(file)
        rows = _single_range(spec, shape, self.tp_rank)
        if rows is not None and into is None and self.views:
            dim = spec.dim if spec is not None else 0
            nbytes = math.prod(shape) // shape[dim] * (rows[1] - rows[0]) * _item_size(stored)
            if (dtype is None or dtype == stored) and nbytes >= _VIEW_MIN_BYTES:
                if file not in self.maps:
                    self.maps[file] = safe_open(where, framework="pt", device="cpu")
                index = (slice(None),) * dim + (slice(*rows),)
                return _own_storage(self.maps[file].get_slice(key)[index])
        value = _FileTensor(where, key, header).read(spec, self.tp_rank, into.dtype if into is not None else dtype)
        if into is not None:
            with torch.no_grad():
                into.copy_(value)
            return into
        return value

    def close(self) -> None:
        """Drop the per-file handles (the views keep their mappings alive)."""
        self.maps.clear()


def materialize(model: nn.Module, snap: Snapshot, source: dict[str, str], headers: dict[str, TensorHeader],
                dtype: torch.dtype | None, in_place: bool = False, copy: bool = False) -> None:
    """Replace every parameter and persistent buffer ``source`` names (model FQN -> checkpoint
    key) by this rank's slice read from the opened files, floating ones converted to ``dtype``
    (``None``: as stored); tied tensors are read once and stay one tensor. ``in_place``: copy the
    slices into the existing tensors instead (converted to their dtype), which keep their
    identity (optimizers keep pointing at them).

    Reads go through :class:`_Reader`: one-range shards in the stored dtype become zero-copy
    views of the file's mapping (unless ``copy``), the others are copied into owned memory.
    Shows a progress bar on TP rank 0. Local: no communication; a read that fails raises
    safetensors' or the OS's error as it is (the caller's agreement reports it to every rank).
    """
    tp_rank = get_tp_info(model).tp_rank
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    for mname, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                fqn = f"{mname}.{name}" if mname else name
                holders.setdefault(id(t), []).append((module, name))
                if fqn in source and id(t) not in tensors:
                    tensors[id(t)] = (fqn, t)
    from tqdm.auto import tqdm

    reader = _Reader(snap, headers, tp_rank, views=not copy)
    try:
        for fqn, old in tqdm(list(tensors.values()), desc="tpify: loading", disable=tp_rank != 0 or None,
                             leave=False):
            spec = shard_spec_of(old)
            if in_place:
                reader.read(source[fqn], spec, None, into=old)
                continue
            value = reader.read(source[fqn], spec, dtype if old.is_floating_point() else None)
            _set_tensor(model, holders, old, value)
    finally:
        reader.close()


def check_loaded(model: nn.Module) -> None:
    """Raise unless every parameter of ``model`` holds values (none left on the meta device).

    Raises:
        CheckpointError: parameters left unloaded (defensive: the key matching refuses a
            checkpoint that lacks a tensor the model needs before anything is read).
    """
    leftover = [f for f, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"tpify: parameters left unloaded: {leftover}")


def _set_tensor(model: nn.Module, holders: dict[int, list[tuple[nn.Module, str]]], old, value: torch.Tensor):
    """Put ``value`` in place of ``old`` in every module that holds it (a new Parameter keeping
    ``old``'s ``requires_grad`` and ``tp_shard_spec``, or the buffer itself)."""
    spec = shard_spec_of(old)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        if spec is not None:
            new.tp_shard_spec = spec
        for module, name in holders[id(old)]:
            module._parameters[name] = new
    else:
        for module, name in holders[id(old)]:
            module._buffers[name] = value
