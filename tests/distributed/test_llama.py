"""Parallelized Llama (grouped-query attention) equals the dense model; packed GQA splits by part.

Reference: the dense model built from one seed on every rank, in float64, deep-copied before
``parallelize``. Tolerance ``atol=1e-10, rtol=1e-9``: in float64 the only difference between the
two computations is the order of floating-point sums (partial matmuls summed by the all-reduce),
a few ulps (~1e-16 relative); 1e-9 leaves room for accumulation over 2 layers while catching
any real error (a wrong KV-head shard or a missing gradient all-reduce gives errors >= 1e-3).
"""

import pytest
import copy

import torch
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForQuestionAnswering,
                          LlamaForSequenceClassification, LlamaForTokenClassification, LlamaModel)

import tputil
from tpify.authoring.reference import perturb_constants

TOL = dict(atol=1e-10, rtol=1e-9)


def llama_config(tie: bool, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=48, vocab_size=101,
                       max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def _causal_lm_body(rank, world):
    import tpify

    g = torch.Generator().manual_seed(1)
    ids = tputil.to_device(torch.randint(3, 101, (2, 12), generator=g))  # TPIFY_TEST_DEVICE=cuda: the GPU
    labels = ids.clone()
    labels[0, :3] = -100
    for tie in (True, False):
        config = llama_config(tie)
        torch.manual_seed(0)
        ref = tputil.to_device(LlamaForCausalLM(config).double())
        perturb_constants(ref)  # zero biases, unit norms: seeded noise
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=world)
        emb, head = par.model.embed_tokens.weight, par.lm_head.weight
        assert (emb is head) == tie, f"tie_word_embeddings={tie} but tied={emb is head}"
        # Every rank holds n/p query heads and n_kv/p KV heads of the 4/2 split.
        attn = par.model.layers[0].self_attn
        assert attn.q_proj.weight.shape[0] == 4 // world * attn.head_dim
        assert attn.k_proj.weight.shape[0] == 2 // world * attn.head_dim
        # Without labels the logits are gathered (full vocabulary); with labels the loss is the
        # vocab-parallel one, compared with HF's semantics in float64 (tputil.ref_lm_loss).
        out_ref, out_par = ref(ids), par(ids)
        torch.testing.assert_close(out_par.logits, out_ref.logits, **TOL)
        assert out_par.logits.shape[-1] == config.vocab_size
        loss_ref = tputil.ref_lm_loss(out_ref.logits, labels, causal=True)
        loss_par = par(ids, labels=labels).loss
        torch.testing.assert_close(loss_par, loss_ref, **TOL)
        loss_ref.backward()
        loss_par.backward()
        ref_grads, par_grads = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
        assert ref_grads.keys() == par_grads.keys()
        for name, grad in ref_grads.items():
            assert par_grads[name] is not None, f"{name} got no gradient"
            torch.testing.assert_close(par_grads[name], grad, **TOL, msg=lambda m: f"tie={tie} grad {name}: {m}")
        # Greedy generation with the KV cache gives the same tokens.
        ref.eval(), par.eval()
        prompt = ids[:, :5]
        kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        with torch.no_grad():
            gen_ref, gen_par = ref.generate(prompt, **kw), par.generate(prompt, **kw)
        assert torch.equal(gen_ref, gen_par), f"tie={tie}: {gen_ref.tolist()} != {gen_par.tolist()}"
    # Every head class of the family parallelizes with the same recipe.
    config = llama_config(False)
    for cls in (LlamaModel, LlamaForSequenceClassification, LlamaForTokenClassification, LlamaForQuestionAnswering):
        torch.manual_seed(0)
        ref = tputil.to_device(cls(config).double().eval())
        perturb_constants(ref)  # zero biases, unit norms: seeded noise
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=world)
        a, b = ref(ids), par(ids)
        key = next(k for k in ("last_hidden_state", "logits", "start_logits") if k in a)
        torch.testing.assert_close(b[key], a[key], **TOL, msg=lambda m: f"{cls.__name__}: {m}")
    return True


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_llama_gqa_equivalence_tp2():
    """LlamaForCausalLM (tied and untied, 4 heads / 2 KV heads) at tp=2: logits, loss, every
    gradient and greedy generate() equal dense; the head classes too."""
    assert tputil.spawn(_causal_lm_body, 2) == [True, True]


