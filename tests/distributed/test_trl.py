"""TRL's SFT, DPO, GRPO and Reward trainers on a tpify model equal the same trainer on the dense model.

The dense references run in this (pytest) process with TRL's own trainers, one process (GRPO's
at dp = 2: TRL's GRPOTrainer on 2 dense processes, plain DDP, in the tp = 2 job); the
tensor-parallel runs use ``tpify.integrations.tp_trainer_class(<TRL trainer>)`` on gloo ranks at
tp = 2 (one spawned job for every check, the resumed runs included) and SFT, DPO and GRPO at
dp = 2 x tp = 2 (a second job), with the same seed, data and arguments
(``per_device_train_batch_size`` is per DP replica, so a one-process dense run's batch is ``dp``
times it). The model is a tiny Llama (2 layers, hidden 32) with SmolLM2's
49,152-token vocabulary and tokenizer (its chat template), built from a config: no download.

What is compared: every numeric value TRL logs at every step (loss, grad_norm, SFT's entropy,
mean_token_accuracy and num_tokens, DPO's rewards/*, logps/*, logits/*, GRPO's reward, kl,
entropy, completion lengths...) and the final weights (dense, gathered; the adapters for PEFT).
Tolerances:
* float64 models (SFT, DPO, GRPO): rtol 1e-5, atol 1e-5 on logged values: TRL's fused LM head
  computes in float32 even for a float64 model (its chunked kernel), so the dense reference is
  float32-exact only (measured: losses within 2e-7 relative; DPO's rewards ``beta * (logp -
  logp_ref)`` with ``logp`` ~ -50 carry ~2e-7 absolute of float32 rounding). Weights atol 1e-4,
  rtol 1e-5: Adam's step ``m / (sqrt(v) + eps)`` divides by the gradient's own size, so an element
  whose gradient is 1e-3 of its tensor's largest carries that float32 noise amplified 1e3 times
  into its update (measured: 4e-5 on one LayerNorm weight after 3 steps of lr 1e-3); a wrong
  log-prob (a vocabulary shard taken for the whole head) moves the loss by 50% and weights by ~lr;
* bf16 runs (``bf16=True``, TRL's default: autocast to bfloat16 over float32 weights): rtol 2e-2
  on losses and metrics, weights atol 2e-3. bfloat16 keeps 8 bits of mantissa (relative rounding
  4e-3); the TP run rounds partial sums of its row-parallel matmuls before the all-reduce while
  the dense run rounds the whole sum once, so activations differ by a few bf16 ulps and the
  difference grows through 2 layers and 3 Adam steps; weights atol 6e-3 = 2 * lr * steps (Adam
  moves a weight by ~lr a step whatever its gradient, so a gradient at bf16 noise level can flip
  an update; measured 2.9e-3 on one embedding element of 1.5 M).
GRPO also checks that the completions are identical on both TP ranks (token ids compared) and
equal to the dense run's.
"""

import os
import re

import pytest
import torch

import tputil

pytestmark = pytest.mark.slow

STEPS = 3
F64 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)
WEIGHTS_F64 = dict(atol=1e-4, rtol=1e-5)
WEIGHTS_BF16 = dict(atol=6e-3, rtol=2e-2)  # 2 * lr * STEPS: Adam moves a weight by ~lr a step whatever its gradient
_SKIP = re.compile(r"runtime|per_second|flos|epoch|step_time|mfu|tokens_per|clipped_ratio")


def _tokenizer():
    from transformers import AutoTokenizer

    from tpify.cli.demo_models import default_smollm2_dir

    return AutoTokenizer.from_pretrained(str(default_smollm2_dir()))


def _llama(dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(cfg).to(dtype)


def _texts(n=8):
    words = "the cat sat on a mat while two dogs ran past the old red barn near the river".split()
    return [" ".join(words[i % 5: i % 5 + 4 + i % 4]) for i in range(n)]


def _sft_data(kind):
    from datasets import Dataset

    texts = _texts()
    if kind == "text":
        return Dataset.from_list([{"text": t} for t in texts])
    if kind == "completion":
        return Dataset.from_list([{"prompt": t[:9], "completion": t[9:]} for t in texts])
    if kind == "chat":  # conversational prompt-completion: the chat template, loss on the completion only
        return Dataset.from_list([{"prompt": [{"role": "user", "content": t[:9]}],
                                   "completion": [{"role": "assistant", "content": t[9:]}]} for t in texts])
    raise ValueError(kind)


def _common(out, batch, **kw):
    """Trainer arguments; ``batch`` per device, or ``{"batch": b, <saving options>}``."""
    kw.setdefault("bf16", False)
    saving = dict(save_strategy="no")
    if isinstance(batch, dict):
        saving = {k: v for k, v in batch.items() if k != "batch"}
        batch = batch["batch"]
    return dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=STEPS,
                learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                max_grad_norm=1.0, **saving, **kw)


