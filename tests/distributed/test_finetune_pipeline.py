"""``tpify finetune --pp``, through the command: the same losses as ``--pp 1`` (every weight, and
LoRA), a save plain transformers loads, an adapter plain PEFT loads, checkpoints that resume at
another pp, tp and dp (tpify/cli/finetune_pipeline.py).

Each ``tpify finetune`` launch costs seconds (imports, conversion, rank start-up): the tiny GPT-2's
dense ``--pp 1`` full fine-tuning run is one module-scoped fixture shared by the comparisons, and
the refusals before launch run in-process (one real subprocess proves the process-level path)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tputil

pytestmark = pytest.mark.slow  # real models / end-to-end runs through torchrun: not in the quick subset

ENV = dict(os.environ, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")


def _finetune(*args, timeout=420, ok=True):
    out = subprocess.run([sys.executable, "-m", "tpify.cli", "finetune", *args], capture_output=True, text=True,
                         timeout=timeout, env=ENV)
    if ok:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def _losses(out_dir):
    return json.loads((out_dir / "losses.json").read_text())["losses"]


def _same_weights(a_dir, b_dir, atol):
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(a_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(b_dir).state_dict()  # plain transformers loads the pipeline's save
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=0, msg=name)


def test_smollm2_pp2_equals_pp1(tmp_path):
    """The embedded SmolLM2 (30 layers, tied head) at ``--pp 2 --tp 1`` (1F1B, 2 microbatches:
    layers 0..14 and 15..29) against ``--pp 1``: every weight trained for 3 AdamW steps with
    clipping.

    Tolerances (float32): the losses to rtol 1e-5: the pipeline sums two microbatches' token
    losses where the dense run sums one batch, and 30 layers' float32 matmuls of other shapes
    (measured: 1.3e-5 absolute on a loss of 5, 2.6e-6 relative). The weights to 3 lr: an AdamW step
    moves a weight by about lr whatever the gradient's size, so a gradient element near zero
    whose sign the reordering flips may differ by up to 2 lr per step (measured: 8.8e-5 at lr 1e-4).
    The saved model's tied head equals its embedding.
    """
    from transformers import AutoModelForCausalLM

    lr = 1e-4
    common = ["--tp", "1", "--lora-r", "0", "--steps", "3", "--seq-len", "32", "--batch-size", "2",
              "--sample-tokens", "0", "--lr", str(lr)]
    out = _finetune(*common, "--pp", "2", "--out", str(tmp_path / "pp2")).stdout
    assert "rank 1: stage 1 (layers 15..29)" in out, out[-2000:]
    _finetune(*common, "--pp", "1", "--out", str(tmp_path / "pp1"))
    pp1, pp2 = _losses(tmp_path / "pp1"), _losses(tmp_path / "pp2")
    assert len(pp1) == len(pp2) == 3
    torch.testing.assert_close(torch.tensor(pp2), torch.tensor(pp1), rtol=1e-5, atol=0)
    assert sorted(p.name for p in (tmp_path / "pp2" / "final").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _same_weights(tmp_path / "pp1" / "final", tmp_path / "pp2" / "final", atol=3 * lr)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pp2" / "final")
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A 4-layer GPT-2 (tied head, learned positions) with the real MiniLM WordPiece tokenizer;
    dropout off, so that the pipeline and the dense run compute the same function (their dropout
    masks come from other generator streams)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2-pp")
    tok = AutoTokenizer.from_pretrained(tputil.minilm_dir())
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=tok.vocab_size,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


#: The tiny GPT-2 runs' flags (full fine-tuning): the ``--pp 1`` reference and the pipelines compared to it.
FULL = ["--lora-r", "0", "--steps", "4", "--seq-len", "32", "--sample-tokens", "0", "--lr", "1e-3", "--warmup", "1"]


@pytest.fixture(scope="module")
def tiny_dense(tiny_gpt2, tmp_path_factory):
    """``--pp 1 --tp 1`` on the tiny GPT-2, every weight trained for 4 AdamW steps on a global batch of
    4: the dense reference of the full fine-tuning pipelines (one launch for the module)."""
    out = tmp_path_factory.mktemp("tiny-dense") / "dense"
    _finetune("--model-dir", str(tiny_gpt2), *FULL, "--batch-size", "4", "--pp", "1", "--tp", "1", "--out", str(out))
    return out


def test_tiny_gpt2_interleaved_pp2_tp2(tiny_gpt2, tiny_dense, tmp_path):
    """A 4-layer GPT-2 at ``--pp 2 --tp 2`` (4 ranks; Interleaved1F1B: 4 stages of one layer, two
    per rank, 4 microbatches) against ``--pp 1 --tp 1``: 4 AdamW steps with clipping; the tied
    embedding's gradient summed between the first and last stage. Tolerances as the SmolLM2 test
    (float32; here 4 layers of width 64). Each rank's parameter bytes equal ``tpify plan --pp``'s."""
    lr = 1e-3
    _finetune("--model-dir", str(tiny_gpt2), *FULL, "--batch-size", "4", "--pp", "2", "--tp", "2",
              "--pp-schedule", "Interleaved1F1B", "--microbatches", "4", "--out", str(tmp_path / "pp2tp2"))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pp2tp2")), torch.tensor(_losses(tiny_dense)),
                               rtol=1e-5, atol=0)
    _same_weights(tiny_dense / "final", tmp_path / "pp2tp2" / "final", atol=4 * 2 * lr)
    # tpify plan --pp's bytes per rank are the real stages' (global rank g is pipeline rank g // tp)
    from tpify.authoring.plan_pipeline import pipeline_report

    real = json.loads((tmp_path / "pp2tp2" / "losses.json").read_text())["rank_param_bytes"]
    planned = pipeline_report(str(tiny_gpt2), 2, 2, schedule="Interleaved1F1B")["ranks"]
    assert real == [planned[g // 2]["rank_bytes"] for g in range(4)], (real, planned)


def _step_loss(model, model_dir, step, batch_size=4, seq_len=32, seed=0):
    """``model``'s mean loss (float32) on the batch ``tpify finetune`` trains on at ``step``."""
    from transformers import AutoTokenizer

    from tpify.cli.finetune import batch_indices, default_text_files, pack_texts

    data = pack_texts(AutoTokenizer.from_pretrained(model_dir), [str(p) for p in default_text_files()], seq_len)
    ids = data[batch_indices(step, data.shape[0], batch_size, seed)]
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_tiny_gpt2_lora_pp2_adapter_and_resume(tiny_gpt2, tmp_path):
    """LoRA (the default r = 8) at ``--pp 2`` against ``--pp 1``: the same losses step by step (the
    adapters start from the dense run's values on every stage), 4 AdamW steps with clipping. The
    pipeline's adapter is one PEFT directory: plain PEFT loads ``checkpoint-2/adapter`` on the
    dense model and gives the loss the run logged at step 3 (the batch and the adapter after 2
    steps), and the final adapter gives the merged ``final/`` model's loss and the ``--pp 1`` run's.
    ``--resume`` from ``checkpoint-2`` at ``--pp 2 --tp 2`` with ZBVZeroBubble (another layout: the
    stages in a V, the backward split into input and weight passes) continues with the
    uninterrupted run's losses, and its adapter (gathered over tp 2) and merged model give the
    uninterrupted run's loss.

    Tolerances (float32): losses to rtol 1e-5, as the full fine-tuning tests (the pipeline sums two
    microbatches where the dense run sums one batch; measured 1e-7 relative); the adapter on the
    dense model against the logged loss and the merged model to rtol 1e-5 (another summation
    order: the adapter's ``x A^T B^T`` added after ``x W`` against ``x (W + B A)``)."""
    import shutil

    import peft
    from transformers import AutoModelForCausalLM

    common = ["--model-dir", str(tiny_gpt2), "--steps", "4", "--seq-len", "32", "--batch-size", "4",
              "--sample-tokens", "0", "--lr", "1e-3", "--warmup", "1"]
    out = _finetune(*common, "--pp", "2", "--tp", "1", "--save-every", "2", "--out", str(tmp_path / "pp2")).stdout
    assert "LoRA r=8" in out, out[-2000:]
    _finetune(*common, "--pp", "1", "--tp", "1", "--out", str(tmp_path / "pp1"))
    pp1, pp2 = _losses(tmp_path / "pp1"), _losses(tmp_path / "pp2")
    torch.testing.assert_close(torch.tensor(pp2), torch.tensor(pp1), rtol=1e-5, atol=0)
    assert sorted(p.name for p in (tmp_path / "pp2" / "adapter").iterdir()) == ["adapter_config.json",
                                                                                "adapter_model.safetensors"]

    def adapted(adapter_dir):
        base = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
        return peft.PeftModel.from_pretrained(base, adapter_dir).eval()  # plain PEFT on the dense model

    at_2 = _step_loss(adapted(tmp_path / "pp2" / "checkpoint-2" / "adapter"), tiny_gpt2, 2)
    torch.testing.assert_close(at_2, pp2[2], rtol=1e-5, atol=0)
    final = _step_loss(adapted(tmp_path / "pp2" / "adapter"), tiny_gpt2, 4)
    merged = _step_loss(AutoModelForCausalLM.from_pretrained(tmp_path / "pp2" / "final").eval(), tiny_gpt2, 4)
    dense = _step_loss(AutoModelForCausalLM.from_pretrained(tmp_path / "pp1" / "final").eval(), tiny_gpt2, 4)
    torch.testing.assert_close(merged, final, rtol=1e-5, atol=0)
    torch.testing.assert_close(merged, dense, rtol=1e-5, atol=0)
    assert abs(final - _step_loss(AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval(), tiny_gpt2, 4)) > 1e-4
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "pp2" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    _finetune(*common, "--pp", "2", "--tp", "2", "--pp-schedule", "ZBVZeroBubble", "--microbatches", "4", "--resume",
              "--out", str(tmp_path / "resumed"))  # stages in a V (the tied head on rank 0), the split backward
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "resumed")), torch.tensor(pp2), rtol=1e-5, atol=0)
    # its adapter, gathered over tp 2 in each stage, and its merged model: the uninterrupted run's
    torch.testing.assert_close(_step_loss(adapted(tmp_path / "resumed" / "adapter"), tiny_gpt2, 4), final,
                               rtol=1e-5, atol=0)
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "final").eval()
    torch.testing.assert_close(_step_loss(resumed, tiny_gpt2, 4), merged, rtol=1e-5, atol=0)


