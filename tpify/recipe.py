"""Recipes: declarative per-architecture tensor-parallel plans, read from TOML files.

A recipe names, for one Hugging Face ``model_type``, how each ``nn.Linear``,
``transformers.pytorch_utils.Conv1D`` and ``nn.Embedding`` of the model is split, and which
integer attributes (head counts, split sizes) each rank must divide by ``tp_size``. One recipe
serves every head class of its family: module names are matched relative to the base model
(``transformer.h.0.attn`` of ``GPT2LMHeadModel`` and ``h.0.attn`` of ``GPT2Model`` both match
``h.*.attn``).

File format (``recipes/<model_type>.toml``)::

    model_type = "gpt2"
    divisible = ["n_head"]            # config attributes tp_size must divide

    [[rule]]
    match = "h.*.attn.c_attn"        # glob over the FQN: '*' one segment, '**' any number
    style = "packed_colwise"          # see STYLES
    parts = 3                         # packed parts: a count of equal parts, or a list of
                                      # config attributes whose values weigh the part widths
    [[rule]]
    match = "h.*.attn"
    divide = ["num_heads", "split_size"]
    [[rule]]
    match = ["score", "classifier"]
    style = "replicate"
    optional = true                   # no warning when it matches nothing (head-specific)

Styles (the names of Hugging Face's and PyTorch's TP plans):
    ``colwise``: :class:`~tpify.layers.ColumnParallelLinear`, output left sharded.
    ``packed_colwise``: the same, each packed part split separately.
    ``colwise_rep``: column-parallel with the output gathered (LM heads; vocab padded if needed).
    ``rowwise``: :class:`~tpify.layers.RowParallelLinear`, input already sharded.
    ``embedding_rowwise``: :class:`~tpify.layers.VocabParallelEmbedding`.
    ``embedding_colwise``: :class:`~tpify.layers.ColumnParallelEmbedding` (columns are heads).
    ``experts``: the named parameters of a module (fused 3-D MoE experts) split along a dimension
        (``params``); its output is a partial sum, all-reduced (or, with ``ep_size``, whole experts
        per rank and the tokens exchanged).
    ``latent``: a low-rank down projection of multi-head latent attention, a full copy on every
        rank; the last ``shared`` output features (the rotary key every head reads) get their
        gradient summed over the ranks.
    ``per_head``: the named parameters of a module holding one value per head (attention sinks)
        split with the heads (``params``; ``kv_heads`` for one value per KV head).
    ``replicate``: left as it is, a full copy on every rank (a container: everything inside it; with
        ``params``, a list of its own parameter names: only those, its children keeping their rules).

Every key, with an example per feature, is in ``docs/recipes.md``.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .hf_modules import base_model_and_prefix, config_get, config_has
from .loss import LOGIT_OPS
from .styles import AFTER_SUM, WHOLE
from .styles import STYLES as _STYLE_OBJECTS

__all__ = ["Recipe", "Rule", "RuleIndex", "Include", "RecipeError", "STYLES", "load_recipe", "recipe_dirs",
           "available_recipes", "compose"]

STYLES = tuple(_STYLE_OBJECTS)  # the style names a rule may give (tpify.styles: one object each)
_RULE_KEYS = {"match", "style", "parts", "replicated_parts", "kv_heads", "kv_groups", "kv_counts", "divide", "head_inputs",
              "optional", "when", "params", "shared", "identity_from"}
_PARAM_KEYS = {"dim", "parts"}
_TOP_KEYS = {"model_type", "description", "divisible", "divide_config", "loss", "checkpoint", "subclasses",
             "sequence_parallel", "rule", "include"}
_SP_KEYS = {"split", "gather", "exit"}
_SP_OPTIONAL = {"scope"}
_INCLUDE_KEYS = {"recipe", "prefix", "config"}
_HEAD_INPUT_KEYS = {"arg", "dim", "heads"}
SUBCLASS_FORWARDS = ("plain", "scaled")
LOSS_KINDS = ("causal", "masked", "seq2seq", "none")
_LOSS_KEYS = set(LOSS_KINDS) | {"ignores_num_items", "terms", "logits"}
_TERM_KEYS = {"output", "coefficient"}
_CHECKPOINT_KEYS = {"renames"}


class RecipeError(ValueError):
    """A recipe file is missing, unreadable or malformed; the message names the file and rule."""


def _compile_glob(pattern: str) -> re.Pattern:
    """FQN glob -> regex: ``*`` and ``?`` stay inside one dotted segment, ``**`` spans any number."""
    segs = pattern.split(".")
    regex = ""
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            regex += r"[^.]+(?:\.[^.]+)*" if last else r"(?:[^.]+\.)*"
        else:
            regex += re.escape(seg).replace(r"\*", "[^.]*").replace(r"\?", "[^.]") + ("" if last else r"\.")
    return re.compile(regex + r"\Z")


@dataclass
class Rule:
    """One ``[[rule]]`` of a recipe: FQN globs and what to do with the modules they match."""

    index: int
    patterns: tuple[str, ...]
    style: str | None = None
    parts: int | tuple[str | int, ...] | None = None
    divide: tuple[str, ...] = ()
    optional: bool = False
    when: tuple[tuple[str, object], ...] = ()
    replicated_parts: tuple[int, ...] = ()
    head_inputs: tuple[tuple[str, int, str], ...] = ()  # (argument name, head dimension, config head count)
    params: tuple[tuple[str, int, int], ...] = ()  # (parameter name, split dimension, packed parts) of 'experts'
    # KV heads of the layers (colwise) or of their replicated_parts (packed_colwise): config attribute or
    # number; held by groups of tp_size / kv_heads ranks when tp_size is a multiple of them
    kv_heads: str | int | None = None
    # attributes of the matched module holding query heads per KV head (HF's num_key_value_groups):
    # divided by tp_size / kv_heads when each KV head is held by a group of ranks
    kv_groups: tuple[str, ...] = ()
    # attributes of the matched module holding its KV heads (phi3's num_key_value_heads): divided by
    # tp_size when it divides the KV heads, else by kv_heads (each rank then holds one KV head)
    kv_counts: tuple[str, ...] = ()
    # 'latent' only: the trailing output features every head reads directly (DeepSeek's k_pe, a
    # config attribute or a number); their gradient is summed over the ranks
    shared: str | int | None = None
    # 'experts' only: the expert index from which the router's choices are zero-computation identity
    # experts (longcat_flash: the token itself, weighted), a config attribute or a number
    identity_from: str | int | None = None
    origin: str = ""  # where an included rule comes from: "<recipe file> at <prefix>" (compose)
    _regexes: list[re.Pattern] | None = field(default=None, repr=False, compare=False)  # compiled on first use

    def matches(self, fqn: str) -> bool:
        """True when ``fqn`` (relative to the base model) matches one of the rule's globs."""
        if self._regexes is None:
            self._regexes = [_compile_glob(p) for p in self.patterns]
        return any(r.match(fqn) for r in self._regexes)

    def applies(self, config) -> bool:
        """True when every ``when`` condition holds: ``config.<key> == value`` (a dotted key reads a
        sub-config, :func:`tpify.hf_modules.config_get`)."""
        return all(config_get(config, key) == value for key, value in self.when)

    def describe(self) -> str:
        where = f", from {self.origin}" if self.origin else ""
        return f"rule #{self.index} (match={list(self.patterns)}{where})"


