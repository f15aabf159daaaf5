"""Training-step time of tpify vs PyTorch DTensor ``parallelize_module`` vs transformers' own TP.

One step = ``model(input_ids, labels=input_ids)`` (forward with labels), ``loss.backward()``,
``AdamW.step()``, ``zero_grad(set_to_none=True)``, in float32 on CPU ranks over gloo. Model: a
random Llama (``LlamaForCausalLM``, transformers 5.23), 4 layers, hidden 512, 8 attention heads
/ 4 KV heads, intermediate 1376, vocabulary 32000; batch 4 x 256 tokens (issue 11). The weights
are made once (``torch.manual_seed(seed)``) and saved to a temporary safetensors directory;
every implementation loads that same directory, so every one starts from the same weights and
sees the same batch.

Implementations, each with its own copy of the model and its own AdamW (default arguments):

* ``HF``: plain transformers in one process (tp = 1 only): the baseline ``T1``.
* ``tpify``: ``tpify.parallelize(model, tp_size=tp)`` (the ``llama`` recipe, vocab-parallel loss).
* ``tpify+SP``: the same with ``sequence_parallel=True`` (``--sequence-parallel``; measured only
  when the installed ``tpify.parallelize`` accepts that keyword, otherwise reported "not
  available").
* ``DTensor``: ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D ``("tp",)`` mesh
  with the usual Llama plan: ``q/k/v/gate/up_proj`` ``ColwiseParallel()``, ``o/down_proj``
  ``RowwiseParallel()``, ``embed_tokens`` ``RowwiseParallel(input_layouts=Replicate())``,
  ``lm_head`` ``ColwiseParallel(output_layouts=Replicate())`` (full logits on every rank, HF's
  loss). Head counts: torch's own Llama example divides ``n_heads``/``n_kv_heads`` per rank;
  transformers 5.23's ``LlamaAttention`` needs nothing divided (it views its projections with
  ``-1`` heads and keeps only ``num_key_value_groups = n / n_kv``, the same per rank), and the
  step-1 loss equal to plain HF's checks it.
* ``HF TP``: transformers' own TP, ``LlamaForCausalLM.from_pretrained(dir,
  distributed_config=DistributedConfig(tp_size=tp))``. ``tp_plan="auto"`` still works in 5.23
  (with a FutureWarning) but makes ``DistributedConfig(tp_plan="auto")``, which takes its tp size
  from ``$WORLD_SIZE`` (1 here, where ranks meet over a FileStore, so no TP at all); hence the
  explicit ``tp_size``. The plan: the model's ``base_model_tp_plan`` plus ``embed_tokens``
  ``embedding_rowwise`` and ``lm_head`` ``colwise_gather_output``, as DTensors. On CPU it works:
  ``initialize_distributed_mesh`` takes the device type from ``torch._C._get_accelerator()``
  (``cpu``), maps it to gloo (``DISTRIBUTED_BACKEND_MAP``) and builds a ``(pp, dp_replicate,
  fsdp, tp)`` mesh whose size must equal the world, so each tp size runs in its own world. At
  tp = 1 ``DistributedConfig(tp_size=1)`` makes no mesh: it is plain HF, not measured twice.
  Sequence parallelism: ``DistributedConfig.enable_sequence_parallel`` is documented in 5.23 as
  "Reserved ... Not wired up yet", so there is no HF TP+SP row.

``--pin`` pins rank ``r`` of every group to core ``r`` (``os.sched_setaffinity``; only where tp
is at most the core count), for every implementation alike; PyTorch's own
``THP_MEM_ALLOC_ENABLE=1`` in the environment (inherited by the ranks) puts buffers of 2 MiB and
more on transparent huge pages. Neither is on by default.

How it is measured. Every tp size is one group of ``tp`` worker processes (spawned with
``torch.multiprocessing``, one gloo world per group over a ``FileStore``,
``GLOO_SOCKET_IFNAME=lo``, ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1`` per rank) that
holds every implementation at that tp size; tp = 1 is always included (``T1``). The parent then
runs ``--rounds`` rounds; in each round every (tp, implementation) unit runs ``--warmup``
untimed steps and ``--steps`` timed steps, one unit at a time (the other groups wait on a queue,
idle), in an order rotated every round, so that machine noise hits all alike. A timed step is a
barrier (untimed), then the step on every rank; its time is the slowest rank's. Reported: the
median of all timed steps (and the spread), the scaling efficiency ``T1 / (tp * T_tp)`` with
``T1`` the plain-HF median, the ratios tpify / DTensor and tpify / HF TP at each tp, and each
implementation's loss at step 1 (same weights and batch: they must agree to ~1e-5 in float32;
a difference from plain HF above ``--loss-tol``, default 1e-5, or above 10x that over the steps
of round 1, which also checks gradients and the AdamW update, is printed as MISMATCH and the
script exits with status 1).
The load average is printed before and after (the machine is shared; this benchmark itself
adds up to ``tp`` to it while a group runs).

Host syncs: after the rounds, one more step of each implementation runs under
``tpify/syncs.py``'s counter (loaded by path, so it counts an older tree alike): the
``aten::_local_scalar_dense`` calls (``.item()``, ``bool()``), the ops whose output size depends
on values, tpify's marked syncs, per step on rank 0 (the optimizer's reads of its own host-side
step counters apart). ``--baseline TREE`` adds ``tpify (base)`` and ``tpify+SP (base)``: the same
implementations from the tpify checkout at ``TREE`` (the main branch's worktree, say), in worker
processes of their own (``TREE`` first on their ``sys.path``), interleaved with the others in
every round, and a table of this tree's time and syncs against the base's. ``--tpify-only``
leaves DTensor and HF TP out.

``--profile``: instead, one group at the first tp > 1 of ``--tp`` runs two warm-up steps and
then one step (``--profile-steps``) under ``torch.profiler`` for tpify and for DTensor, and
prints side by side (rank 0) where the time goes (matmuls, attention, collectives including the
wait for the slower rank, DTensor wrapping and dispatch, the rest, and the time outside any
recorded event) and each one's 15 ops with the most self CPU time.

Usage::

    python benchmarks/bench_step.py --quick                      # smoke run, a tiny model
    python benchmarks/bench_step.py --tp 1,2 --rounds 5          # the issue's model at tp 1 and 2
    python benchmarks/bench_step.py --tp 1,2,4 --sequence-parallel --out step.md --png step.png
    python benchmarks/bench_step.py --profile --tp 2
    python benchmarks/bench_step.py --tp 2 --sequence-parallel --tpify-only --baseline /work/main

Writes the markdown to ``--out`` (default benchmarks/out/step.md) and stdout, and the bar chart
to ``--png`` (default benchmarks/out/step.png).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

PLAIN, TPIFY, TPIFY_SP, DTENSOR, HF_TP = "HF", "tpify", "tpify+SP", "DTensor", "HF TP"
BASE = " (base)"  # --baseline: the same implementation from another tpify tree
TPIFY_BASE, TPIFY_SP_BASE = TPIFY + BASE, TPIFY_SP + BASE
IMPL_ORDER = [PLAIN, TPIFY, TPIFY_BASE, TPIFY_SP, TPIFY_SP_BASE, DTENSOR, HF_TP]
GROUP_TIMEOUT_S = 900
PIN_ENV = "TPIFY_BENCH_PIN"  # --pin, passed to the spawned ranks
RESULT_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Shape:
    """Model and batch of one benchmark run (float32 Llama)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int

    def describe(self) -> str:
        """One line for the report."""
        return (f"Llama, {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
                f"intermediate {self.intermediate}, vocab {self.vocab}; batch {self.batch} x {self.seq} tokens; "
                "float32")


