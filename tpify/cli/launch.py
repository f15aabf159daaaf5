"""Process launching for the ``tpify`` command: self-launch under torchrun, set up the group, report
a failed rank once.

A ``tpify`` subcommand run by hand (no ``LOCAL_RANK`` in the environment) starts its ranks itself:
:func:`relaunch` runs torchrun's launcher (``torch.distributed.run``, ``--standalone
--nproc-per-node N -m tpify.cli ...``) in this process, so one command starts all ranks on this
host and, when a rank fails, this process prints that rank's error once
(:func:`failure_report`) instead of every rank's traceback and torchrun's ``ChildFailedError``.
Under ``torchrun`` (one or several hosts, any rendezvous) it runs as the rank torchrun made it
(:func:`run_rank`). The backend is NCCL with one GPU per rank when CUDA is available, else gloo on
the CPU.

A rank reports its error through the file torchrun names in ``TORCHELASTIC_ERROR_FILE`` (JSON, the
format torchrun reads back): the message alone for an error that explains itself (a bad argument
or file: ``ValueError``, ``ImportError``, ``OSError``, tpify's agreement and usage errors), the
traceback for anything else. Started by :func:`relaunch` (``TPIFY_LAUNCHER=1``), the rank prints
nothing of it: the launcher does, once. Under a torchrun the user started, each failing rank
prints its message on one line, prefixed with its rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["under_torchrun", "relaunch", "rank_environment", "init_distributed", "world_mismatch", "launch_problem",
           "run_rank", "failure_report", "LAUNCHER_ENV", "PREFLIGHT_ENV"]

# Set by relaunch for the ranks it starts: the launcher prints a failed rank's error (once).
LAUNCHER_ENV = "TPIFY_LAUNCHER"
# Set by relaunch once the launcher checked the arguments against the model: the ranks skip that check.
PREFLIGHT_ENV = "TPIFY_PREFLIGHT_DONE"


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


def rank_environment(nproc: int, tp: int = 1, fsdp: bool = False) -> dict[str, str]:
    """The variables :func:`relaunch` adds to the environment of the ``nproc`` ranks it starts (``tp``
    per TP group, ``fsdp``: the model sharded by FSDP2 over DP).

    Always tpify's launcher flags. With CUDA: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` at ``tp > 1``
    without FSDP2 (:func:`tpify.layers.overlap_environment`: set before the ranks initialise CUDA,
    so that each column-parallel layer's input-gradient all-reduce runs beside its weight-gradient
    matmul; a value the user set is kept). Without CUDA: ``cores // nproc`` threads per rank (at
    least one; ``OMP_NUM_THREADS`` if set) and gloo over loopback (``GLOO_SOCKET_IFNAME`` if set).
    """
    from ..layers import overlap_environment

    env = {LAUNCHER_ENV: "1", PREFLIGHT_ENV: "1"}  # the ranks' environment is this process's, while they run
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    env.update(overlap_environment(tp, fsdp))
    return env


def relaunch(nproc: int, argv: list[str], command: str = "", tp: int = 1, fsdp: bool = False) -> int:
    """Run ``python -m tpify.cli *argv`` on ``nproc`` local ranks with torchrun's launcher (in this
    process); the exit status: 0, or 1 when a rank failed (its error printed once to stderr,
    :func:`failure_report`), 130 when interrupted.

    The ranks' environment is this process's plus :func:`rank_environment` (``tp``, ``fsdp``:
    CUDA_DEVICE_MAX_CONNECTIONS=1 on GPUs at ``tp > 1`` without FSDP2; CPU ranks get ``cores //
    nproc`` threads each and gloo talks over loopback), restored afterwards. The launcher's own log
    lines (a worker failed, the others are stopped) are silenced: the report says what failed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    env = rank_environment(nproc, tp, fsdp)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    elastic.setLevel(logging.CRITICAL)
    name = f"tpify {command}".strip()
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "tpify.cli", *argv]))
    except ChildFailedError as e:
        print(failure_report(name, e.failures), file=sys.stderr)
        return 1
    except (SignalException, KeyboardInterrupt):
        print(f"{name}: interrupted; the ranks were stopped", file=sys.stderr)
        return 130
    finally:
        elastic.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


def failure_report(what: str, failures: dict) -> str:
    """The error of the rank that failed first, once, for ``failures`` (torchrun's ``{global rank:
    ProcessFailure}``): ``"tpify finetune: error on rank 1 (and ranks 0, 1 alike): PlanError: ..."``.
    Ranks that failed otherwise follow, one line each (an :class:`~tpify.agree.AgreementError`
    that only repeats another rank's failure is left out; so is a rank stopped by a signal after
    another failed, which is counted)."""
    reports = {}
    for rank, failure in failures.items():
        data = getattr(failure, "error_file_data", None) or {}
        mine = data.get("tpify") if isinstance(data, dict) else None
        if isinstance(mine, dict) and isinstance(mine.get("message"), str):
            reports[rank] = (float(mine.get("time", 0.0)), mine["message"])
        elif getattr(failure, "exitcode", 0) < 0:
            reports[rank] = (float("inf"), f"stopped by signal {failure.signal_name()}")
        else:
            reports[rank] = (float(getattr(failure, "timestamp", 0) or 0) + 0.5,
                             f"exited with code {getattr(failure, 'exitcode', '?')} without an error message; its "
                             f"output is above")
    root = min(reports, key=lambda r: (reports[r][0], r))
    message = reports[root][1]
    alike = sorted(r for r, (_, m) in reports.items() if m == message)
    ranks = f"rank {root}" + (f" (ranks {', '.join(map(str, alike))} alike)" if len(alike) > 1 else "")
    lines = [f"{what}: error on {ranks}: {message}"]
    stopped = []
    for rank in sorted(reports):
        text = reports[rank][1]
        if rank in alike:
            continue
        if text.startswith("stopped by signal"):
            stopped.append(rank)
        elif not text.startswith("AgreementError"):
            first = text.strip().splitlines()[0] if text.strip() else text
            lines.append(f"  rank {rank}: {first[:400]}")
    if stopped:
        lines.append(f"  rank(s) {', '.join(map(str, stopped))} stopped after it")
    return "\n".join(lines)


def _explains_itself(error: BaseException) -> bool:
    """An error whose message says what is wrong and the fix (a bad argument or file, a missing
    extra, ranks that disagree): printed without its traceback. Anything else is a bug to report,
    traceback and all."""
    from ..agree import AgreementError
    from ..info import TPUsageError

    return isinstance(error, (ValueError, ImportError, OSError, AgreementError, TPUsageError))


def run_rank(command: str, worker, args) -> int:
    """Run ``worker(args)`` as one rank of ``tpify <command>``; its exit status. A failure is
    written to torchrun's error file (``TORCHELASTIC_ERROR_FILE``) and, unless tpify's own
    launcher started this rank (it prints the error once, :func:`relaunch`), printed on one line
    prefixed with the rank; exit status 1."""
    try:
        return worker(args)
    except Exception as e:  # noqa: BLE001 - reported once, below and by the launcher
        text = f"{type(e).__name__}: {e}" if _explains_itself(e) else traceback.format_exc().rstrip()
        rank = os.environ.get("RANK", "?")
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            with open(error_file, "w") as f:
                json.dump({"message": text, "timestamp": int(time.time()),
                           "tpify": {"message": text, "time": time.time()}}, f)
        if os.environ.get(LAUNCHER_ENV) != "1":
            print(f"[rank {rank}] tpify {command}: error: {text}", file=sys.stderr, flush=True)
        return 1


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
