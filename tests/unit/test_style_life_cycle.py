"""Each style's life cycle without a model, in one process: ``read_rule``, ``install``, ``explain``,
the registry, and a style added as one class plus one line of transformers' style table.

What it proves:

* ``read_rule``: every style turns the keys it takes into its options (normalised: tuples,
  sorted params, ``after_sum``), refuses a malformed value, and refuses a key it does not take
  with the message of the style that does (``'parts' is only for style 'packed_colwise'``); a
  recipe gives the same message, naming the file and the rule; ``rule.<option>`` reads the
  options (None for another style's option, AttributeError for no option at all);
* ``install``: the hooks each style puts on its own module at a fake tp size (a
  ``TPContext(None)`` whose size is set by hand: nothing runs, no collective): fused experts a
  pre-hook and a hook (tensor-parallel or expert-parallel), a latent projection a pre-hook and a
  hook, a per-head parameter held by groups of ranks a pre-hook (and a handle for the gradient
  hooks it adds), every other style none; none at tp 1; the handles remove them all;
* ``explain``: what ``tpify plan`` prints of a module and of a parameter kept whole, per style;
* the registry: a style registered twice is refused; a toy style (tests/toy_style.py, one class +
  one ``tpify.hf_plan.HF_STYLES`` line) is read by a recipe, made by transformers' plan import,
  planned, built at tp 2 (each rank's slice), and gone again once unregistered.

Tolerance: none (integers, messages, hooks and slices compared exactly).
"""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import toy_style
from tpify.context import TPContext
from tpify.layers import RowParallelLinear
from tpify.recipe import Recipe, RecipeError, Rule
from tpify.sharding import ShardSpec, shard_spec_of
from tpify.styles import AFTER_SUM, STYLES, WHOLE, NoOptions, PlanContext, RuleError, register
from tpify.styles.experts import ExpertsOptions
from tpify.styles.experts_hooks import ExpertParallelDispatch, TensorParallelExperts
from tpify.styles.latent import LatentOptions, LatentProjection
from tpify.styles.linear import PackedOptions
from tpify.styles.per_head import GroupSummedGrads, PerHeadOptions
from tpify.styles.replicate import ReplicateOptions

KV_ONLY = "'kv_heads' (a config attribute name or a positive integer"
PARAMS_ONLY = "'params' is only for styles 'experts' and 'per_head'"
GATE_DOWN = {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}, "down_proj_bias": {"after_sum": True}}

# (style, the rule's style keys, the options it reads, or the message it refuses them with)
READ_CASES = [
    ("colwise", {}, NoOptions()),
    ("colwise", {"kv_heads": "num_key_value_heads"}, NoOptions()),  # kept on the rule (rule.kv_heads)
    ("colwise", {"kv_heads": 0}, KV_ONLY),
    ("colwise", {"parts": 2}, "'parts' is only for style 'packed_colwise'"),
    ("packed_colwise", {"parts": 3}, PackedOptions(3, ())),
    ("packed_colwise", {"parts": ["num_attention_heads", 2]}, PackedOptions(("num_attention_heads", 2), ())),
    ("packed_colwise", {"parts": 3, "replicated_parts": [2, 1], "kv_heads": 2}, PackedOptions(3, (2, 1))),
    ("packed_colwise", {"parts": 3, "kv_heads": 2}, KV_ONLY),  # kv_heads names the replicated parts' heads
    ("packed_colwise", {}, "style 'packed_colwise' needs 'parts'"),
    ("packed_colwise", {"parts": 1}, "'parts' must be an integer >= 2"),
    ("packed_colwise", {"parts": 3, "replicated_parts": [0, 1, 2]}, "some, not all"),
    ("colwise_rep", {}, NoOptions()),
    ("colwise_rep", {"kv_heads": "n"}, KV_ONLY),
    ("rowwise", {"params": {"w": {"dim": 0}}}, PARAMS_ONLY),
    ("embedding_rowwise", {}, NoOptions()),
    ("embedding_colwise", {"shared": 1}, "'shared' (the trailing output features every head reads"),
    ("experts", {"params": GATE_DOWN, "identity_from": "n_routed_experts"},
     ExpertsOptions((("down_proj", 2, 1), ("down_proj_bias", AFTER_SUM, 1), ("gate_up_proj", 1, 2)),
                    "n_routed_experts")),
    ("experts", {}, "style 'experts' needs 'params', the parameters it splits and how"),
    ("experts", {"params": {"w": {"dim": -1}}}, "'params' must be a table of parameter name"),
    ("experts", {"params": {"w": {"dim": 0}}, "identity_from": -1}, "'identity_from' (the first expert index"),
    ("latent", {}, LatentOptions(None)),
    ("latent", {"shared": "qk_rope_head_dim"}, LatentOptions("qk_rope_head_dim")),
    ("latent", {"shared": -1}, "'shared' (the trailing output features every head reads"),
    ("per_head", {"params": {"sinks": {"dim": 0}}, "kv_heads": "num_key_value_heads"}, PerHeadOptions((("sinks", 0, 1),))),
    ("per_head", {"params": {"b": {"after_sum": True}}}, "'params' must be a table of parameter name"),
    ("per_head", {"identity_from": 2, "params": {"sinks": {"dim": 0}}}, "'identity_from'"),
    ("replicate", {}, ReplicateOptions()),
    ("replicate", {"params": ["pos_table", "cls"]}, ReplicateOptions((("cls", WHOLE, 1), ("pos_table", WHOLE, 1)))),
    ("replicate", {"params": {"w": {"dim": 0}}}, "'params' of style 'replicate' must be a list"),
    ("replicate_sum_grads", {}, ReplicateOptions()),
    ("replicate_sum_grads", {"params": ["w"]}, PARAMS_ONLY),
]


