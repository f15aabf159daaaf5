"""transformers Trainer and accelerate on a tpify model equal the same tool on the dense model.

The dense references run in this (pytest) process with plain ``transformers.Trainer`` and plain
``accelerate.Accelerator``, one process, GPT-2 in float64; the tensor-parallel runs use
``tpify.integrations.TPTrainer`` / ``TPAccelerator`` on gloo ranks at tp = 2 (2 ranks) and at
dp = 2 x tp = 2 (4 ranks), with the same seed, data and arguments (``per_device_train_batch_size``
is per DP replica, so the dense run's batch is ``dp`` times it).

What is compared and at what tolerance:
* every logged training loss: rtol 1e-6. Trainer accumulates the logged loss in a float32 tensor,
  so even two float64 runs agree only to float32 rounding (~6e-8 relative);
* ``trainer.evaluate()`` at tp = 2 with a ``compute_metrics`` that reads the logits, on 10
  sequences (a partial last batch): eval loss and the sum of all logits, rtol 1e-6 (float32
  accumulation). Not at dp = 2: there Trainer's own evaluation differs from a single process as
  it does under plain DDP (it pads the last batch with repeated samples);
* every logged gradient norm (before clipping, ``max_grad_norm=1.0`` and the norms are > 1 so
  clipping acts): rtol 1e-9 (float64 summation order);
* the final weights: atol 1e-8, rtol 1e-6, as in test_dp_tp_training.py: Adam's update
  ``m / (sqrt(v) + eps)`` amplifies the ~1e-16 relative noise of gradients near eps (rows of
  token ids absent from a batch) to a few 1e-9; a real error (no DP averaging, local-norm
  clipping, shards overwritten by DDP) moves weights by 1e-4 or more.
The dense model's loss is HF's with float64 arithmetic (``tputil.float64_loss_function``; HF's
own upcasts to float32). Also checked: ``trainer.save_model()`` writes a directory plain
transformers loads, with the dense model's logits (atol 1e-6); a run resumed from a Trainer
checkpoint (with dropout 0.1, so tpify's dropout streams must be restored too) ends bitwise
equal to the straight run; the LoRA run uses Trainer's ``gradient_checkpointing=True`` on the
tensor-parallel side only and still equals dense PEFT; an accelerate loop resumed with
``save_state`` / ``load_state`` ends bitwise equal to the straight loop; plain ``Trainer`` and plain ``Accelerator.prepare`` on a tpify model
raise on every rank instead of training wrong.

Resuming at another layout works (tpify/checkpoint.py reshards the optimizer state; the
checks run in the same spawned job, on its checkpoints, at dp 2 x tp 2 only, the slow job): TPTrainer at tp 1 (dp = world) and at
another ``pad_vocab_multiple`` loads the optimizer state bitwise equal to the saved run's dense
state and trains on; ``TPAccelerator.load_state`` there continues as the straight loop (TOL);
``tpify finetune``'s restore at another padding restores the optimizer state bitwise. A resume
into another model (TPTrainer, before the weights are read), with other optimizer param groups
(compared once Trainer has built its optimizer), and with the manifest missing on one rank (an
AgreementError on the others) is refused on every rank. Plain ``transformers.Trainer`` resuming
a TPTrainer checkpoint raises before any step instead of training on with a fresh optimizer.
"""

import os
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

import tputil
from test_core_equivalence import gpt2_config

TOL = dict(atol=1e-8, rtol=1e-6)
STEPS = 4


class _Data(torch.utils.data.Dataset):
    """16 GPT-2 sequences of 12 tokens; ``masked``: about 30% of the labels are -100."""

    def __init__(self, masked: bool = True, n: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 50257, (n, 12), generator=g)
        self.labels = self.ids.clone()
        if masked:
            self.labels[torch.rand(n, 12, generator=g) < 0.3] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _args(out, batch, **kw):
    kw.setdefault("save_strategy", "no")
    kw.setdefault("max_grad_norm", 1.0)
    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=2,
                             max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], seed=0,
                             use_cpu=True, disable_tqdm=True, **kw)