def _is_glob(pattern: str) -> bool:
    return "*" in pattern or "?" in pattern


class RuleIndex:
    """The rules of a list that match an FQN, in rule order, without trying every rule.

    A pattern's literal parts bound what it can match: a name without ``*`` or ``?`` matches only
    itself; a glob matches only names with its number of dotted segments (unless it has a ``**``
    segment) whose first and last segments equal its own where those are literal (``h.*.attn``:
    three-segment names beginning with ``h`` and ending with ``attn``). Patterns are filed under
    that key, and a name is tried only against the rules filed under the keys it fits, so a recipe
    of thousands of rules costs little more per module than one of ten. Globs are compiled when
    first tried.
    """

    def __init__(self, rules: list[Rule]):
        self._by_name: dict[str, list[Rule]] = {}
        # (segment count or None with '**', literal first segment or None, literal last segment or None)
        self._by_shape: dict[tuple[int | None, str | None, str | None], list[Rule]] = {}
        for rule in rules:
            for pattern in dict.fromkeys(rule.patterns):  # a pattern listed twice is filed once
                if not _is_glob(pattern):
                    self._by_name.setdefault(pattern, []).append(rule)
                    continue
                segs = pattern.split(".")
                key = (None if "**" in segs else len(segs), None if _is_glob(segs[0]) else segs[0],
                       None if _is_glob(segs[-1]) else segs[-1])
                self._by_shape.setdefault(key, []).append(rule)

    def hits(self, fqn: str) -> list[Rule]:
        """Every rule that matches ``fqn`` (relative to the base model), once each, in rule order."""
        segs = fqn.split(".")
        found = {rule.index: rule for rule in self._by_name.get(fqn, ())}
        for count in (len(segs), None):
            for first in (segs[0], None):
                for last in (segs[-1], None):
                    for rule in self._by_shape.get((count, first, last), ()):
                        if rule.index not in found and rule.matches(fqn):
                            found[rule.index] = rule
        return [found[i] for i in sorted(found)]


@dataclass(frozen=True)
class Include:
    """One ``[[include]]`` of a recipe: another recipe applied to a sub-module with its sub-config.

    Attributes:
        prefix: the sub-module's name relative to the base model (``language_model``); the
            included rules' globs are prefixed with it.
        config: the attribute path of its sub-config on the model's config (``text_config``);
            every config attribute the included recipe reads is read there.
        recipe: the recipe's name or ``.toml`` path; None: the sub-config's ``model_type``.
    """

    prefix: str
    config: str
    recipe: str | None = None


