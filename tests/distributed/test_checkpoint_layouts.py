"""Training checkpoints at any layout (tpify/checkpoint.py, torch.distributed.checkpoint).

A tiny float64 GPT-2 (fused ``c_attn``: a packed Conv1D parameter; a 61-token vocabulary, padded
on every tp > 1) trains with AdamW (weight decay), a learning-rate schedule and global-norm
clipping (max norm 0.5, below the measured norms: clipping acts at every step). It is saved
after 2 steps at dp 2 x tp 2 with ``pad_vocab_multiple=8`` (the vocabulary padded to 64 rows, 32
per rank, which is not DTensor's ``ceil(61 / 2) = 31``: the dense-order fallback), then resumed
at tp 4 (padded to 64 rows, 16 per rank: DTensor's chunks), at dp 4 x tp 1, at tp 1 in one
process (the parent) and at the saved layout, each into a model initialised from another seed,
and trained 2 more steps; the same checkpoint is resumed into FSDP2 (dp 2 x tp 2), and one
saved under FSDP2 is resumed at tp 4. The weights then equal those of the uninterrupted dense run (4 steps
on one process): ``atol=1e-8, rtol=1e-6``, for the reason tests/distributed/test_dp_tp_training.py
gives (Adam's ``m / (sqrt(v) + eps)`` turns ~1e-16 relative gradient noise of rows with tiny
gradients into up to ~1e-9; a wrong shard, a lost moment or a step counter restarted moves
weights by ~1e-3; measured here: at most 1.6e-14 from the dense run at every layout). At the saved
layout the resumed run is bitwise the uninterrupted tensor-parallel run.

The checks share one spawned job of 4 ranks (:func:`tputil.run_checks`), one test per check; the
resume at tp 1 and the comparison with a one-process save run in the pytest process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tputil

pytestmark = pytest.mark.slow

VOCAB, BATCH, SEQ = 61, 4, 8
BEFORE, AFTER = 2, 2
TOL = dict(atol=1e-8, rtol=1e-6)


def _config(n_embd=16):
    return GPT2Config(n_layer=1, n_embd=n_embd, n_head=4, n_positions=16, vocab_size=VOCAB, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _dense(seed=0, n_embd=16):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(_config(n_embd)).double()


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100  # the same count of labelled tokens in every row: the mean of DP means is the mean
    return ids, labels


def _optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.25, total_iters=BEFORE + AFTER)


def _dense_steps(model, opt, sched, steps):
    for step in steps:
        ids, labels = _batch(step)
        loss = tputil.ref_lm_loss(model(ids).logits, labels, causal=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert norm > 0.5, "the test must exercise clipping"
        opt.step()
        sched.step()
        opt.zero_grad()


def _tp_steps(model, opt, sched, steps):
    import torch.distributed as dist

    import tpify
    from tpify.sharding import is_dtensor
    from tpify.training import clip_grad_norm_, sync_gradients

    info = tpify.get_tp_info(model)
    dp = dist.get_world_size(info.dp_group) if info.dp_group is not None else 1
    dp_rank = dist.get_rank(info.dp_group) if info.dp_group is not None else 0
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in steps:
        ids, labels = _batch(step)
        model(ids[rows], labels=labels[rows]).loss.backward()
        if not any(is_dtensor(p) for p in model.parameters()):  # FSDP2 reduces over DP itself
            sync_gradients(model)
        clip_grad_norm_(model, 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()


def _reference():
    """The uninterrupted dense run: 4 steps on one process."""
    ref = _dense()
    opt, sched = _optim(ref)
    _dense_steps(ref, opt, sched, range(BEFORE + AFTER))
    return {k: v.detach() for k, v in ref.state_dict().items()}


def _assert_dense_equal(got: dict, ref: dict, what: str, **tol):
    for key, value in got.items():
        torch.testing.assert_close(value, ref[key], **(tol or TOL), msg=lambda m: f"{what}: {key}: {m}")


def _resume(path, tp, pad=1, fsdp=False):
    """A model from another seed, parallelized at ``tp`` (``fsdp``: then sharded by FSDP2 over
    DP), resumed from ``path``, trained on."""
    import tpify
    from tpify.checkpoint import load_checkpoint

    model = tpify.parallelize(_dense(seed=7), tp_size=tp, pad_vocab_multiple=pad)
    if fsdp:
        tpify.shard_data_parallel(model)
    opt, sched = _optim(model)
    load_checkpoint(path, model, [opt], [sched])
    _tp_steps(model, opt, sched, range(BEFORE, BEFORE + AFTER))
    return tpify.dense_state_dict(model)


# ------------------------------------------------------------------------------------------------
# The checks, run in one spawned job of 4 ranks.

class _Run:
    def __init__(self, out):
        self.out = out
        self.ckpt = f"{out}/ckpt"
        self.ref = _reference()
        self.straight = None


def saved_at_dp2_tp2(c):
    """Save after 2 steps at dp 2 x tp 2 (padded vocabulary, fallback), continue uninterrupted."""
    import tpify
    from tpify.checkpoint import save_checkpoint

    model = tpify.parallelize(copy.deepcopy(_dense()), tp_size=2, pad_vocab_multiple=8)
    assert model.transformer.wte.weight.shape[0] == 32, "61 rows padded to 64, 32 per rank"
    opt, sched = _optim(model)
    _tp_steps(model, opt, sched, range(BEFORE))
    save_checkpoint(c.ckpt, model, [opt], [sched], extra={"step": BEFORE})
    _tp_steps(model, opt, sched, range(BEFORE, BEFORE + AFTER))
    c.straight = tpify.dense_state_dict(model)
    _assert_dense_equal(c.straight, c.ref, "uninterrupted dp 2 x tp 2")


def resumes_at_tp4(c):
    _assert_dense_equal(_resume(c.ckpt, 4), c.ref, "resumed at tp 4")


def resumes_at_dp4_tp1(c):
    _assert_dense_equal(_resume(c.ckpt, 1), c.ref, "resumed at dp 4 x tp 1")


def resumes_at_the_saved_layout_bitwise(c):
    got = _resume(c.ckpt, 2, pad=8)
    for key, value in got.items():
        assert torch.equal(value, c.straight[key]), f"resumed at dp 2 x tp 2: {key} differs from the uninterrupted run"


def fsdp2_resumes_and_saves_at_other_layouts(c):
    """The dp 2 x tp 2 checkpoint resumed into FSDP2 over dp 2 x tp 2 (each rank slices its rows
    of every TP shard and of its Adam moments); a checkpoint saved under FSDP2 (each TP shard
    gathered over DP) resumed at tp 4. Both continue as the uninterrupted dense run."""
    import tpify
    from tpify.checkpoint import save_checkpoint

    _assert_dense_equal(_resume(c.ckpt, 2, fsdp=True), c.ref, "resumed into FSDP2 at dp 2 x tp 2")
    model = tpify.shard_data_parallel(tpify.parallelize(copy.deepcopy(_dense()), tp_size=2))
    opt, sched = _optim(model)
    _tp_steps(model, opt, sched, range(BEFORE))
    save_checkpoint(f"{c.out}/ckpt_fsdp", model, [opt], [sched])
    _assert_dense_equal(_resume(f"{c.out}/ckpt_fsdp", 4), c.ref, "saved under FSDP2, resumed at tp 4")


def other_model_is_refused_on_every_rank(c):
    import tpify
    from tpify.checkpoint import load_checkpoint

    model = tpify.parallelize(_dense(n_embd=24), tp_size=2)
    opt, sched = _optim(model)
    with pytest.raises(tpify.CheckpointError, match=r"transformer.wte.weight.*\(61, 16\).*\(61, 24\)"):
        load_checkpoint(c.ckpt, model, [opt], [sched])


def _recording_writes(fail: bool = False):
    """Patch the save's ``save_file`` on this rank: record the names written (or raise)."""
    import tpify.io.save as save

    written, real = [], save.save_file

    def record(tensors, filename, metadata=None):
        if fail:
            raise OSError(f"disk full (simulated) writing {Path(filename).name}")
        written.append(Path(filename).name)
        return real(tensors, filename, metadata=metadata)

    save.save_file = record
    return written, lambda: setattr(save, "save_file", real)


