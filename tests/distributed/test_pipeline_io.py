"""Loading and saving by stage (``tpify.pipeline.from_pretrained`` / ``save_pretrained``), float64.

One spawned job of 4 gloo ranks: GPT-2 (tied head) and Llama (untied, GQA) saved dense by
transformers, loaded at pp 2 x tp 2 where each rank reads only its stage's tensors, and of those
only its TP slices (every read counted: the keys and the bytes equal the stage's own); one step
(loss and every gradient) and one AdamW update equal the dense model's; the pipeline's save is
one plain HF directory transformers loads, equal to the updated dense model; that directory
loaded again at pp 4 x tp 1 (another layout) gives the dense model's loss and gradients.
Tolerance: float64 sums in another order (tputil.F64).
"""

from __future__ import annotations

import pytest
import torch

from tests import tputil
from tests.distributed.test_pipeline import _batch, _dense_loss, _gpt2, _llama

pytestmark = pytest.mark.slow

M = 4


def _counting_reads(log: dict):
    """Count every tensor read from a checkpoint: ``{key: bytes}`` of the slices returned."""
    from tpify.io import reader

    original = reader._Reader.read

    def read(self, key, spec, dtype, into=None):
        value = original(self, key, spec, dtype, into=into)
        log[key] = log.get(key, 0) + value.numel() * value.element_size()
        return value

    reader._Reader.read = read


def _step_matches(sched, ref, seed, what):
    import tpify.pipeline as pp

    stages = pp.stages_of(sched)
    first, last = stages[0].is_first, stages[-1].is_last
    ids, labels = _batch(ref.config.vocab_size, seed)
    want = _dense_loss(ref, ids, labels)
    want.backward()
    loss = pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
    if last:
        torch.testing.assert_close(loss, want.detach(), **tputil.F64, msg=f"{what}: loss")
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for stage in stages:
        named = tputil.dense_named(stage.model, "grad")
        for n, g in named.items():
            torch.testing.assert_close(g, ref_grads[n], **tputil.F64, msg=f"{what}: grad {n}")


def _full(t):
    """A DTensor (FSDP2's, split over dp_shard) gathered whole; a plain tensor as it is."""
    from tpify.sharding import is_dtensor

    return t.full_tensor() if t is not None and is_dtensor(t) else t


