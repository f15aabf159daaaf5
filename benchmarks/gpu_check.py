"""One command that checks tpify on a GPU: correctness on CUDA, overheads against plain Hugging
Face, and what CPU runs cannot show. Called by ``benchmarks/gpu_check.sh`` (at most 10 minutes on
one H100); every section also runs on the CPU at toy sizes (``--device cpu --quick``) so that its
code path is tested where there is no GPU (tests/unit/test_gpu_check.py).

Sections, each in its own subprocess with a time budget (a hang or a crash costs that section
only; what it recorded before stays), each writing ``OUT/<section>.json`` as its results come:

* ``env``: versions (Python, torch, CUDA, NCCL, transformers, peft, accelerate, safetensors,
  tokenizers, Liger-Kernel when installed, tpify and its commit) and the card.
* ``mesh_device``: one rank initialised with ``init_process_group()`` (no backend: torch
  reports ``"undefined"``), ``"nccl"`` and ``"cpu:gloo,cuda:nccl"`` (on the CPU: none, ``"gloo"``):
  the backend's name and configuration, the device of the mesh ``init_mesh`` builds, what the old
  rule (``"cuda" if get_backend() == "nccl"``) gave, and where FSDP2 leaves the parameters of a
  tp = 1 model (``shard_data_parallel``): on the GPU with every backend string.
* ``tp1_overhead``: ``tpify.parallelize(tp_size=1)`` against the plain HF model, one process:
  GPT-2 124M and a ~1.2B Llama (Llama-3.2-1B's shapes) built from config, in bf16 (bf16 weights,
  AdamW) and in fp32 weights under ``torch.autocast(bfloat16)``: the first loss of both (equal
  within bf16 rounding), the step time (forward with ``labels=``, backward, AdamW; CUDA events,
  median of the timed steps after warm-up), ``torch.cuda.max_memory_allocated`` over the steps,
  and the host syncs of one steady-state step (``torch.cuda.set_sync_debug_mode("warn")``
  warnings; on the CPU the profiler's ``aten::_local_scalar_dense`` calls).
* ``two_ranks``: two ranks on one GPU over gloo (NCCL refuses two ranks on one GPU), tp = 2
  against the dense model on the same device: fp32 (TF32 off), bf16 autocast, sequence
  parallelism with dropout (the per-rank CUDA dropout streams differ, the shared one is equal,
  attention-dropout masks differ, replicated outputs are bitwise equal), the chunked loss
  (``lm_loss_chunk``) and expert parallelism (Mixtral, ``ep_size=2``): the loss and every
  gathered gradient, as the largest normwise relative error.
* ``chunked_loss``: the LM-head loss at V = 128,256, H = 4,096, N = 8,192 tokens in bf16, tp = 1:
  ``F.cross_entropy`` of the full logits (as HF: upcast to fp32), tpify's chunked
  ``vocab_parallel_linear_cross_entropy`` and Liger-Kernel's fused linear cross-entropy (when its
  wheel installs): forward and backward time and the peak memory above the inputs.
* ``compile``: ``torch._dynamo.explain`` of a forward with ``labels=`` (graphs, graph breaks and
  their first reasons) for the plain HF model and the tp = 1 tpify model with dropout 0 and 0.1
  (train); on the GPU the compiled step's time against eager.

Writes ``OUT/gpu_check.json`` (every section, with its status and seconds) and
``OUT/gpu_check.md`` (the tables of docs/benchmarks.md, "GPU check") after each section.

Run: ``bash benchmarks/gpu_check.sh`` on the GPU machine; here
``PYTHONPATH=$PWD python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

SECTIONS = ("env", "mesh_device", "tp1_overhead", "two_ranks", "chunked_loss", "compile", "quantized")
#: each section's share of the whole budget (seconds at the default 570; scaled with --budget)
BUDGET_S = {"env": 20, "mesh_device": 90, "tp1_overhead": 170, "two_ranks": 130, "chunked_loss": 70, "compile": 120,
            "quantized": 90}
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Recording, timing, counting.

class Recorder:
    """A section's results, rewritten to ``path`` (atomically) at every :meth:`put`."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` calls: CUDA events on the
    GPU (the GPU's time from the first kernel queued to the last), wall time on the CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def host_syncs(fn, device: str) -> tuple[int, str]:
    """How often one call of ``fn`` makes the host wait for the device, and how it was counted."""
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), "set_sync_debug_mode warnings"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    return calls, "profiler aten::_local_scalar_dense (CPU: no sync, the calls that would be)"


