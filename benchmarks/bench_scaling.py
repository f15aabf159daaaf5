"""Memory per rank and step time of data parallelism on a tensor-parallel model: DDP and FSDP2 x TP.

Model: a random float32 Llama (``LlamaForCausalLM``, transformers 5.23), 4 layers, hidden 256,
8 attention heads / 4 KV heads, intermediate 688, vocabulary 16000, untied (11.1 M parameters,
74 % of them in the embedding and the LM head); batch 4 x 128 tokens per DP replica. One step =
``model(ids, labels=ids).loss.backward()``, ``AdamW.step()``, ``zero_grad(set_to_none=True)``.

Layouts ``dp x tp``: 1x1 (plain transformers, the dense reference), 1x2, 1x4 (tpify alone: no
data-parallel engine at dp 1), 2x1 and 2x2, each with

* ``DDP``: :func:`tpify.replicate_data_parallel` (DDP over the DP group, default arguments);
* ``FSDP2``: :func:`tpify.shard_data_parallel` (``fully_shard`` per block and on the model over
  ``dp_shard = dp``);
* ``sync``: the older path, :func:`tpify.training.sync_gradients` after the backward.

Every layout and engine runs in its own spawned gloo world of ``dp * tp`` ranks (a fresh process
per rank, 1x1 too, so nothing of another run stays resident). Per rank, after two steps (the optimizer
state exists):

* **state bytes**, measured from the tensors: the bytes of the distinct storages of the
  parameters (the local shard of a DTensor), of their gradients and of AdamW's state tensors
  (``exp_avg``, ``exp_avg_sq``, ``step``); a storage shared by two tensors (tied weights, a
  gradient that is a view of a DDP bucket) counts once. ``replicated`` is the part of the
  parameters tpify keeps whole on every TP rank (the RMSNorm weights, the one-dimensional
  parameters of this model), as held on the rank.
* **step peak**: the process's peak resident set during the third step: the kernel's high-water
  mark (``VmHWM``) reset just before the step (``/proc/self/clear_refs``, value 5), read after
  it, minus the resident set before it (``VmRSS``). It covers activations, the gradients, FSDP2's
  all-gathered blocks, sync_gradients' flat copy; DDP's buckets live for the whole run and are in
  the resident set before the step. ``MALLOC_MMAP_THRESHOLD_`` is set
  to 128 KiB in the ranks so that glibc returns large freed blocks at once (otherwise a freed
  block stays resident and hides the next peak).

Step time (``--rounds``, default 5): dp 2 x tp 1, DDP against ``sync_gradients``, two models in
one world of 2 ranks, each round ``--steps`` timed steps of one then of the other (the order
alternating every round, after one untimed warm-up step each); a step's time is the slower
rank's (a barrier before, untimed). Reported: medians and minima, and the ratios DDP / sync.

The machine is shared (2 cores, other jobs): ranks run at ``nice 19`` if the caller does
(``nice -n 19 python benchmarks/bench_scaling.py``); timings are noisy, byte counts are not.

Usage::

    python benchmarks/bench_scaling.py                 # the tables, markdown to benchmarks/out/scaling.md
    python benchmarks/bench_scaling.py --quick         # a tiny model, 1 round (smoke)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

FULL = dict(layers=4, hidden=256, heads=8, kv_heads=4, intermediate=688, vocab=16000, batch=4, seq=128)
QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=4, intermediate=128, vocab=1000, batch=2, seq=32)
LAYOUTS = [(1, 1, "dense"), (1, 2, "tpify"), (1, 4, "tpify"), (2, 1, "DDP"), (2, 1, "FSDP2"), (2, 1, "sync"),
           (2, 2, "DDP"), (2, 2, "FSDP2"), (2, 2, "sync")]
MIB = 2 ** 20


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _model(shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                                        max_position_embeddings=shape["seq"], tie_word_embeddings=False))


def _build(engine: str, tp: int, shape: dict):
    """``(step_model, tp_model, after_backward)`` for one engine."""
    import tpify
    from tpify.training import sync_gradients

    dense = _model(shape)
    if engine == "dense":
        return dense, dense, None
    par = tpify.parallelize(dense, tp_size=tp)
    if engine == "DDP":
        return tpify.replicate_data_parallel(par), par, None
    if engine == "FSDP2":
        return tpify.shard_data_parallel(par), par, None
    if engine == "sync":
        return par, par, lambda: sync_gradients(par)
    return par, par, None


def _step(model, opt, ids, after_backward) -> None:
    model(ids, labels=ids).loss.backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _state_bytes(tp_model, opt) -> dict:
    """Bytes of the distinct storages of parameters, gradients and optimizer state on this rank."""
    import torch

    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            s = _local(t).untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                continue
            seen.add(s.data_ptr())
            n += s.nbytes()
        return n

    params = list(tp_model.parameters())
    replicated = sum(_local(p).numel() * _local(p).element_size() for p in params if p.dim() == 1)  # the norms
    out = {"params": total(params)}
    out["grads"] = total(p.grad for p in params if p.grad is not None)
    out["optimizer"] = total(v for state in opt.state.values() for v in state.values())
    out["replicated"] = replicated
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["n_local"] = sum(_local(p).numel() for p in params)
    return out


def _memory_worker(rank: int, world: int, store: str, engine: str, tp: int, shape: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model, tp_model, after = _build(engine, tp, shape)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        dp_rank = rank // tp
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]),
                            generator=torch.Generator().manual_seed(1 + dp_rank))
        for _ in range(2):
            _step(model, opt, ids, after)
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _step(model, opt, ids, after)
        peak = _status("VmHWM") - before
        # The step's gradients are gone (zero_grad); count them as they are between backward and step.
        model(ids, labels=ids).loss.backward()
        if after is not None:
            after()
        opt.step()
        figures = _state_bytes(tp_model, opt)
        figures.update(step_peak=peak, rss=before, rank=rank)
        Path(out, f"{engine}-{world // tp}x{tp}-rank{rank}.json").write_text(json.dumps(figures))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _time_worker(rank: int, world: int, store: str, shape: dict, rounds: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        runs = {}
        for engine in ("DDP", "sync"):
            model, _, after = _build(engine, 1, shape)
            runs[engine] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), after)
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]),
                            generator=torch.Generator().manual_seed(1 + rank))
        times = {engine: [] for engine in runs}
        for engine, (model, opt, after) in runs.items():
            _step(model, opt, ids, after)  # warm-up
        for r in range(rounds):
            for engine in (("DDP", "sync") if r % 2 == 0 else ("sync", "DDP")):
                model, opt, after = runs[engine]
                for _ in range(steps):
                    dist.barrier()
                    start = time.perf_counter()
                    _step(model, opt, ids, after)
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    times[engine].append(float(took))
        if rank == 0:
            Path(out, "times.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, str(Path(tmp) / "store"), *args), nprocs=world, join=True)


def _loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(OUT / "scaling.md"))
    parser.add_argument("--skip-time", action="store_true", help="memory tables only")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    rounds = 1 if args.quick else args.rounds
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    sys.path.insert(0, str(ROOT))
    load_before = _loadavg()
    rows = []
    with tempfile.TemporaryDirectory() as res:
        for dp, tp, engine in LAYOUTS:
            world = dp * tp
            _spawn(_memory_worker, world, engine, tp, shape, res)  # world 1 too: a fresh process
            ranks = [json.loads(Path(res, f"{engine}-{dp}x{tp}-rank{r}.json").read_text()) for r in range(world)]
            rows.append((dp, tp, engine, ranks))
            print(f"{dp}x{tp} {engine}: done", flush=True)
        times = None
        if not args.skip_time:
            _spawn(_time_worker, 2, shape, rounds, args.steps, res)
            times = json.loads(Path(res, "times.json").read_text())
    dense = rows[0][3][0]
    lines = [f"## Scaling out: memory per rank and step time ({datetime.date.today()}, {platform.machine()}, "
             f"{os.cpu_count()} cores, shared; load {load_before} before, {_loadavg()} after)", "",
             f"Llama {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']}/{shape['kv_heads']} heads, "
             f"intermediate {shape['intermediate']}, vocab {shape['vocab']}, untied, float32, AdamW; "
             f"{dense['n_local'] / 1e6:.2f} M parameters; batch {shape['batch']} x {shape['seq']} per DP replica.",
             "", "Per rank (the largest over the ranks), MiB; bytes/param = state bytes / dense parameter count.", "",
             "| dp x tp | engine | params | grads | optimizer | state total | bytes/param | x dense/(dp*tp) "
             "| replicated params | resident before the step | step peak above it |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    n_dense = dense["n_local"]
    for dp, tp, engine, ranks in rows:
        worst = max(ranks, key=lambda r: r["total"])
        ideal = dense["total"] / (dp * tp)
        peak = max(r["step_peak"] for r in ranks)
        lines.append(f"| {dp}x{tp} | {engine} | {worst['params'] / MIB:.1f} | {worst['grads'] / MIB:.1f} | "
                     f"{worst['optimizer'] / MIB:.1f} | {worst['total'] / MIB:.1f} | {worst['total'] / n_dense:.2f} | "
                     f"{worst['total'] / ideal:.2f} | {worst['replicated'] / 1024:.1f} KiB | "
                     f"{max(r['rss'] for r in ranks) / MIB:.0f} | {peak / MIB:.1f} |")
    fsdp22 = next(r for r in rows if r[:3] == (2, 2, "FSDP2"))[3]
    worst = max(r["total"] for r in fsdp22)
    goal = 1.1 * dense["total"] / 4 + 4 * dense["replicated"]
    lines += ["", f"FSDP2 x TP at 2x2: {worst / MIB:.2f} MiB per rank; goal 1.1 x dense/4 + the replicated norms' "
              f"state (4 x their dense bytes: parameter, gradient, two AdamW moments) = {goal / MIB:.2f} MiB: "
              f"{'met' if worst <= goal else 'NOT MET'} ({worst / (dense['total'] / 4):.3f} x dense/4)."]
    if times:
        med = {k: statistics.median(v) for k, v in times.items()}
        lines += ["", f"Step time at dp 2 x tp 1, {rounds} interleaved rounds x {args.steps} steps (slowest rank, "
                  f"seconds; the machine is shared, figures are noisy): DDP median {med['DDP']:.3f} "
                  f"(min {min(times['DDP']):.3f}), sync_gradients median {med['sync']:.3f} (min {min(times['sync']):.3f}); "
                  f"DDP / sync = {med['DDP'] / med['sync']:.2f} (medians), {min(times['DDP']) / min(times['sync']):.2f} (minima)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
