"""``tpify draft``: a draft recipe for a model family, to review and then prove exact.

Two sources, tried in this order (``method="auto"``):

1. **transformers' own TP plan** (``config.base_model_tp_plan`` and the head classes'
   ``_tp_plan``), imported by :mod:`tpify.hf_plan` for every head class of the family and merged
   into one recipe here (head-class rules optional).
2. **A data-flow trace** of one forward of a small random instance
   (:mod:`tpify.authoring.tracer`, turned into rules by :mod:`tpify.authoring.trace_recipe`), for
   families without a plan.

The draft is a starting point, never trusted as is: every rule carries a comment saying what it
is based on, and the file ends with what to review. After the draft is made, its layout is built
at tp = 2 for every head class (meta device); a failure becomes a review line. ``tpify verify``
(or the test pattern of ``tests/distributed``) proves a recipe exact against the dense model.

:func:`draft` returns a :class:`~tpify.authoring.draft_types.Draft` (``draft.toml()``,
``draft.recipe()``); the command is ``tpify draft MODEL_TYPE_OR_DIR [--out FILE] [--head-class ...]
[--method ...]`` (:mod:`tpify.cli.draft`).
"""

from __future__ import annotations

import transformers

from ..hf_plan import TASK_HEADS, has_hf_plan, import_hf_plan
from ..layout import PlanError, build_layout
from ..recipe import RecipeError
from .draft_types import Draft, DraftError, build_head_class, recipe_data
from .small import small_config
from .target import HEAD_TASKS, family_head_classes, resolve_config
from .trace_recipe import draft_from_trace

__all__ = ["draft", "Draft", "DraftError"]


def draft(target: str, head_class: list[str] | None = None, method: str = "auto") -> Draft:
    """A draft recipe for ``target`` (a ``model_type`` or a directory with a ``config.json``).

    ``method``: ``"auto"`` (the HF plan when the family has one, else a trace), ``"hf-plan"`` or
    ``"trace"``. ``head_class``: tasks (``causal-lm``) or class names to build (default: every
    head class :func:`tpify.authoring.target.family_head_classes` lists). Nothing is downloaded;
    the trace runs one forward of a small random model
    (:func:`tpify.authoring.small.small_config`) on the CPU.

    Raises:
        tpify.authoring.target.TargetError: the target is not a model_type nor a config directory.
        DraftError: no head class, an unknown ``--head-class``, ``hf-plan`` for a family without
            one, a config that cannot be made small, a forward that fails on the small model.
        RecipeError: the HF plan holds a style tpify cannot express (``auto`` then traces).
    """
    if method not in ("auto", "hf-plan", "trace"):
        raise DraftError(f"method must be 'auto', 'hf-plan' or 'trace', not {method!r}")
    config = resolve_config(str(target))
    classes = _select_heads(config, head_class)
    if not classes:
        raise DraftError(f"transformers defines no model class for model_type {config.model_type!r}")
    d = None
    if method in ("auto", "hf-plan"):
        first = build_head_class(next(iter(classes.values())), config, meta=True)
        if has_hf_plan(first):
            try:
                d = _draft_from_hf_plan(config, classes)
            except RecipeError as e:
                if method == "hf-plan":
                    raise
                d = draft_from_trace(config, classes)
                d.review.insert(0, f"transformers' plan could not be imported ({e}); traced instead")
        elif method == "hf-plan":
            raise DraftError(f"transformers defines no tensor-parallel plan for model_type {config.model_type!r}; "
                             f"use method 'trace'")
    if d is None:
        d = draft_from_trace(config, classes)
    _check_layouts(d, config, classes)
    return d


def _select_heads(config, head_class: list[str] | None) -> dict[str, type]:
    """The head classes to look at: every head class of the family (the standard tasks of
    :func:`tpify.authoring.target.head_classes`, then the family's other public model classes such
    as ``GPT2DoubleHeadsModel``, as :func:`tpify.authoring.target.family_head_classes` lists them),
    or those named (tasks or class names).

    Raises:
        DraftError: a name that is neither a task nor a class of the installed transformers.
    """
    found = {t: c for t, c in family_head_classes(config).items()
             if getattr(c, "config_class", None) is None or isinstance(config, c.config_class)}
    if not head_class:
        return found
    by_name = {c.__name__: (t, c) for t, c in found.items()}
    out = {}
    for item in head_class:
        if item in found:
            out[item] = found[item]
        elif item in by_name:
            out[by_name[item][0]] = by_name[item][1]
        else:
            cls = getattr(transformers, item, None)
            if not isinstance(cls, type) or item in HEAD_TASKS:
                raise DraftError(f"--head-class {item!r} is neither a task ({', '.join(HEAD_TASKS)}) nor a head class "
                                 f"of model_type {config.model_type!r} ({', '.join(by_name)})")
            out[f"other:{item}"] = cls
    return out


