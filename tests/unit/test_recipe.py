"""Recipe parsing and validation, one process."""

import copy
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
import tputil
from tpify.layout import build_layout
from tpify.recipe import Recipe, RecipeError, available_recipes, load_recipe


def test_shipped_recipes_load():
    assert {"bert", "gpt2"} <= set(available_recipes())
    for name in available_recipes():
        assert load_recipe(name).model_type == name


@pytest.mark.parametrize("rule, needle", [
    ({"style": "colwise"}, "needs 'match'"),
    ({"match": "a", "style": "sideways"}, "unknown style 'sideways'"),
    ({"match": "a"}, "needs a 'style' or a 'divide'"),
    ({"match": "a", "style": "colwise", "parts": 3}, "'parts' is only for style 'packed_colwise'"),
    ({"match": "a", "style": "packed_colwise"}, "needs 'parts'"),
    ({"match": "a", "style": "packed_colwise", "parts": 1}, "'parts' must be an integer >= 2"),
    ({"match": "a", "style": "colwise", "extra": 1}, "unknown keys ['extra']"),
    ({"match": "a", "divide": "num_heads"}, "'divide' must be a list"),
    ({"match": "a", "style": "replicate", "params": {"w": {"dim": 0}}}, "'params' of style 'replicate' must be a list"),
    ({"match": "a", "style": "colwise", "params": ["w"]}, "'params' is only for styles"),
    ({"match": "a", "style": "colwise", "identity_from": 4}, "'identity_from'"),
    ({"match": "a", "style": "experts", "params": {"w": {"dim": 1}}, "identity_from": -1}, "'identity_from'"),
])
def test_malformed_rules_are_named(rule, needle):
    with pytest.raises(RecipeError, match="rule #0") as err:
        Recipe.from_dict({"model_type": "x", "rule": [rule]}, "test.toml")
    assert needle in str(err.value) and "test.toml" in str(err.value)


def test_invalid_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("model_type = \n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(path)


def test_unmatched_rule_warns_and_optional_does_not():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # optional head rules (score, classifier) must not warn
        tpify.parallelize(model)
    import tomllib
    from tpify.recipe import recipe_dirs

    data = tomllib.loads((recipe_dirs()[0] / "gpt2.toml").read_text())
    data["rule"].append({"match": "nothing.here", "style": "replicate"})
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8))
    with pytest.warns(UserWarning, match="matched no module"):
        tpify.parallelize(model, recipe=data)


def test_two_styled_rules_on_one_module_is_an_error():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8))
    data = {"model_type": "gpt2", "rule": [{"match": "**", "style": "replicate"},
                                           {"match": "lm_head", "style": "colwise_rep"}]}
    with pytest.raises(tpify.PlanError, match="several styled rules"):
        build_layout(model, Recipe.from_dict(data), 1)


def test_recipes_ship_inside_the_wheel(tmp_path):
    """A wheel carries the recipes as tpify/recipes/*.toml and installs no top-level 'recipes'."""
    names = tputil.build_wheel(tmp_path).namelist()
    assert {"tpify/recipes/gpt2.toml", "tpify/recipes/bert.toml"} <= set(names)
    assert not any(n.startswith("recipes/") for n in names)


# ---- recipe keys of the layout issue: packed parts kept whole, per-head inputs, subclasses

@pytest.mark.parametrize("rule, needle", [
    ({"match": "a", "style": "colwise", "replicated_parts": [1]}, "'replicated_parts' is for style 'packed_colwise'"),
    ({"match": "a", "style": "packed_colwise", "parts": 3, "replicated_parts": [0, 1, 2]}, "some, not all"),
    ({"match": "a", "style": "packed_colwise", "parts": 3, "replicated_parts": [3]}, "below 3"),
    ({"match": "a", "style": "packed_colwise", "parts": ["n", 0]}, "positive integer"),
    ({"match": "a", "head_inputs": [{"arg": "alibi", "dim": 0}]}, "'head_inputs' must be a list"),
    ({"match": "a", "head_inputs": {"arg": "alibi", "dim": 0, "heads": "n"}}, "'head_inputs' must be a list"),
])
def test_malformed_new_rule_keys_are_named(rule, needle):
    with pytest.raises(RecipeError, match="rule #0") as err:
        Recipe.from_dict({"model_type": "x", "rule": [rule]}, "test.toml")
    assert needle in str(err.value)


