"""Sequence parallelism with mixture-of-experts blocks, KV heads held by groups of ranks in phi3 and
the MoE recipes, DCP checkpoints and FSDP2's gradient norm with KV groups: exact against dense.

One spawned job of 4 gloo ranks runs every check of the table (``tputil.run_checks``), each test
asserting one:

* sequence parallelism with fused experts (mixtral, qwen3_moe), tensor-parallel experts and
  expert parallelism (``ep_size = tp``), at tp = 4 (2 KV heads: each held by 2 ranks) and at
  tp = 2 (each TP group of a ``dp = 2 x tp = 2`` mesh): logits, the ``labels=`` loss with the
  router's load-balancing loss (``output_router_logits=True``), the aux loss itself and every
  gathered gradient, the router's included, against the dense float64 model (every dense model
  here with the tensors its init leaves constant, norm weights and biases, perturbed as ``tpify
  verify`` does: :func:`_dense_ref`); the collectives
  of one MoE layer counted against sequence parallelism's own budget; Mixtral at tp = 2 again
  with gradient checkpointing (the block's hooks run again in the recomputation);
* refused, naming the module: a shared expert beside the experts (qwen2_moe), a module with
  parameters beside the router, Mixtral's router jitter noise in training;
* KV heads held by groups of ranks (tp = 4, 2 KV heads) in phi3 (fused ``qkv_proj``: the K/V
  parts replicated parts, ``num_key_value_heads`` 1 per rank), qwen2_moe, mixtral and qwen3_moe:
  logits, loss (with the aux loss), every gradient;
* a DCP checkpoint of Llama and of phi3 at tp = 4 with 2 KV heads (each on 2 ranks: the
  dense-order fallback), with its AdamW state and schedule, resumed at tp = 4, 2 (dp 2), 1 (dp 4)
  and into FSDP2 at dp 2 x tp 2: two more steps equal the uninterrupted dense run;
* FSDP2 (dp 2) on tp = 2 with ONE KV head (multi-query: the K/V rows replicated on both TP ranks
  and split by FSDP2): the global gradient norm equals the dense one, the replicas stay
  identical (the grouped case at dp 2 x tp 4 is in tests/distributed/test_kv_groups.py, whose
  job has 8 ranks).

Tolerance ``atol=1e-10, rtol=1e-9`` in float64: both sides compute the same sums in another order
(measured: at most 8.9e-16 for mixtral, qwen2_moe and phi3); a router gradient counted ``tp``
times, a router input gradient counted ``tp`` times, a KV head on the wrong rank or a missing
group sum is wrong by the order of the values themselves (measured with the router's mask or its
exemption from the norms' gradient sum removed: 2e-2 and 3e-2). Qwen MoE families compute their
norms in float32 inside the float64 model: compared normwise (:func:`_normwise` says why). After
AdamW steps ``atol=1e-8, rtol=1e-6`` (tests/distributed/test_dp_tp_training.py says why).
Marker: slow (one spawned job, about 35 s on the shared 2-core machine).
"""

import copy

import pytest
import torch
import torch.distributed as dist

import tputil

pytestmark = pytest.mark.slow

F64 = tputil.F64
VOCAB = 61


