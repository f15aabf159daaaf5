"""Context parallelism against cp = 1: the longest sequence a fixed per-rank memory budget takes, and
the step time at the same tokens per rank (interleaved rounds).

1. **Longest T in a budget.** The memory measured is ``bench_context_parallel.py``'s: the bytes
   autograd saves for the backward pass in one training forward, per rank, each storage once,
   parameters left out (the activation memory a step holds between its forward and its backward;
   no allocator noise, any device). For T on a grid of ``--step`` tokens up to ``--max-tokens``,
   the largest rank's bytes at cp 1 (the dense model, transformers' SDPA) and at cp 2; reported:
   the longest T whose bytes fit ``--budget-mib`` per rank, at each cp, and their ratio (goal: 2).
   Left out, as in docs/context-parallelism.md: what one layer's attention holds while it runs
   (cp > 1: the gathered K/V and the ``T/cp x T`` boolean mask; cp 1: SDPA's own workspace).
2. **Step time at the same tokens per rank.** cp 1 runs a sequence of ``t`` tokens, cp 2 a sequence
   of ``2t`` (each rank ``t``): forward, backward, AdamW step. Rounds alternate, each timed with the
   other layout idle: in one world of 2 gloo ranks, rank 0 runs the dense step alone (rank 1 waits
   at a barrier), then both run the context-parallel step. Reported: each round's times, the median
   ratio cp 2 / cp 1 (1.0: context parallelism doubles the sequence for the same time per step),
   and the same with cp 1 at ``2t`` (one sequence of ``2t`` on one rank against two ranks).
   On this CPU machine the gloo collectives and the mask-based attention (no flash kernel) weigh
   more than they would on GPUs with NCCL: the figures bound nothing on a GPU.

Model: ``bench_context_parallel._model`` (a random Llama, float32, 8 query / 4 KV heads). Run:
``python benchmarks/bench_cp_budget.py`` (about 2 minutes on 2 CPU cores). Results:
docs/benchmarks.md, with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_context_parallel import _model, _Saved  # noqa: E402


def _saved_bytes(model, batch) -> int:
    """The bytes one training forward saves for backward (no backward: only the forward is needed)."""
    saved = _Saved(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = model(**batch).loss
    del loss
    return saved.total()


def _step(model, batch, opt) -> float:
    """One training step (forward, backward, AdamW); its wall time in seconds."""
    start = time.perf_counter()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _rank(rank: int, store_path: str, args, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        import tpify
        from tpify.context_parallel import split_batch

        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        mesh = tpify.init_mesh(1, cp_size=2, device_type="cpu")

        def ids(tokens):
            return torch.randint(3, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))

        # 1. bytes saved per rank on the grid: cp 1 on rank 0 (rank 1 idle), cp 2 on both
        memory = {}
        for tokens in range(args.step, args.max_tokens + 1, args.step):
            if rank == 0:
                batch = {"input_ids": ids(tokens), "labels": ids(tokens)}
                dense = _saved_bytes(_model(args.layers, args.hidden), batch)
            dist.barrier()
            model = tpify.parallelize(_model(args.layers, args.hidden), mesh=mesh)
            split = split_batch({"input_ids": ids(tokens), "labels": ids(tokens)}, model)
            mine = torch.tensor([_saved_bytes(model, split)])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            if rank == 0:
                memory[tokens] = (dense, int(mine))
        # 2. step time, interleaved: dense at t and at 2t (rank 0 alone), context-parallel at 2t (both ranks)
        t = args.tokens_per_rank
        models = {}
        if rank == 0:
            for tokens in (t, 2 * t):
                m = _model(args.layers, args.hidden)
                models[tokens] = (m, torch.optim.AdamW(m.parameters(), lr=1e-5),
                                  {"input_ids": ids(tokens), "labels": ids(tokens)})
        cp_model = tpify.parallelize(_model(args.layers, args.hidden), mesh=mesh)
        cp_opt = torch.optim.AdamW(cp_model.parameters(), lr=1e-5)
        cp_batch = split_batch({"input_ids": ids(2 * t), "labels": ids(2 * t)}, cp_model)
        rounds = []
        for r in range(args.rounds + 1):  # round 0: warm-up, not reported
            times = {}
            for tokens in (t, 2 * t):
                if rank == 0:
                    m, opt, batch = models[tokens]
                    times[f"cp1 T={tokens}"] = _step(m, batch, opt)
                dist.barrier()
            mine = torch.tensor([_step(cp_model, cp_batch, cp_opt)])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            times[f"cp2 T={2 * t}"] = float(mine)
            dist.barrier()
            if r:
                rounds.append(times)
        results.put((rank, (memory, rounds)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=160.0, help="bytes saved per rank allowed (MiB)")
    parser.add_argument("--step", type=int, default=1024, help="the grid of sequence lengths (tokens)")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--tokens-per-rank", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, str(Path(tmp) / "store"), args, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    errors = [v for v in got.values() if isinstance(v, str)]
    if errors:
        raise RuntimeError(errors[0])
    memory, rounds = got[0]
    print(f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs; Llama {args.layers} layers, "
          f"hidden {args.hidden}, 8/4 heads, float32, one sequence per step")
    print("\n| T | cp 1: MiB saved per rank | cp 2: MiB saved per rank (largest rank) | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens, (dense, cp) in sorted(memory.items()):
        print(f"| {tokens} | {dense / 2**20:.1f} | {cp / 2**20:.1f} | {cp / dense:.3f} |")
    budget = args.budget_mib * 2**20
    longest = {i: max([T for T, v in memory.items() if v[i] <= budget], default=0) for i in (0, 1)}
    ratio = longest[1] / longest[0] if longest[0] else float("nan")
    print(f"\nbudget {args.budget_mib:.0f} MiB per rank (grid of {args.step} tokens up to {args.max_tokens}): longest "
          f"T at cp 1 = {longest[0]}, at cp 2 = {longest[1]}: ratio {ratio:.2f}")
    t = args.tokens_per_rank
    print(f"\nstep time (forward, backward, AdamW), s; {args.rounds} interleaved rounds after one warm-up")
    keys = list(rounds[0])
    print("| round | " + " | ".join(keys) + " |")
    print("| ---: |" + " ---: |" * len(keys))
    for i, times in enumerate(rounds, 1):
        print(f"| {i} | " + " | ".join(f"{times[k]:.3f}" for k in keys) + " |")
    same_rank = statistics.median(r[f"cp2 T={2 * t}"] / r[f"cp1 T={t}"] for r in rounds)
    same_seq = statistics.median(r[f"cp2 T={2 * t}"] / r[f"cp1 T={2 * t}"] for r in rounds)
    print(f"\nmedian ratio, the same {t} tokens per rank: cp 2 (T={2 * t}) / cp 1 (T={t}) = {same_rank:.2f}")
    print(f"median ratio, the same sequence T={2 * t}: cp 2 / cp 1 = {same_seq:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
