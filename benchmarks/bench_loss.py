"""Benchmark the vocab-parallel loss: peak memory per rank, and the collectives of a step.

(a) Peak memory of the LM head + loss, forward and backward, per rank, at tp = 1, 2, 4:
    ``logits = head(X)`` with ``X`` ``(B*T, H)``, the loss, ``loss.backward()`` (which also makes
    the head's weight gradient and ``dX``). Compared, in the same run, with Hugging Face's
    full-logit loss: a dense ``nn.Linear`` to all ``V`` logits and ``F.cross_entropy`` (the tp=1
    baseline), and with what a parallelized model did before tpify.loss (logits gathered with
    ``gather_output=True``, then ``F.cross_entropy``).
    How memory is measured: ``torch.profiler`` with ``profile_memory=True`` records every
    allocation and free of the CPU allocator (one ``[memory]`` event each, with its size and
    time). Summing the events in time order gives the bytes allocated above what existed before
    the measured block; its maximum is the peak. This counts every tensor the block allocates,
    including autograd's saved tensors, temporaries and communication buffers, and nothing
    else (no allocator caching or Python objects), so it is the honest analogue of
    ``torch.cuda.max_memory_allocated`` on a CPU-only machine. Weights and ``X`` exist before the
    block and are not counted; the weight gradient is.
(b) The collectives one training step (forward with ``labels=``, backward) of a small GPT-2
    issues at tp=2 (``tpify.comm.count_collectives``), against the analytic minimum of
    docs/mechanics.md, "Communication budget": per layer 4 all-reduces of ``B*T*H``; per step the
    embedding's and the tied head's all-reduce (``B*T*H`` each) and the loss's 2 (``B*T`` and
    ``2*B*T`` values).

(c) The chunked vocab-parallel linear cross-entropy (``tpify.vocab_parallel_linear_cross_entropy``)
    against today's vocab-parallel loss (the head's ``(N, V/p)`` logits shard, then
    ``tpify.vocab_parallel_cross_entropy``) and, at tp = 1, HF's dense loss (``F.cross_entropy``
    of the full ``(N, V)`` logits): peak memory per rank (the profiler method of (a)) and time per
    step (the slowest rank's wall time), of head + loss + ``backward``, at Llama-3's vocabulary
    (V = 128,256), H = 2,048, N = 4,096 and 8,192 tokens, tp = 1, 2, 4, float32. Each
    configuration runs in its own subprocess (its own gloo ranks), one at a time; rounds are
    interleaved (every configuration once per round) and times are the median over rounds;
    ratios are against the baselines of the same run. ``--scale s`` divides N, H and the chunk
    size by ``s`` (V unchanged): every term of the peak (the ``N x V/p`` logits and buffers, the
    ``c x V/p`` chunk buffers, the ``V/p x H`` weight gradient) then shrinks by ``s``, so the
    memory ratios are those of the full size (to the ``N x H`` input gradient, under 2% of any
    peak here), while the matmuls cost ``s^2`` less (so times at ``--scale`` > 1 overstate the
    per-chunk overhead of small chunks: measure time at full size). ``--chunk`` is the chunked
    loss's chunk at full size (default ``auto``: ``tpify.loss.default_chunk_size`` of the full N
    and H, scaled like N); ``--chunks`` adds a chunk-size sweep at the largest N, tp = 1;
    ``--methods`` runs a subset.

Writes benchmarks/out/loss.md and benchmarks/out/loss_memory.png ((a), (b)), and
benchmarks/out/loss_chunked*.md/.jsonl ((c)), prints the tables.
Run: ``python benchmarks/bench_loss.py`` ((a) and (b), about a minute on 2 CPU cores);
``nice -n 19 python benchmarks/bench_loss.py --part chunked [--scale 8] [--rounds 3]`` ((c); at
full size about 3 minutes per configuration and round on 2 CPU cores, 15 GB free for HF dense at
N = 8,192: a configuration that does not fit in the memory available is skipped and said so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import tputil  # noqa: E402  (gloo rank spawning shared with the tests)

OUT = ROOT / "benchmarks" / "out"
TOKENS, HIDDEN, VOCAB = 1024, 64, 50257  # N = B*T tokens; GPT-2's vocabulary (odd: padded for tp > 1)


def _peak_bytes(fn) -> int:
    """Peak bytes allocated above the starting point while ``fn`` runs (CPU allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _memory_body(rank, world):
    from torch import nn

    import tpify
    from tpify.layers import ColumnParallelLinear
    from tpify.sharding import pad_vocab_size

    torch.manual_seed(0)
    dense = nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    target = torch.randint(0, VOCAB, (TOKENS,))
    padded = pad_vocab_size(VOCAB, world) if VOCAB % world else None
    sharded = ColumnParallelLinear.from_dense(dense, None, padded_out_features=padded)
    gathered = ColumnParallelLinear.from_dense(dense, None, gather_output=True, padded_out_features=padded)

    def ours():
        logits = sharded(x)  # (N, Vp/p)
        tpify.vocab_parallel_cross_entropy(logits, target, vocab_size=VOCAB).backward()

    def gathered_hf():
        F.cross_entropy(gathered(x).float(), target).backward()  # logits (N, V) on every rank

    def dense_hf():
        F.cross_entropy(dense(x).float(), target).backward()

    out = {}
    for name, fn in (("ours", ours), ("gathered", gathered_hf), ("dense", dense_hf)):
        fn()  # warm-up (lazy init of autograd/profiler state)
        for p in (x, dense.weight, sharded.weight, gathered.weight):
            p.grad = None
        out[name] = _peak_bytes(fn)
        for p in (x, dense.weight, sharded.weight, gathered.weight):
            p.grad = None
    return out


def _comm_body(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=50257, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = tpify.parallelize(GPT2LMHeadModel(cfg), tp_size=world)
    B, T = 4, 32
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with tpify.comm.count_collectives() as ours:
        model(ids, labels=ids).loss.backward()
    model.zero_grad()
    with tpify.comm.count_collectives() as before:  # logits gathered, then HF's causal loss
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size).float(), ids[:, 1:].reshape(-1)).backward()
    L, H = cfg.n_layer, cfg.n_embd
    minimum = {"all_reduce": 4 * L + 2 + 2, "all_reduce_numel": (4 * L + 2) * B * T * H + 3 * B * T,
               "all_gather": 0, "all_gather_numel": 0}
    return {"ours": dict(ours), "before": dict(before), "minimum": minimum, "B": B, "T": T, "H": H, "L": L}


