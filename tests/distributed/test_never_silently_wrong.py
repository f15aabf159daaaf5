"""What used to crash or train silently wrong now matches the dense model, or raises on every rank.

Each test is named after the behaviour it guards and asserts one check of a spawned job: one job
of 2 gloo ranks (tp = 2) and one of 4 (dp = 2 x tp = 2, expert parallelism ep = 2 included), each
running every check of its table
(``tputil.run_checks``), so a spawn is paid once per world size.

Tolerances:
* float64 checks (the MoE auxiliary loss, DP-group inference): ``atol=1e-10, rtol=1e-9``,
  the order of floating-point sums only (as tests/distributed/test_core_equivalence.py);
  weights after AdamW steps ``atol=1e-8, rtol=1e-6`` (Adam turns ~1e-16 relative gradient noise
  near eps into a few 1e-9, see test_dp_tp_training.py).
* bf16 autocast against the same autocast on the dense model: bfloat16 keeps 8 significant bits
  (a rounding is up to 2**-9 = 0.2% relative). The two sides round at other points (each rank's
  partial matmul is rounded to bf16 before the all-reduce, which adds in bf16; the dense matmul
  rounds once), so the loss differs by ~1e-5 relative (measured 2e-5 at most) and a gradient
  tensor by ~1% of its norm (measured 0.8% at most). Criteria: loss ``rtol=1e-3``; each gradient
  ``||g - g_dense|| <= 0.02 ||g_dense|| + 0.002 G`` with ``G`` the largest dense gradient norm
  of the model (the second term covers tensors whose exact gradient is ~0, such as BERT's
  attention key biases, where both sides hold rounding noise); measured: at most 0.26 of that
  bound. A missing all-reduce, a wrong shard or the crash this guards gives errors of the
  order of the gradient itself.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MixtralConfig, MixtralForCausalLM)

import tputil

F64 = dict(atol=1e-10, rtol=1e-9)
WEIGHTS = dict(atol=1e-8, rtol=1e-6)


def _gpt2(**kw):
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **kw))


def _bert():
    return BertForMaskedLM(BertConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      max_position_embeddings=32))


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _ids(seed=1, shape=(4, 16)):
    return torch.randint(0, 101, shape, generator=torch.Generator().manual_seed(seed))


def _seeded(build):
    """The same dense model on every rank (parallelize compares a sample of the weights)."""
    torch.manual_seed(0)
    return build()


def _assert_bf16_grads(par, ref, what):
    grads, dense = tputil.dense_named(par, "grad"), tputil.dense_named(ref, "grad")
    dense = {n: g for n, g in dense.items() if g is not None}
    assert dense and set(dense) <= {n for n, g in grads.items() if g is not None}, what
    largest = max(float(g.norm()) for g in dense.values())
    for name, g in dense.items():
        err, bound = float((grads[name].float() - g.float()).norm()), 0.02 * float(g.norm()) + 0.002 * largest
        assert err <= bound, f"{what}: gradient of {name} off by {err:.3g} (bound {bound:.3g})"


def _bf16_case(par, ref, what, ids=None, **call):
    ids = _ids() if ids is None else ids
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref = ref(ids, labels=ids, **call).loss
        loss_par = par(ids, labels=ids, **call).loss
    loss_ref.backward()
    loss_par.backward()
    torch.testing.assert_close(loss_par.float(), loss_ref.float(), rtol=1e-3, atol=0, msg=f"{what} loss")
    _assert_bf16_grads(par, ref, what)


# ---------------------------------------------------------------------------------------------
# tp = 2

_TP2 = {}


def _tp2(fn):
    _TP2[fn.__name__] = fn
    return fn


@_tp2
def bf16_autocast_gpt2_bert_llama(c):
    import tpify

    for build in (_gpt2, _bert, _llama):
        ref = _seeded(build)
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
        _bf16_case(par, ref, type(ref).__name__)


@_tp2
def bf16_autocast_with_lora(c):
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    ref = _seeded(_llama)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                  init_lora_weights="gaussian")
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**config))
    torch.manual_seed(1)
    par = get_peft_model(par, peft.LoraConfig(**config))
    _bf16_case(par, ref, "Llama + LoRA")


@_tp2
def bf16_autocast_with_gradient_checkpointing(c):
    import tpify

    ref = _seeded(_gpt2)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    ref.gradient_checkpointing_enable()
    par.gradient_checkpointing_enable()
    _bf16_case(par, ref, "GPT-2 + gradient checkpointing")


@_tp2
def bf16_autocast_with_sequence_parallelism(c):
    import tpify

    ref = _seeded(_llama)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2, sequence_parallel=True)
    _bf16_case(par, ref, "Llama + sequence parallelism")


def _mixtral(aux: bool):
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=aux,
        router_aux_loss_coef=0.1, experts_implementation="eager", max_position_embeddings=32)).double()


def _mixtral_recipe(terms: bool) -> dict:
    """The shipped recipe's rules as a mapping (attention by heads, tensor-parallel experts, router
    replicated), with or without the ``[loss] terms`` declaring the aux loss."""
    recipe = {"model_type": "mixtral", "divisible": ["num_attention_heads", "num_key_value_heads"],
              "loss": {"causal": ["MixtralForCausalLM"]},
              "rule": [{"match": "embed_tokens", "style": "embedding_rowwise"},
                       {"match": ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj",
                                  "layers.*.self_attn.v_proj"], "style": "colwise"},
                       {"match": "layers.*.self_attn.o_proj", "style": "rowwise"},
                       {"match": "layers.*.mlp.experts", "style": "experts",
                        "params": {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}}},
                       {"match": "layers.*.mlp.gate", "style": "replicate"},
                       {"match": "lm_head", "style": "colwise_rep"}]}
    if terms:
        recipe["loss"]["terms"] = [{"output": "aux_loss", "coefficient": "router_aux_loss_coef"}]
    return recipe


@_tp2
def moe_aux_loss_is_part_of_the_loss(c):
    """Mixtral fine-tuned as HF does (output_router_logits=True), its experts split by the shipped
    recipe: tensor-parallel (every expert's intermediate dimension split) and expert-parallel
    (ep_size = 2: whole experts per rank, tokens exchanged). The loss is CE + 0.1 x the
    load-balancing loss, the router gradients include the aux loss's; float64, every gradient
    gathered. Without output_router_logits the loss is the CE alone, as in HF.

    Collectives counted per MoE layer against the same model with its experts replicated (the
    count is the point: exactly once each way): tensor-parallel experts add one all-reduce
    forward (the partial sums) and one backward (the inputs' gradients, hidden states and routing
    weights together); expert parallelism adds none, but 5 all-to-alls (forward: the counts,
    the tokens, the results; backward: the two exchanges reversed) and 3 all-gathers (forward:
    the output rows; backward: the rows' gradients of the hidden states and of the weights)."""
    import tpify
    from tpify.authoring.reference import float64_loss_function
    from tpify.comm import count_collectives

    layers = 2
    replicated = _mixtral_recipe(terms=True)
    replicated["rule"][3] = {"match": "layers.*.mlp.experts", "style": "replicate"}
    for aux in (True, False):
        counts = {}
        for label, recipe, ep in (("replicated", replicated, 1), ("tp", "mixtral", 1), ("ep", "mixtral", 2)):
            ref = _seeded(lambda: _mixtral(aux))
            ref.loss_function = float64_loss_function("ForCausalLM")
            par = tpify.parallelize(copy.deepcopy(ref), tp_size=2, recipe=recipe, ep_size=ep)
            experts = par.model.layers[0].mlp.experts
            assert (experts.gate_up_proj.shape, experts.num_experts) == (((2, 96, 32), 2) if ep == 2 else
                                                                        ((4, 48, 32), 4) if label == "tp" else
                                                                        ((4, 96, 32), 4))
            ids = _ids(shape=(2, 12))
            out_ref = ref(ids, labels=ids)
            with count_collectives() as counted:
                out_par = par(ids, labels=ids)
                out_par.loss.backward()
            counts[label] = counted
            assert (out_ref.aux_loss is not None) == aux
            torch.testing.assert_close(out_par.loss, out_ref.loss, **F64, msg=f"aux={aux} {label}: loss")
            if aux:
                torch.testing.assert_close(out_par.aux_loss, out_ref.aux_loss, **F64, msg=f"{label}: aux loss")
            out_ref.loss.backward()
            grads, dense = tputil.dense_named(par, "grad"), tputil.dense_named(ref, "grad")
            assert any(".mlp.gate." in n for n in dense), "the router must be compared"
            for name, g in dense.items():
                torch.testing.assert_close(grads[name], g, **F64,
                                           msg=lambda m: f"aux={aux} {label}: gradient of {name}: {m}")
        base = counts["replicated"]
        assert counts["tp"]["all_reduce"] - base["all_reduce"] == 2 * layers, (counts["tp"], base)
        assert {k: v for k, v in counts["tp"].items() if not k.startswith("all_reduce")} == \
            {k: v for k, v in base.items() if not k.startswith("all_reduce")}
        assert counts["ep"]["all_reduce"] == base["all_reduce"], (counts["ep"], base)
        assert (counts["ep"]["all_to_all"], counts["ep"]["all_gather"] - base["all_gather"]) == (5 * layers, 3 * layers)


@_tp2
def moe_aux_loss_undeclared_is_refused(c):
    import tpify
    from tpify.integrations import TPUsageError

    par = tpify.parallelize(_seeded(lambda: _mixtral(True)), tp_size=2, recipe=_mixtral_recipe(terms=False))
    with pytest.raises(TPUsageError, match=r"holds \['aux_loss'\], loss terms HF adds .* terms = \[\{ output = "
                                           r"\"aux_loss\""):
        par(_ids(shape=(2, 12)), labels=_ids(shape=(2, 12)))


@_tp2
def deepcopy_of_a_parallel_model_shares_the_groups(c):
    import tpify
    from tpify.sharding import shard_spec_of

    par = tpify.parallelize(_seeded(_gpt2), tp_size=2)
    twin = copy.deepcopy(par)
    assert twin.tp_info.tp_group is par.tp_info.tp_group
    assert twin.lm_head.tp_group is par.lm_head.tp_group and twin.lm_head.weight is not par.lm_head.weight
    assert shard_spec_of(twin.lm_head.weight) == shard_spec_of(par.lm_head.weight)
    assert twin.lm_head.weight is twin.transformer.wte.weight, "ties survive the copy"
    ids = _ids()
    torch.testing.assert_close(twin(ids).logits, par(ids).logits, atol=0, rtol=0)
    torch.testing.assert_close(twin(ids, labels=ids).loss, par(ids, labels=ids).loss, atol=0, rtol=0)


@_tp2
def peft_modules_to_save_lm_head_trains_the_sharded_copy(c):
    """PEFT deep-copies the LM head (modules_to_save): the trainable copy stays vocab-sharded, the
    loss and its gradients equal dense PEFT's (float64)."""
    import peft

    import tpify
    from tpify.integrations import get_peft_model
    from tpify.authoring.reference import float64_loss_function

    ref = _seeded(_gpt2).double()
    ref.loss_function = float64_loss_function("ForCausalLM")
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    config = dict(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"], init_lora_weights="gaussian")
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**config))
    torch.manual_seed(1)
    par = get_peft_model(par, peft.LoraConfig(**config))
    ids = _ids()
    loss_ref, loss_par = ref(ids, labels=ids).loss, par(ids, labels=ids).loss
    torch.testing.assert_close(loss_par, loss_ref, **F64)
    loss_ref.backward()
    loss_par.backward()
    group = par.tp_info.tp_group
    for (name, p), (_, q) in zip(par.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            continue
        spec = tpify.sharding.shard_spec_of(p)
        got = spec.gather(p.grad, group) if spec is not None else p.grad
        torch.testing.assert_close(got, q.grad, **F64, msg=lambda m: f"{name}: {m}")


@_tp2
def trl_fused_lm_head_is_refused_even_after_remove_hooks(c):
    """TRL's fused LM head multiplies by lm_head.weight, a vocabulary shard here: refused, naming
    TRL, on every rank, also after remove_hooks (the guards stay)."""
    from trl.trainer.utils import add_fused_lm_head

    import tpify
    from tpify.integrations import TPUsageError

    par = tpify.parallelize(_seeded(_llama), tp_size=2)
    assert tpify.remove_hooks(par) > 0
    add_fused_lm_head(par)
    ids = _ids()
    with pytest.raises(TPUsageError, match="fused_lm_head=True: TRL's fused LM head .* this rank's shard of the "
                                           "vocabulary"):
        par(ids, labels=ids, fused_lm_head=True)
    assert par(ids).logits.shape[-1] == 101, "without the fused head the model still runs"


@_tp2
def different_weights_on_the_ranks_are_refused(c):
    """from_config without a common seed: each rank would hold other random weights."""
    import tpify
    from tpify import AgreementError

    torch.manual_seed(c.rank)
    with pytest.raises(AgreementError, match=r"the ranks disagree on tpify.parallelize: weights \(a sample"):
        tpify.parallelize(_llama(), tp_size=2)


@_tp2
def vocab_parallel_cross_entropy_refuses_shards_of_different_widths(c):
    import tpify

    logits = torch.randn(3, 5 + c.rank, dtype=torch.float64)
    with pytest.raises(ValueError, match="logits shards of different widths"):
        tpify.vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2]), vocab_size=10)