@dataclass
class Recipe:
    """A parsed recipe: ``model_type``, config attributes tp must divide, and rules in order."""

    model_type: str
    rules: list[Rule]
    divisible: tuple[str, ...] = ()
    source: str = "<memory>"
    description: str = ""
    divide_config: tuple[str, ...] = ()
    loss: dict[str, str] = field(default_factory=dict)  # head class name -> "causal" | "masked" | "none"
    ignores_num_items: tuple[str, ...] = ()
    # (output field, coefficient: config attribute or number) HF adds to the LM loss (MoE aux losses)
    loss_terms: tuple[tuple[str, str | float], ...] = ()
    # (op, value: config attribute or number) the model applies to its LM head's output, in order
    logit_ops: tuple[tuple[str, str | float], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    subclasses: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # class -> (forward, scale attr)
    sequence_parallel: dict | None = None  # {"split": glob, "gather": [globs], "exit": glob[, "scope": prefix]}
    includes: tuple[Include, ...] = ()  # other recipes applied to sub-modules (compose() flattens them)

    def digest_data(self) -> list:
        """Everything that decides a layout, as JSON-able data (for the agreement fingerprint)."""
        return ([(r.patterns, r.style, r.parts, r.divide, r.optional, r.when, r.replicated_parts, r.head_inputs,
                  r.params, r.kv_heads, r.kv_groups, r.kv_counts, r.shared, r.identity_from) for r in self.rules]
                + [self.model_type, list(self.divisible), list(self.divide_config), sorted(self.loss.items()),
                   list(self.ignores_num_items), list(self.renames), sorted(self.subclasses.items()),
                   self.sequence_parallel, list(self.loss_terms), list(self.logit_ops),
                   [(i.prefix, i.config, i.recipe) for i in self.includes]])

    @classmethod
    def from_dict(cls, data: dict, source: str = "<memory>") -> "Recipe":
        """Validate and build a recipe from the parsed TOML mapping.

        Raises:
            RecipeError: unknown keys, a missing ``match``, an unknown style, a rule with neither
                ``style`` nor ``divide``, ``parts`` on a style that is not ``packed_colwise``,
                or a value of the wrong type. The message names ``source`` and the rule.
        """
        def fail(msg: str):
            raise RecipeError(f"recipe {source}: {msg}")

        if not isinstance(data, dict):
            fail("the top level must be a table")
        unknown = set(data) - _TOP_KEYS
        if unknown:
            fail(f"unknown top-level keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
        model_type = data.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            fail("'model_type' must be a non-empty string")
        divisible = data.get("divisible", [])
        if not isinstance(divisible, list) or not all(isinstance(d, str) for d in divisible):
            fail("'divisible' must be a list of config attribute names")
        divide_config = data.get("divide_config", [])
        if not isinstance(divide_config, list) or not all(isinstance(d, str) for d in divide_config):
            fail("'divide_config' must be a list of config attribute names")
        loss_table = data.get("loss", {})
        if not isinstance(loss_table, dict) or set(loss_table) - _LOSS_KEYS:
            fail(f"[loss] must be a table with keys among {sorted(_LOSS_KEYS)}")
        loss: dict[str, str] = {}
        loss_terms = []
        for term in loss_table.get("terms", []) if isinstance(loss_table.get("terms", []), list) else [None]:
            coefficient = term.get("coefficient") if isinstance(term, dict) else None
            if (not isinstance(term, dict) or set(term) != _TERM_KEYS or not isinstance(term["output"], str)
                    or not term["output"] or isinstance(coefficient, bool)
                    or not isinstance(coefficient, (str, int, float)) or coefficient == ""):
                fail("[loss] terms must be a list of { output = the model output's field (\"aux_loss\"), "
                     "coefficient = the config attribute HF multiplies it by (\"router_aux_loss_coef\"), or a "
                     "number } tables")
            loss_terms.append((term["output"], coefficient))
        logit_ops = []
        raw_ops = loss_table.get("logits", [])
        for item in raw_ops if isinstance(raw_ops, list) else [None]:
            op, value = next(iter(item.items())) if isinstance(item, dict) and len(item) == 1 else (None, None)
            if (op not in LOGIT_OPS or isinstance(value, bool) or not isinstance(value, (str, int, float))
                    or value in ("", 0)):
                fail(f"[loss] logits must be a list of {{ op = value }} tables, op one of {list(LOGIT_OPS)} and value "
                     f"the config attribute HF reads (\"final_logit_softcapping\") or a non-zero number, in the order "
                     f"the model applies them to its LM head's output")
            logit_ops.append((op, value))
        for kind, names in loss_table.items():
            if kind in ("terms", "logits"):
                continue
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                fail(f"[loss] {kind} must be a list of head class names")
            if kind == "ignores_num_items":
                continue
            for name in names:
                if name in loss:
                    fail(f"[loss] lists {name} under both {loss[name]!r} and {kind!r}")
                loss[name] = kind
        checkpoint = data.get("checkpoint", {})
        if not isinstance(checkpoint, dict) or set(checkpoint) - _CHECKPOINT_KEYS:
            fail(f"[checkpoint] must be a table with keys among {sorted(_CHECKPOINT_KEYS)}")
        renames = checkpoint.get("renames", [])
        if not isinstance(renames, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) and x for x in r) for r in renames):
            fail("[checkpoint] renames must be a list of [old suffix, new suffix] pairs of non-empty strings")
        subclasses: dict[str, tuple[str, str | None]] = {}
        raw_sub = data.get("subclasses", {})
        if not isinstance(raw_sub, dict):
            fail("[subclasses] must be a table of class name = { forward = 'plain' | 'scaled', scale = attribute }")
        for name, entry in raw_sub.items():
            if not isinstance(entry, dict) or set(entry) - {"forward", "scale"} or entry.get("forward") not in SUBCLASS_FORWARDS:
                fail(f"[subclasses] {name} must be a table with forward = one of {list(SUBCLASS_FORWARDS)} "
                     f"(and scale = a module attribute name for 'scaled')")
            scale = entry.get("scale")
            if (entry["forward"] == "scaled") != isinstance(scale, str) or scale == "":
                fail(f"[subclasses] {name}: forward = 'scaled' needs scale = the name of the module attribute "
                     f"holding the factor (a float); 'plain' takes no scale")
            subclasses[name] = (entry["forward"], scale)
        sp = data.get("sequence_parallel")
        if sp is not None:
            ok = (isinstance(sp, dict) and _SP_KEYS <= set(sp) <= _SP_KEYS | _SP_OPTIONAL
                  and isinstance(sp.get("scope", "x"), str) and sp.get("scope", "x") and isinstance(sp["split"], str) and sp["split"]
                  and isinstance(sp["exit"], str) and sp["exit"] and isinstance(sp["gather"], list) and sp["gather"]
                  and all(isinstance(g, str) and g for g in sp["gather"]))
            if not ok:
                fail("[sequence_parallel] must be a table with split = the glob of the module whose input is split "
                     "along the tokens, gather = globs of the modules whose input is all-gathered (attention, MLP), "
                     "exit = the glob of the module whose output is all-gathered (and optionally scope = the "
                     "module whose column- and row-parallel layers must all be gathered, by default the whole model)")
        includes = _includes(data.get("include", []), fail)
        raw_rules = data.get("rule", [])
        if not isinstance(raw_rules, list) or not (raw_rules or includes):
            fail("a recipe needs at least one [[rule]] (or [[include]])")
        rules = []
        for i, raw in enumerate(raw_rules):
            where = f"rule #{i}"
            if not isinstance(raw, dict):
                fail(f"{where} must be a table")
            unknown = set(raw) - _RULE_KEYS
            if unknown:
                fail(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
            match = raw.get("match")
            patterns = [match] if isinstance(match, str) else match
            if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
                fail(f"{where} needs 'match': a glob string or a list of them (\"\": the base model itself)")
            style = raw.get("style")
            if style is not None and style not in STYLES:
                fail(f"{where} (match={patterns}) has unknown style {style!r}; known styles: {list(STYLES)}")
            divide = raw.get("divide", [])
            if not isinstance(divide, list) or not all(isinstance(d, str) for d in divide):
                fail(f"{where} (match={patterns}): 'divide' must be a list of attribute names")
            raw_inputs = raw.get("head_inputs", [])
            head_inputs = []
            for item in raw_inputs if isinstance(raw_inputs, list) else [None]:  # not a list: the error below
                if (not isinstance(item, dict) or set(item) != _HEAD_INPUT_KEYS or not isinstance(item["arg"], str)
                        or not isinstance(item["dim"], int) or isinstance(item["dim"], bool)
                        or not isinstance(item["heads"], str)):
                    fail(f"{where} (match={patterns}): 'head_inputs' must be a list of {{ arg = forward argument "
                         f"name, dim = its head dimension (an integer), heads = config attribute of the dense head "
                         f"count }}")
                head_inputs.append((item["arg"], item["dim"], item["heads"]))
            kv_groups = raw.get("kv_groups", [])
            if not isinstance(kv_groups, list) or not all(isinstance(d, str) and d for d in kv_groups):
                fail(f"{where} (match={patterns}): 'kv_groups' must be a list of attribute names")
            kv_counts = raw.get("kv_counts", [])
            if not isinstance(kv_counts, list) or not all(isinstance(d, str) and d for d in kv_counts):
                fail(f"{where} (match={patterns}): 'kv_counts' must be a list of attribute names")
            if style is None and not divide and not head_inputs and not kv_groups and not kv_counts:
                fail(f"{where} (match={patterns}) needs a 'style' or a 'divide' list (or 'head_inputs', 'kv_groups', "
                     f"'kv_counts')")
            parts = raw.get("parts")
            if parts is not None:
                if style != "packed_colwise":
                    fail(f"{where} (match={patterns}): 'parts' is only for style 'packed_colwise'")
                ok = (isinstance(parts, int) and not isinstance(parts, bool) and parts >= 2) or (
                    isinstance(parts, list) and len(parts) >= 2 and all(
                        (isinstance(p, str) and p) or (isinstance(p, int) and not isinstance(p, bool) and p >= 1)
                        for p in parts))
                if not ok:
                    fail(f"{where} (match={patterns}): 'parts' must be an integer >= 2 (equal parts) or a list of "
                         ">= 2 weights, each a config attribute name or a positive integer")
                parts = parts if isinstance(parts, int) else tuple(parts)
            elif style == "packed_colwise":
                fail(f"{where} (match={patterns}): style 'packed_colwise' needs 'parts'")
            replicated_parts = raw.get("replicated_parts", [])
            if replicated_parts:
                count = parts if isinstance(parts, int) else len(parts or ())
                if (style != "packed_colwise" or not isinstance(replicated_parts, list)
                        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count
                                   for i in replicated_parts)
                        or len(set(replicated_parts)) != len(replicated_parts) or len(replicated_parts) >= count):
                    fail(f"{where} (match={patterns}): 'replicated_parts' is for style 'packed_colwise': a list of "
                         f"distinct part indices (0-based, below {count}) naming some, not all, of the parts")
            kv_heads = raw.get("kv_heads")
            if (kv_groups or kv_counts) and (style is not None or kv_heads is None):
                fail(f"{where} (match={patterns}): 'kv_groups' (attributes holding query heads per KV head) and "
                     f"'kv_counts' (attributes holding the KV heads) need 'kv_heads' (the KV heads, a config attribute "
                     f"name or a positive integer) and no 'style'")
            if kv_heads is not None and not kv_groups and not kv_counts and (
                    style not in ("colwise", "packed_colwise", "per_head")
                    or (style == "packed_colwise" and not replicated_parts)
                    or not ((isinstance(kv_heads, str) and kv_heads)
                            or (isinstance(kv_heads, int) and not isinstance(kv_heads, bool) and kv_heads >= 1))):
                fail(f"{where} (match={patterns}): 'kv_heads' (a config attribute name or a positive integer: the KV "
                     f"heads of a 'colwise' layer, of a 'packed_colwise' layer's replicated_parts, or of a "
                     f"'per_head' rule's parameters) is for those styles only")
            params = _rule_params(raw.get("params"), style, f"{where} (match={patterns})", fail)
            shared = raw.get("shared")
            if shared is not None and (style != "latent" or not (
                    (isinstance(shared, str) and shared)
                    or (isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0))):
                fail(f"{where} (match={patterns}): 'shared' (the trailing output features every head reads, a config "
                     f"attribute name or a non-negative integer) is for style 'latent' only")
            identity_from = raw.get("identity_from")
            if identity_from is not None and (style != "experts" or not (
                    (isinstance(identity_from, str) and identity_from)
                    or (isinstance(identity_from, int) and not isinstance(identity_from, bool) and identity_from >= 0))):
                fail(f"{where} (match={patterns}): 'identity_from' (the first expert index of the zero-computation "
                     f"identity experts, a config attribute name or a non-negative integer) is for style 'experts' "
                     f"only")
            optional = raw.get("optional", False)
            if not isinstance(optional, bool):
                fail(f"{where} (match={patterns}): 'optional' must be true or false")
            when = raw.get("when", {})
            if not isinstance(when, dict) or not all(isinstance(v, (bool, int, float, str)) for v in when.values()):
                fail(f"{where} (match={patterns}): 'when' must be a table of config attribute = value "
                     f"(booleans, numbers or strings)")
            rules.append(Rule(i, tuple(patterns), style, parts, tuple(divide), optional, tuple(sorted(when.items())),
                              tuple(replicated_parts), tuple(head_inputs), params, kv_heads=kv_heads,
                              kv_groups=tuple(kv_groups), kv_counts=tuple(kv_counts), shared=shared,
                              identity_from=identity_from))
        return cls(model_type, rules, tuple(divisible), source, data.get("description", ""), tuple(divide_config),
                   loss, tuple(loss_table.get("ignores_num_items", [])), tuple(loss_terms), tuple(logit_ops),
                   tuple(tuple(r) for r in renames), subclasses, sp, includes)


