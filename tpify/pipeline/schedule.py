"""torch's pipeline schedules over tpify's stages, the last stage's loss, and one training step.

:func:`build_schedule` returns torch's schedule object (``torch.distributed.pipelining``:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) whose loss is
:class:`PipelineLoss`; :func:`step` shifts the labels as HF does, counts the non-ignored targets of
the whole batch once, runs the schedule and sums the tied embedding's gradient between the first
and last stage, so that the loss and every gradient equal the dense model's mean loss over the
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from .. import comm
from ..agree import agree
from ..comm.inputs import inputs_checksum
from ..loss import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from ..sharding import is_dtensor
from .data_parallel import check_data_parallel
from .plan import PipelineError
from .split import PipelineInfo

__all__ = ["SCHEDULES", "REFUSED_SCHEDULES", "PipelineLoss", "build_schedule", "check_microbatches", "step",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100

#: The schedules tpify builds: name -> (torch class, several stages per rank).
SCHEDULES = {"GPipe": (ScheduleGPipe, False), "1F1B": (Schedule1F1B, False),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, True)}
#: torch's other schedules, refused with the reason.
_SPLIT_BACKWARD = ("its backward is split into input and weight gradients (stage_backward_input / _weight), which "
                   "tpify's tensor-parallel layers and the tied-embedding sum are not verified against")
REFUSED_SCHEDULES = {
    "InterleavedZeroBubble": _SPLIT_BACKWARD + "; use GPipe, 1F1B or Interleaved1F1B",
    "ZBVZeroBubble": _SPLIT_BACKWARD + " (and its V placement of the stages is not built); use GPipe, 1F1B or "
                                       "Interleaved1F1B",
    "DualPipeV": _SPLIT_BACKWARD + " (and its V placement of the stages is not built); use GPipe, 1F1B or "
                                   "Interleaved1F1B",
    "LoopedBFS": "not verified against the dense model yet; use Interleaved1F1B (the same placement of the stages)",
}


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

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
        if self.chunk is not None:  # ``logits`` is the head's input (B, T, H): the logits are never held
            weight = self.head.weight
            if getattr(self.head, "weight_layout", "linear") != "linear":
                weight = weight.t()
            total = vocab_parallel_linear_cross_entropy(
                logits, weight, target, bias=getattr(self.head, "bias", None), ignore_index=IGNORE_INDEX,
                reduction="sum", tp_group=self.tp_group, vocab_size=self.vocab_size,
                chunk_size=None if self.chunk == "auto" else self.chunk)
            return total / num_items.to(total.dtype)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if comm.group_size(self.tp_group) == 1:
            total = F.cross_entropy(logits.flatten(0, -2)[:, :self.vocab_size], target.flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        else:
            total = vocab_parallel_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum",
                                                 tp_group=self.tp_group, vocab_size=self.vocab_size)
        return total / num_items.to(total.dtype)


def check_microbatches(schedule: str, n_microbatches, pp_size: int, num_stages: int, local_stages: int) -> None:
    """Whether ``schedule`` can take ``n_microbatches`` on this layout (torch's own conditions,
    checked before anything is built). Pure.

    Raises:
        PipelineError: an unknown or refused schedule, a count that is not a positive integer,
            fewer microbatches than stages (1F1B), a count that is not a multiple of the rounds
            (interleaved), several stages per rank for a one-stage schedule.
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
    if schedule == "1F1B" and n_microbatches < num_stages:
        raise PipelineError(f"1F1B needs at least as many microbatches as stages: n_microbatches = {n_microbatches}, "
                            f"{num_stages} stages; use n_microbatches >= {num_stages}")
    if multi:
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

    Communication: one agreement (the store) on the schedule and the microbatch count; torch's
    send/recv over the pipeline group when the schedule first runs.

    Raises:
        PipelineError: on every rank, as :func:`check_microbatches`; a bad ``lm_loss_chunk``; dp > 1
            without FSDP2 or ``replicate`` on the stages (naming the two functions).
        AgreementError: another rank failed, or the ranks passed other arguments.
    """
    error = None
    try:
        check_data_parallel(info.mesh, info.data_parallel)
        check_microbatches(schedule, n_microbatches, info.mesh["pp"].size(), info.num_stages, len(info.stages))
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
    return out


def _batch_problem(info: PipelineInfo, has_first: bool, has_last: bool, input_ids, labels, m: int) -> str | None:
    """What is wrong with this rank's part of the batch, or None. Local."""
    if has_first != (input_ids is not None):
        return ("input_ids are given on a rank that holds no first stage: pass them on the first stage only"
                if input_ids is not None else "the first stage needs input_ids")
    if has_last != (labels is not None):
        return ("labels are given on a rank that holds no last stage: pass them on the last stage only"
                if labels is not None else "the last stage needs labels")
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if t is not None and (t.dim() != 2 or t.shape[0] % m):
            return (f"{name} of shape {tuple(t.shape)}: a (B, T) batch whose B is a multiple of n_microbatches = {m}"
                    f" (each microbatch gets B / {m} rows)")
    return None


