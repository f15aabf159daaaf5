"""One context-parallel rank's attention on a GPU, against the dense attention: time, memory, error.

tpify's attention over a split sequence (:func:`tpify.hooks.context_parallel._attend`) on one
rank is this rank's ``T/cp`` queries over the keys and values of the whole sequence (gathered in
rank order) under a boolean mask built from the global positions. Here that is run in one
process: the "gathered" K/V are the whole sequence's, permuted to rank order (a one-rank group
gathers nothing), so the kernel, the mask and the recomputation are the real ones and the
all-gather is left out (its time is the interconnect's, not measured here).

Per ``T`` and cp, for the first and the last rank of the group (front and back chunks): the
median time of forward + backward (``torch.utils.checkpoint`` around it, as in the model: the
forward runs twice), the peak memory above the inputs (``torch.cuda.max_memory_allocated``), and
the largest difference of its output rows from the dense causal attention's rows (SDPA,
``is_causal=True``, ``enable_gqa``); dense is cp = 1. bfloat16 and float32 (the tolerance of a
kernel: the dense side takes the flash kernel, the masked side the memory-efficient one).
Rounds interleaved: each round runs every configuration once, in turn.

The ring (``cp_attention="ring"``, :mod:`tpify.hooks.cp_ring`) is measured the same way, its
``[K | V]`` transport emulated: ``tpify.comm.ring_shift_start`` is replaced, for this process, by
a shift that hands the rank the block of the rank before it from the whole sequence's K/V (what
the P2P receive would bring; the backward's ``[dK | dV]`` accumulators come back unchanged, which
costs the same compute but is not the sum, so only the forward rows are compared). Rows
``ring`` next to ``cp`` (the all-gather form) at the same rank. The ring's sub-blocks here are
causal with one document (no window, no packing): each is one call of the flash kernel that returns
the log-sum-exp (``aten._scaled_dot_product_flash_attention`` on CUDA in bf16/fp16,
``..._for_cpu`` on the CPU), or the masked einsum where the kernel refuses the inputs (fp32 on
CUDA); the line before each dtype's table says which, counts the calls, and gives the ring's
gradients at cp 1 (no shift: every gradient is the ring's own) against dense SDPA's, both in the
run's dtype (the flash kernel's backward checked on the device).

Run on a GPU: ``python benchmarks/bench_cp_attention_gpu.py``; ``--device cpu --tokens 256`` checks
the script on a CPU (times by the wall clock, no memory figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=g)
    return q, k, v


def _dense(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _measure(fn, args, rounds_out: list, peaks: list):
    leaves = [a.detach().requires_grad_() for a in args]
    cuda = leaves[0].is_cuda
    if not cuda:
        start = time.perf_counter()
        out = fn(*leaves)
        out.float().square().sum().backward()
        rounds_out.append(1e3 * (time.perf_counter() - start))
        peaks.append(float("nan"))
        return out.detach()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*leaves)
    out.float().square().sum().backward()
    end.record()
    torch.cuda.synchronize()
    rounds_out.append(start.elapsed_time(end))
    peaks.append(torch.cuda.max_memory_allocated() - base)
    return out.detach()


class _EmulatedShift:
    """``tpify.comm.ring_shift_start`` for one process: the ``[K | V]`` of the block the P2P ring
    would bring next, taken from the whole sequence (forward and backward alike); other tensors
    (the ``[dK | dV]`` accumulators) come back as they are."""

    def __init__(self, kv_blocks: list, rank: int):
        self.kv_blocks, self.rank, self.step = kv_blocks, rank, 0

    def __call__(self, tensor, group, tag=0):
        from tpify.comm import RingShift
        from tpify.hooks.cp_ring import _KV_TAG

        if tag != _KV_TAG:
            return RingShift([], tensor, tensor)
        cp = len(self.kv_blocks)
        if tensor.data_ptr() == self.kv_blocks[self.rank].data_ptr() or self.step >= cp - 1:
            self.step = 0  # a new ring (the forward, then the backward, start from this rank's block)
        self.step += 1
        return RingShift([], tensor, self.kv_blocks[(self.rank - self.step) % cp].to(tensor.dtype))


def _ring_run(q, k, v, tokens: int, cp: int, rank: int, device):
    """``(run, local_q, local_k, local_v, index)`` for this rank's ring attention, the shifts emulated."""
    import tpify.comm
    from tpify.context_parallel import load_balanced_index, sequence_order
    from tpify.hooks import cp_ring
    from tpify.hooks.context_parallel import ContextParallelCall

    order = sequence_order(tokens, cp, device=device)
    index = load_balanced_index(tokens, cp, rank, device=device)
    call, _ = ContextParallelCall.from_positions(None, cp, rank, order[None], "ring")
    blocks = [torch.cat([k, v], -1).index_select(2, load_balanced_index(tokens, cp, r, device=device))
              for r in range(cp)]
    shift = _EmulatedShift(blocks, rank)
    local_k, local_v = blocks[rank][..., :k.shape[-1]], blocks[rank][..., k.shape[-1]:]

    def run(qq, kk, vv):
        tpify.comm.ring_shift_start, old = shift, tpify.comm.ring_shift_start
        shift.step = 0
        try:
            return cp_ring.ring_attention(qq, kk, vv, call, None, qq.shape[-1] ** -0.5)
        finally:
            tpify.comm.ring_shift_start = old

    return run, q.index_select(2, index), local_k, local_v, index


