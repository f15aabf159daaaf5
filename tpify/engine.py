"""The rule engine: match a recipe to a module tree, validate it, and swap modules.

Data flows ``recipe -> plan -> surgery``. :func:`build_plan` is pure and deterministic: given
the same model, recipe and ``tp_size`` it gives the same plan (or raises the same error) on
every rank, and it issues no collective, so bad input fails on every rank at the same point and
nothing hangs. :func:`apply_plan` swaps each ``nn.Linear``/``Conv1D``/``nn.Embedding`` for its
parallel counterpart (Megatron-LM, arXiv:1909.08053, section 3), divides per-rank attributes,
keeps tied parameters tied, and never replaces a Hugging Face ``forward`` method.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from . import comm
from .integrations.model import is_peft
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .random import install_rng_hooks
from .recipe import Recipe, Rule
from .sharding import pad_vocab_size, valid_tp_sizes

__all__ = ["PlanError", "PlanEntry", "Plan", "build_plan", "apply_plan", "relative_fqn", "SHARDABLE_TYPES"]


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


def relative_fqn(model: nn.Module, fqn: str) -> str:
    """``fqn`` with the base-model prefix removed (``transformer.h.0`` -> ``h.0``), for matching."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module) and fqn.startswith(prefix + "."):
        return fqn[len(prefix) + 1:]
    return fqn


@dataclass
class PlanEntry:
    """What happens to one module: its FQN, the style, and the per-style sizes."""

    fqn: str
    style: str
    rule: int
    partition_sizes: list[int] | None = None
    padded_size: int | None = None


@dataclass
class Plan:
    """The validated outcome of matching a recipe to a model at ``tp_size``."""

    tp_size: int
    recipe: Recipe
    entries: dict[str, PlanEntry] = field(default_factory=dict)
    divides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unmatched_rules: list[Rule] = field(default_factory=list)


