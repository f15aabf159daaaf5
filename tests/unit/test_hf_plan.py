"""transformers' TP plans as tpify recipes (tpify/hf_plan.py) and ``tpify draft`` (tpify/authoring/draft.py),
without ranks: models on the meta device or small random ones on the CPU.

* Style mapping, on synthetic plans set on a small Qwen3 model: colwise, rowwise,
  embedding_rowwise, the head's colwise_gather_output -> colwise_rep, gathered pairs inside the
  model -> replicate, packed_colwise on an nn.Linear -> packed_colwise parts 2,
  replicated_with_grad_allreduce -> no rule; every unsupported style -> RecipeError naming the
  style and the module; real MoE plans import the shipped recipes' experts rule; cohere's per-head
  ``q_norm`` (use_qk_norm) refused.
* The imported recipe builds a layout at tp = 2 for every head class of qwen3, olmo2, granite,
  starcoder2, cohere, glm (every linear / embedding covered), says it was imported, and a tied
  head follows its embedding (a forward-overriding embedding: both replicated).
* ``parallelize``'s recipe choice: no shipped recipe + an HF plan -> the import with the one-line
  notice; neither -> RecipeError naming ``tpify draft``; a shipped recipe is used as before.
* ``tpify draft``: gpt2 (traced) reproduces the shipped gpt2 recipe's styles and parts, llama
  (HF plan) its styles; the TOML reads back to the same mapping; traced olmo2 keeps the attention
  whole as HF's plan does; the command writes a file in-process.
The exactness of these recipes at tp = 2 is tests/distributed/test_hf_plan_families.py.
"""

import subprocess
import sys
import tomllib
import warnings

import pytest
import torch

from tpify.authoring.small import small_config
from tpify.authoring.target import head_classes, resolve_config
from tpify.hf_plan import has_hf_plan, import_hf_plan, recipe_from_hf_plan
from tpify.layout import build_layout
from tpify.recipe import RecipeError, load_recipe

FAMILIES = ["qwen3", "olmo2", "granite", "starcoder2", "cohere", "glm"]


def _meta(model_type, task="causal-lm", **changes):
    config = small_config(resolve_config(model_type), (2,))
    for k, v in changes.items():
        setattr(config, k, v)
    with torch.device("meta"):
        return head_classes(model_type)[task](config)


def _styles(recipe):
    return {(r.patterns if len(r.patterns) > 1 else r.patterns[0]): r.style for r in recipe.rules if r.style}


def _with_plan(plan, model_type="qwen3"):
    model = _meta(model_type)
    model._tp_plan = dict(plan)
    return model


BASE = "model.layers.*.self_attn."


def test_style_mapping():
    plan = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
            BASE + "q_proj": "colwise", BASE + "k_proj": "colwise_gather_output", BASE + "v_proj": "colwise_rep",
            BASE + "o_proj": "rowwise_split_input", BASE + "q_norm": "replicated_with_grad_allreduce",
            "model.layers.*.mlp.gate_proj": "packed_colwise", "model.layers.*.mlp.up_proj": "replicate",
            "model.layers.*.mlp.down_proj": "rowwise"}
    imported = import_hf_plan(_with_plan(plan))
    styles = _styles(imported.recipe())
    assert styles["lm_head"] == "colwise_rep"
    assert styles["embed_tokens"] == "embedding_rowwise"
    assert styles["layers.*.self_attn.q_proj"] == "colwise"
    assert styles["layers.*.self_attn.k_proj"] == styles["layers.*.self_attn.v_proj"] == "replicate"
    assert styles["layers.*.self_attn.o_proj"] == "replicate"
    assert styles["layers.*.mlp.up_proj"] == "replicate"
    assert styles["layers.*.mlp.down_proj"] == "rowwise"
    gate = next(r for r in imported.recipe().rules if r.patterns == ("layers.*.mlp.gate_proj",))
    assert gate.style == "packed_colwise" and gate.parts == 2
    assert not any("q_norm" in p for r in imported.recipe().rules for p in r.patterns)
    assert any("replicated_with_grad_allreduce" in line and "by construction" in line for line in imported.review)
    assert all(note for note in imported.notes) and len(imported.notes) == len(imported.data["rule"])


@pytest.mark.parametrize("style", ["sequence_parallel", "moe_tp_experts", "local_params", "mla_kv_a_proj",
                                   "all_reduce", "packed_rowwise", "embedding_colwise", "no_such_style"])
