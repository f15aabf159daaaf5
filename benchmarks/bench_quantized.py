"""Per-rank memory of QLoRA under tensor parallelism: the 4-bit base, LoRA parameters, gradients and
AdamW state at tp 1, 2, 4, against the dense 4-bit model, plus a "what fits" estimate.

What is measured, per rank (bytes, exact, from the tensors themselves, not the allocator):
* base: the quantized layers' codes, absmax and code tables (:func:`tpify.quantized.quantized_bytes`)
  plus the unquantized frozen parameters (embeddings, LM head, norms: replicated or vocab-split);
* LoRA: the adapters' parameters (r = 16 on every linear layer), their gradients (same bytes after a
  backward) and AdamW's two moments (2 x the parameters, float32).
The baseline is transformers' own 4-bit model (``from_pretrained(..., quantization_config=
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))``) in one process, with PEFT's
LoRA on it: the same counts on the dense model. Reported: the largest rank's bytes and the ratio
to the dense model (goal for the quantized layers: 1 / tp).

Model: a random Llama, 4 layers, hidden ``--hidden`` (default 512), 8 query / 4 KV heads,
intermediate 4 x hidden, vocabulary 8192, float32 weights (the unquantized parts' dtype; bf16
halves them). Each tp size is a world of tp gloo ranks on this machine.

Loading: the resident memory a load adds (RSS sampled every 2 ms, minus the RSS before; imports
done first), per rank, of a pre-quantized checkpoint (4 layers, hidden ``--load-hidden``, NF4, saved by
transformers), by transformers' ``from_pretrained`` in one process and by ``tpify.from_pretrained``
at each tp (each rank reads its blocks only): the peak during the load, split after it into
anonymous memory (the process's own copies) and file pages (the mapped safetensors file: zero-copy
tensors, and pages a read touched), and the RSS once every tensor has been touched (what a first
forward does): transformers' tensors are lazy views of the mapped file, resident only when read,
so the peak during its load alone undercounts.

The "what fits" lines are ``tpify plan --quantize nf4``'s per-rank bytes (checked equal to the real
shards in tests/distributed/test_quantized.py) for Llama 3 8B and 70B shapes (bf16 unquantized
parts, LoRA r = 16 with its gradients and AdamW state): not activations (those depend on batch
and sequence and are split by tp too only inside the parallel regions).

Run: ``python benchmarks/bench_quantized.py`` (about a minute on 2 CPU cores). Results go in
docs/quantization.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=4 * hidden, vocab_size=8192, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _bnb():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _lora():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _counts(model, quantized: int) -> dict:
    """Bytes of the base (quantized layers + frozen parameters), adapters, their grads and AdamW state,
    after one backward and one optimizer step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(3, 8192, (1, 32), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    frozen = _nbytes(p for p in model.parameters() if not p.requires_grad and p.dtype.is_floating_point)
    state = _nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"quantized": quantized, "frozen": frozen, "lora": _nbytes(trainable),
            "grads": _nbytes(p.grad for p in trainable if p.grad is not None), "adam": state}


def _dense(path: str) -> dict:
    import peft
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, quantization_config=_bnb(), dtype=torch.float32, device_map="cpu")
    q = 0
    for m in model.modules():
        if type(m).__name__ == "Linear4bit":
            qs = m.weight.quant_state
            q += _nbytes([m.weight.data, qs.absmax, qs.code])
    model = peft.get_peft_model(model, _lora())
    model.train()
    return _counts(model, q)