def _body(rank, world, checks):
    return tputil.run_checks(checks, SimpleNamespace(rank=rank, world=world))


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, 2, _TP2, timeout=300)


_ok = tputil.assert_checks_ok


def test_bf16_autocast_trains_gpt2_bert_and_llama_as_the_dense_model(tp2):
    _ok(tp2, "bf16_autocast_gpt2_bert_llama")


def test_bf16_autocast_with_lora_gradient_checkpointing_and_sequence_parallelism(tp2):
    _ok(tp2, "bf16_autocast_with_lora", "bf16_autocast_with_gradient_checkpointing",
        "bf16_autocast_with_sequence_parallelism")


def test_moe_aux_loss_is_part_of_the_labels_loss_and_of_every_gradient(tp2):
    _ok(tp2, "moe_aux_loss_is_part_of_the_loss")


def test_an_undeclared_loss_term_is_refused_not_dropped(tp2):
    _ok(tp2, "moe_aux_loss_undeclared_is_refused")


def test_deepcopy_of_a_parallelized_model_works_and_shares_the_groups(tp2):
    _ok(tp2, "deepcopy_of_a_parallel_model_shares_the_groups")


def test_peft_modules_to_save_lm_head_equals_dense_peft(tp2):
    _ok(tp2, "peft_modules_to_save_lm_head_trains_the_sharded_copy")


