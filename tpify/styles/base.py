"""What every style is: :class:`Style`, the layout entry it fills, the context it plans in, the registry.

A style owns its whole life cycle (as torch's ``ParallelStyle._apply`` and torchtitan's
``colwise_config()`` do), so that nothing else interprets its name:

* :meth:`Style.read_rule`: the recipe keys it accepts, validated where it lives (the options);
* :meth:`Style.plan`: a module checked at a tp size, its :class:`ModuleLayout` filled, with each
  parameter's :class:`~tpify.sharding.ShardSpec` (:meth:`Style.param_specs`);
* :meth:`Style.build`: the parallel module (surgery); :meth:`Style.install`: its module hooks;
* :meth:`Style.explain`: what ``tpify plan`` prints of it;
* :meth:`Style.from_hf` (and :meth:`~Style.hf_param`, :meth:`~Style.complete_hf`): transformers'
  plan entries it stands for, made into recipe rules (:mod:`tpify.hf_plan` maps HF names to styles).

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) is the method; docs/recipes.md the keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from ..context import TPContext
from ..hf_modules import SHARDABLE_TYPES, config_get, module_kind, overrides_forward, qualname
from ..sharding import ShardSpec

__all__ = ["Style", "ModuleLayout", "PlanContext", "NoOptions", "RuleError", "STYLES", "register", "unregister",
           "style_of", "foreign_key", "AFTER_SUM", "WHOLE"]

#: ``dim`` of an ``experts`` rule's parameter that is not split: a bias added to every expert's
#: output (``down_proj_bias (E, H)``), kept whole and counted once after the sum over the ranks.
AFTER_SUM = -1
#: The "dimension" of a parameter a ``replicate`` rule's ``params`` names: kept whole on purpose.
WHOLE = -2


class RuleError(ValueError):
    """A rule's keys that its style refuses; :mod:`tpify.recipe` raises it as a ``RecipeError``
    naming the recipe file (the message names the rule)."""


@dataclass(frozen=True)
class NoOptions:
    """The options of a style that takes no recipe key of its own."""

    #: Fields whose string values (or string items) name config attributes (``[[include]]``
    #: rewrites them into the sub-config, :func:`tpify.compose.compose`).
    CONFIG_REFS = ()


def config_reads(options) -> list[tuple[str, str]]:
    """``[(config attribute, key)]`` that ``options`` reads from the config (its :attr:`CONFIG_REFS`)."""
    out = []
    for key in type(options).CONFIG_REFS:
        value = getattr(options, key)
        out += [(v, key) for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, str)]
    return out


def with_config_prefix(options, at: Callable[[str], str]):
    """``options`` with each config attribute it names rewritten by ``at`` (``text_config.<name>``)."""
    changes = {}
    for key in type(options).CONFIG_REFS:
        value = getattr(options, key)
        if isinstance(value, tuple):
            changes[key] = tuple(at(v) if isinstance(v, str) else v for v in value)
        elif isinstance(value, str):
            changes[key] = at(value)
    return replace(options, **changes)


def config_ref_or_int(value, minimum: int) -> bool:
    """A recipe value naming a config attribute (a non-empty string) or an integer ``>= minimum``."""
    return (isinstance(value, str) and bool(value)) or (
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum)


#: The message for ``kv_heads`` on a style that does not take it (or of the wrong type).
KV_HEADS_ONLY = ("'kv_heads' (a config attribute name or a positive integer: the KV heads of a 'colwise' layer, of a "
                 "'packed_colwise' layer's replicated_parts, or of a 'per_head' rule's parameters) is for those styles "
                 "only")
#: The message for ``params`` on a style that does not take it.
PARAMS_ONLY = ("'params' is only for styles 'experts' and 'per_head' (and, as a list of the module's own parameter "
               "names kept whole, 'replicate')")


@dataclass
class ModuleLayout:
    """What happens to one module: its FQN, the style, the rule that said so, per-style sizes.

    Attributes:
        partition_sizes: global widths of the packed parts (``packed_colwise``), each split alike.
        padded_size: the vocabulary padded to a multiple of ``tp_size`` (vocab-row styles), or None.
        replicated_parts: indices of the parts replicated over groups of ranks (K/V parts when
            ``tp_size`` exceeds the KV heads); ``replica_shards`` their KV heads (each held by
            ``tp_size / replica_shards`` consecutive ranks), 1 with none.
        output_scale: the constant a scaled-embedding subclass multiplies its output by (the
            recipe's ``[subclasses]``), or None; ``scale_attr`` the module attribute holding it.
        specs: each parameter's :class:`ShardSpec` (``None``: replicated), by parameter name.
        sequence_parallel: the layer lies in a sequence-parallel stretch (built with it).
        params: ``experts`` / ``per_head``: ``(parameter, split dimension, packed parts)``
            (:data:`AFTER_SUM`: kept whole, counted once); ``replicate``: its own parameters kept
            whole (:data:`WHOLE`).
        expert_parallel: ``experts``: whole experts per rank, split along dim 0, tokens exchanged.
        shared_features: ``latent``: the trailing output features every head reads (rotary key).
        uneven: a split dimension ``tp_size`` does not divide is split by torch.chunk's rule
            (:func:`tpify.sharding.chunk_range`), allowed only where no head is found.
        identity_experts: ``experts``: the first index of the zero-computation identity experts.
    """

    fqn: str
    style: str
    rule: int
    partition_sizes: list[int] | None = None
    padded_size: int | None = None
    replicated_parts: tuple[int, ...] = ()
    replica_shards: int = 1
    output_scale: float | None = None
    scale_attr: str | None = None
    specs: dict[str, ShardSpec | None] = field(default_factory=dict)
    sequence_parallel: bool = False
    params: tuple[tuple[str, int, int], ...] = ()
    expert_parallel: bool = False
    shared_features: int = 0
    uneven: bool = False
    identity_experts: int | None = None

    @property
    def styler(self) -> "Style":
        """The :class:`Style` object of :attr:`style`."""
        return STYLES[self.style]


@dataclass
class PlanContext:
    """What :meth:`Style.plan` checks a module against: the model, its config, the recipe, the tp
    size and padding, and where problems go (``errors``; ``need_divisible(what, value)`` records a
    count ``tp_size`` must divide). ``packed_sizes(rule, out_features, owner, fqn)``: the global
    widths of a packed layer's parts (None: the style weighs them itself); ``ep_size``: ``tp_size``
    under expert parallelism, else 1; ``kv_shards(what, kv)``: the planner's KV-head placement
    (None: :meth:`kv_placement`'s own rule); ``may_be_uneven(fqn)``: whether module ``fqn`` may
    split a size ``tp_size`` does not divide (it holds no head; None: never)."""

    model: nn.Module
    config: object
    recipe: object
    tp_size: int
    pad_vocab_multiple: int
    errors: list[str]
    need_divisible: Callable[[str, int], None]
    packed_sizes: Callable | None = None
    ep_size: int = 1
    kv_shards: Callable | None = None
    may_be_uneven: Callable[[str], bool] | None = None

    def split_size(self, fqn: str, what: str, value: int, entry: ModuleLayout) -> None:
        """A size module ``fqn`` splits: ``tp_size`` must divide it (:attr:`need_divisible`),
        unless the module may split unevenly; then an indivisible size sets ``entry.uneven``."""
        if self.may_be_uneven is not None and self.may_be_uneven(fqn):
            if value % self.tp_size:
                entry.uneven = True
            return
        self.need_divisible(what, value)

    def kv_placement(self, what: str, kv: int):
        """How ``kv`` KV heads go over the ranks: None (split), ``kv`` (each held by ``tp_size / kv``
        ranks) or False (neither; the error recorded)."""
        if self.kv_shards is not None:
            return self.kv_shards(what, kv)
        if kv % self.tp_size == 0:
            return None
        if self.tp_size % kv == 0:
            return kv
        self.errors.append(f"{what}: {kv} KV heads at tp_size = {self.tp_size}: tp_size must divide them or be a "
                           f"multiple of them")
        return False

    def kv_heads(self, rule, fqn: str) -> int | None:
        """The rule's ``kv_heads`` as a number (a config attribute read), or None (an error recorded
        when it is no positive integer)."""
        value = rule.kv_heads if not isinstance(rule.kv_heads, str) else config_get(self.config, rule.kv_heads)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.errors.append(f"{fqn}: {rule.describe()} reads its KV heads from config.{rule.kv_heads}, which is "
                               f"{value!r}, not a positive integer")
            return None
        return value


class Style:
    """One recipe style. Subclasses set the class attributes and override what differs.

    Attributes:
        name: the recipe's name for it.
        kind: the module kind it splits (``"linear"``, ``"embedding"``, ``"params"``: named
            parameters of another module), or None (any module: ``replicate``).
        region: ``"start"``: a sharded region begins after the module (its output stays split);
            ``"end"``: one ends before it (its input is split); else None (tpify.hooks.dropout,
            tpify.hooks.region_grads follow the regions).
        lm_head: the vocabulary-parallel LM head (the parallel LM loss reads its shards).
        vocab_rows: splits a vocabulary's rows (a tied embedding and head must both do so).
        packed: its output holds packed parts, each split alike.
        moe: fused MoE experts (under sequence parallelism their block is gathered whole).
        copies_whole: a full copy and nothing added (a replicated container's own meaning).
        tied_head: the style an LM head tied to this embedding's weight must have (split alike).
        sums_own_grads: its parameters' gradients are partial on each rank and summed over the
            group by tpify.hooks.region_grads (not found by construction).
        sequence_parallel: whether ``sequence_parallel=True`` supports it; else why not
            (``sequence_parallel_refusal``).
        KEYS: the recipe keys it takes, each with the message for a style that does not.
        Options: the frozen dataclass :meth:`read_rule` returns (``rule.options``).
        scales_output: its layer takes a scaled subclass's constant factor (``[subclasses]``
            forward = 'scaled').
        hf_note: the note of a rule imported from transformers' style of the same meaning.
    """

    name = ""
    kind: str | None = None
    region: str | None = None
    lm_head = False
    vocab_rows = False
    packed = False
    moe = False
    scales_output = False
    copies_whole = False
    tied_head: str | None = None
    sums_own_grads = False
    sequence_parallel = True
    sequence_parallel_refusal = ""
    KEYS: dict[str, str] = {}
    Options = NoOptions
    hf_note = "HF {hf_style}: style {name}"

    @property
    def shards(self) -> bool:
        """Whether the style splits the module at all."""
        return self.kind is not None

    @property
    def column(self) -> bool:
        """A column-parallel linear whose output stays split (its width may be heads)."""
        return self.kind == "linear" and self.region == "start"

    def accepts(self, module: nn.Module) -> bool:
        """Whether ``module`` is of the kind this style splits (any module for ``replicate``)."""
        return self.kind is None or module_kind(module) == self.kind

    # -- the recipe ----------------------------------------------------------------------------
    def read_rule(self, raw: dict, where: str):
        """The options of a rule giving this style: ``raw`` holds the rule's style keys (every key
        a rule takes but the common ones; ``kv_heads`` included when given), ``where`` names the
        rule. Raises :class:`RuleError` for a key the style does not take or a malformed value."""
        self.refuse_foreign(raw, where)
        return self.Options()

    def refuse_foreign(self, raw: dict, where: str) -> None:
        """A :class:`RuleError` for the first key of ``raw`` this style does not take, with the
        message of a registered style that does (``'parts' is only for style 'packed_colwise'``)."""
        for key in raw:
            if key not in self.KEYS:
                raise RuleError(f"{where}: {foreign_key(key)}")

    def head_owner(self, fqn: str, module: nn.Module, rule, widths: set[int]) -> str | None:
        """The module that holds attention heads, judged from this rule on module ``fqn`` (no
        dimension inside it is split unevenly; :meth:`tpify.planner.Planner.find_heads`), or None.
        ``widths``: the widths of a layer holding heads (head counts times the head size)."""
        return None

    def is_container(self, rule) -> bool:
        """Whether, on a module that is no layer, the rule replicates everything inside it."""
        return False

    def covers(self, entry: ModuleLayout, pname: str) -> bool:
        """Whether the module's entry covers its own parameter ``pname`` (the coverage check)."""
        return True

    # -- planning ------------------------------------------------------------------------------
    def plan(self, ctx: PlanContext, fqn: str, module: nn.Module, rule) -> ModuleLayout | None:
        """Check ``module`` for this style and return its :class:`ModuleLayout` (specs included),
        or None after appending to ``ctx.errors``. Pure; no communication."""
        entry = ModuleLayout(fqn, self.name, rule.index)
        before = len(ctx.errors)
        if not self._check_module(ctx, fqn, module, rule, entry) or not self._sizes(ctx, fqn, module, rule, entry):
            return None
        try:
            entry.specs = self.param_specs(module, entry, ctx.tp_size)
        except ValueError as e:  # sizes tp_size does not divide: reported by need_divisible, unless something else
            if len(ctx.errors) == before:
                ctx.errors.append(f"{fqn} ({type(module).__name__}, {self.name}): {e}")
        return entry

    def _check_module(self, ctx: PlanContext, fqn: str, module: nn.Module, rule, entry: ModuleLayout) -> bool:
        """The module is of this style's kind and computes what the plain layer computes (or the
        recipe's ``[subclasses]`` says what its ``forward`` adds)."""
        kind = module_kind(module)
        if not self.accepts(module):
            ctx.errors.append(f"{fqn} is a {type(module).__name__}; style {self.name!r} ({rule.describe()}) does not "
                              f"apply to it" if kind is not None else
                              f"{fqn} is a {qualname(module)}, not one of {SHARDABLE_TYPES}; {rule.describe()} gives "
                              f"it style {self.name!r} (only 'replicate' applies to a container module)")
            return False
        overridden = overrides_forward(module)
        if not overridden:
            return True
        declared = ctx.recipe.subclasses.get(type(module).__name__)
        if declared is None:
            ctx.errors.append(f"{fqn} is a {qualname(module)}, a subclass of {overridden} that overrides forward; "
                              f"tpify swaps only what it understands (its parallel version would drop what that "
                              f"forward adds). Give it style 'replicate', or declare in the recipe's [subclasses] "
                              f"what its forward computes (forward = 'plain' or 'scaled', docs/recipes.md)")
            return False
        forward, scale_attr = declared
        if forward != "scaled":
            return True
        scale = getattr(module, scale_attr, None)
        number = (isinstance(scale, (int, float)) and not isinstance(scale, bool)) or (
            isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.is_meta and scale.is_floating_point())
        if not self.scales_output or not number:
            ctx.errors.append(f"{fqn} ({type(module).__name__}): [subclasses] forward = 'scaled' applies to an "
                              f"nn.Embedding with style 'embedding_rowwise' whose attribute {scale_attr!r} is a number "
                              f"or a one-element float tensor holding a value; here the style is {self.name!r} and "
                              f"{scale_attr} = {scale!r}")
            return False
        entry.output_scale, entry.scale_attr = float(scale), scale_attr
        return True

    def _sizes(self, ctx: PlanContext, fqn: str, module: nn.Module, rule, entry: ModuleLayout) -> bool:
        """Check and record the style's sizes (divisibility, padding, parts); False on an error."""
        return True

    def param_specs(self, module: nn.Module, entry: ModuleLayout, tp_size: int) -> dict[str, ShardSpec | None]:
        """Each parameter's spec, by name (``None``: replicated)."""
        return {}

    # -- the model -----------------------------------------------------------------------------
    def build(self, module: nn.Module, entry: ModuleLayout, ctx: TPContext) -> nn.Module:
        """The parallel module holding this rank's shard of ``module`` (surgery), in the model's
        context ``ctx``; ``module`` itself when the style does not split. Works on the meta device."""
        return module

    def install(self, module: nn.Module, entry: ModuleLayout, ctx: TPContext) -> list:
        """The hooks this style needs on its (built) ``module`` at run time; their handles (each
        has ``remove()``). None by default. Communication: none here."""
        return []

    def explain(self, entry: ModuleLayout, param: str | None = None, source: str = "") -> str:
        """What ``tpify plan`` prints: with ``param``, why that parameter (kept whole) is whole;
        without, a note on how the module's parameters are split ("" when the table says it all).
        ``source``: the rule it comes from, as the plan says it (``from rule #3 (match 'h.*')``)."""
        return f"not split by style {self.name!r}" if param is not None else ""

    # -- transformers' plans (tpify.hf_plan) ---------------------------------------------------
    def from_hf(self, imp, entry) -> None:
        """Make a recipe rule of transformers' plan entry ``entry`` (``key``, ``hf_style``, the
        modules it matches) with ``imp.add_rule``, or raise ``imp.error``: the module kind the
        style splits (a forward-overriding layer kept whole, for review), noted ``self.hf_note``."""
        imp.require_kind(entry, self.kind)
        if imp.keep_overridden(entry):
            return
        imp.add_rule(entry.key, entry.names, self.name, self.hf_note.format(hf_style=entry.hf_style, name=self.name),
                     **self.hf_options(imp, entry))

    def hf_options(self, imp, entry) -> dict:
        """The rule keys the style adds to a rule imported from transformers' plan."""
        return {}

    def hf_param(self, imp, owner: str, leaf: str, hf_style: str, shape: tuple) -> bool:
        """Whether the style takes transformers' plan entry on parameter ``owner.leaf``."""
        return False

    def complete_hf(self, imp) -> None:
        """What the style adds to an imported plan after every entry is read (none by default)."""


