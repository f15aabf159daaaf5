"""Recipe parsing and validation, one process."""

import warnings

import pytest
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
