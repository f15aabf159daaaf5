"""Recipe features on small random models, float64, against the dense model at tp = 2 (tp = 4 slow).

* phi with ``qk_layernorm=True``: the per-head q/k LayerNorms run inside the sharded region;
  tpify finds them by construction and all-reduces their gradients (without it their gradients
  were wrong by up to 0.057); ``qk_layernorm=False`` too.
* phi3: packed ``qkv_proj`` (GQA parts) and ``gate_up_proj``; ``config.num_attention_heads`` is
  read at forward time, so the recipe divides it per rank (``divide_config``); a save writes it
  back dense.
* roberta: ``classifier`` is a container in ``RobertaForSequenceClassification`` and an
  ``nn.Linear`` in ``RobertaForTokenClassification``; one ``replicate`` rule covers both. The
  MLM head's loss kind comes from the recipe's ``[loss]`` table.

Each case compares logits (with a padding mask where the model takes one), the ``labels=`` loss,
every gathered gradient and greedy ``generate`` (causal LMs). Tolerance ``atol=1e-10,
rtol=1e-9`` (float64: only the order of the sums differs, ~1e-16 relative; a wrong shard or a
missing gradient all-reduce gives errors >= 1e-3).
"""

import copy
import json

import pytest
import torch
from transformers import (PhiConfig, PhiForCausalLM, Phi3Config, Phi3ForCausalLM, RobertaConfig,
                          RobertaForMaskedLM, RobertaForSequenceClassification, RobertaForTokenClassification)

import tputil

TOL = dict(atol=1e-10, rtol=1e-9)


def _phi(qk):
    return PhiConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                     vocab_size=101, max_position_embeddings=64, qk_layernorm=qk, resid_pdrop=0.0,
                     embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _phi3(world=2):
    kv = 2 if world == 2 else 4  # grouped-query at tp = 2; tp = 4 needs 4 KV heads
    return Phi3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv,
                      intermediate_size=48, vocab_size=101, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


def _roberta():
    return RobertaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                         vocab_size=99, max_position_embeddings=40, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, num_labels=3)


CASES = {
    "phi qk_layernorm": (PhiForCausalLM, lambda: _phi(True)),
    "phi": (PhiForCausalLM, lambda: _phi(False)),
    "phi3": (Phi3ForCausalLM, _phi3),  # called with the world size
    "roberta mlm": (RobertaForMaskedLM, _roberta),
    "roberta seq-cls": (RobertaForSequenceClassification, _roberta),
    "roberta tok-cls": (RobertaForTokenClassification, _roberta),
}


def _check(name, cls, config, world, tmp):
    import tpify

    torch.manual_seed(0)
    ref = cls(config).double()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=world)
    if cls.__name__.endswith("ForCausalLM"):  # HF's causal loss computes in float32; the reference in float64
        ref.loss_function = tputil.float64_loss_function(causal=True)
    g = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    ids = torch.randint(3, vocab, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    if cls in (RobertaForSequenceClassification,):
        labels = torch.tensor([0, 2])
    elif cls in (RobertaForTokenClassification,):
        labels = torch.randint(0, 3, (2, 10), generator=g)
    else:
        labels = ids.clone()
        labels[0, :2] = -100
    out_ref, out_par = ref(ids, attention_mask=mask), par(ids, attention_mask=mask)
    torch.testing.assert_close(out_par.logits, out_ref.logits, **TOL)
    loss_ref = ref(ids, attention_mask=mask, labels=labels).loss
    loss_par = par(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss_par, loss_ref, **TOL)
    loss_ref.backward()
    loss_par.backward()
    ref_grads, par_grads = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
    assert ref_grads.keys() == par_grads.keys()
    worst = 0.0
    for fqn, grad in ref_grads.items():
        torch.testing.assert_close(par_grads[fqn], grad, **TOL, msg=lambda m: f"{name}: {fqn}: {m}")
        worst = max(worst, float((par_grads[fqn] - grad).abs().max()))
    if hasattr(ref, "generate") and cls.__name__.endswith("ForCausalLM"):
        kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(par.generate(ids[:1], **kw), ref.generate(ids[:1], **kw)), name
    if cls is Phi3ForCausalLM:
        assert par.config.num_attention_heads == 4 // world  # per rank at forward time
        tpify.save_pretrained(par, f"{tmp}/{name}")
        saved = json.loads(open(f"{tmp}/{name}/config.json").read())
        assert saved["num_attention_heads"] == 4 and par.config.num_attention_heads == 4 // world
        back = tpify.from_pretrained(f"{tmp}/{name}", tp_size=world, torch_dtype="float64")
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, out_ref.logits, **TOL)
    return worst


def _body(rank, world, tmp):
    return {name: _check(name, cls, make(world) if make is _phi3 else make(), world, tmp)
            for name, (cls, make) in CASES.items()}


def _run(world, tmp_path):
    results = tputil.spawn(_body, world, str(tmp_path), timeout=400)
    print(f"measured, tp = {world}: max |gradient - dense| per case:", results[0])


def test_recipe_features_match_dense_tp2(tmp_path):
    _run(2, tmp_path)


@pytest.mark.slow
def test_recipe_features_match_dense_tp4(tmp_path):
    _run(4, tmp_path)


def test_without_the_region_all_reduce_phi_qk_layernorm_gradients_are_wrong():
    """The negative control: remove tpify's hooks after the first forward and the per-head
    LayerNorm gradients come out as the local heads' partial sums (the silent error guarded)."""
    results = tputil.spawn(_negative_body, 2, timeout=200)
    assert results[0] > 1e-3, results
    print(f"measured: without the all-reduce the q_layernorm gradient is off by {results[0]:.3g}")


def _negative_body(rank, world):
    import tpify

    torch.manual_seed(0)
    ref = PhiForCausalLM(_phi(True)).double()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=world)
    assert tpify.remove_hooks(par) > 0
    ids = torch.randint(3, 101, (2, 10), generator=torch.Generator().manual_seed(1))
    ref(ids, labels=ids).loss.backward()
    par(ids, labels=ids).loss.backward()  # HF's own loss on gathered logits now
    name = "model.layers.0.self_attn.q_layernorm.weight"
    return float((tputil.dense_named(par, "grad")[name] - tputil.dense_named(ref, "grad")[name]).abs().max())
