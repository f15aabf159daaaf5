"""tpify.surgery.apply_layout on tiny Hugging Face models built from configs, in one process.

A layout at tp 2 or 4 is applied with a fake context: ``TPContext(None)`` whose ``size`` and
``rank`` are set by hand (building a layer only slices the dense weights, no collective runs), so
every rank's surgery is checked in this one process. What it proves, on GPT-2 (Conv1D, packed
``[Q | K | V]``, an LM head tied to the embedding), Llama (separate q/k/v, grouped-query, untied
and tied heads), BERT (``cls.predictions.bias``, a plain module holding the decoder's bias) and
Phi-3 (``divide_config``):

* every module the layout splits is replaced by its style's layer, built in the given context;
  no dense ``nn.Linear``/``Conv1D``/``nn.Embedding`` is left where the layout splits, and
  ``replicate`` modules are the very same objects as before;
* every parameter of the model is exactly this rank's slice of the dense one, by the spec the
  layout holds for it, and carries that spec (``None``: a full copy, no spec);
* tied parameters are still one object (GPT-2's ``lm_head.weight is transformer.wte.weight``,
  tied Llama), any plain module holding a tied parameter is re-pointed to the new one (BERT),
  and a tie the layout's styles would shard to different shapes is refused;
* the module attributes the layout divides (GPT-2's ``num_heads``, ``split_size``; Phi-3's
  ``num_key_value_heads``) and its ``config_divides`` (Phi-3's ``num_attention_heads``) are divided,
  nothing else;
* a context whose size is not the layout's is refused (``PlanError``) before anything changes;
  a non-optional rule that matched nothing warns; surgery adds no hook of any kind;
* at tp 1 the swapped model computes the dense model's logits.

Tolerance: none for weights and sizes (slices are copied, compared bitwise). The tp 1 logits use
float64 with ``atol=rtol=1e-12``: the row-parallel layer adds its bias after the matmul where the
dense Conv1D fuses it into ``addmm``, so only the order of the additions differs (a few ulps of
values of order 1).
"""

import copy
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Phi3Config, Phi3ForCausalLM)
from transformers.pytorch_utils import Conv1D

from tpify.context import TPContext
from tpify.layers import ColumnParallelInput, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpify.layout import PlanError, build_layout
from tpify.recipe import Recipe, load_recipe
from tpify.sharding import ShardSpec, shard_spec_of
from tpify.surgery import apply_layout

LAYER_CLASSES = {"colwise": ColumnParallelLinear, "packed_colwise": ColumnParallelLinear,
                 "colwise_rep": ColumnParallelLinear, "rowwise": RowParallelLinear,
                 "embedding_rowwise": VocabParallelEmbedding}
TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=50, n_positions=16))


def _llama(tied=False):
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                        tie_word_embeddings=tied, **TOKENS))


def _bert():
    return BertForMaskedLM(BertConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, vocab_size=50, max_position_embeddings=16))


def _phi3():
    return Phi3ForCausalLM(Phi3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50, **TOKENS))


MODELS = {"gpt2": _gpt2, "llama": _llama, "llama-tied": lambda: _llama(tied=True), "bert": _bert, "phi3": _phi3}
RECIPES = {"gpt2": "gpt2", "llama": "llama", "llama-tied": "llama", "bert": "bert", "phi3": "phi3"}


def _fake_context(tp, rank, **kwargs):
    """What rank ``rank`` of a ``tp``-rank group would use, in one process (see the module docstring)."""
    ctx = TPContext(None, **kwargs)
    ctx.size, ctx.rank = tp, rank
    return ctx


def _split(name, tp, rank, recipe=None):
    """``(dense copy, model after surgery, layout, ctx)`` of rank ``rank`` at ``tp``."""
    torch.manual_seed(0)
    model = MODELS[name]()
    dense = copy.deepcopy(model)
    layout = build_layout(model, load_recipe(recipe or RECIPES[name]), tp)
    ctx = _fake_context(tp, rank)
    apply_layout(model, layout, ctx)
    return dense, model, layout, ctx


CASES = [("gpt2", 2, 0), ("gpt2", 2, 1), ("gpt2", 4, 3), ("llama", 2, 1), ("llama-tied", 2, 0), ("bert", 2, 1),
         ("phi3", 2, 1)]
