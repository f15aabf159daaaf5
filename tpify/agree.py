"""Did every rank succeed: the protocols that turn one rank's failure into an error on every rank.

tpify's entry points are collective. A rank whose local checks fail (a missing file, another
recipe, a different tp size) must not leave the others waiting in a collective that never
comes, so each entry point first makes every rank learn every rank's outcome. Three protocols,
one per kind of step:

| protocol                | used by                                     | communication                        |
| ----------------------- | ------------------------------------------- | ------------------------------------ |
| :func:`agree`           | the first step of every entry point         | the rendezvous store (no collective) |
| :func:`on_writing_rank` | each write of a save (global rank 0 writes) | one all-reduce of one int (world)    |
| :func:`on_every_rank`   | the save's files, each rank writing its own | one all-gather of a small object     |
| :func:`step_outcome`    | each step of ``tpify verify``'s cases       | one all-gather of a small object     |

:func:`agree` compares fingerprints too (the ranks must bring the same model, checkpoint,
recipe and arguments) and fails fast, with a message that names the cause, when a rank never
comes (it exited, or is in another tpify call). The other two only report success or failure:
their ranks already agreed. :func:`agreement` wraps a block of local checks in :func:`agree`.
The collectives are issued through :mod:`tpify.comm`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import pickle
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from .comm import all_gather_objects, all_reduce, backend_map, group_rank, group_size

__all__ = [
    "AgreementError",
    "agree",
    "agreement",
    "Agreement",
    "digest",
    "agreement_timeout",
    "agreement_notice",
    "AGREEMENT_TIMEOUT_ENV",
    "AGREEMENT_NOTICE_ENV",
    "on_writing_rank",
    "on_every_rank",
    "StepOutcome",
    "step_outcome",
    "host_of_rank",
    "device_placement",
    "shared_gpus",
]


class AgreementError(RuntimeError):
    """Ranks that must agree do not: different arguments, models, recipes or tp sizes, or another
    rank failed before the first collective. Raised on every rank at the same point."""


def digest(value) -> str:
    """A short digest of a JSON-able value, for the fingerprints :func:`agree` compares."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


#: Seconds a rank waits in :func:`agree` for the other ranks (environment variable).
AGREEMENT_TIMEOUT_ENV = "TPIFY_AGREEMENT_TIMEOUT"
_DEFAULT_AGREEMENT_TIMEOUT_S = 300.0
#: Seconds of waiting in :func:`agree` after which a rank says once what it waits for (environment variable).
AGREEMENT_NOTICE_ENV = "TPIFY_AGREEMENT_NOTICE"
# 30 s: ranks routinely reach a call seconds apart (one rank reads a checkpoint or converts a
# model first), rarely half a minute, so a notice after 30 s is seldom noise; and a user looking
# at a silent terminal learns the likely cause in half a minute, not after the 5-minute timeout.
_DEFAULT_AGREEMENT_NOTICE_S = 30.0
# (store, rank) once the exit marker is registered: process-wide as atexit itself is (one per process).
_exit_marker: list = []


def _seconds_from_env(name: str, default: float) -> float:
    """``$name`` as a positive number of seconds (``inf``: never), or ``default`` when unset or empty.

    Raises:
        ValueError: ``$name`` is not a number, or not a positive one (NaN included).
    """
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def agreement_timeout() -> float:
    """Seconds :func:`agree` waits for the other ranks: ``$TPIFY_AGREEMENT_TIMEOUT``, default 300."""
    return _seconds_from_env(AGREEMENT_TIMEOUT_ENV, _DEFAULT_AGREEMENT_TIMEOUT_S)


def agreement_notice() -> float:
    """Seconds of waiting in :func:`agree` before the waiting rank warns, once, which ranks it waits
    for and why they may never come: ``$TPIFY_AGREEMENT_NOTICE``, default 30 (none when it is not
    shorter than :func:`agreement_timeout`: the error comes first)."""
    return _seconds_from_env(AGREEMENT_NOTICE_ENV, _DEFAULT_AGREEMENT_NOTICE_S)