@pytest.mark.parametrize("entry", [{"forward": "magic"}, {"forward": "scaled"}, {"forward": "plain", "scale": "s"}])
def test_malformed_subclasses_are_named(entry):
    with pytest.raises(RecipeError, match=r"\[subclasses\] MyLinear"):
        Recipe.from_dict({"model_type": "x", "subclasses": {"MyLinear": entry},
                          "rule": [{"match": "a", "style": "colwise"}]}, "test.toml")


def _falcon(**kw):
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=101,
                                          **kw))


def test_a_subclass_that_overrides_forward_is_refused_unless_the_recipe_declares_it():
    data = load_recipe("falcon")
    recipe = Recipe.from_dict({k: v for k, v in _raw("falcon").items() if k != "subclasses"}, "nosub.toml")
    with pytest.raises(tpify.PlanError, match="FalconLinear.*overrides forward.*\\[subclasses\\]"):
        build_layout(_falcon(), recipe, 2)
    assert build_layout(_falcon(), data, 2).modules["transformer.h.0.self_attention.query_key_value"].replicated_parts \
        == (1, 2)


def test_parts_weighed_by_a_config_value_the_module_does_not_use_are_refused():
    # Falcon multi-query: config.num_kv_heads = 4, the attention module uses 1 K/V head; a recipe
    # weighing [q | k | v] by the config would mis-split the weight and fail later inside HF code.
    raw = _raw("falcon")
    for rule in raw["rule"]:
        if rule.get("style") == "packed_colwise":
            rule["parts"] = ["num_attention_heads", "num_kv_heads", "num_kv_heads"]
    with pytest.raises(tpify.PlanError, match=r"config.num_kv_heads = 4, but the module .*num_kv_heads = 1"):
        build_layout(_falcon(num_kv_heads=4), Recipe.from_dict(raw, "bad.toml"), 2)


def test_head_inputs_name_an_argument_the_module_takes_and_a_divisible_head_count():
    raw = _raw("bloom")
    for rule in raw["rule"]:
        if "head_inputs" in rule:
            rule["head_inputs"] = [{"arg": "alibi_slopes", "dim": 0, "heads": "n_head"}]
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=24, n_head=6, vocab_size=101))
    # BloomAttention.forward takes **kwargs, so a misspelt name passes planning; the first call refuses it.
    misspelt = tpify.parallelize(copy.deepcopy(bloom), tp_size=1, recipe=Recipe.from_dict(raw, "bad.toml"))
    with pytest.raises(ValueError, match="called without argument 'alibi_slopes'"):
        misspelt(torch.tensor([[5, 6, 7]]))
    with pytest.raises(tpify.PlanError, match=r"config.n_head \(heads of .*'alibi'\) = 6 is not divisible by tp_size = 4"):
        build_layout(bloom, load_recipe("bloom"), 4)
    layout = build_layout(bloom, load_recipe("bloom"), 2)
    assert layout.head_inputs == {"transformer.h.0.self_attention": (("alibi", 0, 6),)}


def _raw(name):
    import tomllib
    from tpify.recipe import recipe_dirs

    path = next(d / f"{name}.toml" for d in recipe_dirs() if (d / f"{name}.toml").is_file())
    return tomllib.loads(path.read_text())


