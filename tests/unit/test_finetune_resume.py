"""``tpify finetune --resume`` refuses a checkpoint it would continue wrongly from, naming why."""

import json

import pytest

from tpify.cli.finetune import FinetuneConfig, _run_args, check_resume_files, resume_point


def _checkpoint(out, step, cfg, state=None):
    d = out / f"checkpoint-{step}" / "trainer"
    d.mkdir(parents=True)
    body = {"step": step, "losses": [1.0] * step, "tp": cfg.tp, "dp": cfg.dp, "lora_r": cfg.lora_r,
            "args": _run_args(cfg)} if state is None else state
    (d / "state.json").write_text(body if isinstance(body, str) else json.dumps(body))


def test_resume_refuses_changed_arguments_and_names_them(tmp_path):
    cfg = FinetuneConfig(model_dir="m", out_dir=str(tmp_path), tp=2, seq_len=32, lr=1e-3, resume=True)
    _checkpoint(tmp_path, 2, cfg)
    (tmp_path / "checkpoint-old2").mkdir()  # a stray folder is not a checkpoint
    ckpt, state = resume_point(cfg)
    assert ckpt.name == "checkpoint-2" and state["step"] == 2
    changed = FinetuneConfig(model_dir="m", out_dir=str(tmp_path), tp=2, seq_len=64, lr=5e-3, seed=1, resume=True)
    with pytest.raises(ValueError, match=r"seq_len: 32 then, 64 now.*lr: 0.001 then, 0.005 now.*seed: 0 then, 1 now"):
        resume_point(changed)
    changed.allow_changes = True
    assert resume_point(changed)[0].name == "checkpoint-2"


def test_resume_names_a_corrupt_state_file(tmp_path):
    cfg = FinetuneConfig(model_dir="m", out_dir=str(tmp_path), resume=True)
    _checkpoint(tmp_path, 4, cfg, state="{not json")
    with pytest.raises(ValueError, match=r"checkpoint-4/trainer/state.json is missing or corrupt.*delete"):
        resume_point(cfg)
    with pytest.raises(ValueError, match="no checkpoint-<step> directory"):
        resume_point(FinetuneConfig(model_dir="m", out_dir=str(tmp_path / "empty"), resume=True))


def _real_checkpoint(out, step, cfg):
    """``checkpoint-<step>`` with a real adapter file and a real DCP training state (tp = 1)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify
    from tpify.checkpoint import save_checkpoint

    _checkpoint(out, step, cfg)
    torch.manual_seed(0)
    model = tpify.parallelize(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16,
                                                         vocab_size=61)), tp_size=1)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(out / f"checkpoint-{step}" / "trainer", model, [opt])
    (out / f"checkpoint-{step}" / "adapter").mkdir()
    save_file({"a.lora_A.weight": torch.ones(8, 16), "a.lora_B.weight": torch.zeros(16, 8)},
              str(out / f"checkpoint-{step}" / "adapter" / "adapter_model.safetensors"))


def _truncate(file):
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 10)


def test_resume_names_a_truncated_adapter_or_distcp_file_and_the_checkpoint_before_it(tmp_path):
    """A truncated ``adapter/adapter_model.safetensors`` stopped the ranks with PEFT's
    ``SafetensorError: ... incomplete metadata, file not fully covered``, a truncated
    ``trainer/__0_0.distcp`` with DCP's ``CheckpointException`` around a bare ``EOFError``. The
    local check every rank runs before the agreement names the file and the fix: resume from the
    checkpoint before it."""
    cfg = FinetuneConfig(model_dir="m", out_dir=str(tmp_path), lora_r=8, resume=True)
    for step in (2, 4):
        _real_checkpoint(tmp_path, step, cfg)
    ckpt = resume_point(cfg)[0]
    assert ckpt.name == "checkpoint-4"
    check_resume_files(ckpt, cfg)  # whole
    adapter = tmp_path / "checkpoint-4" / "adapter" / "adapter_model.safetensors"
    _truncate(adapter)
    with pytest.raises(ValueError, match=rf"--resume: .*checkpoint-4 is damaged: cannot read safetensors file "
                                         rf"{adapter} .*truncated.*Move .*checkpoint-4 away and run again with "
                                         rf"--resume to continue from checkpoint-2"):
        check_resume_files(ckpt, cfg)
    full = FinetuneConfig(model_dir="m", out_dir=str(tmp_path), lora_r=0, resume=True)
    shard = sorted((tmp_path / "checkpoint-2" / "trainer").glob("*.distcp"))[0]
    _truncate(shard)
    for step in (2, 4):  # the adapter is not read without LoRA; checkpoint-2's state is
        (tmp_path / f"checkpoint-{step}" / "trainer" / "state.json").write_text(json.dumps(
            {"step": step, "losses": [1.0] * step, "lora_r": 0, "args": _run_args(full)}))
    import shutil

    shutil.rmtree(tmp_path / "checkpoint-4")
    with pytest.raises(ValueError, match=rf"checkpoint-2 is damaged: load_checkpoint: {shard} is truncated: .*No "
                                         rf"earlier checkpoint is in {tmp_path}: start again without --resume"):
        check_resume_files(resume_point(full)[0], full)
