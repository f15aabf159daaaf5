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

A rule's own keys are those every rule may have (``match``, ``style``, ``divide``,
``head_inputs``, ``kv_heads`` / ``kv_groups`` / ``kv_counts``, ``optional``, ``when``); the keys
of a style (``parts``, ``params``, ``shared``, ...) are read by that style
(:meth:`tpify.styles.Style.read_rule`: the rule's ``options``). The styles are
:data:`tpify.styles.STYLES`; every key, with an example per feature, is in ``docs/recipes.md``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .hf_modules import config_get
from .loss import LOGIT_OPS
from .styles import STYLES, RuleError
from .styles.base import foreign_key

__all__ = ["Recipe", "Rule", "RuleIndex", "Include", "RecipeError", "STYLES", "load_recipe", "recipe_dirs",
           "available_recipes"]

#: The keys every rule may have, whatever its style; a style's own keys are its ``KEYS``.
_COMMON_KEYS = {"match", "style", "divide", "head_inputs", "optional", "when", "kv_heads", "kv_groups", "kv_counts"}
_TOP_KEYS = {"model_type", "description", "divisible", "divide_config", "loss", "checkpoint", "subclasses",
             "sequence_parallel", "rule", "include", "pipeline"}
_SP_KEYS = {"split", "gather", "exit"}
#: ``[pipeline]`` (tpify.pipeline): the decoder layers' ModuleList, the modules of the first and last
#: stage (each with what it becomes on the other stages), and the head (default: the output embeddings).
_PP_KEYS = {"layers", "first", "last", "head"}
#: What a first- or last-stage module becomes on the other stages: ``absent`` (removed: the HF
#: forward does not call it when given ``inputs_embeds``), ``identity`` (returns its input: a final
#: norm, a dropout), ``zero`` (returns 0: a term added to the embeddings, GPT-2's ``wpe``).
PIPELINE_ELSEWHERE = ("absent", "identity", "zero")
_SP_OPTIONAL = {"scope"}
_INCLUDE_KEYS = {"recipe", "prefix", "config"}
_HEAD_INPUT_KEYS = {"arg", "dim", "heads"}
SUBCLASS_FORWARDS = ("plain", "scaled")
LOSS_KINDS = ("causal", "masked", "seq2seq", "none")
_LOSS_KEYS = set(LOSS_KINDS) | {"ignores_num_items", "terms", "logits"}
_TERM_KEYS = {"output", "coefficient"}
_CHECKPOINT_KEYS = {"renames"}


def rule_keys() -> set[str]:
    """Every key a rule may have: the common ones and each registered style's."""
    return _COMMON_KEYS | {key for style in STYLES.values() for key in style.KEYS}


def _option_names() -> set[str]:
    """The option fields of every registered style (``parts``, ``params``, ``shared``, ...)."""
    return {f.name for style in STYLES.values() for f in dataclasses.fields(style.Options)}


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
    """One ``[[rule]]`` of a recipe: FQN globs and what to do with the modules they match.

    Attributes:
        index, patterns: its place in the recipe and its globs (``match``).
        style: the style's name, or None (a rule of facts only).
        divide, head_inputs: module attributes divided by ``tp_size``; forward arguments holding
            one entry per head (``(argument, head dimension, config head count)``).
        kv_heads: the KV heads of what it matches (a config attribute or a number): what
            ``kv_groups`` / ``kv_counts`` divide by, or the styles that split by KV heads read.
        kv_groups, kv_counts: attributes holding query heads per KV head (HF's
            ``num_key_value_groups``) and KV head counts (phi3's ``num_key_value_heads``).
        optional, when: no warning when it matches nothing; ``config.<key> == value`` conditions.
        options: the style's own keys as its :meth:`~tpify.styles.Style.read_rule` read them (a
            frozen dataclass), None without a style. ``rule.<option>`` reads one (``rule.parts``);
            an option its style does not take reads as None.
        origin: where an included rule comes from: "<recipe file> at <prefix>" (:func:`tpify.compose.compose`).
    """

    index: int
    patterns: tuple[str, ...]
    style: str | None = None
    divide: tuple[str, ...] = ()
    optional: bool = False
    when: tuple[tuple[str, object], ...] = ()
    head_inputs: tuple[tuple[str, int, str], ...] = ()
    kv_heads: str | int | None = None
    kv_groups: tuple[str, ...] = ()
    kv_counts: tuple[str, ...] = ()
    options: object = None
    origin: str = ""
    _regexes: list[re.Pattern] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.options is None and self.style in STYLES:
            try:
                self.options = STYLES[self.style].Options()  # a style whose keys are all optional
            except TypeError:
                pass

    def __getattr__(self, name: str):
        """A style option read as an attribute (``rule.parts``): None where the rule's style takes
        no such option. Raises AttributeError for any other name."""
        if name.startswith("_"):
            raise AttributeError(name)
        options = self.__dict__.get("options")
        if options is not None and hasattr(options, name) and not name.isupper():
            return getattr(options, name)
        if name in _option_names():
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def styler(self):
        """The :class:`~tpify.styles.Style` of :attr:`style`, or None."""
        return STYLES[self.style] if self.style is not None else None

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
    includes: tuple[Include, ...] = ()  # other recipes applied to sub-modules (tpify.compose flattens them)
    pipeline: dict | None = None  # [pipeline]: {"layers": name, "first"/"last": {name: elsewhere}, "head": name}

    def digest_data(self) -> list:
        """Everything that decides a layout, as JSON-able data (for the agreement fingerprint)."""
        return ([(r.patterns, r.style, r.divide, r.optional, r.when, r.head_inputs, r.kv_heads, r.kv_groups,
                  r.kv_counts, None if r.options is None else (type(r.options).__name__,
                                                               dataclasses.astuple(r.options)))
                 for r in self.rules]
                + [self.model_type, list(self.divisible), list(self.divide_config), sorted(self.loss.items()),
                   list(self.ignores_num_items), list(self.renames), sorted(self.subclasses.items()),
                   self.sequence_parallel, list(self.loss_terms), list(self.logit_ops),
                   [(i.prefix, i.config, i.recipe) for i in self.includes]]
                + ([self.pipeline] if self.pipeline is not None else []))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<memory>") -> "Recipe":
        """Validate and build a recipe from the parsed TOML mapping, one reader per table.

        Raises:
            RecipeError: unknown keys, a missing ``match``, an unknown style, a rule with neither
                ``style`` nor ``divide``, a key its style does not take (``parts`` on a style that
                is not ``packed_colwise``), or a value of the wrong type. The message names
                ``source`` and the rule.
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
        divisible = _names(data, "divisible", "'divisible' must be a list of config attribute names", fail)
        divide_config = _names(data, "divide_config", "'divide_config' must be a list of config attribute names", fail)
        loss, ignores, terms, ops = _read_loss(data.get("loss", {}), fail)
        renames = _read_checkpoint(data.get("checkpoint", {}), fail)
        subclasses = _read_subclasses(data.get("subclasses", {}), fail)
        sp = _read_sequence_parallel(data.get("sequence_parallel"), fail)
        pipeline = read_pipeline(data.get("pipeline"), fail)
        includes = _includes(data.get("include", []), fail)
        raw_rules = data.get("rule", [])
        if not isinstance(raw_rules, list) or not (raw_rules or includes):
            fail("a recipe needs at least one [[rule]] (or [[include]])")
        rules = [_read_rule(i, raw, fail) for i, raw in enumerate(raw_rules)]
        return cls(model_type, rules, tuple(divisible), source, data.get("description", ""), tuple(divide_config),
                   loss, ignores, terms, ops, renames, subclasses, sp, includes, pipeline)


def _names(data: dict, key: str, message: str, fail) -> list[str]:
    """A top-level list of config attribute names."""
    names = data.get(key, [])
    if not isinstance(names, list) or not all(isinstance(d, str) for d in names):
        fail(message)
    return names


def _read_loss(table, fail) -> tuple[dict, tuple, tuple, tuple]:
    """``[loss]``: ``(head class -> kind, ignores_num_items, terms, logit ops)``."""
    if not isinstance(table, dict) or set(table) - _LOSS_KEYS:
        fail(f"[loss] must be a table with keys among {sorted(_LOSS_KEYS)}")
    loss_terms = []
    for term in table.get("terms", []) if isinstance(table.get("terms", []), list) else [None]:
        coefficient = term.get("coefficient") if isinstance(term, dict) else None
        if (not isinstance(term, dict) or set(term) != _TERM_KEYS or not isinstance(term["output"], str)
                or not term["output"] or isinstance(coefficient, bool)
                or not isinstance(coefficient, (str, int, float)) or coefficient == ""):
            fail("[loss] terms must be a list of { output = the model output's field (\"aux_loss\"), "
                 "coefficient = the config attribute HF multiplies it by (\"router_aux_loss_coef\"), or a "
                 "number } tables")
        loss_terms.append((term["output"], coefficient))
    logit_ops = []
    raw_ops = table.get("logits", [])
    for item in raw_ops if isinstance(raw_ops, list) else [None]:
        op, value = next(iter(item.items())) if isinstance(item, dict) and len(item) == 1 else (None, None)
        if (op not in LOGIT_OPS or isinstance(value, bool) or not isinstance(value, (str, int, float))
                or value in ("", 0)):
            fail(f"[loss] logits must be a list of {{ op = value }} tables, op one of {list(LOGIT_OPS)} and value "
                 f"the config attribute HF reads (\"final_logit_softcapping\") or a non-zero number, in the order "
                 f"the model applies them to its LM head's output")
        logit_ops.append((op, value))
    loss: dict[str, str] = {}
    for kind, names in table.items():
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
    return loss, tuple(table.get("ignores_num_items", [])), tuple(loss_terms), tuple(logit_ops)


def _read_checkpoint(table, fail) -> tuple[tuple[str, str], ...]:
    """``[checkpoint] renames``: ``((old suffix, new suffix), ...)``."""
    if not isinstance(table, dict) or set(table) - _CHECKPOINT_KEYS:
        fail(f"[checkpoint] must be a table with keys among {sorted(_CHECKPOINT_KEYS)}")
    renames = table.get("renames", [])
    if not isinstance(renames, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) and x for x in r) for r in renames):
        fail("[checkpoint] renames must be a list of [old suffix, new suffix] pairs of non-empty strings")
    return tuple(tuple(r) for r in renames)


def _read_subclasses(raw, fail) -> dict[str, tuple[str, str | None]]:
    """``[subclasses]``: class name -> ``(forward, scale attribute)``."""
    if not isinstance(raw, dict):
        fail("[subclasses] must be a table of class name = { forward = 'plain' | 'scaled', scale = attribute }")
    subclasses = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) - {"forward", "scale"} or entry.get("forward") not in SUBCLASS_FORWARDS:
            fail(f"[subclasses] {name} must be a table with forward = one of {list(SUBCLASS_FORWARDS)} "
                 f"(and scale = a module attribute name for 'scaled')")
        scale = entry.get("scale")
        if (entry["forward"] == "scaled") != isinstance(scale, str) or scale == "":
            fail(f"[subclasses] {name}: forward = 'scaled' needs scale = the name of the module attribute "
                 f"holding the factor (a float); 'plain' takes no scale")
        subclasses[name] = (entry["forward"], scale)
    return subclasses


def _read_sequence_parallel(sp, fail) -> dict | None:
    """``[sequence_parallel]``: split, gather, exit (and optionally scope) globs."""
    if sp is None:
        return None
    ok = (isinstance(sp, dict) and _SP_KEYS <= set(sp) <= _SP_KEYS | _SP_OPTIONAL
          and isinstance(sp.get("scope", "x"), str) and sp.get("scope", "x") and isinstance(sp["split"], str)
          and sp["split"] and isinstance(sp["exit"], str) and sp["exit"] and isinstance(sp["gather"], list)
          and sp["gather"] and all(isinstance(g, str) and g for g in sp["gather"]))
    if not ok:
        fail("[sequence_parallel] must be a table with split = the glob of the module whose input is split "
             "along the tokens, gather = globs of the modules whose input is all-gathered (attention, MLP), "
             "exit = the glob of the module whose output is all-gathered (and optionally scope = the "
             "module whose column- and row-parallel layers must all be gathered, by default the whole model)")
    return sp


def read_pipeline(table, fail) -> dict | None:
    """``[pipeline]``: ``layers`` (the decoder layers' ModuleList, a child of the base model),
    ``first`` and ``last`` (tables of base-model children -> what each becomes on the other
    stages, one of :data:`PIPELINE_ELSEWHERE`), ``head`` (the head class's child on the last stage
    only; default its output embeddings). Returns the table with defaults filled, or None."""
    if table is None:
        return None
    message = ("[pipeline] must be a table with layers = the name of the decoder layers' ModuleList (a child of the "
               "base model, e.g. 'layers' or 'h'), and optionally first = { name = 'absent' | 'identity' | 'zero' } "
               "(the modules of the first stage and what each becomes on the others), last = { ... } (those of the "
               "last stage), head = the head class's child computing the logits (default: its output embeddings)")
    if not isinstance(table, dict) or "layers" not in table or set(table) - _PP_KEYS:
        fail(message + (f"; unknown keys {sorted(set(table) - _PP_KEYS)}" if isinstance(table, dict) else ""))
    out = {"layers": table["layers"], "first": table.get("first", {}), "last": table.get("last", {}),
           "head": table.get("head")}
    names = [out["layers"]] + list(out["first"]) + list(out["last"]) if isinstance(out["first"], dict) and \
        isinstance(out["last"], dict) else None
    if names is None or not all(isinstance(n, str) and n and "." not in n for n in names) \
            or not all(v in PIPELINE_ELSEWHERE for v in [*out["first"].values(), *out["last"].values()]) \
            or not (out["head"] is None or isinstance(out["head"], str) and out["head"]):
        fail(message)
    return out


def _read_rule(i: int, raw, fail) -> Rule:
    """One ``[[rule]]``: its common keys here, its style's keys by the style (:meth:`Style.read_rule`)."""
    where = f"rule #{i}"
    if not isinstance(raw, dict):
        fail(f"{where} must be a table")
    allowed = rule_keys()
    unknown = set(raw) - allowed
    if unknown:
        fail(f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    match = raw.get("match")
    patterns = [match] if isinstance(match, str) else match
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
        fail(f"{where} needs 'match': a glob string or a list of them (\"\": the base model itself)")
    style = raw.get("style")
    if style is not None and style not in STYLES:
        fail(f"{where} (match={patterns}) has unknown style {style!r}; known styles: {list(STYLES)}")
    where = f"{where} (match={patterns})"
    divide = raw.get("divide", [])
    if not isinstance(divide, list) or not all(isinstance(d, str) for d in divide):
        fail(f"{where}: 'divide' must be a list of attribute names")
    head_inputs = _read_head_inputs(raw.get("head_inputs", []), where, fail)
    kv_groups, kv_counts = (_attribute_list(raw, key, where, fail) for key in ("kv_groups", "kv_counts"))
    if style is None and not divide and not head_inputs and not kv_groups and not kv_counts:
        fail(f"{where} needs a 'style' or a 'divide' list (or 'head_inputs', 'kv_groups', 'kv_counts')")
    kv_heads = raw.get("kv_heads")
    if (kv_groups or kv_counts) and (style is not None or kv_heads is None):
        fail(f"{where}: 'kv_groups' (attributes holding query heads per KV head) and 'kv_counts' (attributes "
             f"holding the KV heads) need 'kv_heads' (the KV heads, a config attribute name or a positive integer) "
             f"and no 'style'")
    own = {k: v for k, v in raw.items() if k not in _COMMON_KEYS or (k == "kv_heads" and not kv_groups and not kv_counts)}
    if own.get("replicated_parts") == []:
        del own["replicated_parts"]  # an empty list says nothing (any style may give it)
    try:
        options = STYLES[style].read_rule(own, where) if style is not None else _no_style(own, where)
    except RuleError as e:
        fail(str(e))
    optional = raw.get("optional", False)
    if not isinstance(optional, bool):
        fail(f"{where}: 'optional' must be true or false")
    when = raw.get("when", {})
    if not isinstance(when, dict) or not all(isinstance(v, (bool, int, float, str)) for v in when.values()):
        fail(f"{where}: 'when' must be a table of config attribute = value (booleans, numbers or strings)")
    return Rule(i, tuple(patterns), style, tuple(divide), optional, tuple(sorted(when.items())), tuple(head_inputs),
                kv_heads, tuple(kv_groups), tuple(kv_counts), options)


def _no_style(own: dict, where: str) -> None:
    """A rule without a style takes no style key (the message of a style that does)."""
    if own:
        raise RuleError(f"{where}: {foreign_key(next(iter(own)))}")


def _read_head_inputs(raw, where: str, fail) -> list[tuple[str, int, str]]:
    """A rule's ``head_inputs``: ``[(argument, head dimension, config head count)]``."""
    found = []
    for item in raw if isinstance(raw, list) else [None]:  # not a list: the error below
        if (not isinstance(item, dict) or set(item) != _HEAD_INPUT_KEYS or not isinstance(item["arg"], str)
                or not isinstance(item["dim"], int) or isinstance(item["dim"], bool)
                or not isinstance(item["heads"], str)):
            fail(f"{where}: 'head_inputs' must be a list of {{ arg = forward argument name, dim = its head dimension "
                 f"(an integer), heads = config attribute of the dense head count }}")
        found.append((item["arg"], item["dim"], item["heads"]))
    return found


def _attribute_list(raw: dict, key: str, where: str, fail) -> list[str]:
    """A rule's list of module attribute names (``kv_groups``, ``kv_counts``)."""
    names = raw.get(key, [])
    if not isinstance(names, list) or not all(isinstance(d, str) and d for d in names):
        fail(f"{where}: '{key}' must be a list of attribute names")
    return names


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