def test_uncovered_modules_do_not_suggest_tp_sizes_and_too_few_kv_heads_say_so():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # tp 6 neither divides 4 KV heads nor is a multiple of them (tp 4 or 12 would hold each on 1 or 3 ranks)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, hidden_size=48, num_attention_heads=12,
                                         num_key_value_heads=4, intermediate_size=48, vocab_size=101))
    with pytest.raises(tpify.PlanError) as err:
        build_layout(model, load_recipe("qwen2"), 6)
    message = str(err.value)
    assert "4 KV heads at tp_size = 6: tp_size must divide the KV heads" in message
    assert "tp sizes that would work for this model: [1, 2, 4, 12]" in message
    raw = {"model_type": "qwen2", "rule": [{"match": "embed_tokens", "style": "embedding_rowwise"}]}
    with pytest.raises(tpify.PlanError) as err:
        build_layout(model, Recipe.from_dict(raw, "partial.toml"), 1)
    assert "covered by no rule" in str(err.value) and "tp sizes that would work" not in str(err.value)


def test_rule_index_finds_what_trying_every_rule_finds():
    """RuleIndex files patterns by their literal segments; it must find exactly what a scan does."""
    import random

    from tpify.recipe import Rule, RuleIndex

    rng = random.Random(0)
    segments = ["h", "0", "attn", "c_attn", "*", "**", "?", "a*", "*n", ""]
    for _ in range(40):
        rules = [Rule(i, tuple(".".join(rng.choice(segments) for _ in range(rng.randint(1, 4)))
                               for _ in range(rng.randint(1, 3))), "replicate") for i in range(20)]
        index = RuleIndex(rules)
        for _ in range(20):
            name = ".".join(rng.choice(["h", "0", "attn", "c_attn", "an", "a", ""]) for _ in range(rng.randint(1, 5)))
            assert [r.index for r in index.hits(name)] == [r.index for r in rules if r.matches(name)], name


def test_a_recipe_of_20000_rules_is_matched_without_comparing_rules_or_trying_each_per_module(monkeypatch):
    """Matching is linear in the rules: no Rule equality (a list membership test made it quadratic,
    over 200 s for 20,000 rules), and a module is tried only against the rules that can match it."""
    from tpify.recipe import Rule

    data = _raw("gpt2")
    shipped = len(data["rule"])
    for i in range(5000):
        data["rule"] += [{"match": f"extra.{i}", "style": "replicate", "optional": True},
                         {"match": f"h.*.attn.x{i}", "style": "replicate", "optional": True},
                         {"match": f"**.y{i}", "style": "replicate", "optional": True},
                         {"match": ["h.*", f"h.*.z{i}"], "style": "replicate",
                          "when": {"n_layer": 99}}]  # inactive: takes no part
    data["rule"].append({"match": "nowhere", "style": "replicate"})
    recipe = Recipe.from_dict(data)
    assert len(recipe.rules) == shipped + 20001
    tried = []
    monkeypatch.setattr(Rule, "__eq__", lambda self, other: pytest.fail("build_layout compared two Rule objects"))
    matches = Rule.matches
    monkeypatch.setattr(Rule, "matches", lambda self, fqn: tried.append(self.index) or matches(self, fqn))
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=8))
    layout = build_layout(model, recipe, 2)
    assert [r.patterns for r in layout.unmatched_rules] == [("nowhere",)]
    assert layout.modules["transformer.h.1.attn.c_attn"].style == "packed_colwise"
    # Only the shipped globs (h.*.attn.c_attn, ...) are tried, never the 15,000 added rules that
    # cannot match by their literal segments; a scan would try 20,000 rules for each of 33 modules.
    assert all(i < shipped for i in tried) and len(tried) < 33 * shipped


