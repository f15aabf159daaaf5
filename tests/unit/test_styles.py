"""tpify.styles, one style object at a time, in one process without a process group.

What it proves, for every style of ``STYLES`` at tp sizes 2 and 4:

* ``plan`` accepts the module kinds the style splits (``nn.Linear`` and transformers ``Conv1D``,
  GPT-2's weight ``[in, out]``, for the linear styles; ``nn.Embedding`` for the embedding styles;
  anything for ``replicate``) and refuses the others with an error naming the module, its class
  and the rule, returning None;
* the per-parameter specs it puts in the layout equal the expected :class:`ShardSpec`, written
  out by hand: the split dimension of ``nn.Linear`` vs ``Conv1D`` weights, packed parts, parts
  kept whole (multi-query K/V), vocabulary padding (``colwise_rep`` pads only when ``p`` does not
  divide, ``embedding_rowwise`` always records its padded size), a missing bias;
* every count ``tp_size`` must divide goes through ``PlanContext.need_divisible`` (recorded even
  when it divides: build_layout lists the sizes that would work), and an indivisible one is
  reported once, not a second time by the spec functions; padded styles never ask;
* a subclass that overrides ``forward`` is refused unless the recipe's ``[subclasses]`` declares
  it (``plain``; ``scaled`` only for an ``embedding_rowwise`` table whose scale attribute holds a
  number);
* ``build`` at a fake tp size (a ``TPContext(None)`` whose ``size``/``rank`` are set by hand: the
  layers only slice at construction, no collective runs) gives the style's layer class, in the
  given context, each parameter exactly ``spec.slice_dense(dense, rank)`` and carrying as
  ``tp_shard_spec`` exactly the spec the style put in the layout (the single-source guarantee:
  the layout, the loader, the saver and the layer read one spec);
* the registry: every style name a recipe accepts has an object, and a recipe naming another
  style is refused.

Tolerance: none. Planning computes integers, and building copies slices of the dense weights,
so every tensor comparison is bitwise.
"""

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import tpify.recipe
from tpify.context import TPContext
from tpify.layers import ColumnParallelEmbedding, ColumnParallelInput, ColumnParallelLinear, RowParallelLinear, \
    VocabParallelEmbedding
from tpify.recipe import Recipe, RecipeError, Rule
from tpify.sharding import ShardSpec, shard_spec_of
from tpify.styles import STYLES, ModuleLayout, PlanContext, Style, style_of

S = ShardSpec
LINEAR_STYLES = ("colwise", "packed_colwise", "colwise_rep", "rowwise")
EMBEDDING_STYLES = ("embedding_rowwise", "embedding_colwise")


def _plan_ctx(tp, *, pad=1, parts=None, subclasses=None, report_indivisible=True):
    """A :class:`PlanContext` as build_layout makes one: ``need_divisible`` records every count
    (``ctx.counts``) and an error when ``tp`` does not divide it; ``packed_sizes`` answers
    ``parts`` (the recipe's weighing of packed parts is build_layout's, tested with it)."""
    errors, counts = [], []

    def need_divisible(what, value):
        counts.append((what, value))
        if value % tp and report_indivisible:
            errors.append(f"{what} = {value} is not divisible by tp_size = {tp}")

    model = nn.Module()
    model.attn = nn.Module()
    recipe = Recipe("test", [], subclasses=dict(subclasses or {}))
    ctx = PlanContext(model, None, recipe, tp, pad, errors, need_divisible, lambda rule, out_f, owner, fqn: parts)
    ctx.counts = counts
    return ctx


def _rule(style, parts=None, replicated=()):
    """A rule giving ``style``, its keys read by the style (``parts`` and ``replicated_parts`` only
    for ``packed_colwise``, which needs them)."""
    raw = {"parts": parts, "replicated_parts": list(replicated)} if style == "packed_colwise" else {}
    return Rule(0, ("fc",), style, options=STYLES[style].read_rule(raw, "rule #0"))


def _dense(module, seed=0):
    """``module`` in float64, every parameter drawn from N(0, 1), so any misplaced value shows."""
    module = module.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return module


# ---------------------------------------------------------------------------------------------
# The registry

def test_every_recipe_style_name_has_a_style_object_of_that_name():
    assert set(tpify.recipe.STYLES) == set(STYLES)
    for name in tpify.recipe.STYLES:
        assert isinstance(STYLES[name], Style) and STYLES[name].name == name
        assert style_of(name) is STYLES[name]
        assert ModuleLayout("fc", name, 0).styler is STYLES[name]