def dense_save_by_several_ranks(c):
    """save_pretrained at dp 2 x tp 2: the files are written by several ranks (the parent
    compares them with a one-process save)."""
    import torch.distributed as dist

    import tpify

    model = tpify.parallelize(copy.deepcopy(_dense()), tp_size=2, pad_vocab_multiple=8)
    written, restore = _recording_writes()
    try:
        tpify.save_pretrained(model, f"{c.out}/dense", max_shard_size="4KB")
    finally:
        restore()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, written)
    assert sum(1 for w in everyone if w) == 4, f"every rank writes some of the files: {everyone}"
    assert sorted(n for w in everyone for n in w) == sorted({n for w in everyone for n in w}), "a file written twice"


def failed_write_on_one_rank_leaves_the_target_untouched(c):
    """Rank 1 fails writing its file: every rank raises (rank 1 its own error, the others naming
    rank 1), the previous checkpoint in the target is byte for byte intact, no temporary
    directory is left."""
    import torch.distributed as dist

    import tpify

    target = Path(f"{c.out}/dense_kept")
    model = tpify.parallelize(copy.deepcopy(_dense()), tp_size=2, pad_vocab_multiple=8)
    tpify.save_pretrained(model, target, max_shard_size="4KB")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    other = tpify.parallelize(_dense(seed=3), tp_size=2, pad_vocab_multiple=8)
    _, restore = _recording_writes(fail=dist.get_rank() == 1)
    try:
        pattern = r"disk full \(simulated\)" if dist.get_rank() == 1 else r"saving failed on rank\(s\) \[1\]"
        with pytest.raises((OSError, RuntimeError), match=pattern):
            tpify.save_pretrained(other, target, max_shard_size="4KB")
    finally:
        restore()
    dist.barrier()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before, "the target changed"
    assert not list(target.parent.glob(".dense_kept.tmp-*")), "a temporary directory was left"


