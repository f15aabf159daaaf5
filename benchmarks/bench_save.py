"""Saving a tensor-parallel model: the dense save by one writer vs by every rank, and the DCP
training checkpoint (model + AdamW state) saved and loaded at the same layout.

Configurations, each in the same spawned job of ``--world`` gloo ranks (``tp = --tp``,
``dp = world / tp``; ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``), on a GPT-2 of random
float32 weights (``--layers`` x ``--hidden``, vocabulary 50257, the head tied as GPT-2's):

* ``dense, rank 0 writes``: ``tpify.save_pretrained`` with global rank 0 writing every file (as
  tpify did before: the baseline every ratio is taken to);
* ``dense, every rank writes``: ``tpify.save_pretrained`` as it is (the files in rounds of one
  per rank);
* ``DCP save``: :func:`tpify.checkpoint.save_checkpoint` of the model and its AdamW state (after
  one step: ``exp_avg``, ``exp_avg_sq``), every rank writing its part;
* ``DCP load``: :func:`tpify.checkpoint.load_checkpoint` of it at the same layout.

Times are the slowest rank's wall time of the call (every call is collective), with
``--rounds`` rounds run in an order rotated every round; reported are medians and min-max, and
the bytes on disk. Into ``benchmarks/out/<dir>`` (the page cache: these are times to write into
memory, not to a disk's platters; nothing is fsynced). The machine is shared: compare runs taken
alike.

Usage: ``python benchmarks/bench_save.py [--world 4] [--tp 2] [--layers 6] [--hidden 768]
[--rounds 3] [--shard-size 50MB]`` (prints a markdown table; writes benchmarks/out/save.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = Path(__file__).resolve().parent / "out"
CONFIGS = ("dense, rank 0 writes", "dense, every rank writes", "DCP save", "DCP load")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _rank(rank, world, store, args, results):
    os.environ["GLOO_SOCKET_IFNAME"], os.environ["OMP_NUM_THREADS"] = "lo", "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import functools

    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify
    import tpify.api
    from tpify.checkpoint import load_checkpoint, save_checkpoint
    from tpify.io.save import staged

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, n_positions=128)
    model = tpify.parallelize(GPT2LMHeadModel(config), tp_size=args.tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    base = Path(args.out)
    one_writer = functools.partial(staged, several_writers=False)

    def dense(several: bool):
        tpify.api.staged = staged if several else one_writer
        try:
            tpify.save_pretrained(model, base / "dense", max_shard_size=args.shard_size)
        finally:
            tpify.api.staged = staged

    calls = {CONFIGS[0]: lambda: dense(False), CONFIGS[1]: lambda: dense(True),
             CONFIGS[2]: lambda: save_checkpoint(base / "dcp", model, [opt]),
             CONFIGS[3]: lambda: load_checkpoint(base / "dcp", model, [opt])}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    sizes = {}
    for r in range(args.rounds):
        order = list(CONFIGS[:3])
        order = order[r % 3:] + order[: r % 3] + [CONFIGS[3]]  # the load after its save
        for name in order:
            if rank == 0 and name == CONFIGS[2]:
                shutil.rmtree(base / "dcp", ignore_errors=True)
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times[name].append(seconds.item())
            if rank == 0 and name != CONFIGS[3]:
                sizes[name] = _size(base / ("dcp" if name == CONFIGS[2] else "dense"))
    if rank == 0:
        params = sum(p.numel() for p in tpify.dense_state_dict(model).values())
        results.put((times, sizes, params))
    else:
        tpify.dense_state_dict(model)  # collective
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-size", default="50MB")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        args.out = tmp
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args.world, f"{tmp}/store", args, results))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        times, sizes, params = results.get(timeout=3600)
        for p in procs:
            p.join()
    base = statistics.median(times[CONFIGS[0]])
    lines = [f"GPT-2 {args.layers} x {args.hidden}, {params / 1e6:.0f}M parameters (float32), world {args.world}, "
             f"tp {args.tp}, dp {args.world // args.tp}, shards of {args.shard_size}, {args.rounds} rounds; "
             f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             "| what | median s | min-max s | ratio to rank 0 writing | on disk MB |", "| --- | --- | --- | --- | --- |"]
    for name in CONFIGS:
        t = times[name]
        lines.append(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f}-{max(t):.2f} | "
                     f"{statistics.median(t) / base:.2f} | {sizes[name] / 1e6:.0f} |" if name in sizes else
                     f"| {name} | {statistics.median(t):.2f} | {min(t):.2f}-{max(t):.2f} | "
                     f"{statistics.median(t) / base:.2f} | |")
    text = "\n".join(lines)
    print(text)
    (OUT / "save.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