def test_an_unknown_style_is_refused_by_the_registry_and_by_the_recipe():
    with pytest.raises(KeyError):
        style_of("sideways")
    needle = r"rule #0 \(match=\['fc'\]\) has unknown style 'sideways'; known styles"
    with pytest.raises(RecipeError, match=needle) as err:
        Recipe.from_dict({"model_type": "x", "rule": [{"match": "fc", "style": "sideways"}]}, "test.toml")
    assert all(repr(name) in str(err.value) for name in STYLES), "the message lists every known style"


# The facts the hooks and the loss read from a style (regions: dropout streams and region gradients;
# lm_head: the parallel loss; vocab_rows: tied embeddings; sequence_parallel: the SP layout check).
STYLE_FACTS = {  # name: (kind, region, lm_head, vocab_rows, sequence_parallel, shards)
    "colwise": ("linear", "start", False, False, True, True),
    "packed_colwise": ("linear", "start", False, False, True, True),
    "colwise_rep": ("linear", None, True, True, True, True),
    "rowwise": ("linear", "end", False, False, True, True),
    "embedding_rowwise": ("embedding", None, False, True, True, True),
    "embedding_colwise": ("embedding", "start", False, False, False, True),
    "experts": ("params", None, False, False, True, True),
    "latent": ("linear", None, False, False, False, False),
    "per_head": ("params", None, False, False, True, True),
    "replicate": (None, None, False, False, True, False),
    "replicate_sum_grads": (None, None, False, False, False, False),
}


def test_each_style_declares_its_kind_region_and_roles():
    assert set(STYLE_FACTS) == set(STYLES), "a new style needs its row here"
    for name, facts in STYLE_FACTS.items():
        s = STYLES[name]
        assert (s.kind, s.region, s.lm_head, s.vocab_rows, s.sequence_parallel, s.shards) == facts, name


# ---------------------------------------------------------------------------------------------
# plan: what each style accepts and refuses

def _accepted(style):
    if style in ("experts", "per_head"):  # tests/unit/test_experts.py, tests/distributed/test_per_head.py
        return []
    if style == "replicate":
        return [nn.Linear(8, 12), Conv1D(12, 8), nn.Embedding(10, 8), nn.LayerNorm(8), nn.Sequential(nn.Linear(2, 2))]
    if style in EMBEDDING_STYLES:
        return [nn.Embedding(10, 8), nn.Embedding(10, 8, padding_idx=3)]
    return [nn.Linear(8, 12), nn.Linear(8, 12, bias=False), Conv1D(12, 8)]


@pytest.mark.parametrize("style", list(STYLES))
def test_plan_accepts_the_module_kinds_of_its_style(style):
    for module in _accepted(style):
        ctx = _plan_ctx(2, parts=[4, 4, 4])
        entry = STYLES[style].plan(ctx, "fc", module, _rule(style, parts=3 if style == "packed_colwise" else None))
        assert ctx.errors == [], (type(module).__name__, ctx.errors)
        assert isinstance(entry, ModuleLayout) and (entry.fqn, entry.style, entry.rule) == ("fc", style, 0)


def _refused(style):
    if style in EMBEDDING_STYLES:
        return [(nn.Linear(8, 12), "fc is a Linear; style {s!r} (rule #0 (match=['fc'])) does not apply to it"),
                (Conv1D(12, 8), "fc is a Conv1D; style {s!r} (rule #0 (match=['fc'])) does not apply to it")]
    return [(nn.Embedding(10, 8), "fc is a Embedding; style {s!r} (rule #0 (match=['fc'])) does not apply to it")]


@pytest.mark.parametrize("style", LINEAR_STYLES + EMBEDDING_STYLES)
def test_plan_refuses_other_module_kinds_naming_module_rule_and_style(style):
    for module, message in _refused(style) + [
            (nn.LayerNorm(8), "fc is a torch.nn.modules.normalization.LayerNorm, not one of nn.Linear, transformers "
                              "Conv1D, nn.Embedding; rule #0 (match=['fc']) gives it style {s!r} (only 'replicate' "
                              "applies to a container module)")]:
        ctx = _plan_ctx(2, parts=[4, 4, 4])
        assert STYLES[style].plan(ctx, "fc", module, _rule(style, parts=3)) is None
        assert ctx.errors == [message.format(s=style)]
        assert ctx.counts == [], "nothing is checked further on a module of the wrong kind"


