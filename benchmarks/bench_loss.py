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

Writes benchmarks/out/loss.md and benchmarks/out/loss_memory.png, prints the table.
Run: ``python benchmarks/bench_loss.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import sys
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
    main()