def _sft_args(out, batch, **kw):
    from trl import SFTConfig

    kw.setdefault("max_length", 32)
    kw.setdefault("include_num_input_tokens_seen", "non_padding")  # Trainer's count, logged and compared too
    return SFTConfig(**_common(out, batch, **kw))


def _dpo_args(out, batch, **kw):
    from trl import DPOConfig

    return DPOConfig(**_common(out, batch, max_length=32, **kw))


def _grpo_args(out, batch, **kw):
    from trl import GRPOConfig

    kw = {"num_generations": 2, "max_completion_length": 6, "beta": 0.1, "temperature": 1.0, **kw}
    return GRPOConfig(**_common(out, batch, **kw))


#: GRPO's options whose statistics span the gathered batch, checked against dense: the float64 run
#: at tp 2 (a batch-wide std of per-group normalized rewards; the adaptive entropy controller with a
#: target above the entropy, so its coefficient grows each step and its state matters on resume) and
#: the run at dp 2 x tp 2 (a group of 4 completions spread over both DP replicas, the batch-wide
#: reward std, the entropy quantile over the gathered entropies).
GRPO_OPTIONS = {"grpo": dict(multi_objective_aggregation="normalize_then_sum", use_adaptive_entropy=True,
                             entropy_coef=0.01, entropy_coef_delta=0.01, entropy_target=100.0),
                "grpo-dp": dict(num_generations=4, scale_rewards="batch", top_entropy_quantile=0.8)}
#: The float64 runs at tp 2 that also save a checkpoint after step RESUME_AT and are resumed from it
#: in a new trainer; their logs and weights are compared with the uninterrupted run's.
RESUMED = ("sft-chat", "dpo", "grpo")
RESUME_AT = 2


def _reward_len(completions, **kwargs):
    """A rule-based reward: the number of distinct characters of each completion."""
    return [float(len(set(c))) for c in completions]


def _logs(trainer):
    return [{k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not _SKIP.search(k)}
            for entry in trainer.state.log_history if "loss" in entry]


def _weights(model):
    from tpify.sharding import shard_spec_of

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    trainable = hasattr(model, "peft_config")
    group = base.tp_info.tp_group if hasattr(base, "tp_info") else None
    out = {}
    for n, p in model.named_parameters():
        if trainable and not p.requires_grad:
            continue
        spec = shard_spec_of(p)
        out[n] = (spec.gather(p.detach(), group) if spec is not None else p.detach()).float().clone()
    return out


def _lora():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                           init_lora_weights="gaussian")


def _dpo_data():
    from datasets import Dataset

    t = _texts()
    return Dataset.from_list([{"prompt": t[i][:8], "chosen": t[i][8:], "rejected": t[(i + 3) % 8][8:]}
                              for i in range(8)])


def _grpo_data():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": t[:10]} for t in _texts()])


# -- the runs: the same function builds the dense run (plain TRL trainer) and the TP one ----------

def _run(kind, out, tp, dp=1, model_dir=None, per_process=False):
    """Train ``kind`` for STEPS steps: ``{"logs", "weights", ...}``. tp == 0: TRL's trainer on the
    dense model, in this process with the batch of ``dp`` replicas, or (``per_process``) on every
    process of the world (plain DDP); else tp_trainer_class(trainer) on a tpify model. A kind of
    RESUMED at tp > 0 also saves checkpoint-RESUME_AT and is resumed from it: ``result["resumed"]``."""
    resume = tp > 0 and kind in RESUMED
    result = _train(kind, out, tp, dp, model_dir, per_process, save=resume)
    if resume:
        result["resumed"] = _train(kind, out, tp, dp, model_dir, per_process,
                                   resume_from=os.path.join(out, f"checkpoint-{RESUME_AT}"))
    return result


