"""``tpify draft MODEL_TYPE_OR_DIR [--out FILE] [--head-class ...] [--method ...]``: a draft recipe.

Writes a commented TOML recipe to review (tpify/authoring/draft.py): from transformers' own tensor-parallel
plan when the family has one (imported by tpify/hf_plan/, every head class merged), else from
a data-flow trace of one forward of a small random model of the family. Each rule's comment says
what it is based on; the end of the file lists what to review. Then prove it exact with
``tpify verify MODEL_TYPE --recipe FILE --tp 2``. Runs in this process, on the CPU, no ranks;
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checks import output_problem
from .text import plain

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``tpify draft`` on the ``tpify`` command's subparsers (in-process, no torchrun)."""
    p = sub.add_parser("draft", help="write a draft recipe (from transformers' TP plan, or a trace) to review",
                       description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="MODEL_TYPE_OR_DIR",
                   help="a transformers model_type (its default config) or a directory with a config.json")
    p.add_argument("--out", default=None, help="write the draft to this file (default: print it)")
    p.add_argument("--head-class", action="append", default=None, dest="head_classes", metavar="NAME",
                   help="a head class name or task (causal-lm, masked-lm, base, ...); repeat or comma-separate "
                        "(default: every head class of the family)")
    p.add_argument("--method", choices=["auto", "hf-plan", "trace"], default="auto",
                   help="auto (default): transformers' plan when the family has one, else a trace")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(worker=run, in_process=True)
    return p


def run(args) -> int:
    """Run ``tpify draft``; the exit status: 0 when written, 1 with the error on stderr when no draft
    can be made (or ``--out`` exists without ``--force``), 2 when ``--out`` cannot be written (a
    parent that is a file, a directory, no permission), checked before drafting."""
    out = Path(args.out) if args.out else None
    problem = output_problem(out, "file") if out is not None else None
    if problem:
        print(f"tpify draft: error: {problem}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    from ..authoring.draft import DraftError, draft
    from ..authoring.target import TargetError
    from ..recipe import RecipeError

    hf_logging.set_verbosity_error()
    heads = None
    if args.head_classes:
        heads = [h.strip() for item in args.head_classes for h in item.split(",") if h.strip()]
    if out is not None and out.exists() and not args.force:
        print(f"tpify draft: {out} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    try:
        d = draft(args.target, heads, args.method)
        d.recipe()  # the draft parses as a recipe
    except (DraftError, RecipeError, TargetError) as e:
        print(f"tpify draft: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    text = d.toml()
    if out is None:
        print(text, end="")
    else:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except OSError as e:  # checked above; this is what changed since, or what no check foresees
            print(f"tpify draft: error: cannot write --out {out}: {e.strerror or e}; pass another path",
                  file=sys.stderr)
            return 2
        print(f"tpify draft: wrote {out} ({d.method}, {len(d.data['rule'])} rules, head classes "
              f"{', '.join(d.head_classes)}); review it, then: tpify verify {args.target} --recipe {out} --tp 2",
              file=sys.stderr)
    return 0
