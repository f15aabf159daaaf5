"""The layout: everything tpify decides about a model at a tp size, in one validated object.

:func:`build_layout` matches a recipe (``tpify/recipe.py``) to a model's module tree (on meta or
real weights) for ``tp_size``. It is pure and deterministic: the same model, recipe and size give
the same layout (or raise the same :class:`PlanError`) on every rank, and it issues no
collective, so bad input fails on every rank at the same point. Every later stage takes the
layout instead of re-deriving what it needs:

* surgery (:func:`tpify.engine.apply_layout`): per module the style and per-rank sizes, the
  module attributes and config values to divide;
* sharded loading and saving (:mod:`tpify.loading`): which modules are sharded, the checkpoint
  key renames, the config values to write back dense;
* the dropout streams and gradient hooks (:mod:`tpify.random`, :mod:`tpify.engine`): the
  sharded regions, from the output of each column-parallel layer to the next row-parallel one;
* the parallel loss (:mod:`tpify.loss`): the LM head and the loss kind, from the recipe's
  ``[loss]`` table (or the head class's own ``loss_type``), never from class-name suffixes or
  source text.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) is the method; ``docs/recipes.md`` the
recipe format.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from .agree import digest
from .integrations.model import is_peft
from .recipe import Recipe, Rule, RuleIndex
from .sharding import pad_vocab_size, valid_tp_sizes

__all__ = ["PlanError", "ModuleLayout", "Layout", "build_layout", "relative_fqn", "SHARDABLE_TYPES"]


class PlanError(ValueError):
    """A recipe does not fit a model at a tp size: uncovered modules, indivisible counts, ..."""


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        return "linear"
    return None


SHARDABLE_TYPES = "nn.Linear, transformers Conv1D, nn.Embedding"


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _base_model(model: nn.Module) -> nn.Module:
    """The base model (``model.transformer`` of ``GPT2LMHeadModel``), or ``model`` itself."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return base if isinstance(base, nn.Module) else model


def relative_fqn(model: nn.Module, fqn: str) -> str:
    """``fqn`` relative to the base model, as rules are written: ``transformer.h.0`` -> ``h.0``;
    the base model itself is ``""`` (so ``match = ""`` matches it)."""
    prefix = getattr(model, "base_model_prefix", "")
    if _base_model(model) is not model:
        if fqn == prefix:
            return ""
        if fqn.startswith(prefix + "."):
            return fqn[len(prefix) + 1:]
    return fqn


_PLAIN_FORWARDS = {nn.Linear: nn.Linear.forward, nn.Embedding: nn.Embedding.forward}


def _overrides_forward(module: nn.Module) -> str | None:
    """The plain layer class whose ``forward`` ``module``'s class overrides, or None."""
    for plain, forward in _PLAIN_FORWARDS.items():
        if isinstance(module, plain):
            return None if type(module).forward is forward else plain.__name__
    if _is_conv1d(module):
        for klass in type(module).__mro__:
            if klass.__name__ == "Conv1D":
                return None if type(module).forward is klass.forward else "Conv1D"
    return None


# HF's own declaration of a head class's loss (PreTrainedModel.loss_type), when the recipe's
# [loss] table does not list the class.
_HF_LOSS_TYPES = {"ForCausalLM": "causal", "ForMaskedLM": "masked"}


def _loss_of(model: nn.Module, recipe: Recipe) -> tuple[str | None, bool]:
    """``(loss kind, honours num_items_in_batch)`` of a head class: the recipe's ``[loss]`` entry
    for its class name, else HF's ``loss_type`` declaration, else None (HF's own loss)."""
    name = type(model).__name__
    kind = recipe.loss.get(name)
    if kind is None:
        kind = _HF_LOSS_TYPES.get(getattr(model, "loss_type", None) or "")
    return (None if kind in (None, "none") else kind), name not in recipe.ignores_num_items