def test_trl_fused_lm_head_on_a_vocabulary_shard_is_refused(tp2):
    _ok(tp2, "trl_fused_lm_head_is_refused_even_after_remove_hooks")


def test_different_weights_on_the_ranks_are_refused_by_parallelize(tp2):
    _ok(tp2, "different_weights_on_the_ranks_are_refused")


def test_vocab_parallel_cross_entropy_refuses_shards_of_different_widths(tp2):
    _ok(tp2, "vocab_parallel_cross_entropy_refuses_shards_of_different_widths")


def test_every_tp2_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_TP2)] * 2


def test_a_trl_trainer_tpify_has_not_checked_is_refused_by_name():
    """TRL trainers other than SFT, DPO, GRPO and Reward may read lm_head.weight or full-vocabulary logits
    (vocabulary shards here): refused by name before anything is built (no model needed), however
    the mixin is applied; the checked ones get past the class check."""
    from trl import KTOTrainer, RLOOTrainer, SFTTrainer

    from tpify.integrations import TPTrainer, TPUsageError, tp_trainer_class

    for trainer in (KTOTrainer, RLOOTrainer):
        with pytest.raises(TPUsageError, match=f"derives from TRL's {trainer.__name__}, which tpify has not checked"):
            tp_trainer_class(trainer)(model=None)

    class Both(TPTrainer, SFTTrainer):  # the mixin reached through TPTrainer: the same mechanism
        pass

    with pytest.raises(TPUsageError, match="Both trains models parallelized by tpify"):
        Both(model=None)


