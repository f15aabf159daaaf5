"""transformers' TP plans as tpify recipes (tpify/hf_plan/) and ``tpify draft`` (tpify/authoring/draft.py),
without ranks: models on the meta device or small random ones on the CPU.

* Style mapping, on synthetic plans set on a small Qwen3 model: colwise, rowwise,
  embedding_rowwise, the head's colwise_gather_output -> colwise_rep, gathered pairs inside the
  model -> replicate, packed_colwise on an nn.Linear -> packed_colwise parts 2,
  replicated_with_grad_allreduce -> no rule; every unsupported style -> RecipeError naming the
  style and the module; real MoE plans import the shipped recipes' experts rule; cohere's per-head
  ``q_norm`` (use_qk_norm) split with the heads, a norm over all heads refused by name; what HF's
  plan leaves out or cannot express kept whole with a reason (bare parameters, row layers without a
  split input, gathered ModuleList heads, forward-overriding heads), shared experts HF all-reduces
  and identity experts as ``experts`` rules, a rotary-key norm beside latent attention summed.
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


def test_per_head_norm_is_split_with_the_heads():
    """cohere's q_norm / k_norm with use_qk_norm hold (heads, head_dim) and normalise each head over
    its head_dim (CohereLayerNorm: the mean over the last dimension): imported as per_head rules
    (dim 0), the KV heads' norm with kv_heads, so each rank scales its own heads by their rows
    (exact at tp 2 and 4: tests/distributed/test_hf_plan_families.py)."""
    model = _meta("cohere", use_qk_norm=True)  # 4 heads, 2 KV heads
    recipe = recipe_from_hf_plan(model)
    per_head = {r.patterns: (r.params, r.kv_heads) for r in recipe.rules if r.style == "per_head"}
    assert per_head == {("layers.*.self_attn.q_norm",): ((("weight", 0, 1),), None),
                        ("layers.*.self_attn.k_norm",): ((("weight", 0, 1),), "num_key_value_heads")}
    for tp, q_rows, k_rows in ((2, 2, 1), (4, 1, 1)):
        modules = build_layout(model, recipe, tp).modules
        assert modules["model.layers.0.self_attn.q_norm"].specs["weight"].local_shape((4, 8)) == (q_rows, 8)
        assert modules["model.layers.0.self_attn.k_norm"].specs["weight"].local_shape((2, 8)) == (k_rows, 8)


def test_norm_over_all_heads_is_refused_by_name():
    """A q_norm over the whole projection width (ESM C's LayerNorm(hidden) on q_proj's output: its
    statistics mix every head) cannot be split with the heads: the import names it, says why and
    what to write instead. Constructed: qwen3's per-head q_norm replaced by a norm over all heads."""
    model = _meta("qwen3")
    width = model.config.num_attention_heads * model.config.head_dim
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.LayerNorm(width, device="meta")
    with pytest.raises(RecipeError, match=r"layers.0.self_attn.q_norm.weight has shape \(32,\).*normalises over the "
                                          r"full projection width 32.*cannot be split with the heads.*replicate "
                                          r"layers.\*.self_attn"):
        recipe_from_hf_plan(model)


class _FusedExperts(torch.nn.Module):
    """Fused expert weights no plan names (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``)."""

    def __init__(self, post_norm: bool):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(8, 96, 32, device="meta"))
        self.down_proj = torch.nn.Parameter(torch.empty(8, 32, 48, device="meta"))
        if post_norm:
            self.has_post_expert_norm = True
            self.post_expert_norm = torch.nn.LayerNorm(32, device="meta")


