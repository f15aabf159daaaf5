"""Process groups for tensor parallelism: the TP group and, beside it, the DP group.

Given by the caller (``tp_group``, ``dp_group``), inferred (a ``tp_group`` smaller than the
world: the DP group is the ranks holding the same TP rank), or made here on a mesh: this module
is the one place tpify builds a :class:`~torch.distributed.device_mesh.DeviceMesh`.

``world = dp_replicate * dp_shard * cp * tp`` ranks are laid out as a 4-D DeviceMesh with axes
``("dp_replicate", "dp_shard", "cp", "tp")`` in row-major order (:func:`init_mesh`), so the ranks of
one TP group are contiguous (ranks ``0 .. tp-1`` form the first), which keeps TP inside a host when
each host runs a multiple of ``tp`` processes (docs/mechanics.md, "Groups"), and the ranks of one
context-parallel group (the ``"cp"`` axis: each holds ``T/cp`` tokens of every sequence,
:mod:`tpify.context_parallel`) come next. The two data-parallel axes flattened are the axis ``"dp"``
(:func:`dp_mesh`): the DP group, over which DDP averages gradients; FSDP2 shards over
``"dp_shard"`` and, with ``dp_replicate > 1``, replicates over ``"dp_replicate"`` (HSDP;
:mod:`tpify.data_parallel`). The same names and order as torchtitan's meshes (and accelerate's
``ParallelismConfig``).
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import agree  # agree.agree looked up at the call (a test stands in for it)
from .agree import host_of_rank


__all__ = ["init_mesh", "dp_mesh", "fsdp_mesh", "cp_group_of", "cp_tp_group_of", "cp_size_of", "MESH_DIMS",
           "PP_MESH_DIMS", "pp_size_of", "pp_group_of",
           "resolve_tp_size", "INFER", "check_dp_group",
           "check_mesh", "agreement_scope", "resolve_groups", "host_of_rank", "split_tp_groups", "check_replica_groups",
           "replica_groups", "mesh_device_type", "model_device_type"]

#: The default of ``dp_group``: with a ``tp_group`` smaller than the world, find the DP group from
#: every rank's TP group (``None`` says: no data parallelism).
INFER = "infer"

#: The axes of the mesh :func:`init_mesh` builds, outermost first (TP innermost: contiguous ranks;
#: then context parallelism), torchtitan's order.
MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
#: The axes with pipeline stages (``init_mesh(..., pp_size > 1)``): ``"pp"`` outermost, so that the
#: stages are the slowest-varying coordinate (pp across hosts, tp inside one), torchtitan's order.
#: With ``pp_size == 1`` the mesh keeps :data:`MESH_DIMS` (no axis of one rank is added).
PP_MESH_DIMS = ("pp", *MESH_DIMS)

# The meshes init_mesh made, by (device type, shape). Process-wide on purpose: init_mesh is called
# before any model or context exists, and every later call (each parallelize without a mesh) must get
# the same mesh back, whose process groups were made collectively over the world and are never
# freed; the one object that outlives those calls, the default process group, takes no attributes.
_meshes: dict[tuple, DeviceMesh] = {}
_logger = logging.getLogger(__name__)
_said_no_process_group: list[bool] = []  # set once this process has said it (once per process)

#: What :func:`resolve_tp_size` logs, once per process, when tp 1 comes from a missing process group.
NO_PROCESS_GROUP = ("tpify: torch.distributed is not initialized, so the model is not split: tp_size = 1, this "
                    "process holds it whole. The usual cause is a script started with `python` instead of "
                    "`torchrun --nproc-per-node N` (which starts N processes; call "
                    "torch.distributed.init_process_group() in each before tpify). Pass tp_size=1 to say that one "
                    "process is meant (then nothing is logged).")


def _say_no_process_group() -> None:
    """Log :data:`NO_PROCESS_GROUP` (a warning of the ``tpify.mesh`` logger), the first time only."""
    if not _said_no_process_group:
        _said_no_process_group.append(True)
        _logger.warning(NO_PROCESS_GROUP)


def model_device_type(model: nn.Module | None) -> str | None:
    """The device type of ``model``'s first parameter or buffer not on the meta device (``None``
    without a model, or when every tensor is on the meta device). Local."""
    if model is None:
        return None
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device.type
    return None


def mesh_device_type(model: nn.Module | None = None) -> str:
    """The ``device_type`` of the DeviceMeshes tpify builds: the device the tensors it will carry live on.

    The type of ``model``'s tensors when they are on an accelerator (``"cuda"``); else
    ``"cuda"`` when this process can use CUDA (a model on the CPU or the meta device that is
    moved to this rank's GPU later, :func:`tpify.from_pretrained`'s, or no model); else
    ``"cpu"``. Never from the backend's name: ``init_process_group()`` with no backend reports
    ``"undefined"`` and ``"cpu:gloo,cuda:nccl"`` is neither ``"nccl"`` nor ``"gloo"``, yet both
    carry CUDA tensors over NCCL (a CPU mesh there made FSDP2 move every parameter to the CPU).
    On a GPU host that trains on the CPU, pass ``init_mesh(..., device_type="cpu")``. Local.
    """
    found = model_device_type(model)
    if found not in (None, "cpu"):
        return found
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_tp_size(tp_size: int | None, tp_group: dist.ProcessGroup | None) -> int:
    """The tp size implied by the arguments; local, issues no collective.

    ``tp_group`` wins; else ``tp_size``; else the whole world (1 without torch.distributed, which
    it logs once per process, :data:`NO_PROCESS_GROUP`: the usual cause is ``python`` run instead of
    ``torchrun``).

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
        if not initialized:
            _say_no_process_group()
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