FULL = Shape(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1376, vocab=32000, batch=4, seq=256)
QUICK = Shape(layers=2, hidden=128, heads=8, kv_heads=4, intermediate=344, vocab=4096, batch=2, seq=64)


def sequence_parallel_support() -> tuple[bool, str]:
    """Whether the installed ``tpify.parallelize`` takes ``sequence_parallel``, and a line saying so."""
    sys.path.insert(0, str(ROOT))
    import tpify

    params = inspect.signature(tpify.parallelize).parameters
    if "sequence_parallel" in params:
        return True, "tpify sequence parallelism: measured (tpify.parallelize(..., sequence_parallel=True))"
    return False, ("tpify sequence parallelism: not available (the installed tpify.parallelize has no "
                   "sequence_parallel parameter)")


# ---------------------------------------------------------------------------------------------
# worker side


def _make_checkpoint(path: Path, shape: Shape, seed: int) -> None:
    """Save a random float32 LlamaForCausalLM of ``shape`` (seeded) to ``path`` (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=shape.layers, hidden_size=shape.hidden,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         intermediate_size=shape.intermediate, vocab_size=shape.vocab,
                         max_position_embeddings=max(2048, shape.seq), tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def _dtensor_parallelize(model, tp: int):
    """``parallelize_module`` with the usual Llama plan on a 1-D gloo mesh of ``tp`` CPU ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    # transformers 5.23's LlamaAttention views q/k/v with -1 heads: no head count to divide.
    return parallelize_module(model, mesh, plan)


