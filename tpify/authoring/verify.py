"""Prove a recipe exact: a tensor-parallel model against its dense twin (``tpify verify``).

A recipe is exact when the parallel model computes what the dense model computes, up to the
order of floating-point sums. Verify checks it on a small random model of the family, on CPU
ranks over gloo, for every head class the family defines:

* :func:`verify` (one target) / :func:`verify_many` (several): plan the cases before any rank
  starts (config resolved and made small, recipe found, head classes selected, sizes bounded),
  then one spawned job per tp size (:mod:`tpify.authoring.launcher`) runs every case, and the
  rows come back in a :class:`~tpify.authoring.verify_report.VerifyReport`;
* what each case checks: :func:`tpify.authoring.checks.check_case` (outputs with a left-padding
  mask, the ``labels=`` loss, every gathered gradient, greedy ``generate``, a save/load round
  trip), against the dense reference of :mod:`tpify.authoring.reference`, with the tolerances
  of :mod:`tpify.authoring.compare`;
* small configs and the bounds on what is built and run: :mod:`tpify.authoring.small`.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..recipe import RecipeError, available_recipes, load_recipe
from .inputs import case_config, main_input
from .launcher import run_job
from .small import MAX_SMALL_ELEMENTS, RANK_MEMORY_LIMIT_GIB, check_build_size, small_config
from .target import family_head_classes, resolve_config, task_of
from .verify_report import Row, VerifyReport

__all__ = ["Target", "verify", "verify_many"]


@dataclass
class Target:
    """One thing to verify in :func:`verify_many`.

    Attributes:
        target: a ``model_type`` (``"gpt2"``) or a directory holding a ``config.json``.
        recipe: a recipe name, ``.toml`` path, mapping or Recipe; None: the target's model_type.
        head_classes: class names, task names (``causal-lm``) or classes; None: every head class.
        label: the name rows carry (default ``target``).
        shrink: make the config small (:func:`small_config`); None: for a model_type yes, for a
            directory no (its config is used as it is).
        config: a config to use instead of resolving ``target`` (shrunk only if ``shrink``).
        max_elements: the most parameter and buffer elements a head class built from the config
            may have (:func:`check_build_size`, on the meta device, before any rank starts);
            None: :data:`MAX_SMALL_ELEMENTS` when the config is made small, no bound otherwise.
        expert_parallel: parallelize with ``ep_size = tp_size`` (fused MoE experts whole per
            rank, tokens exchanged with all-to-all) instead of tensor-parallel experts.
    """

    target: str
    recipe: object = None
    head_classes: Sequence | None = None
    label: str | None = None
    shrink: bool | None = None
    config: object = None
    max_elements: int | None = None
    expert_parallel: bool = False


@dataclass
class _Case:
    """One head class of one target, as the ranks run it (pickled to them; ``progress`` gets it)."""

    label: str
    cls: type
    task: str
    config: object
    recipe: object
    expert_parallel: bool = False


def _recipe_for(recipe, config):
    """The recipe to verify: the given one, else the shipped one of ``config.model_type``, else None
    (a family with an HF TP plan and no shipped recipe: ``parallelize`` imports the plan, which is
    then what is verified). Raises RecipeError when none exists, before any rank starts."""
    if recipe is None and config.model_type not in available_recipes():
        if not getattr(config, "base_model_tp_plan", None):
            raise RecipeError(f"no tpify recipe for model_type {config.model_type!r} and transformers defines no "
                              f"tensor-parallel plan for it; pass --recipe FILE (tpify draft writes a draft)")
        return None
    return load_recipe(recipe if recipe is not None else config.model_type)


def _prepare(spec: Target, tp_sizes: Sequence[int]):
    """``(config, recipe, fed heads, unfed heads)`` of one target, before any rank starts.

    The head classes are selected and split by whether verify can feed them
    (:func:`~tpify.authoring.inputs.main_input`: token ids, a part's embeddings, a vision tower's
    pixels; a target none of whose classes it can feed is returned as it is, not made small); the config is resolved and made small for ``tp_sizes`` (:func:`small_config`;
    ``spec.shrink`` None: for a model_type yes, for a directory or a given config no), the recipe
    found (:func:`_recipe_for`); the fed ones are built on the meta device and
    refused when larger than the bound (:func:`check_build_size`: ``spec.max_elements``, default
    :data:`MAX_SMALL_ELEMENTS` for a config made small, none for a config used as it is).

    Raises:
        TargetError, RecipeError, ShrinkError, ValueError: as :func:`verify` says.
    """
    config = spec.config if spec.config is not None else resolve_config(str(spec.target))
    shrink = spec.shrink if spec.shrink is not None else (spec.config is None and not Path(str(spec.target)).is_dir())
    fed, unfed = _fed_heads(_select_heads(config, spec.head_classes), config)  # before shrinking
    if not fed:
        return config, None, fed, unfed
    if shrink:
        config = small_config(config, tuple(tp_sizes))
    recipe = _recipe_for(spec.recipe, config)
    limit = spec.max_elements if spec.max_elements is not None else (MAX_SMALL_ELEMENTS if shrink else None)
    if limit is not None:
        for task, cls in fed:
            check_build_size(case_config(config, task, config.model_type), [cls], limit)
    return config, recipe, fed, unfed


def _plan_cases(spec: Target, tp: int) -> tuple[list[_Case], list[Row]]:
    """The cases of one target at one tp size (:func:`_prepare`), and a failed ``setup`` row for
    each head class verify cannot feed (:func:`_unfed_message`: an audio tower's ``input_features``).
    A target that fails any step of :func:`_prepare` is one failed ``setup`` row."""
    label = spec.label or str(spec.target)
    try:
        config, recipe, fed, unfed = _prepare(spec, (tp,))
    except Exception as e:  # noqa: BLE001 - one target's problem is one failed row
        return [], [Row(label, "-", tp, "setup", None, "-", False, f"{type(e).__name__}: {e}")]
    failed = [Row(label, cls.__name__, tp, "setup", None, "-", False, _unfed_message(cls)) for _, cls in unfed]
    if not fed and not unfed:
        failed.append(Row(label, "-", tp, "setup", None, "-", False,
                          f"not verified: no model class of transformers is built from a {type(config).__name__}"))
    return [_Case(label, cls, task, config, recipe, spec.expert_parallel) for task, cls in fed], failed


def _fed_heads(heads: list[tuple[str, type]], config) -> tuple[list[tuple[str, type]], list[tuple[str, type]]]:
    """``(heads verify can feed, the others)`` (:func:`~tpify.authoring.inputs.main_input`)."""
    fed = [(t, c) for t, c in heads if main_input(c, config) is not None]
    return fed, [(t, c) for t, c in heads if (t, c) not in fed]


def _unfed_message(cls: type) -> str:
    params = [p for p in inspect.signature(cls.forward).parameters if p != "self"][:4]
    return (f"not verified: tpify verify feeds token ids (input_ids), embeddings (inputs_embeds, noise_embeds) "
            f"or a vision tower's pixels (pixel_values of the config's image_size, patches with grid_thw or "
            f"pixel_position_ids), and {cls.__name__}.forward takes none of them ({', '.join(params)}, ...)")


# When transformers lists one class under several tasks (llama4's Llama4ForConditionalGeneration is
# its base model and its image-text-to-text head; bart's BartForConditionalGeneration its masked LM
# and its seq2seq LM), verify runs it once, as the task whose checks include the others' (labels
# and generate before a bare forward); the rows name the class, so a second case would repeat them.
_TASK_PREFERENCE = ("image-text-to-text", "seq2seq-lm", "causal-lm", "masked-lm")


def _task_rank(task: str) -> int:
    if task in _TASK_PREFERENCE:
        return _TASK_PREFERENCE.index(task)
    return len(_TASK_PREFERENCE) + (1 if task == "base" else 0)


def _one_case_per_class(heads: list[tuple[str, type]]) -> list[tuple[str, type]]:
    """``heads`` with each class once, under its preferred task (:data:`_TASK_PREFERENCE`, then
    any other task, ``base`` last), at the place of its first listing."""
    best: dict[type, str] = {}
    for task, cls in heads:
        if cls not in best or _task_rank(task) < _task_rank(best[cls]):
            best[cls] = task
    return [(best[cls], cls) for cls in dict.fromkeys(cls for _, cls in heads)]


def _select_heads(config, requested) -> list[tuple[str, type]]:
    """``[(task, class)]`` for the requested head classes (names, task names or classes; None:
    all), each class once (:func:`_one_case_per_class`): its rows are named by the class."""
    available = family_head_classes(config)
    if not requested:
        return _one_case_per_class(list(available.items()))
    by_name = {cls.__name__: (task, cls) for task, cls in _one_case_per_class(list(available.items()))}
    out = []
    for item in requested:
        if isinstance(item, type):
            task = next((t for t, c in available.items() if c is item), None)
            out.append((task or task_of(item), item))
        elif item in available:
            out.append((item, available[item]))
        elif item in by_name:
            out.append(by_name[item])
        else:
            raise ValueError(f"{item!r} is not a head class of model_type {config.model_type!r}; its head classes "
                             f"(class name or task): {[f'{c.__name__} ({t})' for t, c in available.items()]}")
    return _one_case_per_class(out)


def verify_many(targets: Sequence[Target | str], tp_sizes: Sequence[int] = (2,), *, timeout_s: float = 1800.0,
                group_timeout_s: float = 120.0, progress=None,
                memory_limit_gib: float | None = RANK_MEMORY_LIMIT_GIB) -> VerifyReport:
    """Verify several targets, every head class of each, in one spawned job per tp size.

    Each job starts ``tp`` ranks (``python -c`` subprocesses, :mod:`tpify.authoring.launcher`;
    gloo over localhost, ``GLOO_SOCKET_IFNAME=lo``, rendezvous at a ``TCPStore`` on a free port
    served by this process; one thread per rank) that run
    :func:`~tpify.authoring.checks.check_case` for every (target, head class) in turn; rank 0's
    rows come back as each case ends. Jobs run one after another. A target
    whose config cannot be resolved or shrunk, whose recipe is missing or malformed, or whose
    head class is unknown gives a failed ``setup`` row (no ranks are spawned for it); a job that
    crashes or passes ``timeout_s`` gives a failed ``job`` row for each case that did not report.

    Args:
        targets: :class:`Target`\\ s, or strings (a model_type or a directory: every head class).
        tp_sizes: the tp sizes; the small config is made per tp size (:func:`small_config`).
        timeout_s: the deadline of one job.
        group_timeout_s: the gloo timeout of each case's collectives (a case stuck in a
            collective fails after this long).
        progress: ``progress(case, rows, seconds)`` called in this process as each case reports.
        memory_limit_gib: each rank's address-space limit (``RLIMIT_AS``, where the platform
            enforces it; default :data:`RANK_MEMORY_LIMIT_GIB`), so that a model or a forward
            larger than expected fails its step with a memory error row instead of exhausting
            the machine; None: no limit.
    """
    start = time.perf_counter()
    report = VerifyReport()
    specs = [t if isinstance(t, Target) else Target(t) for t in targets]
    for tp in tp_sizes:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tpify.authoring.verify: tp sizes must be positive integers, got {tp!r}")
        cases: list[_Case] = []
        for spec in specs:
            planned, failed = _plan_cases(spec, tp)
            cases.extend(planned)
            report.rows.extend(failed)
        if not cases:
            continue
        job_start = time.perf_counter()
        rows, seconds, error = run_job(cases, tp, timeout_s, group_timeout_s, progress, memory_limit_gib)
        report.job_seconds[tp] = time.perf_counter() - job_start
        for case, case_rows, secs in zip(cases, rows, seconds):
            if case_rows is None:
                report.rows.append(Row(case.label, case.cls.__name__, tp, "job", None, "-", False,
                                       error or "the ranks ended without reporting this case"))
            else:
                report.rows.extend(case_rows)
                report.case_seconds[(case.label, case.cls.__name__, tp)] = secs
    report.seconds = time.perf_counter() - start
    return report


def verify(target: str, recipe=None, tp_sizes: Sequence[int] = (2,), head_classes: Sequence | None = None, *,
           shrink: bool | None = None, timeout_s: float = 1800.0, progress=None, max_elements: int | None = None,
           memory_limit_gib: float | None = RANK_MEMORY_LIMIT_GIB, expert_parallel: bool = False) -> VerifyReport:
    """Verify one recipe on one target: every head class (or ``head_classes``) at every tp size.

    ``target`` is a ``model_type`` (the family's default config, made small by
    :func:`small_config`) or a directory holding a ``config.json`` (used as it is unless
    ``shrink=True``; random weights, the checkpoint's are not read). ``recipe`` defaults to the
    shipped recipe of the config's ``model_type``. One spawned job per tp size runs every head
    class (:func:`verify_many`); rank 0's :class:`Row`\\ s are returned in a
    :class:`VerifyReport` (``report.ok``, ``report.format_table()``). ``max_elements`` bounds
    what is built (:func:`check_build_size`; default :data:`MAX_SMALL_ELEMENTS` for a config
    made small, none for one used as it is), ``memory_limit_gib`` each rank's address space
    (:func:`verify_many`). ``expert_parallel``: the fused MoE experts whole per rank
    (``parallelize(..., ep_size=tp)``) instead of split by their intermediate dimension.

    Raises:
        tpify.authoring.target.TargetError: the target is neither a model_type nor a config directory.
        RecipeError: the recipe is missing or malformed.
        ShrinkError: the family's config cannot be made small, or a head class built from it
            would have more than ``max_elements`` parameter and buffer elements (checked on the
            meta device, nothing is built).
        ValueError: a head class that is not the family's, or none that verify can feed; a tp
            size that is not a positive integer.
        PlanError: the recipe does not split a head class at a tp size (heads, KV heads or
            features it does not divide), planned on the meta device before any rank starts.
    """
    spec = Target(str(target), recipe, head_classes, shrink=shrink, max_elements=max_elements,
                  expert_parallel=expert_parallel)
    if spec.shrink is None:
        spec.shrink = not Path(str(target)).is_dir()
    _, _, fed, unfed = _prepare(spec, tp_sizes)  # errors about the target itself are raised, not reported
    if not fed:
        raise ValueError("; ".join(_unfed_message(cls) for _, cls in unfed) or
                         f"not verified: no model class of transformers is built from {target!r}'s config")
    _check_plans(spec, tp_sizes)  # a tp size the model cannot be split at: one error, before any rank starts
    return verify_many([spec], tp_sizes, timeout_s=timeout_s, progress=progress, memory_limit_gib=memory_limit_gib)


def _check_plans(spec: Target, tp_sizes: Sequence[int]) -> None:
    """Plan every head class verify would run at every tp size, on the meta device, as
    ``parallelize`` will on the ranks (the recipe, the config made small for that tp size):
    raise the :class:`~tpify.layout.PlanError` the ranks would raise (a tp size that does not
    divide the heads, KV heads or features) before any rank starts: the first refused case's
    message, then the other refused cases by name.
    Anything else the meta build or the plan raises is left to the ranks' rows."""
    import warnings

    import torch

    from ..api import resolve_recipe
    from ..layout import PlanError, build_layout
    from .plan import _meta_model

    refused: list[tuple[str, str]] = []  # (where, message)
    for tp in tp_sizes:
        try:
            config, recipe, fed, _ = _prepare(spec, (tp,))
        except Exception:  # noqa: BLE001 - reported by verify_many as a setup row
            continue
        for task, cls in fed:
            try:
                with warnings.catch_warnings():  # a family without a shipped recipe: the ranks give its notice
                    warnings.simplefilter("ignore")
                    model = _meta_model(case_config(config, task, config.model_type), cls, torch.float32)
                    build_layout(model, resolve_recipe(model, recipe), tp, ep_size=tp if spec.expert_parallel else 1)
            except PlanError as e:
                refused.append((f"{cls.__name__} at tp = {tp}", str(e)))
            except Exception:  # noqa: BLE001 - the ranks report it in the case's rows
                continue
    if refused:  # the first in full; the others (the same heads in other classes, mostly) by name
        others = f"\n(refused alike: {'; '.join(w for w, _ in refused[1:])})" if len(refused) > 1 else ""
        raise PlanError(refused[0][1] + others)
