"""The ``tpify`` command's numeric flags and output paths are checked before anything runs.

A bad value is a usage error at parse time (exit status 2, the flag, the value and the range on
one line), never a ZeroDivisionError or a traceback from a rank; ``FinetuneConfig`` refuses the
same values from Python, through the same check (:mod:`tpify.cli.checks`).
"""

import pytest

from tpify import cli
from tpify.cli import launch
from tpify.cli.finetune import LIMITS, FinetuneConfig
from tpify.cli.checks import Limit, check


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, needle", [
    (["finetune", "--dp", "0"], "argument --dp: must be an integer >= 1, got 0"),
    (["finetune", "--tp", "-2"], "argument --tp: must be an integer >= 1, got -2"),
    (["finetune", "--seq-len", "1"], "argument --seq-len: must be an integer >= 2, got 1 (a causal LM"),
    (["finetune", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    (["finetune", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["finetune", "--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
    (["finetune", "--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
    (["finetune", "--lr", "-0.001"], "argument --lr: must be a finite number >= 0, got -0.001"),
    (["finetune", "--clip", "-1"], "argument --clip: must be a finite number >= 0, got -1 (the largest global"),
    (["finetune", "--save-every", "-5"], "argument --save-every: must be an integer >= 0, got -5"),
    (["finetune", "--seed", "-1"], "argument --seed: must be an integer >= 0 and < 2**63, got -1"),
    (["finetune", "--lora-r", "-1"], "argument --lora-r: must be an integer >= 0, got -1"),
    (["finetune", "--lora-alpha", "0"], "argument --lora-alpha: must be an integer >= 1 (or unset), got 0"),
    (["finetune", "--steps", "2.5"], "argument --steps: must be an integer >= 1, got '2.5'"),
    (["embed", "--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    (["plan", "gpt2", "--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    (["verify", "gpt2", "--tp", "2,0"], "argument --tp: takes integers >= 1 separated by commas (e.g. 2,4), got '2,0'"),
    (["verify", "gpt2", "--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["verify", "gpt2", "--timeout", "inf"], "argument --timeout: must be a finite number > 0, got inf"),
])
def test_bad_numeric_flags_are_usage_errors(capsys, argv, needle):
    assert needle in _usage_error(capsys, argv)


@pytest.mark.parametrize("argv, needle", [
    (["finetune", "--quantize", "int8"], "argument --quantize: invalid choice: 'int8' (choose from 'nf4', 'fp4')"),
    (["finetune", "--quantize", "nf4", "--lora-r", "0"], "--quantize nf4 with --lora-r 0: full fine-tuning of a "
                                                         "quantized base is not supported"),
    (["finetune", "--quantize", "fp4", "--dp", "2", "--dp-shard", "2"], "--quantize fp4 with --dp-shard 2: FSDP2 "
                                                                        "over a quantized base is not built"),
])
def test_quantize_flag_refusals_are_usage_errors(capsys, argv, needle):
    """``--quantize`` (QLoRA) refuses, before any rank starts, what it does not combine with; the
    config refuses the same from Python."""
    assert needle in _usage_error(capsys, argv)
    with pytest.raises(ValueError, match="full fine-tuning of a quantized base"):
        FinetuneConfig(model_dir="m", out_dir="o", quantize="nf4", lora_r=0)
    with pytest.raises(ValueError, match="FSDP2 over a quantized base"):
        FinetuneConfig(model_dir="m", out_dir="o", quantize="nf4", lora_r=8, dp=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"quantize must be one of \['nf4', 'fp4'\]"):
        FinetuneConfig(model_dir="m", out_dir="o", quantize="int8", lora_r=8)


def test_finetune_config_refuses_the_same_values_and_lists_every_one():
    with pytest.raises(ValueError) as err:
        FinetuneConfig(model_dir="m", out_dir="o", dp=0, seq_len=0, lr=float("inf"), tp=True, dtype="float16")
    message = str(err.value)
    for needle in ("tp must be an integer >= 1, got True", "dp must be an integer >= 1, got 0",
                   "seq_len must be an integer >= 2, got 0", "lr must be a finite number >= 0, got inf",
                   "dtype must be one of ['float32', 'bfloat16'], got 'float16'"):
        assert needle in message
    cfg = FinetuneConfig(model_dir="m", out_dir="o", lora_alpha=None, clip=0, lr=0)  # boundaries allowed
    cfg.batch_size = 0  # changed after it was made: finetune() checks again
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        cfg.check()


def test_the_parser_and_the_config_share_one_check():
    """Each finetune flag parses with the very limit FinetuneConfig applies to its field."""
    parser = cli.build_parser()
    finetune = next(a for a in parser._actions if a.dest == "command").choices["finetune"]
    types = {a.dest: a.type for a in finetune._actions}
    assert {name for name in LIMITS if getattr(types.get(name), "limit", None) is LIMITS[name]} \
        == set(LIMITS) - {"weight_decay"}  # the one option without a flag
    assert check("x", 3, Limit(low=1, high=3)) == "x must be an integer >= 1 and < 3, got 3"


def test_tp_and_dp_must_fit_the_ranks_torchrun_started(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    err = _usage_error(capsys, ["finetune", "--model-dir", str(tmp_path), "--tp", "2", "--dp", "1"])
    assert "--tp 2 x --dp 1 = 2 ranks, but 4 ranks were started; pass --tp and --dp whose product is 4" in err
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _usage_error(capsys, ["embed", "--tp", "2"])
    assert "--tp 2 does not divide the 3 ranks started" in err


def test_more_ranks_than_gpus_is_refused_before_launching(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(launch, "relaunch", lambda *a: pytest.fail("relaunched"))
    err = _usage_error(capsys, ["embed", "--tp", "4"])
    assert "4 ranks (--tp x --dp) need a GPU each, but this host has 2" in err


def test_an_out_path_that_cannot_be_written_is_one_line_and_status_2(capsys, monkeypatch, tmp_path):
    """Checked before any work: ``draft`` before drafting, ``finetune`` before the ranks start."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(launch, "relaunch", lambda *a: pytest.fail("relaunched"))
    note = tmp_path / "notes.txt"
    note.write_text("not a folder")
    cases = [(["draft", "gpt2", "--out", str(note / "recipe.toml")], f"{note} is a file, not a directory"),
             (["draft", "gpt2", "--out", str(tmp_path), "--force"], f"--out {tmp_path} is a directory"),
             (["finetune", "--model-dir", "m", "--out", str(note / "run")], f"{note} is a file, not a directory"),
             (["finetune", "--model-dir", "m", "--out", str(note)], f"--out {note} is a file, not a directory")]
    for argv, needle in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "pass " in err, err
    assert note.read_text() == "not a folder"


def test_finetune_context_parallel_sizes_are_checked_before_any_rank(capsys, monkeypatch, tmp_path):
    """``--cp``: a ``--seq-len`` that ``2 x cp`` does not divide is a usage error (and a ``FinetuneConfig``
    ValueError naming the two nearest lengths); under torchrun the world must be ``tp x cp x dp``."""
    assert "--seq-len 30 is not a multiple of 2 x --cp = 4" in _usage_error(
        capsys, ["finetune", "--cp", "2", "--seq-len", "30", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match=r"seq_len = 30 is not a multiple of 2 x cp = 4.*--seq-len 28 or 32"):
        FinetuneConfig(model_dir="m", out_dir="o", cp=2, seq_len=30)
    assert FinetuneConfig(model_dir="m", out_dir="o", cp=2, seq_len=32).cp == 2
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    err = _usage_error(capsys, ["finetune", "--model-dir", str(tmp_path), "--tp", "1", "--cp", "2", "--dp", "1"])
    assert "--tp 1 x --cp 2 x --dp 1 = 2 ranks, but 4 ranks were started" in err