def peak_mib(device: str, since: int = 0) -> float | None:
    """``torch.cuda.max_memory_allocated`` above ``since`` bytes, in MiB (None on the CPU)."""
    if device != "cuda":
        return None
    return round((torch.cuda.max_memory_allocated() - since) / 2 ** 20, 1)


def _reset_peak(device: str) -> int:
    if device != "cuda":
        return 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (2-norm, in float64)."""
    got, want = got.detach().double(), want.detach().double().to(got.device)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# Models.

def gpt2(quick: bool, dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128) if quick else {}  # else 124M
    return GPT2LMHeadModel(GPT2Config(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      bos_token_id=0, eos_token_id=0, **size))


def llama(quick: bool, dropout: float = 0.0, attn: str = "sdpa"):
    """Llama-3.2-1B's shapes (1.24B parameters, tied head) from config; toy sizes with ``quick``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000) if quick else
            dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0))
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=True,
                                        attention_dropout=dropout, attn_implementation=attn, **size))


def _ids(vocab: int, batch: int, tokens: int, device: str, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed)).to(device)


# ---------------------------------------------------------------------------------------------
# Sections.

def section_env(rec: Recorder, cfg) -> None:
    from importlib import metadata

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "peft", "accelerate", "safetensors", "tokenizers", "huggingface-hub", "liger-kernel",
                 "tpify"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import tpify
    import transformers

    versions["tpify path"] = str(Path(tpify.__file__).parent)
    versions["transformers path"] = str(Path(transformers.__file__).parent)
    try:
        versions["tpify commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        versions["tpify commit"] = None
    rec.put("versions", versions)
    card = {"device": cfg.device, "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}
    if cfg.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        card.update(name=props.name, count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        card.update(name=platform.processor() or platform.machine(), cpus=os.cpu_count())
    rec.put("card", card)


def _mesh_rank(rank: int, world: int, device: str) -> dict:
    """One rank of ``mesh_device``: the mesh and FSDP2's device with this backend string."""
    import torch.distributed as dist

    import tpify
    from tpify.mesh import init_mesh

    out = {"get_backend": str(dist.get_backend()), "backend_config": str(dist.get_backend_config())}
    out["old rule"] = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    out["mesh device"] = init_mesh(1).device_type
    torch.manual_seed(0)
    model = gpt2(True).to(device)
    par = tpify.parallelize(model, tp_size=1)
    tpify.shard_data_parallel(par)
    out["parameters after FSDP2"] = sorted({str(p.device) for p in par.parameters()})
    ids = _ids(1000, 2, 16, device)
    par(ids, labels=ids).loss.backward()  # a step runs where the parameters are
    out["step"] = "ok"
    return out


def section_mesh_device(rec: Recorder, cfg) -> None:
    backends = [None, "nccl", "cpu:gloo,cuda:nccl"] if cfg.device == "cuda" else [None, "gloo"]
    for backend in backends:
        name = "init_process_group()" if backend is None else f'init_process_group("{backend}")'
        try:
            rec.put(name, spawn(_mesh_rank, 1, backend, cfg.device, timeout=60)[0])
        except Exception as e:  # noqa: BLE001 - recorded, the next backend runs
            rec.put(name, {"error": f"{type(e).__name__}: {e}"[:2000]})


def _train_case(build, precision: str, use_tpify: bool, ids, cfg) -> dict:
    """One model, one precision, dense or tpify at tp = 1: first loss, step times, peak, syncs."""
    import tpify

    device = cfg.device
    if device == "cuda":  # the previous case's model and optimizer are gone: give their memory back
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    with torch.device(device):
        model = build()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if use_tpify:
        model = tpify.parallelize(model, tp_size=1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if precision == "autocast" else
                torch.autocast(device, enabled=False))
    losses = []

    def step():
        with autocast:
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    since = _reset_peak(device)
    times = timed(step, device, cfg.warmup, cfg.reps)
    out = {"first loss": float(losses[0]), "last loss": float(losses[-1]),
           "parameters (M)": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
           "step ms": round(statistics.median(times), 2), "peak MiB": peak_mib(device, 0),
           "weights MiB": round(since / 2 ** 20, 1) if device == "cuda" else None}
    out["host syncs per step"], out["syncs counted by"] = host_syncs(step, device)
    return out


def section_tp1_overhead(rec: Recorder, cfg) -> None:
    shapes = {"gpt2 124M": (lambda: gpt2(cfg.quick), 1000 if cfg.quick else 50257, (2, 32) if cfg.quick else (8, 1024)),
              "llama 1.2B": (lambda: llama(cfg.quick), 1000 if cfg.quick else 128256,
                             (2, 32) if cfg.quick else (4, 2048))}
    for model_name, (build, vocab, (batch, tokens)) in shapes.items():
        ids = _ids(vocab, batch, tokens, cfg.device)
        for precision in ("bf16", "autocast"):
            key = f"{model_name}, {precision}"
            try:
                dense = _train_case(build, precision, False, ids, cfg)
                par = _train_case(build, precision, True, ids, cfg)
                diff = abs(par["first loss"] - dense["first loss"]) / abs(dense["first loss"])
                row = {"dense": dense, "tpify": par, "tokens": batch * tokens, "loss rel diff": diff,
                       "parameters (M)": dense["parameters (M)"],
                       "loss equal (rel 1e-2, bf16)": diff <= 1e-2,
                       "step ratio": round(par["step ms"] / dense["step ms"], 3)}
                if dense["peak MiB"]:
                    row["peak ratio"] = round(par["peak MiB"] / dense["peak MiB"], 3)
                rec.put(key, row)
            except Exception as e:  # noqa: BLE001 - recorded, the next case runs
                rec.put(key, {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]})
                if cfg.device == "cuda":
                    torch.cuda.empty_cache()


# ---- two ranks on one device over gloo ------------------------------------------------------

def _grads_rel_err(par, ref) -> tuple[float, str]:
    """The largest normwise relative error of a gathered gradient of ``par`` against ``ref``."""
    from tpify.authoring.compare import dense_named

    want, got = dense_named(ref, "grad"), dense_named(par, "grad")
    worst, where = 0.0, ""
    for name, g in want.items():
        if g is None:
            continue
        err = rel_err(got[name], g) if got.get(name) is not None else float("inf")
        if err > worst:
            worst, where = err, name
    return worst, where


def _versus_dense(ref, par, ids, autocast=None, **kw) -> dict:
    ctx = autocast if autocast is not None else torch.autocast(ids.device.type, enabled=False)
    with ctx:
        loss_ref = ref(ids, labels=ids, **kw).loss
        loss_par = par(ids, labels=ids, **kw).loss
    loss_ref.backward()
    loss_par.backward()
    worst, where = _grads_rel_err(par, ref)
    return {"loss rel err": rel_err(loss_par, loss_ref), "grad rel err (max)": worst, "worst grad": where}


def _two_ranks_body(rank: int, world: int, device: str, quick: bool, out_path: str) -> dict:
    import torch.distributed as dist

    import tpify
    from tpify.random import get_rng_tracker

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rec = Recorder(Path(out_path)) if rank == 0 else None
    results = {}

    def check(name, fn, tol):
        try:
            row = fn()
            row["tolerance"] = tol
            row["ok"] = all(v <= tol for k, v in row.items() if "rel err" in k)
        except Exception as e:  # noqa: BLE001 - recorded, the next check runs
            row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        results[name] = row
        if rec is not None:
            rec.put(name, row)

    ids = _ids(1000, 2, 32, device)

    def dense_and_tp(build, **kw):
        torch.manual_seed(0)
        ref = build().to(device)
        return ref, tpify.parallelize(copy.deepcopy(ref), tp_size=world, **kw)

    check("fp32 (TF32 off)", lambda: _versus_dense(*dense_and_tp(lambda: gpt2(True)), ids), 1e-4)
    check("bf16 autocast", lambda: _versus_dense(*dense_and_tp(lambda: llama(True)), ids,
                                                 torch.autocast(device, dtype=torch.bfloat16)), 3e-2)
    check("chunked loss (lm_loss_chunk=16)",
          lambda: _versus_dense(*dense_and_tp(lambda: llama(True), lm_loss_chunk=16), ids), 1e-4)

    def sp_dropout():
        torch.manual_seed(0)
        model = tpify.parallelize(llama(True, dropout=0.1, attn="eager").to(device), tp_size=world,
                                  sequence_parallel=True).train()
        group = model.tp_info.tp_group
        tpify.manual_seed(5)
        out = model(ids, labels=ids, output_attentions=True)
        out.loss.backward()
        probs = out.attentions[0].detach().contiguous()  # (B, heads/p, T, T): this rank's heads, after dropout
        masks = _gather(probs == 0, group)
        losses = _gather(out.loss.detach().reshape(1), group)
        tracker = get_rng_tracker(model)
        where = str(ids.device) if device == "cuda" else "cpu"
        tp_states = _gather(tracker.tp_state(where).to(device), group)
        shared = torch.cuda.get_rng_state(ids.device) if device == "cuda" else torch.get_rng_state()
        default_states = _gather(shared.to(device), group)
        row = {"dropped (rank 0)": int(masks[0].sum()), "attention masks differ": not torch.equal(*masks),
               f"TP stream ({where}) differs": not torch.equal(*tp_states),
               f"default stream ({where}) equal": torch.equal(*default_states),
               "loss equal on both ranks": torch.equal(*losses), "tracker's CUDA devices": list(tracker.cuda_devices())}
        ok = all(v for v in row.values() if isinstance(v, bool))
        ok = ok and (device != "cuda" or bool(row["tracker's CUDA devices"]))  # it switched the GPU's generator
        row["check rel err"] = 0.0 if ok else float("inf")  # pass/fail, reported as the other checks are
        return row

    check("sequence parallel + dropout 0.1: per-rank streams", sp_dropout, 0.0)

    def expert_parallel():
        import transformers as tf

        def build():
            return tf.MixtralForCausalLM(tf.MixtralConfig(
                vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                experts_implementation="eager"))
        return _versus_dense(*dense_and_tp(build, ep_size=world), ids)

    check("expert parallelism (Mixtral, ep 2)", expert_parallel, 1e-4)
    dist.barrier()
    return results


def _gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def section_two_ranks(rec: Recorder, cfg) -> None:
    where = "cuda:0 (both ranks)" if cfg.device == "cuda" else "cpu"
    rec.put("setup", {"ranks": 2, "backend": "gloo", "device": where})
    spawn(_two_ranks_body, 2, "gloo", cfg.device, cfg.quick, str(rec.path), timeout=max(10.0, cfg.budget - 5))


def section_chunked_loss(rec: Recorder, cfg) -> None:
    import torch.nn.functional as F

    from tpify.loss import default_chunk_size, vocab_parallel_linear_cross_entropy

    V, H, N = (1000, 64, 256) if cfg.quick else (128256, 4096, 8192)
    device, dtype = cfg.device, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(N, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g).to(device)
    rec.put("shape", {"V": V, "H": H, "N": N, "dtype": "bfloat16", "chunk": default_chunk_size(N, H)})

    def hf():
        return F.cross_entropy((hidden @ weight.t()).float(), target)

    def chunked():
        return vocab_parallel_linear_cross_entropy(hidden, weight, target)

    methods = {"F.cross_entropy (HF: full logits, fp32)": hf, "tpify chunked": chunked}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        methods["Liger fused linear CE"] = lambda: liger(weight, hidden, target)
    except Exception as e:  # noqa: BLE001 - Liger is optional
        rec.put("Liger fused linear CE", {"skipped": f"{type(e).__name__}: {e}"[:300]})
    reference = None
    for name, loss_fn in methods.items():
        try:
            losses = []

            def step():
                hidden.grad = weight.grad = None
                loss = loss_fn()
                loss.backward()
                losses.append(loss.detach())

            step()  # warm-up, outside the peak
            hidden.grad = weight.grad = None
            since = _reset_peak(device)
            times = timed(step, device, 0, cfg.reps)
            value = float(losses[-1])
            reference = value if reference is None else reference
            rec.put(name, {"ms (fwd+bwd)": round(statistics.median(times), 2),
                           "peak MiB above inputs": peak_mib(device, since), "loss": value,
                           "loss rel diff": abs(value - reference) / abs(reference)})
        except Exception as e:  # noqa: BLE001 - recorded (an out-of-memory one included), the next runs
            rec.put(name, {"error": f"{type(e).__name__}: {e}"[:1500]})
        hidden.grad = weight.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()


def section_compile(rec: Recorder, cfg) -> None:
    import torch._dynamo

    import tpify

    device = cfg.device
    ids = _ids(1000 if cfg.quick else 50257, 2, 32 if cfg.quick else 512, device)
    small = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128) if cfg.quick else \
        dict(n_layer=4, n_embd=256, n_head=4)

    def build(dropout: float, parallel: bool):
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        # every dropout-like number of the config (summary_first_dropout: 0.1 by default, the double-heads
        # summary's) set, so that "dropout 0" is a model that draws nothing (tpify.hooks.dropout reads them all)
        model = GPT2LMHeadModel(GPT2Config(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                           summary_first_dropout=dropout, **small))
        model = model.to(device).train()
        return tpify.parallelize(model, tp_size=1) if parallel else model

    variants = (("plain HF", 0.0, False), ("tpify tp 1, dropout 0", 0.0, True), ("tpify tp 1, dropout 0.1", 0.1, True))
    rows = {}
    for name, dropout, parallel in variants:  # first the graph breaks of every variant (quick)
        try:
            model = build(dropout, parallel)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(ids, labels=ids)
            reasons = []
            for r in explained.break_reasons:
                text = str(getattr(r, "reason", r)).splitlines()[0][:160]
                if text not in reasons:
                    reasons.append(text)
            rows[name] = {"graphs": explained.graph_count, "graph breaks": explained.graph_break_count,
                          "break reasons (first 4)": reasons[:4]}
        except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        rec.put(name, rows[name])
    if device != "cuda" or cfg.quick:
        return
    for name, dropout, parallel in variants[:2]:  # then, on the GPU, the compiled step against eager
        try:
            model = build(dropout, parallel)

            def step(m):
                m(ids, labels=ids).loss.backward()

            rows[name]["eager ms"] = round(statistics.median(timed(lambda: step(model), device, 2, cfg.reps)), 2)
            torch._dynamo.reset()
            compiled = torch.compile(model)
            rows[name]["compiled ms"] = round(statistics.median(timed(lambda: step(compiled), device, 2, cfg.reps)), 2)
        except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
            rows[name]["compile error"] = f"{type(e).__name__}: {e}"[:1500]
        rec.put(name, rows[name])


# ---------------------------------------------------------------------------------------------
# Ranks.


# ---------------------------------------------------------------------------------------------
# QLoRA: a 4-bit base split over two ranks, bitsandbytes' CUDA kernels.

def _quantized_body(rank: int, world: int, device: str, quick: bool, out_path: str, tmp: str) -> dict:
    """tpify's 4-bit layers at tp 2 (both ranks on the one GPU, gloo) against transformers' own 4-bit
    loading with PEFT's LoRA in one process: codes and statistics bitwise, logits, loss, LoRA grads."""
    import bitsandbytes.functional as bnbf
    import peft
    import torch.distributed as dist
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    import tpify
    from tpify.authoring.compare import dense_named
    from tpify.integrations import get_peft_model
    from tpify.quantized import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

    torch.backends.cuda.matmul.allow_tf32 = False
    rec = Recorder(Path(out_path)) if rank == 0 else None
    hidden = 256 if quick else 1024
    cfg = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    path = f"{tmp}/llama"
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
    dist.barrier()
    results = {}
    for quant_type, compute, double in (("nf4", torch.float32, False), ("fp4", torch.float32, False),
                                        ("nf4", torch.bfloat16, False), ("nf4", torch.float32, True)):
        name = f"{quant_type}, compute {str(compute).split('.')[-1]}" + (", double quant" if double else "")
        try:
            bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=compute,
                                     bnb_4bit_use_double_quant=double)
            ref = LlamaForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.float32,
                                                   device_map=device)
            dense = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
            par = tpify.parallelize(dense, tp_size=world, quantization_config=bnb)
            refs = dict(ref.named_modules())
            deq_equal, layers = True, 0
            for fqn, m in par.named_modules():
                if isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)):
                    w = refs[fqn].weight
                    full = bnbf.dequantize_4bit(w.data, w.quant_state)  # (out, in)
                    spec = m.weight_shard_spec
                    dim = 1 if isinstance(m, QuantizedRowParallelLinear) else 0
                    want = torch.cat([full.narrow(dim, a, b - a) for a, b in spec.ranges(rank)], dim=dim)
                    local = m.weight if m.weight_layout == "linear" else m.weight.t()
                    deq_equal = deq_equal and torch.equal(local.to(want.dtype), want)
                    layers += 1
            lora_cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                       "gate_proj", "up_proj", "down_proj"], init_lora_weights="gaussian")
            torch.manual_seed(1)
            ref_l = peft.get_peft_model(ref, lora_cfg)
            torch.manual_seed(1)
            par_l = get_peft_model(par, peft.LoraConfig(**lora_cfg.to_dict()))
            ref_l.train(), par_l.train()
            ids = _ids(1000, 2, 64, device, seed=3)
            loss_r = ref_l(ids, labels=ids).loss
            loss_p = par_l(ids, labels=ids).loss
            loss_r.backward(), loss_p.backward()
            want, got = dense_named(ref_l, "grad"), dense_named(par_l, "grad")
            grad_err = max(rel_err(got[n], g) for n, g in want.items() if g is not None)
            timing = {}
            for label, model in (("dense QLoRA", ref_l), ("tpify tp 2", par_l)):
                def step(model=model):
                    model(ids, labels=ids).loss.backward()
                timing[label] = statistics.median(timed(step, device, 2, 5))
            row = {"quantized layers (this rank)": layers, "dequantized shard bitwise equal": deq_equal,
                   "loss rel err": rel_err(loss_p, loss_r), "LoRA grad rel err (max)": grad_err,
                   "ms fwd+bwd dense QLoRA (1 GPU)": round(timing["dense QLoRA"], 2),
                   "ms fwd+bwd tpify tp 2 (rank 0, both ranks on one GPU)": round(timing["tpify tp 2"], 2)}
            tol = 1e-5 if compute == torch.float32 else 2e-2
            row["tolerance"] = tol
            row["ok"] = deq_equal and row["loss rel err"] <= tol and grad_err <= 10 * tol
            del ref, ref_l, par, par_l, dense
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - recorded, the next check runs
            row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        results[name] = row
        if rec is not None:
            rec.put(name, row)
    dist.barrier()
    return results