def host_of_rank() -> str:
    """This process's host, as tpify tells hosts apart: the host name, and torchrun's node rank
    (``GROUP_RANK``) when set, so that two ``torchrun --nnodes 2`` launches on one machine count as
    two hosts, as they would on two machines. Local; no communication."""
    node = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/node {node}" if node is not None else "")


def device_placement() -> tuple[str, str | None, int | None, bool]:
    """This rank's ``(host, LOCAL_RANK, CUDA device index, NCCL carries CUDA tensors)``, shared in
    every :func:`agree`. The index is read only once this process has initialised CUDA (reading it
    earlier would create a CUDA context on GPU 0); ``None`` before. Local."""
    index = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return host_of_rank(), os.environ.get("LOCAL_RANK"), index, backend_map().get("cuda") == "nccl"


def shared_gpus(placements: list, ranks: list[int]) -> str | None:
    """Under NCCL, the ranks of one host on one GPU described with the fix (``None`` when there are
    none, or without NCCL: gloo takes several ranks per GPU). ``placements[i]``: rank
    ``ranks[i]``'s :func:`device_placement`. Pure."""
    if not any(nccl for *_, nccl in placements):
        return None
    on: dict[tuple[str, int], list[tuple[int, str | None]]] = {}
    for rank, (host, local_rank, index, _) in zip(ranks, placements):
        if index is not None:
            on.setdefault((host, index), []).append((rank, local_rank))
    clashes = [(host, index, who) for (host, index), who in on.items() if len(who) > 1]
    if not clashes:
        return None
    said = "; ".join(f"ranks {[r for r, _ in who]} (LOCAL_RANK {[lr for _, lr in who]}) all on cuda:{index} of "
                     f"host {host}" for host, index, who in clashes[:3])
    return (f"{said}: NCCL needs one GPU per process (it refuses two ranks on one GPU, 'Duplicate GPU "
            f"detected'). Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) in every process before "
            f"init_process_group and before any .cuda() / .to('cuda'), or give each process its own GPU with "
            f"CUDA_VISIBLE_DEVICES")


def _waiting_notice(what: str, me: int, missing: list[int], waited: float, timeout: float) -> str:
    then = (f"This rank raises an AgreementError after {timeout:g} s of waiting; if those ranks are only slower, "
            f"set ${AGREEMENT_TIMEOUT_ENV} to wait longer" if timeout < float("inf") else
            f"This rank waits for them without limit (${AGREEMENT_TIMEOUT_ENV}=inf)")
    return (f"tpify: rank {me} has waited {waited:.0f} s in {what} for rank(s) {missing}, which have not called it. "
            f"The usual cause is a tpify entry point called on some ranks only (e.g. under `if rank == 0:`) "
            f"while the others wait elsewhere (a barrier, another collective): tpify's entry points are "
            f"collective, call {what} on every rank. {then} (${AGREEMENT_NOTICE_ENV} sets when this notice comes)")


def _agreement_store():
    """The default group's key-value store (the rendezvous store), or ``None`` if there is none."""
    try:
        # One namespace per torchrun restart, so that markers of a previous attempt never count.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"tpify/{restart}/", dist.distributed_c10d._get_default_store())
    except (AttributeError, RuntimeError, ValueError):
        return None


def _mark_exited() -> None:
    """At interpreter exit: tell ranks waiting in :func:`agree` that this rank will never come."""
    store, rank = _exit_marker[0]
    writer = threading.Thread(target=lambda: store.set(f"exited/{rank}", "1"), daemon=True)
    writer.start()
    writer.join(2.0)  # a store whose host is gone must not delay this process's exit