def _includes(raw, fail) -> tuple[Include, ...]:
    """The ``[[include]]`` tables: ``prefix`` and ``config`` (non-empty strings), ``recipe`` optional."""
    if not isinstance(raw, list):
        fail("[[include]] must be an array of tables")
    found = []
    for i, item in enumerate(raw):
        ok = (isinstance(item, dict) and {"prefix", "config"} <= set(item) <= _INCLUDE_KEYS
              and all(isinstance(v, str) and v for v in item.values()))
        if not ok:
            fail(f"[[include]] #{i} must be a table with prefix = the sub-module's name relative to the base model "
                 f"(\"language_model\"), config = the attribute path of its sub-config (\"text_config\"), and "
                 f"optionally recipe = the recipe to apply (a name or a .toml path; by default the sub-config's "
                 f"model_type)")
        found.append(Include(item["prefix"], item["config"], item.get("recipe")))
    prefixes = [inc.prefix for inc in found]
    if len(set(prefixes)) != len(prefixes):
        fail(f"[[include]] names a prefix twice: {prefixes}")
    return tuple(found)


def _rule_params(raw, style, where: str, fail) -> tuple[tuple[str, int, int], ...]:
    """A rule's ``params`` table: ``{ name = { dim = d, parts = n } }`` -> ``((name, d, n), ...)``
    sorted by name (``parts`` 1 when not given); ``{ after_sum = true }`` (``experts`` only: a bias
    added to each expert's output, kept whole and counted once) -> ``(name, AFTER_SUM, 1)``. The
    ``experts`` and ``per_head`` styles take it, and need it. ``replicate`` takes a list of the
    module's own parameter names instead (``["positional_embedding_vlm"]`` -> ``(name, WHOLE, 1)``):
    those parameters whole on purpose, the module's children keeping their own rules."""
    if style == "replicate" and raw is not None:
        if not (isinstance(raw, list) and raw and all(isinstance(n, str) and n and "." not in n for n in raw)
                and len(set(raw)) == len(raw)):
            fail(f"{where}: 'params' of style 'replicate' must be a list of distinct names of the module's own "
                 f"parameters, kept whole on purpose (its children keep their own rules)")
        return tuple((name, WHOLE, 1) for name in sorted(raw))
    if raw is None:
        if style == "experts":
            fail(f"{where}: style 'experts' needs 'params', the parameters it splits and how: params = "
                 f"{{ gate_up_proj = {{ dim = 1, parts = 2 }}, down_proj = {{ dim = 2 }} }}")
        if style == "per_head":
            fail(f"{where}: style 'per_head' needs 'params', the parameters holding one value per head and their head "
                 f"dimension: params = {{ sinks = {{ dim = 0 }} }}")
        return ()
    if style not in ("experts", "per_head"):
        fail(f"{where}: 'params' is only for styles 'experts' and 'per_head' (and, as a list of the module's own "
             f"parameter names kept whole, 'replicate')")

    def split(spec) -> bool:
        return (set(spec) <= _PARAM_KEYS and "dim" in spec
                and all(isinstance(v, int) and not isinstance(v, bool) for v in spec.values())
                and spec["dim"] >= 0 and spec.get("parts", 1) >= 1)

    def after_sum(spec) -> bool:
        return style == "experts" and spec == {"after_sum": True}

    ok = isinstance(raw, dict) and raw and all(
        isinstance(name, str) and name and "." not in name and isinstance(spec, dict) and spec
        and (split(spec) or after_sum(spec)) for name, spec in raw.items())
    if not ok:
        fail(f"{where}: 'params' must be a table of parameter name = {{ dim = the dimension split over the ranks "
             f"(an integer >= 0), parts = the number of equal packed parts along it, each split alike (optional, "
             f"an integer >= 1) }}" + (", or {{ after_sum = true }} (a bias added to each expert's output: kept "
                                       "whole, counted once after the sum over the ranks)" if style == "experts"
                                       else ""))
    return tuple(sorted((name, AFTER_SUM, 1) if "after_sum" in spec else (name, spec["dim"], spec.get("parts", 1))
                        for name, spec in raw.items()))


