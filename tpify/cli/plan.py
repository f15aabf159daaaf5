"""``tpify plan MODEL_TYPE_OR_DIR --tp N``: what a recipe does to a model, without running it.

The report itself is :func:`tpify.authoring.plan.plan_report` (JSON-able data, printed with
``--json``) and :func:`tpify.authoring.plan_text.render_text` (plain-text tables): built on the
meta device, in this process, no ranks.
"""

from __future__ import annotations

import json
import sys

from .options import PP_SCHEDULES

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Register ``tpify plan`` on the ``tpify`` parser's subparsers (runs in-process, no torchrun)."""
    plan = sub.add_parser("plan", help="report what a recipe does to a model at --tp (meta device, no ranks)",
                          description="What a recipe does to a model at --tp, without running it: per module the "
                                      "rule, style and per-rank shapes; parameter memory per rank; what is divided, "
                                      "unused and replicated; the LM head and loss. Built on the meta device: no "
                                      "process group, no weights.")
    plan.add_argument("target", metavar="MODEL_TYPE_OR_DIR",
                      help="a model_type (its default config) or a local directory with a config.json")
    from .checks import POSITIVE_INT, flag

    plan.add_argument("--tp", type=flag(POSITIVE_INT), required=True, help="tensor-parallel size to plan for")
    plan.add_argument("--recipe", default=None, help="recipe: a .toml file or a shipped recipe's model_type (default: the config's model_type)")
    plan.add_argument("--head-class", default=None,
                      help="head class name or task (causal-lm, masked-lm, base, ...; default: the masked LM, "
                           "else the causal LM, else the seq2seq LM, else the base model, else the one "
                           "class the config builds: a vision tower, a part of a composite)")
    plan.add_argument("--ep-size", type=flag(POSITIVE_INT), default=1,
                      help="expert parallelism: 1 (default, tensor-parallel experts) or the tp size (whole experts "
                           "per rank)")
    plan.add_argument("--quantize", choices=["nf4", "fp4"], default=None,
                      help="also report the bytes per rank of a QLoRA base: bitsandbytes 4-bit codes + absmax of "
                           "each quantized shard, what stays unquantized, and LoRA (--lora-r) beside")
    plan.add_argument("--lora-r", type=flag(POSITIVE_INT), default=8,
                      help="LoRA rank for the --quantize report (default 8, as tpify finetune)")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_pipeline_flags(plan)
    plan.set_defaults(worker=run, in_process=True)


def _add_pipeline_flags(plan) -> None:
    """``--pp N`` (and ``--pp-schedule``): the stages, their layers and modules, bytes per rank."""
    from .checks import POSITIVE_INT, flag

    plan.add_argument("--pp", type=flag(POSITIVE_INT), default=1,
                      help="pipeline stages: per stage its layers, the modules on it (embeddings, norm, head) and "
                           "the parameter bytes per rank at --tp (tpify.pipeline)")
    plan.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1F1B",
                      help="with --pp: the schedule (Interleaved1F1B, InterleavedZeroBubble: two stages per "
                           "pipeline rank; ZBVZeroBubble, DualPipeV: two, placed in a V)")


def _run_pipeline(args) -> int:
    """``tpify plan --pp``: print :func:`tpify.authoring.plan_pipeline.pipeline_report`."""
    from ..authoring.plan import PlanReportError
    from ..authoring.plan_pipeline import pipeline_report, render_pipeline
    from ..authoring.target import TargetError
    from ..layout import PlanError
    from ..pipeline.plan import PipelineError
    from ..recipe import RecipeError

    try:
        report = pipeline_report(args.target, args.tp, args.pp, args.recipe, args.head_class, args.pp_schedule)
    except (PlanError, RecipeError, TargetError, PlanReportError, PipelineError) as e:
        print(f"tpify plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else render_pipeline(report), end="" if not args.json else "\n")
    return 0


def run(args) -> int:
    """``tpify plan``: print the report; a recipe that does not fit prints the error and returns 1."""
    from ..authoring.plan import PlanReportError, plan_report
    from ..authoring.plan_text import render_text
    from ..authoring.target import TargetError
    from ..layout import PlanError
    from ..recipe import RecipeError

    if getattr(args, "pp", 1) > 1:
        return _run_pipeline(args)
    try:
        report = plan_report(args.target, args.tp, args.recipe, args.head_class, args.ep_size, args.quantize,
                             args.lora_r)
    except (PlanError, RecipeError, TargetError, PlanReportError, ImportError) as e:
        print(f"tpify plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else render_text(report), end="" if not args.json else "\n")
    return 0
