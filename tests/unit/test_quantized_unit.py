"""Quantized tensor-parallel layers, one process: the config checks and the block-alignment check
(pure, on the layout: the same PlanError on every rank before any collective), and a tp = 1 model
quantized by ``tpify.parallelize`` against transformers' own 4-bit model (exact: one shard is the
whole weight)."""

import importlib.util
import warnings

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import tpify
from tpify.api import resolve_recipe
from tpify.layout import build_layout
from tpify.quantized import check_layout, quantization_spec

pytest.importorskip("bitsandbytes")


def _config(**kw):
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              **kw)


def _llama(hidden=128, heads=4, kv=2, inter=256):
    return LlamaConfig(num_hidden_layers=1, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=inter, vocab_size=101, max_position_embeddings=64,
                       tie_word_embeddings=False)


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _check(model, tp, **kw):
    layout = build_layout(model, resolve_recipe(model), tp, **kw)
    return check_layout(model, layout, quantization_spec(_config()))


def test_configs_not_built_are_refused_by_name(monkeypatch):
    assert quantization_spec(_config(bnb_4bit_use_double_quant=True)).double_quant  # built (test below)
    with pytest.raises(NotImplementedError, match="load_in_8bit=True"):
        quantization_spec(BitsAndBytesConfig(load_in_8bit=True))

    class TorchAoConfig:  # stands for transformers' (constructing the real one needs torchao installed)
        pass

    with pytest.raises(NotImplementedError, match="quantization_config=TorchAoConfig.*not built"):
        quantization_spec(TorchAoConfig())
    spec = quantization_spec({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"})
    assert (spec.quant_type, spec.blocksize) == ("fp4", 64)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        quantization_spec(_config())


def test_a_split_that_cuts_a_block_names_the_layer_and_the_tp_sizes_that_work():
    model = _meta(LlamaForCausalLM, _llama())
    assert "model.layers.0.self_attn.o_proj" in _check(model, 2)
    # tp 4: o_proj's input 128 / 4 = 32 columns per rank, half a block of 64
    with pytest.raises(tpify.PlanError, match=r"model.layers.0.self_attn.o_proj \(row-parallel, \[128, 128\] at "
                                              r"tp_size = 4\).*tp sizes that keep its blocks whole: \[1, 2\]"):
        _check(model, 4)
    # column-parallel: q_proj [40, 40] at tp 2 holds 20 rows = 800 elements, not a multiple of 64
    small = _meta(LlamaForCausalLM, _llama(hidden=40, heads=4, kv=4, inter=128))
    with pytest.raises(tpify.PlanError, match=r"self_attn.q_proj \(column-parallel.*element 800"):
        _check(small, 2)


def test_styles_without_a_quantized_form_are_refused():
    moe = _meta(MixtralForCausalLM, MixtralConfig(num_hidden_layers=1, hidden_size=128, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=128, vocab_size=101,
                                                  num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(tpify.PlanError, match=r"style 'experts' has no quantized tensor-parallel form"):
        _check(moe, 2)
    with pytest.raises(tpify.PlanError, match="under sequence parallelism are not built"):
        _check(_meta(LlamaForCausalLM, _llama()), 2, sequence_parallel=True)


def test_tp1_equals_transformers_4bit_model(tmp_path):
    import bitsandbytes.functional as bnbf

    from tpify.quantized import QuantizedColumnParallelLinear, is_quantized, quantized_bytes

    torch.manual_seed(0)
    dense = LlamaForCausalLM(_llama())
    dense.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=_config(), dtype=torch.float32,
                                               device_map="cpu")
    par = tpify.parallelize(LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), tp_size=1,
                            quantization_config=_config())
    assert is_quantized(par) and not any(p.requires_grad for p in par.parameters())
    q = par.model.layers[0].self_attn.q_proj
    r = ref.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedColumnParallelLinear)
    assert torch.equal(q.weight_codes, r.weight.data) and torch.equal(q.weight_absmax, r.weight.quant_state.absmax)
    assert torch.equal(q.weight, bnbf.dequantize_4bit(r.weight.data, r.weight.quant_state))
    ref.save_pretrained(tmp_path / "quantized")  # before any eval forward (which repacks the weights on CPU)
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    ref.train(), par.train()  # bitsandbytes' CPU eval path computes in bfloat16 (see test_quantized.py)
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    sizes = quantized_bytes(par)
    # 7 layers, [128,128] q/o, [64,128] k/v, 3 x [256,128] MLP: 4 bits + one float32 absmax per 64 elements
    numel = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128
    assert sizes["quantized"] == numel // 2 + numel // 64 * 4 + 7 * 16 * 4
    with pytest.raises(KeyError, match="attribute 'weight' already exists"):  # the 4-bit weight is read-only
        q.weight = torch.nn.Parameter(torch.zeros(128, 128))
    # a checkpoint saved quantized (transformers' bitsandbytes format) is read as stored: the same model
    with pytest.raises(ValueError, match="saved quantized already"):
        tpify.from_pretrained(tmp_path / "quantized", tp_size=1, quantization_config=_config())
    loaded = tpify.from_pretrained(tmp_path / "quantized", tp_size=1)
    lq = loaded.model.layers[0].self_attn.q_proj
    assert torch.equal(lq.weight_codes, q.weight_codes) and torch.equal(lq.weight_absmax, q.weight_absmax)
    loaded.train()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, par(ids).logits, atol=0, rtol=0)


