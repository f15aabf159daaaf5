"""The ``experts`` style (tpify.styles) and coverage by size (tpify.layout), in one process.

What it proves:

* ``params`` in a recipe is read (``{ gate_up_proj = { dim = 1, parts = 2 }, down_proj = { dim = 2
  } }``), only for style ``experts``, which needs it; malformed tables are refused naming the rule;
* on transformers' own ``MixtralExperts`` (fused ``gate_up_proj (E, 2I, H)``, ``down_proj
  (E, H, I)``) the style gives exactly the specs written out by hand: tensor-parallel experts
  split ``gate_up_proj`` along dim 1 in its 2 parts (rank r holds ``[gate_r | up_r]``) and
  ``down_proj`` along dim 2; with ``ep_size = tp_size`` both along dim 0 (whole experts);
* what would be silently wrong is refused, naming the module and the fix: a parameter the rule
  does not name (a ``down_proj`` bias would be added ``tp_size`` times), a child with parameters
  (a norm after each expert would see a partial sum), transformers' ``has_bias`` /
  ``has_post_expert_norm`` / interleaved ``[gate, up]``, a parameter the module lacks, an
  intermediate size or expert count ``tp_size`` does not divide (through ``need_divisible``), an
  ``ep_size`` other than 1 or ``tp_size``, expert parallelism on a module whose ``num_experts``
  does not match dim 0;
* ``build`` puts on each rank exactly ``spec.slice_dense(dense, rank)`` carrying the spec, and
  divides ``num_experts`` under expert parallelism (bitwise);
* coverage by size: a fused 3-D parameter that no rule mentions raises the uncovered PlanError
  (naming it, its shape and the threshold); ``replicate`` on it or on a container covers it; a
  parameter below :func:`tpify.layout.coverage_threshold` (``min(1M, 1%)``) needs no rule; the
  threshold itself; every shipped recipe still plans its family's default config (meta device:
  norms, routers and position tables are below the threshold or replicated on purpose).

Tolerance: none (integers and slices, bitwise).
Markers: one quick test (a fused parameter no rule mentions raises the uncovered PlanError: the
smoke check of coverage by size); the rest is ``slow`` (0.7 s of calls in all), since the quick
suite's budget is tight and the quick jobs of tests/distributed/test_never_silently_wrong.py and
test_verify.py already run split experts against dense.
"""

import pytest
import torch
from torch import nn
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralForCausalLM

from tpify.context import TPContext
from tpify.layout import PlanError, build_layout, coverage_threshold
from tpify.recipe import Recipe, RecipeError, Rule, available_recipes, load_recipe
from tpify.sharding import ShardSpec, shard_spec_of
from tpify.styles import STYLES, PlanContext
from tpify.styles.experts import ExpertsOptions

S = ShardSpec
PARAMS = (("down_proj", 2, 1), ("gate_up_proj", 1, 2))
EXPERTS_RULE = {"match": "layers.*.mlp.experts", "style": "experts",
                "params": {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}}}


def _config(**changes):
    values = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32)
    values.update(changes)
    return MixtralConfig(**values)


def _experts(seed=0):
    torch.manual_seed(seed)
    module = MixtralExperts(_config()).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _ctx(tp, ep=1):
    errors, counts = [], []

    def need_divisible(what, value):
        counts.append((what, value))
        if value % tp:
            errors.append(f"{what} = {value} is not divisible by tp_size = {tp}")

    ctx = PlanContext(nn.Module(), None, Recipe("test", []), tp, 1, errors, need_divisible, None, ep)
    ctx.counts = counts
    return ctx


def _rule(params=PARAMS):
    return Rule(0, ("experts",), "experts", options=ExpertsOptions(tuple(params)))


def _fake(tp, rank):
    ctx = TPContext(None)
    ctx.size, ctx.rank = tp, rank
    return ctx


# ---------------------------------------------------------------------------------------------
# The recipe key

@pytest.mark.slow
def test_params_is_read_for_experts_and_refused_elsewhere():
    recipe = Recipe.from_dict({"model_type": "mixtral", "rule": [EXPERTS_RULE]})
    assert recipe.rules[0].params == PARAMS
    with pytest.raises(RecipeError, match=r"style 'experts' needs 'params'"):
        Recipe.from_dict({"model_type": "x", "rule": [{"match": "e", "style": "experts"}]})
    with pytest.raises(RecipeError, match=r"'params' is only for styles 'experts' and 'per_head'"):
        Recipe.from_dict({"model_type": "x", "rule": [{"match": "e", "style": "colwise", "params": {"w": {"dim": 0}}}]})
    for bad in ({"w": {"dim": -1}}, {"w": {"parts": 2}}, {"w": {"dim": 0, "parts": 0}}, {"w": {"dim": 0, "x": 1}},
                {"w": {"dim": True}}, {"a.b": {"dim": 0}}, {}):
        with pytest.raises(RecipeError, match=r"'params' must be a table of parameter name"):
            Recipe.from_dict({"model_type": "x", "rule": [{"match": "e", "style": "experts", "params": bad}]})


# ---------------------------------------------------------------------------------------------
# plan: the specs, tensor-parallel and expert-parallel