# ---------------------------------------------------------------------------------------------
# dp = 2 x tp = 2

_DP2TP2 = {}


def _dp2tp2(fn):
    _DP2TP2[fn.__name__] = fn
    return fn


def _train_dp_tp(c, par, ref, steps=3, clip=0.5, sync=True):
    """``steps`` AdamW steps: the dense model on the full batch of 4 sequences, each DP replica of
    ``par`` on its half (the same number of labelled tokens in each half, so the mean of the
    halves' means is the full batch's), gradients averaged over DP and clipped by the global norm."""
    from tpify.training import clip_grad_norm_, sync_gradients

    dp_rank = c.rank // 2
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(steps):
        ids = _ids(seed=10 + step, shape=(4, 12))
        loss_ref = ref(ids, labels=ids).loss
        loss_ref.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt_ref.step()
        opt_ref.zero_grad()
        loss = par(ids[2 * dp_rank: 2 * dp_rank + 2], labels=ids[2 * dp_rank: 2 * dp_rank + 2]).loss
        loss.backward()
        if sync:
            sync_gradients(par)
        norm = clip_grad_norm_(par, clip)
        opt_par.step()
        opt_par.zero_grad()
        assert norm_ref > clip, "the test must exercise clipping"
        torch.testing.assert_close(norm, norm_ref, **F64, msg=f"gradient norm, step {step}")
    return ref


