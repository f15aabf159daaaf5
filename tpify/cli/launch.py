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

__all__ = ["under_torchrun", "relaunch", "init_distributed"]


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or tpify's own relaunch)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


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