@pytest.mark.parametrize("style", EMBEDDING_STYLES)
@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)],
                         ids=["max_norm", "scale_grad_by_freq", "sparse"])
def test_embedding_styles_refuse_options_that_need_the_whole_table(style, option):
    ctx = _plan_ctx(2)
    assert STYLES[style].plan(ctx, "fc", nn.Embedding(10, 8, **option), _rule(style)) is None
    assert ctx.errors == [f"fc: {style} cannot shard an nn.Embedding with max_norm, scale_grad_by_freq or sparse "
                          f"(they need the whole table); use 'replicate'"]


def test_packed_colwise_stops_when_the_packed_sizes_are_refused():
    """The weighing of the parts (build_layout's ``packed_sizes``) reports its own error and answers
    None: the style adds nothing and returns None."""
    ctx = _plan_ctx(2, parts=None)
    assert STYLES["packed_colwise"].plan(ctx, "attn.c_attn", nn.Linear(8, 12), _rule("packed_colwise", 3)) is None
    assert ctx.errors == [] and ctx.counts == []


def test_packed_colwise_asks_for_the_part_sizes_with_the_owning_module():
    ctx = _plan_ctx(2)
    seen = []
    ctx.packed_sizes = lambda rule, out_f, owner, fqn: seen.append((rule.index, out_f, owner, fqn)) or [4, 4, 4]
    STYLES["packed_colwise"].plan(ctx, "attn.c_attn", Conv1D(12, 8), _rule("packed_colwise", 3))
    STYLES["packed_colwise"].plan(ctx, "c_attn", Conv1D(12, 8), _rule("packed_colwise", 3))
    assert seen == [(0, 12, ctx.model.attn, "attn.c_attn"), (0, 12, None, "c_attn")]


# ---------------------------------------------------------------------------------------------
# plan: the specs, at tp 2 and 4, written out by hand

