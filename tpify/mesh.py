"""Process groups for tensor parallelism: the TP group and, beside it, the DP group.

``world = dp * tp`` ranks are laid out as a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`
with axes ``("dp", "tp")`` in row-major order, so the ranks of one TP group are contiguous
(ranks ``0 .. tp-1`` form the first), which keeps TP inside a host when each host runs a
multiple of ``tp`` processes (docs/mechanics.md, "Groups").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["init_tp_mesh", "resolve_tp_size"]

_meshes: dict[tuple[int, int], DeviceMesh] = {}


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"


def resolve_tp_size(tp_size: int | None, tp_group: dist.ProcessGroup | None) -> int:
    """The tp size implied by the arguments; local, issues no collective.

    ``tp_group`` wins; else ``tp_size``; else the whole world (1 without torch.distributed).

    Raises:
        ValueError: ``tp_group`` does not contain this rank; ``tp_size`` and ``tp_group``
            disagree, ``tp_size`` does not divide the world size, or ``tp_size > 1`` without an
            initialised process group.
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if tp_group is not None:
        if not initialized or dist.get_rank(tp_group) < 0:
            raise ValueError(f"tp_group does not contain this process (global rank "
                             f"{dist.get_rank() if initialized else 'n/a'}): call parallelize only on the ranks of "
                             f"the group, each with its own TP group")
        size = dist.get_world_size(tp_group)
        if tp_size is not None and tp_size != size:
            raise ValueError(f"tp_size = {tp_size} but tp_group has {size} ranks; pass one of them")
        return size
    if tp_size is None:
        return world
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if tp_size > 1 and not initialized:
        raise ValueError(f"tp_size = {tp_size} needs torch.distributed: launch with torchrun "
                         f"--nproc-per-node {tp_size} and call torch.distributed.init_process_group() first")
    if world % tp_size:
        raise ValueError(f"tp_size = {tp_size} does not divide the world size {world}; "
                         f"use a divisor of {world} so that world = dp * tp")
    return tp_size


def init_tp_mesh(tp_size: int) -> DeviceMesh:
    """The ``("dp", "tp")`` DeviceMesh with ``dp = world // tp_size`` (created once, then cached).

    Collective: every rank of the world must call it with the same ``tp_size``.
    ``mesh["tp"].get_group()`` is this rank's TP group, ``mesh["dp"].get_group()`` its DP group.
    """
    world = dist.get_world_size()
    key = (world // tp_size, tp_size)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(_device_type(), key, mesh_dim_names=("dp", "tp"))
    return _meshes[key]