CHECKS = {f.__name__: f for f in (saved_at_dp2_tp2, resumes_at_tp4, resumes_at_dp4_tp1,
                                   resumes_at_the_saved_layout_bitwise, fsdp2_resumes_and_saves_at_other_layouts,
                                   other_model_is_refused_on_every_rank,
                                   dense_save_by_several_ranks, failed_write_on_one_rank_leaves_the_target_untouched)}


def _body(rank, world, out):
    torch.manual_seed(0)
    return tputil.run_checks(CHECKS, _Run(out))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    return out, tputil.spawn(_body, 4, str(out), timeout=300)


@pytest.mark.parametrize("name", list(CHECKS))
def test_checkpoint_layouts(layouts, name):
    _, results = layouts
    problems = {rank: r[name] for rank, r in enumerate(results) if r[name] is not None}
    assert not problems, "\n".join(f"--- rank {k} ---\n{v}" for k, v in problems.items())


def test_resumes_at_tp1_in_one_process(layouts):
    """The checkpoint of 4 ranks, resumed by one process without torch.distributed."""
    out, _ = layouts
    _assert_dense_equal(_resume(f"{out}/ckpt", 1), _reference(), "resumed at tp 1, one process")


def test_dense_save_by_several_ranks_equals_the_one_process_save(layouts, tmp_path):
    """The files the 4 ranks wrote hold exactly (``torch.equal``) the tensors of a one-process
    save of the same weights, under the same file names and index; transformers loads them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import tpify

    out, _ = layouts
    several, one = out / "dense", tmp_path / "one"
    tpify.save_pretrained(tpify.parallelize(_dense(), tp_size=1), one, max_shard_size="4KB")
    index = json.loads((several / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((one / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index["weight_map"].values())) >= 5, "several rounds of files"
    for name in sorted(set(index["weight_map"].values())):
        a, b = load_file(several / name), load_file(one / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    loaded = AutoModelForCausalLM.from_pretrained(several, dtype=torch.float64).state_dict()
    for key, value in _dense().state_dict().items():
        assert torch.equal(loaded[key], value), key