@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_experts_split_the_intermediate_dimension(tp):
    ctx = _ctx(tp)
    entry = STYLES["experts"].plan(ctx, "experts", _experts(), _rule())
    assert ctx.errors == []
    assert entry.specs == {"gate_up_proj": S(1, (48, 48), tp), "down_proj": S(2, (48,), tp)}
    assert not entry.expert_parallel and entry.params == PARAMS
    assert sorted(ctx.counts) == [("experts.down_proj dimension 2", 48),
                                  ("experts.gate_up_proj dimension 1 (each of 2 parts)", 48)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_expert_parallel_experts_split_the_experts(tp):
    ctx = _ctx(tp, ep=tp)
    entry = STYLES["experts"].plan(ctx, "experts", _experts(), _rule())
    assert ctx.errors == []
    assert entry.specs == {"gate_up_proj": S(0, (4,), tp), "down_proj": S(0, (4,), tp)} and entry.expert_parallel
    assert ctx.counts == [("experts.num_experts (MixtralExperts, experts, ep_size)", 4)]


class _Fused(nn.Module):
    """A fused experts module whose extras the style must refuse."""

    def __init__(self, bias=False, norm=False, **flags):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 12, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 6))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(4, 8))
        if norm:
            self.post_expert_norm = nn.LayerNorm(8)
        self.__dict__.update(flags)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


@pytest.mark.parametrize("module, needle", [
    (_Fused(bias=True), "holds parameters ['down_proj_bias'] that the rule does not split"),
    (_Fused(norm=True), "its children ['post_expert_norm'] hold parameters"),
    (_Fused(bias=True, has_bias=True), "has_bias = True: name down_proj_bias in params with after_sum"),
    (_Fused(has_post_expert_norm=True), "has_post_expert_norm = True"),
    (_Fused(is_concatenated=False), "is_concatenated = False"),
], ids=["bias", "norm", "has_bias", "post_norm", "interleaved"])
@pytest.mark.slow
def test_what_would_count_tp_times_or_see_a_partial_sum_is_refused(module, needle):
    ctx = _ctx(2)
    assert STYLES["experts"].plan(ctx, "layers.0.mlp.experts", module, _rule()) is None
    assert len(ctx.errors) == 1 and needle in ctx.errors[0], ctx.errors
    assert ctx.errors[0].startswith("layers.0.mlp.experts (_Fused): style 'experts' (rule #0 (match=['experts'])) "
                                    "cannot split it: ")
    assert ctx.errors[0].endswith("give the module style 'replicate' to keep it whole")


@pytest.mark.slow
def test_a_missing_parameter_a_short_tensor_odd_parts_and_a_linear_are_refused():
    ctx = _ctx(2)
    assert STYLES["experts"].plan(ctx, "e", _Fused(), _rule((("up_proj", 1, 1), ("down_proj", 5, 1)))) is None
    assert "it holds no parameter 'up_proj'" in ctx.errors[0] and "down_proj has 3 dimensions, so it has no dimension 5" \
        in ctx.errors[0]
    ctx = _ctx(2)
    assert STYLES["experts"].plan(ctx, "e", _Fused(), _rule((("gate_up_proj", 1, 5), ("down_proj", 2, 1)))) is None
    assert ctx.errors == ["e.gate_up_proj: dimension 1 of size 12 cannot hold 5 equal parts"]
    ctx = _ctx(2)
    assert STYLES["experts"].plan(ctx, "e", nn.Linear(4, 4), _rule()) is None
    assert ctx.errors[0].startswith("e is a Linear; style 'experts'")


@pytest.mark.slow
def test_indivisible_sizes_go_through_need_divisible():
    ctx = _ctx(4)
    assert STYLES["experts"].plan(ctx, "e", _Fused(), _rule((("gate_up_proj", 1, 2), ("down_proj", 2, 1)))) is not None
    assert ctx.errors == ["e.gate_up_proj dimension 1 (each of 2 parts) = 6 is not divisible by tp_size = 4",
                          "e.down_proj dimension 2 = 6 is not divisible by tp_size = 4"]
    ctx = _ctx(8, ep=8)
    STYLES["experts"].plan(ctx, "e", _Fused(), _rule((("gate_up_proj", 1, 2), ("down_proj", 2, 1))))
    assert ctx.errors == ["e.num_experts (_Fused, experts, ep_size) = 4 is not divisible by tp_size = 8"]


@pytest.mark.slow
def test_expert_parallelism_needs_num_experts_to_be_dim_0():
    module = _Fused(num_experts=3)
    ctx = _ctx(2, ep=2)
    assert STYLES["experts"].plan(ctx, "e", module, _rule((("gate_up_proj", 1, 2), ("down_proj", 2, 1)))) is None
    assert "expert parallelism splits dim 0 of ['down_proj', 'gate_up_proj'] (sizes [4]) as the experts, but its " \
           "num_experts is 3" in ctx.errors[0]


# ---------------------------------------------------------------------------------------------
# build: each rank's slice, bitwise

