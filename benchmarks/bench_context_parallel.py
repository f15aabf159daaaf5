"""Activation memory per rank of one training step under context parallelism, against cp = 1.

What is measured: the bytes autograd saves for the backward pass during one training forward
(``model(**batch).loss``), per rank: every tensor a ``torch.autograd.graph.saved_tensors_hooks``
pack hook sees, counted once per storage, parameters left out. That is the activation memory a
step holds at its peak (between the forward and the backward), without the allocator's noise, on
any device. Also per rank: the bytes of the attention's saved tensors alone (those saved inside
the attention function), and the loss against cp = 1 (the same weights and batch: equal to ~1e-6
in float32).

Model: a random Llama (``LlamaForCausalLM``), float32, ``--layers`` layers, hidden ``--hidden``,
8 query / 4 KV heads, intermediate ``2.75 x hidden``, vocabulary 8192; one sequence of ``T``
tokens per step (``--tokens``, several). cp = 1 is the dense model with transformers' SDPA
attention; cp = 2 and 4 are ``tpify.parallelize(model, mesh=tpify.init_mesh(1, cp_size=cp))``,
each a world of ``cp`` gloo ranks on this machine (``GLOO_SOCKET_IFNAME=lo``, one thread per
rank), the batch split by ``tpify.context_parallel.split_batch``. Reported: the largest rank's
bytes and the ratio to cp = 1 (goal: ``1 / cp``).

Run: ``python benchmarks/bench_context_parallel.py --tokens 2048 4096`` (about a minute on 2 CPU
cores); ``--cp-attention ring`` (or ``alltoall``) runs the cp > 1 models with that attention.

``--attention`` instead compares the three forms of the attention over the split sequence
(``cp_attention="allgather" | "ring" | "alltoall"``) on one layer's ``q, k, v`` (``(1, 8, T/cp,
64)`` queries, 4 K/V heads, float32, this rank's tokens): per rank, the peak bytes allocated
during its forward and backward above the inputs, and the bytes still held between the forward
and the backward (what the layer keeps, its output included), both from a dispatch mode that
follows every storage created (:class:`_PeakBytes`; the allocator's view, on any device), the
largest rank; and the time of forward + backward (median over the rounds). Rounds interleaved:
each round runs every form once, in turn, on the same ranks. Ratios against ``allgather`` in
the same run. ``python benchmarks/bench_context_parallel.py --attention --tokens 4096 8192``.
Results go in docs/context-parallelism.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _PeakBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode (each once), and their peak.

    After every op, storages whose last reference died are dropped (``StorageWeakRef.expired``)
    and the op's new output storages added: the allocator's view of the tensors the code holds,
    without its caching, on any device. Backward ops run inside the mode too."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=int(2.75 * hidden), vocab_size=8192, max_position_embeddings=1 << 17)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


class _Saved:
    """A ``saved_tensors_hooks`` context counting the bytes saved for backward, once per storage."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}
        self.attention = 0
        self.in_attention = False

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen[key] = storage.nbytes()
            if self.in_attention:
                self.attention += storage.nbytes()
        return t

    def total(self) -> int:
        return sum(self.seen.values())


