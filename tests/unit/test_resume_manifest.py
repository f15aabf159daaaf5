"""The manifest of a training checkpoint (tpify/integrations/resume.py), in one process.

What a resume compares and what it may not: another layout (tp_size, dp_size, padding) is fine,
the state being resharded on load; the model class, the parameters' dense shapes, adapters, the
optimizer's class and param groups must match; a missing or unreadable manifest, the old
per-rank format and a missing file are refused with the fix. The multi-rank refusals (every
rank raises, TPTrainer, TPAccelerator, ``tpify finetune``) are in
tests/distributed/test_trainer_accelerate.py.
"""

import copy
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
from tpify.integrations.resume import (MANIFEST_NAME, ResumeError, check_resume, differences, same_layout,
                                       training_layout, write_manifest)


def _model(pad=1, n_embd=16):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, n_positions=16, vocab_size=1000)
    return tpify.parallelize(GPT2LMHeadModel(config), tp_size=1, pad_vocab_multiple=pad)


def _layout(model, optimizer=None):
    return training_layout(model, [optimizer] if optimizer is not None else None, written_by="test")


def test_another_layout_is_no_difference_but_another_model_is():
    model = _model()
    saved = _layout(model, torch.optim.AdamW(model.parameters()))
    padded = _model(pad=64)
    assert differences(saved, dict(saved, tp_size=4, dp_size=2, world_size=8)) == []
    assert differences(saved, _layout(padded, torch.optim.AdamW(padded.parameters()))) == [], "dense shapes unpadded"
    assert not same_layout(saved, _layout(padded)) and same_layout(saved, _layout(model))
    wider = _model(n_embd=32)
    got = differences(saved, _layout(wider, torch.optim.AdamW(wider.parameters())))
    assert got == ["the parameters differ: transformer.wte.weight dense shape [1000, 16] then, [1000, 32] now; "
                   "transformer.wpe.weight dense shape [16, 16] then, [16, 32] now; transformer.h.0.ln_1.weight "
                   "dense shape [16] then, [32] now; and 13 more"], got


def test_param_groups_order_and_optimizer_class_are_compared():
    model = _model()
    params = list(model.parameters())
    saved = _layout(model, torch.optim.AdamW(params))
    assert differences(saved, _layout(model, torch.optim.AdamW(params[::-1]))) == [
        "the optimizer's param groups list the parameters in another order"]
    assert differences(saved, _layout(model, torch.optim.SGD(params))) == ["the optimizer is AdamW then, SGD now"]
    assert differences(saved, _layout(model, torch.optim.AdamW(params[1:]))) == [
        "optimized parameters missing now: transformer.wte.weight",
        f"the optimizer's param groups hold [{len(params)}] parameters then, [{len(params) - 1}] now"]
    # Without an optimizer (TPTrainer's first check, before Trainer builds it) groups are not compared.
    assert differences(saved, _layout(model)) == []


def test_adapters_are_compared():
    import peft

    from tpify.integrations import get_peft_model

    model = _model()
    saved = _layout(model, torch.optim.AdamW(model.parameters()))
    lora = get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    got = differences(saved, _layout(lora, torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad])))
    assert got[0] == "adapters [] then, ['default'] now", got


def test_check_resume_names_both_models_and_the_fix(tmp_path):
    model = _model()
    write_manifest(tmp_path, _layout(model, torch.optim.AdamW(model.parameters())))
    wider = _model(n_embd=32)
    with pytest.raises(ResumeError) as e:
        check_resume(tmp_path, _layout(wider, torch.optim.AdamW(wider.parameters())), "resume")
    message = str(e.value)
    for part in ("saved from GPT2LMHeadModel at tp_size 1, dp_size 1", "this run: GPT2LMHeadModel at tp_size 1",
                 "transformer.wte.weight dense shape [1000, 16] then, [1000, 32] now",
                 "resumes at any tp_size and dp_size, but only into the model"):
        assert part in message, (part, message)
    saved = check_resume(tmp_path, _layout(model, torch.optim.AdamW(model.parameters())), "resume")
    assert saved["tp_size"] == 1 and saved["format"] == 2
    with pytest.raises(ResumeError, match=r"\[.*rank7.pt'\] are missing"):
        check_resume(tmp_path, _layout(model), "resume", files=[tmp_path / "rank7.pt"])


def test_missing_unreadable_or_old_manifest_is_refused(tmp_path):
    mine = _layout(_model())
    with pytest.raises(ResumeError, match=rf"{MANIFEST_NAME} is missing.*start from the dense weights"):
        check_resume(tmp_path, mine, "resume")
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ResumeError, match=r"is unreadable \(JSONDecodeError"):
        check_resume(tmp_path, mine, "resume")
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 1, "tp_size": 2, "dp_size": 1}))
    with pytest.raises(ResumeError, match=r"earlier tpify in the per-rank format .*tp_size 2.*tpify.from_pretrained"):
        check_resume(tmp_path, mine, "resume")


def test_resuming_grpo_restores_its_adaptive_entropy_controller_from_trls_file(tmp_path):
    """TRL's GRPOTrainer restores its entropy controller in its own ``_load_optimizer_and_scheduler``,
    which TPTrainerMixin replaces to reshard the optimizer: tpify reads the same file after the
    optimizer (the resume itself is compared with an uninterrupted run in tests/distributed/test_trl.py)."""
    import types

    from tpify.integrations.trl import after_optimizer_loaded

    (tmp_path / "entropy_ctrl_state.json").write_text(json.dumps({"entropy_coef": 0.25, "last_world_entropy": 1.5}))
    trainer = types.SimpleNamespace(use_adaptive_entropy=True, entropy_coef=0.0, _last_world_entropy=float("inf"))
    after_optimizer_loaded(trainer, str(tmp_path))
    assert (trainer.entropy_coef, trainer._last_world_entropy) == (0.25, 1.5)
    static = types.SimpleNamespace(use_adaptive_entropy=False, entropy_coef=0.0)
    after_optimizer_loaded(static, str(tmp_path))  # a static coefficient is the config's, as in TRL
    assert static.entropy_coef == 0.0