LORA_CLIP = 0.05  # LoRA gradients are small: a lower max_grad_norm so that clipping acts


def _lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], init_lora_weights="gaussian")


def _adapters(model):
    from tpify.sharding import shard_spec_of

    group = model.tp_info.tp_group if hasattr(model, "tp_info") else None
    return {n: (shard_spec_of(p).gather(p.detach(), group) if shard_spec_of(p) is not None else p.detach()).clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = gpt2_config()
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = dropout
    return GPT2LMHeadModel(cfg).double()


def _accuracy(prediction):
    """Next-token accuracy over the labelled positions (needs the full-vocabulary logits)."""
    logits, labels = prediction.predictions, prediction.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    hit = (logits[:, :-1].argmax(-1) == labels[:, 1:])[labels[:, 1:] != -100]
    return {"accuracy": float(hit.mean()), "logit_sum": float(logits.sum())}


def _evaluate(trainer):
    trainer.compute_metrics = _accuracy
    out = trainer.evaluate(eval_dataset=_Data(n=10, seed=9))  # 10 sequences: a partial last batch
    return out["eval_loss"], out["eval_logit_sum"]


def _log(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _accelerate_loop(accelerator, model, batch, steps=3, save=None, resume=None):
    """3 steps of an accelerate loop; ``save``: save_state after 2 steps and stop; ``resume``:
    load_state, skip the first 2 batches, run the 3rd."""
    loader = torch.utils.data.DataLoader(_Data(masked=False), batch_size=batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if resume:
        accelerator.load_state(resume)
        loader = accelerator.skip_first_batches(loader, 2)
        steps = 1
    log = []
    for step, data in zip(range(steps), loader):
        if save and step == 2:
            accelerator.save_state(save)
            break
        loss = model(**data).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        log.append((accelerator.gather(loss.detach()[None]).mean().item(), float(norm)))
    return log


def _dense_weights(model):
    return {k: v.detach().clone() for k, v in tputil.dense_named(model).items()}


def _tp_body(rank, world, tp, out):
    import torch.distributed as dist

    import tpify
    from tpify.integrations import TPAccelerator, TPTrainer

    tputil.torchrun_env(rank, world)
    dp = world // tp
    results = {}

    # 1. Trainer, clipping acts, gradient accumulation 2; then save_model().
    model = tpify.parallelize(_model(), tp_size=tp)
    trainer = TPTrainer(model=model, args=_args(out + "/run", 4 // dp), train_dataset=_Data())
    trainer.train()
    results["trainer"] = _log(trainer)
    results["eval"] = _evaluate(trainer)
    trainer.save_model(out + "/final")
    results["trainer_weights"] = _dense_weights(model)

    # 2. Resume from a checkpoint with dropout on: straight 4 steps == 2 + resume + 2, bitwise.
    def run(resume, save):
        tpify.manual_seed(7)
        m = tpify.parallelize(_model(dropout=0.1), tp_size=tp)
        capture = _OptimizerAt(m, 2)
        t = TPTrainer(model=m, args=_args(out + "/resume", 4 // dp, save_strategy="steps" if save else "no",
                                           save_steps=2), train_dataset=_Data(), callbacks=[capture])
        t.train(resume_from_checkpoint=resume)
        if save:
            torch.save(capture.state, out + f"/optimizer-at-2-rank{rank}.pt")  # for the resumes at other layouts
        return _log(t), _dense_weights(m)

    straight_log, straight_w = run(None, True)
    resumed_log, resumed_w = run(out + "/resume/checkpoint-2", False)
    assert len(resumed_log) == len(straight_log) == STEPS  # the first two come from the checkpoint's state
    assert resumed_log[2:] == straight_log[2:], (resumed_log, straight_log)
    for k, v in straight_w.items():
        assert torch.equal(resumed_w[k], v), f"resumed {k} differs"
    assert os.path.isfile(out + f"/resume/checkpoint-2/tpify_optimizer/__{rank}_0.distcp"), "every rank writes its part"

    # 3. PEFT LoRA through the Trainer, with gradient checkpointing; its checkpoint holds a
    # standard (dense) adapter.
    from tpify.integrations import get_peft_model

    model = tpify.parallelize(_model(), tp_size=tp)
    torch.manual_seed(1)
    model = get_peft_model(model, _lora_config())
    trainer = TPTrainer(model=model, args=_args(out + "/lora", 4 // dp, max_grad_norm=LORA_CLIP,
                                                save_strategy="steps", save_steps=STEPS, gradient_checkpointing=True),
                        train_dataset=_Data())  # checkpointing on the TP side only: the results must not change
    trainer.train()
    results["lora"] = _log(trainer)
    results["lora_weights"] = _adapters(model)

    # 4. accelerate: prepare(model, optimizer, dataloader), backward, clip_grad_norm_.
    model = tpify.parallelize(_model(), tp_size=tp)
    results["accelerate"] = _accelerate_loop(TPAccelerator(cpu=True), model, 4 // dp)
    results["accelerate_weights"] = _dense_weights(model)
    # save_state after 2 steps, then a fresh model and optimizer, load_state, the 3rd step: bitwise.
    _accelerate_loop(TPAccelerator(cpu=True), tpify.parallelize(_model(), tp_size=tp), 4 // dp, save=out + "/state")
    resumed = tpify.parallelize(_model(), tp_size=tp)
    log = _accelerate_loop(TPAccelerator(cpu=True), resumed, 4 // dp, resume=out + "/state")
    assert log == results["accelerate"][2:], (log, results["accelerate"])
    for name, w in _dense_weights(resumed).items():
        assert torch.equal(w, results["accelerate_weights"][name]), f"accelerate resume: {name}"
    # 5. bf16 mixed precision (float32 weights, bf16 autocast), as every GPU user fine-tunes and TRL
    # defaults to: TPTrainer(bf16=True) and TPAccelerator(mixed_precision="bf16").
    model = tpify.parallelize(_model().float(), tp_size=tp)
    trainer = TPTrainer(model=model, args=_args(out + "/bf16", 4 // dp, bf16=True), train_dataset=_Data())
    trainer.train()
    results["trainer_bf16"] = _log(trainer)
    model = tpify.parallelize(_model().float(), tp_size=tp)
    results["accelerate_bf16"] = _accelerate_loop(TPAccelerator(cpu=True, mixed_precision="bf16"), model, 4 // dp)
    if rank == 0:  # tensors travel through a file: a queue would share memory with an exiting process
        torch.save(results, out + "/results.pt")
    dist.barrier()
    # 6. Resuming these checkpoints at another layout; into another model, refused (checks named in _REFUSALS).
    c = SimpleNamespace(rank=rank, world=world, tp=tp, out=out, messages={})
    checks = {k: f for k, f in _REFUSALS.items() if world > tp or k not in _SLOW_ONLY}  # the quick job: refusals
    return out + "/results.pt", tputil.run_checks(checks, c), c.messages


# -- resuming at another layout (slow job only), and refusals of another model ------------------
_REFUSALS = {}
_SLOW_ONLY = {"trainer_resumes_at_tp1", "trainer_resumes_at_other_padding", "accelerate_resumes_at_tp1",
              "accelerate_resumes_at_other_padding", "finetune_resumes_at_other_padding"}


def _refusal(fn):
    _REFUSALS[fn.__name__] = fn
    return fn


def _refused(c, name, fn, *patterns, error=None):
    """``fn()`` must raise (a ResumeError unless ``error`` says otherwise) with every pattern in
    its message; the message is kept for the report."""
    from tpify.integrations.resume import ResumeError

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - checked below
        if not isinstance(e, error or ResumeError):
            raise
        message = str(e)
    else:
        raise AssertionError(f"{name}: resumed without an error")
    for pattern in patterns:
        assert re.search(pattern, message), f"{name}: {pattern!r} not in: {message}"
    c.messages[name] = message
    return message


def _step_counter():
    """A TrainerCallback and the list of the steps it saw end."""
    from transformers import TrainerCallback

    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    return Steps(), steps


def _untouched(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _trainer_refuses(c, name, checkpoint, *patterns, tp=None, pad=1, optimizer=None, error=None, model=_model):
    """TPTrainer resuming ``checkpoint`` raises with ``patterns``, before any step; without an
    ``optimizer`` (a function of the model) the refusal comes before the weights are read."""
    import tpify
    from tpify.integrations import TPTrainer

    tp = tp or c.tp
    model = tpify.parallelize(model(), tp_size=tp, pad_vocab_multiple=pad)
    before = _untouched(model)
    counter, steps = _step_counter()
    trainer = TPTrainer(model=model, args=_args(c.out + f"/refused-{name}", 4 // (c.world // tp)),
                        train_dataset=_Data(), optimizers=(optimizer and optimizer(model), None), callbacks=[counter])
    _refused(c, name, lambda: trainer.train(resume_from_checkpoint=checkpoint), *patterns, error=error)
    assert steps == [], f"{name}: trained steps {steps}"
    if optimizer is None:
        for n, w in _untouched(model).items():
            assert torch.equal(w, before[n]), f"{name}: {n} was loaded before the refusal"


class _OptimizerAt:
    """A TrainerCallback keeping the dense optimizer state (:func:`_dense_optimizer_state`) at the
    end of step ``at``, or at the start of training (``at=None``: just after a resume loaded it)."""

    def __new__(cls, model, at):
        from transformers import TrainerCallback

        class Capture(TrainerCallback):
            state = None

            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                if at is None:
                    self.state = _dense_optimizer_state(model, optimizer)

            def on_step_end(self, args, state, control, optimizer=None, **kwargs):
                if at is not None and state.global_step == at:
                    self.state = _dense_optimizer_state(model, optimizer)

        return Capture()


def _dense_optimizer_state(model, optimizer):
    """``{"<param>.<key>": dense tensor}`` of an optimizer over a tpify model: each state tensor of
    its parameter's shape gathered over TP (collective), the rest as they are."""
    from tpify.info import find_tp_model, get_tp_info, param_specs

    optimizer = getattr(optimizer, "optimizer", optimizer)
    group = get_tp_info(find_tp_model(model)).tp_group
    specs, names = param_specs(model), {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, values in optimizer.state.items():
        for k, v in values.items():
            spec = specs.get(id(p))
            if torch.is_tensor(v) and v.dim() and v.shape == p.shape and spec is not None:
                v = spec.gather(v, group)
            out[f"{names[id(p)]}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def _trainer_resumes(c, name, tp, pad=1):
    """TPTrainer resumes the dp x tp checkpoint at ``tp`` (dp = world / tp) and ``pad``: the
    optimizer state it loaded equals, bitwise (bytes moved, nothing computed), the dense state of
    the run that wrote it, at step 2; then it trains steps 3 and 4."""
    import tpify
    from tpify.integrations import TPTrainer

    model = tpify.parallelize(_model(dropout=0.1), tp_size=tp, pad_vocab_multiple=pad)
    capture, (counter, steps) = _OptimizerAt(model, None), _step_counter()
    trainer = TPTrainer(model=model, args=_args(c.out + f"/resumed-{name}", 4 // (c.world // tp)),
                        train_dataset=_Data(), callbacks=[capture, counter])
    trainer.train(resume_from_checkpoint=c.out + "/resume/checkpoint-2")
    saved = torch.load(c.out + f"/optimizer-at-2-rank{c.rank}.pt")
    assert capture.state.keys() == saved.keys() and len(saved) > 0
    for key, value in saved.items():
        assert torch.equal(capture.state[key], value), f"{name}: {key} differs from the saved run's"
    assert steps == [3, 4], steps
    c.messages[name] = f"resumed at tp {tp}, pad_vocab_multiple {pad}: {len(saved)} optimizer tensors bitwise equal"


@_refusal
def trainer_resumes_at_tp1(c):
    """dp x tp -> dp = world, tp 1."""
    _trainer_resumes(c, "trainer_resumes_at_tp1", tp=1)


@_refusal
def trainer_resumes_at_other_padding(c):
    """tp 2 with the vocabulary padded to a multiple of 64 (the dense-order fallback on load)."""
    _trainer_resumes(c, "trainer_resumes_at_other_padding", tp=c.tp, pad=64)


@_refusal
def trainer_other_model(c):
    """Another model (3 layers where the checkpoint has 2): refused before the weights are read."""
    def other():
        torch.manual_seed(0)
        cfg = gpt2_config()
        cfg.n_layer = 3
        return GPT2LMHeadModel(cfg).double()

    _trainer_refuses(
        c, "trainer_other_model", c.out + "/resume/checkpoint-2",
        r"^TPTrainer resume: .*checkpoint-2 was saved from GPT2LMHeadModel at tp_size 2",
        r"optimized parameters new now: transformer.h.2.ln_1.weight", model=other)


@_refusal
def trainer_other_param_groups(c):
    """Same shards, but one param group where Trainer's default optimizer has two (decay, no
    decay): caught by the second comparison, before the optimizer state is loaded."""
    _trainer_refuses(c, "trainer_other_param_groups", c.out + "/resume/checkpoint-2",
                     r"^TPTrainer resume \(optimizer\): ",
                     r"the optimizer's param groups hold \[\d+, \d+\] parameters then, \[\d+\] now",
                     optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))


@_refusal
def trainer_manifest_missing_on_one_rank(c):
    """Rank 1 resumes from a directory without a manifest: it raises ResumeError, every other
    rank AgreementError naming it (never a hang)."""
    from tpify.agree import AgreementError

    empty = c.out + "/not-a-checkpoint"
    os.makedirs(empty, exist_ok=True)
    if c.rank == 1:
        _trainer_refuses(c, "trainer_manifest_missing_on_one_rank", empty,
                         r"not-a-checkpoint cannot be resumed: its layout manifest .*tpify_optimizer/tpify_layout.json "
                         r"is missing")
    else:
        _trainer_refuses(c, "trainer_manifest_missing_on_one_rank", c.out + "/resume/checkpoint-2",
                         r"failed on rank\(s\) \[1\] \(rank 1: ResumeError: .*layout manifest .* is missing",
                         error=AgreementError)


def _accelerator_resumes(c, name, tp, pad=1):
    """``load_state`` of the state saved at dp x tp into a model at ``tp`` (dp = world / tp) and
    ``pad``, then the 3rd step: the same loss and weights as the straight loop (TOL: float64
    summation order differs between layouts)."""
    import tpify
    from tpify.integrations import TPAccelerator

    model = tpify.parallelize(_model(), tp_size=tp, pad_vocab_multiple=pad)
    log = _accelerate_loop(TPAccelerator(cpu=True), model, 4 // (c.world // tp), resume=c.out + "/state")
    straight = torch.load(c.out + "/results.pt")
    torch.testing.assert_close(log[0][0], straight["accelerate"][2][0], rtol=1e-9, atol=0)
    for key, w in _dense_weights(model).items():
        torch.testing.assert_close(w, straight["accelerate_weights"][key], **TOL, msg=lambda m: f"{name} {key}: {m}")
    c.messages[name] = f"resumed at tp {tp}, pad_vocab_multiple {pad}: step 3 as the straight loop"


@_refusal
def accelerate_resumes_at_tp1(c):
    _accelerator_resumes(c, "accelerate_resumes_at_tp1", tp=1)


@_refusal
def accelerate_resumes_at_other_padding(c):
    _accelerator_resumes(c, "accelerate_resumes_at_other_padding", tp=c.tp, pad=64)


@_refusal
def finetune_resumes_at_other_padding(c):
    """``tpify finetune``'s checkpoint and restore (the code finetune() runs) at another padding
    (the dense-order fallback): the restored optimizer state equals the saved one, bitwise.
    That the same layout restores exactly is test_finetune.py's test_resume_is_exact_dp2_tp2."""
    import tpify
    from tpify.cli import finetune as ft

    cfg = ft.FinetuneConfig(model_dir="unused", out_dir=c.out + "/ft", tp=c.tp, dp=c.world // c.tp)

    def build(pad):
        model = tpify.parallelize(_model(), tp_size=c.tp, pad_vocab_multiple=pad)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    model, opt, sched = build(1)
    ids = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    ckpt = ft._save_checkpoint(model, opt, sched, 1, [1.0], cfg, Path(cfg.out_dir))
    other, other_opt, other_sched = build(64)
    ft._restore(ckpt / "trainer", other, other_opt, other_sched, lora=False)
    want, got = _dense_optimizer_state(model, opt), _dense_optimizer_state(other, other_opt)
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    c.messages["finetune_resumes_at_other_padding"] = f"{len(want)} optimizer tensors bitwise equal"


def _dense_runs(out):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = _model()
    model.loss_function = tputil.float64_loss_function(causal=True)
    trainer = Trainer(model=model, args=_args(out + "/dense", 4), train_dataset=_Data())
    trainer.train()
    dense = {"trainer": _log(trainer), "trainer_weights": _dense_weights(model),
             "eval": _evaluate(trainer)}
    model = _model()
    model.loss_function = tputil.float64_loss_function(causal=True)
    torch.manual_seed(1)
    import peft

    model = peft.get_peft_model(model, _lora_config())
    trainer = Trainer(model=model, args=_args(out + "/dense-lora", 4, max_grad_norm=LORA_CLIP), train_dataset=_Data())
    trainer.train()
    dense["lora"], dense["lora_weights"] = _log(trainer), _adapters(model)
    AcceleratorState._reset_state(True)
    model = _model()
    model.loss_function = tputil.float64_loss_function(causal=True)
    dense["accelerate"] = _accelerate_loop(Accelerator(cpu=True), model, 4)
    dense["accelerate_weights"] = _dense_weights(model)
    AcceleratorState._reset_state(True)
    trainer = Trainer(model=_model().float(), args=_args(out + "/dense-bf16", 4, bf16=True), train_dataset=_Data())
    trainer.train()
    dense["trainer_bf16"] = _log(trainer)
    AcceleratorState._reset_state(True)
    dense["accelerate_bf16"] = _accelerate_loop(Accelerator(cpu=True, mixed_precision="bf16"), _model().float(), 4)
    AcceleratorState._reset_state(True)
    return dense


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    return _dense_runs(str(tmp_path_factory.mktemp("dense")))


def _compare(got, want, what, clip):
    assert len(got) == len(want) and len(want) > 0, what
    for i, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(got, want)):
        assert norm_ref > clip, f"the test must exercise clipping: {what} norm {norm_ref} <= {clip}"
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0, msg=f"{what} loss, step {i + 1}")
        torch.testing.assert_close(norm, norm_ref, rtol=1e-9, atol=0, msg=f"{what} grad norm, step {i + 1}")


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """``run(world, tp)``: the spawned ``_tp_body`` job at that size, once per module:
    ``(out directory, per-rank (results file, refusal checks, refusal messages))``."""
    done = {}

    def run(world, tp):
        if (world, tp) not in done:
            out = tmp_path_factory.mktemp(f"tp-w{world}-tp{tp}")
            done[world, tp] = out, tputil.spawn(_tp_body, world, tp, str(out), timeout=400)
        return done[world, tp]

    return run


SIZES = [pytest.param(2, 2, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow)]  # the quick subset: the refusals
SIZE_IDS = ["tp2", "dp2xtp2"]


@pytest.mark.parametrize("world,tp", SIZES, ids=SIZE_IDS)
def test_trainer_and_accelerate_match_dense(dense_reference, world, tp, tp_runs):
    tmp_path, ranks = tp_runs(world, tp)
    got = torch.load(ranks[0][0])
    for tool, clip in (("trainer", 1.0), ("lora", LORA_CLIP), ("accelerate", 1.0)):
        _compare(got[tool], dense_reference[tool], f"{tool} at world {world}, tp {tp}", clip)
        assert set(got[f"{tool}_weights"]) == set(dense_reference[f"{tool}_weights"])
        for name, w in dense_reference[f"{tool}_weights"].items():
            torch.testing.assert_close(got[f"{tool}_weights"][name], w, **TOL, msg=lambda m: f"{tool} {name}: {m}")
        loss_rel = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got[tool], dense_reference[tool]))
        norm_rel = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got[tool], dense_reference[tool]))
        w_abs = max((got[f"{tool}_weights"][n] - w).abs().max().item() for n, w in dense_reference[f"{tool}_weights"].items())
        print(f"measured {tool} world={world} tp={tp}: loss rel {loss_rel:.1e}, grad-norm rel {norm_rel:.1e}, "
              f"weights max abs {w_abs:.1e}")
    for tool in ("trainer_bf16", "accelerate_bf16"):
        # bf16 keeps 8 significant bits: the two sides round at other points (partial matmuls before the
        # all-reduce), ~1e-5 relative on a loss and ~1% on a gradient tensor (test_never_silently_wrong.py);
        # over 4 AdamW steps, measured at tp 2: losses within 1.5e-5, gradient norms within 8e-4. A crash
        # or a wrong gradient (no DP averaging, a per-rank clip) is off by far more than these bounds.
        assert len(got[tool]) == len(dense_reference[tool]) > 0, tool
        for i, ((loss, norm), (loss_ref, norm_ref)) in enumerate(zip(got[tool], dense_reference[tool])):
            torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=0, msg=f"{tool} loss, step {i + 1}")
            torch.testing.assert_close(norm, norm_ref, rtol=1e-2, atol=0, msg=f"{tool} grad norm, step {i + 1}")
        print(f"measured {tool} world={world} tp={tp}: loss rel "
              f"{max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got[tool], dense_reference[tool])):.1e}, grad-norm "
              f"rel {max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got[tool], dense_reference[tool])):.1e}")
    if world == tp:  # with dp > 1 Trainer's own evaluation differs from one process (it pads the last
        # batch with repeated samples and weighs replicas' means), as it does for plain DDP: not comparable.
        torch.testing.assert_close(got["eval"], dense_reference["eval"], rtol=1e-6, atol=0)
    # What trainer.save_model() wrote loads in plain transformers with the trained weights.
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "final").double().eval()
    ref = _model().eval()
    ref.load_state_dict(dense_reference["trainer_weights"])
    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=1e-6, rtol=1e-6)
    # The LoRA checkpoint's adapter loads in plain peft on the dense model: the dense-trained adapters.
    import peft

    adapter = peft.PeftModel.from_pretrained(_model(), tmp_path / "lora" / f"checkpoint-{STEPS}")
    for name, w in dense_reference["lora_weights"].items():
        torch.testing.assert_close(dict(adapter.named_parameters())[name].detach(), w, **TOL)


def _plain_tools_body(rank, world):
    import tpify
    from tpify.integrations import TPUsageError

    tputil.torchrun_env(rank, world)
    errors = []
    model = tpify.parallelize(_model(), tp_size=2)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=model, args=_args(out, 2), train_dataset=_Data())
        try:
            trainer.train()
        except TPUsageError as e:
            errors.append(str(e))
    from accelerate import Accelerator

    model = tpify.parallelize(_model(), tp_size=2)
    wrapped = Accelerator(cpu=True).prepare(model)
    try:
        wrapped(torch.zeros(1, 4, dtype=torch.long))
    except TPUsageError as e:
        errors.append(str(e))
    return errors


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_plain_trainer_and_accelerator_refuse_a_tp_model():
    """A DDP over the whole world would corrupt the shards: refused on every rank, no hang."""
    for errors in tputil.spawn(_plain_tools_body, 2, timeout=120):
        assert len(errors) == 2, errors
        assert all("DistributedDataParallel over ranks [0, 1], not over its DP group [" in e for e in errors), errors
        assert "TPTrainer" in errors[0]


def _no_torchrun_env_body(rank, world):
    """TPTrainer in ranks started without torchrun's environment (accelerate then counts 1 process)."""
    import tpify
    from tpify.integrations import TPTrainer, TPUsageError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    model = tpify.parallelize(_model(), tp_size=2)
    with tempfile.TemporaryDirectory() as out:
        try:
            TPTrainer(model=model, args=_args(out, 2), train_dataset=_Data())
        except TPUsageError as e:
            return str(e)
    return None


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_tptrainer_without_torchrun_environment_is_refused_on_every_rank():
    """Without torchrun's WORLD_SIZE accelerate counts one process and Trainer scales each loss by
    num_processes // tp_size = 0 (a silently zero loss): refused on every rank at construction."""
    for error in tputil.spawn(_no_torchrun_env_body, 2, timeout=120):
        assert error is not None and "accelerate sees 1 process(es) but torch.distributed has 2 ranks" in error, error


def _checks_ok(ranks, *names):
    failures = {(rank, n): r[1][n] for n in names for rank, r in enumerate(ranks) if r[1][n] is not None}
    assert not failures, "\n".join(f"--- rank {rank}, {n} ---\n{tb}" for (rank, n), tb in failures.items())
    for n in names:
        print(f"{n}, rank 0: {ranks[0][2].get(n)}")


@pytest.mark.parametrize("world,tp", SIZES, ids=SIZE_IDS)
def test_trainer_resume_into_another_model_is_refused_on_every_rank(tp_runs, world, tp):
    _checks_ok(tp_runs(world, tp)[1], "trainer_other_model", "trainer_other_param_groups",
               "trainer_manifest_missing_on_one_rank")


@pytest.mark.slow
def test_trainer_resumes_at_another_layout(tp_runs):
    """dp 2 x tp 2 -> dp 4 x tp 1, and tp 2 at another padding: the optimizer state bitwise."""
    _checks_ok(tp_runs(4, 2)[1], "trainer_resumes_at_tp1", "trainer_resumes_at_other_padding")


@pytest.mark.slow
def test_accelerate_load_state_at_another_layout_continues_as_the_straight_loop(tp_runs):
    _checks_ok(tp_runs(4, 2)[1], "accelerate_resumes_at_tp1", "accelerate_resumes_at_other_padding")


@pytest.mark.slow
def test_finetune_resume_at_another_padding_restores_the_optimizer(tp_runs):
    _checks_ok(tp_runs(4, 2)[1], "finetune_resumes_at_other_padding")


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_plain_trainer_fails_loudly_on_a_tptrainer_checkpoint(tp_runs, tmp_path):
    """Plain ``Trainer`` resuming a TPTrainer checkpoint (to finish in one process) raises before
    any step, instead of training on with a fresh optimizer and a restarted schedule: the
    ``tpify_optimizer/`` subdirectory makes it load ``optimizer.pt``, which is not there."""
    checkpoint = tp_runs(2, 2)[0] / "resume" / "checkpoint-2"
    counter, steps = _step_counter()
    trainer = Trainer(model=_model(dropout=0.1), args=_args(str(tmp_path), 4), train_dataset=_Data(),
                      callbacks=[counter])
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2/optimizer.pt"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert steps == [], steps
    manifest = (checkpoint / "tpify_optimizer" / "tpify_layout.json").read_text()
    assert "torch.distributed.checkpoint" in manifest and '"tp_size": 2' in manifest