def _fsdp_step_matches(sched, ref, seed, what, replicas):
    """One step of stages under FSDP2 (tp 1) against the dense model's on the global batch: each of
    the ``replicas`` dp replicas takes its ``B`` rows; the loss and every gradient (gathered over dp)."""
    import tpify.pipeline as pp
    from tests.distributed.test_pipeline import B
    from tpify.mesh import dp_mesh

    stages = pp.stages_of(sched)
    first, last = stages[0].is_first, stages[-1].is_last
    replica = dp_mesh(sched.tpify_pipeline.mesh).get_local_rank() if replicas > 1 else 0
    ids, labels = _batch(ref.config.vocab_size, seed, B * 2)  # the global batch of every layout below
    want = _dense_loss(ref, ids, labels)
    want.backward()
    rows = slice(replica * 2 * B // replicas, (replica + 1) * 2 * B // replicas)
    loss = pp.step(sched, input_ids=ids[rows] if first else None, labels=labels[rows] if last else None)
    if last:
        torch.testing.assert_close(loss, want.detach(), **tputil.F64, msg=f"{what}: loss")
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for stage in stages:
        for n, p in stage.model.named_parameters():
            torch.testing.assert_close(_full(p.grad), ref_grads[n], **tputil.F64, msg=f"{what}: grad {n}")


def _params_match(sched, ref, what):
    """Every parameter of this rank's stages (gathered over dp) equals the dense model's."""
    import tpify.pipeline as pp

    want = dict(ref.named_parameters(remove_duplicate=False))
    for stage in pp.stages_of(sched):
        for n, p in stage.model.named_parameters():
            torch.testing.assert_close(_full(p), want[n], **tputil.F64, msg=f"{what}: {n}")


def _fsdp(root, name, ref_tp):
    """pp 2 x FSDP2 dp_shard 2 (tp 1; ranks 0-1 stage 0, ranks 2-3 stage 1, each parameter split
    over the two): one step and AdamW update equal to the dense model's on the global batch; the
    dense save (gathered over dp, one writer per stage) loaded by plain transformers equal to the
    updated dense model; its DCP checkpoint (each parameter and Adam moment written as two dim-0
    slices, one per dp rank) resumed at pp 4 and the next step equal to the
    uninterrupted dense run's; the pp 2 x tp 2 checkpoint (``ref_tp``: the dense run it follows)
    resumed at pp 2 x FSDP2 2 and its next step equal too."""
    from pathlib import Path

    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    import tpify
    import tpify.pipeline as pp
    from tpify.checkpoint import read_metadata
    from tpify.sharding import is_dtensor

    src = Path(root) / name
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mesh = tpify.init_mesh(1, pp_size=2, device_type="cpu")  # dp_shard 2
    model = pp.from_pretrained(src, mesh, dtype=torch.float64)
    model.train()
    sched = pp.pipeline(model, mesh, schedule="1F1B", n_microbatches=M, data_parallel="fsdp")
    del model
    assert {p.placements for s in pp.stages_of(sched) for p in s.parameters()} == {(Shard(0),)}
    what = f"{name} at pp 2 x FSDP2 dp_shard 2"
    _fsdp_step_matches(sched, ref, 0, what, 2)
    opt = torch.optim.AdamW(pp.parameters(sched), lr=1e-2)
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    saved = Path(root) / f"{name}-fsdp-pp"
    pp.save_pretrained(sched, saved)  # gathered over dp, then written once per stage
    assert all(is_dtensor(p) for s in pp.stages_of(sched) for p in s.parameters()), what
    pp.save_checkpoint(Path(root) / f"{name}-fsdp-dcp", sched, [opt])
    # at tp 1 each parameter and Adam moment that is one entry (not packed parts, not a padded vocabulary) is
    # written as FSDP2's DTensor: each dp rank its dim-0 slice, no gather
    entries = read_metadata(Path(root) / f"{name}-fsdp-dcp").state_dict_metadata
    whole = 0
    for stage in pp.stages_of(sched):
        for n, p in stage.model.named_parameters():
            if f"model.{n}" not in entries or tuple(entries[f"model.{n}"].size) != tuple(p.shape):
                continue
            whole += 1
            for key in (f"model.{n}", f"optim.model.{n}.exp_avg"):
                offsets = sorted(tuple(c.offsets)[0] for c in entries[key].chunks)
                assert offsets == [0, (p.shape[0] + 1) // 2], (what, key, offsets)
    assert whole >= 8, (what, whole)
    files = sorted(p.name for p in saved.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64)  # plain transformers
    want = dict(ref.named_parameters(remove_duplicate=False))
    for n, p in back.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p, want[n], **tputil.F64, msg=f"{what}: saved {n}")
    # the FSDP2 checkpoint resumed at pp 4 (dp 1: every rank the whole batch)
    mesh4 = tpify.init_mesh(1, pp_size=4, device_type="cpu")
    model4 = pp.from_pretrained(src, mesh4, dtype=torch.float64)  # the step-0 weights: the checkpoint replaces them
    model4.train()
    sched4 = pp.pipeline(model4, mesh4, schedule="GPipe", n_microbatches=M)
    del model4
    opt4 = torch.optim.AdamW(pp.parameters(sched4), lr=1e-2)
    pp.load_checkpoint(Path(root) / f"{name}-fsdp-dcp", sched4, [opt4])
    _params_match(sched4, ref, f"{what}, resumed at pp 4")
    _fsdp_step_matches(sched4, ref, 1, f"{what}, resumed at pp 4", 1)
    opt4.step(); ref_opt.step()  # the second AdamW step continues the first's moments
    _params_match(sched4, ref, f"{what}, resumed at pp 4, after step 2")
    # the pp 2 x tp 2 checkpoint resumed at pp 2 x FSDP2 dp_shard 2 (the DTensors' slices, the AdamW state as DTensors)
    ref, ref_opt = ref_tp
    model = pp.from_pretrained(src, mesh, dtype=torch.float64)
    model.train()
    sched = pp.pipeline(model, mesh, schedule="GPipe", n_microbatches=M, data_parallel="fsdp")
    del model
    opt = torch.optim.AdamW(pp.parameters(sched), lr=1e-2)
    pp.load_checkpoint(Path(root) / f"{name}-dcp", sched, [opt])
    what = f"{name} saved at pp 2 x tp 2, resumed at pp 2 x FSDP2 dp_shard 2"
    _params_match(sched, ref, what)
    _fsdp_step_matches(sched, ref, 1, what, 2)
    opt.step(); ref_opt.step()
    assert all(s["exp_avg"].placements == (Shard(0),) for s in opt.state.values()), what
    _params_match(sched, ref, f"{what}, after step 2")


def _job(rank, world, root):
    import copy
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    import tpify
    import tpify.pipeline as pp
    from tpify.comm import barrier

    reads: dict = {}
    _counting_reads(reads)
    out = []
    for name in ("gpt2", "llama"):
        src, saved = Path(root) / name, Path(root) / f"{name}-pp"
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
        ref.train()
        mesh = tpify.init_mesh(2, pp_size=2, device_type="cpu")
        reads.clear()
        model = pp.from_pretrained(src, mesh, dtype=torch.float64)
        model.train()
        sched = pp.pipeline(model, mesh, schedule="1F1B", n_microbatches=M)
        del model
        stage = pp.stages_of(sched)[0]
        local = {id(p): (n, p) for n, p in stage.model.named_parameters()}
        held = {n for n, _ in stage.model.named_parameters(remove_duplicate=False)}
        # each rank read only its stage's tensors, and of those only its slices: the bytes it holds
        assert set(reads) <= held | {"transformer.wte.weight"}, (rank, sorted(set(reads) - held))
        assert sum(reads.values()) == sum(p.numel() * p.element_size() for _, p in local.values()), (rank, reads)
        assert all(f".{i}." not in k for k in reads for i in range(4) if i not in stage.layer_ids), (rank, reads)
        what = f"{name} loaded by stage at pp 2 x tp 2"
        _step_matches(sched, ref, 0, what)
        opt = torch.optim.AdamW(pp.parameters(sched), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        pp.save_pretrained(sched, saved)
        pp.save_checkpoint(Path(root) / f"{name}-dcp", sched, [opt])  # weights and AdamW state after one step
        files = sorted(p.name for p in saved.glob("*.safetensors"))
        assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
        with pytest.raises(pp.PipelineError, match="already holds weights"):  # no save over an older one, every rank
            pp.save_pretrained(sched, saved)
        back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64)  # plain transformers
        want = dict(ref.named_parameters(remove_duplicate=False))
        for n, p in back.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(p, want[n], **tputil.F64, msg=f"{name}: saved {n}")
        ref_tp = copy.deepcopy((ref, ref_opt))  # the dense run after step 1, for the resume under FSDP2
        mesh4 = tpify.init_mesh(1, pp_size=4, device_type="cpu")  # another layout
        again = pp.from_pretrained(saved, mesh4, dtype=torch.float64)
        again.train()
        sched4 = pp.pipeline(again, mesh4, schedule="GPipe", n_microbatches=M)
        del again
        opt4 = torch.optim.AdamW(pp.parameters(sched4), lr=1e-2)
        pp.load_checkpoint(Path(root) / f"{name}-dcp", sched4, [opt4])  # resume at another pp and tp
        _step_matches(sched4, ref, 1, f"{name} saved at pp 2 x tp 2, loaded at pp 4")
        opt4.step(); ref_opt.step()  # the second AdamW step continues the first's moments
        want = dict(ref.named_parameters(remove_duplicate=False))
        for stage in pp.stages_of(sched4):
            for n, p in stage.model.named_parameters():
                torch.testing.assert_close(p, want[n], **tputil.F64, msg=f"{name}: resumed at pp 4, {n} after step 2")
        barrier()
        _fsdp(root, name, ref_tp)
        barrier()
        out.append(name)
    return out


def test_load_by_stage_save_and_reload(tmp_path):
    torch.manual_seed(0)
    for name, make in (("gpt2", _gpt2), ("llama", _llama)):
        make().double().save_pretrained(tmp_path / name)
    results = tputil.spawn(_job, 4, str(tmp_path), timeout=600)
    assert all(r == ["gpt2", "llama"] for r in results)
