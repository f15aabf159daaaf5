"""The layout manifest of a training checkpoint (tpify/integrations/resume.py), in one process.

What a resume compares, and what it may not: ``dp_size`` only where the optimizer files are per
global rank; the param groups' order; the optimizer class; adapters; a missing or unreadable
manifest and a missing per-rank file. The multi-rank refusals (every rank raises, TPTrainer,
TPAccelerator, ``tpify finetune``) are in tests/distributed/test_trainer_accelerate.py.
"""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
from tpify.integrations.resume import (MANIFEST_NAME, PER_RANK, PER_TP_RANK, ResumeError, check_resume, differences,
                                       training_layout, write_manifest)


def _model(pad=1):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=1000)
    return tpify.parallelize(GPT2LMHeadModel(config), tp_size=1, pad_vocab_multiple=pad)


def _layout(model, optimizer=None, files=PER_TP_RANK):
    return training_layout(model, [optimizer] if optimizer is not None else None, optimizer_files=files,
                           written_by="test")


def test_dp_size_counts_only_for_files_written_per_rank():
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for files, counts in ((PER_TP_RANK, False), (PER_RANK, True)):
        saved = _layout(model, opt, files)
        other_dp = dict(saved, dp_size=4)
        assert differences(saved, saved) == []
        assert differences(saved, other_dp) == (["dp_size 1 then, 4 now"] if counts else []), files


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


def test_check_resume_names_both_layouts_and_the_fix(tmp_path):
    model = _model()
    write_manifest(tmp_path, _layout(model, torch.optim.AdamW(model.parameters())))
    padded = _model(pad=64)
    with pytest.raises(ResumeError) as e:
        check_resume(tmp_path, _layout(padded, torch.optim.AdamW(padded.parameters())), "resume")
    message = str(e.value)
    for part in ("saved at tp_size 1, dp_size 1, pad_vocab_multiple 1 (transformer.wte.weight unpadded, 1000 rows)",
                 "this run: tp_size 1, dp_size 1, pad_vocab_multiple 64 (transformer.wte.weight padded to 1024 rows)",
                 "pad_vocab_multiple 1 then, 64 now", "transformer.wte.weight shape [1000, 16] then, [1024, 16] now",
                 "Resume with the same tp_size and pad_vocab_multiple", "not supported yet"):
        assert part in message, (part, message)
    saved = check_resume(tmp_path, _layout(model, torch.optim.AdamW(model.parameters())), "resume")
    assert saved["tp_size"] == 1 and saved["optimizer_files"] == PER_TP_RANK
    with pytest.raises(ResumeError, match=r"this rank's files \[.*rank7.pt'\] are missing"):
        check_resume(tmp_path, _layout(model), "resume", files=[tmp_path / "rank7.pt"])


def test_missing_or_unreadable_manifest_is_refused(tmp_path):
    mine = _layout(_model())
    with pytest.raises(ResumeError, match=rf"{MANIFEST_NAME} is missing.*start from the dense weights"):
        check_resume(tmp_path, mine, "resume")
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ResumeError, match=r"is unreadable \(JSONDecodeError"):
        check_resume(tmp_path, mine, "resume")