def split_tp_groups(hosts: list[str], tp_size: int) -> list[str]:
    """The contiguous TP groups of ``tp_size`` ranks whose ranks are on more than one host, each
    described (``hosts[r]``: rank ``r``'s :func:`host_of_rank`). Pure; no communication."""
    out = []
    for start in range(0, len(hosts), tp_size):
        on = sorted(set(hosts[start: start + tp_size]))
        if len(on) > 1:
            out.append(f"ranks {start}..{start + tp_size - 1} on {len(on)} hosts ({', '.join(on)})")
    return out


def _check_sizes(tp_size, dp_replicate, world: int, cp_size=1, pp_size=1) -> None:
    """Local checks of :func:`init_mesh`'s sizes. Raises ValueError naming the numbers and the fix."""
    for name, value in (("tp_size", tp_size), ("dp_replicate", dp_replicate), ("cp_size", cp_size),
                        ("pp_size", pp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"init_mesh: {name} must be a positive integer, got {value!r}")
    if world % (tp_size * dp_replicate * cp_size * pp_size):
        cp = f" x cp_size {cp_size}" if cp_size > 1 else ""
        pp = f"pp_size {pp_size} x " if pp_size > 1 else ""
        raise ValueError(f"init_mesh: {pp}dp_replicate {dp_replicate}{cp} x tp_size {tp_size} = "
                         f"{pp_size * dp_replicate * cp_size * tp_size} does not divide the world size {world}: the "
                         f"mesh {'pp x ' if pp_size > 1 else ''}dp_replicate x dp_shard x cp x tp must be the world; "
                         f"pass sizes whose product divides {world}")


def init_mesh(tp_size: int, dp_replicate: int = 1, *, cp_size: int = 1, pp_size: int = 1,
              host_local_tp: bool | None = None, device_type: str | None = None) -> DeviceMesh:
    """The world as a ``("dp_replicate", "dp_shard", "cp", "tp")`` DeviceMesh, made once per shape
    and device type (then the same mesh again).

    ``dp_shard = world // (dp_replicate * cp_size * tp_size)``, row-major (torchtitan's order): TP
    groups are contiguous ranks, then the context-parallel groups (``mesh["cp"]``: ranks that each
    hold ``T / cp_size`` tokens of the same sequences, :mod:`tpify.context_parallel`; with
    ``cp_size > 1`` also the flattened axis ``"cp_tp"``, :func:`cp_tp_group_of`).
    With ``pp_size > 1`` an outermost ``"pp"`` axis comes first (:data:`PP_MESH_DIMS`): ranks
    ``s * world/pp .. (s+1) * world/pp - 1`` hold pipeline stage ``s`` (:mod:`tpify.pipeline`;
    ``mesh["pp"]`` is this rank's pipeline, :func:`pp_group_of`), and ``dp_shard = world //
    (pp_size * dp_replicate * cp_size * tp_size)``; with ``pp_size == 1`` the mesh is the 4-D one.
    ``mesh["tp"]`` is this rank's TP group, :func:`dp_mesh` the DP group (DDP), :func:`fsdp_mesh`
    FSDP2's (or HSDP's) mesh; pass it as ``mesh=`` to :func:`tpify.parallelize`. A TP group whose
    ranks are on several hosts (:func:`host_of_rank`, shared in the agreement) raises with
    ``host_local_tp=True``, warns with ``None`` (default), passes with ``False``. ``device_type``:
    default :func:`mesh_device_type` (CUDA when usable, whatever the backend is called); call
    ``torch.cuda.set_device(LOCAL_RANK)`` first.

    Communication: one agreement (the store: sizes and hosts), then the mesh's process groups
    (collective over the world); none when the mesh exists already.

    Raises:
        ValueError: on every rank: sizes that are not positive integers, ``pp_size * dp_replicate *
            cp_size * tp_size`` not dividing the world, a TP group across hosts with ``host_local_tp=True``.
        AgreementError: another rank failed, or the ranks passed different sizes.
    Warns:
        UserWarning: a TP group across hosts, with ``host_local_tp=None``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("init_mesh needs torch.distributed: launch with torchrun and call "
                         "torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    error = None
    try:
        _check_sizes(tp_size, dp_replicate, world, cp_size, pp_size)
    except ValueError as e:
        error = e
    device = device_type or mesh_device_type()
    shape = None
    if error is None:
        shape = (dp_replicate, world // (pp_size * tp_size * cp_size * dp_replicate), cp_size, tp_size)
        shape = (pp_size, *shape) if pp_size > 1 else shape
    key = (device, *shape) if shape is not None else None
    if key in _meshes and not host_local_tp:  # host_local_tp=True checks the hosts again
        return _meshes[key]
    sizes = {"tp_size": tp_size, "dp_replicate": dp_replicate, "cp_size": cp_size}
    sizes |= {"pp_size": pp_size} if pp_size != 1 else {}  # the same fingerprint as before at pp 1
    hosts = agree.agree("tpify.init_mesh", sizes, error, share=host_of_rank())
    split = split_tp_groups(hosts, tp_size) if hosts is not None and host_local_tp is not False else []
    if split:
        local = os.environ.get("LOCAL_WORLD_SIZE", "unset")
        message = (f"tensor-parallel groups span hosts: {'; '.join(split[:3])}"
                   f"{f' and {len(split) - 3} more' if len(split) > 3 else ''} (tp_size {tp_size}, "
                   f"LOCAL_WORLD_SIZE {local}): every layer's all-reduces would cross the network. Start a multiple "
                   f"of {tp_size} ranks per host (torchrun --nproc-per-node) with contiguous ranks per host, or a "
                   f"tp_size that divides the ranks per host")
        if host_local_tp:
            raise ValueError(message + " (refused: host_local_tp=True)")
        warnings.warn(message + " (pass host_local_tp=True to refuse, False to silence)", UserWarning, stacklevel=2)
    if key not in _meshes:
        mesh = init_device_mesh(device, shape, mesh_dim_names=PP_MESH_DIMS if pp_size > 1 else MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if cp_size > 1:
            mesh["cp", "tp"]._flatten("cp_tp")
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP2's shard axis under context parallelism
        _meshes[key] = mesh
    return _meshes[key]


def pp_size_of(mesh: DeviceMesh | None) -> int:
    """The size of ``mesh``'s ``"pp"`` axis (1 without a mesh or without the axis). Local."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["pp"].size()


def pp_group_of(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """This rank's pipeline: the ranks of ``mesh``'s ``"pp"`` axis (the same dp, cp and tp
    coordinates, one rank per stage), which send activations to each other; None when the axis is
    absent or has one rank. Local after :func:`init_mesh`."""
    if pp_size_of(mesh) == 1:
        return None
    return mesh["pp"].get_group()


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel axes of a :func:`init_mesh` mesh flattened, a 1-D mesh named ``"dp"``
    (this rank's DP group: the ranks that hold the same TP shard); a mesh with a ``"dp"`` axis of
    its own gives that axis. Local after :func:`init_mesh` (the flattened groups exist)."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names and "dp_shard" in names:
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh["dp"]


def cp_size_of(mesh: DeviceMesh | None) -> int:
    """The size of ``mesh``'s ``"cp"`` axis (1 without a mesh or without the axis). Local."""
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh["cp"].size()


def cp_group_of(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """This rank's context-parallel group: the ranks of ``mesh``'s ``"cp"`` axis, which hold the
    same shards and split the tokens of the same sequences (:mod:`tpify.context_parallel`); None
    when the axis is absent or has one rank. Local after :func:`init_mesh`."""
    if cp_size_of(mesh) == 1:
        return None
    return mesh["cp"].get_group()


def cp_tp_group_of(mesh: DeviceMesh | None, tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The ranks of one data-parallel replica under context parallelism: ``mesh``'s ``("cp", "tp")``
    axes flattened (``cp x tp`` ranks). A replicated parameter used where TP splits the activations
    (or sequence parallelism the tokens) gets a partial gradient on each rank of it, summed over
    it (:class:`tpify.grad_sums.SummedGrads`). ``tp_group`` itself without context parallelism.
    Local after :func:`init_mesh`."""
    if cp_size_of(mesh) == 1:
        return tp_group
    return mesh["cp", "tp"]._flatten("cp_tp").get_group()


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2's ``fully_shard`` takes: ``mesh["dp_shard"]`` (1-D: shard over it), or, when
    the mesh replicates (``dp_replicate > 1``), ``mesh["dp_replicate", "dp_shard"]`` (2-D: HSDP,
    replicate over the first axis, shard over the second). With context parallelism (``cp > 1``)
    the shard axis is ``"dp_shard_cp"``, ``dp_shard`` and ``cp`` flattened (torchtitan's): the
    ranks of a CP group hold the same weights, so FSDP2 shards them over ``dp_shard x cp`` and its
    reduce-scatter adds the CP group's partial gradients (:func:`tpify.shard_data_parallel` sets
    the divide factor to the DP size). Local after :func:`init_mesh`."""
    names = mesh.mesh_dim_names or ()
    if "dp_shard" not in names:
        return mesh["dp"]
    shard = "dp_shard"
    if cp_size_of(mesh) > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)  # made by init_mesh: found again
    if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]


def check_mesh(mesh, tp_size: int | None, tp_group, dp_group) -> int:
    """Local checks of a ``mesh=`` argument to :func:`tpify.parallelize`; its tp size. No collective.

    Raises:
        ValueError: ``mesh`` is not a DeviceMesh with a ``"tp"`` axis and the data-parallel axes
            (``"dp_replicate"`` and ``"dp_shard"``, or ``"dp"``; ``"cp"`` optional); it does not
            cover the world (``dp x cp x tp`` must be the world size); it has another axis of more
            than one rank; ``tp_group`` or ``dp_group`` given too; a ``tp_size`` other than the mesh's.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch DeviceMesh (tpify.init_mesh builds one), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" not in names or not ("dp" in names or {"dp_replicate", "dp_shard"} <= set(names)):
        raise ValueError(f"mesh has axes {names}; tpify needs a 'tp' axis and the data-parallel axes ('dp_replicate', "
                         f"'dp_shard') or 'dp': build it with tpify.init_mesh(tp_size, dp_replicate)")
    world = dist.get_world_size()
    if mesh.size() != world:
        shape = " x ".join(f"{n} {mesh.size(i)}" for i, n in enumerate(names))
        if "pp" in names:
            shape += " (with pipeline stages)"
        raise ValueError(f"mesh {shape} = {mesh.size()} ranks, but the world has {world}: the data-parallel and "
                         f"tensor-parallel sizes (and the context-parallel size) must multiply to the world size; "
                         f"build it with tpify.init_mesh(tp_size, dp_replicate, cp_size=cp) (dp_shard = world // "
                         f"(dp_replicate * cp * tp_size))")
    unknown = [n for i, n in enumerate(names) if n not in (*PP_MESH_DIMS, "dp") and mesh.size(i) > 1]
    if unknown:
        raise ValueError(f"mesh has axes {names}; tpify knows {PP_MESH_DIMS} (and 'dp'), and would not split the model "
                         f"or the data over {unknown}: build the mesh with tpify.init_mesh")
    if tp_group is not None or dp_group != INFER:
        raise ValueError("pass mesh= alone, or tp_group= (and dp_group=), not both: the mesh makes both groups")
    size = mesh["tp"].size()
    if tp_size is not None and tp_size != size:
        raise ValueError(f"tp_size = {tp_size} but the mesh's 'tp' axis has {size} ranks; pass one of them")
    return size


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


def resolve_groups(tp_size: int, tp_group: dist.ProcessGroup | None, dp_group=INFER, tp_groups: list | None = None,
                   mesh: DeviceMesh | None = None, device_type: str | None = None):
    """``(tp_group, dp_group, dp_source, mesh)`` for a validated ``tp_size``; creates the mesh
    (:func:`init_mesh`, on ``device_type``: default :func:`mesh_device_type`) or the DP groups
    when needed (collective). See :attr:`TPInfo.dp_source`; ``mesh`` is the DeviceMesh the
    groups come from, or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return tp_group, None, "none", None
    if tp_group is None:
        mesh = mesh if mesh is not None else init_mesh(tp_size, device_type=device_type)
        return mesh["tp"].get_group(), dp_mesh(mesh).get_group(), "mesh", mesh
    if dp_group is None:  # the caller says: no data parallelism
        return tp_group, None, "none", None
    if dp_group != INFER:
        return tp_group, dp_group, "argument", None
    if tp_groups is None:  # the TP group is the whole world
        return tp_group, None, "none", None
    return tp_group, _infer_dp_group(tp_groups), "inferred", None


def check_replica_groups(shards: set[int], tp_group: dist.ProcessGroup | None, dp_group) -> None:
    """Whether :func:`replica_groups` can make the groups a layout's KV heads need (``shards``:
    the KV head counts held by groups of ranks): it must know every TP group of the world. Local;
    no collective.

    Raises:
        ValueError: a ``tp_group`` smaller than the world with ``dp_group`` passed (or None):
            tpify does not know the other ranks' TP groups; pass ``mesh=``, or ``tp_group`` with
            ``dp_group="infer"`` (the default).
    """
    if not shards or tp_group is None or dp_group == INFER or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(tp_group) != dist.get_world_size():
        raise ValueError(f"the layout holds each of {sorted(shards)} KV heads on a group of ranks, whose gradients are "
                         f"summed over that group: tpify makes these groups once, every rank of the world calling "
                         f"new_group in the same order, so it must know every TP group; with a tp_group of "
                         f"{dist.get_world_size(tp_group)} of {dist.get_world_size()} ranks and dp_group={dp_group!r} it "
                         f"does not. Pass mesh= (tpify.init_mesh), or tp_group= with dp_group='infer' (the default)")


# {the mesh, or the TP group: {enumeration: this rank's group}}: kept with what the groups were cut from
# and dropped with it (a weak key; an equal DeviceMesh, same ranks, axes and device, finds the same
# groups), never reused from an earlier process group.
_replica_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tp_group_lists(tp_group: dist.ProcessGroup | None, mesh: DeviceMesh | None,
                    tp_groups: list | None) -> list[tuple[int, ...]]:
    """Every TP group of the world, each as its global ranks in TP-rank order (the same list on
    every rank): the mesh's ``"tp"`` rows, the world itself, or the TP groups the agreement shared."""
    if mesh is not None:
        names = list(mesh.mesh_dim_names)
        grid = mesh.mesh.movedim(names.index("tp"), -1)
        return [tuple(int(r) for r in row) for row in grid.reshape(-1, grid.shape[-1]).tolist()]
    size = dist.get_world_size(tp_group)
    if size == dist.get_world_size():
        return [tuple(dist.get_global_rank(tp_group, i) if tp_group is not None else i for i in range(size))]
    return sorted(set(tp_groups))  # new_group sorts its ranks: TP rank order is rank order


def replica_groups(shards: set[int], tp_group: dist.ProcessGroup | None, mesh: DeviceMesh | None = None,
                   tp_groups: list | None = None) -> dict[int, dist.ProcessGroup]:
    """``{n_kv: this rank's group}`` for each KV head count ``n_kv`` in ``shards``: the TP groups cut
    into groups of ``tp_size / n_kv`` consecutive TP ranks, which hold the same KV head (Megatron-LM's
    KV-head replication). Made once per enumeration and cached.

    Communication: collective over the world when a group is new (one ``new_subgroups_by_enumeration``
    per KV head count, every rank listing every group in the same order); none otherwise.
    """
    if not shards or not (dist.is_available() and dist.is_initialized()):
        return {}
    lists = _tp_group_lists(tp_group, mesh, tp_groups)
    owner = mesh if mesh is not None else tp_group if tp_group is not None else dist.group.WORLD
    made = _replica_groups.setdefault(owner, {})
    out = {}
    for n_kv in sorted(shards):
        size = len(lists[0])
        g = size // n_kv
        enumeration = tuple(tuple(ranks[i: i + g]) for ranks in lists for i in range(0, size, g))
        if enumeration not in made:
            made[enumeration], _ = dist.new_subgroups_by_enumeration([list(e) for e in enumeration])
        out[n_kv] = made[enumeration]
    return out