@_dp2tp2
def dp_group_is_inferred_from_tp_group(c):
    """parallelize(model, tp_group=g) on a world larger than g: the DP group is the ranks holding
    the same TP rank (it used to be None: sync_gradients did nothing and the replicas drifted)."""
    import tpify
    from tpify.training import check_replicas
    from tpify.authoring.reference import float64_loss_function

    tp_group, _ = dist.new_subgroups(2)  # [0, 1] and [2, 3]
    ref = _seeded(_gpt2).double()
    ref.loss_function = float64_loss_function("ForCausalLM")
    par = tpify.parallelize(copy.deepcopy(ref), tp_group=tp_group)
    info = par.tp_info
    assert info.dp_source == "inferred", info.dp_source
    assert dist.get_process_group_ranks(info.dp_group) == [c.rank % 2, c.rank % 2 + 2]
    _train_dp_tp(c, par, ref)
    check_replicas(par)
    for name, w in tputil.dense_named(ref).items():
        torch.testing.assert_close(tputil.dense_named(par)[name], w, **WEIGHTS, msg=lambda m: f"{name}: {m}")


@_dp2tp2
def experts_at_dp2_tp2_ep2(c):
    """Mixtral at world 4 = dp 2 x tp 2 with ep_size = 2: the expert-parallel group is the TP
    group, so ranks 0 and 2 (TP rank 0 of each replica) hold experts 0-1 whole, ranks 1 and 3
    experts 2-3, and the DP groups [0, 2], [1, 3] average the gradients of the same experts. Three
    AdamW steps with each replica on its half of the batch equal the dense model's on the whole
    batch (the clipped global norm at every step, every weight after). Aux loss off here: the
    load-balancing loss of a batch is not the mean of its halves' (checked at tp = 2 above)."""
    import tpify
    from tpify.authoring.reference import float64_loss_function
    from tpify.training import check_replicas

    ref = _seeded(lambda: _mixtral(False))
    ref.loss_function = float64_loss_function("ForCausalLM")
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2, ep_size=2)
    assert dist.get_process_group_ranks(par.tp_info.dp_group) == [c.rank % 2, c.rank % 2 + 2]
    mine = slice(2 * (c.rank % 2), 2 * (c.rank % 2) + 2)
    for layer, dense in zip(par.model.layers, ref.model.layers):
        assert torch.equal(layer.mlp.experts.gate_up_proj, dense.mlp.experts.gate_up_proj[mine])
        assert torch.equal(layer.mlp.experts.down_proj, dense.mlp.experts.down_proj[mine])
    _train_dp_tp(c, par, ref)
    check_replicas(par)
    got = tputil.dense_named(par)
    for name, w in tputil.dense_named(ref).items():
        torch.testing.assert_close(got[name], w, **WEIGHTS, msg=lambda m: f"{name}: {m}")