def test_bare_parameters_hf_leaves_out_are_kept_whole_with_a_reason():
    """Parameters of 2 or more dimensions outside any layer that HF's plan does not name are kept
    whole on purpose, each rule saying why: a convolution (the linear attention's conv1d of
    qwen3_5 / olmo_hybrid) as a container, a table held by the base model itself beside split
    layers (llama4's vision position table) by ``replicate`` with ``params``, fused experts whose
    outputs pass a norm of their own (muse_spark) whole. Fused experts HF leaves out otherwise are
    not covered: the planner refuses them by name (a forgotten rule is not kept whole silently).
    Constructed on qwen3 (its plan splits attention and MLP)."""
    model = _meta("qwen3")
    base = model.model
    base.pos_table = torch.nn.Parameter(torch.empty(17, 32, device="meta"))
    for layer in base.layers:
        layer.conv = torch.nn.Conv1d(32, 32, 4, groups=32, device="meta")
        layer.normed_experts = _FusedExperts(post_norm=True)
    imported = import_hf_plan(model)
    rules = {r.patterns: r for r in imported.recipe().rules}
    notes = dict(zip([tuple([d["match"]] if isinstance(d["match"], str) else d["match"]) for d in imported.data["rule"]],
                     imported.notes))
    assert rules[("",)].style == "replicate" and [n for n, _, _ in rules[("",)].params] == ["pos_table"]
    assert rules[("layers.*.conv",)].style == "replicate" and not rules[("layers.*.conv",)].params
    assert "HF's plan does not name" in notes[("layers.*.conv",)]
    assert rules[("layers.*.normed_experts",)].style == "replicate"
    assert "has_post_expert_norm" in notes[("layers.*.normed_experts",)]
    layout = build_layout(model, imported.recipe(), 2)
    assert layout.modules["model"].style == "replicate"  # the base model's own table, its layers split
    assert layout.modules["model.layers.0.self_attn.q_proj"].style == "colwise"
    for layer in base.layers:
        layer.plain_experts = _FusedExperts(post_norm=False)
    with pytest.raises(Exception, match=r"layers.0.plain_experts.gate_up_proj \(_FusedExperts"):
        build_layout(model, recipe_from_hf_plan(model), 2)