# (id, style, module factory, tp, pad_vocab_multiple, packed part sizes, replicated parts,
#  expected specs, expected (partition_sizes, padded_size, replicated_parts))
SPEC_CASES = [
    ("colwise-linear-tp2", "colwise", lambda: nn.Linear(8, 12), 2, 1, None, (),
     {"weight": S(0, (12,), 2), "bias": S(0, (12,), 2)}, (None, None, ())),
    ("colwise-linear-tp4", "colwise", lambda: nn.Linear(8, 12), 4, 1, None, (),
     {"weight": S(0, (12,), 4), "bias": S(0, (12,), 4)}, (None, None, ())),
    ("colwise-linear-nobias-tp4", "colwise", lambda: nn.Linear(8, 12, bias=False), 4, 1, None, (),
     {"weight": S(0, (12,), 4), "bias": None}, (None, None, ())),
    ("colwise-conv1d-tp2", "colwise", lambda: Conv1D(12, 8), 2, 1, None, (),  # weight [in, out]: split dim 1
     {"weight": S(1, (12,), 2), "bias": S(0, (12,), 2)}, (None, None, ())),
    ("packed-gpt2-qkv-conv1d-tp2", "packed_colwise", lambda: Conv1D(24, 8), 2, 1, [8, 8, 8], (),
     {"weight": S(1, (8, 8, 8), 2), "bias": S(0, (8, 8, 8), 2)}, ([8, 8, 8], None, ())),
    ("packed-gpt2-qkv-conv1d-tp4", "packed_colwise", lambda: Conv1D(24, 8), 4, 1, [8, 8, 8], (),
     {"weight": S(1, (8, 8, 8), 4), "bias": S(0, (8, 8, 8), 4)}, ([8, 8, 8], None, ())),
    ("packed-gqa-unequal-linear-tp4", "packed_colwise", lambda: nn.Linear(8, 16), 4, 1, [8, 4, 4], (),
     {"weight": S(0, (8, 4, 4), 4), "bias": S(0, (8, 4, 4), 4)}, ([8, 4, 4], None, ())),
    ("packed-mqa-kv-replicated-linear-tp4", "packed_colwise", lambda: nn.Linear(8, 12), 4, 1, [8, 2, 2], (1, 2),
     {"weight": S(0, (8, 2, 2), 4, None, (1, 2)), "bias": S(0, (8, 2, 2), 4, None, (1, 2))}, ([8, 2, 2], None, (1, 2))),
    ("packed-mqa-kv-replicated-conv1d-tp2", "packed_colwise", lambda: Conv1D(12, 8), 2, 1, [8, 2, 2], (1, 2),
     {"weight": S(1, (8, 2, 2), 2, None, (1, 2)), "bias": S(0, (8, 2, 2), 2, None, (1, 2))}, ([8, 2, 2], None, (1, 2))),
    ("lm-head-divisible-tp2", "colwise_rep", lambda: nn.Linear(8, 10, bias=False), 2, 1, None, (),
     {"weight": S(0, (10,), 2), "bias": None}, (None, None, ())),
    ("lm-head-padded-tp4", "colwise_rep", lambda: nn.Linear(8, 10, bias=False), 4, 1, None, (),
     {"weight": S(0, (10,), 4, 12), "bias": None}, (None, 12, ())),
    ("lm-head-pad-multiple-8-tp2", "colwise_rep", lambda: nn.Linear(8, 10), 2, 8, None, (),
     {"weight": S(0, (10,), 2, 16), "bias": S(0, (10,), 2, 16)}, (None, 16, ())),
    ("lm-head-conv1d-padded-tp4", "colwise_rep", lambda: Conv1D(10, 8), 4, 1, None, (),
     {"weight": S(1, (10,), 4, 12), "bias": S(0, (10,), 4, 12)}, (None, 12, ())),
    ("rowwise-linear-tp2", "rowwise", lambda: nn.Linear(12, 8), 2, 1, None, (),  # weight [out, in]: split dim 1
     {"weight": S(1, (12,), 2), "bias": None}, (None, None, ())),
    ("rowwise-conv1d-tp4", "rowwise", lambda: Conv1D(8, 12), 4, 1, None, (),  # weight [in, out]: split dim 0
     {"weight": S(0, (12,), 4), "bias": None}, (None, None, ())),
    ("rowwise-linear-nobias-tp4", "rowwise", lambda: nn.Linear(12, 8, bias=False), 4, 1, None, (),
     {"weight": S(1, (12,), 4), "bias": None}, (None, None, ())),
    ("vocab-rows-divisible-tp2", "embedding_rowwise", lambda: nn.Embedding(10, 8), 2, 1, None, (),
     {"weight": S(0, (10,), 2)}, (None, 10, ())),
    ("vocab-rows-padded-tp4", "embedding_rowwise", lambda: nn.Embedding(10, 8, padding_idx=9), 4, 1, None, (),
     {"weight": S(0, (10,), 4, 12)}, (None, 12, ())),
    ("vocab-rows-pad-multiple-4-tp2", "embedding_rowwise", lambda: nn.Embedding(10, 8), 2, 4, None, (),
     {"weight": S(0, (10,), 2, 16)}, (None, 16, ())),
    ("embedding-columns-tp2", "embedding_colwise", lambda: nn.Embedding(32, 8), 2, 1, None, (),
     {"weight": S(1, (8,), 2)}, (None, None, ())),
    ("embedding-columns-tp4", "embedding_colwise", lambda: nn.Embedding(32, 8), 4, 1, None, (),
     {"weight": S(1, (8,), 4)}, (None, None, ())),
    ("replicate-linear-tp4", "replicate", lambda: nn.Linear(8, 10), 4, 1, None, (), {}, (None, None, ())),
    ("replicate-embedding-tp2", "replicate", lambda: nn.Embedding(10, 7), 2, 1, None, (), {}, (None, None, ())),
]


def _plan_case(style, make, tp, pad, parts, replicated):
    ctx = _plan_ctx(tp, pad=pad, parts=parts)
    module = _dense(make())
    rule = _rule(style, parts=len(parts) if parts else None, replicated=replicated)
    entry = STYLES[style].plan(ctx, "attn.fc", module, rule)
    return ctx, module, entry


