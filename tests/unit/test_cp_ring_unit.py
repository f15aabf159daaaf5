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


# --- the flash path: ring_attention itself, one process, the P2P shifts emulated ---------------------------------

class _Shift:
    """``tpify.comm.ring_shift_start`` for rank ``rank`` of an emulated ring: a ``[K | V]`` shift brings the
    block of the rank ``n`` steps before (``n`` counts the shifts of the current ring: ``cp - 1`` per ring);
    a ``[dK | dV]`` shift brings back what was sent (one process holds no other rank's accumulator)."""

    def __init__(self, blocks, rank):
        self.blocks, self.rank, self.n = blocks, rank, 0

    def __call__(self, tensor, group, tag=0):
        from tpify.comm import RingShift
        if tag != cp_ring._KV_TAG:
            return RingShift([], tensor, tensor)
        cp = len(self.blocks)
        self.n = self.n % (cp - 1) + 1
        return RingShift([], tensor, self.blocks[(self.rank - self.n) % cp])


def _ring_rank(q, k, v, positions, cp, rank, window, monkeypatch, dtype=torch.float64):
    """Rank ``rank``'s ``ring_attention`` inputs (leaves) and output, ``(q, k, v, out)``."""
    tokens = q.shape[2]
    index = load_balanced_index(tokens, cp, rank)
    call, _ = ContextParallelCall.from_positions(None, cp, rank, positions.index_select(1, sequence_order(tokens, cp)),
                                                 "ring")
    blocks = [torch.cat([k, v], -1)[:, :, load_balanced_index(tokens, cp, r)].to(dtype) for r in range(cp)]
    monkeypatch.setattr(cp_ring.comm, "ring_shift_start", _Shift(blocks, rank))
    lq = q[:, :, index].to(dtype).requires_grad_()
    lk, lv = blocks[rank][..., :D].clone().requires_grad_(), blocks[rank][..., D:].clone().requires_grad_()
    return lq, lk, lv, cp_ring.ring_attention(lq, lk, lv, call, window, D ** -0.5)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched (by their packet name) while active."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_flash_path_is_the_kernel_of_causal_pieces_and_exact_in_float64(monkeypatch):
    """One document per row, no window: every sub-block of the plan (3 on the own block, 2 on every other)
    goes to ``aten._scaled_dot_product_flash_attention_for_cpu`` forward and its backward, none to the
    einsum; the output equals dense causal attention in float64 (1e-12: the same sums, merged), on every
    rank at cp 1, 2 and 4. At cp 1 (no shift) dQ, dK, dV equal dense too; at cp 2 and 4 dQ does (the
    emulated ring does not sum the other ranks' dK/dV: the multi-rank test does)."""
    q, k, v = _inputs(2)
    positions = torch.arange(T).expand(B, T)
    grad = torch.randn(B, N, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _dense(*leaves, positions, None)
    want_grads = torch.autograd.grad(want, leaves, grad)
    for cp in (1, 2, 4):
        for rank in range(cp):
            index = load_balanced_index(T, cp, rank)
            monkeypatch.setattr(cp_ring, "KERNEL_CALLS", {})
            with _CountOps() as ops:
                lq, lk, lv, out = _ring_rank(q, k, v, positions, cp, rank, None, monkeypatch)
                dq, dk, dv = torch.autograd.grad(out, (lq, lk, lv), grad[:, :, index])
            pieces = 3 + 2 * (cp - 1)
            assert cp_ring.KERNEL_CALLS == {"flash": 2 * pieces}, (cp, rank, cp_ring.KERNEL_CALLS)
            assert ops.calls.get("_scaled_dot_product_flash_attention_for_cpu") == pieces, ops.calls
            assert ops.calls.get("_scaled_dot_product_flash_attention_for_cpu_backward") == pieces, ops.calls
            assert "einsum" not in ops.calls and "bmm" not in ops.calls, ops.calls  # no tpify-side scores
            torch.testing.assert_close(out, want[:, :, index].detach(), atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(dq, want_grads[0][:, :, index], atol=1e-12, rtol=1e-12)
            if cp == 1:
                torch.testing.assert_close(dk, want_grads[1], atol=1e-12, rtol=1e-12)
                torch.testing.assert_close(dv, want_grads[2], atol=1e-12, rtol=1e-12)


def test_packed_documents_and_windows_keep_the_masked_einsum(monkeypatch):
    """Packed rows (positions that restart) or a sliding window: no flash call, every sub-block by the
    masked einsum; exact in float64 (1e-12)."""
    q, k, v = _inputs(4)
    for positions, window in ((_positions(), None), (torch.arange(T).expand(B, T), 5)):
        want = _dense(q, k, v, positions, window)
        monkeypatch.setattr(cp_ring, "KERNEL_CALLS", {})
        _, _, _, out = _ring_rank(q, k, v, positions, 2, 1, window, monkeypatch)
        assert set(cp_ring.KERNEL_CALLS) == {"einsum"}, cp_ring.KERNEL_CALLS
        torch.testing.assert_close(out, want[:, :, load_balanced_index(T, 2, 1)], atol=1e-12, rtol=1e-12)


def test_flash_path_bfloat16_within_bfloat16_rounding(monkeypatch):
    """bfloat16 on the CPU flash kernel against dense attention in float64 over the same (bf16-rounded)
    inputs. Tolerance 2e-2 absolute on outputs of size up to ~3: two bf16 roundings (each piece's output
    comes back in bf16 before the float32 merge, and the final output), each at most half an ulp, 2^-7 at
    |x| < 4; measured ~7e-3, as PyTorch's own bf16 SDPA over the whole sequence. dQ at cp 2 and all three
    gradients at cp 1 within 2x the dense bf16 SDPA's own error against float64, plus 1e-2."""
    q, k, v = (t.bfloat16().double() for t in _inputs(5))
    positions = torch.arange(T).expand(B, T)
    grad = torch.randn(B, N, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _dense(*leaves, positions, None)
    want_grads = torch.autograd.grad(want, leaves, grad)
    bf = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    dense_bf = torch.nn.functional.scaled_dot_product_attention(*bf, is_causal=True, enable_gqa=True)
    dense_err = [(g.double() - w).abs().max() for g, w in
                 zip(torch.autograd.grad(dense_bf, bf, grad.bfloat16()), want_grads)]
    for cp in (1, 2):
        for rank in range(cp):
            index = load_balanced_index(T, cp, rank)
            monkeypatch.setattr(cp_ring, "KERNEL_CALLS", {})
            lq, lk, lv, out = _ring_rank(q, k, v, positions, cp, rank, None, monkeypatch, dtype=torch.bfloat16)
            grads = torch.autograd.grad(out, (lq, lk, lv), grad[:, :, index].bfloat16())
            assert out.dtype == torch.bfloat16 and set(cp_ring.KERNEL_CALLS) == {"flash"}
            torch.testing.assert_close(out.double(), want[:, :, index].detach(), atol=2e-2, rtol=0)
            checked = [(grads[0], want_grads[0][:, :, index], dense_err[0])]
            if cp == 1:
                checked += [(grads[1], want_grads[1], dense_err[1]), (grads[2], want_grads[2], dense_err[2])]
            for got, ref, err in checked:
                assert (got.double() - ref).abs().max() <= 2 * err + 1e-2, ((got.double() - ref).abs().max(), err)


def test_flash_kernel_host_facts(monkeypatch):
    """Which kernel the unmasked sub-blocks take, from device, dtype, head dims and the GPU's compute
    capability alone (an H100's 9.0 and a V100's 7.0 stand in for the device here)."""
    from types import SimpleNamespace as NS

    def t(device, dtype, d):
        return NS(device=torch.device(device), dtype=dtype, shape=(1, 2, 4, d))

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert cp_ring.flash_kernel(t("cuda", torch.bfloat16, 128), t("cuda", torch.bfloat16, 128),
                                t("cuda", torch.bfloat16, 128)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    assert cp_ring.flash_kernel(t("cuda", torch.bfloat16, 128), t("cuda", torch.bfloat16, 128),
                                t("cuda", torch.bfloat16, 128)) == "cuda"
    assert cp_ring.flash_kernel(t("cuda", torch.float16, 64), t("cuda", torch.float16, 64),
                                t("cuda", torch.float16, 64)) == "cuda"
    for dtype, d in ((torch.float32, 128), (torch.float64, 64), (torch.bfloat16, 100), (torch.bfloat16, 512)):
        assert cp_ring.flash_kernel(t("cuda", dtype, d), t("cuda", dtype, d), t("cuda", dtype, d)) is None
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert cp_ring.flash_kernel(t("cpu", dtype, 12), t("cpu", dtype, 12), t("cpu", dtype, 12)) == "cpu"
    assert cp_ring.flash_kernel(t("cpu", torch.float64, 8), t("cpu", torch.float64, 8),
                                t("cpu", torch.float64, 16)) is None  # d_v != d
    assert cp_ring.flash_kernel(t("meta", torch.float32, 8), t("meta", torch.float32, 8),
                                t("meta", torch.float32, 8)) is None
    assert cp_ring._piece_causal(2, 0, 0, 0, 0) and cp_ring._piece_causal(2, 0, 0, 1, 1)
    assert not cp_ring._piece_causal(2, 0, 0, 1, 0) and not cp_ring._piece_causal(2, 1, 0, 0, 0)
    with pytest.raises(RuntimeError, match="neither the diagonal nor fully visible"):
        cp_ring._piece_causal(2, 0, 0, 0, 1)