def _ring_gradients_check(q, k, v, device) -> str:
    """The ring at cp 1 (no shift: its own block, two diagonal sub-blocks and one full one) against
    dense SDPA, forward and backward in the inputs' dtype: ``dQ``, ``dK``, ``dV`` max abs difference
    over the dense gradient's max abs (the flash kernel's backward conventions checked on the device)."""
    from tpify.context_parallel import sequence_order
    from tpify.hooks import cp_ring
    from tpify.hooks.context_parallel import ContextParallelCall

    tokens = q.shape[2]
    call, _ = ContextParallelCall.from_positions(None, 1, 0, sequence_order(tokens, 1, device=device)[None], "ring")
    g = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(q.shape, device=device, dtype=q.dtype, generator=g)
    ring_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dense_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ring = torch.autograd.grad(cp_ring.ring_attention(*ring_leaves, call, None, q.shape[-1] ** -0.5),
                               ring_leaves, grad)
    dense = torch.autograd.grad(_dense(*dense_leaves), dense_leaves, grad)
    rel = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(ring, dense)]
    return "dQ %.1e, dK %.1e, dV %.1e" % tuple(rel)


def main(argv=None) -> int:
    from tpify.context_parallel import load_balanced_index, sequence_order
    from tpify.hooks.context_parallel import ContextParallelCall, _attend

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    device = args.device
    heads, kv_heads, dim = 32, 8, 128
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; B 1, {heads} query / {kv_heads} KV heads, head dim {dim}")
    print("| dtype | T | cp | rank | fwd+bwd ms (median) | x dense | peak MiB above inputs | x dense | "
          "max abs diff from dense rows |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    from tpify.hooks import cp_ring

    for dtype in [getattr(torch, name) for name in args.dtypes]:
        for tokens in args.tokens:
            q, k, v = _inputs(tokens, heads, kv_heads, dim, dtype, device)
            kernel = cp_ring.flash_kernel(q, k, v)
            cp_ring.KERNEL_CALLS = {}
            configs = [("dense", None, None)]
            for cp in args.cp:
                for rank in (0, cp - 1):
                    configs.append((f"cp{cp}", cp, rank))
                    configs.append((f"ring{cp}", cp, rank))
            times = {c[0] + str(c[2]): [] for c in configs}
            peaks = {c[0] + str(c[2]): [] for c in configs}
            outs = {}
            for _ in range(args.rounds):
                for name, cp, rank in configs:
                    key = name + str(rank)
                    if cp is None:
                        outs[key] = _measure(_dense, (q, k, v), times[key], peaks[key])
                        continue
                    if name.startswith("ring"):
                        run, lq, lk, lv, index = _ring_run(q, k, v, tokens, cp, rank, device)
                        outs[key] = (_measure(run, (lq, lk, lv), times[key], peaks[key]), index)
                        continue
                    order = sequence_order(tokens, cp, device=device)
                    index = load_balanced_index(tokens, cp, rank, device=device)
                    call, _ = ContextParallelCall.from_positions(None, cp, rank, order[None])
                    local_q = q.index_select(2, index)
                    gathered_k, gathered_v = k.index_select(2, order), v.index_select(2, order)

                    def run(qq, kk, vv, call=call):
                        return checkpoint(_attend, qq, kk, vv, call, None, None, use_reentrant=False)

                    outs[key] = (_measure(run, (local_q, gathered_k, gathered_v), times[key], peaks[key]), index)
            calls, cp_ring.KERNEL_CALLS = cp_ring.KERNEL_CALLS, None
            print(f"| {str(dtype).removeprefix('torch.')} | {tokens} | ring sub-blocks: "
                  f"{'flash kernel (' + kernel + ')' if kernel else 'masked einsum (no flash kernel for these inputs)'}"
                  f", calls {calls}; ring cp 1 gradients vs dense SDPA (max abs diff / max abs): "
                  f"{_ring_gradients_check(q, k, v, device)} | | | | | |")
            t_dense, p_dense = statistics.median(times["denseNone"]), statistics.median(peaks["denseNone"])
            dense_out = outs["denseNone"]
            print(f"| {str(dtype).removeprefix('torch.')} | {tokens} | 1 | - | {t_dense:.2f} | 1.00 | "
                  f"{p_dense / 2**20:.0f} | 1.00 | 0 |")
            for name, cp, rank in configs[1:]:
                key = name + str(rank)
                out, index = outs[key]
                diff = float((out.float() - dense_out.index_select(2, index).float()).abs().max())
                t, p = statistics.median(times[key]), statistics.median(peaks[key])
                print(f"| {str(dtype).removeprefix('torch.')} | {tokens} | {name} | {rank} | {t:.2f} | "
                      f"{t / t_dense:.2f} | {p / 2**20:.0f} | {p / p_dense:.2f} | {diff:.1e} |")
            del q, k, v, outs
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