def test_loss_terms_are_parsed_and_malformed_ones_refused():
    """``[loss] terms``: what HF adds to the LM loss (a mixture of experts' aux loss), declared."""
    from types import SimpleNamespace

    from tpify.recipe import Recipe, RecipeError, loss_terms_of

    base = {"model_type": "x", "rule": [{"match": "a", "style": "replicate"}]}
    recipe = Recipe.from_dict({**base, "loss": {"causal": ["A"], "terms": [
        {"output": "aux_loss", "coefficient": "router_aux_loss_coef"}, {"output": "z_loss", "coefficient": 0.5}]}})
    assert recipe.loss == {"A": "causal"}
    assert recipe.loss_terms == (("aux_loss", "router_aux_loss_coef"), ("z_loss", 0.5))
    for bad in ([{"output": "aux_loss"}], [{"output": "", "coefficient": 1}], "aux_loss",
                [{"output": "a", "coefficient": True}], [{"output": "a", "coefficient": "c", "extra": 1}]):
        with pytest.raises(RecipeError, match=r"\[loss\] terms must be a list of"):
            Recipe.from_dict({**base, "loss": {"terms": bad}})
    moe = SimpleNamespace(router_aux_loss_coef=0.01, output_router_logits=False)
    assert loss_terms_of(moe) == [{"output": "aux_loss", "coefficient": "router_aux_loss_coef"}]
    assert loss_terms_of(SimpleNamespace(hidden_size=8)) == []


def test_a_recipe_name_with_path_separators_is_refused_not_read(tmp_path, monkeypatch):
    """A recipe given by name is looked up in the recipe folders only: ``../../x/evil`` (which
    loaded ``recipes/../../x/evil.toml``) is refused before any file is read; the same file
    given as a path (ending in .toml, or a pathlib.Path) is read."""
    import os
    from pathlib import Path

    from tpify.recipe import recipe_dirs

    evil = tmp_path / "x" / "evil.toml"
    evil.parent.mkdir()
    evil.write_text(Path(recipe_dirs()[0] / "gpt2.toml").read_text())
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(evil.with_suffix(""), recipe_dirs()[0])  # ../../.../x/evil from the recipe folder
    for name in (relative, "../gpt2", "x/evil", "x\\evil", "..", ".hidden", "", "/etc/passwd", "gpt2/"):
        with pytest.raises(tpify.RecipeError, match=r"is not a recipe name .* Pass a file as a path ending in \.toml"):
            tpify.load_recipe(name)
    assert tpify.load_recipe(str(evil)).model_type == "gpt2"  # a path, passed as one
    assert tpify.load_recipe(evil).model_type == "gpt2"
    assert tpify.load_recipe(Path("x/evil.toml")).source == "x/evil.toml"
    no_suffix = tmp_path / "plain"
    no_suffix.write_text(evil.read_text())
    assert tpify.load_recipe(no_suffix).model_type == "gpt2"  # an existing file given as a Path
    with pytest.raises(tpify.RecipeError, match="does not exist"):
        tpify.load_recipe(Path("gpt2"))  # a Path is a path, never a name
    assert tpify.load_recipe("gpt2").model_type == "gpt2"
    with pytest.raises(tpify.RecipeError, match="no tpify recipe for model_type 'no_such_family'"):
        tpify.load_recipe("no_such_family")


def test_replicate_params_root_match_identity_and_summed_grads_read_back():
    """``replicate`` with ``params`` (its own parameters whole, not a container), ``match = ""`` (the
    base model itself), the experts rule's ``identity_from`` and the ``replicate_sum_grads`` style."""
    from tpify.styles import WHOLE

    recipe = Recipe.from_dict({"model_type": "x", "rule": [
        {"match": "", "style": "replicate", "params": ["pos_table", "cls"]},
        {"match": "layers.*.mlp.experts", "style": "experts", "params": {"down_proj": {"dim": 2}},
         "identity_from": "n_routed_experts"},
        {"match": "layers.*.self_attn.k_rope_only_layernorm", "style": "replicate_sum_grads"}]}, "test.toml")
    root, experts, norm = recipe.rules
    assert root.patterns == ("",) and root.params == (("cls", WHOLE, 1), ("pos_table", WHOLE, 1))
    assert experts.identity_from == "n_routed_experts" and norm.style == "replicate_sum_grads"