def test_double_quantization_tp1_equals_transformers_bitwise(tmp_path):
    """``bnb_4bit_use_double_quant=True`` at tp 1, both paths (quantize on load; transformers' saved
    double-quantized checkpoint read back): every layer's dequantized weight equals transformers'
    dense double-quantized weight dequantized, bit for bit; the logits equal within float32 matmul
    noise (atol 1e-5; train mode, see test_tp1_equals_transformers_4bit_model). tp 2 and the GPT-2
    layout: tests/distributed/test_quantized.py."""
    import bitsandbytes.functional as bnbf

    from tpify.quantized import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

    config = _config(bnb_4bit_use_double_quant=True)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama(hidden=256, inter=512)).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32,
                                               device_map="cpu")
    ref.save_pretrained(tmp_path / "quantized")  # before any eval forward
    par = tpify.from_pretrained(tmp_path, tp_size=1, quantization_config=config)
    loaded = tpify.from_pretrained(tmp_path / "quantized", tp_size=1)
    refs, n = dict(ref.named_modules()), 0
    for model in (par, loaded):
        for fqn, m in model.named_modules():
            if isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)):
                r = refs[fqn].weight
                assert r.quant_state.nested
                assert torch.equal(m.weight, bnbf.dequantize_4bit(r.data, r.quant_state)), fqn
                n += 1
    assert n == 2 * 7
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    ref.train(), par.train(), loaded.train()
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded(ids).logits, par(ids).logits, atol=0, rtol=0)


def test_int8_configs_not_built_are_refused_by_name():
    from tpify.quantized_int8 import int8_spec

    assert int8_spec(BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=4.0)).threshold == 4.0
    with pytest.raises(NotImplementedError, match="llm_int8_has_fp16_weight=True"):
        int8_spec(BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True))
    with pytest.raises(NotImplementedError, match="llm_int8_enable_fp32_cpu_offload=True"):
        int8_spec({"load_in_8bit": True, "llm_int8_enable_fp32_cpu_offload": True})


def test_int8_tp1_equals_transformers_8bit_model(tmp_path):
    """``load_in_8bit=True`` at tp = 1 (one shard: the whole weight) against transformers' 8-bit model:
    codes and row absmax bitwise; logits on both of bitsandbytes' paths (train: dequantize + float32
    matmul, atol 1e-5; eval: int8 activations, outlier columns above 6.0, the same kernel on the same
    inputs: exact); a saved 8-bit checkpoint and full fine-tuning refused by name."""
    from tpify.info import TPUsageError
    from tpify.quantized import refuse_full_finetuning
    from tpify.quantized_int8 import Int8LtColumnParallelLinear, Int8LtRowParallelLinear

    torch.manual_seed(0)
    LlamaForCausalLM(_llama()).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_8bit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.float32,
                                               device_map="cpu")
        par = tpify.parallelize(LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), tp_size=1,
                                quantization_config=config)
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            q, r = par.model.layers[0].get_submodule(name), ref.model.layers[0].get_submodule(name)
            assert isinstance(q, (Int8LtColumnParallelLinear, Int8LtRowParallelLinear)), name
            assert torch.equal(q.weight_CB, r.weight.data) and torch.equal(q.weight_SCB, r.weight.SCB), name
        ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref.train(), par.train()
            torch.testing.assert_close(par(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
            ref.eval(), par.eval()
            torch.testing.assert_close(par(ids).logits, ref(ids).logits, atol=0, rtol=0)
        with pytest.raises(TPUsageError, match="full fine-tuning of a quantized base"):
            refuse_full_finetuning(par, "TPTrainer")
        ref.save_pretrained(tmp_path / "int8")
        with pytest.raises(NotImplementedError, match="checkpoint saved 8-bit"):
            tpify.from_pretrained(tmp_path / "int8", tp_size=1)