def _build(impl: str, tp: int, ckpt: str):
    """Model and AdamW of one implementation at ``tp`` (every rank of the group calls it)."""
    import torch
    from transformers import LlamaForCausalLM

    impl = impl.removesuffix(BASE)  # the base tree's tpify is the one this process imports

    if impl == HF_TP:
        from transformers.distributed.configuration_utils import DistributedConfig

        model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=tp))
    else:
        model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        if impl in (TPIFY, TPIFY_SP):
            import tpify

            kwargs = {"sequence_parallel": True} if impl == TPIFY_SP else {}
            model = tpify.parallelize(model, tp_size=tp, **kwargs)
        elif impl == DTENSOR:
            model = _dtensor_parallelize(model, tp)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _device_step(model, opt, ids, clip: float = 0.0):
    """One training step (with ``clip > 0``, the gradients clipped to that norm: tpify's dense norm
    on a tpify model, torch's otherwise); returns the loss, on the device (no read)."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if clip > 0:
        if hasattr(model, "tp_info"):
            from tpify.training import clip_grad_norm_

            clip_grad_norm_(model, clip)
        else:
            import torch

            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _step(model, opt, ids, clip: float = 0.0) -> float:
    """One training step; returns the loss as a float (a DTensor loss made full first)."""
    loss = _device_step(model, opt, ids, clip)
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return float(loss)


def _syncs_counter():
    """``tpify/syncs.py`` of this checkout, loaded by path (it imports nothing of tpify), so that
    the same counter measures the base tree's tpify too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_syncs", ROOT / "tpify" / "syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _impls_for(tp: int, sp: bool) -> list[str]:
    """The implementations measured at ``tp`` (from this tree)."""
    if tp == 1:
        return [PLAIN, TPIFY, DTENSOR]
    return [TPIFY] + ([TPIFY_SP] if sp else []) + [DTENSOR, HF_TP]


def _base_impls_for(tp: int, sp: bool) -> list[str]:
    """The implementations measured from the ``--baseline`` tree at ``tp``."""
    return [TPIFY_BASE] + ([TPIFY_SP_BASE] if sp and tp > 1 else [])


def _quiet_stderr() -> int:
    """Point file descriptor 2 at /dev/null; return a duplicate of the old one to restore it."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


def _worker(rank: int, tp: int, store_path: str, ckpt: str, shape: Shape, seed: int, impls: list[str],
            commands, results, root: str = str(ROOT)) -> None:
    """One rank of one tp group: build every implementation, then serve ``run``/``syncs``/``profile``
    commands. ``root``: the tree whose tpify this group imports (``--baseline``: another one)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get(PIN_ENV) == "1" and tp <= (os.cpu_count() or 1):
        os.sched_setaffinity(0, {rank})  # --pin: rank r of every group on core r
    sys.path.insert(0, root)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, tp), rank=rank, world_size=tp,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(seed))
        built, failed = {}, {}
        for impl in impls:
            try:
                built[impl] = _build(impl, tp, ckpt)
            except Exception as e:  # noqa: BLE001 - reported in the table as the reason it is missing
                failed[impl] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
            dist.barrier()
        numel = {impl: sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in m.parameters())
                 for impl, (m, _) in built.items()}
        import tpify

        results.put((rank, "ready", {"failed": failed, "numel": numel, "tpify": str(Path(tpify.__file__).parent)}))
        first_loss = {}
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "run":
                _, impl, warmup, steps, clip = cmd
                model, opt = built[impl]
                times, losses = [], []
                for i in range(warmup + steps):
                    dist.barrier()
                    start = time.perf_counter()
                    loss = _step(model, opt, ids, clip)
                    elapsed = time.perf_counter() - start
                    first_loss.setdefault(impl, loss)
                    if i >= warmup:
                        times.append(elapsed)
                    losses.append(loss)
                results.put((rank, "ok", {"times": times, "first_loss": first_loss[impl], "losses": losses}))
            elif cmd[0] == "syncs":  # host syncs of one step, after the rounds' steps (warm)
                _, impl, clip = cmd
                model, opt = built[impl]
                syncs = _syncs_counter()
                dist.barrier()
                saved = _quiet_stderr()  # kineto prints a "USDT: ... profiler_start/stop" line per call
                try:
                    with syncs.count_host_syncs() as counts:
                        _device_step(model, opt, ids, clip)
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
                results.put((rank, "ok", dict(counts)))
            elif cmd[0] == "profile":
                _, impl, warmup, steps = cmd
                model, opt = built[impl]
                for _ in range(warmup):
                    _step(model, opt, ids)
                from torch.profiler import ProfilerActivity, profile

                dist.barrier()
                saved = _quiet_stderr()  # kineto prints a "USDT: ... profiler_start/stop" line per call
                try:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        start = time.perf_counter()
                        for _ in range(steps):
                            _step(model, opt, ids)
                        wall = time.perf_counter() - start
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
                events = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
                per_thread: dict[int, float] = {}
                for e in prof.events():
                    per_thread[e.thread] = per_thread.get(e.thread, 0.0) + e.self_cpu_time_total
                main_thread = max(per_thread.values(), default=0.0)  # the step's thread: by far the most time
                results.put((rank, "ok", {"wall": wall, "events": events, "main": main_thread,
                                          "other_threads": sum(per_thread.values()) - main_thread}))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# parent side


