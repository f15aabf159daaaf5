"""Parameters held per head (style ``per_head``), gpt-oss's experts, and the families that need them.

All slow (the quick suite is at its time limit), in TWO spawned jobs and one process:

* ``tpify verify`` at tp = 2, ONE job: gpt_oss (every head class, tensor-parallel experts; its
  causal LM again with expert parallelism, ep_size = 2), neomme (every head class) and
  gemma3n_text (every head class). Their own init sets the attention sinks, the experts' biases,
  the router bias, neomme's ``alpha`` and value embeddings to zero, which would leave what a split
  of them does untested (a bias counted tp times adds tp * 0): verify gives every such constant
  seeded noise before comparing (tpify.authoring.reference.perturb_constants).
* at tp = 4, ONE job: gpt_oss's causal LM with tensor-parallel experts (each rank 1 of 4 query
  heads and its sinks, a KV head held by 2 ranks) and with expert parallelism (ep_size = 4), and
  the causal LM of a Llama whose attention holds a parameter per KV head (tests/verify_models.py
  ``KVGatedLlama*``, 2 KV heads over 4 ranks: each value held by 2 ranks, its gradient summed
  over each group: tpify.styles.per_head; without the sum its gradient is off by 0.016, measured).
* In one process (meta models, no ranks): what would be silently wrong is refused by name (a
  per-head parameter left whole by a recipe, gpt-oss's interleaved gate/up split as two parts,
  its down_proj_bias split or left out, the intermediate dimension named wrong, per_head on the
  wrong sizes), and the HF-plan import maps attention sinks under ``local_params`` to
  ``per_head`` (granite_swa) while doge stays refused with its reason.

Every verify row: outputs with a left-padding mask, the ``labels=`` loss (the causal LMs with
the router's ``aux_loss``), every gathered gradient, greedy ``generate`` (token ids identical),
save -> transformers' own load bitwise and the save/load round trip, in float64 at atol=1e-10,
rtol=1e-9 (only the order of sums differs); gemma3n_text's norms and gradients through the
float32 sections its own code has (listed in its rows) at the float32 tolerance the row states.
A wrong split is far outside: gpt-oss with down_proj_bias counted twice is off by 0.097 in the
logits (measured 2026-11-24 with that bias drawn at std 0.5; verify's perturbation draws it at
std 0.1, and the difference scales with the bias).
"""

import pytest
import torch

from tpify.authoring.verify import Target, verify_many

pytestmark = pytest.mark.slow


def _kv_gated_target(head_classes) -> Target:
    """The KV-gated Llama (4 heads, 2 KV heads) with llama's recipe plus its per-KV-head rule."""
    import tomllib

    from transformers import LlamaConfig

    from tpify.recipe import recipe_dirs

    data = tomllib.loads(next(d / "llama.toml" for d in recipe_dirs() if (d / "llama.toml").is_file()).read_text())
    data["rule"].append({"match": "layers.*.self_attn", "style": "per_head", "params": {"kv_gate": {"dim": 0}},
                         "kv_heads": "num_key_value_heads"})
    data.pop("sequence_parallel")  # proved with llama's recipe elsewhere; here the per-KV-head gradient sum
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return Target("llama", recipe=data, config=config, shrink=False, head_classes=head_classes, label="kv-gated llama")


def _problems(report, labels) -> list[str]:
    found = {r.target for r in report.rows}
    problems = [f"{label}: no rows" for label in labels if label not in found]
    return problems + [f"{r.target} {r.head} tp={r.tp} {r.check}: {r.max_diff} {r.message}"
                       for r in report.rows if not r.passed]


def _timings(report, tp):
    print(f"measured, tp = {tp}: one job {report.job_seconds.get(tp, 0):.1f} s")
    for label in sorted({r.target for r in report.rows}):
        rows = [r for r in report.rows if r.target == label and r.max_diff is not None]
        worst = max(rows, key=lambda r: r.max_diff)
        print(f"measured, tp = {tp}: {label}: largest difference {worst.max_diff:.3g} ({worst.head} {worst.check}, "
              f"{worst.tolerance})")


def test_per_head_families_are_exact_tp2():
    """ONE job at tp = 2 (see the module docstring): every row passed, every head class reported,
    the causal LMs' loss with the aux loss, generate identical, the checkpoint read by transformers."""
    gpt_oss = ["GptOssModel", "GptOssForCausalLM", "GptOssForSequenceClassification", "GptOssForTokenClassification"]
    neomme = ["NeoMMEModel", "NeoMMEForMaskedLM", "NeoMMEForRetrieval"]
    targets = [Target("gpt_oss", head_classes=gpt_oss),
               Target("gpt_oss", head_classes=["GptOssForCausalLM"], expert_parallel=True, label="gpt_oss (ep)"),
               Target("neomme", head_classes=neomme), Target("gemma3n_text")]
    report = verify_many(targets, (2,), timeout_s=900)
    _timings(report, 2)
    labels = ["gpt_oss", "gpt_oss (ep)", "neomme", "gemma3n_text"]
    problems = _problems(report, labels)
    heads = {label: {r.head for r in report.rows if r.target == label} for label in labels}
    assert heads["gpt_oss"] == set(gpt_oss), heads
    assert heads["neomme"] == set(neomme), heads
    assert heads["gemma3n_text"] == {"Gemma3nTextModel", "Gemma3nForCausalLM"}, heads
    for label in ("gpt_oss", "gpt_oss (ep)"):
        checks = {r.check for r in report.rows if r.target == label and r.head == "GptOssForCausalLM"}
        note = next(r for r in report.rows if r.target == label and r.head == "GptOssForCausalLM"
                    and r.check.startswith("dense reference:"))
        assert "sinks" in note.message and "tensors the family's init leaves constant" in note.message, note
        assert {"labels= loss (labels): aux_loss + loss", "generate (greedy token ids)"} <= checks, checks
        assert any(c.startswith("save: checkpoint weights") for c in checks), checks
    assert not problems, "\n".join(problems)