def _exchange(what: str, mine, ranks: list[int]) -> list | None:
    """Every rank's ``(what, mine)`` through the rendezvous store, waiting at most
    :func:`agreement_timeout` seconds and failing at once when a missing rank has exited.
    After :func:`agreement_notice` seconds of waiting it warns once (``RuntimeWarning``) which
    ranks it waits for, the likely cause and when it will raise.

    Keys are ``agree/<ranks of the group>/<n>/<rank>``: the n-th agreement this process enters on
    that group, so a rank that skipped a call meets the others' next one with another ``what``.
    ``None`` when there is no store (then the caller all-gathers).
    """
    store = _agreement_store()
    if store is None:
        return None
    me = dist.get_rank()
    if not _exit_marker:
        _exit_marker.append((store, me))
        atexit.register(_mark_exited)
    name = "-".join(map(str, ranks))
    # this rank's count of the agreements it entered on this group, kept in the store: it lives and
    # ends with the process group (a new one starts again at 1 on every rank), no process-global count
    n = store.add(f"sequence/{name}/{me}", 1)
    base = f"agree/{name}/{n}/"
    store.set(base + str(me), pickle.dumps((what, mine)))
    timeout, notice = agreement_timeout(), agreement_notice()
    start = time.monotonic()
    deadline, delay = start + timeout, 0.001
    noticed = notice >= timeout  # the error would come first
    missing = [r for r in ranks if r != me]
    while True:
        missing = [r for r in missing if not store.check([base + str(r)])]
        if not missing:
            break
        if not noticed and time.monotonic() - start > notice:
            noticed = True
            warnings.warn(_waiting_notice(what, me, missing, time.monotonic() - start, timeout), RuntimeWarning,
                          stacklevel=3)  # the line of the entry point that called agree
        exited = [r for r in missing if store.check([f"exited/{r}"])]
        if exited:
            raise AgreementError(f"{what}: rank(s) {exited} exited without calling it. Call {what} on every rank "
                                 f"(a call under `if rank == 0:` is the usual cause: tpify's entry points are "
                                 f"collective)")
        if time.monotonic() > deadline:
            raise AgreementError(f"{what}: rank(s) {missing} did not call it within {timeout:g} s. Call {what} on "
                                 f"every rank (a call under `if rank == 0:` is the usual cause: tpify's entry points "
                                 f"are collective); if those ranks are only slower, raise ${AGREEMENT_TIMEOUT_ENV}")
        time.sleep(delay)
        # At most 5 ms late after the last rank arrives (a load makes several agreements): a few
        # hundred store lookups a second while a slow rank is awaited, which the store serves easily.
        delay = min(2 * delay, 0.005)
    everyone = [pickle.loads(store.get(base + str(r))) for r in ranks]
    if store.add(base + "read", 1) == len(ranks):  # the last reader removes the round's keys
        for key in [base + str(r) for r in ranks] + [base + "read"]:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                store.delete_key(key)
    elsewhere = [(r, w) for r, (w, _) in zip(ranks, everyone) if w != what]
    if elsewhere:
        raise AgreementError(f"the ranks are in different tpify calls: this rank (rank {me}) in {what}, "
                             + ", ".join(f"rank {r} in {w}" for r, w in elsewhere)
                             + ". A call made on some ranks only (e.g. under `if rank == 0:`) puts the ranks out "
                               "of step; tpify's entry points are collective: call them on every rank")
    return [value for _, value in everyone]


