"""One import of transformers' plan in progress: the model's tree, the rules so far, the helpers the
styles use to make rules of HF entries (:meth:`tpify.styles.Style.from_hf`). Pure; meta models work."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..hf_modules import base_model_and_prefix, module_kind, overrides_forward, relative_name
from ..recipe import RecipeError, _compile_glob
from ..styles import STYLES

__all__ = ["HFEntry", "HFImport", "wildcard", "head_counts", "HEAD_COUNT_ATTRS", "hf_error", "config_int",
           "head_dim", "out_features"]

# Config attributes holding head counts, in the order they are reported (transformers maps
# family-specific names such as n_head onto them through the config's attribute_map).
HEAD_COUNT_ATTRS = ("num_attention_heads", "num_key_value_heads")
# What the import says of fused MoE experts it cannot translate: a recipe rule with style 'experts' can.
MOE_HINT = ("tpify imports fused MoE experts only as HF's moe_tp_experts module with rules on its own 3-D "
            "parameters: write a recipe rule with style 'experts' (docs/recipes.md, as the shipped mixtral, "
            "qwen2_moe, qwen3_moe and olmoe recipes do)")
_KIND_NAMES = {"linear": "nn.Linear / Conv1D layers", "embedding": "nn.Embedding tables",
               "params": "modules holding the parameters it splits, not layers"}


def wildcard(name: str) -> str:
    """Layer numbers -> ``*``, as transformers' ``replace_layer_number_by_wildcard``:
    ``layers.3.mlp.up_proj`` -> ``layers.*.mlp.up_proj`` (only all-digit dotted segments)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def config_int(config, name: str) -> int | None:
    """``config.<name>`` when it is a positive integer, else None (some configs raise on access)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - per-layer configs raise on global access (gemma4's head_dim)
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def head_dim(config) -> int | None:
    """The config's head size: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    hd = config_int(config, "head_dim")
    if hd:
        return hd
    hidden, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads == 0:
        return hidden // heads
    return None


def head_counts(config) -> dict[str, int]:
    """``{config attribute: value}`` of the head counts the config defines (integers only)."""
    out = {}
    for name in HEAD_COUNT_ATTRS:
        value = config_int(config, name)
        if value:
            out[name] = value
    return out


def out_features(module: nn.Module) -> int | None:
    return getattr(module, "out_features", None) or getattr(module, "nf", None)