def _train(kind, out, tp, dp, model_dir, per_process, save=False, resume_from=None):
    from datasets import Dataset
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer

    import tpify
    from tpify.integrations import tp_trainer_class

    bf16 = kind.endswith("bf16")
    dtype = torch.float32 if bf16 else torch.float64
    wrap = (lambda c: c) if tp == 0 else tp_trainer_class
    par = (lambda m: m) if tp == 0 else (lambda m: tpify.parallelize(m, tp_size=tp))
    batch = 2 * (dp if tp == 0 and not per_process else 1)
    if save:
        batch = dict(batch=batch, save_strategy="steps", save_steps=RESUME_AT)
    tok = _tokenizer()
    result = {}
    if kind.startswith("sft"):
        variant = kind.split("-")[1]
        extra = {"bf16": bf16}
        data = _sft_data({"plain": "text", "bf16": "text", "chat": "chat", "packing": "text"}[variant])
        if variant == "chat":  # SmolLM2's template adds a system prompt of ~30 tokens
            extra.update(max_length=96)
        if variant == "packing":  # packed with position_ids, and LoRA through peft_config=
            extra.update(packing=True, max_length=24)
        trainer = wrap(SFTTrainer)(model=par(_llama(dtype)), args=_sft_args(out, batch, **extra), train_dataset=data,
                                   processing_class=tok, peft_config=_lora() if variant == "packing" else None)
    elif kind.startswith("dpo"):
        trainer = wrap(DPOTrainer)(model=par(_llama(dtype)), ref_model=par(_llama(dtype)),
                                   args=_dpo_args(out, batch, bf16=bf16), train_dataset=_dpo_data(),
                                   processing_class=tok)
    elif kind.startswith("grpo"):
        from transformers import AutoModelForCausalLM

        model = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype) if tp == 0
                 else tpify.from_pretrained(model_dir, tp_size=tp, dtype=dtype))
        trainer = wrap(GRPOTrainer)(model=model, reward_funcs=_reward_len, train_dataset=_grpo_data(),
                                    args=_grpo_args(out, batch, bf16=bf16, **GRPO_OPTIONS.get(kind, {})),
                                    processing_class=tok)
        completions = []
        generate = trainer._generate

        def recording(prompts):
            got = generate(prompts)
            completions.append([list(map(int, c)) for c in got[1]])
            return got

        trainer._generate = recording
        result["completions"] = completions
    elif kind == "reward":
        from transformers import LlamaForSequenceClassification
        from trl import RewardConfig, RewardTrainer

        cfg = _llama().config
        cfg.num_labels = 1
        torch.manual_seed(0)
        model = par(LlamaForSequenceClassification(cfg).to(torch.float64))
        t = _texts()
        data = Dataset.from_list([{"chosen": t[i], "rejected": t[(i + 3) % 8]} for i in range(8)])
        trainer = wrap(RewardTrainer)(model=model, args=RewardConfig(**_common(out, batch, max_length=32)),
                                      train_dataset=data, processing_class=tok)
    elif kind == "refusals":
        return _refusals(out, tp, tok)
    else:
        raise ValueError(kind)
    trainer.train(resume_from_checkpoint=resume_from)
    result.update(logs=_logs(trainer), weights=_weights(trainer.model))
    return result


def _refusals(out, tp, tok):
    """TRL options tpify refuses, each by name, at construction (before any collective): the
    messages, in order."""
    from trl import GRPOTrainer, SFTTrainer

    import tpify
    from tpify.integrations import TPUsageError, tp_trainer_class

    cases = [
        (GRPOTrainer, _grpo_args(out, 2, use_vllm=True), {"reward_funcs": _reward_len}, {}),
        (SFTTrainer, _sft_args(out, 2), {}, {"lm_loss_chunk": 16}),
        (SFTTrainer, None, {}, {}),
    ]
    messages = []
    for trainer, args, extra, options in cases:
        model = tpify.parallelize(_llama(), tp_size=tp, **options)
        try:
            tp_trainer_class(trainer)(model=model, args=args, train_dataset=_grpo_data(), processing_class=tok, **extra)
        except TPUsageError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    return {"messages": messages}


def _save_initial(directory):
    """The GRPO policy's starting point (and TRL's reference model's path), float64."""
    _llama().save_pretrained(directory)


#: The runs of each spawned job (world, tp): "dense:<kind>" is TRL's own trainer on the dense model
#: on every process of the job's world (plain DDP over 2 processes: the reference of dp 2 x tp 2).
KINDS = ["refusals", "reward", "sft-chat", "sft-packing", "sft-bf16", "dpo", "dpo-bf16", "grpo", "grpo-bf16",
         "dense:grpo-dp"]
KINDS_DP2_TP2 = ["sft-plain", "dpo", "grpo-dp"]


