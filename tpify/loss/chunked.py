"""The chunked linear cross-entropy: the LM-head loss from the hidden states ``(..., H)`` and the
head's weight shard ``(V/p, H)``, ``c`` tokens at a time, never holding the ``(..., V/p)`` logits
(:func:`vocab_parallel_linear_cross_entropy`, :func:`default_chunk_size`; Liger-Kernel's fused
linear cross-entropy, arXiv:2410.10989, section 3.3, over vocabulary shards). More: docs/loss.md.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..layers import _autocast_inputs, matmul_dtype
from .steps import (_NEG_INF, LOGIT_OPS, _check_loss_args, _check_target, _check_vocab, _Columns, _columns,
                    _compute_dtype, _cross_entropy, _cross_entropy_grad_, _exp_sum_, _InputChecks, _local_targets,
                    _outside_graph, _softmax_statistics, mean_or_nan)


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

    Backward recomputes each chunk's logits from the saved hidden states and softmax statistics
    (four matmuls per chunk, nothing of size ``(V/p, H)`` kept from forward; Cut Cross-Entropy,
    arXiv:2411.09009, section 4), the sums over chunks in float32 or wider.

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
    Memory: kept for backward: the hidden states, the weight and bias (no copy), ``N``-sized
        statistics; per chunk one ``(c, V/p)`` buffer (:func:`default_chunk_size`: at most 1/8
        of the weight gradient).
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

    More (the backward's matmuls and their precision, the memory in full): docs/loss.md,
    "Reference: details moved from the docstrings".
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
