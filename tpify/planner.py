"""How a layout is decided: :class:`Planner`, one :func:`tpify.layout.build_layout` run.

Rules are matched to the module tree once (:class:`~tpify.recipe.RuleIndex`); the modules holding
heads are found first (no uneven split inside them); each module's style plans it
(:meth:`tpify.styles.Style.plan`); then the checks that span modules: per-head parameters left
whole, large parameters no rule covers, tied parameters split differently, the LM head and its
loss, the sharded regions, the sequence-parallel stretch. Every problem is collected and raised
once as a :class:`PlanError` naming the module and the numbers, the same on every rank (pure, no
collective). Megatron-LM (arXiv:1909.08053, section 3); docs/recipes.md.
"""

from __future__ import annotations

import inspect

from torch import nn

from .hf_modules import (SHARDABLE_TYPES, base_model, config_get, config_has, dense_dims, head_dims, module_kind,
                         relative_fqn)
from .recipe import Recipe, Rule, RuleIndex, _compile_glob
from .sharding import valid_tp_sizes
from .styles import AFTER_SUM, PlanContext, style_of

__all__ = ["PlanError", "Planner", "coverage_threshold", "COVERAGE_ELEMENTS"]


class PlanError(ValueError):
    """A recipe does not fit a model at a tp size: uncovered modules, indivisible counts, ..."""


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


def _outermost_container(fqn: str, containers: dict[str, Rule]) -> str | None:
    """The outermost replicated container holding ``fqn`` (``""``: the root), or None; a lookup per
    ancestor, not a scan of every container."""
    if not fqn:
        return None
    parts = fqn.split(".")
    return next((c for c in ("", *(".".join(parts[:i]) for i in range(1, len(parts)))) if c in containers), None)


#: A parameter of a module no style knows (not nn.Linear / Conv1D / nn.Embedding) must be covered
#: by a rule from this many elements on (or 1% of the model's parameters, if that is fewer).
COVERAGE_ELEMENTS = 1_000_000