def _dims(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def _packed_sizes(rule: Rule, out_features: int, config, fqn: str, errors: list[str]) -> list[int] | None:
    if isinstance(rule.parts, int):
        weights = [1] * rule.parts
    else:
        weights = []
        for name in rule.parts:
            value = getattr(config, name, None)
            if not isinstance(value, int):
                errors.append(f"{fqn}: {rule.describe()} weighs its parts by config.{name}, which is {value!r}")
                return None
            weights.append(value)
    total = sum(weights)
    if out_features % total:
        errors.append(f"{fqn}: out_features = {out_features} cannot be split in parts weighed {weights}")
        return None
    return [out_features // total * w for w in weights]


def build_plan(model: nn.Module, recipe: Recipe, tp_size: int) -> Plan:
    """Match ``recipe`` against ``model`` and validate it for ``tp_size``; no collectives.

    Every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` must be matched by exactly one rule with
    a style (``replicate`` counts). Rules that match nothing warn, unless ``optional``.

    Raises:
        PlanError: with every problem found, each naming the module and the numbers: modules no
            rule covers (listed by FQN), modules two rules claim, a style on the wrong module
            type, counts (config values, attributes to divide, features of sharded layers) that
            ``tp_size`` does not divide, with the tp sizes that would work.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    peft = [fqn or "<root>" for fqn, m in model.named_modules() if is_peft(m)]
    if peft:
        raise PlanError(f"cannot parallelize {type(model).__name__}: it holds PEFT modules ({peft[:3]}"
                        f"{' ...' if len(peft) > 3 else ''}). Parallelize the base model first, then add the adapters: "
                        f"model = tpify.parallelize(model); model = tpify.integrations.get_peft_model(model, lora_config)")
    config = getattr(model, "config", None)
    plan = Plan(tp_size, recipe)
    errors: list[str] = []
    constraints: list[int] = []

    def need_divisible(what: str, value: int):
        constraints.append(value)
        if value % tp_size:
            errors.append(f"{what} = {value} is not divisible by tp_size = {tp_size}")

    for name in recipe.divisible:
        value = getattr(config, name, None)
        if not isinstance(value, int):
            errors.append(f"recipe {recipe.source} requires config.{name} to be an integer; it is {value!r}")
        else:
            need_divisible(f"config.{name} ({type(model).__name__})", value)

    matched = {rule.index: False for rule in recipe.rules}
    uncovered: list[str] = []
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        rel = relative_fqn(model, fqn)
        hits = [rule for rule in recipe.rules if rule.matches(rel)]
        for rule in hits:
            matched[rule.index] = True
        for rule in hits:
            for attr in rule.divide:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} divides attribute "
                                  f"{attr!r}, which is {value!r}, not an integer")
                else:
                    need_divisible(f"{fqn}.{attr}", value)
            if rule.divide:
                plan.divides[fqn] = plan.divides.get(fqn, ()) + rule.divide
        styled = [rule for rule in hits if rule.style is not None]
        kind = _kind(module)
        if kind is None:
            if styled:
                errors.append(f"{fqn} is a {_qualname(module)}, not one of {SHARDABLE_TYPES}; "
                              f"{styled[0].describe()} gives it style {styled[0].style!r}")
            continue
        if not styled:
            uncovered.append(f"{fqn} ({type(module).__name__})")
            continue
        if len(styled) > 1:
            errors.append(f"{fqn} is matched by several styled rules: {[r.describe() for r in styled]}")
            continue
        rule = styled[0]
        entry = PlanEntry(fqn, rule.style, rule.index)
        if rule.style == "replicate":
            plan.entries[fqn] = entry
            continue
        if (kind == "embedding") != (rule.style == "embedding_rowwise"):
            errors.append(f"{fqn} is a {type(module).__name__}; style {rule.style!r} ({rule.describe()}) "
                          f"does not apply to it")
            continue
        if kind == "embedding":
            if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
                errors.append(f"{fqn}: embedding_rowwise cannot shard an nn.Embedding with max_norm, "
                              f"scale_grad_by_freq or sparse (they need the whole table); use 'replicate'")
                continue
            entry.padded_size = pad_vocab_size(module.num_embeddings, tp_size)
        else:
            in_f, out_f = _dims(module)
            if rule.style == "rowwise":
                need_divisible(f"{fqn}.in_features ({type(module).__name__}, rowwise)", in_f)
            elif rule.style == "colwise_rep":
                if out_f % tp_size:
                    entry.padded_size = pad_vocab_size(out_f, tp_size)
            elif rule.style == "packed_colwise":
                sizes = _packed_sizes(rule, out_f, config, fqn, errors)
                if sizes is not None:
                    entry.partition_sizes = sizes
                    for i, size in enumerate(sizes):
                        need_divisible(f"{fqn} packed part {i} of out_features", size)
            else:
                need_divisible(f"{fqn}.out_features ({type(module).__name__}, colwise)", out_f)
        plan.entries[fqn] = entry

    errors.extend(_tie_conflicts(model, plan))
    if uncovered:
        errors.insert(0, f"{len(uncovered)} module(s) of types {SHARDABLE_TYPES} are covered by no rule of recipe "
                         f"{recipe.source}: {uncovered}. Add a rule for each (style 'replicate' to keep a full "
                         f"copy on every rank).")
    if errors:
        hint = (f" tp sizes that would work for this model: {valid_tp_sizes(*constraints)}."
                if constraints else "")
        raise PlanError(f"cannot parallelize {type(model).__name__} with recipe {recipe.source} at "
                        f"tp_size = {tp_size}:\n  - " + "\n  - ".join(errors) + ("\n" + hint if hint else ""))
    plan.unmatched_rules = [r for r in recipe.rules if not matched[r.index] and not r.optional]
    return plan


# Styles that shard a tied weight the same way: vocabulary rows, padded alike (embedding = LM head).
_VOCAB_ROW_STYLES = {"embedding_rowwise", "colwise_rep"}


def _rows(module: nn.Module, entry: PlanEntry) -> int | None:
    """Padded vocabulary rows a vocab-row style gives a module (None for other styles)."""
    if entry.style == "embedding_rowwise":
        return entry.padded_size
    if entry.style == "colwise_rep":
        return entry.padded_size or _dims(module)[1]
    return None


def _tie_conflicts(model: nn.Module, plan: Plan) -> list[str]:
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
        styles = {f"{m}.{p}": plan.entries[m].style for m, p in places if m in plan.entries}
        places = [(m, p) for m, p in places if m in plan.entries]
        if len(places) < 2:
            continue
        kinds = set(styles.values())
        if kinds == {"replicate"} or (kinds <= _VOCAB_ROW_STYLES and "replicate" not in kinds):
            sizes = {_rows(model.get_submodule(m), plan.entries[m]) for m, _ in places}
            if len(sizes) <= 1:
                continue
        errors.append(f"tied parameter {sorted(styles)} is given styles {styles}, which shard it differently: give "
                      f"every holder 'replicate', or the embedding 'embedding_rowwise' and the head 'colwise_rep'")
    return errors


def _build_layer(module: nn.Module, entry: PlanEntry, tp_group: dist.ProcessGroup | None) -> nn.Module:
    if entry.style == "embedding_rowwise":
        return VocabParallelEmbedding.from_dense(module, tp_group, padded_num_embeddings=entry.padded_size)
    if entry.style == "rowwise":
        return RowParallelLinear.from_dense(module, tp_group, input_is_parallel=True)
    return ColumnParallelLinear.from_dense(
        module, tp_group, gather_output=entry.style == "colwise_rep",
        partition_sizes=entry.partition_sizes, padded_out_features=entry.padded_size)


def apply_plan(model: nn.Module, plan: Plan, tp_group: dist.ProcessGroup | None) -> nn.Module:
    """Swap the planned modules of ``model`` in place for their parallel layers; no collectives.

    Each new layer holds only this rank's shard (the dense module is dropped and freed); the
    attributes listed by ``divide`` rules are divided by ``tp_size``; parameters that were the
    same object before (tied embeddings, ``BertLMPredictionHead.bias``) are the same object
    after. Works on the meta device too. Installs the dropout stream hooks of
    :func:`tpify.random.install_rng_hooks` (sharded regions draw from a per-TP-rank stream).

    Raises:
        PlanError: ``tp_group``'s size differs from the plan's ``tp_size``, or two tied
            parameters were given styles that shard them differently.
    """
    group_size = comm.get_tp_size(tp_group)
    if group_size != plan.tp_size:
        raise PlanError(f"the plan is for tp_size = {plan.tp_size} but tp_group has {group_size} ranks")
    for rule in plan.unmatched_rules:
        warnings.warn(f"tpify: {rule.describe()} of recipe {plan.recipe.source} matched no module of "
                      f"{type(model).__name__}", stacklevel=3)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    for fqn, entry in plan.entries.items():
        if entry.style == "replicate":
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, child)
        layer = _build_layer(dense, entry, tp_group)
        for name, new in list(layer.named_parameters(recurse=False)):
            old = getattr(dense, name)
            tied = replaced.get(id(old), (None, None))[1]
            if tied is not None:
                if tied.shape != new.shape:
                    raise PlanError(f"{fqn}.{name} is tied to a parameter sharded to shape {tuple(tied.shape)}, "
                                    f"but its own style gives {tuple(new.shape)}")
                setattr(layer, name, tied)
            else:
                replaced[id(old)] = (old, new)
        setattr(parent, child, layer)
    # Re-point every other holder of a replaced parameter (tied weights held by plain modules).
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            old, new = replaced.get(id(param), (None, None))
            if old is param:
                module._parameters[name] = new
    for fqn, attrs in plan.divides.items():
        module = model.get_submodule(fqn)
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // plan.tp_size)
    # Dropout: TP-distinct random stream between column- and row-parallel layers (tpify.random).
    install_rng_hooks(model, comm.get_tp_rank(tp_group))
    return model