@pytest.mark.parametrize("case", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_plan_gives_the_expected_spec_of_each_parameter(case):
    _, style, make, tp, pad, parts, replicated, specs, sizes = case
    ctx, module, entry = _plan_case(style, make, tp, pad, parts, replicated)
    assert ctx.errors == []
    assert entry.specs == specs
    assert entry.specs == STYLES[style].param_specs(module, entry, tp), "plan stores what param_specs gives"
    assert (entry.partition_sizes, entry.padded_size, entry.replicated_parts) == sizes
    assert not entry.sequence_parallel and entry.output_scale is None and entry.scale_attr is None


# ---------------------------------------------------------------------------------------------
# plan: divisibility, through need_divisible

# (id, style, module factory, tp, packed part sizes, recorded counts, errors)
DIVISIBILITY_CASES = [
    ("colwise-linear", "colwise", lambda: nn.Linear(8, 6), 4, None,
     [("attn.fc.out_features (Linear, colwise)", 6)],
     ["attn.fc.out_features (Linear, colwise) = 6 is not divisible by tp_size = 4"]),
    ("colwise-conv1d", "colwise", lambda: Conv1D(6, 8), 4, None,
     [("attn.fc.out_features (Conv1D, colwise)", 6)],
     ["attn.fc.out_features (Conv1D, colwise) = 6 is not divisible by tp_size = 4"]),
    ("rowwise-linear", "rowwise", lambda: nn.Linear(6, 8), 4, None,
     [("attn.fc.in_features (Linear, rowwise)", 6)],
     ["attn.fc.in_features (Linear, rowwise) = 6 is not divisible by tp_size = 4"]),
    ("rowwise-conv1d", "rowwise", lambda: Conv1D(8, 6), 4, None,
     [("attn.fc.in_features (Conv1D, rowwise)", 6)],
     ["attn.fc.in_features (Conv1D, rowwise) = 6 is not divisible by tp_size = 4"]),
    ("packed-parts", "packed_colwise", lambda: nn.Linear(8, 20), 4, [8, 6, 6],
     [("attn.fc packed part 0 of out_features", 8), ("attn.fc packed part 1 of out_features", 6),
      ("attn.fc packed part 2 of out_features", 6)],
     ["attn.fc packed part 1 of out_features = 6 is not divisible by tp_size = 4",
      "attn.fc packed part 2 of out_features = 6 is not divisible by tp_size = 4"]),
    ("embedding-columns", "embedding_colwise", lambda: nn.Embedding(32, 6), 4, None,
     [("attn.fc.embedding_dim (Embedding, embedding_colwise)", 6)],
     ["attn.fc.embedding_dim (Embedding, embedding_colwise) = 6 is not divisible by tp_size = 4"]),
    # padded styles never need a divisible vocabulary
    ("lm-head-pads-instead", "colwise_rep", lambda: nn.Linear(8, 7), 4, None, [], []),
    ("vocab-rows-pad-instead", "embedding_rowwise", lambda: nn.Embedding(7, 6), 4, None, [], []),
    # a divisible count is recorded all the same (build_layout lists the tp sizes that would work)
    ("colwise-divisible-recorded", "colwise", lambda: nn.Linear(8, 12), 4, None,
     [("attn.fc.out_features (Linear, colwise)", 12)], []),
    ("packed-replicated-part-not-asked", "packed_colwise", lambda: nn.Linear(8, 12), 4, [8, 2, 2],
     [("attn.fc packed part 0 of out_features", 8)], []),
]


@pytest.mark.parametrize("case", DIVISIBILITY_CASES, ids=[c[0] for c in DIVISIBILITY_CASES])
def test_counts_that_tp_size_must_divide_go_through_need_divisible_and_are_reported_once(case):
    _, style, make, tp, parts, counts, errors = case
    replicated = (1, 2) if case[0].startswith("packed-replicated") else ()
    ctx, _, entry = _plan_case(style, make, tp, 1, parts, replicated)
    assert ctx.counts == counts
    assert ctx.errors == errors, "reported by need_divisible, not again by the spec functions"
    assert entry is not None and entry.style == style
    if errors:
        assert entry.specs == {}, "no spec is made for a module tp_size cannot split"


def test_a_spec_error_that_need_divisible_did_not_report_is_reported_by_plan():
    """Should a context's need_divisible record without reporting, the spec functions' own
    ValueError still reaches the errors, naming the module: plan never swallows it."""
    ctx = _plan_ctx(4, report_indivisible=False)
    entry = STYLES["colwise"].plan(ctx, "attn.fc", nn.Linear(8, 6), _rule("colwise"))
    assert entry.specs == {}
    assert ctx.errors == ["attn.fc (Linear, colwise): a part of the sharded dimension = 6 is not divisible by "
                          "tp_size = 4"]


# ---------------------------------------------------------------------------------------------
# plan: subclasses that override forward

class _OwnForwardLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _SameForwardLinear(nn.Linear):
    pass


class _OwnForwardConv1D(Conv1D):
    def forward(self, x):
        return super().forward(x) + 1


class _OwnForwardEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) + 1