def coverage_threshold(model: nn.Module) -> int:
    """``min(1_000_000, 1% of the model's parameter elements)`` (tied parameters once), at least 1.

    A parameter that large, held by a module that is no ``nn.Linear``/``Conv1D``/``nn.Embedding``
    (fused MoE experts ``(E, 2I, H)``, a 3-D projection), would stay a full copy on every rank
    unnoticed, so it must be covered by a rule like a layer (split by a parameter style, or kept
    whole by ``replicate`` on purpose). Why these numbers: 1M elements (2 MB in bfloat16) is far
    above every norm, bias or router of today's models (a 16k-wide norm, Mixtral's 8 x 4096
    router) and far below one expert (Mixtral's ``gate_up_proj`` is 939M elements); 1% of a small
    model (tpify verify's, ~50k elements) keeps the rule meaningful there, where fused experts
    hold most of the parameters and the routers and norms stay far below (0.3%).
    """
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return max(1, min(COVERAGE_ELEMENTS, total // 100))


class Planner:
    """One :func:`build_layout` run: the layout being filled and every problem found so far.

    The work is linear in the rules (a recipe may list thousands): rules are looked up by name
    where they can be (:class:`~tpify.recipe.RuleIndex`), and ``matched`` holds rule indices,
    never compares Rule objects.
    """

    def __init__(self, model: nn.Module, recipe: Recipe, layout):
        """``layout``: the empty :class:`tpify.layout.Layout` to fill (its tp size, padding, ep size)."""
        tp_size, pad_vocab_multiple, ep_size = layout.tp_size, layout.pad_vocab_multiple, layout.ep_size
        self.model, self.recipe, self.tp_size = model, recipe, tp_size
        self.config = getattr(model, "config", None)
        self.layout = layout
        self.errors: list[str] = []
        self.constraints: list[int] = []  # every count tp_size must divide (for the sizes that would work)
        self.kv_constraints: list[int] = []  # KV head counts tp_size must divide or be a multiple of
        self.kv_refused: set[int] = set()  # KV head counts already reported
        self.indivisible: list[str] = []
        self.uncovered: list[str] = []
        self.containers: dict[str, Rule] = {}  # replicated container FQN -> its rule
        self.ctx = PlanContext(model, self.config, recipe, tp_size, pad_vocab_multiple, self.errors,
                               self.need_divisible, None, ep_size, self.kv_shards, self.may_be_uneven)
        self.large_uncovered: list[str] = []
        self.heads: set[str] = set()  # modules holding attention heads (find_heads): no uneven split inside
        self.hits: dict[str, list[Rule]] = {}  # module FQN -> the active rules matching it (find_heads)

    def need_divisible(self, what: str, value: int) -> None:
        """Record a count ``tp_size`` must divide; an error when it does not."""
        self.constraints.append(value)
        if value % self.tp_size:
            self.indivisible.append(what)
            fewer = (" (fewer than tp_size: each rank must hold whole ones, and tpify does not copy one onto "
                     "several ranks)" if 0 < value < self.tp_size else "")
            self.errors.append(f"{what} = {value} is not divisible by tp_size = {self.tp_size}{fewer}")

    def kv_shards(self, what: str, kv: int):
        """How ``kv`` KV heads go over ``tp_size`` ranks: None when ``tp_size`` divides them (each
        rank holds ``kv / tp_size`` heads), ``kv`` when ``tp_size`` is a multiple of them (each head
        held by a group of ``tp_size / kv`` consecutive ranks: the KV head its query heads read),
        False (an error recorded) when neither."""
        self.kv_constraints.append(kv)
        if kv % self.tp_size == 0:
            return None
        if self.tp_size % kv == 0:
            return kv
        self.indivisible.append(what)
        if kv not in self.kv_refused:  # once per KV head count, not once per layer
            self.kv_refused.add(kv)
            self.errors.append(f"{what} (and every module with {kv} KV heads): {kv} KV heads at tp_size = "
                               f"{self.tp_size}: tp_size must divide the KV heads (each rank holds {kv} / tp_size of "
                               f"them) or be a multiple of them (each KV head held by tp_size / {kv} ranks); "
                               f"{self.tp_size} is neither")
        return False

    def config_counts(self) -> None:
        """The recipe's ``divisible`` and ``divide_config`` config values."""
        for name in self.recipe.divisible + self.recipe.divide_config:
            value = config_get(self.config, name)
            if not isinstance(value, int) or isinstance(value, bool):
                self.errors.append(f"recipe {self.recipe.source} requires config.{name} to be an integer; it is "
                                   f"{value!r}")
            else:
                self.need_divisible(f"config.{name} ({type(self.model).__name__})", value)
                if name in self.recipe.divide_config:
                    self.layout.config_divides[name] = value

    def find_heads(self) -> None:
        """The modules that hold attention heads (:attr:`heads`), found before any style plans, so
        that no dimension inside them is split unevenly (heads stay whole on their ranks):

        * a module the recipe says holds heads: a rule with ``divide``, ``kv_groups``,
          ``kv_counts``, ``head_inputs`` or a bare ``kv_heads``;
        * the module its style says holds heads (:meth:`tpify.styles.Style.head_owner`): a
          ``per_head`` module; the owner (parent) of a column-parallel layer split by KV heads or
          by parts weighed by head counts, or of a column- or row-parallel layer whose split width
          is a head count times the head size (:meth:`_head_widths`).

        Matches the active rules (whose ``when`` the config meets) once per module, for
        :meth:`match_modules` too."""
        active = [rule for rule in self.recipe.rules if rule.applies(self.config)]
        index = RuleIndex(active)
        self.matched = {rule.index for rule in self.recipe.rules} - {rule.index for rule in active}
        widths = self._head_widths()
        base = base_model(self.model)
        for fqn, module in self.model.named_modules():
            if not fqn and base is not self.model:
                continue  # the head class's root: rules are written relative to the base model
            hits = self.hits[fqn] = index.hits(relative_fqn(self.model, fqn))
            for rule in hits:
                if (rule.divide or rule.kv_groups or rule.kv_counts or rule.head_inputs
                        or (rule.style is None and rule.kv_heads is not None)):
                    self.heads.add(fqn)
                elif rule.style is not None:
                    owner = rule.styler.head_owner(fqn, module, rule, widths)  # per_head: fqn; a layer: its parent
                    if owner is not None:
                        self.heads.add(owner)

    def _head_widths(self) -> set[int]:
        """The widths a layer holding heads has: each head count (the config's
        ``num_attention_heads`` and ``num_key_value_heads``, the recipe's ``divisible`` values)
        times the head size (``head_dim``, else ``hidden_size / num_attention_heads``), read from
        the config and from each sub-config a ``divisible`` path names (a composed recipe's)."""
        prefixes = {""} | {name.rpartition(".")[0] for name in self.recipe.divisible}
        widths = set()
        for prefix in prefixes:
            sub = config_get(self.config, prefix) if prefix else self.config
            if sub is None:
                continue
            counts = {_config_value(sub, a) for a in ("num_attention_heads", "num_key_value_heads")}
            counts |= {config_get(self.config, n) for n in self.recipe.divisible if n.rpartition(".")[0] == prefix}
            counts = {c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c > 0}
            hd, hidden, heads = (_config_value(sub, a) for a in ("head_dim", "hidden_size", "num_attention_heads"))
            if not isinstance(hd, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                hd = hidden // heads
            if isinstance(hd, int) and hd > 0:
                widths |= {c * hd for c in counts}
        return widths

    def may_be_uneven(self, fqn: str) -> bool:
        """Whether module ``fqn`` may split a dimension ``tp_size`` does not divide: neither it nor
        a module holding it holds attention heads (:meth:`find_heads`)."""
        parts = fqn.split(".")
        return not any(".".join(parts[:i]) in self.heads for i in range(len(parts) + 1))

    def match_modules(self) -> None:
        """Every module against the rules that apply (those whose ``when`` the config meets; the
        others take no part and never warn; :meth:`find_heads` matched them): the rules' facts,
        then the module's style."""
        base = base_model(self.model)
        for fqn, module in self.model.named_modules():
            if not fqn and base is not self.model:
                continue  # the head class's root: rules are written relative to the base model
            rel = relative_fqn(self.model, fqn)
            hits = self.hits[fqn]
            self.matched.update(rule.index for rule in hits)
            for rule in hits:
                self._rule_facts(fqn, module, rule)
            self._style_module(fqn, rel, module, [rule for rule in hits if rule.style is not None])

    def _rule_facts(self, fqn: str, module: nn.Module, rule: Rule) -> None:
        """What a rule says of a module besides its style: attributes to divide, per-head inputs."""
        for attr in rule.divide:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                self.errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} divides attribute {attr!r}, "
                                   f"which is {value!r}, not an integer")
            else:
                self.need_divisible(f"{fqn}.{attr}", value)
        if rule.divide:
            self.layout.divides[fqn] = self.layout.divides.get(fqn, ()) + rule.divide
        if rule.kv_groups or rule.kv_counts:
            self._kv_groups(fqn, module, rule)
        for arg, dim, heads_attr in rule.head_inputs:
            heads = config_get(self.config, heads_attr)
            if not isinstance(heads, int) or isinstance(heads, bool):
                self.errors.append(f"{fqn}: {rule.describe()} slices argument {arg!r} by config.{heads_attr}, which is "
                                   f"{heads!r}, not an integer")
                continue
            self.need_divisible(f"config.{heads_attr} (heads of {fqn}'s argument {arg!r})", heads)
            params = inspect.signature(type(module).forward).parameters
            if arg not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                self.errors.append(f"{fqn}: {rule.describe()} slices argument {arg!r}, but {type(module).__name__}"
                                   f".forward takes no such argument")
                continue
            self.layout.head_inputs[fqn] = self.layout.head_inputs.get(fqn, ()) + ((arg, dim, heads),)

    def _kv_groups(self, fqn: str, module: nn.Module, rule: Rule) -> None:
        """A rule's ``kv_groups``: the module's query heads per KV head, divided by ``tp_size /
        kv_heads`` where each KV head is held by a group of ranks (each rank then holds one KV
        head and its ``n / tp_size`` query heads); its ``kv_counts``: the module's KV heads,
        divided by ``tp_size`` where it divides them, else by ``kv_heads`` (one per rank)."""
        kv = self.ctx.kv_heads(rule, fqn)
        shards = None if kv is None else self.kv_shards(f"{fqn} ({type(module).__name__}, kv_heads = {rule.kv_heads})",
                                                        kv)
        if kv is None or shards is False:
            return
        pairs = [(attr, self.tp_size, "KV heads") for attr in rule.kv_counts] if shards is None else (
            [(attr, self.tp_size // shards, "query heads per KV head") for attr in rule.kv_groups]
            + [(attr, shards, "KV heads") for attr in rule.kv_counts])
        for attr, divisor, what in pairs:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool) or value % divisor:
                self.errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} divides attribute {attr!r} "
                                   f"({what}) by {divisor}, but it is {value!r}")
                return
        if pairs:
            self.layout.kv_divides[fqn] = self.layout.kv_divides.get(fqn, ()) + tuple((a, d) for a, d, _ in pairs)

    def _style_module(self, fqn: str, rel: str, module: nn.Module, styled: list[Rule]) -> None:
        """The one styled rule of a module (or its replicated container's) plans it. A module that is
        no layer and that no parameter style claims: a container style (``replicate``) replicates
        everything inside it; another style plans it (kept when no container encloses it: a norm
        whose gradients are summed, a module's own parameters kept whole) or says why not."""
        container = _outermost_container(fqn, self.containers)
        if module_kind(module) is None and not any(r.styler.kind == "params" for r in styled):
            if len(styled) == 1 and styled[0].styler.is_container(styled[0]):
                self.containers[fqn] = styled[0]  # everything shardable inside it stays a full copy
            elif styled:
                entry = styled[0].styler.plan(self.ctx, fqn, module, styled[0])
                if entry is not None and len(styled) == 1 and container is None:
                    self.layout.modules[fqn] = entry
            return
        if container is not None:
            if styled and any(not r.styler.copies_whole for r in styled):
                self.errors.append(f"{fqn} is inside {container or '<base model>'}, which "
                                   f"{self.containers[container].describe()} replicates, but {styled[0].describe()} "
                                   f"gives it style {styled[0].style!r}")
                return
            styled = [self.containers[container]]
        if not styled:
            self.uncovered.append(f"{rel or '<base model>'} ({type(module).__name__})")
        elif len(styled) > 1:
            self.errors.append(f"{fqn} is matched by several styled rules: {[r.describe() for r in styled]}")
        else:
            entry = styled[0].styler.plan(self.ctx, fqn, module, styled[0])
            if entry is not None:
                self.layout.modules[fqn] = entry

    def per_head_parameters(self) -> None:
        """A parameter holding one value per head (a dimension of ``config.num_attention_heads`` or
        ``num_key_value_heads``: attention sinks) inside an attention module whose projections a
        column style splits by heads must be split with them (``per_head``): left whole, each
        rank would apply all heads' values to its own heads (a shape error at best). Found by the
        parameters, not only the modules: the attention module's own and its parts' (not the
        layers'). The attention modules are the parents of a column-split layer whose width is a
        head count times the head size (a layer whose K/V heads are each held by a group of ranks
        included)."""
        counts = {v for v in (_config_value(self.config, a) for a in ("num_attention_heads", "num_key_value_heads"))
                  if isinstance(v, int) and not isinstance(v, bool) and v > 1}
        hd = _config_value(self.config, "head_dim")
        hidden = _config_value(self.config, "hidden_size")
        if not isinstance(hd, int) and isinstance(hidden, int) and counts:
            hd = hidden // max(counts)
        if not counts or not isinstance(hd, int) or hd < 1:
            return
        widths = {c * hd for c in counts}
        parents = sorted({fqn.rpartition(".")[0] for fqn, m in self.layout.modules.items()
                          if m.styler.column and "." in fqn
                          and dense_dims(self.model.get_submodule(fqn))[1] in widths})
        for parent in parents:
            attention = self.model.get_submodule(parent)
            own_hd = getattr(attention, "head_dim", hd)
            for name, module in attention.named_modules(prefix=parent):
                if module_kind(module) is not None:
                    continue
                split = self.layout.modules[name].specs if name in self.layout.modules else {}
                for pname, param in module.named_parameters(recurse=False):
                    dims = head_dims(param.shape, counts, own_hd if isinstance(own_hd, int) else hd)
                    if not dims or split.get(pname) is not None:
                        continue
                    rel = relative_fqn(self.model, name)
                    count = param.shape[dims[0]]
                    which = " / ".join(a for a in ("num_attention_heads", "num_key_value_heads")
                                       if _config_value(self.config, a) == count)
                    self.errors.append(
                        f"{name}.{pname} ({type(module).__name__}, shape {list(param.shape)}) holds one value per head "
                        f"(dim {dims[0]} = config.{which} = {count}), but {parent}'s projections are split by heads "
                        f"and no rule splits it: each rank would apply every head's values to its own heads. Give "
                        f"{rel or '<base model>'} style 'per_head' with params = {{ {pname} = {{ dim = {dims[0]} }} }}"
                        f"{' and kv_heads' if which == 'num_key_value_heads' else ''} (docs/recipes.md), or keep the "
                        f"attention whole (replicate its projections)")

    def large_parameters(self) -> None:
        """Every parameter of :func:`coverage_threshold` elements or more that no styled module holds
        and no replicated container encloses is uncovered (a module no style knows, holding fused
        experts or a 3-D projection, would otherwise stay a full copy on every rank unnoticed).
        A tied parameter is covered when any of its holders is."""
        threshold, containers = self.layout.coverage_threshold, self.containers
        holders: dict[int, list[tuple[str, str, nn.Module, nn.Parameter]]] = {}
        for mname, module in self.model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                if param.numel() >= threshold:
                    holders.setdefault(id(param), []).append((mname, pname, module, param))

        def covered(mname: str, pname: str) -> bool:
            entry = self.layout.modules.get(mname)
            if entry is not None:
                return entry.styler.covers(entry, pname)  # replicate with params: its named parameters only
            return mname in containers or _outermost_container(mname, containers) is not None

        for places in holders.values():
            if any(covered(m, p) for m, p, _, _ in places):
                continue
            mname, pname, module, param = places[0]
            rel = relative_fqn(self.model, mname)
            self.large_uncovered.append(f"{rel + '.' if rel else ''}{pname} ({type(module).__name__}, shape "
                                        f"{list(param.shape)}, {param.numel():,} elements)")

    def finish(self, sequence_parallel: bool, lm_loss_chunk: int | str | None = None) -> None:
        """What follows from the modules' styles: ties, the LM head and its loss, the sharded
        regions, the sequence-parallel stretch."""
        layout, recipe = self.layout, self.recipe
        self.errors.extend(_tie_conflicts(self.model, layout))
        heads = [fqn for fqn, m in layout.modules.items() if m.styler.lm_head]
        if len(heads) > 1:
            self.errors.append(f"several colwise_rep LM heads {heads}: the parallel LM loss supports one; give the "
                               f"others 'replicate' or 'colwise'")
        layout.lm_head = heads[0] if heads else None
        layout.loss_kind, layout.honours_num_items = _loss_of(self.model, recipe) if heads else (None, True)
        if layout.loss_kind is not None:
            layout.loss_terms = recipe.loss_terms
            for output, coefficient in recipe.loss_terms:
                if isinstance(coefficient, str) and not isinstance(config_get(self.config, coefficient),
                                                                   (int, float)):
                    self.errors.append(f"recipe {recipe.source}: [loss] terms scales {output!r} by config."
                                       f"{coefficient}, which {type(self.model).__name__}'s config does not hold as a "
                                       f"number")
            layout.logit_ops = recipe.logit_ops
            for op, value in recipe.logit_ops:
                if isinstance(value, str) and not (config_has(self.config, value) and isinstance(
                        config_get(self.config, value), (int, float, type(None)))):
                    self.errors.append(f"recipe {recipe.source}: [loss] logits {op} reads config.{value}, which "
                                       f"{type(self.model).__name__}'s config does not hold as a number (or None)")
        if lm_loss_chunk is not None:
            layout.lm_loss_chunk = lm_loss_chunk
            if layout.loss_kind is None:
                self.errors.append(f"lm_loss_chunk = {lm_loss_chunk}: {type(self.model).__name__} has no vocab-parallel "
                                   f"LM loss (a 'colwise_rep' head and a causal, masked or seq2seq [loss]) to chunk; "
                                   f"leave lm_loss_chunk unset")
        layout.region_starts = tuple(f for f, m in layout.modules.items() if m.styler.region == "start")
        layout.region_ends = tuple(f for f, m in layout.modules.items() if m.styler.region == "end")
        if sequence_parallel:
            layout.sequence_parallel = _sequence_layout(self.model, recipe, layout, self.errors)
            if lm_loss_chunk is not None and layout.lm_head and layout.modules[layout.lm_head].sequence_parallel:
                self.errors.append(f"lm_loss_chunk: the LM head {layout.lm_head} lies inside the sequence-parallel "
                                   f"stretch ([sequence_parallel] gather); the chunked loss reads its input whole")

    def result(self):
        """The layout, or a :class:`PlanError` listing every problem (uncovered modules first)."""
        errors = list(self.errors)
        if self.large_uncovered:
            errors.insert(0, f"{len(self.large_uncovered)} parameter(s) of at least {self.layout.coverage_threshold:,} "
                             f"elements (min(1M, 1% of the model's parameters)) held by modules no style knows are "
                             f"covered by no rule of recipe {self.recipe.source}, so they would stay a full copy on every "
                             f"rank unnoticed: {self.large_uncovered}. Add a rule for each module (a style that splits "
                             f"its parameters, such as 'experts', or style 'replicate' to keep a full copy on every "
                             f"rank on purpose).")
        if self.uncovered:
            errors.insert(0, f"{len(self.uncovered)} module(s) of types {SHARDABLE_TYPES} are covered by no rule of "
                             f"recipe {self.recipe.source} (names relative to the base model, as rules are written): "
                             f"{self.uncovered}. Add a rule for each (style 'replicate' to keep a full copy on every "
                             f"rank).")
        if errors:
            # The sizes that would work answer a divisibility error only (not an uncovered module).
            hint = (f" tp sizes that would work for this model: "
                    f"{valid_tp_sizes(*self.constraints, kv_heads=self.kv_constraints)}."
                    if self.indivisible and (self.constraints or self.kv_constraints) else "")
            raise PlanError(f"cannot parallelize {type(self.model).__name__} with recipe {self.recipe.source} at "
                            f"tp_size = {self.tp_size}:\n  - " + "\n  - ".join(errors) + ("\n" + hint if hint else ""))
        self.layout.unmatched_rules = [r for r in self.recipe.rules if r.index not in self.matched and not r.optional]
        return self.layout


