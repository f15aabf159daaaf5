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

    spec = torchao_spec(TorchAoConfig(NF4WeightOnlyConfig()))  # built (tpify.quantized_torchao's NF4 layers)
    assert (spec.quant_type, spec.blocksize, spec.scaler_blocksize) == ("nf4", 64, 256)


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


def _nf4_llama(hidden=256, intermediate=640):
    return LlamaConfig(num_hidden_layers=1, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=intermediate, vocab_size=101, max_position_embeddings=64,
                       tie_word_embeddings=False)


def test_nf4_refuses_a_split_that_cuts_a_block_and_a_weight_torchao_cannot_quantize():
    from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig

    spec = torchao_spec(TorchAoConfig(NF4WeightOnlyConfig()))
    with torch.device("meta"):
        model = LlamaForCausalLM(_nf4_llama())  # down_proj [256, 640]: 640 / 4 = 160 columns, not whole blocks of 64
    fqns, _ = check_torchao_layout(model, build_layout(model, resolve_recipe(model), 2), spec)
    assert len(fqns) == 7
    with pytest.raises(PlanError, match=r"(?s)mlp.down_proj \(row-parallel, \[256, 640\] at tp_size = 4\).*cuts a "
                                        r"quantization block.*tp sizes that keep its blocks whole: \[1, 2, 5, 10\]"):
        check_torchao_layout(model, build_layout(model, resolve_recipe(model), 4), spec)
    with torch.device("meta"):
        small = LlamaForCausalLM(_llama())  # [96, 96] = 9216 elements: torchao's NF4 refuses the dense weight too
    with pytest.raises(PlanError, match=r"multiple of block_size x scaler_block_size = 64 x 256 = 16384.*"
                                        r"q_proj \[96, 96\] \(9216 elements\)"):
        check_torchao_layout(small, build_layout(small, resolve_recipe(small), 1), spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_row,tp", [(True, 2), (True, 4), (False, 4)])
def test_nf4_shard_from_gathered_absmax_dequantizes_to_the_dense_slice(monkeypatch, dtype, is_row, tp):
    """The NF4 shard in one process (the all-gather stood in by every shard's block absmax, in rank
    order): each rank's dequantized ``NF4Tensor`` equals the dense one's slice bit for bit, where
    scaler blocks of 256 are cut (row-parallel: 4 or 2 scalers per row and rank; column-parallel at
    tp 4: 192 rows of 6 = 1152 scalers, 4.5 scaler blocks), and the shard quantized alone differs."""
    from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax

    from tpify import comm
    from tpify import quantized_torchao as qt
    from tpify.sharding import ShardSpec

    torch.manual_seed(0)
    w = torch.randn(768, 512 if is_row else 384).to(dtype)  # 24 or 18 x 16384 elements
    spec = torchao_spec(TorchAoConfig(NF4WeightOnlyConfig()))
    dense = to_nf4(w)
    shard_spec = ShardSpec(dim=1 if is_row else 0, parts=(w.shape[1 if is_row else 0],), tp_size=tp)
    shards = [s.contiguous() for s in w.chunk(tp, dim=1 if is_row else 0)]
    absmax = [get_block_absmax(s.flatten(), 64) for s in shards]
    monkeypatch.setattr(comm, "all_gather_dim", lambda t, dim, group: torch.cat(absmax, dim=dim))
    sizes = set()
    for r, s in enumerate(shards):
        local = qt._nf4_shard(s, shard_spec, r, None, is_row, spec)
        sizes.add(local.scaler_block_size)
        want = dense.get_original_weight().chunk(tp, dim=1 if is_row else 0)[r]
        assert torch.equal(local.get_original_weight(), want), r
    assert sizes == ({256 // tp} if is_row else {128})
    alone = to_nf4(shards[1], 64, min(sizes))  # its own mean and scaler blocks
    want = dense.get_original_weight().chunk(tp, dim=1 if is_row else 0)[1]
    assert not torch.equal(alone.get_original_weight(), want)
