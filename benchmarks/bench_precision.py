"""Benchmark precision and overlap (issue 32, item 3): the chunked loss's memory, time and accuracy,
and the dtypes tensor parallelism's reductions run in, each against a baseline in the same run.

(a) The chunked linear cross-entropy (``tpify.loss.vocab_parallel_linear_cross_entropy``, tp 1,
    ``V = 32,000``, ``H = 512``, ``N = 2,048`` tokens, chunks of 256: ``--vocab``, ``--hidden``,
    ``--tokens``, ``--chunk``; on the CPU, or ``--device cuda``), with bfloat16 weights and with
    float32 weights under bf16 autocast, forward and
    backward: the bytes saved from forward to backward beyond its inputs
    (``torch.autograd.graph.saved_tensors_hooks``, each storage once), the peak bytes allocated
    above the inputs (``torch.profiler``'s allocator events, as bench_loss.py), the wall time (the
    median over interleaved rounds), the loss's absolute error and the gradients' relative
    norm-wise errors against ``F.cross_entropy`` in float64 of the same rounded inputs (first round). Baselines
    in the same run: the unchunked head and loss of this checkout (``F.linear``, then
    ``tpify.vocab_parallel_cross_entropy``), and with ``--before PATH`` the chunked loss of another
    checkout (e.g. the commit before this change), each configuration in a subprocess of its own
    with that checkout first on ``sys.path``.
(b) One training step of a small Llama (hidden 256, 2 layers, ``B*T = 4*64``) at tp 2 (gloo): the
    elements every all-reduce and reduce-scatter carried, per dtype (``torch.distributed``'s
    functions wrapped, so any checkout is measured alike): under bf16 autocast over float32
    weights, with ``grad_reduce_dtype=torch.float32``, and PEFT LoRA (r 8) on a bfloat16 base with
    PEFT's float32 adapters; the same for ``--before``'s checkout.

Writes benchmarks/out/precision.md and .json (``--out``), prints the tables. Run (2 CPU cores, about
3 minutes a round): ``python benchmarks/bench_precision.py --before /path/to/main/checkout``; on a GPU
``python benchmarks/bench_precision.py --device cuda --parts loss --vocab 128256 --hidden 4096
--tokens 8192 --chunk 512 --before ...``.
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

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
V, H, N, CHUNK = 32000, 512, 2048, 256


# ---- (a) the chunked loss, in a subprocess per configuration --------------------------------------

def _peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def _loss_one(cfg: dict) -> dict:
    import torch
    import torch.nn.functional as F

    import tpify
    from tpify.loss import vocab_parallel_linear_cross_entropy

    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    v, h, n = cfg["vocab"], cfg["hidden"], cfg["tokens"]
    autocast = cfg["precision"] == "autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, h, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=device) * h ** -0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=g, device=device)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if cfg["method"] == "unchunked":
                return tpify.vocab_parallel_cross_entropy(F.linear(x, w), target)
            return vocab_parallel_linear_cross_entropy(x, w, target, chunk_size=cfg["chunk"])

    exclude = {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in exclude:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()  # also the warm-up
    x.grad = w.grad = None
    if cuda:  # the caching allocator's own count: bytes in tensors, above what existed before
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_bytes(lambda: forward().backward())
    times = []
    for _ in range(5 if cuda else 1):
        x.grad = w.grad = None
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = forward()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {"saved": sum(saved.values()), "peak": peak, "seconds": statistics.median(times),
           "grad_bytes": w.grad.numel() * w.grad.element_size(), "w_grad_dtype": str(w.grad.dtype)}
    if not cfg["accuracy"]:
        return out
    rx, rw = hidden.double().requires_grad_(), weight.to(torch.bfloat16).double().requires_grad_()
    ref = F.cross_entropy(F.linear(rx.to(torch.bfloat16).double(), rw), target)
    ref.backward()
    rel = lambda got, want: float((got.double() - want).norm() / want.norm())  # noqa: E731
    return {**out, "loss_error": abs(float(loss) - float(ref)), "w_error": rel(w.grad, rw.grad),
            "x_error": rel(x.grad, rx.grad)}


# ---- (b) the reductions' dtypes at tp 2 ------------------------------------------------------------

def _reductions_body(rank, world, cfg):
    import copy

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import tpify

    torch.set_num_threads(1)
    counts: dict[str, int] = {}
    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def wrapped(*args, _real=real, _name=name, **kwargs):
            tensor = args[0] if _name == "all_reduce" else args[1]  # reduce-scatter: (out, input)
            key = f"{str(tensor.dtype).removeprefix('torch.')}"
            counts[key] = counts.get(key, 0) + tensor.numel()
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    dense = LlamaForCausalLM(config)
    kwargs = {"grad_reduce_dtype": torch.float32} if cfg["case"] == "autocast, float32 floor" else {}
    if cfg["case"] == "bf16 base, fp32 LoRA":
        dense = dense.to(torch.bfloat16)
    model = tpify.parallelize(copy.deepcopy(dense), tp_size=world, **kwargs)
    if cfg["case"] == "bf16 base, fp32 LoRA":
        import peft

        from tpify.integrations import get_peft_model

        model = get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"]))
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    autocast = cfg["case"].startswith("autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    forward = dict(counts)
    counts.clear()
    loss.backward()
    return {"forward": forward, "backward": dict(counts)}


def _reductions_one(cfg: dict) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import tputil

    return tputil.spawn(_reductions_body, 2, cfg, timeout=300)[0]


# ---- driver ------------------------------------------------------------------------------------

def _run(cfg: dict, checkout: str | None) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(cfg.get("threads", 1)))
    path = [checkout] if checkout else []
    env["PYTHONPATH"] = os.pathsep.join(path + [str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{cfg}: {proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="another checkout (its root) whose tpify is the 'before' baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=V)
    parser.add_argument("--hidden", type=int, default=H)
    parser.add_argument("--tokens", type=int, default=N)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: (a) on this process's GPU (peak: "
                        "torch.cuda.max_memory_allocated; time: the median of 5 synchronized runs)")
    parser.add_argument("--parts", default="loss,reductions", help="loss and/or reductions")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        cfg = json.loads(args.one)
        result = _loss_one(cfg) if cfg["part"] == "loss" else _reductions_one(cfg)
        print("RESULT " + json.dumps(result), flush=True)
        return
    impls = [("chunked", None, "chunked (this checkout)"), ("unchunked", None, "unchunked head + loss")]
    if args.before:
        impls.insert(1, ("chunked", args.before, "chunked (before)"))
    parts = args.parts.split(",")
    loss_runs: dict[tuple, list] = {}
    for round_ in range(args.rounds if "loss" in parts else 0):  # interleaved: every configuration once per round
        for precision in ("bf16", "autocast"):
            for method, checkout, label in impls:
                cfg = {"part": "loss", "method": method, "precision": precision, "vocab": args.vocab,
                       "hidden": args.hidden, "tokens": args.tokens, "chunk": args.chunk, "device": args.device,
                       "threads": args.threads, "accuracy": round_ == 0}  # the float64 reference once
                loss_runs.setdefault((precision, label), []).append(_run(cfg, checkout))
    rows = ["| weights | implementation | saved fwd->bwd MiB | x weight grad | peak MiB | x weight grad | time s "
            "| time ratio | loss abs err | dW rel err | dX rel err |", "|---" * 11 + "|"]
    for precision in ("bf16", "autocast") if loss_runs else ():
        base = statistics.median(r["seconds"] for r in loss_runs[(precision, "chunked (this checkout)")])
        for _, _, label in impls:
            runs = loss_runs[(precision, label)]
            r0, secs = runs[0], statistics.median(r["seconds"] for r in runs)
            gb = r0["grad_bytes"]
            rows.append(f"| {'bf16' if precision == 'bf16' else 'fp32, bf16 autocast'} | {label} | "
                        f"{r0['saved'] / 2**20:.1f} | {r0['saved'] / gb:.2f} | {r0['peak'] / 2**20:.1f} | "
                        f"{r0['peak'] / gb:.2f} | {secs:.3f} | {secs / base:.2f} | {r0['loss_error']:.1e} | "
                        f"{r0['w_error']:.1e} | {r0['x_error']:.1e} |")
    red_rows = ["| checkout | case | forward bf16 | forward fp32 | backward bf16 | backward fp32 |", "|---" * 6 + "|"]
    reductions = {}
    for checkout, name in ([(None, "this")] + ([(args.before, "before")] if args.before else [])
                           if "reductions" in parts else []):
        for case in ("autocast", "autocast, float32 floor", "bf16 base, fp32 LoRA"):
            if name == "before" and case == "autocast, float32 floor":
                continue  # no such option before
            r = _run({"part": "reductions", "case": case}, checkout)
            reductions[f"{name}: {case}"] = r
            f, b = r["forward"], r["backward"]
            red_rows.append(f"| {name} | {case} | {f.get('bfloat16', 0):,} | {f.get('float32', 0):,} | "
                            f"{b.get('bfloat16', 0):,} | {b.get('float32', 0):,} |")
    text = (f"# Precision and overlap (benchmarks/bench_precision.py)\n\n(a) chunked loss, V = {args.vocab:,}, "
            f"H = {args.hidden}, N = {args.tokens:,}, chunk {args.chunk}, tp 1, {args.device}, {args.rounds} "
            f"interleaved rounds, {args.threads} threads; time ratio against this checkout's chunked loss\n\n"
            + "\n".join(rows) + "\n\n(b) elements reduced per dtype in one tp 2 training step (Llama, hidden 256, "
            "2 layers, 4 x 64 tokens)\n\n" + "\n".join(red_rows) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.md").write_text(text)
    (out / "precision.json").write_text(json.dumps({"loss": {f"{k[0]}: {k[1]}": v for k, v in loss_runs.items()},
                                                    "reductions": reductions}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