def _config_value(config, name: str):
    """``config.<name>``, or None where the config has none or refuses a global value (a
    per-layer attribute of a heterogeneous config raises on access: gemma4's ``head_dim``)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _sequence_layout(model: nn.Module, recipe: Recipe, layout, errors: list[str]) -> dict | None:
    """Resolve the recipe's ``[sequence_parallel]`` globs to FQNs and check that every column- and
    row-parallel layer lies inside a module whose input is gathered (elsewhere it would receive
    ``T/p`` tokens, or reduce-scatter an output nobody gathers)."""
    sp = recipe.sequence_parallel
    if sp is None:
        errors.append(f"sequence_parallel=True, but recipe {recipe.source} has no [sequence_parallel] table marking "
                      f"where the tokens are split and gathered (docs/recipes.md)")
        return None
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
    # The part whose layers the stretch may reach: the whole model, or a composed recipe's part
    # (the language model; a vision tower runs before the split, on its own tokens).
    scope = sp.get("scope")

    def in_scope(fqn: str) -> bool:
        return scope is None or (relative_fqn(model, fqn) + ".").startswith(scope + ".")

    outside = [f for f in layout.region_starts + layout.region_ends
               if in_scope(f) and not any(f.startswith(g + ".") for g in gathers)]
    if outside:
        errors.append(f"sequence parallelism: column/row-parallel layers {outside[:4]} lie outside every module of "
                      f"[sequence_parallel] gather = {sp['gather']}; their input would be split along the tokens")
    unsupported = sorted({m.style for f, m in layout.modules.items() if in_scope(f) and not m.styler.sequence_parallel})
    if unsupported:
        errors.append("sequence parallelism is not supported with " + "; ".join(
            f"{name} ({style_of(name).sequence_parallel_refusal})" for name in unsupported))
    moe_blocks = _moe_blocks(model, layout, gathers, errors)
    if errors:
        return None
    for fqn, entry in layout.modules.items():  # a construction fact of these layers (tpify.styles)
        if entry.styler.region is not None and any(fqn.startswith(g + ".") for g in gathers):
            entry.sequence_parallel = True
    return {"split": out["split"][0], "gather": list(gathers), "exit": out["exit"][0], "moe_blocks": moe_blocks}


def _moe_blocks(model: nn.Module, layout, gathers: tuple[str, ...], errors: list[str]) -> dict:
    """The gathered modules that hold fused experts (mixture-of-experts blocks), ``{block FQN:
    (experts FQN, [router FQNs], expert parallel)}``, the routers being the block's other modules
    with parameters.

    Under sequence parallelism such a block runs its router on every gathered token (the routing
    and the load-balancing loss are the dense ones) and its experts on them, and the block's
    output is reduce-scattered along ``T`` (:mod:`tpify.hooks.sequence_parallel`). Refused: fused
    experts outside every gathered module (they would see ``T/p`` tokens), two of them in one
    block, a column- or row-parallel layer beside them (a shared expert: its output would be
    added to the experts' partial sum once per rank), and a module with parameters that is no
    router (a router's parameters have one row per expert; a norm before the experts would get a
    partial gradient from them)."""
    blocks: dict[str, tuple[str, list[str], bool]] = {}
    for fqn, entry in layout.modules.items():
        if not entry.styler.moe:
            continue
        block = next((g for g in gathers if fqn.startswith(g + ".")), None)
        if block is None:
            errors.append(f"sequence parallelism: the fused experts {fqn} lie outside every module of "
                          f"[sequence_parallel] gather; their tokens would be split along T. Gather the MoE block "
                          f"that holds them")
            continue
        layers = [f for f in layout.region_starts + layout.region_ends if f.startswith(block + ".")]
        if layers or block in blocks:
            errors.append(f"sequence parallelism: the MoE block {block} holds "
                          + (f"column/row-parallel layers {layers[:4]}" if layers else "two fused experts modules")
                          + f" beside its experts {fqn}; tpify reduce-scatters the block's output as the experts' "
                            f"partial sum, which a shared expert's output would join once per rank (not supported: "
                            f"run without sequence_parallel)")
            continue
        biases = [name for name, dim, _ in entry.params if dim == AFTER_SUM]
        if entry.identity_experts is not None:
            biases.append(f"identity experts from index {entry.identity_experts}")
        if biases and not entry.expert_parallel:
            errors.append(f"sequence parallelism: the fused experts {fqn} add whole biases {biases} after their sum "
                          f"(after_sum, identity_from), which tpify counts once in the all-reduce, not in the block's "
                          f"reduce-scatter "
                          f"(not supported: run without sequence_parallel, or with ep_size)")
            continue
        container, experts = model.get_submodule(block), model.get_submodule(fqn)
        count = getattr(experts, entry.params[0][0]).shape[0]  # E: dim 0 of the fused expert weights
        others = {f"{block}.{name}": module for name, module in container.named_modules()
                  if name and f"{block}.{name}" != fqn and not f"{block}.{name}".startswith(fqn + ".")
                  and any(True for _ in module.parameters(recurse=False))}
        # A router: every parameter one row per expert (its (E, H) weight, a per-expert bias). Another
        # module with parameters (a norm before the experts) would get a partial gradient from the experts.
        strangers = sorted(f for f, m in others.items()
                           if any(p.dim() == 0 or p.shape[0] != count for p in m.parameters(recurse=False)))
        if strangers:
            errors.append(f"sequence parallelism: the MoE block {block} holds {strangers} beside its experts {fqn} "
                          f"and router(s); tpify gathers the block's tokens for a router (parameters of {count} rows, "
                          f"one per expert) and the experts only (not supported: run without sequence_parallel)")
            continue
        blocks[block] = (fqn, sorted(others), entry.expert_parallel)
    return blocks


def _split_key(spec) -> tuple | None:
    """What decides a shard's rows: the split dimension, parts, tp size and padded size (a spec
    without padding counts as padded to its own size)."""
    if spec is None:
        return None
    return (spec.dim, spec.parts, spec.tp_size, spec.padded_size or spec.global_size, spec.replicated,
            spec.replica_shards, spec.uneven)


def _tie_conflicts(model: nn.Module, layout) -> list[str]:
    """Tied parameters whose holders' styles would shard them differently (or one not at all).

    A weight tied between an embedding and an LM head must be replicated by both, or split by
    vocabulary rows by both (``embedding_rowwise`` + ``colwise_rep``, padded alike); anything else
    gives one of them a shard it cannot use (wrong logits or a half-width vocabulary), so it is an
    error. Decided by the styles' per-parameter specs (:attr:`ModuleLayout.specs`).
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
        splits = {_split_key(layout.modules[m].specs.get(p)) for m, p in places}
        if len(splits) == 1:  # every holder splits it alike (or none does)
            continue
        errors.append(f"tied parameter {sorted(styles)} is given styles {styles}, which shard it differently: give "
                      f"every holder 'replicate', or the embedding 'embedding_rowwise' and the head 'colwise_rep'")
    return errors