def loss_terms_of(config) -> list[dict]:
    """The ``[loss] terms`` HF adds to a config's LM loss, for a recipe written from the config
    (``tpify draft``, the imported HF plan): a mixture of experts whose config holds
    ``router_aux_loss_coef`` and ``output_router_logits`` adds ``router_aux_loss_coef * aux_loss``
    when ``output_router_logits`` is on (Mixtral, Qwen2/3-MoE, OLMoE, ...). Local; reads attributes."""
    if hasattr(config, "router_aux_loss_coef") and hasattr(config, "output_router_logits"):
        return [{"output": "aux_loss", "coefficient": "router_aux_loss_coef"}]
    return []


def logit_ops_of(config) -> list[dict]:
    """The ``[loss] logits`` a config's model applies to its LM head's output, for a recipe written
    from the config (``tpify draft``, the imported HF plan), in the order transformers applies
    them: ``logit_scale`` multiplies (Cohere), ``lm_head_multiplier`` multiplies (Falcon-H1),
    ``logits_scaling`` divides (Granite), ``final_logit_softcapping`` caps (Gemma 2 and 3:
    ``cap * tanh(logits / cap)``). Local; reads
    attribute names only. A declaration the model does not follow is refused when the chunked
    loss checks it (:mod:`tpify.hooks.lm_loss`)."""
    found = [("multiply", "logit_scale"), ("multiply", "lm_head_multiplier"), ("divide", "logits_scaling"),
             ("softcap", "final_logit_softcapping")]
    return [{op: name} for op, name in found if hasattr(config, name)]


