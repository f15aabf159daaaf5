"""Pipeline parallelism (:mod:`tpify.pipeline`): the bubble, the memory per rank, the step time against tp.

``python benchmarks/bench_pipeline.py [--part a|b|c|all]`` on CPU ranks over gloo (``tests/tputil.spawn``:
spawned processes, a FileStore, one thread each). Prints markdown tables (docs/benchmarks.md,
"Pipeline parallelism").

(a) **Bubble fraction** of torch's schedules, the ones :func:`tpify.pipeline.build_schedule` builds
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` over ``PipelineStage``, ``scale_grads=False``),
at pp 2 and 4, m = 4, 8, 16 microbatches. The stages' compute is controlled: each stage is a
``Linear(8, 8)`` whose forward sleeps ``t_f`` and whose backward sleeps ``t_b = 2 t_f`` (an autograd
function), with two stages of half the time each per rank when interleaved, so every rank has the
same work per microbatch. Why sleeps: this machine has 2 cores, and 4 compute-bound ranks cannot run
in parallel on it, so a compute-bound stage would measure the CPU scheduler, not the pipeline; a
sleeping rank takes no core. Measured per rank: busy = the sum of the stage's own forward and
backward intervals (timestamps inside the autograd function), step = from a barrier before
``schedule.step`` to a barrier after it (the step ends for every rank when the last is done); bubble = 1 - busy / step, the mean over ranks, the median over 5
steps after one warm-up. Analytic (Narayanan et al., arXiv:2104.04473, section 2.2):
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved with ``v = 2``
stages per rank (as ``idle / (idle + busy)``; the paper's ``(p-1)/m`` divides by the busy time
alone). The measured fraction also holds what the schedule costs itself (send/recv of the
activations over gloo, Python dispatch): the difference to the analytic figure is that overhead.

(b) **Bytes per rank** of parameters, gradients and AdamW state at pp x tp (pp 2, 4; tp 1, 2) for
the ``llama`` recipe on transformers' default ``LlamaConfig`` (32 layers, hidden 4096, vocabulary
32000: 6.7 B parameters, float32), from :func:`tpify.authoring.plan_pipeline.pipeline_report` on the
meta device (tests/unit/test_cli_plan_pipeline.py checks its bytes against the real stages at tp 1,
tests/distributed/test_finetune_pipeline.py against ``tpify finetune --pp 2 --tp 2``'s ranks); the
largest rank against ``dense / (pp tp)``. Gradients: the parameters' bytes again; AdamW: twice.

(c) **Step time** of pp 2 (1F1B, 4 microbatches) against tp 2 at the same world size 2, on a random
Llama (8 layers, hidden 256, 8 heads / 4 KV heads, intermediate 688, vocabulary 8000; batch 8 x 128
tokens, float32): forward, backward, global-norm clip, AdamW. Both in the same spawned job, the
same weights, interleaved rounds (pp step, tp step, ...), 2 warm-up rounds then 8 timed; the
median of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import tputil  # noqa: E402  (gloo rank spawning shared with the tests)

T_F = 0.020  # seconds a stage's forward sleeps per microbatch (the backward: 2 T_F)
MICROBATCHES = (4, 8, 16)


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``t`` and backward ``2 t``; both record their interval."""

    @staticmethod
    def forward(ctx, x, t, log):
        ctx.t, ctx.log = t, log
        a = time.perf_counter()
        time.sleep(t)
        log.append(time.perf_counter() - a)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        a = time.perf_counter()
        time.sleep(2 * ctx.t)
        ctx.log.append(time.perf_counter() - a)
        return g, None, None


class _Stage(torch.nn.Module):
    def __init__(self, t: float, log: list):
        super().__init__()
        self.lin, self.t, self.log = torch.nn.Linear(8, 8), t, log

    def forward(self, x):
        return _Sleep.apply(self.lin(x), self.t, self.log)


def _bubble_body(rank, world, cases):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
    out = []
    for schedule, m in cases:
        v = 2 if schedule == "Interleaved1F1B" else 1
        log: list[float] = []
        stages = [PipelineStage(_Stage(T_F / v, log), rank + k * world, world * v, torch.device("cpu"))
                  for k in range(v)]
        sched = classes[schedule](stages if v > 1 else stages[0], m, loss_fn=lambda y, t: y.sum(),
                                  scale_grads=False)
        fractions = []
        for it in range(6):
            x = torch.randn(2 * m, 8)
            log.clear()
            dist.barrier()
            a = time.perf_counter()
            args = (x,) if rank == 0 else ()
            target = torch.zeros(2 * m, 8) if rank == world - 1 else None
            sched.step(*args, target=target)
            dist.barrier()  # the step ends when the last rank is done: a rank that finishes early idles till then
            step = time.perf_counter() - a
            if it:
                fractions.append(1 - sum(log) / step)
        out.append((schedule, m, statistics.median(fractions)))
    return out