def _rank(rank: int, tp: int, store_path: str, path: str, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        import tpify
        from tpify.integrations import get_peft_model
        from tpify.quantized import quantized_bytes

        if tp > 1:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, tp), rank=rank, world_size=tp)
        model = tpify.from_pretrained(path, tp_size=tp, quantization_config=_bnb(), dtype=torch.float32)
        q = quantized_bytes(model)["quantized"]
        torch.manual_seed(0)
        model = get_peft_model(model, _lora())
        model.train()
        results.put((rank, _counts(model, q)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(tp: int, path: str) -> dict:
    """The largest rank's counts at ``tp``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, tp, str(Path(tmp) / "store"), path, results)) for r in range(tp)]
        for p in procs:
            p.start()
        got = [results.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
    errors = [v for _, v in got if isinstance(v, str)]
    if errors:
        raise RuntimeError(errors[0])
    return {k: max(v[k] for _, v in got) for k in got[0][1]}


def _rss_rank(rank: int, tp: int, store_path: str, path: str, results) -> None:
    """Peak resident memory added by loading the pre-quantized checkpoint ``path`` on one rank: the
    highest RSS sampled every 2 ms during the load minus the RSS before it (imports done first);
    tp 0: transformers' own ``from_pretrained`` in one process."""
    import threading

    import psutil

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        import bitsandbytes  # noqa: F401 - imported before the baseline, as the load would
        from transformers import LlamaForCausalLM

        import tpify

        if tp > 1:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, tp), rank=rank, world_size=tp)
        proc, peak, done = psutil.Process(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                done.wait(0.002)

        before, kinds_before = proc.memory_info().rss, _rss_kinds()
        sampler = threading.Thread(target=sample)
        sampler.start()
        if tp == 0:
            model = LlamaForCausalLM.from_pretrained(path, device_map="cpu")
        else:
            model = tpify.from_pretrained(path, tp_size=tp)
        peak[0] = max(peak[0], proc.memory_info().rss)
        done.set()
        sampler.join()
        kinds = {k: v - kinds_before[k] for k, v in _rss_kinds().items()}
        with torch.no_grad():  # what a first forward does: every page of every tensor read once
            for t in list(model.parameters()) + list(model.buffers()):
                if t.numel():
                    t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
        touched = proc.memory_info().rss - before
        del model
        results.put((rank, (peak[0] - before, kinds["RssAnon"], kinds["RssFile"], touched)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rss_kinds() -> dict[str, int]:
    """This process's resident bytes by kind (``/proc/self/status``): ``RssAnon`` (its own
    allocations) and ``RssFile`` (pages of mapped files, such as a safetensors file read zero-copy)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _load_peak(tp: int, path: str) -> tuple[int, int, int, int]:
    """The largest rank's ``(peak RSS added, anonymous added, file-backed added, RSS added once every
    tensor is touched)`` loading ``path`` at ``tp`` (0: transformers, one process), by its peak."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rss_rank, args=(r, tp, str(Path(tmp) / "store"), path, results))
                 for r in range(max(tp, 1))]
        for p in procs:
            p.start()
        got = [results.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join()
    errors = [v for _, v in got if isinstance(v, str)]
    if errors:
        raise RuntimeError(errors[0])
    return max((v for _, v in got), key=lambda v: v[0])


def _fits() -> list[str]:
    """Per-rank GB of a QLoRA run on Llama 3 shapes (8B, 70B), from ``tpify plan --quantize nf4``'s
    bytes per rank (:func:`tpify.authoring.plan.plan_report` on the meta device): the 4-bit base and
    the bf16 parts kept, plus LoRA r = 16 on every quantized layer x 4 (parameters, gradients, AdamW's
    two moments, all bf16); which of 24, 48 and 80 GB GPUs hold it with 20 % left for activations."""
    from transformers import LlamaConfig

    from tpify.authoring.plan import plan_report

    shapes = {"Llama 3 8B": (4096, 14336, 32, 32, 8), "Llama 3 70B": (8192, 28672, 80, 64, 8)}
    lines = []
    for name, (h, inter, layers, heads, kv) in shapes.items():
        out = []
        with tempfile.TemporaryDirectory() as tmp:
            LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv, vocab_size=128256, tie_word_embeddings=False,
                        dtype="bfloat16").save_pretrained(tmp)
            for tp in (1, 2, 4, 8):
                rank = plan_report(tmp, tp, quantize="nf4", lora_r=16)["quantized"]["rank"]
                gb = (rank["base_bytes"] + 4 * rank["lora_bytes"]) / 1e9
                fits = [gpu for gpu in (24, 48, 80) if gb < 0.8 * gpu]
                out.append(f"tp {tp}: {gb:.2f} GB/rank (fits {', '.join(f'{g} GB' for g in fits) or 'none'})")
        lines.append(f"{name}: " + "; ".join(out))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--load-hidden", type=int, default=1024,
                        help="hidden size of the Llama whose pre-quantized checkpoint is loaded for the peak-memory table")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    print(f"{datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs; Llama 4 layers, hidden "
          f"{args.hidden}, 8/4 heads, NF4 (blocks of 64, no double quantization), LoRA r = 16 on every linear layer")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args.hidden)).save_pretrained(tmp)
        dense = _dense(tmp)
        table = {tp: _run(tp, tmp) for tp in args.tp}
    keys = ["quantized", "frozen", "lora", "grads", "adam"]
    print("| tp | " + " | ".join(f"{k} (KiB) | ratio" for k in keys) + " |")
    print("| --- |" + " --- | --- |" * len(keys))
    print("| dense 4-bit (transformers + PEFT) | " + " | ".join(f"{dense[k] / 1024:.0f} | 1" for k in keys) + " |")
    for tp, row in table.items():
        print(f"| {tp} | " + " | ".join(f"{row[k] / 1024:.0f} | {row[k] / max(dense[k], 1):.3f}" for k in keys) + " |")
    ratio = table[max(table)]["quantized"] / dense["quantized"] * max(table)
    print(f"quantized bytes x tp / dense at tp {max(table)}: {ratio:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import LlamaForCausalLM as _L

        torch.manual_seed(0)
        _L(_config(args.load_hidden)).save_pretrained(f"{tmp}/dense")
        q = _L.from_pretrained(f"{tmp}/dense", quantization_config=_bnb(), dtype=torch.float32, device_map="cpu")
        q.save_pretrained(f"{tmp}/4bit")
        del q
        on_disk = sum(f.stat().st_size for f in Path(f"{tmp}/4bit").glob("*.safetensors"))
        print(f"loading a pre-quantized checkpoint (Llama 4 layers, hidden {args.load_hidden}, NF4; "
              f"{on_disk / 2**20:.1f} MiB of safetensors): RSS added per rank (MiB), largest rank")
        print("| loader | peak during the load | of it: anonymous | of it: file pages | once every tensor is "
              "touched | ratio (touched) |")
        print("| --- | --- | --- | --- | --- | --- |")
        rows = [("transformers from_pretrained, one process", _load_peak(0, f"{tmp}/4bit"))]
        rows += [(f"tpify.from_pretrained, tp {tp}", _load_peak(tp, f"{tmp}/4bit")) for tp in args.tp]
        for name, (peak, anon, file, touched) in rows:
            print(f"| {name} | {peak / 2**20:.1f} | {anon / 2**20:.1f} | {file / 2**20:.1f} | {touched / 2**20:.1f} | "
                  f"{touched / rows[0][1][3]:.3f} |")
    print("what fits (tpify plan --quantize nf4: base + LoRA r = 16 + gradients + AdamW, bf16, no activations; "
          "20 % of each GPU left for them):")
    for line in _fits():
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
