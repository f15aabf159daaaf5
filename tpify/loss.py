"""Vocab-parallel cross-entropy: the loss from logits split over the vocabulary.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, "output embedding"): the LM head's
logits stay split over the vocabulary, shape ``(B, T, V/p)`` per rank, and the softmax
cross-entropy is computed from the shards with two all-reduces of ``B*T`` and ``2*B*T`` values
instead of gathering ``B*T*V`` logits on every rank. The hook that makes
``model(input_ids, labels=labels).loss`` of a parallelized model use it is
:mod:`tpify.hooks.lm_loss`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm

__all__ = ["vocab_parallel_cross_entropy", "mean_or_nan"]

_REDUCTIONS = ("none", "sum", "mean")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from a vocab shard; see :func:`vocab_parallel_cross_entropy`."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, group, vocab_size, bad_targets):
        tp_size, tp_rank = comm.group_size(group), comm.group_rank(group)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 input
        per_partition = logits.shape[-1]
        start = tp_rank * per_partition
        end = start + per_partition
        true_vocab = per_partition * tp_size if vocab_size is None else vocab_size

        z = logits.to(compute_dtype)  # (N..., V/p); a new tensor unless logits already are compute_dtype
        padded = None
        if end > true_vocab:  # this shard holds padded columns (global index >= V): never counted
            padded = torch.arange(start, end, device=z.device) >= true_vocab  # (V/p,)
            z = z.masked_fill(padded, float("-inf"))

        # 1. m = allreduce_max(max_v z); no gradient flows through m (it cancels in the loss).
        # Five more values ride on this all-reduce, so that every rank learns, at no extra
        # collective, whether any rank holds targets outside [0, V), whether the ranks hold the
        # same targets (max and -min of a checksum) and shards of the same width (max and -min):
        # a rank alone with bad or different targets would otherwise raise alone, or train on a
        # mismatched batch; shards of different widths would place the vocabulary wrongly.
        m = z.amax(dim=-1)  # (N...,)
        if tp_size > 1:  # one rank: vocab_parallel_cross_entropy has checked the targets already
            checksum = comm.checksum(target).to(m.dtype)
            width = torch.tensor(float(per_partition), dtype=m.dtype, device=m.device)
            checks = torch.stack([bad_targets.to(m.dtype), checksum, -checksum, width, -width])
            packed = torch.cat([m.reshape(-1), checks])
            comm.all_reduce(packed, group, op="max")
            m, checks = packed[:-5].view_as(m), packed[-5:]
            comm.raise_unless(checks[3] == -checks[4], ValueError,
                              f"vocab_parallel_cross_entropy: the ranks of the TP group hold logits shards of "
                              f"different widths (this rank: {per_partition} columns); every rank must hold V_padded / "
                              f"tp_size columns of the same padded vocabulary")
            comm.raise_unless(checks[0] <= 0, ValueError,
                              f"vocab_parallel_cross_entropy: a rank of the TP group holds targets outside [0, "
                              f"{true_vocab}) that are not ignore_index = {ignore_index}; fix the labels or set ignore_index",
                              detail=lambda: "this rank holds them" if bool(bad_targets) else "another rank holds them")
            comm.raise_unless(checks[1] == -checks[2], ValueError,
                              "vocab_parallel_cross_entropy: the ranks of the TP group hold different targets; every "
                              "rank of a TP group must see the same batch (split data over DP replicas only)")
        # 2. z_t = z[target] - m on the rank that owns the target, 0 elsewhere (summed over ranks in 3).
        ignored = target == ignore_index
        owned = (target >= start) & (target < end) & ~ignored
        local_target = (target - start).masked_fill(~owned, 0)
        z_t = (z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) - m).masked_fill(~owned, 0.0)

        # 3. S = sum_v exp(z - m), in one (N..., V/p) buffer (z's own when z is a cast or masked copy
        # of the logits) that is kept for backward and becomes the gradient there: every new buffer
        # of that size costs a pass over memory and, on a CPU, its page faults. S and z_t (and, with
        # label smoothing, sum_v (z_v - m) over the true vocabulary) ride on one all-reduce.
        own_copy = padded is not None or compute_dtype != logits.dtype  # z is not the caller's logits
        shifted = z.sub_(m.unsqueeze(-1)) if own_copy else z - m.unsqueeze(-1)  # z - m
        sums = [z_t]
        if label_smoothing > 0:
            sums.append((shifted if padded is None else shifted.masked_fill(padded, 0.0)).sum(dim=-1))
        exp_z = shifted.exp_()  # the same buffer; exp(-inf) = 0 on the padded columns
        sums.append(exp_z.sum(dim=-1))
        packed = torch.stack(sums)
        comm.all_reduce(packed, group)
        z_t, sum_exp = packed[0], packed[-1]
        log_s = sum_exp.log()
        loss = log_s - z_t
        if label_smoothing > 0:
            # (1-eps)(log S - z_t) + eps(log S - mean_v z_v), the mean over the true V.
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_s - packed[1] / true_vocab)
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(exp_z, sum_exp, local_target, owned, ignored, padded)
        ctx.label_smoothing = label_smoothing
        ctx.true_vocab = true_vocab
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        exp_z, sum_exp, local_target, owned, ignored, padded = ctx.saved_tensors
        eps = ctx.label_smoothing
        # dL/dz = (exp(z - m)/S - (1-eps) onehot_local(target) - eps/V) * grad_output; 0 on ignored
        # rows. The 1/S and grad_output scale the buffer in one pass.
        g = grad_loss.masked_fill(ignored, 0.0)  # (N...,)
        grad = exp_z.mul_((g / sum_exp).unsqueeze(-1))  # reused in place: the Function is once-differentiable
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (owned.to(grad.dtype) * g * -(1.0 - eps)).unsqueeze(-1))
        if eps > 0:
            grad.sub_((g * (eps / ctx.true_vocab)).unsqueeze(-1))
            if padded is not None:
                grad.masked_fill_(padded, 0.0)  # padded columns are not in the vocabulary
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


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

    Under ``torch.compile`` it traces into the model's graph with no graph break: the target
    checks become ``torch._assert_async`` (a ``RuntimeError`` with the same message, on every rank).

    Raises:
        ValueError: bad ``reduction``/``label_smoothing``/``vocab_size`` or shapes that do not
            match (before any collective); a target outside ``[0, V)`` that is not
            ``ignore_index`` on any rank, targets that differ between the ranks of the group, or
            shards of different widths: learnt by every rank from the first all-reduce (five
            values ride on it), so every
            rank raises, none waits. Under ``torch.compile`` these data checks raise
            ``RuntimeError`` with the same message (``torch._assert_async``).
    """
    tp_size = comm.group_size(tp_group)
    padded_vocab = logits.shape[-1] * tp_size
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size = {vocab_size} does not fit shards of "
                         f"{logits.shape[-1]} columns over {tp_size} ranks (padded vocabulary {padded_vocab}); "
                         f"pass the true vocabulary size, at most {padded_vocab}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} disagree; logits must be target.shape + (V/p,)")
    if target.is_floating_point():
        raise ValueError("vocab_parallel_cross_entropy: target must hold integer class ids, got "
                         f"{target.dtype} (probability targets are not supported)")
    true_vocab = padded_vocab if vocab_size is None else vocab_size
    outside = ((target < 0) | (target >= true_vocab)) & (target != ignore_index)
    bad_targets = outside.any()  # 0-dim bool; at tp > 1 it rides on the first all-reduce
    if tp_size == 1:
        comm.raise_unless(~bad_targets, ValueError,
                          f"vocab_parallel_cross_entropy: targets outside [0, {true_vocab}) that are not "
                          f"ignore_index = {ignore_index}; fix the labels or set ignore_index",
                          detail=lambda: f"targets {target[outside][:5].tolist()}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, ignore_index, float(label_smoothing), tp_group,
                                            vocab_size, bad_targets)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return mean_or_nan(loss.sum(), (target != ignore_index).sum())


def mean_or_nan(total: torch.Tensor, count) -> torch.Tensor:
    """``total / count``, NaN when ``count == 0`` (as ``F.cross_entropy``) but with a zero gradient.

    ``0 / 0`` would also be NaN forward, but its gradient is NaN too, and one batch whose labels
    are all ignored (or a one-token causal sequence) would then poison the weights at the next
    optimizer step; HF's dense model gets zero gradients there.
    """
    count = torch.as_tensor(count, device=total.device)
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