def test_every_style_has_read_cases():
    assert {case[0] for case in READ_CASES} == set(STYLES)


@pytest.mark.parametrize("style, raw, want", READ_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(READ_CASES)])
def test_read_rule_reads_the_styles_keys_and_refuses_others(style, raw, want):
    if isinstance(want, str):
        with pytest.raises(RuleError, match="^rule #0: ") as err:
            STYLES[style].read_rule(raw, "rule #0")
        assert want in str(err.value)
        with pytest.raises(RecipeError) as err:  # the recipe says the same, naming the file and the rule
            Recipe.from_dict({"model_type": "x", "rule": [{"match": "a", "style": style, **raw}]}, "t.toml")
        assert want in str(err.value) and str(err.value).startswith("recipe t.toml: rule #0 (match=['a']): ")
    else:
        assert STYLES[style].read_rule(raw, "rule #0") == want
        rule = Recipe.from_dict({"model_type": "x", "rule": [{"match": "a", "style": style, **raw}]}).rules[0]
        assert rule.options == want and rule.kv_heads == raw.get("kv_heads")


def test_a_rule_reads_its_options_as_attributes():
    packed = Recipe.from_dict({"model_type": "x", "rule": [
        {"match": "a", "style": "packed_colwise", "parts": 3},
        {"match": "b", "divide": ["num_heads"]}]})
    rule, facts = packed.rules
    assert (rule.parts, rule.replicated_parts, rule.params, rule.shared, rule.identity_from) == (3, (), None, None, None)
    assert facts.options is None and facts.parts is None and facts.styler is None
    assert rule.styler is STYLES["packed_colwise"]
    with pytest.raises(AttributeError, match="no attribute 'partz'"):
        rule.partz  # noqa: B018 - the attribute read is the test


# ---------------------------------------------------------------------------------------------
# install: the module hooks each style owns

class _Experts(nn.Module):
    """Fused experts with transformers' interface: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``."""

    def __init__(self, experts=4, hidden=8, inter=6):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter, dtype=torch.float64))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - never run here
        raise NotImplementedError


class _Sinks(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=torch.float64))


def _plan_ctx(tp, ep=1, config=None):
    errors = []

    def need_divisible(what, value):
        if value % tp:
            errors.append(f"{what} = {value} is not divisible by tp_size = {tp}")

    return PlanContext(nn.Module(), config, Recipe("x", []), tp, 1, errors, need_divisible, None, ep)


def _fake(tp, **kwargs):
    ctx = TPContext(None, **kwargs)
    ctx.size, ctx.rank = tp, 0
    return ctx


def _planned(style, module, raw, tp=2, ep=1, kv_heads=None, config=None):
    """``(plan context, entry, built module)`` of ``module`` under ``style`` at a fake ``tp``."""
    rule = Rule(0, ("m",), style, kv_heads=kv_heads, options=STYLES[style].read_rule(raw, "rule #0"))
    ctx = _plan_ctx(tp, ep, config)
    entry = STYLES[style].plan(ctx, "m", module, rule)
    assert ctx.errors == [] and entry is not None, ctx.errors
    return entry, STYLES[style].build(module, entry, _fake(tp, replica_groups={2: None}))


def _hooks(module):
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


