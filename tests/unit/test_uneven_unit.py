"""What the planner splits unevenly and what it still refuses, without ranks (models on meta).

A split size ``tp_size`` does not divide is split by torch.chunk's rule (``ceil(n / p)`` per rank,
the last ranks fewer; docs/mechanics.md, "Uneven splits") only where the planner finds no
attention head (:meth:`tpify.planner.Planner.find_heads`). Proven here:

* the MLPs of Llama (gate/up/down), GPT-2 (Conv1D ``c_fc``/``c_proj``), Phi-3 (packed
  ``[gate | up]``), T5 (``wi``/``wo``), BERT (``intermediate``/``output``) and Mixtral's fused
  experts with intermediate 37 plan at tp 2 and 3, each split parameter carrying an uneven
  ``ShardSpec`` whose ranks hold torch.chunk's sizes; the attention layers stay even;
* heads stay whole, with the messages of before: a head count tp does not divide is refused
  with the same lines (the config count, the attention layers) and the sizes that would work,
  now from the heads alone; a layer inside a module the recipe marks as holding heads, a
  layer whose width is a head count times the head size, packed parts weighed by head counts
  and K/V layers are never split unevenly; interleaved gate/up pairs (gpt-oss) neither; nor are
  the experts themselves under expert parallelism;
* ``tpify plan`` reports every rank's shapes where they differ.

Tolerance: none; planning computes integers.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import tpify
from tpify.api import resolve_recipe
from tpify.layout import build_layout
from tpify.recipe import Recipe
from tpify.sharding import ShardSpec


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _layout(model, tp, **kw):
    return build_layout(model, resolve_recipe(model, None), tp, **kw)


def _uneven(layout):
    return sorted(f for f, m in layout.modules.items() if m.uneven)


def _llama(**kw):
    values = dict(hidden_size=48, intermediate_size=37, num_hidden_layers=1, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=101)
    return _meta(tf.LlamaForCausalLM, tf.LlamaConfig(**{**values, **kw}))


@pytest.mark.parametrize("tp,sizes", [(2, [19, 18]), (3, [13, 13, 11])])
def test_llama_mlp_of_37_is_split_unevenly_and_its_attention_evenly(tp, sizes):
    layout = _layout(_llama(), tp)
    mlp = "model.layers.0.mlp."
    assert _uneven(layout) == [mlp + "down_proj", mlp + "gate_proj", mlp + "up_proj"]
    gate = layout.modules[mlp + "gate_proj"].specs["weight"]
    assert gate == ShardSpec(0, (37,), tp, uneven=True) and gate.local_sizes() == sizes
    assert layout.modules[mlp + "down_proj"].specs["weight"] == ShardSpec(1, (37,), tp, uneven=True)
    assert all(spec is None or spec.is_uniform for f, m in layout.modules.items() if "self_attn" in f
               for spec in m.specs.values())


def test_gpt2_phi3_t5_bert_and_mixtral_split_their_intermediate_size_unevenly():
    gpt2 = _layout(_meta(tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=32, n_inner=37, n_layer=1, n_head=4,
                                                           vocab_size=101)), 2)
    assert _uneven(gpt2) == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert gpt2.modules["transformer.h.0.mlp.c_fc"].specs["weight"] == ShardSpec(1, (37,), 2, uneven=True)
    phi3 = _layout(_meta(tf.Phi3ForCausalLM, tf.Phi3Config(hidden_size=48, intermediate_size=37, num_hidden_layers=1,
                                                           num_attention_heads=6, num_key_value_heads=3,
                                                           vocab_size=101, pad_token_id=0)), 3)
    gate_up = phi3.modules["model.layers.0.mlp.gate_up_proj"].specs["weight"]
    assert gate_up == ShardSpec(0, (37, 37), 3, uneven=True) and gate_up.local_sizes() == [26, 26, 22]
    assert _uneven(phi3) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj"]
    t5 = _layout(_meta(tf.T5ForConditionalGeneration, tf.T5Config(d_model=32, d_ff=37, d_kv=8, num_layers=1,
                                                                   num_heads=4, vocab_size=101)), 2)
    assert all("DenseReluDense" in f for f in _uneven(t5)) and len(_uneven(t5)) == 4
    bert = _layout(_meta(tf.BertForMaskedLM, tf.BertConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                                          num_attention_heads=4, vocab_size=101)), 2)
    assert _uneven(bert) == ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense"]
    mixtral = _layout(_meta(tf.MixtralForCausalLM, tf.MixtralConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, num_local_experts=4)), 2)
    experts = mixtral.modules["model.layers.0.mlp.experts"].specs
    assert experts["gate_up_proj"] == ShardSpec(1, (37, 37), 2, uneven=True)
    assert experts["down_proj"] == ShardSpec(2, (37,), 2, uneven=True)


def test_a_head_count_tp_does_not_divide_is_refused_with_the_same_messages():
    # 3 heads of 6 at tp 4: the heads, q/k/v/o refused as before; the MLP of 37 no longer named
    model = _llama(hidden_size=18, num_attention_heads=3, num_key_value_heads=3, head_dim=6)
    with pytest.raises(tpify.PlanError) as err:
        _layout(model, 4)
    message = str(err.value)
    for line in ("config.num_attention_heads (LlamaForCausalLM) = 3 is not divisible by tp_size = 4",
                 "3 KV heads at tp_size = 4: tp_size must divide the KV heads",
                 "model.layers.0.self_attn.q_proj.out_features (Linear, colwise) = 18 is not divisible by tp_size = 4",
                 "model.layers.0.self_attn.o_proj.in_features (Linear, rowwise) = 18 is not divisible by tp_size = 4",
                 "tp sizes that would work for this model: [1, 3]."):
        assert line in message, (line, message)
    assert "mlp" not in message, message
    bert = _meta(tf.BertForMaskedLM, tf.BertConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                                   num_attention_heads=4, vocab_size=101))
    with pytest.raises(tpify.PlanError) as err:
        _layout(bert, 3)
    message = str(err.value)
    assert "bert.encoder.layer.0.attention.self.all_head_size = 32 is not divisible by tp_size = 3" in message
    assert "bert.encoder.layer.0.attention.output.dense.in_features (Linear, rowwise) = 32 is not divisible" in message
    assert "intermediate" not in message and "tp sizes that would work for this model: [1, 2, 4]." in message


class _Toy(nn.Module):
    """An attention-like module (``attn``: ``q``, a gate ``g`` and ``o``) and an MLP (``up``, ``down``)."""

    def __init__(self, width=6, mlp=7, gate=5):
        super().__init__()
        self.attn = nn.Module()
        self.attn.num_heads = 2
        self.attn.q, self.attn.g, self.attn.o = nn.Linear(4, width), nn.Linear(4, gate), nn.Linear(width, 4)
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(4, mlp), nn.Linear(mlp, 4)


def _toy_recipe(*extra):
    rules = [{"match": ["attn.q", "attn.g"], "style": "colwise"}, {"match": "attn.o", "style": "rowwise"},
             {"match": "mlp.up", "style": "colwise"}, {"match": "mlp.down", "style": "rowwise"}, *extra]
    return Recipe.from_dict({"model_type": "toy", "rule": rules}, "toy.toml")


def test_a_layer_inside_a_module_holding_heads_is_never_split_unevenly():
    toy = _Toy()
    layout = build_layout(toy, _toy_recipe(), 4)  # nothing says attn holds heads: every layer may be uneven
    assert _uneven(layout) == ["attn.g", "attn.o", "attn.q", "mlp.down", "mlp.up"]
    with pytest.raises(tpify.PlanError) as err:  # the recipe divides attn's head count: attn holds heads
        build_layout(toy, _toy_recipe({"match": "attn", "divide": ["num_heads"]}), 4)
    message = str(err.value)
    for line in ("attn.num_heads = 2 is not divisible by tp_size = 4",
                 "attn.q.out_features (Linear, colwise) = 6 is not divisible by tp_size = 4",
                 "attn.g.out_features (Linear, colwise) = 5 is not divisible by tp_size = 4",
                 "attn.o.in_features (Linear, rowwise) = 6 is not divisible by tp_size = 4"):
        assert line in message, (line, message)
    assert "mlp" not in message, "the MLP may still be uneven"
    layout = build_layout(_Toy(gate=6), _toy_recipe({"match": "attn", "divide": ["num_heads"]}), 4 // 2)
    assert _uneven(layout) == ["mlp.down", "mlp.up"], "at tp 2 the heads divide: only the MLP of 7 is uneven"


def test_a_layer_as_wide_as_heads_times_the_head_size_is_never_split_unevenly():
    """No rule marks ``attn``, but ``q`` is 3 heads of 2 (config.num_attention_heads, head_dim):
    its owner holds heads, so ``q``, ``o`` and the gate ``g`` beside them stay even."""
    toy = _Toy()
    toy.config = tf.PretrainedConfig(num_attention_heads=3, head_dim=2)
    with pytest.raises(tpify.PlanError) as err:
        build_layout(toy, _toy_recipe(), 4)
    message = str(err.value)
    assert "attn.q.out_features (Linear, colwise) = 6 is not divisible by tp_size = 4" in message
    assert "attn.g.out_features (Linear, colwise) = 5 is not divisible by tp_size = 4" in message
    assert "mlp" not in message


def test_kv_layers_and_parts_weighed_by_heads_are_never_split_unevenly():
    bigcode = _meta(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(n_layer=1, n_embd=30, n_head=6, n_inner=37,
                                                                  vocab_size=101, multi_query=True))
    with pytest.raises(tpify.PlanError) as err:  # multi-query [Q | K | V] weighed [6, 1, 1] heads of 5
        _layout(bigcode, 4)
    assert "transformer.h.0.attn.c_attn packed part 0 of out_features = 30 is not divisible by tp_size = 4" in \
        str(err.value)
    assert "mlp" not in str(err.value), "the MLP of 37 may be uneven"
    qwen2 = _meta(tf.Qwen2ForCausalLM, tf.Qwen2Config(num_hidden_layers=1, hidden_size=48, num_attention_heads=12,
                                                      num_key_value_heads=4, intermediate_size=37, vocab_size=101))
    with pytest.raises(tpify.PlanError, match="4 KV heads at tp_size = 6"):
        _layout(qwen2, 6)
    assert _uneven(_layout(qwen2, 4)) == [f"model.layers.0.mlp.{n}" for n in ("down_proj", "gate_proj", "up_proj")]


def test_interleaved_gate_up_pairs_and_expert_parallel_experts_are_never_split_unevenly():
    gpt_oss = _meta(tf.GptOssForCausalLM, tf.GptOssConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=101, num_local_experts=4))
    with pytest.raises(tpify.PlanError) as err:
        _layout(gpt_oss, 2)
    assert ("model.layers.0.mlp.experts.gate_up_proj dimension 2 (interleaved gate/up pairs, never split unevenly) "
            "= 37 is not divisible by tp_size = 2") in str(err.value)
    mixtral = _meta(tf.MixtralForCausalLM, tf.MixtralConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, num_local_experts=6))
    assert _uneven(_layout(mixtral, 4, ep_size=1)) == ["model.layers.0.mlp.experts"]
    assert _uneven(_layout(mixtral, 2, ep_size=2)) == [], "whole experts per rank: nothing uneven"
    with pytest.raises(tpify.PlanError, match=r"num_experts \(MixtralExperts, experts, ep_size\) = 6 is not divisible"):
        _layout(mixtral, 4, ep_size=4)


def test_plan_reports_each_rank_shapes_of_an_uneven_split(tmp_path):
    from tpify.authoring.plan import plan_report
    from tpify.authoring.plan_text import render_text

    tf.LlamaConfig(hidden_size=48, intermediate_size=37, num_hidden_layers=1, num_attention_heads=6,
                   num_key_value_heads=3, vocab_size=101).save_pretrained(tmp_path)
    report = plan_report(str(tmp_path), 3)
    rows = {m["fqn"]: m for m in report["modules"]}
    gate = rows["model.layers.0.mlp.gate_proj"]
    assert gate["uneven"] and gate["params"][0]["rank_shape"] == [13, 48]
    assert gate["params"][0]["rank_shapes"] == [[13, 48], [13, 48], [11, 48]]
    assert rows["model.layers.0.mlp.down_proj"]["params"][0]["rank_shapes"] == [[48, 13], [48, 13], [48, 11]]
    assert not rows["model.layers.0.self_attn.q_proj"]["uneven"]
    assert rows["model.layers.0.self_attn.q_proj"]["params"][0]["rank_shapes"] is None
    text = render_text(report)
    assert "split unevenly (torch.chunk's rule); ranks: [13, 48], [13, 48], [11, 48]" in text
    assert "rank 0's, the largest, where a split is uneven" in text