IDS = [f"{n}-tp{tp}-rank{r}" for n, tp, r in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def split(request):
    name, tp, rank = request.param
    return (name,) + _split(name, tp, rank)


def _is_dense_layer(module):
    return isinstance(module, (nn.Linear, nn.Embedding, Conv1D))


def test_each_split_module_is_its_styles_layer_in_the_given_context(split):
    name, dense, model, layout, ctx = split
    assert layout.sharded(), "the layout splits something"
    dense_modules = dict(dense.named_modules())
    for fqn, entry in layout.modules.items():
        module = model.get_submodule(fqn)
        if entry.styler.shards:
            assert type(module) is LAYER_CLASSES[entry.style], fqn
            assert module.ctx is ctx and (module.tp_size, module.tp_rank) == (ctx.size, ctx.rank), fqn
        else:
            assert type(module) is type(dense_modules[fqn]), f"{fqn} ({entry.style}) is left as it is"
    left = {fqn for fqn, m in model.named_modules() if _is_dense_layer(m)}
    assert left == {fqn for fqn, e in layout.modules.items() if not e.styler.shards}, "no dense layer where split"


def test_replicated_modules_are_the_same_objects_after_surgery():
    torch.manual_seed(0)
    model = _gpt2()
    before = dict(model.named_modules())
    layout = build_layout(model, load_recipe("gpt2"), 2)
    apply_layout(model, layout, _fake_context(2, 0))
    for fqn in ("transformer.wpe", "transformer.h.0.ln_1", "transformer.ln_f", "transformer.h.1.attn",
                "transformer.h.1.mlp", "transformer"):
        assert model.get_submodule(fqn) is before[fqn], fqn


def _same_split(a, b):
    """Two specs that put the same rows on every rank: a vocabulary split records its unpadded
    size as ``padded_size`` (embedding_rowwise) or as None (colwise_rep); the tie check of the
    layout compares them alike."""
    if a is None or b is None:
        return a is b
    key = lambda s: (s.dim, s.parts, s.tp_size, s.padded_size or s.global_size, s.replicated)  # noqa: E731
    return key(a) == key(b)


def test_every_parameter_is_this_ranks_slice_by_the_layouts_spec(split):
    """A tied parameter is one object with one spec: the one the layout gives some holder of it
    (GPT-2's wte and lm_head give the same split; BERT's cls.predictions.bias is held by a module
    the layout does not list, and carries its decoder's)."""
    name, dense, model, layout, ctx = split
    specs = layout.param_specs()
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) == set(dense_params), "the same parameter names (the checkpoint's)"
    aliases = {}
    for fqn, param in params.items():
        aliases.setdefault(id(param), []).append(fqn)
    for fqn, param in params.items():
        given = [specs[a] for a in aliases[id(param)] if a in specs] or [None]
        spec, full = shard_spec_of(param), dense_params[fqn].detach()
        assert spec in given, f"{fqn}: the parameter carries a spec the layout gives it ({given})"
        assert all(_same_split(spec, g) for g in given), f"{fqn}: its holders split it alike"
        expected = full if spec is None else spec.slice_dense(full, ctx.rank)
        assert param.shape == expected.shape and torch.equal(param.detach(), expected), fqn
        assert param.requires_grad, fqn


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_lm_head_stays_tied_to_the_embedding_shard(tp):
    _, model, layout, _ = _split("gpt2", tp, tp - 1)
    assert model.lm_head.weight is model.transformer.wte.weight
    local = 25 if tp == 2 else 13  # 50 rows, padded to 52 at tp 4
    assert model.lm_head.weight.shape == (local, 16)
    assert shard_spec_of(model.lm_head.weight) == ShardSpec(0, (50,), tp, None if tp == 2 else 52)
    assert len([p for p in model.parameters()]) == len(list(_gpt2().parameters())), "no untied copy"


