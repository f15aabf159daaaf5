"""Vocab-parallel cross-entropy from a logits shard ``(..., V/p)``: :func:`vocab_parallel_cross_entropy`
and its autograd Function (Megatron-LM, arXiv:1909.08053, section 3); two all-reduces of ``(...)``
vectors forward, none backward. More: docs/loss.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .steps import (_check_loss_args, _check_target, _check_vocab, _columns, _cross_entropy, _cross_entropy_grad_,
                    _InputChecks, _local_logits, _local_targets, _outside_graph, _reduce, _softmax_statistics)


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