class Group:
    """The ``tp`` worker processes of one tp size, and their command/result queues."""

    def __init__(self, ctx, tp: int, tmp: Path, ckpt: Path, shape: Shape, seed: int, impls: list[str],
                 root: Path = ROOT, tag: str = ""):
        self.tp, self.impls = tp, list(impls)
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(tp)]
        store = str(tmp / f"store-tp{tp}{tag}")
        self.procs = [ctx.Process(target=_worker, args=(r, tp, store, str(ckpt), shape, seed, impls,
                                                        self.commands[r], self.results, str(root)), daemon=True)
                      for r in range(tp)]
        for p in self.procs:
            p.start()
        ready = self.collect("setup")
        self.failed: dict[str, str] = {}
        for r in ready:
            self.failed.update(r["failed"])
        self.impls = [i for i in self.impls if i not in self.failed]  # failed on any rank: not measured
        self.numel = {impl: max(r["numel"][impl] for r in ready) for impl in self.impls}
        self.tpify = ready[0]["tpify"]

    def collect(self, what: str) -> list:
        """Every rank's answer to the last command, by rank; raises on a rank's error or a hang."""
        out: dict[int, object] = {}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(out) < self.tp:
            try:
                rank, status, value = self.results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"tp={self.tp} group, {what}: rank(s) {dead or 'some'} died or hung")
                continue
            if status == "error":
                self.kill()
                raise RuntimeError(f"tp={self.tp} group, {what}: rank {rank} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.tp)]

    def send(self, *cmd) -> None:
        """Send one command to every rank."""
        for q in self.commands:
            q.put(cmd)

    def stop(self) -> None:
        """Ask every rank to leave and wait for it (killed after 60 s)."""
        self.send("stop")
        for p in self.procs:
            p.join(timeout=60)
        self.kill()

    def kill(self) -> None:
        """Kill the ranks still alive (this group's own processes only)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()


def _loadavg() -> str:
    """The machine's load average, 1 / 5 / 15 minutes, as one string."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, linearly interpolated (as numpy's default)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted, or ``n/a`` for None."""
    return "n/a" if x is None else format(x, spec)


def run_benchmark(args, shape: Shape, tps: list[int]) -> int:
    """Build the groups, run the interleaved rounds, write the table and the chart; return the exit status."""
    import torch
    import torch.multiprocessing as mp
    import transformers

    sp_ok, sp_line = sequence_parallel_support() if args.sequence_parallel else (False, None)
    load_before = _loadavg()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    ctx = mp.get_context("spawn")
    groups: dict[tuple[int, str], Group] = {}  # (tp, "" or "base") -> its worker processes
    group_of: dict[tuple[int, str], Group] = {}  # (tp, implementation) -> the group that holds it
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = tmp / "llama"
        _make_checkpoint(ckpt, shape, args.seed)
        try:
            for tp in tps:
                trees = [("", ROOT, _impls_for(tp, sp_ok))]
                if args.baseline:
                    trees.append(("base", Path(args.baseline).resolve(), _base_impls_for(tp, sp_ok)))
                for tag, root, impls in trees:
                    if args.tpify_only:
                        impls = [i for i in impls if i not in (DTENSOR, HF_TP)]
                    print(f"starting the tp={tp} group {tag} ({tp} process(es))", file=sys.stderr, flush=True)
                    groups[(tp, tag)] = Group(ctx, tp, tmp, ckpt, shape, args.seed, impls, root, tag)
                    group_of.update({(tp, impl): groups[(tp, tag)] for impl in groups[(tp, tag)].impls})
            units = [(tp, impl) for tp in tps for impl in IMPL_ORDER if (tp, impl) in group_of]
            times: dict[tuple[int, str], list[float]] = {u: [] for u in units}
            first_loss: dict[tuple[int, str], float] = {}
            round1_losses: dict[tuple[int, str], list[float]] = {}
            round_load = []
            for rnd in range(args.rounds):
                shift = rnd % len(units)
                for tp, impl in units[shift:] + units[:shift]:
                    g = group_of[(tp, impl)]
                    g.send("run", impl, args.warmup, args.steps, args.clip)
                    answers = g.collect(f"{impl} round {rnd + 1}")
                    per_step = [max(a["times"][i] for a in answers) for i in range(args.steps)]
                    times[(tp, impl)] += per_step
                    first_loss.setdefault((tp, impl), answers[0]["first_loss"])
                    round1_losses.setdefault((tp, impl), answers[0]["losses"])
                round_load.append(os.getloadavg()[0])
                print(f"round {rnd + 1}/{args.rounds} done, load average {round_load[-1]:.2f}: " +
                      ", ".join(f"{impl}@{tp} {statistics.median(times[(tp, impl)]):.3f}s" for tp, impl in units),
                      file=sys.stderr, flush=True)
            syncs = {}  # (tp, impl) -> rank 0's host syncs of one step, after the rounds
            for tp, impl in units:
                g = group_of[(tp, impl)]
                g.send("syncs", impl, args.clip)
                syncs[(tp, impl)] = g.collect(f"{impl} host syncs")[0]
        finally:
            for g in groups.values():
                try:
                    g.stop()
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    g.kill()

    load_after = _loadavg()
    med = {u: statistics.median(ts) for u, ts in times.items()}
    t1 = med.get((1, PLAIN))
    ref_loss = first_loss.get((1, PLAIN))
    failed = [(tp, impl, reason) for (tp, _), g in groups.items() for impl, reason in g.failed.items()]
    mismatch = []

    lines = ["## Training step: tpify vs DTensor parallelize_module vs transformers TP", "",
             f"- model: {shape.describe()}; one step = forward with labels + backward"
             f"{f' + gradient clipping to {args.clip}' if args.clip > 0 else ''} + AdamW step (+ zero_grad)",
             f"- {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per implementation and tp, "
             f"rounds interleaved; median over the timed steps (each the slowest rank's); gloo on CPU, "
             f"1 thread per rank; ranks pinned to cores (--pin): "
             f"{f'yes, rank r on core r where tp <= {os.cpu_count()}' if args.pin else 'no'}; "
             f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}",
             f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores; torch {torch.__version__}, "
             f"transformers {transformers.__version__}; started {started}",
             f"- load average before: {load_before}; after: {load_after}; 1-min load after each round: "
             f"{', '.join(f'{x:.2f}' for x in round_load)} (this benchmark itself adds up to tp while a group runs)"]
    if sp_line:
        lines.append(f"- {sp_line}")
    if args.sequence_parallel:
        lines.append("- DTensor and HF TP rows are without sequence parallelism (HF TP: "
                     "DistributedConfig.enable_sequence_parallel is 'Reserved ... Not wired up yet' in transformers "
                     f"{transformers.__version__})")
    lines.append("- HF TP at tp=1: DistributedConfig(tp_size=1) builds no mesh, i.e. it is plain HF (row `HF`)")
    if args.baseline:
        base = next(g.tpify for (_, tag), g in groups.items() if tag == "base")
        lines.append(f"- `{BASE.strip()}` rows: the same implementation from the tpify at `{base}` (--baseline), in "
                     f"worker processes of their own, interleaved with the others in every round")
    lines.append("- host syncs: one step after the rounds, rank 0, counted by tpify/syncs.py (torch.profiler: "
                 "`aten::_local_scalar_dense`, ops whose output size depends on values, tpify's marked syncs); "
                 "`+ n`: the optimizer's reads of its own step counters (host tensors: no sync on a GPU)")
    for tp, impl, reason in failed:
        lines.append(f"- **{impl} at tp={tp} could not run**: {reason}")
    ref_traj = round1_losses.get((1, PLAIN))
    nsteps1 = args.warmup + args.steps
    lines += ["", "| implementation | tp | params per rank (largest) | step s (median) | p25-p75 s | min-max s | "
              "timed steps | "
              "efficiency T1/(tp*T) | loss at step 1 | loss - HF loss | max abs(loss - HF loss), steps 1-"
              f"{nsteps1} | host syncs per step |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for tp, impl in sorted(units, key=lambda u: (u[0], IMPL_ORDER.index(u[1]))):
        ts = times[(tp, impl)]
        eff = t1 / (tp * med[(tp, impl)]) if t1 else None
        loss = first_loss[(tp, impl)]
        diff = loss - ref_loss if ref_loss is not None else None
        traj = (max(abs(a - b) for a, b in zip(round1_losses[(tp, impl)], ref_traj))
                if ref_traj is not None else None)
        flag = ""
        if (diff is not None and abs(diff) > args.loss_tol) or (traj is not None and traj > 10 * args.loss_tol):
            flag = " MISMATCH"
            mismatch.append((tp, impl, max(abs(diff), traj)))
        counted = syncs[(tp, impl)]
        lines.append(f"| {impl} | {tp} | {group_of[(tp, impl)].numel[impl] / 1e6:.2f}M | {med[(tp, impl)]:.3f} | "
                     f"{_quantile(ts, 0.25):.3f}-{_quantile(ts, 0.75):.3f} | "
                     f"{min(ts):.3f}-{max(ts):.3f} | {len(ts)} | {_fmt(eff)} | {loss:.7f} | "
                     f"{_fmt(diff, '+.1e')} | {_fmt(traj, '.1e')}{flag} | {counted.get('total', 0)} "
                     f"+ {counted.get('optimizer step counters', 0)} |")
    lines += ["", "| tp | tpify s | efficiency tpify | tpify / HF (1 process) | tpify / DTensor | tpify / HF TP |"
              + (" tpify+SP s | efficiency tpify+SP | tpify+SP / DTensor |" if sp_ok else ""),
              "| ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if sp_ok else "")]

    def ratio(a, b):
        return med[a] / med[b] if a in med and b in med else None

    for tp in tps:
        if (tp, TPIFY) not in med:
            continue
        row = (f"| {tp} | {med[(tp, TPIFY)]:.3f} | {_fmt(t1 / (tp * med[(tp, TPIFY)]) if t1 else None)} | "
               f"{_fmt(ratio((tp, TPIFY), (1, PLAIN)))} | {_fmt(ratio((tp, TPIFY), (tp, DTENSOR)))} | "
               f"{_fmt(ratio((tp, TPIFY), (tp, HF_TP)) if tp > 1 else None)} |")
        if sp_ok:
            sp = med.get((tp, TPIFY_SP))
            row += (f" {_fmt(sp)} | {_fmt(t1 / (tp * sp) if sp and t1 else None)} | "
                    f"{_fmt(ratio((tp, TPIFY_SP), (tp, DTENSOR)))} |")
        lines.append(row)
    if args.baseline:
        lines += ["", "Against the base tree, in the same run (median step time, this tree / base; host syncs per step "
                  "this tree / base):", "",
                  "| implementation | tp | this tree s | base s | this / base | host syncs, this / base |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for tp, impl in units:
            base = (tp, impl + BASE)
            if impl.endswith(BASE) or base not in med:
                continue
            lines.append(f"| {impl} | {tp} | {med[(tp, impl)]:.3f} | {med[base]:.3f} | "
                         f"{med[(tp, impl)] / med[base]:.3f} | {syncs[(tp, impl)].get('total', 0)} / "
                         f"{syncs[base].get('total', 0)} |")
    spread = max(first_loss.values()) - min(first_loss.values()) if first_loss else 0.0
    worst_traj = max((abs(a - b) for u in units for a, b in zip(round1_losses[u], ref_traj or [])), default=0.0)
    lines += ["", f"Loss at step 1 (same weights, same batch): largest difference between implementations "
              f"{spread:.1e}; over the {nsteps1} steps of round 1 (same batch each step, so this also checks the "
              f"gradients and the AdamW update) at most "
              f"{worst_traj:.1e} "
              f"from plain HF (tolerances {args.loss_tol:.0e} at step 1, {10 * args.loss_tol:.0e} over round 1)"
              + (": MISMATCH" if mismatch else ": they agree.")]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.png:
        _plot(args.png, shape, tps, units, med, times, f"load average before: {load_before}")
    print(text)
    if mismatch:
        print("MISMATCH: losses differ from plain HF beyond the tolerance: " +
              ", ".join(f"{impl}@tp={tp} {d:.2e}" for tp, impl, d in mismatch), file=sys.stderr)
        return 1
    return 0


def _plot(path: str, shape: Shape, tps, units, med, times, note: str) -> None:
    """Bars per implementation per tp (median step time, p25-p75 whiskers), the ideal T1 / tp dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(IMPL_ORDER, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    labelled = set()
    for j, tp in enumerate(tps):
        here = [i for i in IMPL_ORDER if (tp, i) in med]
        width = 0.8 / max(len(here), 1)
        for k, impl in enumerate(here):
            ts, m = times[(tp, impl)], med[(tp, impl)]
            ax.bar(j - 0.4 + width * (k + 0.5), m, width * 0.95, color=colors[impl], capsize=2,
                   yerr=[[m - _quantile(ts, 0.25)], [_quantile(ts, 0.75) - m]],
                   label=None if impl in labelled else impl)
            labelled.add(impl)
    if (1, PLAIN) in med:
        for j, tp in enumerate(tps):
            ax.hlines(med[(1, PLAIN)] / tp, j - 0.42, j + 0.42, colors="k", linestyles="dashed",
                      label="T1 / tp (ideal)" if j == 0 else None)
    ax.set_xticks(range(len(tps)), [f"tp={tp}" for tp in tps])
    ax.set_ylabel("step time, s (median; whiskers p25-p75)")
    ax.set_title(f"train step, {shape.layers}L h{shape.hidden} V{shape.vocab}, {shape.batch}x{shape.seq} tokens, "
                 f"CPU gloo\n{note}",
                 fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    rank = {name: k for k, name in enumerate(IMPL_ORDER)}
    order = sorted(range(len(labels)), key=lambda k: rank.get(labels[k], -1))
    ax.legend([handles[k] for k in order], [labels[k] for k in order], fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# tpify's autograd functions that issue collectives (tpify/comm/, tpify/layers/, tpify/loss/): a blocking
# gloo collective waits in Python (``work.wait()``), not in a profiled op, so the wait shows up as
# the self time of the function around it.
_TPIFY_COMM_FUNCTIONS = ("_CopyToTPRegion", "_CopyManyToTPRegion", "_ReduceFromTPRegion", "_ScatterToTPRegion",
                         "_GatherFromTPRegion", "_SumGradRanges", "_ColumnParallelMatmul", "_VocabParallelCrossEntropy",
                         "_ReduceScatter", "_AllGather")


def _category(name: str) -> str:
    """The bucket of a profiler event name, for the profile's summary."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        return "matmuls (aten::mm/addmm/bmm)"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention kernel (SDPA)"
    if name.startswith(("c10d", "_c10d_functional", "gloo", "record_param_comms")):
        return "collective ops (c10d enqueue; DTensor's wait_tensor: the wait)"
    if name.startswith(_TPIFY_COMM_FUNCTIONS):
        return "tpify's autograd functions (the wait on their collectives + their Python)"
    if name in ("PythonSubclass", "NestedRedistribute") or name.startswith(("_FromTorchTensor", "_ToTorchTensor",
                                                                                "Redistribute", "DTensor")):
        return "DTensor wrapping and dispatch"
    if "Optimizer" in name:
        return "optimizer step (its own Python)"
    return "everything else (elementwise, copies, loss, autograd functions)"


def run_profile(args, shape: Shape, tps: list[int]) -> int:
    """tpify and DTensor steps under torch.profiler at the first tp > 1; top ops side by side (rank 0)."""
    import torch.multiprocessing as mp

    tp = next((t for t in tps if t > 1), 2)
    impls = [TPIFY, DTENSOR]
    n = args.profile_steps
    ctx = mp.get_context("spawn")
    load_before = _loadavg()
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp_name:
        tmp = Path(tmp_name)
        ckpt = tmp / "llama"
        _make_checkpoint(ckpt, shape, args.seed)
        group = Group(ctx, tp, tmp, ckpt, shape, args.seed, impls)
        try:
            if group.failed:
                raise RuntimeError(f"could not build: {group.failed}")
            prof = {}
            for impl in impls:
                group.send("profile", impl, 2, n)
                prof[impl] = group.collect(f"profile {impl}")[0]  # rank 0
        finally:
            group.stop()
    per = "per step, " if n > 1 else ""
    lines = [f"## Per-op profile of {n} training step(s) at tp={tp}, rank 0 (torch.profiler, self CPU time"
             f"{', averaged per step' if n > 1 else ''})", "",
             f"- model: {shape.describe()}; 2 warm-up steps each first",
             f"- load average before: {load_before}; after: {_loadavg()}",
             "- a collective's wait for the slower rank is the self time of `_c10d_functional::wait_tensor` "
             "(DTensor) or of the tpify autograd function that waits on it (`work.wait()` is not a profiled op); "
             "`PythonSubclass` is DTensor's __torch_dispatch__ (sharding propagation, wrapping)", ""]
    cats = {}
    for impl in impls:
        events = prof[impl]["events"]
        main = prof[impl]["main"] / 1e3 / n
        other = prof[impl]["other_threads"] / 1e3 / n
        wall = prof[impl]["wall"] * 1e3 / n
        lines.append(f"- {impl}: step wall {wall:.1f} ms (under the profiler); self CPU time in recorded events "
                     f"{main:.1f} ms on the step's thread (+ {other:.1f} ms on other threads: gloo's copies); "
                     f"outside any recorded event {wall - main:.1f} ms; "
                     f"{sum(e[2] for e in events) // n} op calls {per.strip(', ') or 'in the step'}")
        cats[impl] = {}
        for name, us, _ in events:
            cats[impl][_category(name)] = cats[impl].get(_category(name), 0.0) + us / 1e3 / n
        cats[impl]["outside any recorded event (Python)"] = wall - main
    names = sorted({c for impl in impls for c in cats[impl]}, key=lambda c: -max(cats[i].get(c, 0) for i in impls))
    lines += ["", "| where the time goes, ms | " + " | ".join(impls) + " |", "| --- |" + " ---: |" * len(impls)]
    for c in names:
        lines.append(f"| {c} | " + " | ".join(f"{cats[i].get(c, 0.0):.1f}" for i in impls) + " |")
    lines.append("| **step wall** | " + " | ".join(f"**{prof[i]['wall'] * 1e3 / n:.1f}**" for i in impls) + " |")
    lines.append("\n(the rows include the other threads' time, so they can add up to a little more than the wall)")
    top = {impl: sorted(prof[impl]["events"], key=lambda e: -e[1])[:args.profile_top] for impl in impls}
    head = " | ".join(f"{impl} op | self ms | calls" for impl in impls)
    lines += ["", f"| # | {head} |", "| ---: |" + " --- | ---: | ---: |" * len(impls)]
    for i in range(args.profile_top):
        cells = []
        for impl in impls:
            if i < len(top[impl]):
                name, us, count = top[impl][i]
                cells.append(f"`{name}` | {us / 1e3 / n:.1f} | {count // n}")
            else:
                cells.append(" | | ")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


def main() -> int:
    """Parse the options and run the benchmark or the profile."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tp sizes (1 is always added: T1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per implementation per round")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per implementation per round")
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch (smoke run)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also measure tpify with sequence_parallel=True (when tpify supports it)")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r of each group to core r (every implementation alike; tp <= cores)")
    parser.add_argument("--profile", action="store_true",
                        help="per-op profile of one tpify and one DTensor step at the first tp > 1 instead")
    parser.add_argument("--profile-top", type=int, default=15, help="ops listed per implementation")
    parser.add_argument("--profile-steps", type=int, default=1, help="profiled steps (averaged per step)")
    parser.add_argument("--baseline", default=None, metavar="TREE",
                        help="also measure tpify and tpify+SP from the tpify checkout at TREE (e.g. the main branch's "
                             "worktree), in worker processes of their own, interleaved: ratios in the same run")
    parser.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                        help="clip the gradients to this norm in every step (tpify.training.clip_grad_norm_ on tpify "
                             "models, torch.nn.utils.clip_grad_norm_ otherwise); 0: no clipping (default)")
    parser.add_argument("--tpify-only", action="store_true",
                        help="leave out DTensor and HF TP (plain HF at tp 1 stays: the reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-tol", type=float, default=1e-5,
                        help="largest accepted |loss at step 1 - plain HF's| (float32; 10x that over round 1)")
    parser.add_argument("--out", default=None, help="markdown file (default benchmarks/out/step.md, "
                                                    "or step_profile.md with --profile)")
    parser.add_argument("--png", default=None, help="bar chart (default benchmarks/out/step.png)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    os.environ[PIN_ENV] = "1" if args.pin else "0"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")
    shape = QUICK if args.quick else FULL
    tps = sorted({1, *(int(t) for t in args.tp.split(","))})
    if any(t < 1 for t in tps):
        parser.error(f"--tp sizes must be >= 1, got {args.tp}")
    bad = [t for t in tps if shape.heads % t or shape.kv_heads % t]
    if bad:
        parser.error(f"tp sizes {bad} do not divide {shape.heads} heads and {shape.kv_heads} KV heads")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    if args.profile:
        args.out = args.out or str(OUT / "step_profile.md")
        return run_profile(args, shape, tps)
    args.out = args.out or str(OUT / "step.md")
    args.png = args.png or str(OUT / "step.png")
    return run_benchmark(args, shape, tps)


if __name__ == "__main__":
    sys.exit(main())