def agree(what: str, fingerprint: dict, error: BaseException | None = None,
          group: dist.ProcessGroup | None = None, share=None) -> list | None:
    """The first communication of a tpify entry point: every rank learns every rank's outcome.

    Each rank posts its ``fingerprint`` (small picklable values that must be equal on every rank:
    tp size, digests of config, recipe and plan, dtype, a path) and the ``error`` its local checks
    raised, if any, to the rendezvous store, and reads the others'. Then every rank decides alike:
    a rank that failed raises its own error, the others an :class:`AgreementError` naming it;
    differing fingerprints raise on every rank, listing each value per rank. A rank that never
    comes is found fast: it exited (a marker written at exit), it entered another tpify call
    (agreements are numbered per group), or ``$TPIFY_AGREEMENT_TIMEOUT`` seconds (300) passed; a
    rank still waiting after ``$TPIFY_AGREEMENT_NOTICE`` seconds (30) warns once. Every rank also
    shares its :func:`device_placement`: ranks of one host on one GPU under NCCL raise here, before
    the first NCCL collective.

    ``share``: a picklable value not compared; every rank receives every rank's, in rank order
    (``None`` when not given). Without torch.distributed (or one rank) it only re-raises ``error``.

    Communication: none through the process group: a few keys in the default group's store,
    removed by the last reader (an ``all_gather_object`` over ``group`` where there is no store).

    Raises:
        AgreementError: another rank failed, the ranks disagree, are in different tpify calls, a
            rank exited or did not come in time; under NCCL, ranks of one host on one GPU.
        ValueError: ``$TPIFY_AGREEMENT_TIMEOUT`` or ``$TPIFY_AGREEMENT_NOTICE`` is not a positive number.
    Warns:
        RuntimeWarning: once, after ``$TPIFY_AGREEMENT_NOTICE`` seconds of waiting.
    """
    if group_size(group) == 1:  # one rank, or no torch.distributed
        if error is not None:
            raise error
        return None if share is None else [share]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if dist.get_rank() not in ranks:  # a group of other ranks: nothing to agree with them
        raise error if error is not None else ValueError(f"{what}: the group {ranks} does not contain this "
                                                         f"process (rank {dist.get_rank()})")
    placement = device_placement()
    mine = ((None, f"{type(error).__name__}: {error}", None, placement) if error is not None
            else (fingerprint, None, share, placement))
    everyone = _exchange(what, mine, ranks)
    if everyone is None:
        everyone = all_gather_objects(mine, group)
    if error is not None:
        raise error
    shared = [value for _, _, value, _ in everyone]
    placements = [where for *_, where in everyone]
    everyone = [(fp, message) for fp, message, _, _ in everyone]
    failed = [(ranks[i], message) for i, (_, message) in enumerate(everyone) if message is not None]
    if failed:
        rank, message = failed[0]
        raise AgreementError(f"{what} failed on rank(s) {[r for r, _ in failed]} (rank {rank}: {message.strip()}); "
                             f"this rank stops here too instead of waiting for it")
    one_gpu = shared_gpus(placements, ranks)
    if one_gpu is not None:  # before the first NCCL collective, which would hang or fail on one rank
        raise AgreementError(f"{what}: {one_gpu}")
    keys = sorted({k for fp, _ in everyone for k in fp})
    differing = [k for k in keys if len({repr(fp.get(k)) for fp, _ in everyone}) > 1]
    if differing:
        parts = [f"{k}: " + ", ".join(f"rank {ranks[i]} {fp.get(k)!r}" for i, (fp, _) in enumerate(everyone))
                 for k in differing]
        raise AgreementError(f"the ranks disagree on {what}: " + "; ".join(parts) + ". Launch every rank with the "
                             "same model, checkpoint, recipe, tp_size, dtype and arguments.")
    return None if share is None else shared


class Agreement:
    """The block of :func:`agreement` sets ``fingerprint``; after the block, ``shared`` holds every
    rank's ``share`` in the group's rank order (``None`` when no ``share`` was given)."""

    def __init__(self) -> None:
        self.fingerprint: dict = {}
        self.shared: list | None = None


@contextlib.contextmanager
def agreement(what: str, group: dist.ProcessGroup | None = None, share=None) -> Iterator[Agreement]:
    """Run this rank's local checks in the block, then :func:`agree` on their outcome.

    The block sets ``fingerprint`` on the :class:`Agreement` it is given; an ``Exception`` it
    raises is this rank's error, re-raised here after the agreement (an :class:`AgreementError`
    on the other ranks). A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``)
    propagates at once, without an agreement. Every rank of ``group`` must enter the block.

    Communication and Raises: as :func:`agree`.
    """
    outcome = Agreement()
    try:
        yield outcome
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        agree(what, {}, e, group, share)
        raise  # not reached: agree re-raised e
    outcome.shared = agree(what, outcome.fingerprint, None, group, share)


