"""Ring attention over the CP group: K/V blocks rotate by P2P, merged by the online-softmax rule.

Liu et al., ring attention (arXiv:2310.01889); the merge is Milakov & Gimelshein's online softmax
(arXiv:1805.02867). Each rank keeps its queries (load-balanced: a front chunk and a back chunk of
``c = T / (2 cp)`` tokens, :func:`tpify.context_parallel.load_balanced_index`); the ``[K | V]``
blocks go around the ring (:func:`tpify.comm.ring_shift_start`), the next block's transfer posted
before this block's compute. Per block the attention returns its output and log-sum-exp; the
running output is rescaled and merged (:func:`merge`). The backward is a custom autograd Function
that runs the ring again, passing the ``[dK | dV]`` accumulators around with the blocks.
Per sub-block the kernel is a fused flash kernel that returns the log-sum-exp (:func:`flash_kernel`)
wherever the sub-block needs no mask (no window, one document per row), else tpify's masked
einsum over tiles of scores. The maths and the memory: docs/context-parallelism.md, "Ring attention".
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .. import comm

__all__ = ["ring_attention", "block_plan", "merge", "flash_kernel", "ATTENTION_BLOCKS", "KERNEL_CALLS"]

_KV_TAG, _DKV_TAG = 1, 2


def block_plan(cp_size: int, rank: int, source: int, chunk: int,
               window: int | None) -> list[tuple[int, int]]:
    """The sub-blocks rank ``rank``'s queries compute against the ``[K | V]`` block of rank ``source``:
    ``(q_half, k_half)`` pairs, ``0`` the front chunk and ``1`` the back chunk of the ``chunk``-token
    halves. Pure, host integers only (the same on every step of every call: no host sync).

    Rank ``r`` holds global chunks ``r`` and ``2 cp - 1 - r``. A sub-block is left out when no query
    of it sees any key of it under the causal mask (every key after every query) or the sliding
    window ``w`` (every key at least ``w`` tokens before every query, transformers'
    ``k > q - w``); packed documents only mask more, so the plan holds for them too. Under the
    load-balanced order every rank computes the same number of sub-blocks: 3 on its own block
    (the diagonal), 2 on every other (the front keys of a rank before it, the back queries against
    a rank after it).
    """
    chunks = (rank, 2 * cp_size - 1 - rank), (source, 2 * cp_size - 1 - source)
    plan = []
    for qh, qa in enumerate(chunks[0]):
        for kh, kb in enumerate(chunks[1]):
            if kb * chunk > (qa + 1) * chunk - 1:  # the first key after the last query
                continue
            if window is not None and (kb + 1) * chunk - 1 <= qa * chunk - window:  # the last key out of the window
                continue
            plan.append((qh, kh))
    return plan


#: ``{step: sub-blocks}`` counted in the last forward when a test sets it to a dict (None: off).
ATTENTION_BLOCKS: dict | None = None


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """The online-softmax merge of a block into the running attention: ``(out, lse)``.

    ``out`` ``(..., q, d_v)`` and ``lse`` ``(..., q)`` cover the keys seen so far, ``out_b`` and
    ``lse_b`` one more block's keys; the result covers both: ``lse' = log(e^lse + e^lse_b)``,
    ``out' = e^(lse - lse') out + e^(lse_b - lse') out_b``. Rows that saw no key yet
    (``lse = -inf``, ``out = 0``) stay so; no NaN, no host sync.
    """
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # -inf only where both are
    out = out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, new


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``(B, n_kv, g, q, k)`` scaled scores of grouped queries ``(B, n_kv, g, q, d)`` against keys
    ``(B, n_kv, k, d)``, ``-inf`` where ``mask`` ``(B', q, k)`` is False."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def _block_forward(q, k, v, mask, scale):
    """Output ``(B, n_kv, g, q, d_v)`` and log-sum-exp ``(B, n_kv, g, q)`` of one sub-block (rows
    that see no key: output 0, lse ``-inf``)."""
    s = _scores(q, k, mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v) / torch.where(total == 0, torch.ones_like(total), total)
    return out, (m + torch.log(total)).squeeze(-1)


def _block_backward(q, k, v, mask, scale, lse, dout, delta):
    """``(dq, dk, dv)`` of one sub-block, from the final ``lse`` and ``delta = rowsum(dout * out)``
    (the softmax backward of flash attention: ``dS = P (dP - delta)``)."""
    s = _scores(q, k, mask, scale)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse.unsqueeze(-1))  # masked: exp(-inf) = 0
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dout, v)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q)
    return dq, dk, dv


#: The most score elements (``B * n * rows * keys``) one tile of a sub-block computes at once: the
#: query rows of a sub-block are cut into tiles of at most this many scores (16 MiB in float32),
#: which bounds the transient memory of the scores and their gradient whatever ``T`` is.
TILE_SCORES = 1 << 22


def _row_tiles(rows: slice, lead: int, keys: int):
    """Slices of ``rows`` whose scores ``(lead, len, keys)`` hold at most :data:`TILE_SCORES` elements."""
    step = max(1, TILE_SCORES // max(1, lead * keys))
    for start in range(rows.start, rows.stop, step):
        yield slice(start, min(start + step, rows.stop))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _halves(c: int, h: int) -> slice:
    return slice(h * c, (h + 1) * c)


#: ``{"flash": n, "einsum": n}`` sub-block kernel calls (forward and backward) counted when a test
#: sets it to a dict (None: off).
KERNEL_CALLS: dict | None = None

_FLASH_CUDA_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def flash_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """The fused flash kernel the ring's unmasked sub-blocks take for these inputs, or None (the
    einsum path). Host facts only (device, dtype, head dims): no data read.

    ``"cuda"``: ``aten._scaled_dot_product_flash_attention`` (and its backward) for float16 and
    bfloat16 with ``d == d_v``, ``d`` a multiple of 8 and at most 256, on compute capability 8.0 or
    newer (what the CUDA flash kernel takes; float32 and float64 on CUDA, and older GPUs, keep the
    einsum path). ``"cpu"``:
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) for float16, bfloat16,
    float32 and float64 with ``d == d_v``. Any other device: None.
    """
    d, d_v = query.shape[-1], value.shape[-1]
    if d != d_v or key.shape[-1] != d:
        return None
    if query.device.type == "cuda" and query.dtype in _FLASH_CUDA_DTYPES and d % 8 == 0 and d <= 256:
        return "cuda" if torch.cuda.get_device_capability(query.device) >= (8, 0) else None
    if query.device.type == "cpu" and query.dtype in _FLASH_CPU_DTYPES:
        return "cpu"
    return None


#: ``{call.doc_k: bool}``: whether a call's rows each hold one document (read once per call, see
#: :func:`_one_document`); keyed by the call's document tensor, which lives as long as the call.
_ONE_DOCUMENT = WeakTensorKeyDictionary()


def _one_document(call) -> bool:
    """True when no row of the call holds more than one document (no packing, no padding by
    restarted positions): then every sub-block the plan keeps is fully visible or a diagonal, and
    needs no mask. One device-to-host read of one bool per model call (the first ring layer reads
    it, the others reuse it), not per layer or per sub-block."""
    known = _ONE_DOCUMENT.get(call.doc_k)
    if known is None:
        known = bool((call.doc_k == call.doc_k[:, :1]).all())
        _ONE_DOCUMENT[call.doc_k] = known
    return known


def _piece_causal(cp_size: int, rank: int, source: int, qh: int, kh: int) -> bool:
    """For a sub-block of the plan under the causal mask alone: True when it is a diagonal (the
    query and key chunks are the same positions: ``is_causal``), False when every key precedes
    every query (no mask). Raises RuntimeError for a partly masked one (none exists under the
    load-balanced layout: a guard against a change of layout)."""
    qa = (rank, 2 * cp_size - 1 - rank)[qh]
    kb = (source, 2 * cp_size - 1 - source)[kh]
    if qa == kb:
        return True
    if kb < qa:
        return False
    raise RuntimeError(f"ring attention: sub-block (query chunk {qa}, key chunk {kb}) of cp {cp_size} is neither "
                       f"the diagonal nor fully visible; the flash path cannot compute it")


def _count(kind: str) -> None:
    if KERNEL_CALLS is not None:
        KERNEL_CALLS[kind] = KERNEL_CALLS.get(kind, 0) + 1


def _flash_forward(kernel: str, q, k, v, causal: bool, scale: float):
    """``(out (B, n, rows, d) in q's dtype, lse (B, n, rows) float32 (float64 for float64 inputs),
    rng_state, unused)`` of one unmasked sub-block by the flash kernel (``causal``: the diagonal);
    ``k``, ``v`` with as many heads as ``q``."""
    _count("flash")
    if kernel == "cuda":
        out, lse, _, _, _, _, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, rng, unused
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None, None


def _flash_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float, rng, unused):
    """``(dq, dk, dv)`` of one unmasked sub-block by the flash kernel's backward, given the FINAL
    output rows ``out`` and log-sum-exp ``lse`` of the whole ring (the sub-block's share of the
    gradient under the global softmax: ``P = exp(S - lse)``, ``dS = P (dP - rowsum(dout * out))``)."""
    _count("flash")
    lse = lse.contiguous()
    if kernel == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, unused, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


class _Ring:
    """The static facts of one ring attention call (host values and the call's index tensors)."""

    def __init__(self, call, window, scale, n_kv: int, d: int, kernel: str | None = None):
        self.group, self.size, self.rank = call.group, call.size, call.rank
        self.call, self.window, self.scale, self.n_kv, self.d = call, window, scale, n_kv, d
        self.kernel = kernel  # flash_kernel's answer when every sub-block needs no mask, else None (einsum)

    def source(self, step: int) -> int:
        """The rank whose ``[K | V]`` block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def mask(self, source: int, qh: slice, kh: int, c: int) -> torch.Tensor:
        """``(B', rows, c)`` bool: this rank's query rows ``qh`` (local positions) against half ``kh``
        of rank ``source``'s keys, from the call's global indices and documents."""
        call, local = self.call, 2 * c
        qs, ks = qh, slice(source * local + kh * c, source * local + (kh + 1) * c)
        qi, ki = call.q_index[qs], call.k_index[ks]
        allowed = ki[None, :] <= qi[:, None]
        if self.window is not None:
            allowed = allowed & (ki[None, :] > qi[:, None] - self.window)
        same = call.doc_q[:, qs, None] == call.doc_k[:, None, ks]
        return same & allowed


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, ring: _Ring):
        b, n, local, d = query.shape
        c, acc = local // 2, _acc_dtype(query.dtype)
        g = n // ring.n_kv
        q = query.to(acc).view(b, ring.n_kv, g, local, d) if ring.kernel is None else None
        out = query.new_zeros(b, ring.n_kv, g, local, value.shape[-1], dtype=acc)
        lse = query.new_full((b, ring.n_kv, g, local), float("-inf"), dtype=acc)
        kv = torch.cat([key, value], dim=-1)  # (B, n_kv, T/cp, d + d_v), sent in the input dtype
        rng = None  # the flash kernel's rng state (dropout 0: passed back to its backward, unread)
        for step in range(ring.size):
            source = ring.source(step)
            pending = comm.ring_shift_start(kv, ring.group, _KV_TAG) if step < ring.size - 1 else None
            plan = block_plan(ring.size, ring.rank, source, c, ring.window)
            if ATTENTION_BLOCKS is not None:
                ATTENTION_BLOCKS[step] = len(plan)
            if ring.kernel is not None:
                k_all, v_all = _expand(kv[..., :d], g), _expand(kv[..., d:], g)  # (B, n, T/cp, d): equal heads
                for qh, kh in plan:
                    qs, ks = _halves(c, qh), _halves(c, kh)
                    o_b, l_b, *state = _flash_forward(ring.kernel, query[:, :, qs], k_all[:, :, ks], v_all[:, :, ks],
                                                      _piece_causal(ring.size, ring.rank, source, qh, kh), ring.scale)
                    rng = state if rng is None else rng
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs],
                                                          o_b.to(acc).reshape(b, ring.n_kv, g, c, -1),
                                                          l_b.to(acc).reshape(b, ring.n_kv, g, c))
            else:
                kv_acc = kv.to(acc)
                for qh, kh in plan:
                    ks = _halves(c, kh)
                    for qs in _row_tiles(_halves(c, qh), b * n, c):
                        _count("einsum")
                        o_b, l_b = _block_forward(q[..., qs, :], kv_acc[..., ks, :d], kv_acc[..., ks, d:],
                                                  ring.mask(source, qs, kh, c), ring.scale)
                        out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o_b, l_b)
            if pending is not None:
                kv = pending.wait()
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.ring, ctx.rng = ring, rng
        return result.view(b, n, local, -1)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        ring = ctx.ring
        b, n, local, d = query.shape
        c, acc = local // 2, _acc_dtype(query.dtype)
        g = n // ring.n_kv
        kv = torch.cat([key, value], dim=-1)
        if ring.kernel is not None:  # the flash kernel's backward: inputs in the input dtype, (B, n, ...) heads
            dout = grad.to(query.dtype).reshape(b, n, local, -1).contiguous()
            out_h, lse_h = out.view(b, n, local, -1), lse.view(b, n, local)
            dq = torch.zeros(b, n, local, d, dtype=acc, device=query.device)
        else:
            q = query.to(acc).view(b, ring.n_kv, g, local, d)
            dout = grad.to(acc).reshape(b, ring.n_kv, g, local, -1)
            delta = (dout * out.to(acc)).sum(-1)
            dq = torch.zeros_like(q)
        incoming = None  # the [dK | dV] of the block this rank holds, summed by the ranks before it
        for step in range(ring.size):
            source = ring.source(step)
            pending = comm.ring_shift_start(kv, ring.group, _KV_TAG) if step < ring.size - 1 else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            plan = block_plan(ring.size, ring.rank, source, c, ring.window)
            if ring.kernel is not None:
                k_all, v_all = _expand(kv[..., :d], g), _expand(kv[..., d:], g)
                for qh, kh in plan:
                    qs, ks = _halves(c, qh), _halves(c, kh)
                    dq_b, dk_b, dv_b = _flash_backward(ring.kernel, dout[:, :, qs], query[:, :, qs], k_all[:, :, ks],
                                                       v_all[:, :, ks], out_h[:, :, qs], lse_h[:, :, qs],
                                                       _piece_causal(ring.size, ring.rank, source, qh, kh),
                                                       ring.scale, *ctx.rng)
                    dq[:, :, qs] += dq_b
                    dkv[..., ks, :d] += _group_sum(dk_b, ring.n_kv)
                    dkv[..., ks, d:] += _group_sum(dv_b, ring.n_kv)
            else:
                kv_acc = kv.to(acc)
                for qh, kh in plan:
                    ks = _halves(c, kh)
                    for qs in _row_tiles(_halves(c, qh), b * n, c):
                        _count("einsum")
                        dq_b, dk_b, dv_b = _block_backward(q[..., qs, :], kv_acc[..., ks, :d], kv_acc[..., ks, d:],
                                                           ring.mask(source, qs, kh, c), ring.scale, lse[..., qs],
                                                           dout[..., qs, :], delta[..., qs])
                        dq[..., qs, :] += dq_b
                        dkv[..., ks, :d] += dk_b
                        dkv[..., ks, d:] += dv_b
            if incoming is not None:
                dkv = dkv + incoming.wait()
            incoming = comm.ring_shift_start(dkv, ring.group, _DKV_TAG)  # on to the block's next rank
            if pending is not None:
                kv = pending.wait()
        dkv = incoming.wait()  # after cp shifts, this rank's own block, summed over every rank's queries
        return (dq.view(b, n, local, d).to(query.dtype), dkv[..., :d].to(key.dtype), dkv[..., d:].to(value.dtype),
                None)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, n_kv, t, d)`` -> ``(B, n_kv * groups, t, d)``: each K/V head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _group_sum(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``(B, n, t, d)`` -> ``(B, n_kv, t, d)`` float: the gradient of :func:`_expand`'s repeat."""
    b, n, t, d = x.shape
    return x.view(b, n_kv, n // n_kv, t, d).sum(2, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call, window: int | None,
                   scale: float) -> torch.Tensor:
    """This rank's queries over the whole sequence by ring attention: ``(B, n, T/cp, d_v)``.

    Shapes: ``query`` ``(B, n, T/cp, d)``, ``key`` ``(B, n_kv, T/cp, d)``, ``value`` ``(B, n_kv,
    T/cp, d_v)``, this rank's tokens in load-balanced order (grouped-query heads: ``n_kv``
    divides ``n``; repeated per step for the flash kernel only). ``call``: the
    :class:`~tpify.hooks.context_parallel.ContextParallelCall` (group, rank, global indices,
    documents); ``window``: the layer's sliding window or None.

    Kernel per sub-block: with no window, one document per row (the call's documents, read once
    per call: one device-to-host read of a bool) and inputs :func:`flash_kernel` accepts, the
    flash kernel that returns the log-sum-exp, without a mask (``is_causal`` on the diagonal
    sub-blocks), and its backward with the final output and log-sum-exp; otherwise tpify's masked
    einsum over tiles of query rows. Dtypes: the flash kernel computes in the input dtype (its
    softmax statistics in float32); the merge, the einsum and the gradient sums run in float32
    (float64 for float64 inputs); the output and gradients come back in the inputs' dtypes.

    Communication: forward ``cp - 1`` ring shifts of this rank's ``[K | V]``
    (``B * n_kv * T/cp * (d + d_v)`` values each, in the input dtype), each posted before the
    previous block's compute; backward ``cp - 1`` shifts of ``[K | V]`` again and ``cp`` shifts of
    the ``[dK | dV]`` accumulators (float32 or float64), the last bringing each rank its own
    block's gradient.
    Memory kept for backward: this rank's ``q, k, v``, the output and the log-sum-exp
    (``B * n * T/cp`` floats). While the ring runs: the block computed and the one in flight
    (backward: also two ``[dK | dV]`` accumulators), and, on the einsum, the scores of one tile of
    query rows against ``c = T / (2 cp)`` keys (at most :data:`TILE_SCORES` elements, a few copies
    of them in backward), never the whole sequence's K/V; on the flash kernel, the block's K/V
    repeated to the query heads (grouped-query attention) instead of the scores.

    Raises:
        RuntimeError: (the flash path) a sub-block of the plan that is neither a diagonal nor fully
            visible, which the load-balanced layout never gives (a guard, on every rank before the
            first shift).
    """
    kernel = flash_kernel(query, key, value) if window is None else None
    if kernel is not None and not _one_document(call):
        kernel = None  # packed documents: the masked einsum path
    if kernel is not None:  # every sub-block of every step a diagonal or fully visible, checked before any shift
        for source in range(call.size):
            for qh, kh in block_plan(call.size, call.rank, source, query.shape[2] // 2, None):
                _piece_causal(call.size, call.rank, source, qh, kh)
    ring = _Ring(call, window, scale, key.shape[1], query.shape[-1], kernel)
    return _RingAttention.apply(query, key, value, ring)
