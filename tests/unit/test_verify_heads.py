"""Which head classes ``tpify verify`` runs: each class once, although transformers lists some
classes under several tasks (its rows are named by the class, so a second case printed every row
twice: ``tpify verify llama4`` showed its one failing row twice)."""

import pytest

from tpify.authoring.target import family_head_classes, resolve_config
from tpify.authoring.verify import _plan_cases, _select_heads, Target

# model_type -> (the class transformers lists under several tasks, the task verify runs it as)
LISTED_TWICE = {
    "llama4": ("Llama4ForConditionalGeneration", "image-text-to-text"),  # base and image-text-to-text
    "gemma3": ("Gemma3ForConditionalGeneration", "image-text-to-text"),  # causal-lm and image-text-to-text
    "bart": ("BartForConditionalGeneration", "seq2seq-lm"),  # masked-lm and seq2seq-lm
    "xlm": ("XLMWithLMHeadModel", "causal-lm"),  # causal-lm and masked-lm
}


@pytest.mark.parametrize("model_type", sorted(LISTED_TWICE))
def test_verify_runs_a_class_listed_under_several_tasks_once(model_type):
    config = resolve_config(model_type)
    name, task = LISTED_TWICE[model_type]
    listed = [t for t, c in family_head_classes(config).items() if c.__name__ == name]
    assert len(listed) >= 2, listed  # the premise: transformers lists it more than once
    heads = _select_heads(config, None)
    names = [c.__name__ for _, c in heads]
    assert len(names) == len(set(names)), names
    assert (task, name) in [(t, c.__name__) for t, c in heads]
    # asked for by both of its tasks, it still runs once
    assert [c.__name__ for _, c in _select_heads(config, listed)] == [name]


def test_verify_llama4_plans_one_case_so_each_row_prints_once():
    cases, failed = _plan_cases(Target("llama4"), 2)
    assert not failed
    assert [(c.cls.__name__, c.task) for c in cases] == [("Llama4ForConditionalGeneration", "image-text-to-text")]
