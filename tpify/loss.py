"""Vocab-parallel losses and per-token statistics: from logits (or hidden states) split over the vocabulary.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, "output embedding"): the LM head's
logits stay split over the vocabulary, shape ``(B, T, V/p)`` per rank, and the softmax and what
is computed from it come from the shards with two all-reduces of ``B*T``-sized vectors instead of
gathering ``B*T*V`` logits on every rank. The hook that makes ``model(input_ids,
labels=labels).loss`` of a parallelized model use it is :mod:`tpify.hooks.lm_loss`.

Every function is built from the same named steps, each written once (as Megatron's
``cross_entropy.py`` is cut into static steps shared by its fused and unfused paths):

| step                    | what                                                            | collective          |
| ----------------------- | --------------------------------------------------------------- | ------------------- |
| ``_columns``            | this rank's columns of the vocabulary, how many are real        | none                |
| ``_local_logits``       | the shard in the compute dtype, ``/ temperature``, padding -inf | none                |
| ``_agreed_max``         | the row maxima ``m``; the input checks ride on it               | one all-reduce, max |
| ``_target_logit``       | ``z[target] - m`` on the rank owning the target, 0 elsewhere    | none                |
| ``_exp_sum_``           | ``exp(z - m)`` in place, and its row sums                       | none                |
| ``_summed``             | sums over the group                                             | one all-reduce, sum |
| ``_softmax_statistics`` | the four above for one block of rows                            | the two above       |
| ``_cross_entropy``, ``_cross_entropy_grad_`` | the loss and its gradient from the statistics | none        |

The public functions: :func:`vocab_parallel_cross_entropy`, :func:`vocab_parallel_log_probs`,
:func:`vocab_parallel_entropy`, :func:`vocab_parallel_kl`, :func:`vocab_parallel_is_top1` (from a
logits shard) and :func:`vocab_parallel_linear_cross_entropy` (from the hidden states and the
head's weight shard, over token chunks, never holding the logits).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import comm
from .layers import _autocast_inputs, matmul_dtype

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_log_probs", "vocab_parallel_entropy", "vocab_parallel_kl",
           "vocab_parallel_is_top1", "vocab_parallel_linear_cross_entropy", "default_chunk_size", "mean_or_nan",
           "LOGIT_OPS", "MIN_CHUNK"]

_REDUCTIONS = ("none", "sum", "mean")
#: What a model may do to its LM head's output before the softmax, in the order it does it:
#: ``("multiply", s)``: ``z * s``; ``("divide", d)``: ``z / d``; ``("softcap", c)``:
#: ``c * tanh(z / c)`` (Gemma 2's ``final_logit_softcapping``).
LOGIT_OPS = ("multiply", "divide", "softcap")
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# The named steps.

class _Columns(NamedTuple):
    """This rank's columns of the padded vocabulary, ``[start, start + width)``; the first
    ``real`` of them are below the true vocabulary ``vocab`` (the padding is the vocabulary's tail)."""

    start: int
    width: int
    real: int
    vocab: int


def _columns(width: int, group: dist.ProcessGroup | None, vocab_size: int | None) -> _Columns:
    """Step 0: which columns this rank holds (rank ``r``: ``[r*width, (r+1)*width)``)."""
    start = comm.group_rank(group) * width
    vocab = width * comm.group_size(group) if vocab_size is None else vocab_size
    return _Columns(start, width, max(0, min(width, vocab - start)), vocab)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Where the softmax is computed: float32 for half-precision inputs, float64 for float64."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def _local_logits(logits: torch.Tensor, cols: _Columns, inv_temperature: float = 1.0) -> tuple[torch.Tensor, bool]:
    """Step 0: the shard in the compute dtype, times ``1/temperature``, its padded columns -inf.

    Returns ``(z, own)``: ``own`` says ``z`` is a new buffer the caller may overwrite (a cast,
    scaled or masked copy), not the caller's logits."""
    dtype = _compute_dtype(logits.dtype)
    own = dtype != logits.dtype
    z = logits.to(dtype)
    if inv_temperature != 1.0:
        z = z.mul_(inv_temperature) if own else z * inv_temperature
        own = True
    if cols.real < cols.width:  # padded columns (global index >= V) never count
        if not own:
            z, own = z.clone(), True
        z[..., cols.real:] = _NEG_INF
    return z, own


class _InputChecks:
    """What every rank of the group must hold alike, checked on values that ride on the first
    all-reduce (max) at no extra collective: shards of the same width (max and -min) and, with
    targets, no target outside ``[0, V)`` on any rank and the same targets (max and -min of a
    checksum). A rank alone with bad or different targets would otherwise raise alone, or train
    on a mismatched batch; shards of different widths would place the vocabulary wrongly."""

    def __init__(self, what: str, cols: _Columns, target: torch.Tensor | None = None,
                 bad_targets: torch.Tensor | None = None, ignore_index: int | None = None, defer=None):
        self.what, self.cols, self.target, self.bad, self.ignore_index = what, cols, target, bad_targets, ignore_index
        self.defer = defer  # a model call's comm.DeferredChecks: raised at its next call, no host sync

    def values(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The values to all-reduce (max): 2, or 5 with targets."""
        width = torch.full((), float(self.cols.width), dtype=dtype, device=device)  # a fill: no copy from the host
        values = [width, -width]
        if self.target is not None:
            checksum = comm.checksum(self.target).to(dtype)  # < 2**24: exact in float32
            values += [self.bad.to(dtype), checksum, -checksum]
        return torch.stack(values)

    def raise_if_failed(self, got: torch.Tensor) -> None:
        """Raise, on every rank alike, what the all-reduced values say (with ``defer``: at the
        model's next call)."""
        comm.raise_unless(got[0] == -got[1], ValueError,
                          f"{self.what}: the ranks of the TP group hold logits shards of different widths (this "
                          f"rank: {self.cols.width} columns); every rank must hold V_padded / tp_size columns of the "
                          f"same padded vocabulary", defer=self.defer)
        if self.target is None:
            return
        comm.raise_unless(got[2] <= 0, ValueError,
                          f"{self.what}: a rank of the TP group holds targets outside [0, {self.cols.vocab}) that are "
                          f"not ignore_index = {self.ignore_index}; fix the labels or set ignore_index",
                          detail=((self.bad,), lambda bad: "this rank holds them" if bad else "another rank holds them"),
                          defer=self.defer)
        comm.raise_unless(got[3] == -got[4], ValueError,
                          f"{self.what}: the ranks of the TP group hold different targets; every rank of a TP group "
                          f"must see the same batch (split data over DP replicas only)", defer=self.defer)


def _agreed_max(maxes: list[torch.Tensor], group: dist.ProcessGroup | None,
                checks: _InputChecks | None = None) -> list[torch.Tensor]:
    """Step 1: the maximum over the group of each tensor of ``maxes`` (row maxima ``(N...)``, one
    dtype), in one all-reduce (max) that also carries ``checks`` (raised on every rank alike).
    No gradient flows through a maximum subtracted from logits: it cancels in the softmax."""
    if comm.group_size(group) == 1:  # the arguments were checked before (one rank: nothing to agree on)
        return maxes
    parts = [m.reshape(-1) for m in maxes]
    if checks is not None:
        parts.append(checks.values(maxes[0].dtype, maxes[0].device))
    packed = torch.cat(parts)
    comm.all_reduce(packed, group, op="max")
    if checks is not None:
        checks.raise_if_failed(packed[packed.numel() - parts[-1].numel():])
    out, at = [], 0
    for m in maxes:
        out.append(packed[at:at + m.numel()].view_as(m))
        at += m.numel()
    return out


def _local_targets(target: torch.Tensor, cols: _Columns, ignore_index: int):
    """``(ignored, owned, local)``: targets equal to ``ignore_index``; targets in this rank's
    columns; their index in the shard (0 where not owned)."""
    ignored = target == ignore_index
    owned = (target >= cols.start) & (target < cols.start + cols.width) & ~ignored
    local = (target - cols.start).masked_fill(~owned, 0)
    return ignored, owned, local


def _target_logit(z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Step 2: ``z[target] - m`` on the rank that owns the target, 0 elsewhere (summed over the
    ranks in step 4, which makes it the target logit on every rank)."""
    return (z.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m).masked_fill(~owned, 0.0)


def _exp_sum_(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: ``exp(z - m)`` in place of ``z - m`` (one buffer: every new buffer of that size
    costs a pass over memory and, on a CPU, its page faults), and its row sums. ``exp(-inf) = 0``
    on padded columns."""
    exp_z = shifted.exp_()
    return exp_z, exp_z.sum(dim=-1)


def _summed(values: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Step 4: the sums over the group of several ``(N...)`` tensors, in one all-reduce."""
    packed = torch.stack(values)
    comm.all_reduce(packed, group)
    return packed.unbind(0)


class _Stats(NamedTuple):
    """The softmax statistics of a block of rows: ``m`` (row max), ``exp_z = exp(z - m)`` (this
    rank's columns), ``sum_exp = S``, ``z_t = z[target] - m``, and with label smoothing ``sum_z =
    sum_{v < V} (z_v - m)``, each summed over the group."""

    m: torch.Tensor
    exp_z: torch.Tensor
    sum_exp: torch.Tensor
    z_t: torch.Tensor
    sum_z: torch.Tensor | None


def _softmax_statistics(z: torch.Tensor, own: bool, cols: _Columns, local: torch.Tensor, owned: torch.Tensor,
                        smoothing: bool, group: dist.ProcessGroup | None,
                        checks: _InputChecks | None) -> _Stats:
    """Steps 1-4 for one block of rows ``z (N..., V/p)``: two all-reduces, the max (with
    ``checks``) of ``N`` values and the sums of ``2N`` (``3N`` with ``smoothing``). ``z`` is
    overwritten when ``own``."""
    (m,) = _agreed_max([z.amax(dim=-1)], group, checks)
    z_t = _target_logit(z, local, owned, m)
    shifted = z.sub_(m.unsqueeze(-1)) if own else z - m.unsqueeze(-1)
    sums = [z_t]
    if smoothing:
        sums.append(shifted[..., :cols.real].sum(dim=-1))
    exp_z, sum_exp = _exp_sum_(shifted)
    sums.append(sum_exp)
    sums = _summed(sums, group)
    return _Stats(m, exp_z, sums[-1], sums[0], sums[1] if smoothing else None)


def _cross_entropy(stats: _Stats, eps: float, cols: _Columns, ignored: torch.Tensor) -> torch.Tensor:
    """``log S - z_t``; with label smoothing ``eps``: ``(1-eps)(log S - z_t) + eps(log S - mean_{v<V} z_v)``
    (the mean over the true ``V``); 0 on ignored rows."""
    log_s = stats.sum_exp.log()
    loss = log_s - stats.z_t
    if eps > 0:
        loss = (1.0 - eps) * loss + eps * (log_s - stats.sum_z / cols.vocab)
    return loss.masked_fill(ignored, 0.0)


def _cross_entropy_grad_(exp_z: torch.Tensor, sum_exp: torch.Tensor, g: torch.Tensor, local: torch.Tensor,
                         owned: torch.Tensor, eps: float, cols: _Columns) -> torch.Tensor:
    """``dL/dz = (exp(z - m)/S - (1-eps) onehot_local(target) - eps/V) * g`` in place of ``exp_z``
    (``g``: the loss's gradient per row, 0 on ignored rows); padded columns get 0."""
    grad = exp_z.mul_((g / sum_exp).unsqueeze(-1))  # the 1/S and g scale the buffer in one pass
    grad.scatter_add_(-1, local.unsqueeze(-1), (owned.to(grad.dtype) * g * -(1.0 - eps)).unsqueeze(-1))
    if eps > 0:
        grad.sub_((g * (eps / cols.vocab)).unsqueeze(-1))
        if cols.real < cols.width:
            grad[..., cols.real:] = 0.0  # padded columns are not in the vocabulary
    return grad


# ---------------------------------------------------------------------------------------------
# Argument checks, before any collective.

def _check_vocab(what: str, width: int, group, vocab_size: int | None) -> int:
    """The true vocabulary ``V``; raises when ``vocab_size`` does not fit the shards."""
    tp_size = comm.group_size(group)
    padded_vocab = width * tp_size
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"{what}: vocab_size = {vocab_size} does not fit shards of {width} columns over {tp_size} "
                         f"ranks (padded vocabulary {padded_vocab}); pass the true vocabulary size, at most "
                         f"{padded_vocab}")
    return padded_vocab if vocab_size is None else vocab_size


def _check_target(what: str, leading: torch.Size, target: torch.Tensor, vocab: int, ignore_index: int,
                  group, input_name: str = "logits", defer=None) -> torch.Tensor:
    """Shapes and dtype of ``target``; returns the 0-dim bool "a target outside ``[0, V)`` that is
    not ``ignore_index``" (raised here with one rank, else carried by the first all-reduce; with
    ``defer``, a model call's :class:`~tpify.comm.DeferredChecks`, raised at its next call)."""
    if leading != target.shape:
        raise ValueError(f"{what}: {input_name} {tuple(leading)} + (...,) and target {tuple(target.shape)} disagree; "
                         f"{input_name} must be target.shape + (last dim,)")
    if target.is_floating_point():
        raise ValueError(f"{what}: target must hold integer class ids, got {target.dtype} (probability targets are "
                         f"not supported)")
    outside = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    bad_targets = outside.any()  # 0-dim bool; at tp > 1 it rides on the first all-reduce
    if comm.group_size(group) == 1:
        message = (f"{what}: targets outside [0, {vocab}) that are not ignore_index = {ignore_index}; fix the "
                   f"labels or set ignore_index")
        if defer is None or torch.compiler.is_compiling():
            comm.raise_unless(~bad_targets, ValueError, message, detail=lambda: f"targets {target[outside][:5].tolist()}")
        else:  # no boolean indexing (a host sync): the first bad target, read at the next call
            first = (target.reshape(-1).index_select(0, outside.reshape(-1).to(torch.uint8).argmax().reshape(1))
                     .reshape(()) if target.numel() else bad_targets)  # a tensor index: no host read
            comm.raise_unless(~bad_targets, ValueError, message, detail=((first,), lambda t: f"the first: {t}"),
                              defer=defer)
    return bad_targets


def _check_loss_args(what: str, reduction: str, label_smoothing: float) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{what}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{what}: label_smoothing must be in [0, 1], got {label_smoothing}")


def _inverse_temperature(what: str, temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"{what}: temperature must be positive, got {temperature}")
    return 1.0 / float(temperature)


def _reduce(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return mean_or_nan(loss.sum(), (target != ignore_index).sum())


def mean_or_nan(total: torch.Tensor, count) -> torch.Tensor:
    """``total / count``, NaN when ``count == 0`` (as ``F.cross_entropy``) but with a zero gradient;
    ``count`` a tensor (moved to ``total``'s device without blocking) or a Python number.

    ``0 / 0`` would also be NaN forward, but its gradient is NaN too, and one batch whose labels
    are all ignored (or a one-token causal sequence) would then poison the weights at the next
    optimizer step; HF's dense model gets zero gradients there.
    """
    if not isinstance(count, torch.Tensor):  # a Python number: no tensor copied from the host
        return total / count if count > 0 else total * 0.0 + float("nan")
    count = count.to(total.device, non_blocking=True)
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))


# ---------------------------------------------------------------------------------------------
# From a logits shard: cross-entropy and log-probabilities.

@torch.compiler.disable
def _outside_graph(function, *args):
    """``function.apply(*args)`` run eagerly under ``torch.compile``: a graph break around the
    vocab-parallel statistics. Inductor (torch 2.13, CPU) miscompiled the shard's target logit at
    tp > 1 (the loss of targets owned by other ranks than 0 came out wrong by up to 2.3 nats while
    eager was exact; tests/distributed/test_compile.py), so these autograd Functions stay out of
    compiled graphs until that is understood; the rest of the model compiles."""
    return function.apply(*args)



class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from a vocab shard; see :func:`vocab_parallel_cross_entropy`."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, group, vocab_size, bad_targets, inv_temperature,
                what, defer=None):
        cols = _columns(logits.shape[-1], group, vocab_size)
        z, own = _local_logits(logits, cols, inv_temperature)  # (N..., V/p)
        ignored, owned, local = _local_targets(target, cols, ignore_index)
        stats = _softmax_statistics(z, own, cols, local, owned, label_smoothing > 0, group,
                                    _InputChecks(what, cols, target, bad_targets, ignore_index, defer))
        loss = _cross_entropy(stats, label_smoothing, cols, ignored)
        ctx.save_for_backward(stats.exp_z, stats.sum_exp, local, owned, ignored)
        ctx.cols, ctx.eps, ctx.inv_temperature, ctx.logits_dtype = cols, label_smoothing, inv_temperature, logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        exp_z, sum_exp, local, owned, ignored = ctx.saved_tensors
        g = grad_loss.masked_fill(ignored, 0.0)  # (N...,)
        if ctx.inv_temperature != 1.0:  # z = logits / T
            g = g * ctx.inv_temperature
        # exp_z is reused in place: the Function is once-differentiable
        grad = _cross_entropy_grad_(exp_z, sum_exp, g, local, owned, ctx.eps, ctx.cols)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary, without gathering them.

    Equals ``F.cross_entropy(gathered_logits[..., :V], target, ...)`` (Megatron-LM,
    arXiv:1909.08053, section 3). Per token, from this rank's shard ``z`` (columns
    ``[r*V_padded/p, (r+1)*V_padded/p)`` of the global vocabulary)::

        m = allreduce_max(max_v z);  z -= m
        z_t, S = allreduce_sum(z[target] on the owning rank, else 0;  sum_v exp(z))
        loss = log S - z_t
        with label smoothing eps: (1 - eps)(log S - z_t) + eps(log S - mean_{v<V} z_v)

    Backward: ``dL/dz = (exp(z)/S - (1-eps) onehot_local(target) - eps/V) * grad_output``, no
    communication.

    Shapes:
        logits: ``(..., V_padded / tp_size)``, e.g. ``(B, T, V/p)``, this rank's vocab shard.
        target: ``(...)``, e.g. ``(B, T)``, global ids in ``[0, V)`` or ``ignore_index``; the same
        on every rank of the group.
        returns: ``(...)`` with ``reduction="none"``, else a scalar.
    Dtype: computed in float32 whatever the logits dtype (float64 stays float64); the loss is
        returned in that compute dtype and the gradient in the logits dtype.
    Communication:
        forward: 2 all-reduces: the max, ``numel(target)`` values (plus 5: the target and shard-width checks);
        then the target logit and the sum of exp, ``2 * numel(target)`` values (``3 *`` with
        ``label_smoothing > 0``: the sum of logits too). backward: none.

    Args:
        logits: this rank's shard of the logits.
        target: global target ids.
        ignore_index: targets equal to it give loss 0 and gradient 0 and are not counted by
            ``"mean"``.
        label_smoothing: ``eps`` in ``[0, 1]``, as in ``F.cross_entropy`` (uniform over the true V).
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (over the non-ignored tokens of this call;
            NaN when every token is ignored, like ``F.cross_entropy``, with a zero gradient).
        tp_group: the group that shares the vocabulary (``None``: the default group, or a single
            process when torch.distributed is not initialised).
        vocab_size: the true vocabulary ``V`` when the shards are padded (``V_padded > V``):
            columns ``>= V`` never contribute. Default ``V_padded`` (no padding).

    Under ``torch.compile`` it runs eagerly, one graph break (:func:`_outside_graph`: inductor
    miscompiled it at tp > 1); its checks raise ``ValueError`` on every rank as in eager mode.

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``/``vocab_size`` or shapes that do not
            match (before any collective); a target outside ``[0, V)`` that is not
            ``ignore_index`` on any rank, targets that differ between the ranks of the group, or
            shards of different widths: learnt by every rank from the first all-reduce (five
            values ride on it), so every
            rank raises, none waits. Under ``torch.compile`` these data checks raise
            ``RuntimeError`` with the same message (``torch._assert_async``).
    """
    return cross_entropy_deferred(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                  reduction=reduction, tp_group=tp_group, vocab_size=vocab_size, defer=None)


def cross_entropy_deferred(logits, target, *, ignore_index, label_smoothing, reduction, tp_group, vocab_size,
                           defer) -> torch.Tensor:
    """:func:`vocab_parallel_cross_entropy` whose data checks (targets in range, the same on
    every rank, shards of one width) are recorded in ``defer`` (a model call's
    :class:`~tpify.comm.DeferredChecks`, raised at its next call: no host sync) when it is not
    None and the code is not being compiled; what the model's ``labels=`` loss calls."""
    what = "vocab_parallel_cross_entropy"
    if torch.compiler.is_compiling():
        defer = None  # the guard that raises deferred checks does not run under torch.compile
    _check_loss_args(what, reduction, label_smoothing)
    vocab = _check_vocab(what, logits.shape[-1], tp_group, vocab_size)
    bad_targets = _check_target(what, logits.shape[:-1], target, vocab, ignore_index, tp_group, defer=defer)
    loss = _outside_graph(_VocabParallelCrossEntropy, logits, target, ignore_index, float(label_smoothing), tp_group,
                          vocab_size, bad_targets, 1.0, what, defer)
    return _reduce(loss, target, ignore_index, reduction)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``log p(target)`` per token from logits split over the vocabulary, without gathering them.

    Equals ``torch.gather(F.log_softmax(gathered[..., :V] / temperature, -1), -1, target[..., None])``
    (TRL's ``selective_log_softmax``): ``log p_t = z_t - m - log S`` with the statistics of
    :func:`vocab_parallel_cross_entropy` (it is minus its unreduced loss), on ``z = logits /
    temperature``. Backward: ``d log p_t / dz = onehot(target) - softmax(z)``, times
    ``1/temperature``; no communication.

    Shapes:
        logits: ``(..., V_padded / tp_size)``, e.g. ``(B, T, V/p)``, this rank's shard.
        target: ``(...)``, e.g. ``(B, T)``, global ids in ``[0, V)`` or ``ignore_index``, the same on
        every rank of the group.
        returns: ``(...)``: ``log p(target)``, 0 where ``target == ignore_index`` (zero gradient).
    Dtype: computed and returned in float32 (float64 for float64 logits); the temperature
        divides the logits in that dtype (TRL divides in the logits' dtype); the gradient is
        returned in the logits' dtype.
    Communication: forward 2 all-reduces, ``numel(target) + 5`` values (max) and
        ``2 * numel(target)`` (sums); backward none.

    Args:
        logits, target, tp_group, vocab_size: as :func:`vocab_parallel_cross_entropy`.
        temperature: the logits are divided by it (positive).
        ignore_index: targets equal to it give 0 and no gradient.

    Raises:
        ValueError: as :func:`vocab_parallel_cross_entropy` (arguments before any collective; bad
            or differing targets and shard widths on every rank from the first all-reduce);
            ``temperature <= 0``.
    """
    what = "vocab_parallel_log_probs"
    inv_t = _inverse_temperature(what, temperature)
    vocab = _check_vocab(what, logits.shape[-1], tp_group, vocab_size)
    bad_targets = _check_target(what, logits.shape[:-1], target, vocab, ignore_index, tp_group)
    return -_outside_graph(_VocabParallelCrossEntropy, logits, target, ignore_index, 0.0, tp_group, vocab_size,
                           bad_targets, inv_t, what, None)


# ---------------------------------------------------------------------------------------------
# From a logits shard: entropy, KL divergence, top-1.

def _shifted(z: torch.Tensor, m: torch.Tensor, own: bool) -> torch.Tensor:
    """``z - m`` (in place when ``own``)."""
    return z.sub_(m.unsqueeze(-1)) if own else z - m.unsqueeze(-1)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_v a_v b_v`` per row, ``(N..., V/p) x2 -> (N...)``, as a batched matmul (no ``(N, V/p)``
    temporary)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


class _VocabParallelEntropy(torch.autograd.Function):
    """Per-token entropy from a vocab shard; see :func:`vocab_parallel_entropy`."""

    @staticmethod
    def forward(ctx, logits, group, vocab_size, inv_temperature):
        what = "vocab_parallel_entropy"
        cols = _columns(logits.shape[-1], group, vocab_size)
        z, own = _local_logits(logits, cols, inv_temperature)
        (m,) = _agreed_max([z.amax(dim=-1)], group, _InputChecks(what, cols))
        shifted = _shifted(z, m, own)  # z - m, kept for backward
        exp_z = shifted.exp()
        if cols.real < cols.width:
            shifted[..., cols.real:] = 0.0  # p = 0 there; 0 * (-inf) would be NaN
        sum_exp, dot = _summed([exp_z.sum(dim=-1), _row_dot(exp_z, shifted)], group)
        del exp_z
        log_s = sum_exp.log()
        entropy = log_s - dot / sum_exp  # -sum p log p, log p = (z - m) - log S
        ctx.save_for_backward(shifted, log_s, entropy)
        ctx.cols, ctx.inv_temperature, ctx.logits_dtype = cols, inv_temperature, logits.dtype
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_entropy):
        shifted, log_s, entropy = ctx.saved_tensors
        cols = ctx.cols
        # dH/dz_v = -p_v (log p_v + H), log p_v = (z_v - m) - log S
        p = (shifted - log_s.unsqueeze(-1)).exp_()
        if cols.real < cols.width:
            p[..., cols.real:] = 0.0
        grad = shifted.add_((entropy - log_s).unsqueeze(-1)).mul_(p)  # log p + H, times p (in place: once-differentiable)
        grad.mul_((-grad_entropy * ctx.inv_temperature).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` per token, ``p = softmax(logits / temperature)`` over the
    true vocabulary, from logits split over the vocabulary, without gathering them.

    Equals TRL's ``entropy_from_logits(gathered[..., :V] / temperature)``. From this rank's shard
    ``z``: ``m = allreduce_max(max_v z)``; ``S, A = allreduce_sum(sum_v exp(z - m), sum_v exp(z - m)
    (z - m))``; ``H = log S - A / S``. Backward: ``dH/dz_v = -p_v (log p_v + H)``, times
    ``1/temperature``; no communication.

    Shapes:
        logits: ``(..., V_padded / tp_size)``, e.g. ``(B, T, V/p)``.
        returns: ``(...)``, e.g. ``(B, T)``, in nats.
    Dtype: computed and returned in float32 (float64 for float64 logits); gradient in the logits' dtype.
    Memory: keeps one ``(..., V/p)`` buffer in the compute dtype for backward.
    Communication: forward 2 all-reduces, ``numel + 2`` values (max, with the shard-width check)
        and ``2 * numel`` (sums); backward none.

    Raises:
        ValueError: ``vocab_size`` that does not fit, ``temperature <= 0`` (before any collective);
            shards of different widths (every rank, from the first all-reduce).
    """
    what = "vocab_parallel_entropy"
    inv_t = _inverse_temperature(what, temperature)
    _check_vocab(what, logits.shape[-1], tp_group, vocab_size)
    return _outside_graph(_VocabParallelEntropy, logits, tp_group, vocab_size, inv_t)


class _VocabParallelKL(torch.autograd.Function):
    """Per-token KL(p || q) from two vocab shards; see :func:`vocab_parallel_kl`."""

    @staticmethod
    def forward(ctx, logits_p, logits_q, group, vocab_size, inv_temperature):
        what = "vocab_parallel_kl"
        cols = _columns(logits_p.shape[-1], group, vocab_size)
        zp, own_p = _local_logits(logits_p, cols, inv_temperature)
        zq, own_q = _local_logits(logits_q, cols, inv_temperature)
        mp, mq = _agreed_max([zp.amax(dim=-1), zq.amax(dim=-1)], group, _InputChecks(what, cols))
        sp, sq = _shifted(zp, mp, own_p), _shifted(zq, mq, own_q)  # kept for backward
        exp_p = sp.exp()
        sum_q = sq.exp().sum(dim=-1)
        if cols.real < cols.width:
            sp[..., cols.real:] = 0.0  # p = q = 0 there; 0 * (-inf + inf) would be NaN
            sq[..., cols.real:] = 0.0
        sum_p, sum_q, dot = _summed([exp_p.sum(dim=-1), sum_q, _row_dot(exp_p, sp - sq)], group)
        del exp_p
        log_sp, log_sq = sum_p.log(), sum_q.log()
        kl = dot / sum_p - log_sp + log_sq  # sum_v p_v (log p_v - log q_v)
        ctx.save_for_backward(sp, sq, log_sp, log_sq, kl)
        ctx.cols, ctx.inv_temperature = cols, inv_temperature
        ctx.dtypes = logits_p.dtype, logits_q.dtype
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        sp, sq, log_sp, log_sq, kl = ctx.saved_tensors
        cols = ctx.cols
        g = (grad_kl * ctx.inv_temperature).unsqueeze(-1)
        p = (sp - log_sp.unsqueeze(-1)).exp_()
        if cols.real < cols.width:
            p[..., cols.real:] = 0.0
        grad_p = grad_q = None
        if ctx.needs_input_grad[1]:  # dKL/dzq_v = q_v - p_v
            q = (sq - log_sq.unsqueeze(-1)).exp_()
            if cols.real < cols.width:
                q[..., cols.real:] = 0.0
            grad_q = q.sub_(p).mul_(g).to(ctx.dtypes[1])
        if ctx.needs_input_grad[0]:  # dKL/dzp_v = p_v (log p_v - log q_v - KL)
            grad_p = sp.sub_(sq).sub_((log_sp - log_sq + kl).unsqueeze(-1)).mul_(p).mul_(g).to(ctx.dtypes[0])
        return grad_p, grad_q, None, None, None


def vocab_parallel_kl(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``KL(p || q) = sum_v p_v (log p_v - log q_v)`` per token, ``p = softmax(logits_p / T)``,
    ``q = softmax(logits_q / T)`` over the true vocabulary, from two shards split alike over the
    vocabulary, without gathering them.

    The direction: ``p`` is the distribution the expectation is taken under. For a policy
    ``pi`` kept near a reference ``pi_ref`` (the RLHF penalty ``KL(pi || pi_ref)``) pass the
    policy's logits as ``logits_p``; for distillation toward a teacher with the forward KL
    ``KL(teacher || student)`` pass the teacher's as ``logits_p``. Equals
    ``F.kl_div(F.log_softmax(q_full, -1), F.log_softmax(p_full, -1), log_target=True,
    reduction="none").sum(-1)`` on the gathered logits.

    From the shards: ``mp, mq = allreduce_max(max_v zp, max_v zq)``; ``Sp, Sq, A =
    allreduce_sum(sum_v e^(zp-mp), sum_v e^(zq-mq), sum_v e^(zp-mp) ((zp-mp) - (zq-mq)))``;
    ``KL = A/Sp - log Sp + log Sq``. Backward (no communication): ``dKL/dzp_v = p_v (log p_v -
    log q_v - KL)``, ``dKL/dzq_v = q_v - p_v``, each times ``1/T``; a side that does not require
    a gradient (a frozen reference) costs nothing there.

    Shapes:
        logits_p, logits_q: ``(..., V_padded / tp_size)`` each, the same shape.
        returns: ``(...)``, e.g. ``(B, T)``, in nats.
    Dtype: computed and returned in float32 (float64 for float64 logits); gradients in each input's dtype.
    Memory: keeps two ``(..., V/p)`` buffers in the compute dtype for backward.
    Communication: forward 2 all-reduces, ``2 * numel + 2`` values (max, with the shard-width
        check) and ``3 * numel`` (sums); backward none.

    Raises:
        ValueError: shapes that differ, a ``vocab_size`` that does not fit, ``temperature <= 0``
            (before any collective); shards of different widths (every rank, from the first all-reduce).
    """
    what = "vocab_parallel_kl"
    inv_t = _inverse_temperature(what, temperature)
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"{what}: logits_p {tuple(logits_p.shape)} and logits_q {tuple(logits_q.shape)} differ; both "
                         f"must be shards of the same tokens and vocabulary")
    _check_vocab(what, logits_p.shape[-1], tp_group, vocab_size)
    return _outside_graph(_VocabParallelKL, logits_p, logits_q, tp_group, vocab_size, inv_t)


@torch.no_grad()
def vocab_parallel_is_top1(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Whether the target is the most likely token, ``argmax(gathered[..., :V]) == target``, per
    token, from logits split over the vocabulary, without gathering them (no gradient).

    Ties count as ``torch.argmax`` breaks them (the first maximum): the target is top-1 when its
    logit is the maximum ``m`` and every column before it is below ``m``. One all-reduce (max) of
    each row's maximum, the target logit (``-inf`` off the owning rank) and the maximum of the
    columns before the target. TRL's ``mean_token_accuracy`` is
    ``is_top1.sum() / (target != ignore_index).sum()``.

    Shapes:
        logits: ``(..., V_padded / tp_size)``; target: ``(...)``, the same on every rank.
        returns: ``(...)`` bool, False where ``target == ignore_index``.
    Dtype: compared in float32 (exact for half-precision logits; float64 stays float64).
    Communication: 1 all-reduce (max) of ``3 * numel(target) + 5`` values (the target and shard-width checks ride on it).

    Raises:
        ValueError: as :func:`vocab_parallel_cross_entropy`: arguments before any collective; bad or
            differing targets and shard widths on every rank from the all-reduce.
    """
    what = "vocab_parallel_is_top1"
    vocab = _check_vocab(what, logits.shape[-1], tp_group, vocab_size)
    bad_targets = _check_target(what, logits.shape[:-1], target, vocab, ignore_index, tp_group)
    cols = _columns(logits.shape[-1], tp_group, vocab_size)
    z, _ = _local_logits(logits, cols)
    ignored, owned, local = _local_targets(target, cols, ignore_index)
    target_z = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, _NEG_INF)
    # columns before the target: all of a rank below the owner, the owner's first `local`, none above
    before = torch.where(owned, local, torch.where(target >= cols.start + cols.width, cols.width, 0))
    columns = torch.arange(cols.width, device=z.device)
    max_before = z.masked_fill(columns >= before.unsqueeze(-1), _NEG_INF).amax(dim=-1)
    m, target_z, max_before = _agreed_max([z.amax(dim=-1), target_z, max_before], tp_group,
                                          _InputChecks(what, cols, target, bad_targets, ignore_index))
    return (target_z >= m) & (max_before < target_z) & ~ignored


# ---------------------------------------------------------------------------------------------
# From the hidden states and the head's weight shard, over token chunks.

#: The smallest chunk :func:`default_chunk_size` picks, in tokens (the matmuls' efficiency, below).
MIN_CHUNK = 256


def default_chunk_size(tokens: int, hidden: int) -> int:
    """The chunk :func:`vocab_parallel_linear_cross_entropy` uses by default:
    ``min(N, max(MIN_CHUNK, H // 8))`` tokens.

    Memory: beside the gradients it returns, the chunked loss holds one ``(c, V/p)`` buffer (the
    chunk's logits, turned into their gradient in place). Its ratio to the ``(V/p, H)`` weight
    gradient, which backward makes whatever the loss, is ``c / H`` whatever ``V/p``: ``c <= H / 8``
    keeps it at most 1/8 of that floor (Liger-Kernel's fused linear cross-entropy bounds it by
    the ``(N, H)`` input instead, ``c ~ N H / V``, arXiv:2410.10989, section 3.3). Time: each chunk
    streams the weight shard through four matmuls (its logits in forward; again, ``dX`` and ``dW``
    in backward) and reads and writes the weight gradient's float32 sum, about ``20 V/p H`` bytes
    for ``8 c V/p H`` flops, so ``c >= 256`` keeps about 100 flops per byte; where memory bandwidth
    is scarcer than that (GPUs in bf16, shared CPUs) a larger ``chunk_size`` (1024) is faster, for
    a larger buffer (docs/benchmarks.md). At H = 2,048 this is 256 tokens.

    Raises:
        ValueError: ``tokens`` or ``hidden`` is not a positive integer.
    """
    if min(tokens, hidden) < 1:
        raise ValueError(f"default_chunk_size: tokens and hidden must be positive, got {tokens} and {hidden}")
    return min(tokens, max(MIN_CHUNK, hidden // 8))


def _check_logit_ops(what: str, logit_ops) -> tuple[tuple[str, float], ...]:
    ops = tuple((str(op), float(value)) for op, value in logit_ops)
    for op, value in ops:
        if op not in LOGIT_OPS or not value or value != value:
            raise ValueError(f"{what}: logit_ops must be (op, value) pairs with op in {LOGIT_OPS} and a finite, "
                             f"non-zero value; got {(op, value)}")
    return ops


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ops, cols: _Columns,
                  compute: torch.dtype, want_derivative: bool):
    """One token chunk's logits ``(c, V/p)`` as the head and the model make them: ``x W^T + b`` in
    the head's dtype, then ``ops`` in that dtype as HF applies them (``logits / cap``, ``tanh``,
    ``* cap``), then the compute dtype with padded columns -inf (a buffer of its own).

    Returns ``(z, derivative, scale)``: ``dz/dy = derivative * scale`` (``derivative`` a tensor in
    the compute dtype, the product of the softcaps' ``1 - tanh^2``, or None; ``scale`` the product
    of the multiplies and divides), with ``want_derivative``."""
    y = F.linear(x, weight, bias)  # (c, V/p), a new buffer
    derivative, scale = None, 1.0
    for op, value in ops:
        if op == "multiply":
            y.mul_(value)
            scale *= value
        elif op == "divide":
            y.div_(value)
            scale /= value
        else:  # softcap: value * tanh(y / value); d/dy = 1 - tanh^2
            t = y.div_(value).tanh_()
            if want_derivative:
                factor = t.to(compute, copy=True).square_().neg_().add_(1.0)
                derivative = factor if derivative is None else derivative.mul_(factor)
            y = t.mul_(value)
    z = y.to(compute)
    if cols.real < cols.width:
        z[..., cols.real:] = _NEG_INF
    return z, derivative, scale


#: How many row blocks the backward pass cuts a half-precision head's vocabulary shard into: each
#: block's weight gradient accumulates over every token chunk in a float32 ``(V/p / 8, H)`` buffer
#: (a quarter of the ``bfloat16`` gradient's bytes), never a float32 ``(V/p, H)`` one.
VOCAB_BLOCKS = 8


def _vocab_blocks(width: int, whole: bool) -> list[tuple[int, int]]:
    """The ``[a, b)`` row blocks of a ``width``-row shard the backward pass walks: one with
    ``whole``, else :data:`VOCAB_BLOCKS` (fewer for a narrow shard)."""
    if whole or width <= 1:
        return [(0, width)]
    size = -(-width // VOCAB_BLOCKS)
    return [(a, min(width, a + size)) for a in range(0, width, size)]


def _block_targets(local: torch.Tensor, owned: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, owned)`` of the shard's rows ``[a, b)``: the targets in them, their index there."""
    inside = owned & (local >= a) & (local < b)
    return (local - a).masked_fill(~inside, 0), inside


def _linear_cross_entropy_chunks(hidden, weight, bias, target, ignore_index, eps, group, vocab_size, bad_targets,
                                 chunk_size, ops, defer=None):
    """The per-token loss ``(N,)`` and ``m`` and ``S`` ``(N,)`` (the softmax statistics the backward
    pass recomputes the gradient from), chunk by chunk: each chunk's logits ``(c, V/p)``, its
    statistics (two all-reduces) and its loss; no gradient."""
    what = "vocab_parallel_linear_cross_entropy"
    n = hidden.shape[0]
    cols = _columns(weight.shape[0], group, vocab_size)
    compute = _compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))
    ignored, owned, local = _local_targets(target, cols, ignore_index)
    loss = torch.empty(n, dtype=compute, device=hidden.device)
    m_all, s_all = torch.empty_like(loss), torch.empty_like(loss)
    checks = _InputChecks(what, cols, target, bad_targets, ignore_index, defer)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(n, start + chunk_size))
        z, _, _ = _chunk_logits(hidden[rows], weight, bias, ops, cols, compute, False)
        stats = _softmax_statistics(z, True, cols, local[rows], owned[rows], eps > 0, group,
                                    checks if start == 0 else None)
        loss[rows] = _cross_entropy(stats, eps, cols, ignored[rows])
        m_all[rows], s_all[rows] = stats.m, stats.sum_exp
        del z, stats  # this chunk's (c, V/p) buffers go before the next chunk's are made
    return loss, m_all, s_all, (ignored, owned, local), cols


@functools.cache
def _float32_output_matmul(device_type: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` takes half-precision
    ``a``, ``b`` and a float32 ``acc`` on this device type: a half-precision GEMM that accumulates
    in float32 into a float32 output (CUDA in recent torch; Megatron-LM's
    ``wgrad_gemm_accum_fp32``). Probed once per device type on a 2 x 2 case (no host sync)."""
    if device_type != "cuda":
        return False
    try:
        acc = torch.zeros(2, 2, device=device_type)
        one = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _addmm_float32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_wide: torch.Tensor | None = None,
                    b_wide: torch.Tensor | None = None) -> None:
    """``acc += a @ b`` with ``a``, ``b`` in the head's dtype and ``acc`` float32 or wider: each
    product summed in ``acc``'s dtype, never rounded to the operands' dtype. The same dtype:
    ``addmm_``; CUDA: a half-precision GEMM into the float32 ``acc`` (:func:`_float32_output_matmul`);
    else the operands upcast (``a_wide``, ``b_wide``: already upcast, reused across calls)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32 and _float32_output_matmul(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a_wide if a_wide is not None else a.to(acc.dtype), b_wide if b_wide is not None else b.to(acc.dtype))


def _linear_cross_entropy_grads(hidden, weight, bias, head_dtype, m, s, g, targets, cols, eps, ops, chunk_size,
                                want: tuple[bool, bool, bool]):
    """The gradients of ``sum_i g_i loss_i`` with respect to the hidden states ``(N, H)``, the
    weight shard ``(V/p, H)`` and the bias shard, in their dtypes, from the saved statistics
    ``m``, ``S``: each tile's logits recomputed (``x W^T + b`` in ``head_dtype``), ``dL/dz`` in
    the compute dtype, cast to ``head_dtype``; ``dX += dz W``, ``dW += dz^T X`` as ``head_dtype``
    matmuls; sums in float32 or wider.

    Where the weight's dtype is ``head_dtype`` and at least float32 the tiles are whole chunks
    ``(c, V/p)``: ``dW`` accumulates in place in the returned gradient, ``dX`` of a chunk is one
    matmul. Otherwise (``bfloat16`` weights, or autocast over ``float32`` ones) the shard is cut
    into :data:`VOCAB_BLOCKS` row blocks, walked one after another: a block's ``dW`` accumulates over
    every chunk in float32 (in the ``float32`` gradient itself, or in a ``(V/p / 8, H)`` float32
    buffer rounded once into the ``bfloat16`` gradient), and ``dX`` in one float32 ``(N, H)`` buffer
    rounded once at the end; no float32 ``(V/p, H)`` buffer ever exists."""
    ignored, owned, local = targets
    compute = m.dtype
    n, width = hidden.shape[0], weight.shape[0]
    whole = head_dtype == weight.dtype and torch.promote_types(weight.dtype, torch.float32) == weight.dtype
    blocks = _vocab_blocks(width, whole)
    b_ = None if bias is None else (bias if bias.dtype == head_dtype else bias.to(head_dtype))
    grad_x = torch.empty_like(hidden) if want[0] else None
    acc_x = None
    if want[0] and len(blocks) > 1:  # summed over the blocks in float32, rounded once
        acc_x = torch.zeros(hidden.shape, dtype=compute, device=hidden.device)
    grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if want[1] else None
    acc_b = torch.zeros(width, dtype=compute, device=hidden.device) if want[2] and bias is not None else None
    for a, b in blocks:
        bcols = _Columns(cols.start + a, b - a, max(0, min(b - a, cols.real - a)), cols.vocab)
        w_blk = weight[a:b] if weight.dtype == head_dtype else weight[a:b].to(head_dtype)  # autocast's cast, a block
        bias_blk = None if b_ is None else b_[a:b]
        # where no GEMM sums half-precision operands into float32 (the CPU), the operands upcast: w_blk once per block
        upcast = head_dtype != compute and not _float32_output_matmul(w_blk.device.type)
        w_wide = w_blk.to(compute) if upcast and acc_x is not None else None
        acc_w = None
        if grad_w is not None:  # this block's dW: in the gradient itself when it is float32 or wider
            acc_w = grad_w[a:b] if grad_w.dtype == _compute_dtype(grad_w.dtype) else \
                torch.zeros((b - a, weight.shape[1]), dtype=compute, device=weight.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            x = hidden[rows]
            blocal, bowned = _block_targets(local[rows], owned[rows], a, b)
            z, derivative, scale = _chunk_logits(x, w_blk, bias_blk, ops, bcols, compute, True)
            exp_z, _ = _exp_sum_(z.sub_(m[rows].unsqueeze(-1)))
            grad_z = _cross_entropy_grad_(exp_z, s[rows], g[rows], blocal, bowned, eps, bcols)
            if derivative is not None:
                grad_z.mul_(derivative)
            if scale != 1.0:
                grad_z.mul_(scale)
            dy = grad_z.to(head_dtype)  # as autograd hands dL/dy to the head, in its dtype
            dy_wide = dy.to(compute) if upcast else None
            if acc_x is not None:  # this block's share of dX, summed over the blocks in float32
                _addmm_float32_(acc_x[rows], dy, w_blk, dy_wide, w_wide)
            elif grad_x is not None:
                grad_x[rows] = dy @ w_blk
            if acc_w is not None:
                _addmm_float32_(acc_w, dy.t(), x, None if dy_wide is None else dy_wide.t(),
                                x.to(compute) if upcast else None)
            if acc_b is not None:
                acc_b[a:b] += dy.sum(dim=0, dtype=compute)
            del z, derivative, exp_z, grad_z, dy, dy_wide  # this tile's buffers go before the next tile's are made
        if acc_w is not None and acc_w.dtype != grad_w.dtype:
            grad_w[a:b] = acc_w
        del w_blk, w_wide, acc_w
    if acc_x is not None:
        grad_x.copy_(acc_x)
    grad_b = None if acc_b is None else acc_b.to(bias.dtype)
    return grad_x, grad_w, grad_b


class _LinearCrossEntropy(torch.autograd.Function):
    """The per-token losses from the hidden states and the head's weight shard, chunk by chunk.

    Forward keeps only the softmax statistics ``m`` and ``S`` (``N`` values each) besides its
    inputs (the hidden states in ``head_dtype``, the weight and bias as they are: a parameter,
    no copy); backward recomputes each tile's logits from them for the gradients
    (:func:`_linear_cross_entropy_grads`; four matmuls per chunk in all, the unchunked head and
    loss's three plus the recomputed logits), as Cut Cross-Entropy does (Wijmans et al.,
    arXiv:2411.09009, section 4). Nothing of size ``(V/p, H)`` is kept from forward to backward.
    ``head_dtype``: the dtype of the head's matmul (autocast's: the weight cast to it whole in
    forward and a block at a time in backward, never kept; else the weight's)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, eps, group, vocab_size, bad_targets, chunk_size, ops,
                head_dtype, defer=None):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight if weight.dtype == head_dtype else weight.to(head_dtype)  # freed after forward
            b_ = None if bias is None else (bias if bias.dtype == head_dtype else bias.to(head_dtype))
            loss, m, s, (ignored, owned, local), cols = _linear_cross_entropy_chunks(
                hidden, w, b_, target, ignore_index, eps, group, vocab_size, bad_targets, chunk_size, ops, defer)
        del w, b_
        ctx.save_for_backward(hidden, weight, bias, m, s, ignored, owned, local)
        ctx.eps, ctx.chunk_size, ctx.ops, ctx.cols, ctx.head_dtype = eps, chunk_size, ops, cols, head_dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, m, s, ignored, owned, local = ctx.saved_tensors
        g = grad_loss.masked_fill(ignored, 0.0).to(m.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _linear_cross_entropy_grads(hidden, weight, bias, ctx.head_dtype, m, s, g, (ignored, owned, local),
                                                ctx.cols, ctx.eps, ctx.ops, ctx.chunk_size,
                                                tuple(ctx.needs_input_grad[:3]))
        return (*grads, None, None, None, None, None, None, None, None, None, None)


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logit_ops: Sequence[tuple[str, float]] = (),
    grad_reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of the vocab-parallel LM head's logits from its input, over token chunks,
    never holding the ``(N, V/p)`` logits.

    Equals ``vocab_parallel_cross_entropy(ops(hidden @ weight.T + bias), target, ...)`` (with
    ``softcap``: ``ops(y) = softcap * tanh(y / softcap)``), which equals ``F.cross_entropy`` of the
    dense head's logits (Megatron-LM, arXiv:1909.08053, section 3, "output embedding"; the
    chunking is the fused linear cross-entropy of Liger-Kernel, arXiv:2410.10989, section 3.3,
    done over the vocabulary shards). For each chunk of ``chunk_size`` tokens: the chunk's logits
    ``(c, V/p)`` in the weight's dtype, the logit ops as the model applies them, then the softmax
    statistics of :func:`vocab_parallel_cross_entropy` (its steps, on the chunk) and the chunk's loss.

    Gradients (hidden, weight, bias), in backward, whatever the reduction: each chunk's logits are
    recomputed from the saved hidden states and the saved softmax statistics ``m`` and ``S``
    (``N`` values each), and ``dL/dz`` (through the logit ops, cast to the head's dtype) gives
    ``dX = dz W``, ``dW += dz^T X``, ``db += sum dz``: four matmuls per chunk in all, one more than
    the unchunked head and loss, for keeping nothing of size ``(V/p, H)`` from forward to
    backward (Cut Cross-Entropy, Wijmans et al., arXiv:2411.09009, section 4). The matmuls run
    in the head's dtype (``bfloat16`` under bf16 autocast or for a bf16 head) and their sums
    over chunks in float32 or wider: a float32 (float64) weight's gradient accumulates in place;
    a half-precision weight's in float32 per block of ``V/p / 8`` rows
    (:data:`VOCAB_BLOCKS`), each rounded once into the returned gradient, and ``dX`` over those
    blocks in one float32 ``(N, H)`` buffer.

    Shapes:
        hidden: ``(..., H)``, e.g. ``(B, T, H)``, replicated on every rank of the group.
        weight: ``(V_padded / tp_size, H)``, this rank's rows of the head (``nn.Linear`` layout;
        pass ``weight.t()`` for a ``Conv1D`` head); padded rows are zeros and never count.
        bias: ``(V_padded / tp_size,)`` or None.
        target: ``(...)`` global ids in ``[0, V)`` or ``ignore_index``, the same on every rank.
        returns: ``(...)`` with ``reduction="none"``, else a scalar.
    Dtype: logits in the dtype of ``hidden @ weight.T`` (autocast's under autocast, as the head:
        the weight cast once per pass, not kept), the softmax in float32 (float64 for float64);
        the loss in that compute dtype. Gradients in their tensors' dtypes (a float32 weight's
        under autocast: float32, accumulated as such, not rounded through bfloat16).
    Memory: kept from forward to backward: the hidden states (in the head's dtype), the weight
        and bias themselves (no copy) and ``m``, ``S`` and the targets' masks (``N`` values each).
        Per chunk one ``(c, V/p)`` buffer in the compute dtype (two with ``softcap`` in
        backward); in backward, besides the gradients it returns, for a half-precision weight
        or under autocast one float32 ``(V/p / 8, H)`` block buffer, the ``(c, V/p / 8)`` tile,
        the float32 ``(N, H)`` sum of ``dX`` and, under autocast, a block of the weight cast to
        bfloat16 (forward casts the whole weight once, for its chunks, and frees it).
        The default chunk (:func:`default_chunk_size`) keeps the chunk buffer at most 1/8 of the
        weight gradient.
    Communication: per chunk 2 all-reduces, ``c`` values (max; the first chunk's carries the 5
        target and shard-width checks) and ``2c`` (``3c`` with ``label_smoothing > 0``): in all
        ``2 * ceil(N / chunk_size)`` all-reduces of ``N + 5`` and ``2N`` (``3N``) values, the
        unchunked loss's values. Backward: one all-reduce of the hidden states' gradient ``N * H``
        (Megatron's ``f``: ``hidden`` enters the column-parallel region here, as the head's input
        does), in the head's dtype (at least ``grad_reduce_dtype``), none else.

    Args:
        hidden, weight, target, bias: see Shapes.
        ignore_index, label_smoothing, reduction, tp_group, vocab_size: as
            :func:`vocab_parallel_cross_entropy`.
        chunk_size: tokens per chunk (positive); None: :func:`default_chunk_size` of the number
            of tokens and ``H``.
        softcap: Gemma 2's ``final_logit_softcapping``: ``logits = softcap * tanh(logits /
            softcap)`` before the softmax (appended to ``logit_ops``).
        logit_ops: what the model does to the head's output before the softmax, in order:
            ``("multiply", s)``, ``("divide", d)``, ``("softcap", c)`` (:data:`LOGIT_OPS`).
        grad_reduce_dtype: the narrowest dtype the hidden states' gradient is all-reduced in
            (:func:`tpify.comm.grad_reduce_dtype`); None: the head's dtype.

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``/``vocab_size``/``chunk_size``/
            ``logit_ops``/``grad_reduce_dtype``, shapes that do not match (before any
            collective); bad or differing targets and shard widths (every rank, from the first
            all-reduce), as :func:`vocab_parallel_cross_entropy`.
    """
    return linear_cross_entropy_deferred(
        hidden, weight, target, bias=bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction, tp_group=tp_group, vocab_size=vocab_size, chunk_size=chunk_size, softcap=softcap,
        logit_ops=logit_ops, defer=None, grad_reduce_dtype=grad_reduce_dtype)


def linear_cross_entropy_deferred(hidden, weight, target, *, bias, ignore_index, label_smoothing, reduction, tp_group,
                                  vocab_size, chunk_size, softcap, logit_ops, defer,
                                  grad_reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`vocab_parallel_linear_cross_entropy` whose data checks are recorded in ``defer``
    (as :func:`cross_entropy_deferred`); what the model's ``labels=`` loss calls with
    ``lm_loss_chunk``."""
    what = "vocab_parallel_linear_cross_entropy"
    if torch.compiler.is_compiling():
        defer = None  # the guard that raises deferred checks does not run under torch.compile
    _check_loss_args(what, reduction, label_smoothing)
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"{what}: chunk_size must be a positive number of tokens or None, got {chunk_size!r}")
    if grad_reduce_dtype is not None and not (isinstance(grad_reduce_dtype, torch.dtype)
                                              and grad_reduce_dtype.is_floating_point):
        raise ValueError(f"{what}: grad_reduce_dtype must be None or a floating torch.dtype, got {grad_reduce_dtype!r}")
    ops = _check_logit_ops(what, tuple(logit_ops) + ((("softcap", softcap),) if softcap is not None else ()))
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{what}: weight {tuple(weight.shape)} must be (V_padded / tp_size, H) with H = "
                         f"hidden.shape[-1] = {hidden.shape[-1]} (pass weight.t() for a Conv1D head)")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{what}: bias {tuple(bias.shape)} must be (V_padded / tp_size,) = ({weight.shape[0]},)")
    vocab = _check_vocab(what, weight.shape[0], tp_group, vocab_size)
    bad_targets = _check_target(what, hidden.shape[:-1], target, vocab, ignore_index, tp_group, "hidden", defer)
    head_dtype = matmul_dtype(hidden)  # the head's matmul: autocast's, else the hidden states' (= the weight's)
    hidden = _autocast_inputs(hidden)[0]
    # backward: the all-reduce of the partial dX, in the head matmul's dtype (at least grad_reduce_dtype)
    hidden = comm.copy_to_tp_region(hidden, tp_group, comm.grad_reduce_dtype(hidden.dtype, grad_reduce_dtype))
    flat_hidden, flat_target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(max(1, flat_hidden.shape[0]), flat_hidden.shape[1])
    args = (flat_hidden, weight, bias, flat_target, ignore_index, float(label_smoothing), tp_group, vocab_size,
            bad_targets, chunk_size, ops, head_dtype, defer)
    losses = _outside_graph(_LinearCrossEntropy, *args)
    if reduction == "none":
        return losses.view(target.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    return mean_or_nan(total, (target != ignore_index).sum())
