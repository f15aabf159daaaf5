"""Ranks that disagree, or an error on one rank only: the same error point on every rank, no hang.

One 2-rank spawn runs every case; each case is followed by a barrier, so a rank left waiting in
a collective would hang the next barrier and the test would fail at its deadline (60 s group
timeout, 120 s test deadline) instead of passing.

* different ``tp_size`` on the two ranks; a different model config on one rank: every rank raises
  ``AgreementError`` listing the differing value per rank (before the mesh is created, where the
  ranks would otherwise block or abort with a gloo collective mismatch);
* one rank's copy of the checkpoint is truncated: that rank raises ``CheckpointError`` naming the
  file, the other ``AgreementError`` naming the rank and the error; the same for
  ``load_weights_`` (the in-place load a Trainer resume uses);
* ``tpify.save_pretrained`` to a path that is a file on one rank only;
* a ``tp_group`` that does not contain the rank: a ``ValueError`` saying so;
* ``tpify.training.check_replicas``: passes on a fresh model, and names a replicated parameter
  whose copy drifted on one rank;
* the ranks in different tpify calls (rank 0 saves, rank 1 parallelizes): both raise, naming
  each rank's call;
* a call made on rank 0 only (``if rank == 0: tpify.save_pretrained(...)``) while rank 1 waits
  in a barrier: rank 0 warns once after ``$TPIFY_AGREEMENT_NOTICE`` (1 s here) which rank it
  waits for, in which call, and why, then raises after ``$TPIFY_AGREEMENT_TIMEOUT`` (5 s here)
  naming rank 1, and the barrier then completes (last: it leaves the ranks' agreement counts out
  of step); no other case (nor rank 1) warns;
* the same call when rank 1 has exited: rank 0 raises at once (a separate spawn, with a 60 s
  agreement timeout that the test's 45 s deadline would catch).
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tputil


def _gpt2(n_layer=1):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def _cases(rank, tmp):
    import tpify
    from tpify.training import check_replicas

    def tp_size():
        tpify.parallelize(_gpt2(), tp_size=2 if rank == 0 else 1)

    def config():
        tpify.parallelize(_gpt2(n_layer=1 if rank == 0 else 2), tp_size=2)

    def truncated():
        import torch.distributed as dist

        path = f"{tmp}/rank{rank}"
        if rank == 0:  # HF's save_pretrained writes on global rank 0 only
            for r in (0, 1):
                _gpt2().save_pretrained(f"{tmp}/rank{r}")
        dist.barrier()
        if rank == 1:
            with open(f"{path}/model.safetensors", "r+b") as f:
                f.truncate(100)
        tpify.from_pretrained(path, tp_size=2)

    def truncated_load_weights():  # after truncated(): rank 1's copy is the truncated one
        from tpify.api import load_weights_

        load_weights_(tpify.parallelize(_gpt2(), tp_size=2), f"{tmp}/rank{rank}")

    def save_to_file():
        model = tpify.parallelize(_gpt2(), tp_size=2)
        target = f"{tmp}/target{rank}"
        if rank == 1:
            open(target, "w").close()
        tpify.save_pretrained(model, target)

    def replicas():
        model = tpify.parallelize(_gpt2(), tp_size=2)
        check_replicas(model)
        if rank == 1:
            with torch.no_grad():
                model.transformer.ln_f.weight.add_(1e-7)
        check_replicas(model)

    def foreign_group():
        import torch.distributed as dist

        groups = [dist.new_group([0]), dist.new_group([1])]  # collective: every rank creates both
        tpify.parallelize(_gpt2(), tp_group=groups[1 - rank])  # each rank passes the other's group

    def different_calls():
        model = tpify.parallelize(_gpt2(), tp_size=2)
        if rank == 0:
            tpify.save_pretrained(model, f"{tmp}/different")
        else:
            tpify.parallelize(_gpt2(), tp_size=2)

    def only_rank0_saves():
        import os

        model = tpify.parallelize(_gpt2(), tp_size=2)
        os.environ["TPIFY_AGREEMENT_TIMEOUT"] = "5"
        os.environ["TPIFY_AGREEMENT_NOTICE"] = "1"
        if rank == 0:
            tpify.save_pretrained(model, f"{tmp}/only0")

    return {"different_calls": different_calls, "tp_size": tp_size, "config": config, "foreign_group": foreign_group, "truncated": truncated,
            "truncated_load_weights": truncated_load_weights, "save_to_file": save_to_file,
            "replicas": replicas, "only_rank0_saves": only_rank0_saves}


def _body(rank, world):
    import tempfile

    import torch.distributed as dist

    import warnings

    out = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        for name, case in _cases(rank, shared[0]).items():
            try:
                case()
                out[name] = "no error"
            except Exception as e:  # noqa: BLE001 - the errors are what is tested
                out[name] = f"{type(e).__name__}: {e}"
            dist.barrier()
    out["notices"] = [str(w.message) for w in seen if "has waited" in str(w.message)]
    return out


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_disagreeing_ranks_and_one_rank_errors_raise_everywhere():
    r0, r1 = tputil.spawn(_body, 2, timeout=120)
    for out in (r0, r1):
        assert out["tp_size"].startswith("AgreementError: the ranks disagree on tpify.parallelize: tp_size: "
                                         "rank 0 2, rank 1 1"), out["tp_size"]
        assert out["config"].startswith("AgreementError") and "config: rank 0 " in out["config"], out["config"]
        assert "save_pretrained" in out["save_to_file"]
        assert out["replicas"].startswith("AgreementError: replicated parameters differ across ranks") \
            and "transformer.ln_f.weight differs between TP ranks (ranks [0], ranks [1])" in out["replicas"], out
    for out in (r0, r1):
        assert out["foreign_group"].startswith("ValueError: tp_group does not contain this process"), out
    assert r1["truncated"].startswith("CheckpointError") and "truncated or corrupt" in r1["truncated"]
    assert r0["truncated"].startswith("AgreementError: tpify.from_pretrained failed on rank(s) [1] "
                                      "(rank 1: CheckpointError"), r0["truncated"]
    for me, other, out in ((0, 1, r0), (1, 0, r1)):
        mine, theirs = ("tpify.save_pretrained", "tpify.parallelize")[::1 if me == 0 else -1]
        assert out["different_calls"].startswith(f"AgreementError: the ranks are in different tpify calls: this rank "
                                                 f"(rank {me}) in {mine}, rank {other} in {theirs}"), out
    assert r0["only_rank0_saves"].startswith("AgreementError: tpify.save_pretrained: rank(s) [1] did not call it "
                                             "within 5 s"), r0["only_rank0_saves"]
    assert r1["only_rank0_saves"] == "no error"
    (notice,) = r0["notices"]  # once, after 1 s, before the error at 5 s
    assert notice.startswith("tpify: rank 0 has waited 1 s in tpify.save_pretrained for rank(s) [1], which have "
                             "not called it. The usual cause is a tpify entry point called on some ranks only (e.g. "
                             "under `if rank == 0:`)"), notice
    assert "raises an AgreementError after 5 s" in notice and "TPIFY_AGREEMENT_TIMEOUT" in notice, notice
    assert r1["notices"] == [], r1["notices"]
    assert r1["truncated_load_weights"].startswith("CheckpointError"), r1["truncated_load_weights"]
    assert r0["truncated_load_weights"].startswith("AgreementError: tpify.load_weights_ failed on rank(s) [1] "
                                                   "(rank 1: CheckpointError"), r0["truncated_load_weights"]
    assert r1["save_to_file"].startswith("ValueError") and "is not a directory" in r1["save_to_file"]
    assert r0["save_to_file"].startswith("AgreementError: tpify.save_pretrained failed on rank(s) [1]")


def _rank0_saves_after_rank1_exited(rank, world, tmp):
    import os
    import time

    import tpify

    os.environ["TPIFY_AGREEMENT_TIMEOUT"] = "60"
    model = tpify.parallelize(_gpt2(), tp_size=2)
    if rank == 1:
        return "exited"
    start = time.monotonic()
    try:
        tpify.save_pretrained(model, f"{tmp}/out")
    except Exception as e:  # noqa: BLE001 - the error is what is tested
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_call_on_rank_0_only_raises_at_once_when_the_other_rank_has_exited(tmp_path):
    r0, r1 = tputil.spawn(_rank0_saves_after_rank1_exited, 2, str(tmp_path), timeout=45)
    message, seconds = r0
    assert message.startswith("AgreementError: tpify.save_pretrained: rank(s) [1] exited without calling it"), message
    assert seconds < 30, seconds
    assert not (tmp_path / "out").exists()
    print(f"measured: rank 0 raised {seconds:.1f} s after calling save_pretrained")
