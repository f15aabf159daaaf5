"""The ranks of a verify job: ``tp`` subprocesses on this host that run cases with
:func:`~tpify.authoring.checks.check_case` and send rank 0's rows back.

Each rank is a ``python -c`` subprocess (never a re-import of the caller's main module, so a
script without an ``if __name__ == "__main__"`` guard works) that joins a gloo group over
localhost (``GLOO_SOCKET_IFNAME=lo``, one thread, rendezvous at a ``TCPStore`` on a free port
served by the parent), its address space limited (``RLIMIT_AS``). The job's cases travel in a
pickled payload file; results come back through the store: ``case/<i>`` (pickled rows and
seconds, from rank 0), ``done/<rank>``, or ``error/<rank>`` with the traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .checks import check_case
from .verify_report import Row

__all__ = ["run_job"]

_STORE_TIMEOUT = datetime.timedelta(seconds=600)


def _free_store():
    """A TCPStore served by this process on a free localhost port (the ranks connect to it)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)


def _rank_entry(payload_path: str, rank: int) -> None:
    """Body of one launched rank (``python -c``): join the group, run every case, post rank 0's rows.

    Results go to the parent's TCPStore: ``case/<i>`` (pickled rows and seconds, rank 0),
    ``done/<rank>``, or ``error/<rank>`` with the traceback.
    """
    import warnings

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    job = pickle.loads(Path(payload_path).read_bytes())
    _limit_memory(job.get("memory_limit_gib"))
    world, cases = job["world"], job["cases"]
    store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=_STORE_TIMEOUT)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("group/", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job["group_timeout_s"]))
        for i, case in enumerate(cases):
            start = time.perf_counter()
            rows = check_case(case.cls, case.config, world, recipe=case.recipe, workdir=job["workdir"],
                              target=case.label, task=case.task, group_timeout_s=job["group_timeout_s"],
                              ep_size=world if getattr(case, "expert_parallel", False) else 1)
            if rank == 0:
                store.set(f"case/{i}", pickle.dumps((rows, time.perf_counter() - start)))
        store.set(f"done/{rank}", "1")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _limit_memory(gib: float | None) -> None:
    """Limit this process's address space to ``gib`` GiB (``RLIMIT_AS``; never above the hard
    limit; a platform without it, or one that refuses, is left as it is)."""
    if not gib:
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = int(gib * 2**30)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        if soft == resource.RLIM_INFINITY or want < soft:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


class _Job:
    """What the parent knows of one running job: each case's rows as they arrive, each rank's end."""

    def __init__(self, cases: list, tp: int, store, progress=None):
        self.cases, self.tp, self.store, self.progress = cases, tp, store, progress
        self.rows: list[list[Row] | None] = [None] * len(cases)
        self.seconds = [0.0] * len(cases)
        self.finished: dict[int, str] = {}  # rank -> its error ("" when it finished cleanly)

    def collect(self) -> None:
        """Read what the ranks posted since the last call (calls ``progress`` for each new case)."""
        for i in range(len(self.cases)):
            if self.rows[i] is None and self.store.check([f"case/{i}"]):
                self.rows[i], self.seconds[i] = pickle.loads(self.store.get(f"case/{i}"))
                if self.progress is not None:
                    self.progress(self.cases[i], self.rows[i], self.seconds[i])
        for r in range(self.tp):
            if r not in self.finished:
                if self.store.check([f"error/{r}"]):
                    self.finished[r] = self.store.get(f"error/{r}").decode(errors="replace")
                elif self.store.check([f"done/{r}"]):
                    self.finished[r] = ""


def _spawn(payload: Path, tp: int, logs: list[Path]) -> list[subprocess.Popen]:
    """Start the ``tp`` ranks, each writing to its log."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "import sys; from tpify.authoring.launcher import _rank_entry; _rank_entry(sys.argv[1], int(sys.argv[2]))"
    procs = []
    for r in range(tp):
        with open(logs[r], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(payload), str(r)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs


def _errors(job: _Job, procs: list[subprocess.Popen], logs: list[Path], deadline: float, timeout_s: float) -> str:
    """What went wrong on the ranks: their own errors, then those that never finished (and why),
    with the tail of their output. Kills any rank still running."""
    errors = [f"rank {r}: {m}" for r, m in sorted(job.finished.items()) if m]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    missing = [r for r in range(job.tp) if r not in job.finished]
    if missing:
        timed_out = time.monotonic() >= deadline
        errors.append(f"rank(s) {missing} " + (f"did not finish within {timeout_s:.0f} s (killed)" if timed_out else
                                              f"exited with codes {[procs[r].returncode for r in missing]} "
                                              f"before finishing"))
        for r in missing:
            tail = logs[r].read_text(errors="replace")[-1500:].strip()
            if tail:
                errors.append(f"rank {r} output (tail):\n{tail}")
    return "\n".join(errors)


def run_job(cases: list, tp: int, timeout_s: float, group_timeout_s: float, progress=None,
            memory_limit_gib: float | None = None) -> tuple[list[list[Row] | None], list[float], str]:
    """Launch ``tp`` ranks that run ``cases``; ``(rows per case or None, seconds per case, error)``.

    ``cases``: objects with ``cls``, ``config``, ``recipe``, ``label``, ``task`` and
    ``expert_parallel`` (pickled to the ranks). The ranks are ``python -c`` subprocesses with this process's ``sys.path``,
    ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``, their address space limited to
    ``memory_limit_gib`` (None: unlimited); each rank's output goes to a log whose tail is
    reported if the rank fails. ``progress(case, rows, seconds)`` is called as each case reports;
    ranks still running after ``timeout_s`` are killed.
    """
    store = _free_store()
    job = _Job(cases, tp, store, progress)
    with tempfile.TemporaryDirectory(prefix="tpify-verify-") as workdir:
        payload = Path(workdir) / "job.pkl"
        payload.write_bytes(pickle.dumps({"world": tp, "cases": cases, "port": store.port, "workdir": workdir,
                                          "group_timeout_s": group_timeout_s, "memory_limit_gib": memory_limit_gib}))
        logs = [Path(workdir) / f"rank{r}.log" for r in range(tp)]
        procs = _spawn(payload, tp, logs)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job.collect()
            if len(job.finished) == tp or all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        job.collect()
        error = _errors(job, procs, logs, deadline, timeout_s)
    return job.rows, job.seconds, error