def recipe_dirs() -> list[Path]:
    """Folders searched for ``<model_type>.toml``: inside the installed wheel, then the checkout."""
    here = Path(__file__).resolve().parent
    return [d for d in (here / "recipes", here.parent / "recipes") if d.is_dir()]


def available_recipes() -> list[str]:
    """The ``model_type`` names that have a shipped recipe."""
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.toml")})


# A recipe name is a model_type: letters, digits, "_", "-" and inner dots; never a path (no separator, no "..").
_RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*")


def load_recipe(recipe: "str | Path | dict | Recipe") -> Recipe:
    """Load a recipe by ``model_type`` name, by path to a ``.toml`` file, or from a mapping.

    A string ending in ``.toml``, or a ``pathlib.Path``, is a file path (read as given); any other
    string is a name, looked up as ``<name>.toml`` in the recipe folders (:func:`recipe_dirs`)
    only: it must be a name (letters, digits, ``_``, ``-``, inner dots), so a name can never
    reach a file outside those folders (``../../x/evil`` is refused, not read).

    Raises:
        RecipeError: a name that is not one (a path separator, ``..``), no recipe for that name
            (the message lists the known ones and how to pass a file), a file that does not exist
            or is not valid TOML, or a malformed recipe.
    """
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    if not isinstance(recipe, (str, os.PathLike)):
        raise RecipeError(f"recipe must be a name (a model_type such as 'llama'), a path to a .toml file, a mapping "
                          f"or a Recipe, got {type(recipe).__name__}")
    path = Path(recipe)
    if isinstance(recipe, str) and path.suffix != ".toml":
        if not _RECIPE_NAME.fullmatch(recipe):
            raise RecipeError(
                f"recipe {recipe!r} is not a recipe name (a model_type such as 'llama': letters, digits, '_', '-') "
                f"and not a .toml path: a name is looked up in the recipe folders only. Pass a file as a path ending "
                f"in .toml, or as a pathlib.Path")
        found = [d / f"{recipe}.toml" for d in recipe_dirs() if (d / f"{recipe}.toml").is_file()]
        if not found:
            raise RecipeError(
                f"no tpify recipe for model_type {str(recipe)!r}; shipped recipes: {available_recipes()}. "
                "Write one (see docs/recipes.md) and pass it as parallelize(model, recipe='path/to/file.toml').")
        path = found[0]
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"recipe {path}: not valid TOML: {e}") from e
    return Recipe.from_dict(data, str(path))


