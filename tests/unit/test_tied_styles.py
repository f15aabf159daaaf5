"""Tied weights given conflicting styles are a PlanError (before anything changes), not wrong logits."""

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

import tpify


def _recipe(wte: str, head: str) -> dict:
    import tomllib
    from pathlib import Path

    raw = tomllib.loads((Path(__file__).resolve().parents[2] / "recipes" / "gpt2.toml").read_text())
    for rule in raw["rule"]:
        if rule["match"] == "wte":
            rule["style"] = wte
        if rule["match"] == "lm_head":
            rule["style"] = head
    return raw


@pytest.mark.parametrize("wte,head", [("replicate", "colwise_rep"), ("embedding_rowwise", "replicate")])
def test_tied_weights_with_conflicting_styles_are_a_plan_error(wte, head):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=16))
    with pytest.raises(tpify.PlanError, match="tied parameter .* shard it differently"):
        tpify.parallelize(model, tp_size=1, recipe=_recipe(wte, head))
    assert type(model.transformer.wte).__name__ == "Embedding", "nothing changed"


def test_tied_weights_with_matching_styles_pass():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=16))
    tpify.parallelize(model, tp_size=1, recipe=_recipe("replicate", "replicate"))
    assert model.lm_head.weight is model.transformer.wte.weight