def _ids(seed=1, shape=(2, 16)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _moe(kind: str, aux: bool = True):
    """A small float64 MoE causal LM: 8 query heads, 2 KV heads, 4 experts (top 2), eager experts
    (transformers' grouped-mm kernel refuses float64)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=32, output_router_logits=aux, router_aux_loss_coef=0.1,
                  experts_implementation="eager")
    torch.manual_seed(0)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4,
                                                       num_experts_per_tok=2, **common))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=48,
                                                         num_experts=4, num_experts_per_tok=2, head_dim=4,
                                                         mlp_only_layers=[1], **common))
    elif kind == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=24, intermediate_size=48,
                                                         shared_expert_intermediate_size=48, num_experts=4,
                                                         num_experts_per_tok=2, **common))
    else:
        raise ValueError(kind)
    return _dense_ref(model.double())


def _phi3(kv=2, seed=0):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    return _dense_ref(Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=kv,
                                                 max_position_embeddings=32, pad_token_id=0)).double(), seed)


def _dense_ref(model, seed: int = 0):
    """``model`` with its loss in float64 and every tensor its init leaves constant (norm weights
    of ones; qwen2_moe's q/k/v biases, zero) given seeded noise as ``tpify verify`` does
    (tpify.authoring.reference.perturb_constants): with ones and zeros a bias or norm weight held
    by the wrong ranks would compute the dense result."""
    from tpify.authoring.reference import float64_loss_function, perturb_constants

    model.loss_function = float64_loss_function("ForCausalLM")
    perturb_constants(model, seed)
    return model


def _normwise(kind: str) -> float | None:
    """Qwen MoE families normalise in float32 inside a float64 model (their RMSNorms, the q/k norms
    of every head) and cast the router's float32 routing weights back: a float64 sum taken in
    another order can flip a float32 rounding, so they are compared normwise at 1e-6 of each
    tensor's norm (measured: 1.3e-7 at tp = 4, the same with and without sequence parallelism and
    with replicated experts; float32's eps is 1.2e-7). A router gradient counted tp times is off
    by the order of the gradient itself."""
    return 1e-6 if kind.startswith("qwen") else None


_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _sp_experts(c, tp):
    import tpify

    mesh = tpify.init_mesh(tp) if tp < c.world else None
    for kind in ("mixtral", "qwen3_moe"):
        for ep in (1, tp):
            ref = _moe(kind)
            par = tpify.parallelize(copy.deepcopy(ref), tp_size=None if mesh else tp, mesh=mesh,
                                    sequence_parallel=True, ep_size=ep)
            assert par.tp_info.layout.sequence_parallel["moe_blocks"], "the MoE blocks are gathered"
            assert any(".mlp.gate." in n for n, _ in ref.named_parameters())
            tputil.assert_lm_matches_dense(par, ref, _ids(2 + ep), f"{kind} tp {tp} ep {ep} sequence parallel",
                                           aux=True, normwise=_normwise(kind))
            if kind == "mixtral":
                _assert_counts(par, ep > 1, kv_sums=tp > 2)


def _assert_counts(par, expert_parallel: bool, kv_sums: bool):
    """The collectives of one step of the sequence-parallel Mixtral (L = 2 layers, B x T = 2 x 16
    tokens, H = 32, top k = 2), each counted. Per MoE block, tensor-parallel experts: forward one
    all-gather (the block's input) and one reduce-scatter (its partial output), as a dense MLP
    under sequence parallelism; backward their reverses and one all-reduce of the routing
    weights' gradient (B T k values); the router's weight gradient is NOT all-reduced (complete on
    every rank: it saw every token). Expert parallelism: the block's output split (no
    reduce-scatter), its gather's backward a split (no reduce-scatter), the exchange's own
    all-to-alls and row all-gathers. Besides: per layer the attention's all-gather and
    reduce-scatter, the first split's and the exit's all-gather, the embedding's all-reduce and the
    loss's 3 forward; backward the LM head's all-reduce, one of every norm of the split stretch
    together (2 L + 1 norms, H values each: tpify.grad_sums), per layer the attention's input
    tokens all-gathered again for q/k/v's weight gradients (they save this rank's tokens), and
    with KV heads held by groups of ranks (tp 4, 2 KV heads) one per K and V weight (a KV head's
    rows, head_dim x H values)."""
    from tpify.comm import count_collectives

    layers, tokens, hidden, k = 2, 2 * 16, 32, 2
    kv = 2 * layers if kv_sums else 0  # k_proj, v_proj: 4 x 32 values each
    ids = _ids(9)
    with count_collectives() as fwd:
        loss = par(ids, labels=ids).loss
    with count_collectives() as bwd:
        loss.backward()
    par.zero_grad()
    if expert_parallel:
        assert (fwd["all_gather"], fwd["reduce_scatter"], fwd["all_reduce"]) == (3 * layers + 1, layers, 4), fwd
        assert (bwd["all_gather"], bwd["reduce_scatter"], bwd["all_reduce"]) == (
            2 * layers + 1 + 2 * layers + layers, layers, 1 + 1 + kv), bwd
        return
    assert (fwd["all_gather"], fwd["reduce_scatter"], fwd["all_reduce"]) == (2 * layers + 1, 2 * layers, 4), fwd
    assert (bwd["all_gather"], bwd["reduce_scatter"], bwd["all_reduce"]) == (
        2 * layers + 1 + layers, 2 * layers, 1 + layers + 1 + kv), bwd
    assert bwd["all_reduce_numel"] == (tokens * hidden + layers * tokens * k + (2 * layers + 1) * hidden
                                       + kv * 4 * hidden), bwd


@_check
def sp_experts_tp4(c):
    _sp_experts(c, 4)


@_check
def sp_experts_tp2_on_dp2_mesh(c):
    """Also with activation recomputation (transformers' gradient checkpointing: each decoder
    layer, its MoE block's gather and the router's mask included, runs again in backward)."""
    import tpify

    _sp_experts(c, 2)
    for ep in (1, 2):
        ref = _moe("mixtral").train()
        par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(2), sequence_parallel=True, ep_size=ep)
        par.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tputil.assert_lm_matches_dense(par.train(), ref, _ids(8), f"mixtral tp 2 ep {ep}, sequence parallel, "
                                       f"gradient checkpointing", aux=True)


@_check
def sp_refused_where_it_would_be_wrong(c):
    """qwen2_moe's shared expert (column/row-parallel layers beside the experts, whose output would
    join the experts' partial sum once per rank), a module with parameters beside the router (a
    norm before the experts would get a partial gradient from them) and Mixtral's router jitter
    noise in training (each rank would draw other noise for the same tokens) are refused, naming
    the module."""
    import dataclasses

    import tpify
    from tpify.recipe import load_recipe

    recipe = load_recipe("qwen2_moe")
    table = {"split": "layers.0", "gather": ["layers.*.self_attn", "layers.*.mlp"], "exit": "norm"}
    recipe = dataclasses.replace(recipe, sequence_parallel=table)
    with pytest.raises(tpify.PlanError, match=r"MoE block model.layers.0.mlp holds column/row-parallel layers"):
        tpify.parallelize(_moe("qwen2_moe"), tp_size=4, recipe=recipe, sequence_parallel=True)
    stranger = _moe("mixtral")
    stranger.model.layers[1].mlp.pre_norm = torch.nn.LayerNorm(32, dtype=torch.float64)  # a norm beside the router
    with pytest.raises(tpify.PlanError, match=r"MoE block model.layers.1.mlp holds \['model.layers.1.mlp.pre_norm'\]"):
        tpify.parallelize(stranger, tp_size=4, sequence_parallel=True)
    ref = _moe("mixtral")
    ref.config.router_jitter_noise = 0.1
    for layer in ref.model.layers:
        layer.mlp.jitter_noise = 0.1
    par = tpify.parallelize(ref, tp_size=4, sequence_parallel=True).train()
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock draws router jitter noise"):
        par(_ids(), labels=_ids())


@_check
def kv_groups_phi3_and_moe_tp4(c):
    import tpify

    for label in ("phi3", "qwen2_moe", "mixtral", "qwen3_moe"):
        ref = _phi3() if label == "phi3" else _moe(label)
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=4)
        attn = par.model.layers[0].self_attn
        if label == "phi3":
            assert attn.qkv_proj.weight.shape[0] == (2 + 1 + 1) * 4  # [Q_r | K_h | V_h], head_dim 4
            assert attn.num_key_value_heads == 1
        else:
            assert attn.k_proj.weight.shape[0] == 4 and attn.k_proj.replica_group is not None
        assert attn.num_key_value_groups == 2  # 2 query heads per rank, one KV head
        tputil.assert_lm_matches_dense(par, ref, _ids(5), f"{label} tp 4, 2 KV heads", aux=label != "phi3",
                                       normwise=_normwise(label))


# ------------------------------------------------------------------------------------------------
# DCP checkpoints and FSDP2's gradient norm with KV heads held by groups of ranks.

BATCH, SEQ, BEFORE, AFTER = 4, 8, 2, 2
TOL = dict(atol=1e-8, rtol=1e-6)  # after AdamW steps (tests/distributed/test_dp_tp_training.py says why)


def _kv_dense(kind: str, kv: int = 2, seed: int = 0):
    if kind == "phi3":
        return _phi3(kv, seed)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return _dense_ref(LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                   num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=kv,
                                                   max_position_embeddings=32)).double(), seed)


def _batch(step):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.25, total_iters=BEFORE + AFTER)


def _steps(model, opt, sched, steps, dense=False):
    """AdamW steps with clipping by the global norm (0.5: below the norms, so clipping acts), the
    batch split over the DP ranks (tensor-parallel models)."""
    from tpify.sharding import is_dtensor
    from tpify.training import clip_grad_norm_, sync_gradients

    if dense:
        dp, dp_rank = 1, 0
    else:
        import tpify

        info = tpify.get_tp_info(model)
        dp = dist.get_world_size(info.dp_group) if info.dp_group is not None else 1
        dp_rank = dist.get_rank(info.dp_group) if info.dp_group is not None else 0
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for step in steps:
        ids = _batch(step)[rows]
        model(ids, labels=ids).loss.backward()
        if dense:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            if not any(is_dtensor(p) for p in model.parameters()):  # FSDP2 reduces over DP itself
                sync_gradients(model)
            norm = clip_grad_norm_(model, 0.5)
        assert norm > 0.5, "the test must exercise clipping"
        opt.step()
        sched.step()
        opt.zero_grad()


def _assert_dense_equal(got: dict, want: dict, what: str):
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=lambda m: f"{what}: {key}: {m}")


def _resume(kind, path, tp, fsdp=False):
    import tpify
    from tpify.checkpoint import load_checkpoint

    model = tpify.parallelize(_kv_dense(kind, seed=7), tp_size=tp)
    if fsdp:
        tpify.shard_data_parallel(model)
    opt, sched = _optim(model)
    load_checkpoint(path, model, [opt], [sched])
    _steps(model, opt, sched, range(BEFORE, BEFORE + AFTER))
    return tpify.dense_state_dict(model)


@_check
def dcp_kv_groups_resume_at_other_layouts(c):
    """Llama (k_proj / v_proj: one part, each KV head on 2 ranks) and phi3 (qkv_proj: the K/V
    packed parts replicated over groups) at tp = 4 with 2 KV heads: saved after 2 steps (DCP's
    dense-order fallback for the grouped parts), resumed at tp 4, tp 2 (dp 2 inferred), tp 1
    (dp 4) and into FSDP2 at dp 2 x tp 2, each from a model of another seed; 2 more steps equal
    the uninterrupted dense run (4 steps, one process), and the uninterrupted tp 4 run too."""
    import tpify
    from tpify.checkpoint import save_checkpoint

    for kind in ("llama", "phi3"):
        ref = _kv_dense(kind)
        opt, sched = _optim(ref)
        _steps(ref, opt, sched, range(BEFORE + AFTER), dense=True)
        want = {k: v.detach() for k, v in ref.state_dict().items()}
        model = tpify.parallelize(_kv_dense(kind), tp_size=4)
        opt, sched = _optim(model)
        _steps(model, opt, sched, range(BEFORE))
        path = f"{c.tmp}/ckpt-{kind}"
        save_checkpoint(path, model, [opt], [sched])
        _steps(model, opt, sched, range(BEFORE, BEFORE + AFTER))
        _assert_dense_equal(tpify.dense_state_dict(model), want, f"{kind}: uninterrupted tp 4")
        for tp, fsdp in ((4, False), (2, False), (1, False), (2, True)):
            _assert_dense_equal(_resume(kind, path, tp, fsdp), want, f"{kind}: resumed at tp {tp} (fsdp={fsdp})")


@_check
def fsdp2_grad_norm_counts_replicated_parts_once(c):
    """FSDP2 (dp 2) on tp 2 with ONE KV head (multi-query: the K/V rows, or qkv_proj's K/V parts,
    whole on both TP ranks, their rows split by FSDP2 over DP): the global gradient norm equals
    the dense model's on the whole batch, clipping gives the dense gradients, and the replicas
    stay identical after an AdamW step (``check_replicas``)."""
    import tpify
    from tpify.training import check_replicas, clip_grad_norm_

    for kind in ("llama", "phi3"):
        ref = _kv_dense(kind, kv=1)
        model = tpify.shard_data_parallel(tpify.parallelize(copy.deepcopy(ref), tp_size=2))
        ids = _batch(0)
        ref(ids, labels=ids).loss.backward()
        rows = slice(c.rank // 2 * 2, c.rank // 2 * 2 + 2)  # this DP rank's half of the batch
        model(ids[rows], labels=ids[rows]).loss.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        norm = clip_grad_norm_(model, 0.1)
        torch.testing.assert_close(norm, norm_ref, **F64, msg=f"{kind}: FSDP2 global gradient norm")
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        check_replicas(model)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    return tputil.spawn(tputil.checks_body, 4, _CHECKS, str(tmp_path_factory.mktemp("moesp")), timeout=400)


def test_sequence_parallel_experts_at_tp4_are_exact_with_aux_loss_tp_and_ep(tp4):
    tputil.assert_checks_ok(tp4, "sp_experts_tp4")


def test_sequence_parallel_experts_at_tp2_are_exact_on_each_tp_group_of_a_dp2_mesh_and_recomputed(tp4):
    tputil.assert_checks_ok(tp4, "sp_experts_tp2_on_dp2_mesh")


def test_kv_heads_held_by_groups_in_phi3_and_moe_recipes_are_exact_at_tp4(tp4):
    tputil.assert_checks_ok(tp4, "kv_groups_phi3_and_moe_tp4")


def test_dcp_checkpoint_with_kv_groups_resumes_at_tp4_tp2_tp1_and_fsdp2_as_the_uninterrupted_run(tp4):
    tputil.assert_checks_ok(tp4, "dcp_kv_groups_resume_at_other_layouts")


def test_fsdp2_gradient_norm_counts_replicated_kv_parts_once(tp4):
    tputil.assert_checks_ok(tp4, "fsdp2_grad_norm_counts_replicated_parts_once")


def test_sequence_parallelism_is_refused_with_a_shared_expert_and_with_router_jitter(tp4):
    tputil.assert_checks_ok(tp4, "sp_refused_where_it_would_be_wrong")
