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


def _job(rank, world, root):
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
        out.append(name)
    return out


def test_load_by_stage_save_and_reload(tmp_path):
    torch.manual_seed(0)
    for name, make in (("gpt2", _gpt2), ("llama", _llama)):
        make().double().save_pretrained(tmp_path / name)
    results = tputil.spawn(_job, 4, str(tmp_path), timeout=600)
    assert all(r == ["gpt2", "llama"] for r in results)
