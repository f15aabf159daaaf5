"""``tpify plan --pp``: the stages, their layers and modules, and the bytes per rank equal the real
stages' (one process: each pipeline rank's model cut by tpify.pipeline's own trim, at tp 1)."""

import copy

import pytest
import torch

from tpify.authoring.plan_pipeline import pipeline_report
from tpify.pipeline.plan import PipelineError, layer_ranges, pipeline_plan, stage_indices
from tpify.pipeline.stage import trim_model


def _tiny_llama(path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def _real_bytes(model, pp, n_virtual, rank):
    """Bytes of the parameters a pipeline rank holds: the model cut as tpify.pipeline cuts it."""
    from tpify.api import resolve_recipe

    plan = pipeline_plan(model, resolve_recipe(model, None))
    ranges = layer_ranges(len(model.model.layers), pp * n_virtual)
    mine = stage_indices(rank, pp, n_virtual, "loop")
    cut = copy.deepcopy(model)
    trim_model(cut, plan, {i for s in mine for i in ranges[s]}, first=0 in mine, last=len(ranges) - 1 in mine)
    return sum(p.numel() * p.element_size() for p in cut.parameters())  # tied ones once (parameters() dedupes)


SLOW = pytest.mark.slow  # the quick subset keeps one case (tied head, interleaved)


@pytest.mark.parametrize("tied,pp,schedule", [
    (True, 2, "Interleaved1F1B"),
    pytest.param(False, 2, "Interleaved1F1B", marks=SLOW), pytest.param(True, 2, "1F1B", marks=SLOW),
    pytest.param(False, 2, "1F1B", marks=SLOW), pytest.param(True, 3, "GPipe", marks=SLOW),
    pytest.param(False, 3, "GPipe", marks=SLOW)])
def test_bytes_equal_the_real_stages(tmp_path, tied, pp, schedule):
    model = _tiny_llama(tmp_path, tied)
    report = pipeline_report(str(tmp_path), 1, pp, schedule=schedule)
    nv = 2 if schedule == "Interleaved1F1B" else 1
    assert [r["rank_bytes"] for r in report["ranks"]] == [_real_bytes(model, pp, nv, r) for r in range(pp)]
    assert report["dense_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    stages = [s for r in report["ranks"] for s in r["stages"]]
    assert sorted(s["stage"] for s in stages) == list(range(pp * nv))
    by_stage = {s["stage"]: s for s in stages}
    assert by_stage[0]["modules"] == ["model.embed_tokens"] and by_stage[0]["layers"][0] == 0
    assert by_stage[pp * nv - 1]["modules"] == ["model.norm", "lm_head"] and by_stage[pp * nv - 1]["layers"][1] == 4


def test_tp2_halves_the_sharded_bytes(tmp_path):
    """At tp 2 each stage's linear weights and vocab rows are halved; norms stay whole."""
    _tiny_llama(tmp_path, False)
    one = pipeline_report(str(tmp_path), 1, 2)["ranks"]
    two = pipeline_report(str(tmp_path), 2, 2)["ranks"]
    for a, b in zip(one, two):
        assert a["rank_bytes"] / 2 < b["rank_bytes"] < a["rank_bytes"] * 0.52


def test_command_and_refusal(tmp_path, capsys):
    from tpify.cli import main

    _tiny_llama(tmp_path, True)
    assert main(["plan", str(tmp_path), "--tp", "1", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "5 layers in 2 stages on pp 2 x tp 1" in out and "model.norm, lm_head" in out
    assert main(["plan", str(tmp_path), "--tp", "1", "--pp", "6"]) == 1
    assert "6 pipeline stages but the model has 5 layers" in capsys.readouterr().err
    with pytest.raises(PipelineError):
        pipeline_report(str(tmp_path), 1, 3, schedule="Interleaved1F1B")