#: Every style a recipe may name, by name, in the order the registry lists them.
STYLES: dict[str, Style] = {}


def register(style):
    """Add ``style`` (an instance, or a :class:`Style` subclass, instantiated) to :data:`STYLES`;
    returns it (usable as a class decorator).

    Raises:
        ValueError: a style of that name is registered already, or the object is no Style.
    """
    obj = style() if isinstance(style, type) else style
    if not isinstance(obj, Style) or not obj.name:
        raise ValueError(f"tpify.styles.register takes a named Style, got {style!r}")
    if obj.name in STYLES:
        raise ValueError(f"a style named {obj.name!r} is registered already ({type(STYLES[obj.name]).__name__})")
    STYLES[obj.name] = obj
    return style


def foreign_key(key: str) -> str:
    """What a rule is told when it gives ``key`` to a style that does not take it: the message of
    the registered style that does (its ``KEYS``)."""
    return next((s.KEYS[key] for s in STYLES.values() if key in s.KEYS), f"'{key}' is no style's key")


def unregister(name: str) -> None:
    """Remove the style ``name`` from :data:`STYLES` (a test's toy style)."""
    STYLES.pop(name, None)


def style_of(name: str) -> Style:
    """The :class:`Style` named ``name``.

    Raises:
        KeyError: no such style (recipes are validated against ``STYLES`` when read).
    """
    return STYLES[name]


def slice_params(module: nn.Module, specs: dict, rank: int) -> None:
    """Each parameter of ``module`` that has a spec replaced by this rank's slice (carrying the
    spec); parameters without one (``None``) stay whole. Works on the meta device."""
    with torch.no_grad():
        for name, spec in specs.items():
            if spec is None:
                continue
            dense = getattr(module, name)
            shard = nn.Parameter(spec.slice_dense(dense, rank), requires_grad=dense.requires_grad)
            shard.tp_shard_spec = spec
            setattr(module, name, shard)
