"""torchao int8 weight-only, one process: the config checks (refused by name: every other torchao
config, other granularities, quantized embeddings, an LM head transformers would quantize) and a
tp = 1 Llama quantized by ``tpify.parallelize`` against transformers' own torchao model: codes and
scales bitwise (one shard is the whole weight), logits exactly (the same torchao linear on the same
tensors), ``modules_to_not_convert`` matched as transformers matches it."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tpify
from tpify.api import resolve_recipe
from tpify.layout import PlanError, build_layout

pytest.importorskip("torchao")

from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerGroup, PerTensor  # noqa: E402
from transformers import TorchAoConfig  # noqa: E402

from tpify.quantized_torchao import check_torchao_layout, is_torchao_config, torchao_spec  # noqa: E402


def _llama():
    return LlamaConfig(num_hidden_layers=1, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=160, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False)


def test_torchao_configs_not_built_are_refused_by_name():
    spec = torchao_spec(TorchAoConfig(Int8WeightOnlyConfig()))
    assert (spec.quant_type, spec.skip) == ("int8_weight_only", None)
    assert is_torchao_config(TorchAoConfig(Int8WeightOnlyConfig())) and not is_torchao_config(object())
    with pytest.raises(NotImplementedError, match="Int8DynamicActivationInt8WeightConfig.*not built.*row-parallel"):
        torchao_spec(TorchAoConfig(Int8DynamicActivationInt8WeightConfig()))
    for gran in (PerTensor(), PerGroup(32)):
        with pytest.raises(NotImplementedError, match=f"granularity={type(gran).__name__}.*not built"):
            torchao_spec(TorchAoConfig(Int8WeightOnlyConfig(granularity=gran)))
    with pytest.raises(NotImplementedError, match="include_input_output_embeddings=True"):
        torchao_spec(TorchAoConfig(Int8WeightOnlyConfig(), include_input_output_embeddings=True))
    from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig

    with pytest.raises(NotImplementedError, match="NF4WeightOnlyConfig.*blocks of 256"):
        torchao_spec(TorchAoConfig(NF4WeightOnlyConfig()))


def test_an_lm_head_transformers_would_quantize_is_refused():
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama())
    layout = build_layout(model, resolve_recipe(model), 1)
    fqns, spec = check_torchao_layout(model, layout, torchao_spec(TorchAoConfig(Int8WeightOnlyConfig())))
    assert len(fqns) == 7 and "lm_head" in spec.skip  # transformers' default: the output embeddings kept
    with pytest.raises(PlanError, match="lm_head: transformers' TorchAoConfig would quantize it"):
        check_torchao_layout(model, layout, torchao_spec(TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=[])))


@pytest.mark.parametrize("skip", [None, ["lm_head", "model.layers.0.mlp.down_proj"]])
def test_tp1_int8_equals_transformers_torchao_bitwise(tmp_path, skip):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    LlamaForCausalLM(_llama()).save_pretrained(tmp_path)
    config = lambda: TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=skip)  # noqa: E731
    ref = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=config(), dtype=torch.float32, device_map="cpu")
    par = tpify.parallelize(LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), tp_size=1,
                            quantization_config=config())
    refs, n = dict(ref.named_modules()), 0
    for fqn, m in par.named_modules():
        dense = getattr(refs.get(fqn), "weight", None)
        if hasattr(m, "weight_qdata"):
            assert torch.equal(m.weight_qdata, dense.qdata) and torch.equal(m.weight_scale, dense.scale), fqn
            assert torch.equal(m.weight, dense.dequantize()), fqn
            n += 1
        elif dense is not None:
            assert type(dense).__name__ != "Int8Tensor", f"{fqn}: quantized by transformers, not by tpify"
    assert n == (6 if skip else 7)
    assert all(not p.requires_grad for p in par.parameters())
    assert "int8_weight_only" in repr(par.model.layers[0].self_attn.q_proj)
    ids = torch.randint(3, 101, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_parallel_scale_from_gathered_min_max_is_the_dense_scale(monkeypatch, dtype):
    """The row-parallel path at tp 2 in one process (the all-gather stood in by the two shards'
    per-row (min, max), concatenated in rank order): the dense scales and codes bit for bit, where
    a shard quantized alone gives other codes (about a third of them, measured)."""
    from torchao.quantization import Int8Tensor, PerRow

    from tpify import comm
    from tpify import quantized_torchao as qt

    torch.manual_seed(0)
    w = torch.randn(64, 96).to(dtype)
    dense = Int8Tensor.from_hp(w, granularity=PerRow())
    shards = [s.contiguous() for s in w.chunk(2, dim=1)]
    others = [torch.stack([s.amin(dim=1), s.amax(dim=1)], dim=1) for s in shards]
    monkeypatch.setattr(comm, "all_gather_dim", lambda t, dim, group: torch.cat(others, dim=dim))
    codes = []
    for s in shards:
        scale, zero_point = qt._row_scale(s, None)
        assert torch.equal(scale, dense.scale) and torch.equal(zero_point, dense.zero_point)
        codes.append(Int8Tensor.from_hp(s, granularity=PerRow(), scale=scale, zero_point=zero_point).qdata)
    assert torch.equal(torch.cat(codes, dim=1), dense.qdata)
    alone = Int8Tensor.from_hp(shards[0], granularity=PerRow()).qdata
    assert (alone != dense.qdata[:, :48]).float().mean() > 0.1