def test_unsupported_styles_are_refused(style):
    plan = {BASE + "q_proj": style, BASE + "k_proj": "colwise", BASE + "v_proj": "colwise", BASE + "o_proj": "rowwise"}
    with pytest.raises(RecipeError) as e:
        recipe_from_hf_plan(_with_plan(plan))
    msg = str(e.value)
    assert style in msg and "layers.0.self_attn.q_proj" in msg and "tpify draft qwen3" in msg, msg


def test_wrong_module_types_and_parameter_rules_are_refused():
    with pytest.raises(RecipeError, match=r"embedding_rowwise applies to an nn.Embedding"):
        recipe_from_hf_plan(_with_plan({BASE + "q_proj": "embedding_rowwise"}))
    with pytest.raises(RecipeError, match=r"applies to nn.Linear"):
        recipe_from_hf_plan(_with_plan({BASE + "q_norm": "colwise"}))
    with pytest.raises(RecipeError, match=r"parameter layers.0.self_attn.q_norm.weight"):
        recipe_from_hf_plan(_with_plan({BASE + "q_norm.weight": "colwise"}))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_real_moe_plans_import_the_shipped_recipes_experts_rule(model_type):
    """HF's moe_tp_experts (packed_colwise gate_up_proj, rowwise down_proj) imports as the experts
    rule the shipped recipe writes (the families verified exact through the import:
    tests/distributed/test_hf_plan_families.py), the router replicated."""
    from tpify.recipe import load_recipe

    config = resolve_config(model_type)  # the family's default config, on the meta device (no memory)
    config.num_hidden_layers = 2
    config.first_k_dense_replace = 0  # deepseek_v2: a sparse layer among the two
    with torch.device("meta"):
        model = head_classes(model_type)["causal-lm"](config)
    rules = {r.patterns: r for r in recipe_from_hf_plan(model).rules}
    shipped = {r.patterns: r for r in load_recipe(model_type).rules}
    experts = ("layers.*.mlp.experts",)
    assert rules[experts].style == shipped[experts].style == "experts"
    assert sorted(rules[experts].params) == sorted(shipped[experts].params)
    assert rules[("layers.*.mlp.gate",)].style == "replicate"