def _attention_marker(model, saved: _Saved):
    """Pre- and post-hooks on every attention module that mark its tensors as the attention's."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            handles.append(module.register_forward_pre_hook(lambda m, a: setattr(saved, "in_attention", True)))
            handles.append(module.register_forward_hook(lambda m, a, o: setattr(saved, "in_attention", False)))
    return handles


def _step(model, batch) -> tuple[int, int, float]:
    saved = _Saved(model.parameters())
    handles = _attention_marker(model, saved)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = model(**batch).loss
    for h in handles:
        h.remove()
    loss.backward()
    return saved.total(), saved.attention, float(loss.detach())


def _rank(rank: int, cp: int, store_path: str, args, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        import tpify
        from tpify.context_parallel import split_batch

        out = []
        if cp > 1:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
            mesh = tpify.init_mesh(1, cp_size=cp, device_type="cpu")
        for tokens in args.tokens:
            model = _model(args.layers, args.hidden)
            ids = torch.randint(3, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
            batch = {"input_ids": ids, "labels": ids}
            if cp > 1:
                model = tpify.parallelize(model, mesh=mesh, cp_attention=args.cp_attention)
                batch = split_batch(batch, model)
            out.append((tokens, *_step(model, batch)))
        results.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _CausalAttention(torch.nn.Module):
    """A stand-in attention module for :func:`_attention_rank` (what the attention function reads of it)."""

    is_causal = True


def _attention_round(mode: str, call, q, k, v, grad) -> tuple[int, int, float]:
    """``(peak bytes, bytes held after forward, seconds)`` of one forward + backward of ``mode``."""
    import time

    from tpify.hooks.context_parallel import CALL_KWARG, context_parallel_attention

    call.mode, call.calls = mode, 0
    dist.barrier(call.group)
    start = time.perf_counter()
    tracker = _PeakBytes()
    with tracker:
        out, _ = context_parallel_attention(_CausalAttention(), q, k, v, None, **{CALL_KWARG: call})
        held = tracker.now
        out.backward(grad)
        del out
    seconds = time.perf_counter() - start
    q.grad = k.grad = v.grad = None
    return tracker.peak, held, seconds


def _attention_rank(rank: int, cp: int, store_path: str, args, results) -> None:
    """One rank of the attention comparison: ``[(T, mode, round, peak, held, seconds), ...]``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        from tpify.context_parallel import sequence_order
        from tpify.hooks.context_parallel import ContextParallelCall

        dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
        group = dist.new_group(list(range(cp)))
        out = []
        for tokens in args.tokens:
            gathered = sequence_order(tokens, cp)[None]  # one document: positions 0 .. T - 1
            call, _ = ContextParallelCall.from_positions(group, cp, rank, gathered)
            g = torch.Generator().manual_seed(rank)
            local = tokens // cp
            q, k, v = (torch.randn(1, heads, local, args.head_dim, generator=g, requires_grad=True)
                       for heads in (8, 4, 4))
            grad = torch.randn(1, local, 8, args.head_dim, generator=g)
            for r in range(args.rounds):
                for mode in args.modes:
                    out.append((tokens, mode, r, *_attention_round(mode, call, q, k, v, grad)))
        results.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attention_table(args) -> None:
    """Print the attention comparison, per T and cp: every form against ``allgather``."""
    import statistics

    print(f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs; one layer's attention, "
          f"8 query / 4 K/V heads of {args.head_dim}, float32, one sequence; {args.rounds} interleaved rounds")
    print("| T | cp | attention | peak MiB per rank (fwd + bwd) | ratio | held after forward MiB | ratio | "
          "time fwd + bwd s | ratio |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cp in args.cp:
        if cp == 1:
            continue
        rows = _spawn(_attention_rank, cp, args)
        for tokens in args.tokens:
            stats = {}
            for mode in args.modes:
                mine = [row for row in rows if row[0] == tokens and row[1] == mode]
                rounds = {}
                for row in mine:  # the largest rank in each round, then the median over rounds
                    old = rounds.get(row[2], (0, 0, 0.0))
                    rounds[row[2]] = tuple(max(a, b) for a, b in zip(old, row[3:]))
                stats[mode] = [statistics.median(r[i] for r in rounds.values()) for i in range(3)]
            base = stats.get("allgather", next(iter(stats.values())))
            for mode, (peak, held, seconds) in stats.items():
                print(f"| {tokens} | {cp} | {mode} | {peak / 2**20:.1f} | {peak / base[0]:.3f} | {held / 2**20:.1f} | "
                      f"{held / base[1]:.3f} | {seconds:.3f} | {seconds / base[2]:.2f} |")


def _spawn(target, cp: int, args) -> list:
    """Run ``target(rank, cp, store, args, results)`` on ``cp`` gloo ranks; every rank's rows."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, cp, str(Path(tmp) / "store"), args, results)) for r in range(cp)]
        for p in procs:
            p.start()
        got = [results.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
    errors = [v for _, v in got if isinstance(v, str)]
    if errors:
        raise RuntimeError(errors[0])
    return [row for _, rows in got for row in rows]


def _run(cp: int, args) -> dict:
    """``{T: (max bytes over ranks, max attention bytes, loss)}`` for one cp size."""
    by_t = {}
    for tokens, total, attention, loss in _spawn(_rank, cp, args):
        old = by_t.get(tokens, (0, 0, loss))
        by_t[tokens] = (max(old[0], total), max(old[1], attention), loss)
    return by_t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--cp-attention", default="allgather", choices=("allgather", "ring", "alltoall"))
    parser.add_argument("--attention", action="store_true", help="compare the three attention forms alone")
    parser.add_argument("--modes", nargs="+", default=["allgather", "ring", "alltoall"])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.attention:
        _attention_table(args)
        return 0
    print(f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs; Llama {args.layers} layers, "
          f"hidden {args.hidden}, 8/4 heads, float32, one sequence per step")
    table = {cp: _run(cp, args) for cp in sorted(set(args.cp) | {1})}
    print("| T | cp | activation bytes per rank (MiB) | ratio to cp 1 | attention's (MiB) | ratio | loss - cp 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        base, base_attn, base_loss = table[1][tokens]
        for cp, rows in table.items():
            total, attention, loss = rows[tokens]
            print(f"| {tokens} | {cp} | {total / 2**20:.1f} | {total / base:.3f} | {attention / 2**20:.1f} | "
                  f"{attention / max(base_attn, 1):.3f} | {loss - base_loss:+.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