def _check_layouts(d: Draft, config, classes: dict[str, type]) -> None:
    """Build the draft's layout at tp = 2 for every head class (meta device, the family's small
    config when it has one); each failure becomes a review line (the draft is still written)."""
    try:
        config = small_config(config, (2,))
    except Exception:  # noqa: BLE001 - the full config on the meta device then
        pass
    recipe = d.recipe()
    for cls in classes.values():
        try:
            build_layout(build_head_class(cls, config, meta=True), recipe, 2)
        except PlanError as e:
            d.review.insert(0, f"the draft does not fit {cls.__name__} at tp = 2: {e}")
        except Exception as e:  # noqa: BLE001 - a class that cannot be built on meta is reported, not fatal
            d.review.append(f"{cls.__name__} could not be checked on the meta device ({type(e).__name__}: {e})")


def _draft_from_hf_plan(config, classes: dict[str, type]) -> Draft:
    """Merge the imported plan of every head class (:func:`tpify.hf_plan.import_hf_plan`): base
    rules once, head rules optional, the task heads in one rule at the end.

    Raises:
        RecipeError: a head class's plan cannot be imported.
    """
    rules: list[dict] = []
    notes: list[str] = []
    review: list[str] = []
    seen: dict[str, int] = {}  # repr(match) -> index in rules
    divisible: list[str] = []
    divide_config: list[str] = []
    hf_count = 0
    for cls in classes.values():
        imported = import_hf_plan(build_head_class(cls, config, meta=True))
        hf_count = max(hf_count, len(imported.hf_rules))
        _add_new(divisible, imported.data.get("divisible", []))
        _add_new(divide_config, imported.data.get("divide_config", []))
        _merge_rules(cls, imported, rules, notes, review, seen)
        _add_new(review, imported.review)
    covered = {n for r in rules for n in (r["match"] if isinstance(r["match"], list) else [r["match"]])}
    heads = [t for t in TASK_HEADS if t not in covered]
    if heads:
        rules.append({"match": heads, "style": "replicate", "optional": True})
        notes.append("small task heads of the head classes: a full copy on every rank (optional)")
    data = recipe_data(config, f"DRAFT imported from transformers' tensor-parallel plan ({hf_count} HF rules)",
                       divisible, divide_config, rules, classes)
    if any("gathers this layer's output" in n or "rowwise_split_input" in n for n in notes):
        review.append("replicate rules for layers HF's plan gathers (colwise_gather_output / rowwise_split_input) "
                      "are exact but keep the layer whole; a packed layer can be split with packed_colwise (parts "
                      "per packed tensor) + rowwise on its consumer: compare `tpify draft --method trace`")
    review.append("divide / divide_config: HF plans say nothing of head counts; the import looked for integer "
                  "attributes and config head counts read in the attention modules' forward; check the forward of "
                  "each attention class for sizes it reads (views with -1 need nothing)")
    return Draft(data, notes, review, "hf-plan", config.model_type, [c.__name__ for c in classes.values()])


def _add_new(items: list, more) -> None:
    """Append each of ``more`` that ``items`` does not hold yet, in order."""
    for x in more:
        if x not in items:
            items.append(x)


def _merge_rules(cls: type, imported, rules: list[dict], notes: list[str], review: list[str],
                 seen: dict[str, int]) -> None:
    """Add ``cls``'s imported rules not given by an earlier head class (a different rule for the
    same match becomes a review line, the first kept); the task-heads rule is left out."""
    for rule, note in zip(imported.data["rule"], imported.notes):
        key = repr(rule["match"])
        if rule["match"] == list(TASK_HEADS) or (isinstance(rule["match"], list)
                                                 and set(rule["match"]) <= set(TASK_HEADS)):
            continue  # the task heads rule is written once, at the end
        if key in seen:
            old = rules[seen[key]]
            if {k: v for k, v in old.items() if k != "optional"} != {k: v for k, v in rule.items()
                                                                      if k != "optional"}:
                review.append(f"{rule['match']}: {cls.__name__} gives {rule} but another head class gave {old}; "
                              f"the first is kept")
            continue
        seen[key] = len(rules)
        rules.append(dict(rule))
        notes.append(note + (f" [{cls.__name__}]" if rule.get("optional") else ""))