def section_quantized(rec: Recorder, cfg) -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        rec.put("setup", {"ok": False, "error": "bitsandbytes is not installed (carry its wheel in .whl/)"})
        return
    import bitsandbytes

    rec.put("setup", {"ranks": 2, "backend": "gloo", "bitsandbytes": bitsandbytes.__version__,
                      "reference": "transformers 4-bit from_pretrained + PEFT LoRA, one process"})
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_quantized_body, 2, "gloo", cfg.device, cfg.quick, str(rec.path), tmp,
              timeout=max(10.0, cfg.budget - 5))

def _rank_entry(rank, world, backend, store_path, fn, args, results):
    import datetime as dt

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(world, 1) // 2))
    try:
        device = args[0]
        if device == "cuda":
            torch.cuda.set_device(0 if backend == "gloo" else rank)  # gloo: every rank on the one GPU
        store = dist.FileStore(store_path, world)
        kw = {} if backend is None else {"backend": backend}
        dist.init_process_group(store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=120), **kw)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, backend: str | None, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks (``args[0]`` is the device); the
    per-rank results. Raises RuntimeError with every failing rank's traceback, or on a timeout."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_entry, args=(r, world, backend, str(Path(tmp) / "store"), fn, args, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out, deadline = {}, time.monotonic() + timeout
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
                out[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in out.items() if s == "error"}
    missing = [r for r in range(world) if r not in out]
    if errors or missing:
        raise RuntimeError("; ".join([f"rank {r}: {v[-1500:]}" for r, v in sorted(errors.items())]
                                     + ([f"ranks {missing} did not finish in {timeout:.0f} s"] if missing else [])))
    return [out[r][1] for r in range(world)]