def test_per_head_norm_is_refused():
    """cohere's q_norm with use_qk_norm holds (heads, head_dim): HF splits the heads, not it."""
    with pytest.raises(RecipeError, match=r"layers.0.self_attn.q_norm.weight has shape \(4, 8\)"):
        recipe_from_hf_plan(_meta("cohere", use_qk_norm=True))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_imported_recipe_covers_every_head_class(model_type):
    for task, cls in head_classes(model_type).items():
        model = _meta(model_type, task)
        assert has_hf_plan(model)
        recipe = recipe_from_hf_plan(model)
        assert "imported" in recipe.source and recipe.model_type == model_type
        layout = build_layout(model, recipe, 2)  # raises PlanError listing any uncovered module
        linear = {f for f, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        assert linear == set(layout.modules), (cls.__name__, linear ^ set(layout.modules))
        if task == "causal-lm":
            assert layout.lm_head == "lm_head" and layout.loss_kind == "causal"
            # K/V rules carry kv_heads (split by KV heads, or each held by a group of ranks) when the
            # config has fewer KV heads than heads; then tp_size need not divide num_key_value_heads
            fewer = model.config.num_key_value_heads < model.config.num_attention_heads
            assert any(r.kv_heads for r in recipe.rules) == (fewer and model_type != "olmo2"), model_type
            assert recipe.divisible == (() if model_type == "olmo2" else ("num_attention_heads",) if fewer
                                        else ("num_attention_heads", "num_key_value_heads"))


def test_olmo2_attention_and_glm_mlp_are_whole():
    """HF gathers olmo2's q/k/v (q_norm spans all heads) and glm's packed gate_up_proj."""
    olmo = build_layout(_meta("olmo2"), recipe_from_hf_plan(_meta("olmo2")), 2).modules
    assert {olmo[f"model.layers.0.self_attn.{p}"].style for p in ("q_proj", "k_proj", "v_proj", "o_proj")} == {
        "replicate"}
    assert olmo["model.layers.0.mlp.gate_proj"].style == "colwise"
    glm = build_layout(_meta("glm"), recipe_from_hf_plan(_meta("glm")), 2).modules
    assert glm["model.layers.0.mlp.gate_up_proj"].style == glm["model.layers.0.mlp.down_proj"].style == "replicate"
    assert glm["model.layers.0.self_attn.q_proj"].style == "colwise"


def test_tied_head_follows_its_embedding():
    """gemma3's scaled embedding overrides forward: replicated, and so is the head tied to it."""
    model = _meta("gemma3_text")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layout = build_layout(model, recipe_from_hf_plan(model), 2)
    assert layout.modules["model.embed_tokens"].style == layout.modules["lm_head"].style == "replicate"
    model = _meta("qwen3", tie_word_embeddings=True)
    model.tie_weights()
    layout = build_layout(model, recipe_from_hf_plan(model), 2)
    assert (layout.modules["model.embed_tokens"].style, layout.modules["lm_head"].style) == (
        "embedding_rowwise", "colwise_rep")


def test_parallelize_picks_the_imported_plan_with_a_notice():
    from tpify.api import prepare

    model = _meta("olmo2")  # (qwen3 ships a recipe now)
    with pytest.warns(UserWarning, match=r"^tpify: no shipped recipe for olmo2; using transformers' "
                                         r"base_model_tp_plan \(imported, \d+ rules\)$"):
        size, layout = prepare(model, 1, None, None)
    assert "imported" in layout.recipe.source
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, layout = prepare(_meta("llama"), 1, None, None)  # a shipped recipe: no notice
    assert layout.recipe.source.endswith("llama.toml")


def test_no_recipe_and_no_plan_names_tpify_draft():
    from tpify.api import prepare

    model = _meta("stablelm")
    model.config.model_type = "tpify-test-unshipped"
    model._tp_plan, model.config.base_model_tp_plan = {}, None  # no plan, whatever this transformers declares
    assert not has_hf_plan(model)
    with pytest.raises(RecipeError) as e:
        prepare(model, 1, None, None)
    msg = str(e.value)
    assert "no tpify recipe for model_type 'tpify-test-unshipped'" in msg and "no tensor-parallel plan" in msg, msg
    assert "tpify draft tpify-test-unshipped" in msg and "shipped recipes: [" in msg, msg


# ---------------------------------------------------------------------------------------------
# tpify draft

def _core(recipe):
    return {(p, r.style, r.parts) for r in recipe.rules if r.style and r.style != "replicate" for p in r.patterns}


def test_draft_gpt2_by_trace_matches_the_shipped_recipe():
    from tpify.authoring.draft import draft

    d = draft("gpt2", method="trace")  # traced, whether or not this transformers declares a plan
    assert d.method == "trace"
    shipped = load_recipe("gpt2")
    mine = d.recipe()
    wanted = {x for x in _core(shipped) if "crossattention" not in x[0]}  # cross-attention: not in the trace
    assert _core(mine) == wanted, _core(mine) ^ wanted
    divides = {p: r.divide for r in mine.rules if r.divide for p in r.patterns}
    assert divides == {"h.*.attn": ("split_size",)}  # the shipped recipe also divides num_heads (upcast path)
    assert mine.divisible == ("num_attention_heads",) and mine.loss == {"GPT2LMHeadModel": "causal"}
    assert tomllib.loads(d.toml()) == d.data
    assert not any("does not fit" in line for line in d.review), d.review


#: Llama's plan as transformers 5.0 to 5.24 declare it: the input of the import tests, fixed here.
LLAMA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
              "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
              "layers.*.mlp.down_proj": "rowwise"}


