"""KV heads replicated over groups of ranks (tp_size a multiple of num_key_value_heads) are exact.

When ``tp_size`` exceeds the KV heads, rank ``r`` holds KV head ``r // (tp / n_kv)``: the one
its query heads read in HF's ``repeat_kv`` order; the K/V weight, bias and LoRA ``B`` rows'
gradients are summed over each group of ``tp / n_kv`` ranks (docs/mechanics.md, "KV heads held
by groups of ranks"). One spawned job of 8 gloo ranks runs every check of the table
(``tputil.run_checks``), each test asserting one:

* tp = 8, 4 KV heads (groups of 2), Llama: logits, the ``labels=`` loss and every gathered
  gradient against the dense float64 model, with and without sequence parallelism; one AdamW
  step with clipping by the global norm (the norm equal to the dense one: the replicated rows
  counted once), the replicas identical after it (``check_replicas``), the weights equal to the
  dense model's; ``save_pretrained`` read back by plain transformers bitwise and by
  ``tpify.from_pretrained`` at tp = 8 (the same logits); ``copy.deepcopy`` shares the KV groups.
* tp = 4, 2 KV heads (groups of 2), Qwen2 (q/k/v biases) on a ``dp = 2 x tp = 4`` mesh: the
  replica groups made for both TP groups; each TP group against the dense model.
* LoRA on q/k/v/o at tp = 8 with 2 KV heads (groups of 4): every adapter gradient against dense
  PEFT, with and without sequence parallelism.
* Gemma 3 with ONE KV head and q/k norms (transformers' own plan, imported): exact at tp = 8
  (it was refused: "holds values for all heads").
* FSDP2 over dp 2 on tp 4 with 2 KV heads (each KV head's rows split again by FSDP2): the
  global gradient norm equal to the dense one, the replicas identical after an AdamW step, and
  its DCP checkpoint resumed at tp 8 and into FSDP2 at dp 2 x tp 4 (weights bitwise; one more
  step as the saved model's).

Tolerance ``atol=1e-10, rtol=1e-9`` in float64: both sides compute the same sums in another
order (measured: at most ~1e-16); a KV head on the wrong rank or a missing group sum gives
errors of the order of the values themselves. Gemma 3 computes its norms and rotary embedding
in float32 even in a float64 model, so it is compared normwise at ``1e-6`` of each tensor's norm
(measured: at most 5e-8 relative; float32's eps is 1.2e-7). The PlanError for a tp size that neither divides
the KV heads nor is a multiple of them is asserted in tests/unit/test_recipe.py
(``test_uncovered_modules_do_not_suggest_tp_sizes_and_too_few_kv_heads_say_so``).
"""

import copy
import pytest
import torch
import torch.distributed as dist

import tputil

pytestmark = pytest.mark.slow

F64 = tputil.F64
WEIGHTS = dict(atol=1e-8, rtol=1e-6)  # after an AdamW step (test_dp_tp_training.py says why)
VOCAB = 61


def _llama(kv, heads=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=4 * heads, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                                        max_position_embeddings=32)).double()