INSTALL_CASES = {  # style: (module factory, style keys, kv_heads, expected hook owners (pre, post))
    "colwise": (lambda: nn.Linear(8, 12), {}, None, None),
    "packed_colwise": (lambda: nn.Linear(8, 12), {"parts": 3}, None, None),
    "colwise_rep": (lambda: nn.Linear(8, 12), {}, None, None),
    "rowwise": (lambda: nn.Linear(12, 8), {}, None, None),
    "embedding_rowwise": (lambda: nn.Embedding(10, 8), {}, None, None),
    "embedding_colwise": (lambda: nn.Embedding(10, 8), {}, None, None),
    "experts": (_Experts, {"params": {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}}}, None,
                (TensorParallelExperts, TensorParallelExperts)),
    "latent": (lambda: nn.Linear(8, 12), {"shared": 4}, None, (LatentProjection, LatentProjection)),
    "per_head": (lambda: _Sinks(2), {"params": {"sinks": {"dim": 0}}}, 2, (GroupSummedGrads, None)),
    "replicate": (lambda: nn.Linear(8, 12), {}, None, None),
    "replicate_sum_grads": (lambda: nn.LayerNorm(8), {}, None, None),
}


def test_every_style_has_an_install_case():
    assert set(INSTALL_CASES) == set(STYLES)


@pytest.mark.parametrize("style", list(INSTALL_CASES))
def test_install_puts_the_styles_own_hooks_on_its_module_and_removes_them(style):
    make, raw, kv_heads, owners = INSTALL_CASES[style]
    tp = 4 if kv_heads else 2  # per_head: 2 KV heads over 4 ranks, each held by 2 (its gradient summed)
    entry, module = _planned(style, make(), raw, tp=tp, kv_heads=kv_heads)
    assert STYLES[style].install(module, entry, _fake(1)) == [], "nothing at tp 1"
    handles = STYLES[style].install(module, entry, _fake(tp, replica_groups={2: None}))
    pre, post = _hooks(module)
    if owners is None:
        assert handles == [] and pre == [] and post == []
    else:
        want_pre, want_post = owners
        assert [type(getattr(h, "__self__", h)) for h in pre] == [want_pre]
        assert [type(getattr(h, "__self__", h)) for h in post] == ([want_post] if want_post else [])
        assert len(handles) == 2
    for handle in handles:
        handle.remove()
    assert _hooks(module) == ([], [])


def test_install_of_expert_parallel_experts_exchanges_the_tokens():
    entry, module = _planned("experts", _Experts(), INSTALL_CASES["experts"][1], ep=2)
    assert entry.expert_parallel and module.num_experts == 2
    handles = STYLES["experts"].install(module, entry, _fake(2))
    pre, post = _hooks(module)
    assert [type(h.__self__) for h in pre + post] == [ExpertParallelDispatch, ExpertParallelDispatch]
    for handle in handles:
        handle.remove()


def test_per_head_parameters_split_by_kv_heads_need_no_hook():
    entry, module = _planned("per_head", _Sinks(4), {"params": {"sinks": {"dim": 0}}}, tp=2, kv_heads=4)
    assert entry.replicated_parts == () and STYLES["per_head"].install(module, entry, _fake(2)) == []


# ---------------------------------------------------------------------------------------------
# explain: what tpify plan prints

SOURCE = "from rule #3 (match 'h.*')"
INSIDE = "inside container h.0, replicated by rule #3 (match 'h.*')"


def test_explain_says_how_a_module_is_split_and_why_a_parameter_is_whole():
    experts, _ = _planned("experts", _Experts(), INSTALL_CASES["experts"][1])
    assert STYLES["experts"].explain(experts) == "down_proj dim 2; gate_up_proj dim 1 in 2 parts; output all-reduced"
    ep, _ = _planned("experts", _Experts(), INSTALL_CASES["experts"][1], ep=2)
    assert STYLES["experts"].explain(ep) == "whole experts per rank (dim 0), tokens exchanged"
    assert STYLES["experts"].explain(experts, "down_proj", SOURCE) == "not split by style 'experts'"
    sinks, _ = _planned("per_head", _Sinks(2), {"params": {"sinks": {"dim": 0}}})
    assert STYLES["per_head"].explain(sinks) == "sinks dim 0; with the heads"
    rows, _ = _planned("rowwise", nn.Linear(12, 8), {})
    assert STYLES["rowwise"].explain(rows) == ""
    assert STYLES["rowwise"].explain(rows, "bias", SOURCE) == ("bias of a rowwise layer: whole on every rank, added "
                                                               "once after the all-reduce")
    assert STYLES["rowwise"].explain(rows, "weight", SOURCE) == "not split by style 'rowwise'"
    whole, _ = _planned("replicate", nn.Linear(8, 12), {})
    assert STYLES["replicate"].explain(whole) == ""
    assert STYLES["replicate"].explain(whole, "weight", SOURCE) == "style replicate from rule #3 (match 'h.*')"
    assert STYLES["replicate"].explain(whole, "weight", INSIDE) == INSIDE
    table = nn.Module()
    table.pos = nn.Parameter(torch.zeros(3, 2))
    own, _ = _planned("replicate", table, {"params": ["pos"]})
    assert STYLES["replicate"].explain(own) == ("its own pos whole on purpose (replicate params); its layers keep "
                                                "their own rules")
    norm, _ = _planned("replicate_sum_grads", nn.LayerNorm(8), {})
    assert STYLES["replicate_sum_grads"].explain(norm, "weight", SOURCE) == (
        "style replicate_sum_grads (from rule #3 (match 'h.*')): whole, its gradient, partial on each rank, summed "
        "over the ranks")
    latent, _ = _planned("latent", nn.Linear(8, 12), {"shared": 4})
    assert STYLES["latent"].explain(latent, "weight", SOURCE) == (
        "style latent: a low-rank latent every head reads, a full copy on every rank; the gradient of its last 4 "
        "output features (read by every head) summed")


