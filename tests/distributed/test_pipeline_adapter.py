"""A PEFT model's adapters on pipeline stages (``tpify.pipeline.save_adapter`` / ``merge_adapters``),
float64.

One spawned job of 4 gloo ranks: Llama (untied, GQA) with LoRA on every projection at pp 2 x tp 2
(GPipe), 2 AdamW steps beside the single-process dense PEFT model; the adapter saved by stage is
one PEFT directory whose tensors are the dense adapter's, which plain PEFT loads on the dense
model with the dense loss; the stages merged and saved by stage give the dense model PEFT's
``merge_and_unload`` gives. Refused: stages holding no adapter. Tolerance: float64 sums in
another order (tputil.F64, atol 1e-10).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests import tputil
from tests.distributed.test_pipeline import LORA, _batch, _dense_loss, _llama

pytestmark = pytest.mark.slow

M = 4


def _job(rank, world, root):
    from pathlib import Path

    import peft
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import tpify
    import tpify.pipeline as pp
    from tpify.comm import barrier
    from tpify.integrations import get_peft_model

    root = Path(root)
    torch.manual_seed(0)
    base = _llama().double()
    ref = copy.deepcopy(base)
    mesh = tpify.init_mesh(2, pp_size=2, device_type="cpu")
    model = tpify.parallelize(copy.deepcopy(base), mesh=mesh)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**LORA))
    torch.manual_seed(1)
    model = get_peft_model(model, peft.LoraConfig(**LORA)).base_model.model
    sched = pp.pipeline(model, mesh, schedule="GPipe", n_microbatches=M)
    del model
    if rank == 0:  # after parallelize: saving writes to the config, whose fingerprint the ranks compare
        base.save_pretrained(root / "base")
    stages = pp.stages_of(sched)
    first, last = stages[0].is_first, stages[-1].is_last
    opt = torch.optim.AdamW([p for p in pp.parameters(sched) if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for it in range(2):
        ids, labels = _batch(64, it)
        _dense_loss(ref, ids, labels).backward()
        pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
        ref_opt.step(); ref_opt.zero_grad()
        opt.step(); opt.zero_grad()
    pp.save_adapter(sched, root / "adapter")  # every rank; one directory
    barrier()
    assert sorted(p.name for p in (root / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(root / "adapter" / "adapter_model.safetensors")
    want = get_peft_model_state_dict(ref)
    assert sorted(saved) == sorted(want), (sorted(set(saved) ^ set(want)))[:5]
    for k in want:
        torch.testing.assert_close(saved[k], want[k], **tputil.F64, msg=f"adapter {k}")
    dense = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float64)
    loaded = peft.PeftModel.from_pretrained(dense, root / "adapter")  # plain PEFT on the dense model
    ids, labels = _batch(64, 5)
    with torch.no_grad():
        torch.testing.assert_close(_dense_loss(loaded, ids, labels), _dense_loss(ref, ids, labels), **tputil.F64)
    assert pp.merge_adapters(sched) == sum(len(LORA["target_modules"]) for s in stages for _ in s.layer_ids)
    pp.save_pretrained(sched, root / "merged")
    with pytest.raises(pp.PipelineError, match="no PEFT adapter"):  # merged: the stages hold none now
        pp.save_adapter(sched, root / "again")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float64).state_dict()
    ref_merged = ref.merge_and_unload().state_dict()
    assert merged.keys() == ref_merged.keys()
    for k, v in ref_merged.items():
        torch.testing.assert_close(merged[k], v, **tputil.F64, msg=f"merged {k}")
    barrier()
    return "ok"


def test_adapter_by_stage(tmp_path):
    assert tputil.spawn(_job, 4, str(tmp_path), timeout=600) == ["ok"] * 4