def test_tiny_gpt2_full_pp2_dp2_and_resume_at_pp4(tiny_gpt2, tiny_dense, tmp_path):
    """Every weight trained (``--lora-r 0``) at ``--pp 2 --dp 2`` (4 ranks: two replicas of the
    2-stage pipeline under torch's ``replicate``, DDP's semantics; ``--batch-size 2`` per replica,
    1F1B with 2 microbatches of one row) against ``--pp 1`` on the same global batch of 4: the
    logged losses (the global batch's mean, the target count summed over dp) and the final weights
    (one writer per stage). Then ``--resume`` from its ``checkpoint-2`` at ``--pp 4 --dp 1``
    (GPipe, 4 microbatches, ``--batch-size 4``: the same global batch): the weights, AdamW's
    moments, the LR schedule and the step come back from the pipeline's DCP checkpoint at another
    pp and dp, and the losses and final weights are the uninterrupted run's.

    Tolerances (float32) as the other full fine-tuning tests: losses rtol 1e-5 (the replicas'
    partial sums added over dp, microbatches of one row against one batch of 4); weights 2 lr per
    step (4 steps against the dense run, 2 after the resume)."""
    import shutil

    lr = 1e-3
    common = ["--model-dir", str(tiny_gpt2), "--tp", "1", *FULL]
    out = _finetune(*common, "--pp", "2", "--dp", "2", "--batch-size", "2", "--save-every", "2",
                    "--out", str(tmp_path / "pp2dp2")).stdout
    assert "pp 2 x tp 1 x dp 2" in out, out[-2000:]
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pp2dp2")), torch.tensor(_losses(tiny_dense)),
                               rtol=1e-5, atol=0)
    assert sorted(p.name for p in (tmp_path / "pp2dp2" / "final").glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _same_weights(tiny_dense / "final", tmp_path / "pp2dp2" / "final", atol=4 * 2 * lr)
    assert not (tmp_path / "pp2dp2" / "checkpoint-2" / "adapter").exists()
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "pp2dp2" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    _finetune(*common, "--batch-size", "4", "--pp", "4", "--pp-schedule", "GPipe", "--microbatches", "4", "--resume",
              "--out", str(tmp_path / "resumed"))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "resumed")),
                               torch.tensor(_losses(tmp_path / "pp2dp2")), rtol=1e-5, atol=0)
    _same_weights(tmp_path / "pp2dp2" / "final", tmp_path / "resumed" / "final", atol=2 * 2 * lr)