def _tp_body(rank, world, tp, out, kinds, model_dir):
    tputil.torchrun_env(rank, world)
    from accelerate.state import AcceleratorState

    results, errors = {}, {}
    for kind in kinds:
        try:
            if kind.startswith("dense:"):
                results[kind] = _run(kind[6:], os.path.join(out, kind[6:] + "-dense"), 0, world, model_dir,
                                     per_process=True)
            else:
                results[kind] = _run(kind, os.path.join(out, kind), tp, world // tp, model_dir)
        except Exception:  # noqa: BLE001 - reported per kind to the test that owns it
            import traceback

            errors[kind] = traceback.format_exc()
        AcceleratorState._reset_state(True)
    if rank < tp:  # the TP ranks of DP replica 0
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    return errors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("initial")
    _save_initial(str(d))
    return str(d)


@pytest.fixture(scope="module")
def dense(tmp_path_factory, model_dir):
    from accelerate.state import AcceleratorState

    out = tmp_path_factory.mktemp("dense")
    runs = {}

    def get(kind, dp=1):
        if (kind, dp) not in runs:
            runs[kind, dp] = _run(kind, str(out / f"{kind}-dp{dp}"), 0, dp, model_dir)
            AcceleratorState._reset_state(True)
        return runs[kind, dp]

    return get


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory, model_dir):
    done = {}

    def run(world, tp, kinds):
        if (world, tp) not in done:
            out = tmp_path_factory.mktemp(f"trl-w{world}-tp{tp}")
            errors = tputil.spawn(_tp_body, world, tp, str(out), kinds, model_dir, timeout=600)
            done[world, tp] = out, errors
        out, errors = done[world, tp]
        return out, errors

    return run


def _compare(got, want, tol, wtol, what, skip=()):
    assert len(got["logs"]) == len(want["logs"]) == STEPS, what
    worst = {"loss": 0.0, "metrics": 0.0, "weights": 0.0}  # the largest differences, printed (pytest -s)
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        assert set(g) == set(w), f"{what} step {step + 1}: logged keys {sorted(set(g) ^ set(w))} differ"
        for key in set(w) - set(skip):
            torch.testing.assert_close(g[key], w[key], **tol, msg=lambda m: f"{what} step {step + 1} {key}: {m}")
            part = "loss" if key == "loss" else "metrics"  # relative above 1, absolute below (GRPO's loss, kl ~ 0)
            worst[part] = max(worst[part], abs(g[key] - w[key]) / max(abs(w[key]), 1.0))
    assert set(got["weights"]) == set(want["weights"]), what
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, **wtol, msg=lambda m: f"{what} {name}: {m}")
        worst["weights"] = max(worst["weights"], (got["weights"][name] - w).abs().max().item())
    print(f"\n[measured] {what} (relative above 1, absolute below): loss {worst['loss']:.1e}, other logged values "
          f"{worst['metrics']:.1e}, weights {worst['weights']:.1e} absolute")


def _job_result(tp_job, world, tp, kind):
    out, errors = tp_job(world, tp, KINDS if world == tp else KINDS_DP2_TP2)
    failed = {r: e[kind] for r, e in enumerate(errors) if kind in e}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    return out, torch.load(out / "rank0.pt")[kind]