def _ids(seed=1, shape=(2, 16)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _dense_ref(model):
    """The float64 dense reference: HF's loss in float64, and every constant tensor of the init
    (zero K/V biases, unit norm weights) given seeded noise (tpify.authoring.reference
    ``perturb_constants``), so that a bias or a norm weight taken from the wrong KV group shows."""
    from tpify.authoring.reference import float64_loss_function, perturb_constants

    model.loss_function = float64_loss_function("ForCausalLM")
    perturb_constants(model)
    return model


_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


@_check
def tp8_four_kv_heads_llama(c):
    import tpify
    from tpify.training import check_replicas, clip_grad_norm_

    ref = _dense_ref(_llama(kv=4))
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=8)
    k_proj = par.model.layers[0].self_attn.k_proj
    assert k_proj.weight.shape[0] == 4 and k_proj.replica_group is not None  # one KV head of 4 rows per rank
    assert dist.get_process_group_ranks(k_proj.replica_group) == [c.rank // 2 * 2, c.rank // 2 * 2 + 1]
    assert par.model.layers[0].self_attn.num_key_value_groups == 1  # 1 query head per rank, 1 KV head
    tputil.assert_lm_matches_dense(par, ref, _ids(), "tp 8, 4 KV heads")
    sp = tpify.parallelize(copy.deepcopy(ref), tp_size=8, sequence_parallel=True)
    tputil.assert_lm_matches_dense(sp, ref, _ids(2), "tp 8, 4 KV heads, sequence parallel")

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    ids = _ids(3)
    ref(ids, labels=ids).loss.backward()
    par(ids, labels=ids).loss.backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    norm = clip_grad_norm_(par, 0.1)
    torch.testing.assert_close(norm, norm_ref, **F64, msg="global gradient norm")
    opt_ref.step(), opt.step()
    check_replicas(par)  # the ranks holding one KV head hold the same bytes
    trained = tputil.dense_named(par)
    for name, w in tputil.dense_named(ref).items():
        torch.testing.assert_close(trained[name], w, **WEIGHTS, msg=lambda m: f"{name}: {m}")

    from transformers import LlamaForCausalLM

    par.save_pretrained(c.tmp / "llama-kv4")  # collective: one copy of each KV head written
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(c.tmp / "llama-kv4", dtype=torch.float64)
    got = dict(loaded.named_parameters())
    for name, w in trained.items():
        assert torch.equal(got[name], w), f"saved {name} differs from the parallel model's"
    again = tpify.from_pretrained(c.tmp / "llama-kv4", tp_size=8, dtype=torch.float64)  # each rank its head
    copied = copy.deepcopy(par)  # shares the groups, the KV replica groups included
    ids = _ids(6)
    with torch.no_grad():
        want = par(ids).logits
        torch.testing.assert_close(again(ids).logits, want, atol=0, rtol=0, msg="from_pretrained of the save")
        torch.testing.assert_close(copied(ids).logits, want, atol=0, rtol=0, msg="deepcopy")
    assert copied.model.layers[0].self_attn.k_proj.replica_group is k_proj.replica_group


@_check
def tp4_two_kv_heads_qwen2_on_a_dp2_mesh(c):
    import tpify
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    ref = _dense_ref(Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                  num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                                                  max_position_embeddings=32)).double())
    mesh = tpify.init_mesh(4)  # 2 TP groups of 4: [0..3], [4..7]
    par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
    k_proj = par.model.layers[0].self_attn.k_proj
    start = c.rank // 2 * 2
    assert dist.get_process_group_ranks(k_proj.replica_group) == [start, start + 1]
    assert k_proj.bias.shape == (4,)  # the bias rows of this rank's KV head (head_dim 4)
    tputil.assert_lm_matches_dense(par, ref, _ids(), "tp 4 x dp 2, 2 KV heads")


@_check
def lora_on_kv_held_by_groups_of_four(c):
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    dense_base = _dense_ref(_llama(kv=2))
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                  init_lora_weights="gaussian")
    for sequence_parallel in (False, True):
        torch.manual_seed(1)
        dense = peft.get_peft_model(copy.deepcopy(dense_base), peft.LoraConfig(**config))
        par = tpify.parallelize(copy.deepcopy(dense_base), tp_size=8, sequence_parallel=sequence_parallel)
        torch.manual_seed(1)
        lora = get_peft_model(par, peft.LoraConfig(**config))
        ids = _ids(4)
        loss_ref = dense(ids, labels=ids).loss
        loss_ref.backward()
        loss = lora(ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, **F64, msg=f"LoRA loss (sp={sequence_parallel})")
        want = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
        got = tputil.dense_named(lora, "grad")
        assert any("k_proj.lora_B" in n for n in want)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, **F64,
                                       msg=lambda m: f"LoRA grad {name} (sp={sequence_parallel}): {m}")


@_check
def gemma3_one_kv_head_with_qk_norms(c):
    import warnings

    import tpify
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    ref = _dense_ref(Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=32, sliding_window=8)).double())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice that transformers' plan is imported
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=8)
    assert par.model.layers[0].self_attn.k_proj.weight.shape[0] == 4  # the one KV head, on every rank
    # Gemma 3's RMSNorm and rotary embedding compute in float32 (x.float()) in a float64 model: a
    # difference of one float64 ulp in the order of a sum can flip a float32 rounding (measured
    # 5e-8 relative at most), so each tensor is compared normwise at 1e-6; a KV head on the wrong
    # rank or a missing group sum is wrong by the order of the gradient itself.
    tputil.assert_lm_matches_dense(par, ref, _ids(5), "gemma3, 1 KV head, q/k norms, tp 8", normwise=1e-6)