def part_a() -> list[str]:
    rows = ["| schedule | pp | m | measured bubble | analytic | measured - analytic |", "| --- | --- | --- | --- | --- | --- |"]
    for pp in (2, 4):
        cases = [(s, m) for s in ("GPipe", "1F1B", "Interleaved1F1B") for m in MICROBATCHES]
        per_rank = tputil.spawn(_bubble_body, pp, cases, timeout=600.0)
        for k, (s, m) in enumerate(cases):
            measured = statistics.mean(r[k][2] for r in per_rank)
            v = 2 if s == "Interleaved1F1B" else 1
            analytic = (pp - 1) / (v * m + pp - 1)
            rows.append(f"| {s} | {pp} | {m} | {measured:.3f} | {analytic:.3f} | {measured - analytic:+.3f} |")
    return rows


def part_b() -> list[str]:
    from tpify.authoring.plan_pipeline import pipeline_report

    rows = ["| pp x tp | largest rank: parameters | gradients | AdamW state | dense / (pp tp) | largest / (dense / (pp tp)) |",
            "| --- | --- | --- | --- | --- | --- |"]

    def gib(n):
        return f"{n / 2**30:.2f} GiB"

    for pp in (2, 4):
        for tp in (1, 2):
            report = pipeline_report("llama", tp, pp)
            top = max(r["rank_bytes"] for r in report["ranks"])
            ideal = report["dense_bytes"] / (pp * tp)
            rows.append(f"| {pp} x {tp} | {gib(top)} | {gib(top)} | {gib(2 * top)} | {gib(ideal)} | {top / ideal:.3f} |")
    rows.append(f"\ndense: {report['dense_bytes'] / 2**30:.2f} GiB of float32 parameters")
    return rows


def _step_body(rank, world, rounds, warmup):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import tpify
    from tpify import pipeline as pp
    from tpify.training import clip_grad_norm_

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    dense = LlamaForCausalLM(config)
    ids = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(1))
    tp_model = tpify.parallelize(copy.deepcopy(dense), tp_size=2)
    tp_opt = torch.optim.AdamW(tp_model.parameters(), lr=1e-4)
    mesh = tpify.init_mesh(1, pp_size=2, device_type="cpu")
    pp_model = tpify.parallelize(copy.deepcopy(dense), mesh=mesh)
    sched = pp.pipeline(pp_model, mesh, schedule="1F1B", n_microbatches=4)
    del pp_model, dense
    pp_opt = torch.optim.AdamW(pp.parameters(sched), lr=1e-4)
    first = any(s.is_first for s in pp.stages_of(sched))

    def pp_step():
        pp.step(sched, input_ids=ids if first else None, labels=None if first else ids)
        pp.clip_grad_norm_(sched, 1.0)
        pp_opt.step()
        pp_opt.zero_grad(set_to_none=True)

    def tp_step():
        tp_model(input_ids=ids, labels=ids).loss.backward()
        clip_grad_norm_(tp_model, 1.0)
        tp_opt.step()
        tp_opt.zero_grad(set_to_none=True)

    import torch.distributed as dist

    times = {"pp": [], "tp": []}
    for r in range(warmup + rounds):
        for name, fn in (("pp", pp_step), ("tp", tp_step)):
            dist.barrier()
            a = time.perf_counter()
            fn()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - a)
    return times


def part_c() -> list[str]:
    times = tputil.spawn(_step_body, 2, 8, 2, timeout=600.0)[0]
    p, t = statistics.median(times["pp"]), statistics.median(times["tp"])
    return ["| layout (world 2) | median step | ratio to tp 2 |", "| --- | --- | --- |",
            f"| tp 2 | {t * 1e3:.0f} ms | 1.00 |", f"| pp 2 (1F1B, m = 4) | {p * 1e3:.0f} ms | {p / t:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    args = parser.parse_args()
    print(f"# bench_pipeline: torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for part, fn in (("a", part_a), ("b", part_b), ("c", part_c)):
        if args.part in (part, "all"):
            t0 = time.perf_counter()
            print("\n".join(fn()))
            print(f"({part}: {time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