@pytest.mark.slow
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_build_holds_each_ranks_slice_and_the_spec(ep):
    dense = _experts()
    for rank in range(2):
        module = _experts()
        entry = STYLES["experts"].plan(_ctx(2, ep=2 if ep else 1), "experts", module, _rule())
        built = STYLES["experts"].build(module, entry, _fake(2, rank))
        assert built is module and module.num_experts == (2 if ep else 4)
        for name, spec in entry.specs.items():
            param = getattr(module, name)
            assert isinstance(param, nn.Parameter) and shard_spec_of(param) == spec and param.requires_grad
            assert torch.equal(param, spec.slice_dense(getattr(dense, name), rank)), (name, rank)
        if not ep:  # rank r's [gate_r | up_r]: the packed halves split alike
            gate, up = dense.gate_up_proj.chunk(2, dim=1)
            want = torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1)
            assert torch.equal(module.gate_up_proj, want)


# ---------------------------------------------------------------------------------------------
# Coverage by size

def _recipe(*extra, experts=True):
    rules = [{"match": "embed_tokens", "style": "embedding_rowwise"},
             {"match": ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj"],
              "style": "colwise"},
             {"match": "layers.*.self_attn.o_proj", "style": "rowwise"},
             {"match": "lm_head", "style": "colwise_rep"}, *extra]
    if experts:
        rules.append(EXPERTS_RULE)
    return Recipe.from_dict({"model_type": "mixtral", "rule": rules})


def test_a_fused_3d_parameter_no_rule_mentions_raises():
    with torch.device("meta"):
        model = MixtralForCausalLM(_config())
    threshold = coverage_threshold(model)
    assert threshold == sum(p.numel() for p in model.parameters()) // 100 == 498
    with pytest.raises(PlanError) as err:
        build_layout(model, _recipe(experts=False), 2)
    message = str(err.value)
    assert ("4 parameter(s) of at least 498 elements (min(1M, 1% of the model's parameters)) held by modules no style "
            "knows are covered by no rule of recipe <memory>") in message
    assert "'layers.0.mlp.experts.gate_up_proj (MixtralExperts, shape [4, 96, 32], 12,288 elements)'" in message
    assert "'layers.1.mlp.experts.down_proj (MixtralExperts, shape [4, 32, 48], 6,144 elements)'" in message
    assert "style 'replicate' to keep a full copy on every rank on purpose" in message
    assert "mlp.gate.weight" not in message, "the router (128 elements) is below the threshold"
    # kept whole on purpose: replicate on the module, or on a container of it
    for rule in ({"match": "layers.*.mlp.experts", "style": "replicate"}, {"match": "layers.*.mlp", "style": "replicate"}):
        layout = build_layout(model, _recipe(rule, experts=False), 2)
        assert "model.layers.0.mlp.experts" not in layout.sharded()
    layout = build_layout(model, _recipe(), 2)
    assert layout.modules["model.layers.0.mlp.experts"].style == "experts" and layout.coverage_threshold == 498


@pytest.mark.slow
def test_the_threshold_is_one_million_elements_for_large_models():
    big = nn.Linear(4000, 30000, device="meta")  # 120M parameters: 1% is 1.2M
    assert coverage_threshold(big) == 1_000_000
    assert coverage_threshold(nn.Linear(2, 2)) == 1


@pytest.mark.slow
def test_a_parameter_under_the_threshold_needs_no_rule_and_a_large_one_does():
    class Model(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(100, 100)  # 10,100 parameters
            self.scale = nn.Parameter(torch.ones(width))

    recipe = Recipe.from_dict({"model_type": "x", "rule": [{"match": "fc", "style": "colwise"}]})
    build_layout(Model(100), recipe, 2)  # 100 elements < 1% of 10,200
    with pytest.raises(PlanError, match=r"\['scale \(Model, shape \[200\], 200 elements\)'\]"):
        build_layout(Model(200), recipe, 2)  # 200 elements >= 1% of 10,300 = 103


@pytest.mark.slow
@pytest.mark.parametrize("model_type", available_recipes())
def test_every_shipped_recipe_still_plans_its_default_config(model_type):
    from tpify.authoring.target import family_head_classes, head_classes, resolve_config

    config = resolve_config(model_type)
    for part in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        for name in ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "depth"):
            # the same modules per layer, planned faster (a composite's parts too; gemma3n_text's
            # per-layer lists and KV sharing need its 35)
            if part is not None and isinstance(getattr(part, name, None), int) and model_type != "gemma3n_text":
                setattr(part, name, 2)
    heads = head_classes(model_type)
    cls = (heads.get("causal-lm") or heads.get("masked-lm") or heads.get("seq2seq-lm") or heads.get("base")
           or next(iter(family_head_classes(config).values())))  # a part: qwen2_vl_vision's tower
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # as tpify plan builds it (gemma's scale buffer holds a value)
        model = cls(config)
    # tp 1: coverage does not depend on the size (falcon's default 71 heads allow no other)
    layout = build_layout(model, load_recipe(model_type), 1)  # raises PlanError naming anything uncovered
    assert layout.coverage_threshold == min(1_000_000, sum(p.numel() for p in {id(p): p for p in
                                                                                   model.parameters()}.values()) // 100)
