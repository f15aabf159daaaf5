"""``tpify verify MODEL_TYPE_OR_DIR [--recipe FILE] [--tp 2,4] [--head-class ...] [--ep]``: prove a recipe exact.

Runs :func:`tpify.authoring.verify.verify` on this machine's CPU: for every head class of the family (or
those named) and every tp size, a small random float64 model (the tensors its init leaves
constant, zero biases and unit norms, given seeded noise) against ``tpify.parallelize`` of a
copy on gloo ranks it launches itself (no torchrun). Prints one row per comparison (outputs
with a padding mask, the ``labels=`` loss, every gathered gradient, greedy ``generate``, a
save/load round trip) with the largest difference and pass/fail, then the time it took. Where
a family's kernels refuse float64 the case runs in float32 and its rows say so, with their
tolerance; a ``dense reference: ...`` row states such a choice and why, and how many
constant tensors were perturbed. Exit status: 0 when
every check passed, 1 when one failed (the last line says whether the parallel model differs
or the dense reference itself could not be computed), 2 when the target, recipe or arguments
are unusable (a config that cannot be made small enough included).
"""

from __future__ import annotations

import argparse
import sys
import time

from .checks import Limit, flag, tp_list
from .text import plain

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``tpify verify`` on the ``tpify`` command's subparsers."""
    p = sub.add_parser("verify", help="prove a recipe exact: tensor-parallel vs dense in float64, every head class",
                       description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="MODEL_TYPE_OR_DIR",
                   help="a transformers model_type (its default config, made small) or a directory with a config.json")
    p.add_argument("--recipe", default=None, help="recipe .toml file (default: the shipped recipe of the model_type)")
    p.add_argument("--tp", type=tp_list, default=[2], help="tp sizes, comma-separated (default 2)")
    p.add_argument("--head-class", action="append", default=None, dest="head_classes", metavar="NAME",
                   help="a head class name or task (causal-lm, masked-lm, ...); repeat or comma-separate "
                        "(default: every head class of the family)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", dest="shrink", action="store_true", default=None,
                      help="make a directory target's config small too (2 layers, 4 heads, vocabulary 101)")
    size.add_argument("--full", dest="shrink", action="store_false",
                      help="use a model_type's default config at full size (slow)")
    p.add_argument("--timeout", type=flag(Limit(integer=False, low=0, above=True)), default=1800.0,
                   help="seconds one tp size may take (default 1800)")
    p.add_argument("--max-elements", type=flag(Limit(low=1)), default=None, metavar="N",
                   help="refuse a head class whose model has more parameter and buffer elements (counted on the "
                        "meta device before anything is built; default 2,000,000 for a config made small, no bound "
                        "for one used as it is)")
    p.add_argument("--memory-limit", type=flag(Limit(integer=False, low=0)), default=None, metavar="GIB",
                   help="address-space limit of each rank in GiB, 0 for none (default 4; none with --full)")
    p.add_argument("--ep", action="store_true", dest="expert_parallel",
                   help="expert parallelism: the fused MoE experts whole per rank (ep_size = tp), the tokens "
                        "exchanged with all-to-all (default: every expert's intermediate dimension split)")
    p.add_argument("--failures-only", action="store_true", help="print only the rows that failed")
    p.set_defaults(worker=run, in_process=True)
    return p


def run(args) -> int:
    """Run ``tpify verify`` in this process (it launches its ranks itself); the exit status."""
    from ..authoring.compare import TOLERANCE
    from ..authoring.small import RANK_MEMORY_LIMIT_GIB, ShrinkError
    from ..authoring.target import TargetError
    from ..authoring.verify import verify
    from ..recipe import RecipeError

    start = time.perf_counter()
    heads = None
    if args.head_classes:
        heads = [h for item in args.head_classes for h in item.split(",") if h]

    def progress(case, rows, seconds):
        bad = sum(not r.passed for r in rows)
        print(f"  {case.label} {case.cls.__name__} tp={rows[0].tp if rows else '?'}: "
              f"{'ok' if not bad else f'{bad} FAILED'} ({seconds:.1f} s)", flush=True)

    memory = args.memory_limit
    if memory is None:
        memory = None if args.shrink is False else RANK_MEMORY_LIMIT_GIB
    print(f"tpify verify {args.target}: tp {','.join(map(str, args.tp))}, float64 (float32 where the family's "
          f"kernels refuse float64), tolerance {TOLERANCE}", flush=True)
    try:
        report = verify(args.target, recipe=args.recipe, tp_sizes=args.tp, head_classes=heads, shrink=args.shrink,
                           timeout_s=args.timeout, progress=progress, max_elements=args.max_elements,
                           memory_limit_gib=memory or None, expert_parallel=args.expert_parallel)
    except (TargetError, RecipeError, ShrinkError, ValueError) as e:
        print(f"tpify verify: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print()
    print(report.format_table(failures_only=args.failures_only))
    failed = report.failures()
    heads_run = sorted({(r.head, r.tp) for r in report.rows})
    print()
    print(f"{len(report.rows)} checks over {len(heads_run)} head class x tp cases: "
          f"{len(report.rows) - len(failed)} passed, {len(failed)} failed; "
          f"{time.perf_counter() - start:.1f} s in all"
          + "".join(f"; tp={tp} job {s:.1f} s" for tp, s in sorted(report.job_seconds.items())))
    if failed:
        dense = report.dense_failures()
        if dense:
            print(f"FAIL: the dense reference itself could not be computed in {len(dense)} case(s) (not finite on "
                  f"every input tried, or it raised): nothing was compared there; see the 'dense reference' rows",
                  file=sys.stderr)
        if len(dense) < len(failed):
            print("FAIL: the parallel model differs from the dense one (or could not be built); see the rows above",
                  file=sys.stderr)
        return 1
    print("PASS: every check within tolerance")
    return 0