# ---------------------------------------------------------------------------------------------
# The driver and the report.

def _run_section(name: str, args, budget: float) -> dict:
    """Run one section in its own process group, killed after ``budget`` seconds."""
    path = args.out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--section", name, "--device", args.device, "--out", str(args.out),
           "--section-budget", str(int(budget))] + (["--quick"] if args.quick else [])
    start = time.monotonic()
    with open(args.out / f"{name}.log", "w") as log:
        paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))
        try:
            status = "ok" if proc.wait(timeout=budget) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timeout after {budget:.0f} s (results so far kept)"
    results = json.loads(path.read_text()) if path.exists() else {}
    if status != "ok":
        results["log tail"] = (args.out / f"{name}.log").read_text()[-3000:]
    return {"status": status, "seconds": round(time.monotonic() - start, 1), "results": results}


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_cell(x) for x in v) or "-"
    return str(v).replace("|", "/").replace("\n", " ")


#: rows that describe a section's setting, printed as a line above its table
_SETTINGS = ("setup", "shape")
#: the columns a section's table leads with; its rows' other values go into "details"
_COLUMNS = {"two_ranks": ["ok", "tolerance", "loss rel err", "grad rel err (max)", "worst grad"],
            "chunked_loss": ["ms (fwd+bwd)", "peak MiB above inputs", "loss", "loss rel diff"],
            "compile": ["graphs", "graph breaks", "eager ms", "compiled ms", "break reasons (first 4)"],
            "mesh_device": ["get_backend", "backend_config", "mesh device", "old rule", "parameters after FSDP2",
                            "step"]}


