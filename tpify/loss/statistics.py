"""Per-token statistics from a logits shard ``(..., V/p)``: :func:`vocab_parallel_log_probs`,
:func:`vocab_parallel_entropy`, :func:`vocab_parallel_kl`, :func:`vocab_parallel_is_top1` (what RL
trainers read from the policy's logits), each from the shards with one or two all-reduces of
``(...)``-sized vectors. More: docs/loss.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cross_entropy import _VocabParallelCrossEntropy
from .steps import (_NEG_INF, _agreed_max, _check_target, _check_vocab, _columns, _InputChecks, _inverse_temperature,
                    _local_logits, _local_targets, _outside_graph, _summed)


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