def compose(recipe: Recipe, model) -> Recipe:
    """``recipe`` with its ``[[include]]`` tables applied: one flat recipe for ``model``.

    Each include applies another recipe (its ``recipe``, else the ``model_type`` of the sub-config
    at ``config``) to the sub-module at ``prefix`` (relative to the base model): the included
    rules' globs are prefixed with it (and with the sub-module's own base-model prefix, when it
    has one), and every config attribute they read (``divisible``, ``divide_config``,
    ``kv_heads``, ``parts`` weights, ``head_inputs`` heads, ``when`` keys) becomes a dotted path
    into the sub-config (``text_config.num_attention_heads``), so it resolves against the part it
    was written for. Included recipes may include others (applied first, against their own
    sub-config). Their ``[subclasses]`` and checkpoint renames are added; their
    ``[sequence_parallel]`` table is prefixed and scoped to the sub-module (its column- and
    row-parallel layers must lie in a gathered module; the other parts' layers, which run outside
    the split stretch, need not); at most one part may have one. Their ``[loss]`` tables are not
    taken: the head classes are the composite's, and the including recipe declares them. The
    recipe's own rules come first (their indices unchanged), then each include's in order. Local.

    Raises:
        RecipeError: a sub-config that the model's config does not hold, a sub-module the model
            does not have, no recipe for the part's model_type (named, with the shipped ones),
            a config attribute the included recipe reads that the sub-config lacks (each named,
            with the rule that reads it), two ``[sequence_parallel]`` tables, or one
            ``[subclasses]`` entry given two ways.
    """
    if not recipe.includes:
        return recipe
    config = getattr(model, "config", None)
    base, _ = base_model_and_prefix(model)
    rules = list(recipe.rules)
    subclasses, renames = dict(recipe.subclasses), list(recipe.renames)
    divisible, divide_config = list(recipe.divisible), list(recipe.divide_config)
    sp = recipe.sequence_parallel
    for number, inc in enumerate(recipe.includes):
        where = f"recipe {recipe.source}: [[include]] #{number} (prefix = {inc.prefix!r}, config = {inc.config!r})"
        sub = config_get(config, inc.config)
        if sub is None or isinstance(sub, (bool, int, float, str, list, tuple, dict)):
            raise RecipeError(f"{where}: {type(config).__name__} holds no sub-config at {inc.config!r} ({sub!r}); "
                              f"name the attribute that holds the part's config (text_config, vision_config)")
        try:
            module = base.get_submodule(inc.prefix)
        except AttributeError:
            raise RecipeError(f"{where}: {type(model).__name__} has no module {inc.prefix!r} (relative to its base "
                              f"model {type(base).__name__}); its children are "
                              f"{[n for n, _ in base.named_children()]}") from None
        name = inc.recipe or getattr(sub, "model_type", None)
        if not name:
            raise RecipeError(f"{where}: the sub-config {type(sub).__name__} has no model_type; give recipe = ...")
        try:
            inner = compose(load_recipe(name), module)
        except RecipeError as e:
            raise RecipeError(f"{where}: the part {type(module).__name__} ({inc.config}.model_type = "
                              f"{getattr(sub, 'model_type', None)!r}) cannot be planned: {e} For a part: a recipe file "
                              f"named after its model_type in a recipes folder, or recipe = ... in this [[include]]"
                              ) from None
        _check_sub_config(inner, sub, where)
        inner_prefix = base_model_and_prefix(module)[1]
        prefix = f"{inc.prefix}.{inner_prefix}" if inner_prefix else inc.prefix

        def at(name: str, path: str = inc.config) -> str:
            return f"{path}.{name}"

        for r in inner.rules:
            parts = tuple(at(p) if isinstance(p, str) else p for p in r.parts) if isinstance(r.parts, tuple) \
                else r.parts
            rules.append(Rule(len(rules), tuple(f"{prefix}.{p}" for p in r.patterns), r.style, parts, r.divide,
                              r.optional, tuple((at(k), v) for k, v in r.when), r.replicated_parts,
                              tuple((a, d, at(h)) for a, d, h in r.head_inputs), r.params,
                              at(r.kv_heads) if isinstance(r.kv_heads, str) else r.kv_heads, r.kv_groups,
                              kv_counts=r.kv_counts, shared=at(r.shared) if isinstance(r.shared, str) else r.shared,
                              identity_from=at(r.identity_from) if isinstance(r.identity_from, str)
                              else r.identity_from,
                              origin=f"{inner.source} at {prefix}" + (f" ({r.origin})" if r.origin else "")))
        divisible += [at(n) for n in inner.divisible]
        divide_config += [at(n) for n in inner.divide_config]
        renames += [r for r in inner.renames if r not in renames]
        for cls_name, entry in inner.subclasses.items():
            if subclasses.setdefault(cls_name, entry) != entry:
                raise RecipeError(f"{where}: [subclasses] {cls_name} is {entry} in {inner.source} but "
                                  f"{subclasses[cls_name]} elsewhere")
        if inner.sequence_parallel is not None:
            if sp is not None:
                raise RecipeError(f"{where}: {inner.source} has a [sequence_parallel] table, and so has another part; "
                                  f"one stretch of split tokens per model")
            isp = inner.sequence_parallel
            sp = {"split": f"{prefix}.{isp['split']}", "gather": [f"{prefix}.{g}" for g in isp["gather"]],
                  "exit": f"{prefix}.{isp['exit']}", "scope": f"{prefix}.{isp['scope']}" if "scope" in isp else prefix}
    return Recipe(recipe.model_type, rules, tuple(divisible), recipe.source, recipe.description, tuple(divide_config),
                  recipe.loss, recipe.ignores_num_items, recipe.loss_terms, recipe.logit_ops, tuple(renames),
                  subclasses, sp)


def _check_sub_config(recipe: Recipe, sub, where: str) -> None:
    """Every config attribute ``recipe``'s rules read holds on ``sub`` (``when`` keys aside: a
    condition on a missing attribute is simply false), else a RecipeError naming each."""
    reads = [(n, "divisible") for n in recipe.divisible] + [(n, "divide_config") for n in recipe.divide_config]
    for r in recipe.rules:
        if isinstance(r.kv_heads, str):
            reads.append((r.kv_heads, f"kv_heads of {r.describe()}"))
        if isinstance(r.parts, tuple):
            reads += [(p, f"parts of {r.describe()}") for p in r.parts if isinstance(p, str)]
        reads += [(h, f"head_inputs of {r.describe()}") for _, _, h in r.head_inputs]
    missing = [f"{name} ({what})" for name, what in reads if not config_has(sub, name)]
    if missing:
        raise RecipeError(f"{where}: recipe {recipe.source} reads config attributes that the sub-config "
                          f"{type(sub).__name__} (model_type {getattr(sub, 'model_type', None)!r}) does not have: "
                          f"{missing}. Include a recipe written for this part's family (recipe = ...), or write one "
                          f"(docs/recipes.md)")