def _finetune_in_process(capsys, *args):
    """``tpify finetune ARGS`` through the command's entry point in this process (what it refuses
    before any rank starts): ``(exit status, stderr)``."""
    from tpify.cli import main

    capsys.readouterr()
    try:
        rc = main(["finetune", *args])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


def test_refusals_before_launch(tiny_gpt2, tmp_path, capsys):
    """What ``--pp`` does not take is one usage error (status 2) before any rank starts; LoRA (the
    default), ``--save-every``, ``--resume`` and ``--dp`` (full fine-tuning) are taken. A pipeline
    run's checkpoint does not resume without ``--pp`` (nor another run's with it). One refusal
    through ``python -m tpify.cli`` (the process-level path: status 2, one line, no traceback), the
    others through the entry point in-process."""
    common = ["--model-dir", str(tiny_gpt2), "--out", str(tmp_path / "x"), "--tp", "1"]
    ckpt = tmp_path / "piped" / "checkpoint-2" / "trainer"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "losses": [1.0, 1.0], "pp": 2, "lora_r": 8}))
    out = _finetune("--model-dir", str(tiny_gpt2), "--out", str(tmp_path / "piped"), "--resume", ok=False)
    assert out.returncode == 2 and "written with pipeline stages (--pp 2)" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    cases = [(["--pp", "2", "--lora-r", "0", "--dp", "2", "--dp-shard", "2"], "--dp-shard 2: FSDP2 / HSDP of the stages"),
             (["--pp", "2", "--dp", "2"], "--dp 2 with LoRA (--lora-r 8)"),
             (["--pp", "2", "--lora-r", "0", "--batch-size", "3"], "not a multiple of the 2 microbatches"),
             (["--pp", "4", "--lora-r", "0", "--batch-size", "2", "--microbatches", "2"],
              "1F1B needs at least as many microbatches as stages"),
             (["--pp", "2", "--lora-r", "0", "--batch-size", "2", "--pp-schedule", "DualPipeV", "--microbatches", "2"],
              "DualPipeV needs at least as many microbatches as stages"),
             (["--pp", "3", "--lora-r", "0", "--batch-size", "3", "--pp-schedule", "Interleaved1F1B",
               "--microbatches", "3"], "6 stages, but the model has 4 layers"),
             (["--lora-r", "0", "--microbatches", "2"], "take effect with pipeline stages only"),
             (["--pp", "2", "--lora-r", "0", "--cp", "2"], "--cp: context parallelism inside pipeline stages"),
             (["--pp", "2", "--quantize", "nf4"], "--quantize: a quantized base in pipeline stages")]
    for args, text in cases:
        rc, err = _finetune_in_process(capsys, *common, *args)
        assert rc == 2 and text in err and "Traceback" not in err, (args, err)