class _ScaledEmbedding(nn.Embedding):
    """A scaled token embedding (Gemma's kind): the lookup times ``embed_scale``."""

    def __init__(self, num, dim, scale):
        super().__init__(num, dim)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale, persistent=False)
        else:
            self.embed_scale = scale

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


@pytest.mark.parametrize("style, make, base", [
    ("colwise", lambda: _OwnForwardLinear(8, 12), "Linear"),
    ("rowwise", lambda: _OwnForwardLinear(8, 12), "Linear"),
    ("colwise_rep", lambda: _OwnForwardLinear(8, 12), "Linear"),
    ("embedding_rowwise", lambda: _OwnForwardEmbedding(10, 8), "Embedding"),
    ("embedding_colwise", lambda: _OwnForwardEmbedding(10, 8), "Embedding"),
], ids=["colwise", "rowwise", "colwise_rep", "embedding_rowwise", "embedding_colwise"])
def test_a_subclass_overriding_forward_is_refused_unless_the_recipe_declares_it(style, make, base):
    module = make()
    rule = _rule(style, parts=3 if style == "packed_colwise" else None)
    ctx = _plan_ctx(2, parts=[4, 4, 4])
    assert STYLES[style].plan(ctx, "fc", module, rule) is None
    assert len(ctx.errors) == 1
    assert ctx.errors[0].startswith(f"fc is a {__name__}.{type(module).__qualname__}, a subclass of {base} that "
                                    f"overrides forward; tpify swaps only what it understands")
    assert "Give it style 'replicate', or declare in the recipe's [subclasses]" in ctx.errors[0]
    declared = _plan_ctx(2, parts=[4, 4, 4], subclasses={type(module).__name__: ("plain", None)})
    entry = STYLES[style].plan(declared, "fc", module, rule)
    assert declared.errors == [] and entry.specs, "declared 'plain': split as the plain layer"
    assert entry.output_scale is None


def test_a_subclass_keeping_the_plain_forward_needs_no_declaration():
    ctx = _plan_ctx(2)
    assert STYLES["colwise"].plan(ctx, "fc", _SameForwardLinear(8, 12), _rule("colwise")).specs
    assert ctx.errors == []


class _SameForwardConv1D(Conv1D):
    pass


def test_a_conv1d_subclass_keeping_forward_is_split_like_conv1d():
    """tpify.hf_modules.is_conv1d says a subclass of Conv1D counts as one ("recognised by name and
    attributes, so that a subclass ... counts too"), and overrides_forward walks the MRO for it."""
    ctx = _plan_ctx(2, parts=[4, 4, 4])
    entry = STYLES["packed_colwise"].plan(ctx, "fc", _SameForwardConv1D(12, 8), _rule("packed_colwise", 3))
    assert ctx.errors == []
    assert entry.specs == {"weight": S(1, (4, 4, 4), 2), "bias": S(0, (4, 4, 4), 2)}


def test_a_conv1d_subclass_overriding_forward_is_refused_as_such_unless_declared():
    module = _OwnForwardConv1D(12, 8)
    ctx = _plan_ctx(2, parts=[4, 4, 4])
    assert STYLES["packed_colwise"].plan(ctx, "fc", module, _rule("packed_colwise", 3)) is None
    assert ctx.errors[0].startswith(f"fc is a {__name__}._OwnForwardConv1D, a subclass of Conv1D that overrides "
                                    f"forward"), ctx.errors
    declared = _plan_ctx(2, parts=[4, 4, 4], subclasses={"_OwnForwardConv1D": ("plain", None)})
    assert STYLES["packed_colwise"].plan(declared, "fc", module, _rule("packed_colwise", 3)) is not None
    assert declared.errors == []


@pytest.mark.parametrize("scale", [3.0, 4, torch.tensor(2.5), torch.tensor(2.5, dtype=torch.float64)],
                         ids=["float", "int", "float32-tensor", "float64-tensor"])
def test_a_declared_scaled_embedding_records_its_scale(scale):
    ctx = _plan_ctx(2, subclasses={"_ScaledEmbedding": ("scaled", "embed_scale")})
    entry = STYLES["embedding_rowwise"].plan(ctx, "fc", _ScaledEmbedding(10, 8, scale), _rule("embedding_rowwise"))
    assert ctx.errors == []
    assert (entry.output_scale, entry.scale_attr) == (float(scale), "embed_scale")
    assert entry.specs == {"weight": S(0, (10,), 2)}