def step(schedule, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
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

    Shapes: ``input_ids`` ``(B, T)`` int64 on the first stage's ranks only, ``labels`` ``(B, T)``
    on the last stage's only (``B`` a multiple of the microbatch count). Returns a scalar.
    Communication: one agreement (the store: no collective) on the inputs; torch's send/recv
    between stages; the TP layers' collectives; one all-reduce of the tied weight's gradient (this
    rank's shard under FSDP2) over the embedding group; over the dp replicas (when more than one):
    the count and the loss (one value each); the engine's (FSDP2's all-gathers and reduce-scatters,
    or ``replicate``'s all-reduce).

    Raises:
        PipelineError: on every rank before any collective: inputs on a stage that takes none, a
            missing input, a batch the microbatches do not divide, ``input_ids`` and ``labels``
            of different sizes, an ``attention_mask`` or ``position_ids``, ranks of one TP group given different batches (their checksum, one
            host sync, shared in the agreement, as tpify's guard checks a plain model's call).
    """
    info: PipelineInfo = schedule.tpify_pipeline
    m = schedule._n_microbatches
    has_first = any(s.is_first for s in info.stages)
    has_last = any(s.is_last for s in info.stages)
    problem = _batch_problem(info, has_first, has_last, input_ids, labels, m)
    if attention_mask is not None or position_ids is not None:
        problem = ("attention_mask / position_ids are not taken: the stages compute the plain causal mask and "
                   "positions 0 .. T-1 as the dense forward does without them; padding masks and packed sequences "
                   "are not built. Pad on the right with labels -100 (causal attention never reads later tokens, "
                   "and ignored targets are not counted)")
    error = PipelineError(f"tpify.pipeline.step: {problem}") if problem else None
    named = [(n, t) for n, t in (("input_ids", input_ids), ("labels", labels)) if t is not None]
    # what the TP guard checks on a plain model's call: the ranks of a TP group hold one batch (one host sync)
    checksum = int(inputs_checksum(named)) if named and error is None else None
    tp_ranks = tuple(dist.get_process_group_ranks(info.tp_group)) if comm.group_size(info.tp_group) > 1 else ()
    shared = agree("tpify.pipeline.step", {"n_microbatches": m}, error,
                   share=(tuple(tuple(t.shape) for _, t in named), checksum, tp_ranks))
    seen = {s for shapes, _, _ in (shared or []) for s in shapes}
    if len(seen) > 1:
        raise PipelineError(f"tpify.pipeline.step: input_ids and labels of different shapes on the first and last "
                            f"stage: {sorted(seen)}; pass the same (B, T) batch")
    by_group: dict[tuple, set] = {}
    for _, value, ranks in shared or []:
        if ranks:
            by_group.setdefault(ranks, set()).add(value)
    differing = sorted(ranks for ranks, values in by_group.items() if len(values) > 1)
    if differing:
        raise PipelineError(f"tpify.pipeline.step: the ranks of tensor-parallel group(s) {differing} were given "
                            f"different input_ids or labels; every rank of a TP group must get the same batch (the "
                            f"same sampler seed, or a broadcast from its first rank)")
    target, loss_kwargs, losses = None, None, None
    if has_last:
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # HF's shift, before the microbatches
        count = (target != IGNORE_INDEX).sum()
        comm.all_reduce(count, info.dp_group)  # the global batch's count: over the data-parallel replicas
        loss_kwargs = {"num_items": count}
        losses = []
    args = (input_ids,) if has_first else ()
    schedule.step(*args, target=target, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs)
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
    return comm.all_reduce(loss, info.dp_group)  # the global batch's mean loss on every replica