@dataclass
class ModuleLayout:
    """What happens to one module: its FQN, the style, the rule that said so, per-style sizes.

    Attributes:
        partition_sizes: global widths of the packed parts (``packed_colwise``), each split alike.
        padded_size: the vocabulary padded to a multiple of ``tp_size`` (vocab-row styles), or None.
        replicated_parts: indices of packed parts kept whole on every rank (multi-query K/V).
        output_scale: the constant a scaled-embedding subclass multiplies its output by (the
            recipe's ``[subclasses]``), or None; ``scale_attr`` the module attribute holding it
            (surgery hands the attribute itself, a number or the module's buffer, to the layer).
    """

    fqn: str
    style: str
    rule: int
    partition_sizes: list[int] | None = None
    padded_size: int | None = None
    replicated_parts: tuple[int, ...] = ()
    output_scale: float | None = None
    scale_attr: str | None = None


@dataclass
class Layout:
    """The validated outcome of matching a recipe to a model at ``tp_size``.

    Attributes:
        tp_size: ranks the model is split over.
        pad_vocab_multiple: vocabulary-split tables are padded to a multiple of this times ``tp_size``.
        recipe: the recipe it came from.
        model_class: the class name of the model it was built for.
        modules: module FQN -> :class:`ModuleLayout`, for every ``nn.Linear``/``Conv1D``/
            ``nn.Embedding`` (``replicate`` included).
        divides: module FQN -> attribute names divided by ``tp_size`` on each rank (head counts).
        config_divides: config attribute -> its dense value; divided by ``tp_size`` on the
            parallel model's config (HF code reads some at forward time), written dense on save.
        lm_head: the FQN of the vocabulary-parallel LM head (style ``colwise_rep``), or None.
        loss_kind: ``"causal"``, ``"masked"`` or None (HF's own loss on gathered logits).
        honours_num_items: whether the model's own loss divides by ``num_items_in_batch``.
        loss_terms: ``(output field, coefficient)`` pairs HF adds to the LM loss (a mixture of
            experts' ``router_aux_loss_coef * aux_loss``); the coefficient is a config
            attribute name or a number (the recipe's ``[loss] terms``).
        renames: checkpoint key suffix renames ``(old, new)``, applied when loading.
        sequence_parallel: with ``sequence_parallel=True``, the FQNs ``{"split": ..., "gather":
            [...], "exit": ...}`` of the recipe's ``[sequence_parallel]`` table; else None.
        head_inputs: module FQN -> ``(argument, dim, dense head count)`` for each forward argument
            that holds one entry per attention head (ALiBi biases built by the base model for
            all heads): each rank gets its own heads' slice.
        region_starts: column-parallel layers whose output stays sharded (a sharded region
            begins after each).
        region_ends: row-parallel layers (a sharded region ends before each).
        unmatched_rules: non-optional rules that matched nothing (warned about by surgery).
    """

    tp_size: int
    recipe: Recipe
    model_class: str = ""
    pad_vocab_multiple: int = 1
    modules: dict[str, ModuleLayout] = field(default_factory=dict)
    divides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    config_divides: dict[str, int] = field(default_factory=dict)
    lm_head: str | None = None
    loss_kind: str | None = None
    honours_num_items: bool = True
    loss_terms: tuple[tuple[str, str | float], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    head_inputs: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    sequence_parallel: dict | None = None
    region_starts: tuple[str, ...] = ()
    region_ends: tuple[str, ...] = ()
    unmatched_rules: list[Rule] = field(default_factory=list)

    def sharded(self) -> set[str]:
        """FQNs of the modules that are split (every style but ``replicate``)."""
        return {fqn for fqn, m in self.modules.items() if m.style != "replicate"}

    def digest(self) -> str:
        """A short digest of what decides the per-rank tensors besides ``tp_size`` (which the
        agreement compares on its own, so that a different size is reported as such)."""
        return digest([sorted((f, m.style, m.partition_sizes, m.padded_size, m.replicated_parts, m.output_scale)
                                   for f, m in self.modules.items()),
                            sorted((f, list(a)) for f, a in self.divides.items()), sorted(self.config_divides.items()),
                            self.lm_head, self.loss_kind, self.honours_num_items, list(self.loss_terms), list(self.renames),
                            sorted(self.head_inputs.items()), self.sequence_parallel])


def _outermost_container(fqn: str, containers: dict[str, Rule]) -> str | None:
    """The outermost replicated container holding ``fqn`` (``""``: the root), or None; a lookup per
    ancestor, not a scan of every container."""
    if not fqn:
        return None
    parts = fqn.split(".")
    return next((c for c in ("", *(".".join(parts[:i]) for i in range(1, len(parts)))) if c in containers), None)


def _dims(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def _packed_sizes(rule: Rule, out_features: int, config, owner: nn.Module | None, fqn: str,
                  errors: list[str]) -> list[int] | None:
    """Global widths of the packed parts: ``out_features`` split in proportion to the weights.

    A weight named by a config attribute is checked against the attribute of the same name on the
    module that owns the layer (the attention module), when it has one: HF code views the packed
    output with the module's value, and a config that says otherwise (falcon's ``num_kv_heads``
    in multi-query mode: 4 in the config, 1 in the module) would mis-split the weight.
    """
    if isinstance(rule.parts, int):
        weights = [1] * rule.parts
    else:
        weights = []
        for name in rule.parts:
            if isinstance(name, int):
                weights.append(name)
                continue
            value = getattr(config, name, None)
            if not isinstance(value, int):
                errors.append(f"{fqn}: {rule.describe()} weighs its parts by config.{name}, which is {value!r}")
                return None
            used = getattr(owner, name, None) if owner is not None else None
            if isinstance(used, int) and not isinstance(used, bool) and used != value:
                errors.append(f"{fqn}: {rule.describe()} weighs its parts by config.{name} = {value}, but the module "
                              f"that owns it ({type(owner).__name__}) has {name} = {used}, which its forward uses; "
                              f"weigh the parts by what the module uses (a literal integer, or a 'when' condition "
                              f"for this configuration)")
                return None
            weights.append(value)
    total = sum(weights)
    if out_features % total:
        errors.append(f"{fqn}: out_features = {out_features} cannot be split in parts weighed {weights}")
        return None
    return [out_features // total * w for w in weights]


def build_layout(model: nn.Module, recipe: Recipe, tp_size: int, *, pad_vocab_multiple: int = 1,
                 sequence_parallel: bool = False) -> Layout:
    """Match ``recipe`` against ``model`` and validate it for ``tp_size``; no collectives.

    Every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` must be matched by exactly one rule with
    a style (``replicate`` counts). Rules that match nothing warn, unless ``optional``.
    Vocabulary-split tables (``embedding_rowwise``, ``colwise_rep``) are padded to a multiple of
    ``pad_vocab_multiple * tp_size`` rows.

    Raises:
        PlanError: with every problem found, each naming the module and the numbers: modules no
            rule covers (listed by FQN), modules two rules claim, a style on the wrong module
            type, counts (config values, attributes to divide, features of sharded layers) that
            ``tp_size`` does not divide, with the tp sizes that would work.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(pad_vocab_multiple, int) or isinstance(pad_vocab_multiple, bool) or pad_vocab_multiple < 1:
        raise PlanError(f"pad_vocab_multiple must be a positive integer (the vocabulary is padded to a multiple of "
                        f"pad_vocab_multiple * tp_size), got {pad_vocab_multiple!r}")
    step = pad_vocab_multiple * tp_size
    peft = [fqn or "<root>" for fqn, m in model.named_modules() if is_peft(m)]
    if peft:
        raise PlanError(f"cannot parallelize {type(model).__name__}: it holds PEFT modules ({peft[:3]}"
                        f"{' ...' if len(peft) > 3 else ''}). Parallelize the base model first, then add the adapters: "
                        f"model = tpify.parallelize(model); model = tpify.integrations.get_peft_model(model, lora_config)")
    config = getattr(model, "config", None)
    layout = Layout(tp_size, recipe, type(model).__name__, pad_vocab_multiple, renames=recipe.renames)
    errors: list[str] = []
    constraints: list[int] = []
    indivisible: list[str] = []

    def need_divisible(what: str, value: int):
        constraints.append(value)
        if value % tp_size:
            indivisible.append(what)
            fewer = (" (fewer than tp_size: each rank must hold whole ones, and tpify does not copy one onto "
                     "several ranks)" if 0 < value < tp_size else "")
            errors.append(f"{what} = {value} is not divisible by tp_size = {tp_size}{fewer}")

    for name in recipe.divisible + recipe.divide_config:
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"recipe {recipe.source} requires config.{name} to be an integer; it is {value!r}")
        else:
            need_divisible(f"config.{name} ({type(model).__name__})", value)
            if name in recipe.divide_config:
                layout.config_divides[name] = value

    # Rules whose `when` conditions the config does not meet take no part (and do not warn).
    # The work is linear in the rules (a recipe may list thousands): rules are looked up by name
    # where they can be (RuleIndex), and `matched` holds indices, never compares Rule objects.
    active = [rule for rule in recipe.rules if rule.applies(config)]
    index = RuleIndex(active)
    matched = {rule.index for rule in recipe.rules} - {rule.index for rule in active}  # inactive ones never warn
    uncovered: list[str] = []
    containers: dict[str, Rule] = {}  # replicated container FQN -> its rule
    base = _base_model(model)
    for fqn, module in model.named_modules():
        if not fqn and base is not model:
            continue  # the head class's root: rules are written relative to the base model
        rel = relative_fqn(model, fqn)
        hits = index.hits(rel)
        matched.update(rule.index for rule in hits)
        for rule in hits:
            for attr in rule.divide:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} divides attribute "
                                  f"{attr!r}, which is {value!r}, not an integer")
                else:
                    need_divisible(f"{fqn}.{attr}", value)
            if rule.divide:
                layout.divides[fqn] = layout.divides.get(fqn, ()) + rule.divide
            for arg, dim, heads_attr in rule.head_inputs:
                heads = getattr(config, heads_attr, None)
                if not isinstance(heads, int) or isinstance(heads, bool):
                    errors.append(f"{fqn}: {rule.describe()} slices argument {arg!r} by config.{heads_attr}, which "
                                  f"is {heads!r}, not an integer")
                    continue
                need_divisible(f"config.{heads_attr} (heads of {fqn}'s argument {arg!r})", heads)
                params = inspect.signature(type(module).forward).parameters
                if arg not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    errors.append(f"{fqn}: {rule.describe()} slices argument {arg!r}, but "
                                  f"{type(module).__name__}.forward takes no such argument")
                    continue
                layout.head_inputs[fqn] = layout.head_inputs.get(fqn, ()) + ((arg, dim, heads),)
        styled = [rule for rule in hits if rule.style is not None]
        kind = _kind(module)
        container = _outermost_container(fqn, containers)
        if kind is None:
            if styled and styled[0].style == "replicate" and len(styled) == 1:
                containers[fqn] = styled[0]  # everything shardable inside it stays a full copy
            elif styled:
                errors.append(f"{fqn} is a {_qualname(module)}, not one of {SHARDABLE_TYPES}; "
                              f"{styled[0].describe()} gives it style {styled[0].style!r} (only 'replicate' "
                              f"applies to a container module)")
            continue
        if container is not None:
            if styled and any(r.style != "replicate" for r in styled):
                errors.append(f"{fqn} is inside {container or '<base model>'}, which "
                              f"{containers[container].describe()} replicates, but {styled[0].describe()} gives it "
                              f"style {styled[0].style!r}")
                continue
            styled = [containers[container]]
        if not styled:
            uncovered.append(f"{rel or '<base model>'} ({type(module).__name__})")
            continue
        if len(styled) > 1:
            errors.append(f"{fqn} is matched by several styled rules: {[r.describe() for r in styled]}")
            continue
        rule = styled[0]
        entry = ModuleLayout(fqn, rule.style, rule.index)
        if rule.style == "replicate":
            layout.modules[fqn] = entry
            continue
        overridden = _overrides_forward(module)
        if overridden:
            declared = recipe.subclasses.get(type(module).__name__)
            if declared is None:
                errors.append(f"{fqn} is a {_qualname(module)}, a subclass of {overridden} that overrides forward; "
                              f"tpify swaps only what it understands (its parallel version would drop what that "
                              f"forward adds). Give it style 'replicate', or declare in the recipe's [subclasses] "
                              f"what its forward computes (forward = 'plain' or 'scaled', docs/recipes.md)")
                continue
            forward, scale_attr = declared
            if forward == "scaled":
                scale = getattr(module, scale_attr, None)
                number = (isinstance(scale, (int, float)) and not isinstance(scale, bool)) or (
                    isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.is_meta
                    and scale.is_floating_point())
                if kind != "embedding" or rule.style != "embedding_rowwise" or not number:
                    errors.append(f"{fqn} ({type(module).__name__}): [subclasses] forward = 'scaled' applies to an "
                                  f"nn.Embedding with style 'embedding_rowwise' whose attribute {scale_attr!r} is a "
                                  f"number or a one-element float tensor holding a value; here the style is "
                                  f"{rule.style!r} and {scale_attr} = {scale!r}")
                    continue
                entry.output_scale, entry.scale_attr = float(scale), scale_attr
        embedding_style = rule.style in ("embedding_rowwise", "embedding_colwise")
        if (kind == "embedding") != embedding_style:
            errors.append(f"{fqn} is a {type(module).__name__}; style {rule.style!r} ({rule.describe()}) "
                          f"does not apply to it")
            continue
        if kind == "embedding":
            if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
                errors.append(f"{fqn}: {rule.style} cannot shard an nn.Embedding with max_norm, "
                              f"scale_grad_by_freq or sparse (they need the whole table); use 'replicate'")
                continue
            if rule.style == "embedding_colwise":
                need_divisible(f"{fqn}.embedding_dim ({type(module).__name__}, embedding_colwise)",
                               module.embedding_dim)
            else:
                entry.padded_size = pad_vocab_size(module.num_embeddings, tp_size, pad_vocab_multiple)
        else:
            in_f, out_f = _dims(module)
            if rule.style == "rowwise":
                need_divisible(f"{fqn}.in_features ({type(module).__name__}, rowwise)", in_f)
            elif rule.style == "colwise_rep":
                if out_f % step:
                    entry.padded_size = pad_vocab_size(out_f, tp_size, pad_vocab_multiple)
            elif rule.style == "packed_colwise":
                owner = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else None
                sizes = _packed_sizes(rule, out_f, config, owner, fqn, errors)
                if sizes is not None:
                    entry.partition_sizes = sizes
                    entry.replicated_parts = rule.replicated_parts
                    for i, size in enumerate(sizes):
                        if i not in rule.replicated_parts:
                            need_divisible(f"{fqn} packed part {i} of out_features", size)
            else:
                need_divisible(f"{fqn}.out_features ({type(module).__name__}, colwise)", out_f)
        layout.modules[fqn] = entry

    errors.extend(_tie_conflicts(model, layout))
    heads = [fqn for fqn, m in layout.modules.items() if m.style == "colwise_rep"]
    if len(heads) > 1:
        errors.append(f"several colwise_rep LM heads {heads}: the parallel LM loss supports one; give the others "
                      f"'replicate' or 'colwise'")
    layout.lm_head = heads[0] if heads else None
    layout.loss_kind, layout.honours_num_items = _loss_of(model, recipe) if heads else (None, True)
    if layout.loss_kind is not None:
        layout.loss_terms = recipe.loss_terms
        for output, coefficient in recipe.loss_terms:
            if isinstance(coefficient, str) and not isinstance(getattr(config, coefficient, None), (int, float)):
                errors.append(f"recipe {recipe.source}: [loss] terms scales {output!r} by config.{coefficient}, which "
                              f"{type(model).__name__}'s config does not hold as a number")
    layout.region_starts = tuple(f for f, m in layout.modules.items()
                                 if m.style in ("colwise", "packed_colwise", "embedding_colwise"))
    layout.region_ends = tuple(f for f, m in layout.modules.items() if m.style == "rowwise")
    if sequence_parallel:
        layout.sequence_parallel = _sequence_layout(model, recipe, layout, errors)
    if uncovered:
        errors.insert(0, f"{len(uncovered)} module(s) of types {SHARDABLE_TYPES} are covered by no rule of recipe "
                         f"{recipe.source} (names relative to the base model, as rules are written): {uncovered}. "
                         f"Add a rule for each (style 'replicate' to keep a full copy on every rank).")
    if errors:
        # The sizes that would work answer a divisibility error only (not an uncovered module).
        hint = (f" tp sizes that would work for this model: {valid_tp_sizes(*constraints)}."
                if indivisible and constraints else "")
        raise PlanError(f"cannot parallelize {type(model).__name__} with recipe {recipe.source} at "
                        f"tp_size = {tp_size}:\n  - " + "\n  - ".join(errors) + ("\n" + hint if hint else ""))
    layout.unmatched_rules = [r for r in recipe.rules if r.index not in matched and not r.optional]
    return layout


def _sequence_layout(model: nn.Module, recipe: Recipe, layout: Layout, errors: list[str]) -> dict | None:
    """Resolve the recipe's ``[sequence_parallel]`` globs to FQNs and check that every column- and
    row-parallel layer lies inside a module whose input is gathered (elsewhere it would receive
    ``T/p`` tokens, or reduce-scatter an output nobody gathers)."""
    sp = recipe.sequence_parallel
    if sp is None:
        errors.append(f"sequence_parallel=True, but recipe {recipe.source} has no [sequence_parallel] table marking "
                      f"where the tokens are split and gathered (docs/recipes.md)")
        return None
    from .recipe import _compile_glob

    names = [(fqn, relative_fqn(model, fqn)) for fqn, _ in model.named_modules() if fqn]

    def find(glob):
        regex = _compile_glob(glob)
        return [fqn for fqn, rel in names if regex.match(rel)]

    out = {"split": find(sp["split"]), "exit": find(sp["exit"]), "gather": [f for g in sp["gather"] for f in find(g)]}
    for key in ("split", "exit"):
        if len(out[key]) != 1:
            errors.append(f"[sequence_parallel] {key} = {sp[key]!r} must match exactly one module; it matches "
                          f"{out[key][:4]}")
    if not out["gather"]:
        errors.append(f"[sequence_parallel] gather = {sp['gather']} matches no module")
    gathers = tuple(out["gather"])
    outside = [f for f in layout.region_starts + layout.region_ends
               if not any(f.startswith(g + ".") for g in gathers)]
    if outside:
        errors.append(f"sequence parallelism: column/row-parallel layers {outside[:4]} lie outside every module of "
                      f"[sequence_parallel] gather = {sp['gather']}; their input would be split along the tokens")
    if any(m.style == "embedding_colwise" for m in layout.modules.values()):
        errors.append("sequence parallelism is not supported with embedding_colwise (relative attention biases)")
    if errors:
        return None
    return {"split": out["split"][0], "gather": list(gathers), "exit": out["exit"][0]}


# Styles that shard a tied weight the same way: vocabulary rows, padded alike (embedding = LM head).
_VOCAB_ROW_STYLES = {"embedding_rowwise", "colwise_rep"}


def _rows(module: nn.Module, entry: ModuleLayout) -> int | None:
    """Padded vocabulary rows a vocab-row style gives a module (None for other styles)."""
    if entry.style == "embedding_rowwise":
        return entry.padded_size
    if entry.style == "colwise_rep":
        return entry.padded_size or _dims(module)[1]
    return None


def _tie_conflicts(model: nn.Module, layout: Layout) -> list[str]:
    """Tied parameters whose holders' styles would shard them differently (or one not at all).

    A weight tied between an embedding and an LM head must be replicated by both, or split by
    vocabulary rows by both (``embedding_rowwise`` + ``colwise_rep``); anything else gives one of
    them a shard it cannot use (wrong logits or a half-width vocabulary), so it is an error.
    """
    holders: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((mname, pname))
    errors = []
    for places in holders.values():
        if len(places) < 2:
            continue
        # Holders that are not shardable layers (BertLMPredictionHead.bias holding its decoder's
        # bias) only point at the parameter; surgery re-points them to whatever the layer holds.
        styles = {f"{m}.{p}": layout.modules[m].style for m, p in places if m in layout.modules}
        places = [(m, p) for m, p in places if m in layout.modules]
        if len(places) < 2:
            continue
        kinds = set(styles.values())
        if kinds == {"replicate"} or (kinds <= _VOCAB_ROW_STYLES and "replicate" not in kinds):
            sizes = {_rows(model.get_submodule(m), layout.modules[m]) for m, _ in places}
            if len(sizes) <= 1:
                continue
        errors.append(f"tied parameter {sorted(styles)} is given styles {styles}, which shard it differently: give "
                      f"every holder 'replicate', or the embedding 'embedding_rowwise' and the head 'colwise_rep'")
    return errors