@_dp2tp2
def dp_group_passed_as_an_argument_is_checked(c):
    import tpify

    tp_group, _ = dist.new_subgroups(2)
    dp_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    par = tpify.parallelize(_seeded(_gpt2), tp_group=tp_group, dp_group=dp_group)
    assert par.tp_info.dp_source == "argument" and par.tp_info.dp_group is dp_group
    with pytest.raises(ValueError, match=r"dp_group and tp_group share ranks"):
        tpify.parallelize(_seeded(_gpt2), tp_group=tp_group, dp_group=tp_group)


@_dp2tp2
def bf16_autocast_at_dp2_tp2(c):
    import tpify
    from tpify.training import sync_gradients

    ref = _seeded(_llama)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    ids = _ids()
    half = ids[2 * (c.rank // 2): 2 * (c.rank // 2) + 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref = ref(ids, labels=ids).loss
        loss_par = par(half, labels=half).loss
    loss_ref.backward()
    loss_par.backward()
    sync_gradients(par)
    both = [None] * c.world
    dist.all_gather_object(both, float(loss_par))
    torch.testing.assert_close((both[0] + both[2]) / 2, float(loss_ref), rtol=1e-3, atol=0)
    _assert_bf16_grads(par, ref, "Llama dp 2 x tp 2")


@_dp2tp2
def tp_accelerator_refuses_unsupported_fsdp_options(c):
    """TPAccelerator applies FSDP2 over the DP group (tests/distributed/test_scaling_out.py); FSDP's own
    activation checkpointing and size-based wrapping are refused at construction, naming the fix."""
    from accelerate import FullyShardedDataParallelPlugin

    from tpify.integrations import TPAccelerator, TPUsageError

    tputil.torchrun_env(c.rank, c.world)
    with pytest.raises(TPUsageError, match="activation_checkpointing=True .*gradient_checkpointing_enable.*"
                                           "auto_wrap_policy 'size_based_auto_wrap_policy'"):
        TPAccelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, activation_checkpointing=True, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10))


@pytest.fixture(scope="module")
def dp2tp2():
    return tputil.spawn(_body, 4, _DP2TP2, timeout=400)


@pytest.mark.slow
def test_the_dp_group_is_inferred_when_tp_group_is_smaller_than_the_world(dp2tp2):
    _ok(dp2tp2, "dp_group_is_inferred_from_tp_group")


@pytest.mark.slow
def test_expert_parallelism_at_dp2_tp2_ep2_trains_as_the_dense_model(dp2tp2):
    _ok(dp2tp2, "experts_at_dp2_tp2_ep2")


@pytest.mark.slow
def test_a_dp_group_argument_is_used_and_checked(dp2tp2):
    _ok(dp2tp2, "dp_group_passed_as_an_argument_is_checked")


@pytest.mark.slow
def test_bf16_autocast_at_dp2_tp2_matches_the_dense_model(dp2tp2):
    _ok(dp2tp2, "bf16_autocast_at_dp2_tp2")


@pytest.mark.slow
def test_tp_accelerator_refuses_unsupported_fsdp_options(dp2tp2):
    _ok(dp2tp2, "tp_accelerator_refuses_unsupported_fsdp_options")


@pytest.mark.slow
def test_every_dp2tp2_check_ran_on_every_rank(dp2tp2):
    assert [sorted(r) for r in dp2tp2] == [sorted(_DP2TP2)] * 4