def test_gpt_oss_and_kv_head_parameters_are_exact_tp4():
    """ONE job at tp = 4: gpt_oss's causal LM with tensor-parallel experts and with expert
    parallelism (ep_size = 4), and the KV-gated Llama's causal LM (2 KV heads over 4 ranks: each
    gate held by 2 ranks, its gradient summed over them)."""
    import verify_models as vm

    targets = [Target("gpt_oss", head_classes=["GptOssForCausalLM"]),
               Target("gpt_oss", head_classes=["GptOssForCausalLM"], expert_parallel=True, label="gpt_oss (ep)"),
               _kv_gated_target([vm.KVGatedLlamaForCausalLM])]
    report = verify_many(targets, (4,), timeout_s=900)
    _timings(report, 4)
    problems = _problems(report, ["gpt_oss", "gpt_oss (ep)", "kv-gated llama"])
    grads = [r for r in report.rows if r.target == "kv-gated llama" and r.check.startswith("gradients")]
    assert grads, [r.check for r in report.rows]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Refusals, in one process (meta models): a check table, one test each.

def _meta(model_type, task="causal-lm", **changes):
    from tpify.authoring.small import small_config
    from tpify.authoring.target import head_classes, resolve_config

    config = small_config(resolve_config(model_type), (2,))
    for key, value in changes.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return head_classes(model_type)[task](config)


def _recipe(model_type, edit):
    import tomllib

    from tpify.recipe import Recipe, recipe_dirs

    data = tomllib.loads(next(d / f"{model_type}.toml" for d in recipe_dirs()
                              if (d / f"{model_type}.toml").is_file()).read_text())
    edit(data["rule"])
    return Recipe.from_dict(data, f"{model_type} (edited)")


def _drop(rules, match, style):
    rules[:] = [r for r in rules if not (r.get("match") == match and r.get("style") == style)]


def _experts_params(params):
    def edit(rules):
        next(r for r in rules if r.get("style") == "experts")["params"] = params
    return edit


_GPT_OSS = {"gate_up_proj": {"dim": 2}, "gate_up_proj_bias": {"dim": 1}, "down_proj": {"dim": 1},
            "down_proj_bias": {"after_sum": True}}

REFUSED = {  # name: (model_type, task, recipe edit, the words the PlanError must hold)
    "sinks left whole": ("gpt_oss", "causal-lm", lambda rules: _drop(rules, "layers.*.self_attn", "per_head"),
                         ["layers.0.self_attn.sinks", "holds one value per head", "style 'per_head'"]),
    "neomme alpha left whole": ("neomme", "masked-lm",
                                lambda rules: _drop(rules, "layers.*.self_attn.exclusive_self_attention", "per_head"),
                                ["exclusive_self_attention.alpha", "holds one value per head"]),
    "interleaved gate/up as two parts": ("gpt_oss", "causal-lm",
                                         _experts_params({**_GPT_OSS, "gate_up_proj": {"dim": 2, "parts": 2}}),
                                         ["interleaved", "two contiguous parts would cut it wrong"]),
    "down_proj_bias split": ("gpt_oss", "causal-lm", _experts_params({**_GPT_OSS, "down_proj_bias": {"dim": 1}}),
                             ["down_proj_bias is added to each expert's output", "after_sum = true"]),
    "down_proj_bias left out": ("gpt_oss", "causal-lm",
                                _experts_params({k: v for k, v in _GPT_OSS.items() if k != "down_proj_bias"}),
                                ["holds parameters ['down_proj_bias'] that the rule does not split"]),
    "intermediate dim named wrong": ("gpt_oss", "causal-lm",
                                     _experts_params({**_GPT_OSS, "down_proj": {"dim": 2}}),
                                     ["down_proj has its intermediate dimension at dim 1 (is_transposed = True)"]),
    "per_head on the KV heads of a query-head parameter": (
        "gpt_oss", "causal-lm",
        lambda rules: next(r for r in rules if r.get("style") == "per_head").update(kv_heads="num_key_value_heads"),
        ["do not hold one value per KV head"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_would_be_silently_wrong_is_refused(name):
    from tpify.layout import PlanError, build_layout

    model_type, task, edit, needles = REFUSED[name]
    with pytest.raises(PlanError) as info:
        build_layout(_meta(model_type, task), _recipe(model_type, edit), 2)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_hf_plan_import_splits_sinks_with_the_heads_and_still_refuses_doge():
    """granite_swa's plan (``self_attn.sinks: colwise`` + ``self_attn: local_params``) becomes a
    per_head rule and plans at tp = 2, the sinks split; doge stays refused, naming dt_proj."""
    from tpify.hf_plan import import_hf_plan
    from tpify.layout import build_layout
    from tpify.recipe import RecipeError

    model = _meta("granite_swa")
    imported = import_hf_plan(model)
    rules = [r for r in imported.data["rule"] if r.get("style") == "per_head"]
    assert rules == [{"match": "layers.*.self_attn", "style": "per_head", "params": {"sinks": {"dim": 0}}}], rules
    layout = build_layout(model, imported.recipe(), 2)
    spec = layout.param_specs()["model.layers.0.self_attn.sinks"]
    assert (spec.dim, spec.parts, spec.tp_size) == (0, (4,), 2)
    with pytest.raises(RecipeError, match=r"dt_proj reads the values of ALL KV heads"):
        import_hf_plan(_meta("doge"))
