"""tpify.pipeline's pure parts, one process: the layer ranges, the plan (recipe table, transformers'
base_model_pp_plan, the refusal naming the recipe key), the stage's config, the microbatch checks,
the recipe's [pipeline] table, and one stage cut from a tiny GPT-2 keeping the global names."""

from __future__ import annotations

import pytest
import torch

from tpify.pipeline import PipelineError, layer_ranges, pipeline_plan
from tpify.pipeline.plan import stage_indices
from tpify.pipeline.schedule import check_microbatches
from tpify.pipeline.stage import build_stage, stage_config
from tpify.recipe import RecipeError, load_recipe


def test_layer_ranges_balanced_and_given():
    assert layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert layer_ranges(10, 3, [2, 7]) == [range(0, 2), range(2, 7), range(7, 10)]
    with pytest.raises(PipelineError, match="8 pipeline stages but the model has 4 layers"):
        layer_ranges(4, 8)
    for bad in ([7, 2], [0, 5], [3], [3, 10], [3, 3]):
        with pytest.raises(PipelineError, match="split_points"):
            layer_ranges(10, 3, bad)


def test_stage_indices_loop_and_v():
    assert stage_indices(1, 4, 2, "loop") == [1, 5]
    assert stage_indices(0, 2, 2, "v") == [0, 3]
    assert stage_indices(1, 2, 2, "v") == [1, 2]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=4, n_head=2))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_plan_from_recipe_and_from_transformers():
    model = _gpt2()
    plan = pipeline_plan(model, load_recipe("gpt2"))
    assert (plan.layers, plan.head, plan.first["wpe"], plan.last) == ("h", "lm_head", "zero", {"ln_f": "identity"})
    llama = pipeline_plan(_llama(), None)  # transformers' base_model_pp_plan
    assert (llama.layers, llama.first, llama.last, llama.head) == ("layers", {"embed_tokens": "absent"},
                                                                   {"norm": "identity"}, "lm_head")
    with pytest.raises(PipelineError, match=r"no pipeline plan.*\[pipeline\] layers ="):
        pipeline_plan(model, None)  # GPT-2's config declares no base_model_pp_plan
    bad = {"model_type": "gpt2", "rule": [{"match": "wte", "style": "embedding_rowwise"}],
           "pipeline": {"layers": "blocks"}}
    with pytest.raises(PipelineError, match="blocks"):
        pipeline_plan(model, load_recipe(bad))


def test_recipe_pipeline_table_is_validated():
    base = {"model_type": "x", "rule": [{"match": "a", "style": "colwise"}]}
    for table in ({"first": {}}, {"layers": "h", "first": {"wte": "gone"}}, {"layers": "h.x"},
                  {"layers": "h", "extra": 1}):
        with pytest.raises(RecipeError, match=r"\[pipeline\]"):
            load_recipe(base | {"pipeline": table})


def test_stage_config_cuts_per_layer_lists():
    from transformers import Qwen2Config

    cfg = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, sliding_window=4,
                      layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"])
    out = stage_config(cfg, range(1, 3), 4)
    assert out.num_hidden_layers == 2 and out.layer_types == ["full_attention", "sliding_attention"]
    assert cfg.num_hidden_layers == 4 and len(cfg.layer_types) == 4  # the dense config is left as it was


def test_microbatch_checks():
    check_microbatches("1F1B", 4, 4, 4, 1)
    check_microbatches("Interleaved1F1B", 8, 2, 4, 2)
    check_microbatches("InterleavedZeroBubble", 4, 2, 4, 2)
    check_microbatches("ZBVZeroBubble", 2, 2, 4, 2, "v")
    check_microbatches("DualPipeV", 4, 2, 4, 2, "v")
    for args, match in ((("1F1B", 2, 4, 4, 1), "at least as many microbatches"),
                        (("GPipe", 4, 2, 4, 2), "one stage per rank"),
                        (("Interleaved1F1B", 5, 2, 4, 2), "multiple of its rounds"),
                        (("InterleavedZeroBubble", 5, 2, 4, 2), "multiple of its rounds"),
                        (("DualPipeV", 3, 2, 4, 2, "v"), "at least as many microbatches"),
                        (("DualPipeV", 4, 2, 4, 2), "placed 'v'"), (("1F1B", 4, 4, 8, 2, "v"), "one stage per rank"),
                        (("Interleaved1F1B", 4, 2, 4, 2, "v"), "placed 'loop'"),
                        (("ZBVZeroBubble", 4, 2, 6, 3, "v"), "exactly two stages per rank"),
                        (("LoopedBFS", 4, 2, 4, 2), "not built"), (("gpipe", 4, 2, 2, 1), "use one of"),
                        (("GPipe", 0, 2, 2, 1), "positive integer")):
        with pytest.raises(PipelineError, match=match):
            check_microbatches(*args)


def test_stage_keeps_global_names_and_runs_the_hf_forward():
    torch.manual_seed(0)
    model = _gpt2().double().eval()
    plan = pipeline_plan(model, load_recipe("gpt2"))
    first = build_stage(model, plan, range(0, 2), 0, 2, tied=True)
    last = build_stage(model, plan, range(2, 4), 1, 2, tied=True)
    names = [n for n, _ in last.model.named_parameters()]
    assert "transformer.h.2.attn.c_attn.weight" in names and "transformer.h.0.ln_1.weight" not in names
    assert "lm_head.weight" in names and not any(n.startswith("transformer.wte") for n in names)
    assert first.model.lm_head is None and "transformer.h.1.mlp.c_fc.weight" in dict(first.model.named_parameters())
    assert len(model.transformer.h) == 4 and model.lm_head is not None  # the model is left as it was
    ids = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(last(first(ids)), model(ids).logits, atol=1e-12, rtol=0)


def test_logit_ops_and_router_aux_loss_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tpify.pipeline.split import _check_model

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                           final_logit_softcapping=30.0))
    with pytest.raises(PipelineError, match="final_logit_softcapping"):
        _check_model(gemma)
    llama = _llama()
    _check_model(llama)  # nothing applied to its logits
    llama.config.output_router_logits = True
    with pytest.raises(PipelineError, match="output_router_logits"):
        _check_model(llama)


def test_encoders_and_encoder_decoders_are_refused_by_name():
    """BERT (masked LM, even with a [pipeline] table that names its head) and T5: the pipeline's loss
    shifts labels as a causal LM's and its stages run the causal forward, so they are refused."""
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32))
    table = {"model_type": "bert", "rule": [{"match": "embeddings.word_embeddings", "style": "embedding_rowwise"}],
             "pipeline": {"layers": "encoder", "first": {"embeddings": "absent"}, "last": {}, "head": "cls"}}
    with pytest.raises(PipelineError, match=r"BertForMaskedLM \(bert\): tpify.pipeline cuts causal language models"):
        pipeline_plan(bert, load_recipe(table))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2))
    with pytest.raises(PipelineError, match="encoder-decoder"):
        pipeline_plan(t5, None)
