"""What the ``tpify`` command does before and after it starts ranks.

``--help`` and usage errors import nothing heavy and print plain text; what the ranks would
refuse before their first collective (a tp size the model's heads do not allow, a missing model
directory, a damaged checkpoint) is one clean error from the launching process, exit status 2,
no rank started; a rank that fails anyway is reported once by the launcher (:mod:`tpify.cli.launch`).
"""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tpify import cli
from tpify.cli import launch

_HEAVY = ("torch", "torch.distributed", "transformers", "safetensors", "numpy")
_RST = re.compile(r"``|:(func|mod|class|meth|data|attr|ref):`")


def test_help_and_usage_errors_are_plain_text_and_import_nothing_heavy():
    """Before: ``tpify --help`` took 6.6 s (``import tpify`` imported torch and transformers) and
    showed reStructuredText (double backticks, ``:func:`` roles)."""
    code = """if True:
        import contextlib, io, json, sys
        from tpify.cli import main
        out = {}
        for argv in (["--help"], ["finetune", "--help"], ["embed", "--help"], ["plan", "--help"],
                     ["verify", "--help"], ["draft", "--help"], ["finetune", "--tp", "0"], ["nope"]):
            text = io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                try:
                    main(argv)
                except SystemExit as e:
                    code = e.code
            out[" ".join(argv)] = [code, text.getvalue()]
        out["heavy"] = sorted(m for m in HEAVY if m in sys.modules)
        print(json.dumps(out))
    """.replace("HEAVY", repr(_HEAVY))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out.pop("heavy") == [], "imported before the arguments were parsed"
    for argv, (status, text) in out.items():
        assert status == (0 if argv.endswith("--help") else 2), (argv, text)
        assert not _RST.search(text), (argv, _RST.search(text).group(0), text)
        assert "Traceback" not in text
    assert "tpify finetune" in out["--help"][1] and "tpify/cli/data/" in out["--help"][1]
    assert "argument --tp: must be an integer >= 1, got 0" in out["finetune --tp 0"][1]


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory):
    """A 2-layer Llama with SmolLM2's heads: 9 query heads, 3 KV heads (tp in {1, 3})."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("nine-heads")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=72, intermediate_size=96, num_attention_heads=9,
                                 num_key_value_heads=3, vocab_size=128)).save_pretrained(path)
    return path


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(launch.PREFLIGHT_ENV, raising=False)
    monkeypatch.setattr(launch, "relaunch", lambda *a: pytest.fail("ranks started"))


def _one_error(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prefix}: error: ") and err.count(f"{prefix}: error") == 1, err
    assert "Traceback" not in err and "ChildFailedError" not in err and "[rank" not in err, err
    return err


def test_finetune_at_a_tp_the_heads_do_not_allow_is_one_error_before_any_rank_starts(nine_heads, tmp_path, capsys,
                                                                                       no_launch):
    """SmolLM2's 9 heads at --tp 2: the ranks started, then printed the PlanError twice among their
    tracebacks and torchrun's ChildFailedError; now the launching process plans the model on the
    meta device and prints the PlanError once (exit status 2)."""
    status = cli.main(["finetune", "--model-dir", str(nine_heads), "--tp", "2", "--out", str(tmp_path / "run")])
    assert status == 2
    err = _one_error(capsys, "tpify finetune")
    assert "PlanError: cannot parallelize LlamaForCausalLM" in err
    assert "config.num_attention_heads (LlamaForCausalLM) = 9 is not divisible by tp_size = 2" in err
    assert "tp sizes that would work for this model: [1, 3, 9]" in err  # 9: the MLP of 1536 split unevenly
    assert not (tmp_path / "run").exists()
    for argv, needle in ((["--model-dir", str(tmp_path / "none")],
                          f"--model-dir {tmp_path / 'none'} is not a Hugging Face model directory"),
                         (["--model-dir", str(nine_heads), "--tp", "3", "--data", str(tmp_path / "no.txt")],
                          f"--data: {tmp_path / 'no.txt'} is not a file"),
                         (["--model-dir", str(nine_heads), "--tp", "3", "--resume"], "--resume: no checkpoint-<step>")):
        assert cli.main(["finetune", *argv, "--out", str(tmp_path / "run")]) == 2
        assert needle in _one_error(capsys, "tpify finetune")


def test_embed_at_a_tp_the_heads_do_not_allow_is_one_error_before_any_rank_starts(capsys, no_launch):
    assert cli.main(["embed", "--tp", "5"]) == 2  # all-MiniLM-L6-v2: 12 heads
    err = _one_error(capsys, "tpify embed")
    assert "PlanError: cannot parallelize BertModel" in err and "[1, 2, 3, 4, 6, 12]" in err


def test_verify_at_a_tp_the_heads_do_not_allow_is_one_error_before_any_rank_starts(nine_heads, capsys, monkeypatch):
    """A directory target is verified at its own size: 9 heads at --tp 2 was one PlanError row
    per head class, after 46 s of ranks; now it is refused before any rank starts."""
    import tpify.authoring.verify as verify

    monkeypatch.setattr(verify, "run_job", lambda *a, **k: pytest.fail("ranks started"))
    assert cli.main(["verify", str(nine_heads), "--tp", "2"]) == 2
    err = _one_error(capsys, "tpify verify")
    assert "PlanError: cannot parallelize LlamaModel" in err and "[1, 3, 9]" in err
    assert "(refused alike: LlamaForCausalLM at tp = 2;" in err


def test_under_torchrun_every_rank_checks_before_the_group_and_one_per_host_prints(nine_heads, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(launch.PREFLIGHT_ENV, raising=False)
    monkeypatch.setattr(launch, "run_rank", lambda *a: pytest.fail("the rank ran"))
    argv = ["finetune", "--model-dir", str(nine_heads), "--tp", "2", "--out", str(tmp_path / "run")]
    for local_rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert ("is not divisible by tp_size = 2" in err) == printed, err


def _failure(exitcode, message=None, at=0.0):
    data = {"message": message, "timestamp": int(at), "tpify": {"message": message, "time": at}} if message else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=int(at),
                           signal_name=lambda: "SIGTERM")


def test_a_failed_run_is_reported_once_naming_the_rank_that_failed_first():
    same = "ValueError: the text files hold 6 tokens, fewer than one sequence of 64"
    text = launch.failure_report("tpify finetune", {0: _failure(1, same, 2.0), 1: _failure(1, same, 1.0),
                                                    2: _failure(1, same, 3.0)})
    assert text == f"tpify finetune: error on rank 1 (ranks 0, 1, 2 alike): {same}"
    agreement = "AgreementError: tpify.from_pretrained: rank 1 failed: CheckpointError: ..."
    text = launch.failure_report("tpify finetune", {0: _failure(1, agreement, 2.0),
                                                    1: _failure(1, "CheckpointError: file x is truncated", 1.0),
                                                    2: _failure(-15), 3: _failure(1, "RuntimeError: other", 2.5)})
    assert text.splitlines() == ["tpify finetune: error on rank 1: CheckpointError: file x is truncated",
                                 "  rank 3: RuntimeError: other", "  rank(s) 2 stopped after it"]
    text = launch.failure_report("tpify embed", {0: _failure(-9)})
    assert text == "tpify embed: error on rank 0: stopped by signal SIGTERM"


def test_a_rank_writes_its_error_for_the_launcher_and_prints_it_only_without_one(tmp_path, capsys, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "3")

    def bad_file(args):
        raise ValueError("--data: x is not a file")

    def bug(args):
        return {}["missing"]

    monkeypatch.setenv(launch.LAUNCHER_ENV, "1")
    assert launch.run_rank("finetune", bad_file, None) == 1
    assert capsys.readouterr().err == ""  # tpify's launcher prints it, once
    assert json.loads(error_file.read_text())["tpify"]["message"] == "ValueError: --data: x is not a file"
    monkeypatch.delenv(launch.LAUNCHER_ENV)
    assert launch.run_rank("finetune", bad_file, None) == 1
    assert capsys.readouterr().err == "[rank 3] tpify finetune: error: ValueError: --data: x is not a file\n"
    assert launch.run_rank("finetune", bug, None) == 1  # not an error that explains itself: its traceback
    message = json.loads(error_file.read_text())["tpify"]["message"]
    assert message.startswith("Traceback (most recent call last):") and message.endswith("KeyError: 'missing'")
    capsys.readouterr()