def _table(rows: dict, columns: list[str] | None = None, first: str = "case") -> list[str]:
    """A markdown table: one row per ``rows`` entry (a dict); ``columns`` first (default every key
    seen), then the row's other values (but tracebacks) in a "details" column."""
    rows = {k: v for k, v in rows.items() if isinstance(v, dict) and k not in _SETTINGS}
    if not rows:
        return []
    seen = []
    for v in rows.values():
        seen += [c for c in v if c not in seen and c != "traceback"]
    columns = [c for c in (columns or seen) if c in seen]
    extra = [c for c in seen if c not in columns]
    head = columns + (["details"] if extra else [])
    out = [f"| {first} | " + " | ".join(head) + " |", "|" + " --- |" * (len(head) + 1)]
    for k, v in rows.items():
        cells = [_cell(v.get(c)) for c in columns]
        if extra:
            cells.append("; ".join(f"{c}: {_cell(v[c])}" for c in extra if c in v) or "-")
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    return out


def markdown(report: dict) -> str:
    lines = [f"# tpify GPU check ({report.get('mode', '')})", ""]
    for name in SECTIONS:
        sec = report["sections"].get(name)
        if sec is None:
            continue
        res = sec["results"]
        lines += [f"## {name}: {sec['status']}, {sec['seconds']} s", ""]
        if name == "env":
            for key in ("versions", "card"):
                lines += [f"| {key} | value |", "| --- | --- |"]
                lines += [f"| {k} | {_cell(v)} |" for k, v in res.get(key, {}).items()] + [""]
        elif name == "tp1_overhead":
            rows = {}
            for case, r in res.items():
                if not isinstance(r, dict):
                    continue
                if "error" in r:
                    rows[case] = {"error": r["error"]}
                    continue
                d, p = r["dense"], r["tpify"]
                rows[case] = {"params M": r.get("parameters (M)"), "tokens": r["tokens"], "loss HF": d["first loss"],
                              "loss tpify": p["first loss"], "rel diff": r["loss rel diff"], "step ms HF": d["step ms"],
                              "step ms tpify": p["step ms"],
                              "ratio": r["step ratio"], "peak MiB HF": d["peak MiB"], "peak MiB tpify": p["peak MiB"],
                              "syncs HF": d["host syncs per step"], "syncs tpify": p["host syncs per step"]}
            lines += _table(rows) + [""]
        else:
            for key in _SETTINGS:
                if isinstance(res.get(key), dict):
                    lines += [f"{key}: " + ", ".join(f"{k} {_cell(v)}" for k, v in res[key].items()), ""]
            lines += _table(res, _COLUMNS.get(name)) + [""]
        if sec["status"] != "ok" and "log tail" in res:
            lines += ["```", res["log tail"][-1200:], "```", ""]
    return "\n".join(lines) + "\n"