LLAMA3_VOCAB, LLAMA3_HIDDEN = 128256, 2048
METHODS = ("chunked", "today", "hf_dense")


def _chunked_body(rank, world, cfg):
    """One configuration of (c) on this rank: peak bytes and wall seconds of head + loss + backward."""
    import torch.distributed as dist

    import tpify.loss
    from tpify import comm

    torch.set_num_threads(cfg["threads"])
    n, h, v, method = cfg["tokens"], cfg["hidden"], LLAMA3_VOCAB, cfg["method"]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(n, h, generator=gen) * 0.5).requires_grad_()  # replicated: the same seed on every rank
    target = torch.randint(0, v, (n,), generator=gen)
    rows = v if method == "hf_dense" else v // world
    w = (torch.randn(rows, h, generator=torch.Generator().manual_seed(1 + rank)) * h ** -0.5).requires_grad_()

    def chunked():
        tpify.loss.vocab_parallel_linear_cross_entropy(x, w, target, vocab_size=v, chunk_size=cfg["chunk"]).backward()

    def today():  # the head as ColumnParallelLinear makes it (f, then the local matmul), then the loss
        logits = F.linear(comm.copy_to_tp_region(x, None), w)  # (N, V/p)
        tpify.vocab_parallel_cross_entropy(logits, target, vocab_size=v).backward()

    def hf_dense():  # HF's ForCausalLMLoss on the dense head's logits: upcast, F.cross_entropy
        F.cross_entropy(F.linear(x, w).float(), target).backward()

    fn = {"chunked": chunked, "today": today, "hf_dense": hf_dense}[method]
    small_x, small_t = x[:8].detach().requires_grad_(), target[:8]  # warm-up: lazy autograd/profiler state
    F.cross_entropy(F.linear(small_x, w[:16]), small_t % 16).backward()
    w.grad = None
    seconds = []

    def timed():  # timed inside the profiler (its start and the event walk are not counted)
        if world > 1:
            dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        seconds.append((time.perf_counter() - start, time.process_time() - cpu))

    peak = _peak_bytes(timed)
    return {"peak": peak, "seconds": seconds[0][0], "cpu_seconds": seconds[0][1]}


