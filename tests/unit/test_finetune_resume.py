"""``tpify finetune --resume`` refuses a checkpoint it would continue wrongly from, naming why."""

import json

import pytest

from tpify.cli.finetune import FinetuneConfig, _run_args, resume_point


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
