"""Ring attention over the CP group: K/V blocks rotate by P2P, merged by the online-softmax rule.

Liu et al., ring attention (arXiv:2310.01889); the merge is Milakov & Gimelshein's online softmax
(arXiv:1805.02867). Each rank keeps its queries (load-balanced: a front chunk and a back chunk of
``c = T / (2 cp)`` tokens, :func:`tpify.context_parallel.load_balanced_index`); the ``[K | V]``
blocks go around the ring (:func:`tpify.comm.ring_shift_start`), the next block's transfer posted
before this block's compute. Per block the attention returns its output and log-sum-exp; the
running output is rescaled and merged (:func:`merge`). The backward is a custom autograd Function
that runs the ring again, passing the ``[dK | dV]`` accumulators around with the blocks.
The maths and the memory: docs/context-parallelism.md, "Ring attention".
"""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["ring_attention", "block_plan", "merge", "ATTENTION_BLOCKS"]

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


class _Ring:
    """The static facts of one ring attention call (host values and the call's index tensors)."""

    def __init__(self, call, window, scale, n_kv: int, d: int):
        self.group, self.size, self.rank = call.group, call.size, call.rank
        self.call, self.window, self.scale, self.n_kv, self.d = call, window, scale, n_kv, d

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
        q = query.to(acc).view(b, ring.n_kv, g, local, d)
        out = q.new_zeros(b, ring.n_kv, g, local, value.shape[-1])
        lse = q.new_full((b, ring.n_kv, g, local), float("-inf"))
        kv = torch.cat([key, value], dim=-1)  # (B, n_kv, T/cp, d + d_v), sent in the input dtype
        for step in range(ring.size):
            source = ring.source(step)
            pending = comm.ring_shift_start(kv, ring.group, _KV_TAG) if step < ring.size - 1 else None
            plan = block_plan(ring.size, ring.rank, source, c, ring.window)
            if ATTENTION_BLOCKS is not None:
                ATTENTION_BLOCKS[step] = len(plan)
            kv_acc = kv.to(acc)
            for qh, kh in plan:
                ks = _halves(c, kh)
                for qs in _row_tiles(_halves(c, qh), b * n, c):
                    o_b, l_b = _block_forward(q[..., qs, :], kv_acc[..., ks, :d], kv_acc[..., ks, d:],
                                              ring.mask(source, qs, kh, c), ring.scale)
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o_b, l_b)
            if pending is not None:
                kv = pending.wait()
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.ring = ring
        return result.view(b, n, local, -1)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        ring = ctx.ring
        b, n, local, d = query.shape
        c, acc = local // 2, _acc_dtype(query.dtype)
        g = n // ring.n_kv
        q = query.to(acc).view(b, ring.n_kv, g, local, d)
        dout = grad.to(acc).reshape(b, ring.n_kv, g, local, -1)
        delta = (dout * out.to(acc)).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.cat([key, value], dim=-1)
        incoming = None  # the [dK | dV] of the block this rank holds, summed by the ranks before it
        for step in range(ring.size):
            source = ring.source(step)
            pending = comm.ring_shift_start(kv, ring.group, _KV_TAG) if step < ring.size - 1 else None
            kv_acc = kv.to(acc)
            dkv = torch.zeros_like(kv_acc)
            for qh, kh in block_plan(ring.size, ring.rank, source, c, ring.window):
                ks = _halves(c, kh)
                for qs in _row_tiles(_halves(c, qh), b * n, c):
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


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call, window: int | None,
                   scale: float) -> torch.Tensor:
    """This rank's queries over the whole sequence by ring attention: ``(B, n, T/cp, d_v)``.

    Shapes: ``query`` ``(B, n, T/cp, d)``, ``key`` ``(B, n_kv, T/cp, d)``, ``value`` ``(B, n_kv,
    T/cp, d_v)``, this rank's tokens in load-balanced order (grouped-query heads: ``n_kv``
    divides ``n``, never repeated). ``call``: the :class:`~tpify.hooks.context_parallel.ContextParallelCall`
    (group, rank, global indices, documents); ``window``: the layer's sliding window or None.
    Dtypes: the blocks are computed, merged and their gradients summed in float32 (float64 for
    float64 inputs); the output and gradients come back in the inputs' dtypes.

    Communication: forward ``cp - 1`` ring shifts of this rank's ``[K | V]``
    (``B * n_kv * T/cp * (d + d_v)`` values each, in the input dtype), each posted before the
    previous block's compute; backward ``cp - 1`` shifts of ``[K | V]`` again and ``cp`` shifts of
    the ``[dK | dV]`` accumulators (float32 or float64), the last bringing each rank its own
    block's gradient.
    Memory kept for backward: this rank's ``q, k, v``, the output and the log-sum-exp
    (``B * n * T/cp`` floats). While the ring runs: the block computed and the one in flight
    (backward: also two ``[dK | dV]`` accumulators), and the scores of one tile of query rows
    against ``c = T / (2 cp)`` keys (at most :data:`TILE_SCORES` elements, a few copies of them
    in backward), never the whole sequence's K/V.
    """
    ring = _Ring(call, window, scale, key.shape[1], query.shape[-1])
    return _RingAttention.apply(query, key, value, ring)