def _write(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes (every section's code path in a few minutes)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu_check")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run (default 570)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"a comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--section", help=argparse.SUPPRESS)  # a worker: run this one section
    p.add_argument("--section-budget", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda but torch {torch.__version__} sees no GPU: run on the GPU machine, or "
                f"--device cpu --quick")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:  # worker
        cfg = SimpleNamespace(device=args.device, quick=args.quick, budget=args.section_budget,
                              warmup=1 if args.quick else 2, reps=2 if args.quick else 5)
        warnings.filterwarnings("ignore", category=FutureWarning)
        globals()[f"section_{args.section}"](Recorder(args.out / f"{args.section}.json"), cfg)
        return 0
    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    report = {"mode": f"--device {args.device}" + (" --quick" if args.quick else ""), "sections": {}}
    deadline = time.monotonic() + args.budget
    scale = args.budget / sum(BUDGET_S[n] for n in names)  # each section's share of the whole budget
    for i, name in enumerate(names):
        left = deadline - time.monotonic()
        spare = left - scale * sum(BUDGET_S[n] for n in names[i + 1:])  # its share and what earlier ones left
        budget = max(10.0, min(spare, 1.5 * scale * BUDGET_S[name]))
        if left < 10:
            report["sections"][name] = {"status": "skipped (no time left)", "seconds": 0, "results": {}}
        else:
            print(f"gpu_check: {name} (budget {budget:.0f} s)", flush=True)
            report["sections"][name] = _run_section(name, args, budget)
            print(f"gpu_check: {name}: {report['sections'][name]['status']}", flush=True)
        _write(report, args.out)
    print(f"gpu_check: wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
