"""Process groups for tensor parallelism: the TP group and, beside it, the DP group.

Given by the caller (``tp_group``, ``dp_group``), inferred (a ``tp_group`` smaller than the
world: the DP group is the ranks holding the same TP rank), or made here on a mesh.

``world = dp * tp`` ranks are laid out as a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`
with axes ``("dp", "tp")`` in row-major order, so the ranks of one TP group are contiguous
(ranks ``0 .. tp-1`` form the first), which keeps TP inside a host when each host runs a
multiple of ``tp`` processes (docs/mechanics.md, "Groups").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


__all__ = ["init_tp_mesh", "resolve_tp_size", "INFER", "check_dp_group", "agreement_scope", "resolve_groups"]

#: The default of ``dp_group``: with a ``tp_group`` smaller than the world, find the DP group from
#: every rank's TP group (``None`` says: no data parallelism).
INFER = "infer"

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


def check_dp_group(dp_group, tp_group: dist.ProcessGroup | None) -> None:
    """Local checks of a ``dp_group`` argument; no collective.

    Raises:
        ValueError: ``dp_group`` without ``tp_group`` (the mesh makes both), a DP group that does
            not contain this process, or one that shares another rank with the TP group (a DP
            replica must hold the same shard on other ranks); a string other than ``"infer"``.
    """
    if isinstance(dp_group, str) and dp_group != INFER:
        raise ValueError(f"dp_group must be a process group, None (no data parallelism) or {INFER!r}, "
                         f"got {dp_group!r}")
    if dp_group is None or dp_group == INFER:
        return
    if tp_group is None:
        raise ValueError("dp_group= needs tp_group= too: without tp_group tpify makes both groups itself, on a "
                         "('dp', 'tp') DeviceMesh; pass tp_size= alone, or both groups")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(dp_group) < 0:
        raise ValueError("dp_group does not contain this process: pass each rank its own DP group (the ranks that "
                         "hold the same TP rank)")
    shared = set(dist.get_process_group_ranks(dp_group)) & set(dist.get_process_group_ranks(tp_group))
    if shared != {dist.get_rank()}:
        raise ValueError(f"dp_group and tp_group share ranks {sorted(shared - {dist.get_rank()})}: a DP group holds "
                         f"one rank of each TP group (the ranks that hold the same shard)")


def agreement_scope(tp_group: dist.ProcessGroup | None, dp_group):
    """``(group, share)`` for the entry point's agreement: over the TP group, or over the whole
    world when the DP group must be inferred (a ``tp_group`` smaller than the world and
    ``dp_group="infer"``), with each rank's TP-group ranks to share. Local; no collective."""
    if tp_group is None or dp_group != INFER or not (dist.is_available() and dist.is_initialized()):
        return tp_group, None
    if dist.get_world_size(tp_group) == dist.get_world_size():
        return tp_group, None
    ranks = tuple(sorted(dist.get_process_group_ranks(tp_group))) if dist.get_rank(tp_group) >= 0 else ()
    return None, ranks


def _infer_dp_group(tp_groups: list[tuple[int, ...]]):
    """The DP group from every rank's TP-group ranks (the same list on every rank): the ranks
    that hold the same TP rank, one of each TP group (collective: one ``new_group`` per DP group,
    in the same order on every rank).

    Raises:
        ValueError: on every rank alike, when the TP groups do not split the world into groups of
            one size (a rank in two groups, sizes that differ).
    """
    world = len(tp_groups)
    groups = sorted(set(tp_groups))
    size = len(groups[0])
    ok = (all(len(g) == size for g in groups) and sorted(r for g in groups for r in g) == list(range(world))
          and all(r in tp_groups[r] for r in range(world)))
    if not ok:
        raise ValueError(f"cannot infer the DP group: the ranks' TP groups {groups} do not split the world of {world} "
                         f"ranks into groups of one size; pass dp_group= (the ranks holding the same TP rank)")
    dp_lists = [[g[i] for g in groups] for i in range(size)]
    mine, _ = dist.new_subgroups_by_enumeration(dp_lists)
    return mine


def resolve_groups(tp_size: int, tp_group: dist.ProcessGroup | None, dp_group=INFER, tp_groups: list | None = None):
    """``(tp_group, dp_group, dp_source)`` for a validated ``tp_size``; creates the mesh or the DP
    groups when needed (collective). See :attr:`TPInfo.dp_source`."""
    if not (dist.is_available() and dist.is_initialized()):
        return tp_group, None, "none"
    if tp_group is None:
        mesh = init_tp_mesh(tp_size)
        return mesh["tp"].get_group(), mesh["dp"].get_group(), "mesh"
    if dp_group is None:  # the caller says: no data parallelism
        return tp_group, None, "none"
    if dp_group != INFER:
        return tp_group, dp_group, "argument"
    if tp_groups is None:  # the TP group is the whole world
        return tp_group, None, "none"
    return tp_group, _infer_dp_group(tp_groups), "inferred"
