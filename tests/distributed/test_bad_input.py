"""Bad input raises a clear error on every rank, at the same point, and nothing hangs."""

import pytest
import torch
from transformers import GPT2Config, GPT2Model

import tputil

pytestmark = pytest.mark.slow  # real models / long end-to-end runs: not in the quick subset


def _small_gpt2(**kw):
    cfg = dict(n_layer=1, n_embd=48, n_head=6, n_positions=16, vocab_size=100)
    cfg.update(kw)
    return GPT2Model(GPT2Config(**cfg))


CASES = ("heads", "uncovered", "model_type", "malformed")


def _case(case):
    from torch import nn

    import tpify

    if case == "heads":
        tpify.parallelize(_small_gpt2())  # 6 heads over 4 ranks
    elif case == "uncovered":
        model = _small_gpt2(n_head=4)
        model.h[0].mlp.extra = nn.Linear(48, 48)
        tpify.parallelize(model)
    elif case == "model_type":
        model = _small_gpt2(n_head=4)
        model.config.model_type = "not-a-model"
        tpify.parallelize(model)
    elif case == "malformed":
        recipe = {"model_type": "gpt2", "rule": [{"match": "h.*.attn.c_attn", "style": "colwize"}]}
        tpify.parallelize(_small_gpt2(n_head=4), recipe=recipe)


def _body(rank, world):
    """Every case on the same 4 ranks (one spawn); a barrier after each shows no rank is left hanging."""
    import traceback

    outcomes = {}
    for case in CASES:
        try:
            _case(case)
            outcomes[case] = ("ok", "no error")
        except Exception as e:  # noqa: BLE001 - the error is what is tested
            outcomes[case] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        torch.distributed.barrier()
    return outcomes


_OUTCOMES = {}


def _expect(case, *needles):
    if not _OUTCOMES:
        _OUTCOMES.update(enumerate(tputil.spawn(_body, 4, timeout=180)))
    for rank in range(4):
        status, message = _OUTCOMES[rank][case]
        assert status == "error", f"rank {rank} raised nothing for {case}"
        first = message.splitlines()[0]
        for needle in needles:
            assert needle in message, f"rank {rank}: {needle!r} not in {first}"
    return _OUTCOMES[0][case][1]


def test_heads_not_divisible():
    _expect("heads", "PlanError", "config.n_head", "= 6 is not divisible by tp_size = 4", "h.0.attn.num_heads",
                  "tp sizes that would work for this model: [1, 2, 3, 6]")


def test_uncovered_linear():
    _expect("uncovered", "PlanError", "h.0.mlp.extra (Linear)", "covered by no rule", "'replicate'")


def test_unknown_model_type():
    _expect("model_type", "RecipeError", "'not-a-model'", "shipped recipes: ", "'bert'", "'gpt2'", "recipe=")


def test_malformed_rule():
    _expect("malformed", "RecipeError", "rule #0", "unknown style 'colwize'", "known styles")