def _bad_kv_body(rank, world):
    import tpify

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(True, heads=6, kv_heads=3, hidden=48))
    tpify.parallelize(model, tp_size=world)


@pytest.mark.slow
def test_llama_kv_heads_not_divisible():
    """6 query heads divide by tp=2; 3 KV heads neither divide by 2 nor divide 2 (tp 6 would hold
    each KV head on 2 ranks): PlanError on every rank, no hang, naming the sizes that work."""
    outcomes = tputil.spawn(_bad_kv_body, 2, expect_errors=True)
    for status, message in outcomes:
        assert status == "error", outcomes
        assert message.startswith("PlanError"), message
        assert "3 KV heads at tp_size = 2: tp_size must divide the KV heads" in message
        assert "2 is neither" in message
        assert "tp sizes that would work for this model: [1, 3, 6]" in message


class PackedGQA(nn.Module):
    """A fused [Q | K | V] projection with grouped-query widths (n heads, n_kv, n_kv)."""

    def __init__(self, heads=4, kv_heads=2, head_dim=3, hidden=8):
        super().__init__()
        self.config = type("Config", (), dict(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                              model_type="packed_gqa"))()
        self.head_dim = head_dim
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim)

    def forward(self, x):
        return self.qkv_proj(x)


PACKED_RECIPE = {"model_type": "packed_gqa", "divisible": ["num_attention_heads", "num_key_value_heads"],
                 "rule": [{"match": "qkv_proj", "style": "packed_colwise",
                           "parts": ["num_attention_heads", "num_key_value_heads", "num_key_value_heads"]}]}


def _packed_body(rank, world):
    import tpify
    from tpify.sharding import shard_spec_of

    torch.manual_seed(0)
    ref = tputil.to_device(PackedGQA().double())
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=world, recipe=PACKED_RECIPE)
    w_ref, layer = ref.qkv_proj.weight, par.qkv_proj
    spec = shard_spec_of(layer.weight)
    hd = ref.head_dim
    assert spec.parts == (4 * hd, 2 * hd, 2 * hd), spec
    # Rank r holds query heads 2r, 2r+1 and KV head r of K and of V: [Q_r | K_r | V_r].
    q, k, v = w_ref[:4 * hd], w_ref[4 * hd:6 * hd], w_ref[6 * hd:]
    expected = torch.cat([q[2 * rank * hd:(2 * rank + 2) * hd], k[rank * hd:(rank + 1) * hd],
                          v[rank * hd:(rank + 1) * hd]])
    assert torch.equal(layer.weight.detach(), expected)
    assert torch.equal(spec.slice_dense(w_ref.detach(), rank), expected)
    assert torch.equal(spec.gather(layer.weight.detach(), layer.tp_group), w_ref.detach()), "gather must unpack"
    assert torch.equal(shard_spec_of(layer.bias).gather(layer.bias.detach(), layer.tp_group), ref.qkv_proj.bias)
    # The local output is this rank's [Q_r | K_r | V_r] columns of the dense output.
    x = tputil.to_device(torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    dense = ref(x)
    local = torch.cat([dense[..., a:b] for a, b in spec.ranges(rank)], dim=-1)
    torch.testing.assert_close(par(x), local, **TOL)
    return True


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_packed_colwise_grouped_query_parts():
    """packed_colwise with parts [n_heads, n_kv, n_kv] splits each part by its own head count,
    and ShardSpec.gather restores the dense packed weight exactly (bitwise)."""
    assert tputil.spawn(_packed_body, 2) == [True, True]