@pytest.mark.parametrize("style, make", [
    ("embedding_colwise", lambda: _ScaledEmbedding(10, 8, 3.0)),  # only a vocabulary-row table may scale
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, "3.0")),
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, True)),
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, None)),
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, torch.tensor([2.0, 3.0]))),
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, torch.tensor(3))),  # an integer tensor
    ("embedding_rowwise", lambda: _ScaledEmbedding(10, 8, torch.tensor(3.0, device="meta"))),  # holds no value
], ids=["embedding_colwise", "string", "bool", "none", "two-elements", "int-tensor", "meta-tensor"])
def test_a_declared_scaled_embedding_is_refused_without_a_numeric_scale_or_with_another_style(style, make):
    module = make()
    ctx = _plan_ctx(2, subclasses={"_ScaledEmbedding": ("scaled", "embed_scale")})
    assert STYLES[style].plan(ctx, "fc", module, _rule(style)) is None
    assert ctx.errors == [f"fc (_ScaledEmbedding): [subclasses] forward = 'scaled' applies to an nn.Embedding with "
                          f"style 'embedding_rowwise' whose attribute 'embed_scale' is a number or a one-element "
                          f"float tensor holding a value; here the style is {style!r} and embed_scale = "
                          f"{module.embed_scale!r}"]


def test_scaled_declared_for_a_linear_subclass_is_refused():
    ctx = _plan_ctx(2, subclasses={"_OwnForwardLinear": ("scaled", "weight")})
    assert STYLES["colwise"].plan(ctx, "fc", _OwnForwardLinear(8, 12), _rule("colwise")) is None
    assert "[subclasses] forward = 'scaled' applies to an nn.Embedding with style 'embedding_rowwise'" in ctx.errors[0]


# ---------------------------------------------------------------------------------------------
# build: at a fake tp size, every rank, the single-source guarantee

LAYER_CLASSES = {"colwise": ColumnParallelLinear, "packed_colwise": ColumnParallelLinear,
                 "colwise_rep": ColumnParallelLinear, "rowwise": RowParallelLinear,
                 "embedding_rowwise": VocabParallelEmbedding, "embedding_colwise": ColumnParallelEmbedding}


def _fake_context(tp, rank, **kwargs):
    """A context of ``tp`` ranks in one process: ``TPContext(None)`` with size and rank set by
    hand. Building only slices (no collective), so it builds what rank ``rank`` of a real group would."""
    ctx = TPContext(None, **kwargs)
    ctx.size, ctx.rank = tp, rank
    return ctx


def _assert_built_from_layout(layer, dense, entry, ctx, style):
    assert type(layer) is LAYER_CLASSES[style]
    assert layer.ctx is ctx and (layer.tp_group, layer.tp_size, layer.tp_rank) == (None, ctx.size, ctx.rank)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {n for n, p in dense.named_parameters()}
    assert names <= set(entry.specs) and all(entry.specs[n] is None for n in set(entry.specs) - names)
    for name, param in layer.named_parameters():
        spec = entry.specs[name]
        source = getattr(dense, name).detach()
        assert shard_spec_of(param) == spec, f"{name}: the layer's spec is the layout's"
        assert param.requires_grad and param.dtype == torch.float64
        if spec is None:
            assert torch.equal(param, source) and param.data_ptr() != source.data_ptr(), f"{name}: a full copy"
        else:
            assert param.shape == spec.local_shape(source.shape)
            assert torch.equal(param, spec.slice_dense(source, ctx.rank)), f"{name} on rank {ctx.rank}"


@pytest.mark.parametrize("case", [c for c in SPEC_CASES if c[1] != "replicate"],
                         ids=[c[0] for c in SPEC_CASES if c[1] != "replicate"])
def test_build_holds_each_ranks_slice_and_carries_the_layout_spec(case):
    _, style, make, tp, pad, parts, replicated, _, _ = case
    _, dense, entry = _plan_case(style, make, tp, pad, parts, replicated)
    for rank in range(tp):
        ctx = _fake_context(tp, rank)
        layer = STYLES[style].build(dense, entry, ctx)
        _assert_built_from_layout(layer, dense, entry, ctx, style)