def test_draft_llama_from_the_hf_plan_matches_the_shipped_recipe(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpify.authoring.draft import draft

    monkeypatch.setattr(LlamaConfig, "base_model_tp_plan", LLAMA_PLAN)
    monkeypatch.setattr(LlamaForCausalLM, "_tp_plan", {"lm_head": "colwise_gather_output"})
    d = draft("llama", ["causal-lm"])
    assert d.method == "hf-plan"
    assert _core(d.recipe()) == _core(load_recipe("llama"))
    assert tomllib.loads(d.toml()) == d.data
    assert not any("does not fit" in line for line in d.review), d.review


def test_traced_olmo2_keeps_the_attention_whole_like_hf():
    """The trace sees q_norm normalise over all heads (a reduction over the split dimension)."""
    from tpify.authoring.draft import draft

    d = draft("olmo2", ["causal-lm"], method="trace")
    styles = _styles(d.recipe())
    assert styles.get("layers.*.mlp.gate_proj") == "colwise" and styles.get("layers.*.mlp.down_proj") == "rowwise"
    assert not any("self_attn" in str(p) and s != "replicate" for p, s in styles.items()), styles
    assert any("q_proj" in line and "reduces over the split dimension" in line for line in d.review), d.review


@pytest.mark.slow
def test_draft_command_writes_a_file(tmp_path):
    out = tmp_path / "stablelm.toml"
    proc = subprocess.run([sys.executable, "-m", "tpify.cli", "draft", "stablelm", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = tomllib.loads(out.read_text())
    styles = {r["match"]: r.get("style") for r in data["rule"] if isinstance(r["match"], str)}
    assert styles["layers.*.self_attn.o_proj"] == "rowwise" and styles["embed_tokens"] == "embedding_rowwise"
    assert "tpify verify stablelm --recipe" in proc.stderr
    again = subprocess.run([sys.executable, "-m", "tpify.cli", "draft", "stablelm", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "--force" in again.stderr


def test_traced_phi3_finds_packed_gqa_parts_and_forward_time_sizes():
    """phi3's packed [Q|K|V] (GQA widths) and the sizes its forward slices with: query_pos =
    config.num_attention_heads * head_dim (divide_config) and query_pos + num_key_value_heads *
    head_dim (a sum, confirmed by the second trace); the shipped recipe says the same."""
    from tpify.authoring.draft import draft

    d = draft("phi3", ["causal-lm"], method="trace")
    mine, shipped = d.recipe(), load_recipe("phi3")
    assert _core(mine) == _core(shipped), _core(mine) ^ _core(shipped)
    assert mine.divide_config == ("num_attention_heads",)
    assert {p: r.divide for r in mine.rules if r.divide for p in r.patterns} == {
        "layers.*.self_attn": ("num_key_value_heads",)}


def test_traced_constant_size_keeps_the_layer_whole():
    """A fused qkv_proj reshaped into a constant 4 chunks (CodeGen's attention up to transformers
    5.23, defined in tests/toy_models.py so that the subject does not change with transformers),
    4 being the small config's head count only by chance: the second trace (6 heads) shows it does
    not follow, so qkv_proj stays whole instead of a recipe that divides num_attention_heads."""
    from toy_models import ConstantReshapeConfig, ConstantReshapeForCausalLM

    from tpify.authoring.trace_recipe import draft_from_trace

    d = draft_from_trace(ConstantReshapeConfig(), {"causal-lm": ConstantReshapeForCausalLM})
    styles = _styles(d.recipe())
    assert styles["layers.*.attn.qkv_proj"] == "replicate" and styles["layers.*.fc_in"] == "colwise"
    assert not any(r.divide for r in d.recipe().rules)
    assert any("qkv_proj" in line and "a constant?" in line for line in d.review), d.review


def test_traced_t5_splits_the_relative_attention_bias_by_heads():
    from tpify.authoring.draft import draft

    d = draft("t5", ["seq2seq-lm"])
    styles = _styles(d.recipe())
    assert styles["encoder.block.*.layer.*.SelfAttention.relative_attention_bias"] == "embedding_colwise"
    assert styles["shared"] == styles["encoder.embed_tokens"] == styles["decoder.embed_tokens"] == "embedding_rowwise"
    assert styles["lm_head"] == "colwise_rep" and d.recipe().loss == {"T5ForConditionalGeneration": "seq2seq"}


def test_latent_attention_plans_import_as_latent_unless_a_norm_needs_its_gradient_summed():
    """transformers' ``mla_kv_a_proj`` (kv_a_proj_with_mqa: the KV latent and the rotary key every
    head reads) becomes tpify's ``latent`` with ``shared = "qk_rope_head_dim"``, and the heads
    become divisible (minicpm3: dense, the plan imported as it is). A plan that also marks a
    module ``replicated_with_grad_allreduce`` (dots3's norm on the rotary key, between the
    projection and the heads) is refused: its gradient is partial per rank, but the latent style
    ends the sharded region before it, so tpify would not sum it."""
    model = _meta("minicpm3")
    recipe = recipe_from_hf_plan(model)
    latent = [r for r in recipe.rules if r.style == "latent"]
    assert [(r.patterns, r.shared) for r in latent] == [(("layers.*.self_attn.kv_a_proj_with_mqa",), "qk_rope_head_dim")]
    assert "num_attention_heads" in recipe.divisible
    assert build_layout(model, recipe, 2).modules["model.layers.0.self_attn.kv_a_proj_with_mqa"].shared_features == 8
    model._tp_plan = {**model._tp_plan, BASE + "kv_a_layernorm": "replicated_with_grad_allreduce"}
    with pytest.raises(RecipeError, match=r"replicated_with_grad_allreduce next to multi-head latent attention"):
        recipe_from_hf_plan(model)
