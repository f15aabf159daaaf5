"""Ring attention's pure parts in one process: the block plan and the online-softmax merge.

The ring is emulated: for each rank of a cp group, the ``[K | V]`` blocks of every rank are taken
in ring order (``source = (rank - step) % cp``) from one global float64 tensor, computed by
:mod:`tpify.hooks.cp_ring`'s block functions under the call's masks and merged; the result equals
the dense masked softmax over the whole sequence (float64, 1e-12: the same sums merged block by
block). The same emulation with the merge replaced by a plain sum (no rescale), or with the blocks
paired with the wrong ranks' masks (out of order), is far off: the exactness checks would catch
either. The multi-rank form (P2P, backward): tests/distributed/test_cp_attention.py.
"""

import pytest
import torch

from tpify.context_parallel import load_balanced_index, sequence_order
from tpify.hooks import cp_ring
from tpify.hooks.context_parallel import ContextParallelCall

B, N, NKV, D, T = 2, 4, 2, 8, 16


def _positions():
    row0 = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])  # 3 packed documents
    return torch.stack([row0, torch.arange(T)])


def _dense(q, k, v, positions, window):
    """The dense masked attention over the whole sequence, ``(B, n, T, d)``."""
    i = torch.arange(T)
    docs = torch.ones_like(positions, dtype=torch.bool)
    docs[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    docs = docs.cumsum(1)
    allowed = (i[None, :] <= i[:, None]) & (docs[:, :, None] == docs[:, None, :])[:, None]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    k, v = k.repeat_interleave(N // NKV, 1), v.repeat_interleave(N // NKV, 1)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v


def _emulate(q, k, v, positions, cp, rank, window, merge=cp_ring.merge, source_of=None):
    """Rank ``rank``'s ring attention output ``(B, n, T/cp, d)``, its blocks taken from the global tensors."""
    gathered = positions.index_select(1, sequence_order(T, cp))
    call, _ = ContextParallelCall.from_positions(None, cp, rank, gathered, "ring")
    ring = cp_ring._Ring(call, window, D ** -0.5, NKV, D)
    c = T // (2 * cp)
    local = q[:, :, load_balanced_index(T, cp, rank)].reshape(B, NKV, N // NKV, 2 * c, D)
    out = local.new_zeros(B, NKV, N // NKV, 2 * c, D)
    lse = local.new_full((B, NKV, N // NKV, 2 * c), float("-inf"))
    for step in range(cp):
        source = ring.source(step)
        index = load_balanced_index(T, cp, source if source_of is None else source_of(rank, step))
        kb, vb = k[:, :, index], v[:, :, index]
        for qh, kh in cp_ring.block_plan(cp, rank, source, c, window):
            qs, ks = cp_ring._halves(c, qh), cp_ring._halves(c, kh)
            o, l = cp_ring._block_forward(local[..., qs, :], kb[..., ks, :], vb[..., ks, :],
                                          ring.mask(source, qs, kh, c), ring.scale)
            out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l)
    return out.reshape(B, N, 2 * c, D)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, N, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, NKV, T, D, generator=g, dtype=torch.float64),
            torch.randn(B, NKV, T, D, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_ring_blocks_merged_equal_dense_attention(cp, window):
    q, k, v = _inputs()
    positions = _positions()
    want = _dense(q, k, v, positions, window)
    for rank in range(cp):
        got = _emulate(q, k, v, positions, cp, rank, window)
        torch.testing.assert_close(got, want[:, :, load_balanced_index(T, cp, rank)], atol=1e-12, rtol=1e-12)


def test_ring_without_rescale_or_out_of_order_is_wrong():
    q, k, v = _inputs(1)
    positions = _positions()
    want = _dense(q, k, v, positions, None)[:, :, load_balanced_index(T, 2, 0)]
    plain_sum = lambda out, lse, out_b, lse_b: (out + out_b, torch.logaddexp(lse, lse_b))  # noqa: E731
    assert (_emulate(q, k, v, positions, 2, 0, None, merge=plain_sum) - want).abs().max() > 1e-2
    backwards = lambda rank, step: (rank + step) % 4  # noqa: E731 - the blocks paired with the wrong ranks' masks
    want4 = _dense(q, k, v, positions, None)[:, :, load_balanced_index(T, 4, 1)]
    assert (_emulate(q, k, v, positions, 4, 1, None, source_of=backwards) - want4).abs().max() > 1e-2


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_block_plan_skips_only_masked_sub_blocks_and_evens_the_work(cp):
    tokens = 2 * cp * 6
    c = tokens // (2 * cp)
    q_all = [load_balanced_index(tokens, cp, r) for r in range(cp)]
    for window in (None, 4, 7, 100):
        work = []
        for rank in range(cp):
            total = 0
            for source in range(cp):
                plan = cp_ring.block_plan(cp, rank, source, c, window)
                for qh in (0, 1):
                    for kh in (0, 1):
                        qi, ki = q_all[rank][qh * c:(qh + 1) * c], q_all[source][kh * c:(kh + 1) * c]
                        seen = ki[None, :] <= qi[:, None]
                        if window is not None:
                            seen &= ki[None, :] > qi[:, None] - window
                        assert ((qh, kh) in plan) == bool(seen.any()), (cp, rank, source, qh, kh, window)
                total += len(plan)
            work.append(total)
        if window is None:  # causal, load-balanced: 3 sub-blocks on the own block, 2 on every other
            assert work == [3 + 2 * (cp - 1)] * cp, work


def test_merge_keeps_rows_that_saw_no_key():
    out, lse = torch.zeros(1, 2, 3), torch.full((1, 2), float("-inf"))
    out_b, lse_b = torch.zeros(1, 2, 3), torch.tensor([[float("-inf"), 0.0]])
    out_b[0, 1] = 1.0
    merged, new = cp_ring.merge(out, lse, out_b, lse_b)
    assert not merged.isnan().any() and new[0, 0] == float("-inf") and new[0, 1] == 0.0
    torch.testing.assert_close(merged[0, 1], torch.ones(3))