@contextlib.contextmanager
def on_writing_rank(where: str, device: torch.device | str | None = None) -> Iterator[bool]:
    """A block that writes, run on the writing rank (global rank 0); every rank learns whether it succeeded.

    Yields whether this process writes (always without torch.distributed); the block writes under
    ``if writing:`` and issues no collective. On exit one all-reduce (max) of one int over the
    world, on ``device`` (the model's: NCCL reduces only CUDA tensors). Every rank enters the block.

    Raises:
        The block's own exception, on the rank that raised it (after the all-reduce).
        RuntimeError: on every other rank when the block raised somewhere, naming ``where``.
    """
    writing = group_rank(None) == 0  # global rank 0; 0 without torch.distributed
    error = None
    try:
        yield writing
    except BaseException as e:  # noqa: BLE001 - reported to every rank below
        error = e
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    all_reduce(flag, None, op="max")  # a no-op without torch.distributed
    if error is not None:
        raise error
    if flag.item():
        raise RuntimeError(f"tpify: saving failed on the writing rank (global rank 0) while {where}; "
                           f"see that rank's error. The target directory holds one whole checkpoint (the previous "
                           f"one unless the failure came after the switch to the new one).")


@contextlib.contextmanager
def on_every_rank(where: str) -> Iterator[int]:
    """A block every rank runs, each doing its own part (its own files of a save); every rank
    learns whether every part succeeded.

    Yields this process's global rank. On exit one ``all_gather_object`` over the world of each
    rank's outcome: the block's end is a barrier at which every part is complete.

    Raises:
        The block's own exception, on the rank that raised it (after the gather).
        RuntimeError: on every other rank, naming ``where``, the ranks and the first one's error.
    """
    error = None
    try:
        yield group_rank(None)
    except BaseException as e:  # noqa: BLE001 - reported to every rank below
        error = e
    outcomes = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(outcomes) if m is not None]
    if failed:
        raise RuntimeError(f"tpify: saving failed on rank(s) {[r for r, _ in failed]} while {where} (rank "
                           f"{failed[0][0]}: {failed[0][1]}); this rank stops too. The target directory holds one whole "
                           f"checkpoint (the previous one: nothing was moved into it).")


@dataclass(frozen=True)
class StepOutcome:
    """What :func:`step_outcome` learnt: the ranks whose step failed, and why.

    Attributes:
        failed: ``(rank, message)`` of each rank whose step failed, in rank order (empty: all succeeded).
        errors: the exception class names those ranks gave.
        ranks: how many ranks took part.
    """

    failed: tuple[tuple[int, str], ...]
    errors: frozenset[str]
    ranks: int

    def describe(self) -> str:
        """``"every rank: <message>"`` when every rank failed alike, else ``"rank r: <message>; ..."``."""
        if len(self.failed) == self.ranks and len({m for _, m in self.failed}) == 1:
            return f"every rank: {self.failed[0][1]}"
        return "; ".join(f"rank {r}: {m}" for r, m in self.failed)


def step_outcome(ok: bool, message: str = "", error: str = "") -> StepOutcome:
    """Every rank learns whether any rank failed a step that every rank ran.

    Args:
        ok: whether this rank's step succeeded.
        message: this rank's failure, for the others (``""`` when ``ok``).
        error: the class name of this rank's exception (``""`` when ``ok``).

    Communication: one ``all_gather_object`` over the default group (not over a group the step
    itself used: a group a failed step left broken cannot hang it). Without torch.distributed,
    none. Raises nothing: the caller decides what a failure is.
    """
    outcomes = all_gather_objects((ok, message, error))
    failed = tuple((r, m) for r, (o, m, _) in enumerate(outcomes) if not o)
    return StepOutcome(failed, frozenset(e for o, _, e in outcomes if not o), len(outcomes))
