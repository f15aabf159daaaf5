"""``print(model.tp_info)``: one short line per rank; the whole layout behind ``describe()``."""

import copy
import re

import torch

import tputil


def _body(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    import tpify

    torch.manual_seed(0)
    # SmolLM2's shape at a small width: 30 layers, 3 KV heads (before: a repr of ~150 KB per rank)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, hidden_size=72, intermediate_size=96,
                                         num_attention_heads=6, num_key_value_heads=2, vocab_size=1000))
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = tpify.parallelize(model, tp_size=world)
    info = model.tp_info
    text = repr(info)
    layout_text = info.describe()
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    # a deep copy's info counts the copy's parameters (float64: twice the bytes)
    double = copy.deepcopy(model).double()
    copied = repr(double.tp_info)
    assert double.tp_info.model_ref() is double
    del double
    modules = list(info.layout.modules)
    params = [n for n, _ in model.named_parameters()]
    return text, layout_text, local, dense_bytes, copied, modules, params


def test_tp_info_repr_is_one_short_line_and_describe_holds_the_layout():
    for rank, (text, layout_text, local, dense, copied, modules, params) in enumerate(tputil.spawn(_body, 2)):
        assert len(text) < 300 and "\n" not in text, text
        assert f"tp_size=2, tp_rank={rank}, tp_group=[0, 1]" in text, text
        # q, k, v, gate, up and o, down in each of 30 layers; the embedding; the vocabulary-parallel head
        assert "modules: colwise 150, rowwise 60, embedding_rowwise 1, colwise_rep 1" in text, text
        assert f"parameters {local / 2**20:.2f} MiB on this rank ({local / dense:.3f} x dense)" in text, text
        assert ".describe()" in text
        kib = re.search(r"parameters ([\d.]+) MiB", copied)
        assert kib and abs(float(kib.group(1)) - 2 * local / 2**20) < 0.01, copied
        lines = layout_text.splitlines()
        assert lines[0] == text
        for fqn in modules:  # every styled module, with its style and rule
            assert re.search(rf"^  {re.escape(fqn)} +\w+ +rule #\d+$", layout_text, re.M), fqn
        for name in params:  # every parameter, its local shape and its split
            assert re.search(rf"^  {re.escape(name)} +\[[\d, ]+\] +float32 +(replicated|split on dim)", layout_text,
                             re.M), name
        # q_proj: 6 heads of 12, 3 per rank; o_proj split along its input; the head along the vocabulary
        assert re.search(r"q_proj.weight +\[36, 72\] +float32 +split on dim 0 over 2 \(dense 72\)", layout_text)
        assert re.search(r"o_proj.weight +\[72, 36\] +float32 +split on dim 1 over 2 \(dense 72\)", layout_text)
        assert re.search(r"lm_head.weight +\[500, 72\] +float32 +split on dim 0 over 2 \(dense 1000\)", layout_text)