def _run_one(cfg: dict) -> dict:
    """Run one configuration in a fresh subprocess (its own ranks); the result, or why it was skipped."""
    if cfg["method"] == "hf_dense":  # N x V logits, their log-softmax and gradient, and the weight's
        need = (3 * cfg["tokens"] * LLAMA3_VOCAB + 2 * LLAMA3_VOCAB * cfg["hidden"]) * 4
        avail = _available_bytes()
        if avail < need + 2 * 2 ** 30:
            return {**cfg, "skipped": f"needs about {need / 2 ** 30:.1f} GiB, {avail / 2 ** 30:.1f} GiB available"}
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {**cfg, "skipped": f"failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one(cfg: dict) -> None:
    per_rank = tputil.spawn(_chunked_body, cfg["tp"], cfg, timeout=3600.0)
    print(json.dumps({**cfg, "peak": max(r["peak"] for r in per_rank), "seconds": max(r["seconds"] for r in per_rank),
                      "cpu_seconds": sum(r["cpu_seconds"] for r in per_rank)}))


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _chunk(args, n: int) -> int:
    """The chunk of the chunked loss at ``n`` tokens (full size): ``--chunk``, or with ``--chunk auto``
    what the loss picks by default at the full sizes (``tpify.loss.default_chunk_size``)."""
    from tpify.loss import default_chunk_size

    return default_chunk_size(n, LLAMA3_HIDDEN) if args.chunk == "auto" else int(args.chunk)


def _configs(args) -> list[dict]:
    h = LLAMA3_HIDDEN // args.scale
    threads = lambda tp: max(1, (os.cpu_count() or 1) // tp)  # noqa: E731 - every configuration uses every core
    out = []
    for n in args.tokens:
        c = _chunk(args, n) // args.scale
        for tp in args.tp:
            for method in args.methods:
                if method == "hf_dense" and tp != 1:
                    continue
                out.append({"tokens": n // args.scale, "hidden": h, "tp": tp, "method": method, "chunk": c,
                            "threads": threads(tp)})
    for chunk in args.chunks:
        out.append({"tokens": max(args.tokens) // args.scale, "hidden": h, "tp": 1, "method": "chunked",
                    "chunk": chunk // args.scale, "threads": threads(1), "sweep": True})
    return out


def chunked_main(args) -> None:
    """(c): every configuration once per round, rounds interleaved; the table of peaks, times, ratios."""
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"loss_chunked_s{args.scale}{args.tag}"
    configs = _configs(args)
    results: dict[str, list[dict]] = {}
    with open(f"{stem}.jsonl", "w") as log:
        for rnd in range(args.rounds):
            for cfg in configs:
                r = _run_one(cfg)
                results.setdefault(json.dumps(cfg, sort_keys=True), []).append(r)
                log.write(json.dumps({"round": rnd, **r}) + "\n")
                log.flush()
                print(rnd, r, flush=True)
    text = _chunked_table(args, configs, results)
    Path(f"{stem}.md").write_text(text)
    print(text)


def _summary(runs: list[dict]) -> dict | None:
    ok = [r for r in runs if "skipped" not in r]
    if not ok:
        return None
    cpu = [r["cpu_seconds"] for r in ok if "cpu_seconds" in r]
    return {"peak": max(r["peak"] for r in ok), "seconds": statistics.median(r["seconds"] for r in ok),
            "cpu_seconds": statistics.median(cpu) if cpu else float("nan"), "rounds": len(ok)}


def _chunked_table(args, configs, results) -> str:
    s, mib = args.scale, 2 ** 20
    get = {(c["tokens"], c["tp"], c["method"], c["chunk"], c.get("sweep", False)):
           _summary(results[json.dumps(c, sort_keys=True)]) for c in configs}
    chunks = sorted({_chunk(args, n) // s for n in args.tokens})
    chunk = "/".join(map(str, chunks))
    lines = [f"## Chunked linear cross-entropy vs today's vocab-parallel loss vs HF dense (V={LLAMA3_VOCAB}, "
             f"H={LLAMA3_HIDDEN // s}, chunk={chunk}, float32, scale 1/{s}; median of {args.rounds} rounds)", "",
             "| N | tp | chunked MiB | today MiB | HF dense MiB | chunked / today (goal <= 0.15) | "
             "chunked / HF dense (goal <= 0.05) | chunked s | today s | HF dense s | time chunked / today "
             "(goal <= 1.25) | CPU time chunked / today |", "| --- " * 12 + "|"]
    for n in args.tokens:
        c = _chunk(args, n) // s
        dense = get.get((n // s, 1, "hf_dense", c, False))
        for tp in args.tp:
            ch, to = get.get((n // s, tp, "chunked", c, False)), get.get((n // s, tp, "today", c, False))
            f = lambda d, k, sc=1.0: "-" if d is None else f"{d[k] / sc:.{1 if k == 'peak' else 2}f}"  # noqa: E731
            ratio = lambda a, b, k: "-" if a is None or b is None else f"{a[k] / b[k]:.3f}"  # noqa: E731
            lines.append(f"| {n // s} | {tp} | {f(ch, 'peak', mib)} | {f(to, 'peak', mib)} | "
                         f"{f(dense, 'peak', mib) if tp == 1 else ''} | {ratio(ch, to, 'peak')} | "
                         f"{ratio(ch, dense, 'peak')} | {f(ch, 'seconds')} | {f(to, 'seconds')} | "
                         f"{f(dense, 'seconds') if tp == 1 else ''} | {ratio(ch, to, 'seconds')} | "
                         f"{ratio(ch, to, 'cpu_seconds')} |")
    skipped = [r for runs in results.values() for r in runs if "skipped" in r]
    for r in {json.dumps({k: r[k] for k in ("tokens", "tp", "method", "skipped")}) for r in skipped}:
        lines.append(f"\nSkipped: {r}")
    if args.chunks:
        n = max(args.tokens) // s
        today = get.get((n, 1, "today", _chunk(args, max(args.tokens)) // s, False))
        lines += ["", f"Chunk-size sweep at N={n}, tp=1 (chunk sizes scaled by 1/{s}):", "",
                  "| chunk | peak MiB | s | peak / today | time / today | CPU time / today |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for c in args.chunks:
            d = get.get((n, 1, "chunked", c // s, True))
            if d is None:
                continue
            lines.append(f"| {c // s} | {d['peak'] / mib:.1f} | {d['seconds']:.2f} | "
                         f"{d['peak'] / today['peak'] if today else float('nan'):.3f} | "
                         f"{d['seconds'] / today['seconds'] if today else float('nan'):.3f} | "
                         f"{d['cpu_seconds'] / today['cpu_seconds'] if today else float('nan'):.3f} |")
    return "\n".join(lines) + "\n"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    mib = 2 ** 20
    rows = []
    for tp in (1, 2, 4):
        per_rank = tputil.spawn(_memory_body, tp)
        rows.append((tp, max(r["ours"] for r in per_rank), max(r["gathered"] for r in per_rank),
                     max(r["dense"] for r in per_rank)))
    base = rows[0][3]  # HF's dense full-logit loss, tp=1
    lines = [f"## Peak memory per rank: LM head + loss, forward + backward (N={TOKENS} tokens, H={HIDDEN}, "
             f"V={VOCAB}, float32)", "",
             "| tp | vocab-parallel loss (MiB) | gathered logits + F.cross_entropy (MiB) | HF dense (MiB) | "
             "ours / HF dense | target 1/tp + 5% |", "| --- | --- | --- | --- | --- | --- |"]
    for tp, ours, gathered, dense in rows:
        lines.append(f"| {tp} | {ours / mib:.1f} | {gathered / mib:.1f} | {dense / mib:.1f} | {ours / base:.3f} | "
                     f"{1 / tp + 0.05:.3f} |")

    c = tputil.spawn(_comm_body, 2)[0]
    lines += ["", f"## Collectives of one GPT-2 training step at tp=2 (L={c['L']}, B={c['B']}, T={c['T']}, "
              f"H={c['H']}, V=50257)", "",
              "| | all-reduce calls | all-reduce values | all-gather calls | all-gather values |",
              "| --- | --- | --- | --- | --- |"]
    for name, label in (("minimum", "analytic minimum (docs/mechanics.md)"), ("ours", "tpify, labels= (vocab-parallel loss)"),
                        ("before", "gathered logits + F.cross_entropy")):
        d = c[name]
        lines.append(f"| {label} | {d.get('all_reduce', 0)} | {d.get('all_reduce_numel', 0)} | "
                     f"{d.get('all_gather', 0)} | {d.get('all_gather_numel', 0)} |")
    text = "\n".join(lines) + "\n"
    (OUT / "loss.md").write_text(text)
    print(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(tps, [r[1] / base for r in rows], "o-", label="vocab-parallel loss")
    ax.plot(tps, [r[2] / base for r in rows], "s-", label="gathered logits + F.cross_entropy")
    ax.plot(tps, [1 / t for t in tps], "k--", label="1/tp")
    ax.set_xlabel("tp_size")
    ax.set_ylabel("peak memory per rank / HF dense")
    ax.set_xticks(tps)
    ax.set_title("LM head + loss, fwd+bwd")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "loss_memory.png", dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("gpt2", "chunked"), default="gpt2",
                        help="gpt2: (a) and (b); chunked: (c)")
    parser.add_argument("--scale", type=int, default=1, help="(c): divide N, H and the chunk size by this")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="*", default=[], help="(c): chunk sizes to sweep (unscaled)")
    parser.add_argument("--chunk", default="auto",
                        help="(c): the chunked loss's chunk in tokens (unscaled), or auto: "
                             "tpify.loss.default_chunk_size at the full sizes")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="(c): what to run")
    parser.add_argument("--tag", default="", help="(c): appended to the output files' names")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a configuration of (c), in this subprocess
    cli = parser.parse_args()
    if cli.one:
        _one(json.loads(cli.one))
    elif cli.part == "chunked":
        chunked_main(cli)
    else:
        main()