def test_llama_heads_stay_tied_or_untied_as_they_were():
    _, tied, _, _ = _split("llama-tied", 2, 1)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    _, untied, _, _ = _split("llama", 2, 1)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_a_plain_module_holding_a_tied_parameter_is_repointed():
    """BertLMPredictionHead holds ``bias``, the very parameter its ``decoder`` (colwise_rep) holds:
    after surgery it holds the decoder's shard, not the dense bias."""
    dense, model, _, ctx = _split("bert", 2, 1)
    head = model.cls.predictions
    assert isinstance(head.decoder, ColumnParallelLinear)
    assert head.bias is head.decoder.bias and head.bias.shape == (25,)
    assert torch.equal(head.bias.detach(), dense.cls.predictions.bias.detach()[25:])
    assert head.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_a_tie_sharded_to_different_shapes_is_refused():
    """The layout refuses conflicting tied styles first (test_tied_styles.py); surgery checks the
    shapes of what it builds all the same: here a layout altered to pad the LM head alone."""
    torch.manual_seed(0)
    model = _gpt2()
    layout = build_layout(model, load_recipe("gpt2"), 2)
    layout.modules["lm_head"].padded_size = 52
    with pytest.raises(PlanError, match=r"lm_head\.weight is tied to a parameter sharded to shape \(25, 16\), but "
                                        r"its own style gives \(26, 16\)"):
        apply_layout(model, layout, _fake_context(2, 0))


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_attention_attributes_are_divided(tp):
    dense, model, layout, _ = _split("gpt2", tp, 0)
    assert layout.divides == {f"transformer.h.{i}.attn": ("num_heads", "split_size") for i in range(2)}
    for i in range(2):
        attn = model.transformer.h[i].attn
        assert (attn.num_heads, attn.split_size, attn.head_dim) == (4 // tp, 16 // tp, 4), "head_dim is not divided"
    assert (model.config.n_head, model.config.n_embd) == (4, 16), "no config value divided (none listed)"
    assert layout.config_divides == {}


def test_phi3_config_divides_and_module_attributes_are_divided():
    dense, model, layout, _ = _split("phi3", 2, 1)
    assert layout.config_divides == {"num_attention_heads": 4}, "the layout keeps the dense value (saving writes it)"
    assert model.config.num_attention_heads == 2
    assert model.model.layers[0].self_attn.num_key_value_heads == 1
    assert model.config.num_key_value_heads == 2 and dense.config.num_attention_heads == 4


@pytest.mark.parametrize("size", [1, 4])
def test_a_context_of_another_size_is_refused_before_anything_changes(size):
    torch.manual_seed(0)
    model = _gpt2()
    types = {fqn: type(m) for fqn, m in model.named_modules()}
    layout = build_layout(model, load_recipe("gpt2"), 2)
    ctx = TPContext(None) if size == 1 else _fake_context(size, 0)
    with pytest.raises(PlanError, match=f"the layout is for tp_size = 2 but tp_group has {size} ranks"):
        apply_layout(model, layout, ctx)
    assert {fqn: type(m) for fqn, m in model.named_modules()} == types
    assert model.transformer.h[0].attn.num_heads == 4


def test_a_rule_that_matched_nothing_warns_and_the_shipped_recipe_does_not():
    data = tomllib.loads((Path(__file__).resolve().parents[2] / "recipes" / "gpt2.toml").read_text())
    data["rule"].append({"match": "nothing.here", "style": "replicate"})
    recipe = Recipe.from_dict(data, "extra.toml")
    model = _gpt2()
    layout = build_layout(model, recipe, 2)
    assert [r.patterns for r in layout.unmatched_rules] == [("nothing.here",)]
    index = len(data["rule"]) - 1
    with pytest.warns(UserWarning, match=rf"tpify: rule #{index} \(match=\['nothing.here'\]\) of recipe extra.toml "
                                         rf"matched no module of GPT2LMHeadModel"):
        apply_layout(model, layout, _fake_context(2, 0))
    model = _gpt2()
    layout = build_layout(model, load_recipe("gpt2"), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # optional rules (cross-attention, task heads) stay silent
        apply_layout(model, layout, _fake_context(2, 0))


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _hooks(model):
    modules = {fqn: {d: dict(getattr(m, d)) for d in _HOOK_DICTS} for fqn, m in model.named_modules()}
    params = {fqn: (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None))
              for fqn, p in model.named_parameters()}
    import torch.nn.modules.module as mm

    globals_ = [dict(getattr(mm, n)) for n in dir(mm) if n.startswith("_global_") and n.endswith("hooks")]
    return modules, params, globals_


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_surgery_adds_no_hook(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    modules, params, globals_ = _hooks(model)
    layout = build_layout(model, load_recipe(RECIPES[name]), 2)
    apply_layout(model, layout, _fake_context(2, 1, region_input=ColumnParallelInput()))
    after_modules, after_params, after_globals = _hooks(model)
    assert after_globals == globals_
    for fqn, hooks in after_modules.items():
        assert hooks == modules[fqn], f"{fqn}: hooks added or removed"
    assert all(h == (None, None) for h in after_params.values())
    assert set(after_params) == set(params)


def test_at_tp1_the_swapped_model_computes_the_dense_logits():
    """Surgery alone (no hooks) at tp 1: the layers' maths is the dense modules'. float64;
    atol=rtol=1e-12 (see the module docstring)."""
    torch.manual_seed(0)
    model = _gpt2().double().eval()
    dense = copy.deepcopy(model)
    layout = build_layout(model, load_recipe("gpt2"), 1)
    apply_layout(model, layout, TPContext(None, region_input=ColumnParallelInput()))
    assert isinstance(model.transformer.h[0].attn.c_attn, ColumnParallelLinear)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-12, rtol=1e-12)
