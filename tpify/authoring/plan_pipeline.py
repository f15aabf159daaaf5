"""``tpify plan --pp``: the pipeline stages of a model at pp x tp, without running it (:func:`pipeline_report`).

On the meta device, as :func:`tpify.authoring.plan.plan_report`: the recipe's layout at ``tp_size``
sizes each parameter per TP rank (:mod:`tpify.styles`), the pipeline plan
(:func:`tpify.pipeline.pipeline_plan`: the recipe's ``[pipeline]`` table or transformers'
``base_model_pp_plan``) and :func:`tpify.pipeline.layer_ranges` cut the layers into stages, and
:func:`tpify.pipeline.plan.stage_indices` places the stages on the pipeline ranks (Narayanan et al.,
arXiv:2104.04473, section 2.2), as :func:`tpify.pipeline.split_model` does. Per pipeline rank: its
stages, their layers, the first / last stage's modules it holds (embeddings, final norm, head) and
its parameter bytes per TP rank. A tied head is held by the first and the last stage alike (each
keeps a copy; their gradients are summed), so it counts on both.
"""

from __future__ import annotations

import math

from ..api import resolve_recipe
from ..hf_modules import base_model_and_prefix
from ..layout import build_layout
from ..pipeline.plan import layer_ranges, pipeline_plan, stage_indices
from ..pipeline.schedule import SCHEDULES, default_n_virtual, stage_style
from .plan import _dtype_of, _head_class, _meta_model, _module_rows, _Params
from .target import resolve_config

__all__ = ["pipeline_report", "render_pipeline", "PP_SCHEDULES"]

#: schedule -> stages per pipeline rank (tpify.pipeline.pipeline's default n_virtual).
PP_SCHEDULES = {name: default_n_virtual(name) for name in SCHEDULES}


def _place(fqn: str, prefix: str, plan, n_layers: int):
    """Where module ``fqn`` lives: ``("layer", i)``, ``("first", name)``, ``("last", name)`` or
    ``("every", None)`` (held by every stage: the base model's other modules, e.g. rotary)."""
    parts = fqn.split(".") if fqn else []
    if parts and parts[0] == plan.head and prefix != plan.head:
        return "last", plan.head
    rel = parts[len(prefix.split(".")):] if prefix and parts[:len(prefix.split("."))] == prefix.split(".") else parts
    lp = plan.layers.split(".")
    if rel[:len(lp)] == lp and len(rel) > len(lp) and rel[len(lp)].isdigit() and int(rel[len(lp)]) < n_layers:
        return "layer", int(rel[len(lp)])
    for side in ("first", "last"):
        for name in getattr(plan, side):
            if rel[:len(name.split("."))] == name.split("."):
                return side, name
    return "every", None