@_check
def fsdp2_on_dp2_tp4_with_kv_groups(c):
    """FSDP2 over dp 2 on tp 4 with 2 KV heads (each held by 2 ranks, its rows split again by
    FSDP2): the global gradient norm equals the dense one (each KV head counted once), the
    replicas stay identical after an AdamW step, and a DCP checkpoint of it (AdamW state
    included) resumed at tp 8 (groups of 4) and into FSDP2 at dp 2 x tp 4 holds the same dense
    weights and the next step gives the same weights."""
    import tpify
    from tpify.checkpoint import load_checkpoint, save_checkpoint
    from tpify.training import check_replicas, clip_grad_norm_

    ref = _dense_ref(_llama(kv=2))
    par = tpify.shard_data_parallel(tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(4)))
    ids = _ids(7, shape=(4, 16))
    ref(ids, labels=ids).loss.backward()
    rows = slice(c.rank // 4 * 2, c.rank // 4 * 2 + 2)  # this DP rank's half of the batch
    par(ids[rows], labels=ids[rows]).loss.backward()
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(clip_grad_norm_(par, 0.1), norm_ref, **F64, msg="FSDP2 x KV groups: gradient norm")
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    opt.step()
    check_replicas(par)
    saved = tpify.dense_state_dict(par)
    save_checkpoint(c.tmp / "fsdp-kv", par, [opt])
    opt.zero_grad()
    par(ids[rows], labels=ids[rows]).loss.backward()
    opt.step()
    after = tpify.dense_state_dict(par)
    for tp, fsdp in ((8, False), (4, True)):
        torch.manual_seed(5)
        other = tpify.parallelize(_llama(kv=2), mesh=tpify.init_mesh(tp) if fsdp else None,
                                  tp_size=None if fsdp else tp)
        if fsdp:
            tpify.shard_data_parallel(other)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        load_checkpoint(c.tmp / "fsdp-kv", other, [other_opt])
        got = tpify.dense_state_dict(other)
        for name, w in saved.items():
            torch.testing.assert_close(got[name], w, atol=0, rtol=0, msg=lambda m: f"tp {tp}: {name}: {m}")
        mine = ids[rows] if fsdp else ids  # tp 8: the whole batch, whose mean FSDP2's DP average equals
        other(mine, labels=mine).loss.backward()
        other_opt.step()
        got = tpify.dense_state_dict(other)
        for name, w in after.items():
            torch.testing.assert_close(got[name], w, **WEIGHTS, msg=lambda m: f"tp {tp}, one step on: {name}: {m}")


@pytest.fixture(scope="module")
def tp8(tmp_path_factory):
    return tputil.spawn(tputil.checks_body, 8, _CHECKS, str(tmp_path_factory.mktemp("kv")), timeout=400)


def test_tp8_with_four_kv_heads_is_exact_with_sp_clipping_replicas_and_hf_save(tp8):
    tputil.assert_checks_ok(tp8, "tp8_four_kv_heads_llama")


def test_tp4_with_two_kv_heads_is_exact_on_each_tp_group_of_a_dp2_mesh(tp8):
    tputil.assert_checks_ok(tp8, "tp4_two_kv_heads_qwen2_on_a_dp2_mesh")


def test_lora_on_kv_heads_held_by_groups_is_exact_with_and_without_sp(tp8):
    tputil.assert_checks_ok(tp8, "lora_on_kv_held_by_groups_of_four")


def test_one_kv_head_with_qk_norms_is_accepted_and_exact(tp8):
    tputil.assert_checks_ok(tp8, "gemma3_one_kv_head_with_qk_norms")


def test_fsdp2_with_kv_groups_has_the_dense_norm_and_its_dcp_checkpoint_resumes_at_tp8_and_fsdp2(tp8):
    tputil.assert_checks_ok(tp8, "fsdp2_on_dp2_tp4_with_kv_groups")