def hf_error(model: nn.Module, msg: str) -> RecipeError:
    """The import's error: the model, its model_type, ``msg`` and the fix (a recipe, ``tpify draft``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    return RecipeError(f"cannot import transformers' tensor-parallel plan of {type(model).__name__} "
                       f"(model_type {model_type!r}): {msg}. Write a tpify recipe for it (docs/recipes.md; "
                       f"`tpify draft {model_type}` writes a draft to start from) and pass it as recipe='file.toml'")


@dataclass
class HFEntry:
    """One module-level entry of transformers' plan: its glob ``key``, its HF style, the modules it
    matches (names relative to the base model) and ``where`` (how errors name it)."""

    key: str
    hf_style: str
    names: list[str]
    where: str


class HFImport:
    """The state of one :func:`tpify.hf_plan.import_hf_plan` run.

    Attributes:
        model, config, plan: the model, its config, transformers' plan (keys relative to the base model).
        hf_styles: HF style name -> tpify style (:data:`tpify.hf_plan.HF_STYLES`).
        modules, inside: name relative to the base model -> module, and whether it lies inside
            the base model (not a head class's own module).
        by_key, param_keys: plan-style glob -> module names; -> ``(parameter name, shape)``.
        styles: module name -> the style its rule gives it, so far.
        rules: ``(rule mapping, note)`` so far, in order; review: lines for the recipe author.
        dropped, by_construction: HF entries that match nothing; HF's replicated_with_grad_allreduce
            on modules tpify finds by construction (no rule).
        heads, head_dim: the config's head counts and head size; heads_divisible: a style asks for
            the head counts in ``divisible`` (latent attention's up projections).
        scratch: per style name, what its entries collected for its :meth:`~tpify.styles.Style.complete_hf`.
        split_per_head: owner glob -> parameters the imported rules split with the heads.
    """

    def __init__(self, model: nn.Module, plan: dict[str, str], hf_styles: dict):
        self.model, self.plan, self.hf_styles = model, plan, hf_styles
        self.config = getattr(model, "config", None)
        base, prefix = base_model_and_prefix(model)
        self.modules: dict[str, nn.Module] = {}
        self.inside: dict[str, bool] = {}
        for fqn, module in model.named_modules():
            if not fqn and base is not model:
                continue
            rel, in_base = relative_name(fqn, prefix)
            self.modules[rel], self.inside[rel] = module, in_base
        self.by_key: dict[str, list[str]] = {}
        for rel in self.modules:
            self.by_key.setdefault(wildcard(rel), []).append(rel)
        self.param_keys: dict[str, tuple[str, tuple[int, ...]]] = {}
        for rel, m in self.modules.items():
            for p, param in m.named_parameters(recurse=False):
                self.param_keys.setdefault(wildcard(f"{rel}.{p}" if rel else p), (f"{rel}.{p}", tuple(param.shape)))
        self.styles: dict[str, object] = {}
        self.rules: list[tuple[dict, str]] = []
        self.review: list[str] = []
        self.dropped: list[str] = []
        self.by_construction: list[str] = []
        self.heads = head_counts(self.config)
        self.head_dim = head_dim(self.config)
        self.heads_divisible = False
        self.scratch: dict[str, dict] = {}
        self.split_per_head: dict[str, list[str]] = {}
        self.moe_hint = MOE_HINT
        self.whole = hf_styles["replicate"]  # the style of what is kept whole

    def error(self, msg: str) -> RecipeError:
        """The RecipeError naming the model (raise it)."""
        return hf_error(self.model, msg)

    def config_int(self, name: str) -> int | None:
        return config_int(self.config, name)

    def entry(self, key: str, hf_style: str, names: list[str]) -> HFEntry:
        first = names[0]
        return HFEntry(key, hf_style, names,
                       f"HF rule {key!r} = {hf_style!r} (module {first}, a {type(self.modules[first]).__name__})")

    def add_rule(self, key: str, names: list[str], style: str, note: str, **extra) -> None:
        """A rule giving ``names`` (matched by glob ``key``) ``style``, with its note; a head-class
        module's rule is optional (other head classes lack it). ``extra``: more rule keys."""
        regex = _compile_glob(key)
        hits = [r for r in self.modules if regex.match(r)]
        match = key if sorted(hits) == sorted(names) else sorted(names)  # tpify '*' is any segment, HF's digits
        if not any(self.inside[n] for n in names):
            extra.setdefault("optional", True)
        self.rules.append(({"match": match, "style": style, **extra}, note))
        for n in names:
            self.styles[n] = STYLES[style]

    def replicate(self, key: str, names: list[str], note: str, **extra) -> None:
        """A rule keeping ``names`` whole."""
        self.add_rule(key, names, self.whole.name, note, **extra)

    def kinds(self, entry: HFEntry) -> set:
        return {module_kind(self.modules[n]) for n in entry.names}

    def kind(self, rel: str) -> str | None:
        return module_kind(self.modules[rel])

    def require_kind(self, entry: HFEntry, kind: str | None) -> None:
        """Raise unless every module of ``entry`` is of the ``kind`` a style splits."""
        if kind is not None and self.kinds(entry) != {None if kind == "params" else kind}:
            raise self.error(f"{entry.where}: the style applies to {_KIND_NAMES.get(kind, kind)}")

    def keep_overridden(self, entry: HFEntry) -> bool:
        """Keep whole (for review) a layer whose class overrides ``forward``: True when it did."""
        cls = type(self.modules[entry.names[0]]).__name__
        if not any(overrides_forward(self.modules[n]) for n in entry.names):
            return False
        if self.kinds(entry) == {"embedding"}:
            self.replicate(entry.key, entry.names, f"HF {entry.hf_style}, but {cls} overrides forward (a scaled "
                                                   f"embedding?): kept whole; review: declare it in [subclasses] to "
                                                   f"shard it")
            self.review.append(f"{entry.key}: {cls} overrides nn.Embedding.forward; replicated")
        else:
            self.replicate(entry.key, entry.names,
                           f"HF {entry.hf_style}, but {cls} overrides nn.Linear.forward (dory's LM head scales each "
                           f"logit by a parameter of its own): kept whole; review: declare it in [subclasses] if its "
                           f"forward is plain")
            self.review.append(f"{entry.key}: {cls} overrides nn.Linear.forward; replicated")
        return True

    def wildcard(self, rel: str) -> str:
        return wildcard(rel)

    def covered_by(self, rule: dict) -> list[str]:
        """The module names so far styled that ``rule``'s globs match."""
        match = rule["match"] if isinstance(rule["match"], list) else [rule["match"]]
        globs = [_compile_glob(p) for p in match]
        return [r for r in self.styles if any(g.match(r) for g in globs)]

    def head_split_attention(self) -> set[str]:
        """The attention modules whose projections the imported rules split by heads: the parents of
        the column-parallel layers as wide as a head count times the head size."""
        hd = self.head_dim
        widths = {n * hd for n in self.heads.values()} if hd else set()
        return {r.rpartition(".")[0] for r, s in self.styles.items()
                if s.column and out_features(self.modules[r]) in widths}

    def attention_parts(self):
        """``(attention module, part name, part)`` for each module inside a head-split attention that
        is no layer (the attention itself included)."""
        for parent in sorted(self.head_split_attention()):
            for rel, module in self.modules.items():
                if (rel == parent or rel.startswith(parent + ".")) and module_kind(module) is None:
                    yield parent, rel, module