def pipeline_report(target: str, tp_size: int, pp_size: int, recipe=None, head_class: str | None = None,
                    schedule: str = "1F1B", split_points: list[int] | None = None) -> dict:
    """The stages of ``target`` at ``pp_size`` x ``tp_size``, as JSON-able data.

    Returns:
        ``{"target", "model_type", "head_class", "tp_size", "pp_size", "schedule", "n_virtual",
        "plan_source", "dtype", "dense_bytes", "ranks": [{"pp_rank", "stages": [{"stage",
        "layers": [first, last], "modules": [...]}], "rank_bytes", "ratio"}]}``: ``rank_bytes``
        the parameters of one TP rank of that pipeline rank (rank 0's where a split is uneven),
        ``ratio`` that over ``dense_bytes`` (the dense model's, tied parameters once). No
        collective; nothing is downloaded or allocated.

    Raises:
        tpify.pipeline.PipelineError: no pipeline plan (naming the recipe key), more stages than
            layers, bad split points.
        ValueError: an unknown schedule.
        and those of :func:`tpify.authoring.plan.plan_report`.
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: use one of {sorted(PP_SCHEDULES)}")
    config = resolve_config(target)
    cls = _head_class(config, head_class or "causal-lm")
    dtype, _ = _dtype_of(config)
    model = _meta_model(config, cls, dtype)
    layout = build_layout(model, resolve_recipe(model, recipe), tp_size)
    params = _Params.of(model)
    _module_rows(model, layout, tp_size, params)  # fills params.shapes: each parameter's per-rank shape
    plan = pipeline_plan(model, layout.recipe)
    base, prefix = base_model_and_prefix(model)
    n_layers = len(getattr(base, plan.layers))
    n_virtual = PP_SCHEDULES[schedule]
    ranges = layer_ranges(n_layers, pp_size * n_virtual, split_points)
    places = {pid: [_place(m, prefix, plan, n_layers) for m, _ in holders] for pid, holders in params.holders.items()}

    def nbytes(pid: int, rank: bool) -> int:
        p = params.unique[pid]
        dense, per_rank, _, _ = params.shapes.get(pid, (tuple(p.shape), tuple(p.shape), False, None))
        return math.prod(per_rank if rank else dense) * p.element_size()

    dense_bytes = sum(nbytes(pid, False) for pid in params.unique)
    ranks = []
    for r in range(pp_size):
        mine = stage_indices(r, pp_size, n_virtual, stage_style(schedule))
        layers = {i for s in mine for i in ranges[s]}
        first, last = 0 in mine, len(ranges) - 1 in mine

        def held(place) -> bool:
            kind, key = place
            return (kind == "every" or (kind == "layer" and key in layers) or (kind == "first" and first)
                    or (kind == "last" and last))

        rank_bytes = sum(nbytes(pid, True) for pid, where in places.items() if any(held(w) for w in where))
        stages = []
        for s in mine:
            modules = [*(f"{prefix}.{n}" if prefix else n for n in plan.first)] if s == 0 else []
            if s == len(ranges) - 1:
                modules += [*(f"{prefix}.{n}" if prefix else n for n in plan.last), plan.head]
            stages.append({"stage": s, "layers": [ranges[s].start, ranges[s].stop - 1], "modules": modules})
        ranks.append({"pp_rank": r, "stages": stages, "rank_bytes": rank_bytes, "ratio": rank_bytes / dense_bytes})
    return {"target": str(target), "model_type": config.model_type, "head_class": cls.__name__, "tp_size": tp_size,
            "pp_size": pp_size, "schedule": schedule, "n_virtual": n_virtual, "plan_source": plan.source,
            "dtype": str(dtype).removeprefix("torch."), "dense_bytes": dense_bytes, "n_layers": n_layers,
            "ranks": ranks}


def render_pipeline(report: dict) -> str:
    """``tpify plan --pp``'s plain-text table of :func:`pipeline_report`'s data."""
    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    lines = [f"{report['target']} ({report['model_type']}, {report['head_class']}): {report['n_layers']} layers in "
             f"{report['pp_size'] * report['n_virtual']} stages on pp {report['pp_size']} x tp {report['tp_size']} "
             f"({report['schedule']}), {report['dtype']}",
             f"cut by {report['plan_source']}",
             f"dense parameters: {mib(report['dense_bytes'])}; dense / (pp tp) = "
             f"{mib(report['dense_bytes'] / (report['pp_size'] * report['tp_size']))}",
             "",
             f"{'pp rank':>7}  {'stage':>5}  {'layers':>9}  {'bytes per tp rank':>18}  {'x dense':>7}  modules"]
    for row in report["ranks"]:
        for k, st in enumerate(row["stages"]):
            a, b = st["layers"]
            money = (f"{mib(row['rank_bytes']):>18}  {row['ratio']:>7.3f}" if k == 0 else f"{'':>18}  {'':>7}")
            lines.append(f"{row['pp_rank']:>7}  {st['stage']:>5}  {f'{a}..{b}':>9}  {money}  "
                         f"{', '.join(st['modules']) or '-'}")
    lines.append("")
    lines.append("bytes: one tp rank's parameters (tp rank 0's where a split is uneven); a tied head is a copy on the "
                 "last stage's rank (one parameter where that rank holds the first stage too: the V placement). Gradients take them again, AdamW's state twice.")
    return "\n".join(lines) + "\n"
