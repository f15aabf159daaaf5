"""Process groups as tpify asks about them: size and rank (1 and 0 without torch.distributed),
the backend per device type, the device object collectives run on; and
:class:`SharesProcessGroups`, which makes ``copy.deepcopy`` share groups instead of copying them.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["group_size", "group_rank", "backend_map", "collective_device", "SharesProcessGroups"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (a TP or a DP group; ``None``: the world); 1 when
    torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (a TP or a DP group; ``None``: the world); 0 when
    torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def backend_map(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``{device type: backend}`` of ``group`` (default: the world) from torch's backend config,
    never the backend's name: ``{"cuda": "nccl"}`` for ``"nccl"`` and for ``init_process_group()``
    on a CUDA host (``"undefined"``), ``{"cpu": "gloo", "cuda": "nccl"}`` for
    ``"cpu:gloo,cuda:nccl"``; empty without torch.distributed. Local.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # a torch without it, or a group it does not know
        name = str(dist.get_backend(group))
        config = f"cuda:{name}" if name == "nccl" else f"cpu:{name},cuda:{name}"
    return dict(pair.split(":", 1) for pair in config.lower().split(",") if ":" in pair)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device object collectives and barriers run on over ``group``: the CPU when it has a
    CPU backend, else this process's current CUDA device (NCCL alone; this rank's GPU after
    ``torch.cuda.set_device(LOCAL_RANK)``, checked by :func:`tpify.agree.agree`). Local.
    """
    backends = backend_map(group)
    if "cpu" in backends or "cuda" not in backends or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class SharesProcessGroups:
    """Mixin: ``copy.deepcopy`` shares the process groups and DeviceMeshes an object holds (directly
    or as the values of a dict attribute, the KV replica groups) and copies everything else: a
    group is a connection to the other ranks, and a copy of a parallel module (PEFT's
    ``modules_to_save`` copies the LM head) must talk to the same ranks."""

    def __deepcopy__(self, memo):
        for value in self.__dict__.values():
            for held in (value.values() if isinstance(value, dict) else (value,)):  # {n_kv: group} too
                if isinstance(held, (dist.ProcessGroup, DeviceMesh)):  # a mesh holds groups too
                    memo[id(held)] = held
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new