@pytest.mark.parametrize("style", ["colwise", "packed_colwise", "colwise_rep", "rowwise"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_build_passes_the_layouts_mode_to_the_linear_layer(style, sp):
    """The mode is a construction fact: gather_output for the LM head only, the input already
    split for rowwise, sequence_parallel from the layout entry, the model's region entry shared."""
    _, dense, entry = _plan_case(style, lambda: nn.Linear(8, 12), 2, 1, [4, 4, 4], ())
    entry.sequence_parallel = sp
    ctx = _fake_context(2, 1, region_input=ColumnParallelInput())
    layer = STYLES[style].build(dense, entry, ctx)
    assert layer.sequence_parallel is sp
    assert layer.weight_layout == "linear"
    if style == "rowwise":
        assert layer.input_is_parallel is True and layer.in_features_per_partition == 4
    else:
        assert layer.gather_output is (style == "colwise_rep")
        assert layer.region_input is ctx.region_input
        assert layer.out_features_per_partition == 6


def test_build_of_a_column_layer_without_a_model_region_entry_gets_its_own():
    _, dense, entry = _plan_case("colwise", lambda: nn.Linear(8, 12), 2, 1, None, ())
    a, b = (STYLES["colwise"].build(dense, entry, _fake_context(2, 0)) for _ in range(2))
    assert isinstance(a.region_input, ColumnParallelInput) and a.region_input is not b.region_input


def test_build_of_a_vocab_table_sets_each_ranks_row_range():
    _, dense, entry = _plan_case("embedding_rowwise", lambda: nn.Embedding(10, 8, padding_idx=9), 4, 1, None, ())
    ranges = []
    for rank in range(4):
        layer = STYLES["embedding_rowwise"].build(dense, entry, _fake_context(4, rank))
        assert (layer.num_embeddings, layer.padded_num_embeddings, layer.padding_idx) == (10, 12, 9)
        ranges.append((layer.vocab_start_index, layer.vocab_end_index))
        if rank == 3:  # rows 9, 10, 11: the padding row 9 and two padding rows of the vocabulary
            assert torch.equal(layer.weight[1:], torch.zeros(2, 8, dtype=torch.float64))
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]


@pytest.mark.parametrize("scale", [3.0, torch.tensor(2.5)], ids=["float", "buffer"])
def test_build_of_a_scaled_embedding_hands_the_scale_attribute_to_the_layer(scale):
    dense = _dense(_ScaledEmbedding(10, 8, scale))
    ctx = _plan_ctx(2, subclasses={"_ScaledEmbedding": ("scaled", "embed_scale")})
    entry = STYLES["embedding_rowwise"].plan(ctx, "fc", dense, _rule("embedding_rowwise"))
    layer = STYLES["embedding_rowwise"].build(dense, entry, _fake_context(2, 1))
    _assert_built_from_layout(layer, dense, entry, layer.ctx, "embedding_rowwise")
    if isinstance(scale, torch.Tensor):  # the module's buffer itself: dtype conversions treat it alike
        assert dict(layer.named_buffers())["output_scale"].item() == 2.5
    else:
        assert layer.output_scale == 3.0


@pytest.mark.parametrize("style", LINEAR_STYLES + EMBEDDING_STYLES)
def test_build_works_on_the_meta_device(style):
    make = (lambda: nn.Embedding(10, 8)) if style in EMBEDDING_STYLES else (lambda: Conv1D(12, 8))
    with torch.device("meta"):
        dense = make()
    ctx = _plan_ctx(2, parts=[4, 4, 4])
    entry = STYLES[style].plan(ctx, "fc", dense, _rule(style, parts=3 if style == "packed_colwise" else None))
    layer = STYLES[style].build(dense, entry, _fake_context(2, 0))
    for name, param in layer.named_parameters():
        spec = entry.specs[name]
        assert param.is_meta and shard_spec_of(param) == spec
        assert param.shape == (spec.local_shape(getattr(dense, name).shape) if spec else getattr(dense, name).shape)


def test_replicate_plans_no_spec_and_builds_the_module_itself():
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    ctx = _plan_ctx(4)
    entry = STYLES["replicate"].plan(ctx, "fc", module, _rule("replicate"))
    assert (entry.specs, ctx.errors, ctx.counts) == ({}, [], [])
    assert STYLES["replicate"].build(module, entry, _fake_context(4, 2)) is module