# ---------------------------------------------------------------------------------------------
# The registry, and a style added as one class + one line of transformers' style table

def test_a_style_name_is_registered_once():
    with pytest.raises(ValueError, match="a style named 'colwise' is registered already"):
        register(type(STYLES["colwise"])())
    with pytest.raises(ValueError, match="takes a named Style"):
        register(object())


def _llama():
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


HF_PLAN = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
           "model.layers.*.self_attn.q_proj": "colwise_gather_output",
           "model.layers.*.self_attn.k_proj": "colwise_gather_output",
           "model.layers.*.self_attn.v_proj": "colwise_gather_output",
           "model.layers.*.self_attn.o_proj": "rowwise_split_input",
           "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
           "model.layers.*.mlp.down_proj": "rowwise"}


def test_a_toy_style_is_one_class_and_one_hf_table_line():
    from tpify.hf_plan import import_hf_plan
    from tpify.layout import build_layout

    rule = {"match": "layers.*.self_attn.o_proj", "style": toy_style.NAME}
    with pytest.raises(RecipeError, match=f"unknown style {toy_style.NAME!r}"):
        Recipe.from_dict({"model_type": "x", "rule": [rule]})
    with toy_style.registered() as style:
        assert STYLES[toy_style.NAME] is style
        assert Recipe.from_dict({"model_type": "x", "rule": [rule]}).rules[0].styler is style
        with pytest.raises(RecipeError, match="'parts' is only for style 'packed_colwise'"):
            Recipe.from_dict({"model_type": "x", "rule": [{**rule, "parts": 2}]})
        model = _llama()
        model._tp_plan = dict(HF_PLAN)
        imported = import_hf_plan(model)
        rules = {r.patterns: r for r in imported.recipe().rules}
        assert rules[("layers.*.self_attn.o_proj",)].style == toy_style.NAME
        assert rules[("layers.*.self_attn.q_proj",)].style == "replicate"  # HF gathers it inside the block
        note = imported.notes[[r["match"] for r in imported.data["rule"]].index("layers.*.self_attn.o_proj")]
        assert note == "HF rowwise_split_input: input whole, scattered by the layer, output all-reduced (a toy style)"
        layout = build_layout(model, imported.recipe(), 2)
        entry = layout.modules["model.layers.0.self_attn.o_proj"]
        assert entry.styler is style and entry.specs == {"weight": ShardSpec(1, (16,), 2), "bias": None}
        assert "model.layers.0.self_attn.o_proj" not in layout.region_starts + layout.region_ends
        dense = nn.Linear(16, 16, bias=False).double()
        for rank in range(2):
            ctx = _fake(2)
            ctx.rank = rank
            layer = style.build(dense, entry, ctx)
            assert isinstance(layer, RowParallelLinear) and layer.input_is_parallel is False
            assert shard_spec_of(layer.weight) == entry.specs["weight"]
            assert torch.equal(layer.weight, dense.weight[:, 8 * rank:8 * (rank + 1)])
    assert toy_style.NAME not in STYLES
    with pytest.raises(RecipeError, match=f"unknown style {toy_style.NAME!r}"):
        Recipe.from_dict({"model_type": "x", "rule": [rule]})
    model = _llama()
    model._tp_plan = dict(HF_PLAN)
    assert {r.style for r in import_hf_plan(model).recipe().rules if "o_proj" in r.patterns[0]} == {"replicate"}