def test_rowwise_without_a_split_input_is_kept_whole():
    """HF's rowwise on a layer whose neighbours the plan leaves whole (glm5_next's linear-attention
    o_proj under the latent attention's glob) reads a whole input: imported as replicate; a row
    layer fed by column-split neighbours stays rowwise. Constructed with a plan on qwen3."""
    plan = {BASE + "o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    imported = import_hf_plan(_with_plan(plan))
    styles = _styles(imported.recipe())
    assert styles["layers.*.self_attn.o_proj"] == "replicate" and styles["layers.*.mlp.down_proj"] == "rowwise"
    note = imported.notes[[r["match"] for r in imported.data["rule"]].index("layers.*.self_attn.o_proj")]
    assert "no column-split layer beside it" in note


def test_shared_experts_hf_all_reduces_import_as_experts():
    """HF's ``all_reduce`` on a module of 3-D parameters it splits colwise / rowwise (inkling's shared
    experts, ``(n_shared, I, H)`` / ``(n_shared, H, I)``: a sum over the split intermediate
    dimension) becomes an ``experts`` rule, each parameter along its intermediate dimension."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Parameter(torch.empty(1, 48, 32, device="meta"))
            self.up_proj = torch.nn.Parameter(torch.empty(1, 48, 32, device="meta"))
            self.down_proj = torch.nn.Parameter(torch.empty(1, 32, 48, device="meta"))

    model = _meta("qwen3")
    for layer in model.model.layers:
        layer.mlp.shared = Shared()
    shared = "model.layers.*.mlp.shared"
    model._tp_plan = {**model._tp_plan, shared: "all_reduce", shared + ".gate_proj": "colwise",
                      shared + ".up_proj": "colwise", shared + ".down_proj": "rowwise"}
    recipe = recipe_from_hf_plan(model)
    rule = next(r for r in recipe.rules if r.patterns == ("layers.*.mlp.shared",))
    assert rule.style == "experts" and rule.params == (("down_proj", 2, 1), ("gate_proj", 1, 1), ("up_proj", 1, 1))
    specs = build_layout(model, recipe, 2).modules["model.layers.0.mlp.shared"].specs
    assert specs["gate_proj"].local_shape((1, 48, 32)) == (1, 24, 32)


def test_identity_experts_import_and_are_counted_once():
    """HF's ``moe_identity_expert`` inside a ``moe_tp_experts`` module (longcat_flash's
    zero-computation experts: the token itself, weighted) imports as the experts rule's
    ``identity_from``: the routed experts' count (down_proj's dim 0), from which tpify counts them
    once after the sum (tpify.styles.experts); expert parallelism refuses them by name."""

    class Experts(_FusedExperts):
        def __init__(self):
            super().__init__(post_norm=False)
            self.identity_expert = torch.nn.Identity()

    model = _meta("qwen3")
    for layer in model.model.layers:
        layer.mlp.experts = Experts()
    key = "model.layers.*.mlp.experts"
    model._tp_plan = {**model._tp_plan, key: "moe_tp_experts", key + ".gate_up_proj": "packed_colwise",
                      key + ".down_proj": "rowwise", key + ".identity_expert": "moe_identity_expert"}
    recipe = recipe_from_hf_plan(model)
    rule = next(r for r in recipe.rules if r.patterns == ("layers.*.mlp.experts",))
    assert rule.style == "experts" and rule.identity_from == 8
    assert build_layout(model, recipe, 2).modules["model.layers.0.mlp.experts"].identity_experts == 8
    with pytest.raises(Exception, match=r"identity experts \(identity_from\) with expert parallelism"):
        build_layout(model, recipe, 2, ep_size=2)


def test_heads_hf_gathers_that_tpify_cannot_split_are_kept_whole():
    """A ModuleList of LM heads marked colwise_gather_output (Qwen3-Omni's code predictor: one head
    per code group, the forward picks one per call) and a head whose class overrides
    ``nn.Linear.forward`` (dory's logit scale) are imported as replicate, with the reason."""

    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = _meta("qwen3")
    model.lm_head = torch.nn.ModuleList([torch.nn.Linear(32, 101, bias=False, device="meta") for _ in range(2)])
    imported = import_hf_plan(model)
    assert _styles(imported.recipe())["lm_head"] == "replicate"
    assert "ModuleList of heads" in imported.notes[[r["match"] for r in imported.data["rule"]].index("lm_head")]
    build_layout(model, imported.recipe(), 2)
    model = _meta("qwen3")
    model.lm_head = ScaledHead(32, 101, bias=False, device="meta")
    imported = import_hf_plan(model)
    assert _styles(imported.recipe())["lm_head"] == "replicate"
    assert any("overrides nn.Linear.forward" in line for line in imported.review)


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


def test_latent_attention_beside_a_gate_and_a_rotary_key_norm():
    """Beside ``mla_kv_a_proj``: a column layer reading the hidden states (hy_v4's output gate,
    computed before the queries) makes the query's down projection ``q_a_proj`` a ``latent`` too
    (the region ends before it, so it and its norm are not summed as if fed split heads); a norm of
    the rotary key HF marks ``replicated_with_grad_allreduce`` (dots3's ``k_rope_only_layernorm``,
    ``qk_rope_head_dim`` wide: only this rank's heads read its output) becomes
    ``replicate_sum_grads``. Constructed on minicpm3; a latent's own norm so marked stays refused
    (test_latent_attention_plans_import_as_latent_unless_a_norm_needs_its_gradient_summed)."""
    model = _meta("minicpm3")
    config = model.config
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.gate_proj = torch.nn.Linear(config.hidden_size, config.num_attention_heads * config.v_head_dim,
                                         bias=False, device="meta")
        attn.k_rope_only_layernorm = torch.nn.RMSNorm(config.qk_rope_head_dim, device="meta")
    model._tp_plan = {**model._tp_plan, BASE + "gate_proj": "colwise",
                      BASE + "k_rope_only_layernorm": "replicated_with_grad_allreduce"}
    recipe = recipe_from_hf_plan(model)
    styles = _styles(recipe)
    assert styles["layers.*.self_attn.q_a_proj"] == "latent" and styles["layers.*.self_attn.gate_proj"] == "colwise"
    assert styles["layers.*.self_attn.k_rope_only_layernorm"] == "replicate_sum_grads"
    layout = build_layout(model, recipe, 2)
    assert layout.modules["model.layers.0.self_attn.k_rope_only_layernorm"].style == "replicate_sum_grads"
    assert layout.modules["model.layers.0.self_attn.q_a_proj"].shared_features == 0
