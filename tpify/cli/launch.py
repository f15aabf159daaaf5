"""Process launching for the ``tpify`` command: self-launch under torchrun, set up the group.

A ``tpify`` subcommand run by hand (no ``LOCAL_RANK`` in the environment) re-executes itself as
``python -m torch.distributed.run --standalone --nproc-per-node N -m tpify.cli ...`` so that one
command starts all ranks on this host; under ``torchrun`` (one or several hosts, any rendezvous)
it runs as the rank torchrun made it. The backend is NCCL with one GPU per rank when CUDA is
available, else gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist

__all__ = ["under_torchrun", "relaunch", "init_distributed", "world_mismatch", "launch_problem"]


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or tpify's own relaunch)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_mismatch(tp: int, dp: int | None, world: int) -> str | None:
    """Why ``tp`` x ``dp`` ranks do not fit a world of ``world`` ranks, or None; ``dp`` None: any
    number of replicas (``world`` must be a multiple of ``tp``)."""
    if dp is None:
        if world % tp == 0:
            return None
        return (f"--tp {tp} does not divide the {world} ranks started; pass a --tp that divides {world}, or start "
                f"a multiple of {tp} ranks")
    if tp * dp == world:
        return None
    return (f"--tp {tp} x --dp {dp} = {tp * dp} ranks, but {world} ranks were started; pass --tp and --dp whose "
            f"product is {world}, or start {tp * dp} ranks (run without torchrun, tpify starts them itself)")


def launch_problem(nproc: int) -> str | None:
    """Why ``nproc`` ranks cannot be started on this host, or None: with CUDA each rank takes a
    GPU of its own, so there must be as many GPUs (CPU ranks may share cores)."""
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        return (f"{nproc} ranks (--tp x --dp) need a GPU each, but this host has {torch.cuda.device_count()}; pass "
                f"smaller --tp/--dp, or start the ranks on several hosts with torchrun")
    return None


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m tpify.cli *argv`` on ``nproc`` local ranks with torchrun; its exit code.

    CPU ranks get ``cores // nproc`` threads each (at least one), and gloo talks over loopback.
    """
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "tpify.cli", *argv]
    return subprocess.call(cmd, env=env)


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, gloo and the CPU otherwise.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device