def _check(kind, tp_job, dense, world=2, tp=2, skip=(), reference=None):
    out, got = _job_result(tp_job, world, tp, kind)
    bf16 = kind.endswith("bf16")
    want = reference if reference is not None else dense(kind, world // tp)
    _compare(got, want, BF16 if bf16 else F64, WEIGHTS_BF16 if bf16 else WEIGHTS_F64,
             f"{kind} world {world} tp {tp}", skip)
    return out, got


@pytest.mark.parametrize("kind", [k for k in KINDS if k.startswith("sft")])
def test_sft_trainer_matches_dense_at_tp2(kind, tp_job, dense):
    _check(kind, tp_job, dense)


def test_sft_trainer_matches_dense_at_dp2_tp2(tp_job, dense):
    """Plain text, no packing: TRL's padding-free packing puts a batch's sequences in one row, where
    (without flash attention) they attend to each other, so a dense batch of 4 and two DP replicas
    of 2 differ under plain DDP too. GRPO is compared at dp = 1 for the same reason: a dense process
    samples its 4 completions from one random stream, two DP replicas from two."""
    _check("sft-plain", tp_job, dense, world=4, tp=2)


@pytest.mark.parametrize("kind", ["dpo", "dpo-bf16"])
def test_dpo_trainer_with_tp_reference_matches_dense_at_tp2(kind, tp_job, dense):
    _check(kind, tp_job, dense)


@pytest.mark.parametrize("kind", ["grpo", "grpo-bf16"])
def test_grpo_trainer_generates_identical_completions_on_tp_ranks_and_matches_dense(kind, tp_job, dense):
    """Every logged value equals the dense run's, num_tokens and the reward stds included (TRL's
    gathers run over DP only), and the float64 run's options with batch-wide statistics
    (GRPO_OPTIONS) too."""
    out, got = _check(kind, tp_job, dense)
    other = torch.load(out / "rank1.pt")[kind]
    assert got["completions"] and got["completions"] == other["completions"], "completions differ across TP ranks"
    if not kind.endswith("bf16"):
        assert got["completions"] == dense(kind)["completions"], "completions differ from the dense run's"


def test_trl_options_tpify_cannot_run_exactly_are_refused_by_name(tp_job):
    out, errors = tp_job(2, 2, KINDS)
    failed = {r: e["refusals"] for r, e in enumerate(errors) if "refusals" in e}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    messages = torch.load(out / "rank0.pt")["refusals"]["messages"]
    expected = ["use_vllm=True", "parallelized with lm_loss_chunk=16", "pass args="]
    assert len(messages) == len(expected)
    for message, pattern in zip(messages, expected):
        assert message is not None and re.search(pattern, message), (pattern, message)


def test_reward_trainer_matches_dense_at_tp2(tp_job, dense):
    """Sequence classification (the score head replicated): no vocabulary involved; the TPTrainer
    mechanism is all it needs."""
    _check("reward", tp_job, dense)


def test_grpo_trainer_at_dp2_tp2_matches_dense_ddp_with_groups_across_replicas(tp_job):
    """GRPO at dp 2 x tp 2 against TRL's GRPOTrainer on the dense model on 2 processes (plain DDP,
    spawned in the tp 2 job: a dense process samples from one random stream, so the reference of
    two DP replicas is two processes), with a group of 4 completions spread over both replicas,
    the batch-wide reward std and the entropy quantile (GRPO_OPTIONS["grpo-dp"]): every logged value
    (num_tokens, reward, reward_std, rewards/*/std, completion lengths, kl, entropy, clip ratios),
    the final weights and the completions."""
    _, want = _job_result(tp_job, 2, 2, "dense:grpo-dp")
    out, got = _check("grpo-dp", tp_job, None, world=4, tp=2, reference=want)
    assert got["completions"] and got["completions"] == want["completions"], "completions differ from dense DDP's"
    assert got["completions"] == torch.load(out / "rank1.pt")["grpo-dp"]["completions"], "differ across TP ranks"


def test_dpo_trainer_matches_dense_at_dp2_tp2(tp_job, dense):
    """DPO at dp 2 x tp 2 against TRL's DPOTrainer on the dense model with the batch of both
    replicas (DPO's losses and metrics are per-pair means): every logged value (rewards/*, logps/*,
    logits/*, entropy, mean_token_accuracy, num_tokens) within F64, the weights within lr = 1e-3.
    Adam moves each weight by about lr a step whatever the size of its gradient, so an element whose
    gradient is at the float32 noise of TRL's fused head (it computes log-probs in float32) can move
    by up to lr a step either way: measured 6-7e-4 on one embedding element of 1.5 M (row 7674),
    against one dense process and against dense DDP on 2 processes alike; every other element
    within 1e-4. A wrong log-prob moves the loss by 50%."""
    out, got = _job_result(tp_job, 4, 2, "dpo")
    _compare(got, dense("dpo", 2), F64, dict(atol=1e-3, rtol=1e-5), "dpo world 4 tp 2")


@pytest.mark.parametrize("kind", RESUMED)
def test_trl_trainer_resumed_at_tp2_continues_as_the_uninterrupted_run(kind, tp_job):
    """A float64 run at tp 2 saves checkpoint-2; a new trainer resumes from it
    (``train(resume_from_checkpoint=...)``: dense weights, the optimizer state as a
    torch.distributed.checkpoint, scheduler, generators; GRPO's adaptive entropy controller) and
    trains step 3: its logs (the 2 restored entries and step 3) and final weights equal the
    uninterrupted run's, bit for bit (the same layout runs the same operations on the same values).
    SFT's and DPO's ``num_tokens`` is left out: TRL keeps it in an attribute no checkpoint holds, so
    it restarts from 0 on resume, for the dense model too."""
    _, got = _job_result(tp_job, 2, 2, kind)
    resumed = got["resumed"]
    exact = dict(rtol=0.0, atol=0.0)
    skip = () if kind.startswith("grpo") else ("num_tokens",)
    _compare(resumed, got, exact, exact, f"{kind} resumed from checkpoint-{RESUME_AT}", skip)
    if kind.startswith("grpo"):
        assert resumed["completions"] == got["completions"][RESUME_AT:], "step 3's completions differ after resume"
