"""torch's pipeline schedules over tpify's stages, the last stage's loss, and one training step.

:func:`build_schedule` returns torch's schedule object (``torch.distributed.pipelining``:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) whose loss is
:class:`PipelineLoss`; :func:`step` shifts the labels as HF does, counts the non-ignored targets of
the whole batch once, runs the schedule and sums the tied embedding's gradient between the first
and last stage (its inputs checked by :class:`StepCheck`: one host all-reduce, no host sync and no
store traffic per step), so that the loss and every gradient equal the dense model's mean loss over the
batch (gradient accumulation over the microbatches, ``scale_grads=False``). Data-parallel
replicas of the stages are torch's engines, applied to the stages before the schedule is built
(:mod:`tpify.pipeline.data_parallel`: FSDP2 / HSDP or replicas, driven by torch's schedules across
the microbatches); tpify sums no gradient over dp itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from .. import comm
from ..context_parallel import cp_of
from ..agree import AgreementError, agree
from ..info import tp_info_of
from ..loss import cross_entropy_deferred, linear_cross_entropy_deferred
from ..sharding import is_dtensor
from .data_parallel import check_data_parallel
from .plan import PipelineError
from .split import PipelineInfo

__all__ = ["SCHEDULES", "V_SCHEDULES", "REFUSED_SCHEDULES", "stage_style", "default_n_virtual", "PipelineLoss", "build_schedule", "check_microbatches", "step",
           "StepInputsError", "IGNORE_INDEX"]

IGNORE_INDEX = -100

#: The schedules tpify builds: name -> (torch class, several stages per rank). The zero-bubble
#: schedules (Qi et al., arXiv:2401.10241) and DualPipeV (DeepSeek-V3, arXiv:2412.19437) split each
#: backward into an input-gradient pass and a weight-gradient pass (torch's ``stage_backward_input`` /
#: ``stage_backward_weight``): verified exact with tpify's layers (docs/pipeline-parallelism.md).
SCHEDULES = {"GPipe": (ScheduleGPipe, False), "1F1B": (Schedule1F1B, False),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, True),
             "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, True),
             "ZBVZeroBubble": (ScheduleZBVZeroBubble, True), "DualPipeV": (ScheduleDualPipeV, True)}
#: The schedules whose stages are placed in a V (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``:
#: :func:`tpify.pipeline.plan.stage_indices`); every other schedule takes the loop placement.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
#: The interleaved schedules on the loop placement (several stages per rank, 2 by default; their
#: microbatches a multiple of the rounds).
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
#: torch's other schedules, refused with the reason.
REFUSED_SCHEDULES = {
    "LoopedBFS": "not verified against the dense model yet; use Interleaved1F1B (the same placement of the stages)",
}


def stage_style(schedule: str) -> str:
    """The placement of the stages ``schedule`` runs on: ``"v"`` (:data:`V_SCHEDULES`) or ``"loop"``."""
    return "v" if schedule in V_SCHEDULES else "loop"


def default_n_virtual(schedule: str) -> int:
    """Stages per rank when the caller gives none: 2 for the interleaved and V schedules, else 1."""
    return 2 if schedule in (*INTERLEAVED_SCHEDULES, *V_SCHEDULES) else 1


class PipelineLoss:
    """The last stage's loss of one microbatch: ``sum of token losses / num_items``.

    ``num_items`` is the count of non-ignored targets of the whole batch (a tensor on the device,
    counted once by :func:`step`), so the microbatches' losses add up to the dense model's mean
    loss and their gradients to its gradient. From the vocabulary shard with
    :func:`tpify.loss.vocab_parallel_cross_entropy` (Megatron-LM, arXiv:1909.08053, section 3).

    With ``chunk`` (an int, or ``"auto"``: :func:`tpify.loss.default_chunk_size`) the last stage
    returns the head's input and the loss is :func:`tpify.loss.vocab_parallel_linear_cross_entropy`
    from it and ``head``'s weight shard, ``chunk`` tokens at a time: the ``(b, T, V/p)`` logits are
    never held (the head's weight gradient flows from the loss's backward).

    Shapes: ``logits`` ``(b, T, V_padded / tp_size)`` (with ``chunk``: ``(b, T, H)``), ``target``
    ``(b, T)`` (shifted already); returns a scalar. Dtype: float32 for half-precision logits, else
    the logits' dtype. Communication: the vocab-parallel loss's all-reduces over the TP group
    (none at tp 1).
    """

    def __init__(self, tp_group, vocab_size: int, head: nn.Module | None = None, chunk: int | str | None = None):
        self.tp_group, self.vocab_size, self.head, self.chunk = tp_group, vocab_size, head, chunk
        #: where the vocab-parallel loss records its data checks (targets in range and equal on the TP
        #: ranks, shard widths): :class:`StepCheck`'s, raised at the next :func:`step`; None: at once
        self.defer: comm.DeferredChecks | None = None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
        if self.chunk is not None:  # ``logits`` is the head's input (B, T, H): the logits are never held
            weight = self.head.weight
            if getattr(self.head, "weight_layout", "linear") != "linear":
                weight = weight.t()
            total = linear_cross_entropy_deferred(
                logits, weight, target, bias=getattr(self.head, "bias", None), ignore_index=IGNORE_INDEX,
                label_smoothing=0.0, reduction="sum", tp_group=self.tp_group, vocab_size=self.vocab_size,
                chunk_size=None if self.chunk == "auto" else self.chunk, softcap=None, logit_ops=(), defer=self.defer)
            return total / num_items.to(total.dtype)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if comm.group_size(self.tp_group) == 1:
            total = F.cross_entropy(logits.flatten(0, -2)[:, :self.vocab_size], target.flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        else:
            total = cross_entropy_deferred(logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0,
                                           reduction="sum", tp_group=self.tp_group, vocab_size=self.vocab_size,
                                           defer=self.defer)
        return total / num_items.to(total.dtype)


def check_microbatches(schedule: str, n_microbatches, pp_size: int, num_stages: int, local_stages: int,
                       style: str = "loop") -> None:
    """Whether ``schedule`` can take ``n_microbatches`` on this layout (torch's own conditions,
    checked before anything is built). ``style``: the placement the stages were split with. Pure.

    Raises:
        PipelineError: an unknown or refused schedule, a count that is not a positive integer,
            fewer microbatches than stages (1F1B, DualPipeV), a count that is not a multiple of the
            rounds (interleaved, interleaved zero bubble), several stages per rank for a one-stage
            schedule, a V schedule on stages not split in a V (two per rank), a loop schedule on
            stages split in a V.
    """
    if schedule in REFUSED_SCHEDULES:
        raise PipelineError(f"schedule {schedule!r} is not built: {REFUSED_SCHEDULES[schedule]}")
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule {schedule!r}: use one of {sorted(SCHEDULES)}")
    if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
        raise PipelineError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    multi = SCHEDULES[schedule][1]
    if not multi and local_stages != 1:
        raise PipelineError(f"schedule {schedule!r} runs one stage per rank, but the model was split into "
                            f"{local_stages} per rank: use Interleaved1F1B, or split with n_virtual=1")
    if style != stage_style(schedule):
        raise PipelineError(f"schedule {schedule!r} runs on stages placed {stage_style(schedule)!r}, but the model was "
                            f"split with style={style!r}: split (and load) with style={stage_style(schedule)!r}, or "
                            f"let tpify.pipeline.pipeline choose")
    if schedule in V_SCHEDULES and local_stages != 2:
        raise PipelineError(f"{schedule} runs exactly two stages per rank (a V: ranks r and 2 pp - 1 - r), but the "
                            f"model was split into {local_stages} per rank: use n_virtual=2")
    if schedule in ("1F1B", "DualPipeV") and n_microbatches < num_stages:
        raise PipelineError(f"{schedule} needs at least as many microbatches as stages: n_microbatches = "
                            f"{n_microbatches}, {num_stages} stages; use n_microbatches >= {num_stages}")
    if schedule in INTERLEAVED_SCHEDULES:
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise PipelineError(f"{schedule} needs n_microbatches to be a multiple of its rounds "
                                f"(max(1, n_microbatches // pp_size) = {rounds}): got {n_microbatches} at pp "
                                f"{pp_size}; use a multiple of {pp_size}")


def build_schedule(info: PipelineInfo, schedule: str = "1F1B", n_microbatches: int = 1,
                   device: torch.device | None = None, lm_loss_chunk: int | str | None = None):
    """torch's schedule object running ``info``'s stages (:func:`tpify.pipeline.split_model`).

    ``schedule.step`` is torch's; use :func:`step` (labels shifted, the batch's target count, the
    tied embedding's gradient summed). ``schedule.tpify_pipeline`` is ``info``. With data-parallel
    replicas (dp > 1 in the mesh) the stages must be under FSDP2 or ``replicate`` already
    (:func:`tpify.pipeline.shard_stages`, :func:`tpify.pipeline.replicate_stages`): torch's
    ``PipelineStage`` runs the FSDP2 module and drives its gradient sync. ``device``: where
    the stages' activations live (default: the stages' parameters'). ``lm_loss_chunk``: None (the
    loss from the logits shard), a positive int or ``"auto"`` (the chunked linear cross-entropy,
    :class:`PipelineLoss`).

    Communication: one agreement (the store) on the schedule and the microbatch count; at
    NCCL-only, a gloo group of the pipeline's ranks for :func:`step`'s checks (``new_group``, once);
    torch's send/recv over the pipeline group when the schedule first runs.

    Raises:
        PipelineError: on every rank, as :func:`check_microbatches`; a bad ``lm_loss_chunk``; dp > 1
            without FSDP2 or ``replicate`` on the stages (naming the two functions).
        AgreementError: another rank failed, or the ranks passed other arguments.
    """
    error = None
    try:
        check_data_parallel(info.mesh, info.data_parallel)
        check_microbatches(schedule, n_microbatches, info.mesh["pp"].size(), info.num_stages, len(info.stages),
                           info.style)
        if lm_loss_chunk is not None and lm_loss_chunk != "auto" and not (
                isinstance(lm_loss_chunk, int) and not isinstance(lm_loss_chunk, bool) and lm_loss_chunk > 0):
            raise PipelineError(f"lm_loss_chunk must be None, 'auto' or a positive number of tokens, got "
                                f"{lm_loss_chunk!r}")
    except Exception as e:  # noqa: BLE001 - re-raised by agree on this rank, reported on the others
        error = e
    agree("tpify.pipeline.build_schedule", {"schedule": schedule, "n_microbatches": n_microbatches,
                                            "lm_loss_chunk": lm_loss_chunk, "data_parallel": info.data_parallel}, error)
    if device is None:
        first = next(info.stages[0].parameters())
        device = first.to_local().device if is_dtensor(first) else first.device
    stages = [PipelineStage(s, s.stage_index, s.num_stages, device, group=info.pp_group) for s in info.stages]
    cls, multi = SCHEDULES[schedule]
    last = next((s for s in info.stages if s.is_last), None)
    head = getattr(last.model, last.head) if last is not None else None
    if last is not None:
        last.return_hidden = lm_loss_chunk is not None
    loss = PipelineLoss(info.tp_group, info.vocab_size, head, lm_loss_chunk)
    out = cls(stages if multi else stages[0], n_microbatches, loss_fn=loss, scale_grads=False)
    out.tpify_pipeline = info
    out.tpify_step_check = StepCheck(info)
    loss.defer = out.tpify_step_check.checks
    return out


class StepInputsError(PipelineError, AgreementError):
    """:func:`step`'s inputs were wrong on another rank of the pipeline: raised on every other rank,
    at the same point, naming it (the failing rank raises its own :class:`PipelineError`). Both a
    :class:`PipelineError` and an :class:`tpify.AgreementError` (what :func:`tpify.agree.agree`
    raised there before)."""


#: What a rank's inputs to :func:`step` can get wrong, by code (:class:`StepCheck`'s first value):
#: the phrase the other ranks' message gives.
_PROBLEMS = {
    1: "input_ids are given on a rank that holds no first stage",
    2: "the first stage needs input_ids",
    3: "labels are given on a rank that holds no last stage",
    4: "the last stage needs labels",
    5: "a batch that is not (B, T) with B a multiple of n_microbatches",
    6: "attention_mask / position_ids / labels not as the layout takes them (position_ids and shift_labels under "
       "context parallelism only)",
    7: "input_ids and labels of different shapes",
}
_CODES = 8  # codes fit in [0, 8)
#: A value no real one reaches: a rank with nothing to compare puts it in a value and its negation.
_NONE = -(2 ** 62)


def _batch_problem(has_first: bool, has_last: bool, input_ids, labels, attention_mask, position_ids,
                   m: int, cp: int = 1, shift_labels=None) -> tuple[int, str] | None:
    """What is wrong with this rank's part of the batch: ``(code, message)`` (:data:`_PROBLEMS`), or
    None. Under context parallelism (``cp > 1``) ``shift_labels`` stands for ``labels`` and
    ``position_ids`` are required. Local, host values only (shapes)."""
    if cp > 1:
        if labels is not None or attention_mask is not None:
            return (6, f"under context parallelism (cp = {cp}) labels= and attention_mask= are not taken: pass "
                       f"shift_labels= and position_ids= from tpify.context_parallel.split_batch(batch, mesh) (the "
                       f"labels shifted over the whole sequence before the split)")
        x = input_ids if input_ids is not None else shift_labels
        rows = None if position_ids is None else position_ids.shape[0]
        if position_ids is None or position_ids.dim() != 2 or rows % m and rows != 1 or x is not None and (
                position_ids.shape[-1] != x.shape[-1] or rows not in (1, x.shape[0])):
            got = None if position_ids is None else tuple(position_ids.shape)
            return (6, f"under context parallelism (cp = {cp}) every stage needs position_ids (B, T / cp) or "
                       f"(1, T / cp) of this rank's tokens, from tpify.context_parallel.split_batch(batch, mesh): got {got}"
                       + ("" if x is None else f" for a batch of {tuple(x.shape)}"))
        labels, position_ids = shift_labels, None
    elif shift_labels is not None:
        return (6, "shift_labels= is taken under context parallelism only: pass labels= (shifted here as HF does)")
    if has_first != (input_ids is not None):
        return ((1, "input_ids are given on a rank that holds no first stage: pass them on the first stage only")
                if input_ids is not None else (2, "the first stage needs input_ids"))
    if has_last != (labels is not None):
        return ((3, "labels are given on a rank that holds no last stage: pass them on the last stage only")
                if labels is not None else (4, "the last stage needs labels"))
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if t is not None and (t.dim() != 2 or t.shape[0] % m):
            return (5, f"{name} of shape {tuple(t.shape)}: a (B, T) batch whose B is a multiple of n_microbatches = "
                       f"{m} (each microbatch gets B / {m} rows)")
    if attention_mask is not None or position_ids is not None:
        return (6, "attention_mask / position_ids are not taken: the stages compute the plain causal mask and "
                   "positions 0 .. T-1 as the dense forward does without them; padding masks and packed sequences "
                   "are not built. Pad on the right with labels -100 (causal attention never reads later tokens, and "
                   "ignored targets are not counted)")
    if input_ids is not None and labels is not None and input_ids.shape != labels.shape:
        return (7, f"input_ids of shape {tuple(input_ids.shape)} and labels of shape {tuple(labels.shape)}: pass the "
                   f"same (B, T) batch")
    return None


def _host_group(ranks: list[int]):
    """A group of ``ranks`` (the pipeline's) whose backend takes CPU tensors: the world itself when
    it is the world and its backend does (gloo, ``cpu:gloo,cuda:nccl``), else a gloo group of the
    same ranks made here (``use_local_synchronization=True``: only those ranks take part)."""
    if sorted(ranks) == list(range(dist.get_world_size())) and "cpu" in comm.backend_map(None):
        return None
    return dist.new_group(sorted(ranks), backend="gloo", use_local_synchronization=True)


class StepCheck(comm.SharesProcessGroups):
    """The checks :func:`step` makes before the schedule's first send/recv, with no host sync and no
    store traffic in a steady state (what :class:`tpify.hooks.guards.BatchCheck` does for a plain
    parallelized model's call); one per schedule (``schedule.tpify_step_check``).

    One all-reduce (max) on the host, over the pipeline's ranks (every rank of the mesh: pp x dp x
    tp; a gloo group, :func:`_host_group`), of ``7 + 2 G`` int64 values (``G``: the number of TP
    groups when tp > 1, else 0):

    * ``(n - i) * 8 + code`` on a rank (``i``-th of the ``n``) whose local check failed, else 0:
      the max names the first failing rank and its problem (:data:`_PROBLEMS`); ``i + 1`` or 0:
      the last failing rank; ``n - i`` or 0: the first rank whose previous step's data checks failed
      (the loss's targets in range and equal on the TP ranks, :class:`PipelineLoss`; at tp > 1 the
      vocab-parallel embedding's ids in range, for the microbatches :meth:`begin` marked): recorded
      on the device, copied without blocking (:meth:`end`), raised at the next step on every rank
      (there the error recorded, elsewhere :class:`StepInputsError` naming the rank);
    * ``B, -B, T, -T`` of the rank's ``input_ids`` / ``labels`` (:data:`_NONE` where it holds none):
      all equal exactly when ``max B == -max(-B)``, so the first and last stage (and the dp
      replicas) are known to hold batches of one shape;
    * for TP group ``g``, at its two slots, the previous step's :func:`tpify.comm.inputs_checksum`
      of its ranks' inputs and its negation (the others :data:`_NONE`): computed on the device in
      that step and copied to the host without blocking (:class:`tpify.comm.HostCopy`), read here.
      So ranks of a TP group given different batches raise at the NEXT step (that step trained on
      the mix: no crash, no collective of another size); different shapes raise at once.

    The first call also runs :func:`tpify.agree.agree` once (the store: every rank is in ``step``,
    devices placed apart), never again.
    """

    def __init__(self, info: PipelineInfo):
        mesh = info.mesh
        grid = mesh.mesh
        self.ranks = [int(r) for r in grid.flatten().tolist()]
        self.index = self.ranks.index(dist.get_rank())
        tp = comm.group_size(info.tp_group)
        self.tp_groups: list[list[int]] = []
        self.slot = None
        if tp > 1:
            tp_dim = mesh.mesh_dim_names.index("tp")
            rows = grid.movedim(tp_dim, -1).reshape(-1, grid.shape[tp_dim])  # one row per TP group
            self.tp_groups = [[int(r) for r in row] for row in rows.tolist()]
            mine = sorted(dist.get_process_group_ranks(info.tp_group))
            self.slot = next((g for g, row in enumerate(self.tp_groups) if sorted(row) == mine), None)
            if self.slot is None:
                raise PipelineError(f"the model's TP group {mine} is not a row of the mesh's 'tp' axis "
                                    f"({self.tp_groups}): parallelize the model with mesh= the pipeline's mesh")
        self.host_group = _host_group(self.ranks) if len(self.ranks) > 1 else None
        #: the context-parallel group and size (None, 1 without), read once: slicing the mesh at each step
        #: would run host ops (the submesh's coordinates)
        self.cp_group, self.cp, _ = cp_of(mesh)
        #: the loss's data checks (:class:`PipelineLoss`), and the stage models' call states (tp > 1 or cp > 1),
        #: whose checks the vocab-parallel embedding records for the microbatches :meth:`begin` marks as
        #: compared (and the context-parallel hooks, positions that restart inside a sequence)
        self.checks = comm.DeferredChecks()
        self.states = list({id(st): st for st in (getattr(tp_info_of(s.model), "state", None) for s in info.stages)
                            if st is not None and (tp > 1 or self.cp > 1)}.values())
        self.marked: list = []  # this step's microbatches of input_ids (begin), held for the embedding's record
        self.agreed = False
        self.pending = None  # (HostCopy of the previous step's checksum, its layout): read at the next step

    def check(self, what: str, problem: tuple[int, str] | None, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise, on every rank alike and before any collective of the step, what the previous
        step's checksums and this step's local checks (``problem``) and shapes (``named``) found;
        then keep this step's checksum for the next. One host all-reduce (none on one rank).

        Raises:
            PipelineError: the previous step's TP ranks held different values; this rank's
                ``problem`` (its message); input shapes that differ between ranks.
            StepInputsError: another rank's ``problem``, naming it.
        """
        if not self.agreed:
            agree(what, {"ranks": self.ranks}, group=self.host_group)  # once: every rank is in step(); never again
            self.agreed = True
        previous, self.pending = self.pending, None
        failed = []  # the previous step's data checks (the loss's, the embedding's), copied to the host then
        for checks in [self.checks] + [st.checks for st in self.states]:
            failed += checks.collect()[1]
        n = len(self.ranks)
        values = [(n - self.index) * _CODES + problem[0] if problem else 0, self.index + 1 if problem else 0,
                  n - self.index if failed else 0]
        shape = named[0][1].shape if named and problem is None else None
        values += [_NONE] * 4 if shape is None else [shape[0], -shape[0], shape[1], -shape[1]]
        slots = [_NONE] * (2 * len(self.tp_groups))
        if previous is not None:
            value = previous[0].values()[0]  # the copy queued one step ago: no wait on the device's queue
            slots[2 * self.slot], slots[2 * self.slot + 1] = value, -value
        got = values + slots
        if n > 1:
            got = comm.all_reduce(torch.tensor(got, dtype=torch.int64), self.host_group, op="max").numpy().tolist()
        differing = [self.tp_groups[g] for g in range(len(self.tp_groups))
                     if got[7 + 2 * g] != _NONE and got[7 + 2 * g] != -got[8 + 2 * g]]
        if differing:  # the previous step's, raised first: it happened first
            raise PipelineError(
                f"{what}: the ranks of tensor-parallel group(s) {differing} were given different input_ids or labels "
                f"at the previous step; every rank of a TP group must get the same batch (the same sampler seed, or "
                f"a broadcast from its first rank). Found one step late: the inputs' checksum is computed on the "
                f"device and read at the next step, so as not to stop the host; that step trained on the mix")
        if got[2]:  # the previous step's data checks
            if failed:
                raise failed[0]
            raise StepInputsError(f"{what}: the previous step's data checks failed on rank {self.ranks[n - got[2]]} "
                                  f"(ids or targets out of range, or targets that differ on its TP ranks: its own "
                                  f"error there); this rank stops here too " + comm.FOUND_LATE)
        if got[0]:
            first, code = n - got[0] // _CODES, got[0] % _CODES
            if problem is not None:
                raise PipelineError(f"{what}: {problem[1]}")
            last = got[1] - 1
            where = f"rank {self.ranks[first]}" + (f" (and others up to rank {self.ranks[last]})" if last != first
                                                     else "")
            raise StepInputsError(f"{what} failed on {where}: {_PROBLEMS[code]}; this rank stops here too instead "
                                  f"of waiting for it")
        if got[3] != _NONE and (got[3] != -got[4] or got[5] != -got[6]):
            mine = tuple(shape) if shape is not None else "none on this rank"
            raise PipelineError(f"{what}: input_ids and labels of different shapes on the first and last stage (or "
                                f"the data-parallel replicas): B from {-got[4]} to {got[3]}, T from {-got[6]} to "
                                f"{got[5]} (this rank: {mine}); pass the same (B, T) batch")
        if self.tp_groups and named:
            layout = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named)
            self.pending = (comm.HostCopy([comm.inputs_checksum(named)], torch.int64), layout)

    def begin(self, input_ids: torch.Tensor | None, m: int) -> None:
        """Mark the microbatches of ``input_ids`` (torch's split: ``tensor_split`` along dim 0, the
        same views the schedule makes) as compared across the TP group (:meth:`check`, one step
        late), so the vocab-parallel embedding records its bounds check for the next step instead
        of comparing them itself with a host sync (:class:`tpify.comm.CheckedInputs`)."""
        if input_ids is not None:
            chunks = [(f"microbatch {i}", c) for i, c in enumerate(torch.tensor_split(input_ids, m, 0))]
            self.marked = chunks  # held until end(): the record keeps weak references
            for st in self.states:
                st.checked.remember(chunks)

    def end(self) -> None:
        """The step ended (also when it raised): the microbatches forgotten, the step's data checks
        copied to the host without blocking, read at the next :meth:`check`."""
        self.marked = []
        for st in self.states:
            st.checked.forget()
            st.checks.submit()
        self.checks.submit()


def step(schedule, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
         shift_labels: torch.Tensor | None = None) -> torch.Tensor | None:
    """One forward and backward of the whole batch through the pipeline; the loss on the rank
    holding the last stage (None elsewhere). The gradients accumulate in the stages' parameters.

    The labels are shifted as HF's causal LMs shift them (``labels[:, 1:]``, ``-100`` last) before
    the batch is cut into microbatches; the non-ignored targets of the whole batch are counted once
    (a tensor: no host sync), each microbatch's loss is its sum over that count. After the schedule,
    a tied embedding's gradient is summed between the first and last stage (both then hold the
    dense gradient; their updates stay equal; under FSDP2 each rank sums its dim-0 shard of them,
    the two copies being split alike over ``dp_shard``). With data-parallel replicas (the mesh's
    dp axes) each gives its own batch: the count is the global batch's (summed over dp), the
    gradients are summed over dp by torch's engine on the stages (FSDP2's reduce-scatter or
    ``replicate``'s all-reduce, run by the schedule after the last microbatch's backward:
    :mod:`tpify.pipeline.data_parallel`), and the loss returned is the global batch's mean.
    Plain causal attention only: padding masks and packed sequences are not taken (no
    ``attention_mask``).

    ``attention_mask`` / ``position_ids``: refused when given (not built; pad on the right).

    Context parallelism (the mesh's ``"cp"`` axis, the model parallelized over it): every rank
    passes its part of :func:`tpify.context_parallel.split_batch` ``(batch, mesh)``: ``input_ids``
    on the first stage, ``shift_labels`` (shifted over the whole sequence before the split) on the
    last instead of ``labels``, and ``position_ids`` on every stage (cut into microbatches by torch's
    schedule, which passes them to every stage's forward: its attention over the CP group). The
    count is the whole batch's over the CP group too, the gradients are summed over it by the
    model's hooks, and the loss returned is the whole batch's mean on every CP rank of the last stage.

    Shapes: ``input_ids`` ``(B, T)`` int64 on the first stage's ranks only, ``labels`` ``(B, T)``
    on the last stage's only (``B`` a multiple of the microbatch count). Returns a scalar.
    Host syncs: none (the inputs' checks are host values and one host all-reduce; the TP ranks'
    checksum is read one step later, :class:`StepCheck`).
    Communication: before any other, one all-reduce (max) of ``7 + 2 G`` int64 values on the host
    over the pipeline's ranks (:class:`StepCheck`; ``G`` TP groups at tp > 1); the first call
    only, one agreement through the store; torch's send/recv between stages; the TP layers'
    collectives; one all-reduce of the tied weight's gradient (this rank's shard under FSDP2) over
    the embedding group; over the dp replicas (when more than one): the count and the loss (one
    value each); the engine's (FSDP2's all-gathers and reduce-scatters, or ``replicate``'s
    all-reduce).

    Raises:
        PipelineError: on every rank before the schedule's first send/recv: on the rank where it is
            wrong, inputs on a stage that takes none, a missing input, a batch the microbatches do
            not divide, an ``attention_mask`` or ``position_ids``; on every rank, ``input_ids`` and
            ``labels`` of different shapes (first and last stage, or dp replicas), and, one step
            late (at the next call), ranks of one TP group given different batches.
        StepInputsError: (a PipelineError and an AgreementError) on the other ranks, naming the
            rank whose inputs were wrong and the problem.
    """
    info: PipelineInfo = schedule.tpify_pipeline
    m = schedule._n_microbatches
    has_first = any(s.is_first for s in info.stages)
    has_last = any(s.is_last for s in info.stages)
    check = getattr(schedule, "tpify_step_check", None)
    if check is None:  # a schedule of tpify's made by hand from build_schedule's parts
        check = schedule.tpify_step_check = StepCheck(info)
    cp = check.cp
    problem = _batch_problem(has_first, has_last, input_ids, labels, attention_mask, position_ids, m, cp,
                             shift_labels)
    if cp > 1:
        labels = shift_labels
    named = [(n, t) for n, t in (("input_ids", input_ids), ("labels", labels)) if t is not None]
    check.check("tpify.pipeline.step", problem, named)
    if cp > 1 and position_ids.shape[0] == 1:  # split_batch's (1, T / cp): the same positions for every microbatch
        position_ids = position_ids.expand(m, -1)
    target, loss_kwargs, losses = None, None, None
    if has_last:
        # HF's shift, before the microbatches (under cp split_batch shifted before the split)
        target = labels if cp > 1 else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        count = (target != IGNORE_INDEX).sum()
        comm.all_reduce(count, info.dp_group)  # the global batch's count: over the data-parallel replicas
        if cp > 1:
            comm.all_reduce(count, check.cp_group)  # and over the CP group (each rank holds T / cp tokens)
        loss_kwargs = {"num_items": count}
        losses = []
    args = (input_ids,) if has_first else ()
    check.begin(input_ids, m)
    try:
        schedule.step(*args, target=target, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs,
                      **({"position_ids": position_ids} if cp > 1 else {}))
    finally:
        check.end()
    if info.embedding_group is not None:
        for p in info.tied_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            # FSDP2: the first and last stage's copies have one shape, so one dim-0 split over dp_shard
            # (the embedding group pairs ranks of the same dp and tp coordinates): their local shards match
            comm.all_reduce(p.grad.to_local() if is_dtensor(p.grad) else p.grad, info.embedding_group)
    if not has_last:
        return None
    loss = torch.stack(losses).sum().detach()
    if cp > 1:
        comm.all_reduce(loss, check.cp_group)  # each CP rank's share of the whole batch's mean
    return comm.all_reduce(loss, info.dp_group)  # the global batch's mean loss on every replica
