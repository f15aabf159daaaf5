"""Sweep ``tpify verify`` over every family transformers can split, at tp = 2.

The families: every ``model_type`` whose config class declares a tensor-parallel plan
(``base_model_tp_plan``) in the installed transformers, and every recipe tpify ships. Each is
verified as ``tpify verify MODEL_TYPE --tp 2`` does (:func:`tpify.authoring.verify.verify_many`:
the family's default config made small, every head class verify can feed (token ids; a part's
embeddings; a tower's pixels), a float64 dense reference against ``tpify.parallelize`` of a
copy) and comes out as one row:

* ``exact``: every check of every head class passed (outputs, loss, every gradient, generate,
  save/load), with every tensor the family's init leaves constant perturbed
  (:func:`tpify.authoring.reference.perturb_constants`; the row gives how many, the most of any
  head class);
* ``refused``: tpify refused the recipe before anything ran (a ``RecipeError`` / ``PlanError``
  naming the module and the reason, on every rank);
* ``cannot build``: verify could not build a small model, or the dense model itself fails
  (raises, or is not finite on any input), or verify can feed no head class (an audio tower);
  the reason is given;
* ``fails``: a step of the parallel model raised something other than a refusal;
* ``wrong``: the parallel model computed different numbers (the worst defect).

Bounds: batches of ``--batch`` families run in a worker subprocess (one spawned rank job per
batch, so the ranks start once per batch), each rank's address space limited to
``--memory-gib`` (an allocation past it fails that case with a memory error instead of
exhausting the machine), each family given ``--per-type-s`` seconds; a batch that passes its
time (or whose worker dies) is killed and each family it left unreported is run again alone,
then reported as ``cannot build`` with the bound it passed. Before any rank starts, every
model is counted on the meta device and refused above verify's 2M-element bound.

Writes ``benchmarks/out/sweep_verify.json`` (resumable: families already there are skipped unless
``--again``) and ``benchmarks/out/sweep_verify.md`` (the table; docs/families.md holds a copy).

Run: ``python benchmarks/sweep_verify.py`` (17 minutes for the 182 types of transformers 5.24 and
tpify's recipes on 2 shared CPU cores, 2026-11-27; ``--types llama,gemma2`` for a few,
``--again`` to redo them).
This is a measurement, not a test; docs/families.md holds the table and its reading.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"

_REFUSALS = ("RecipeError", "PlanError")
_ORDER = {"wrong": 0, "fails": 1, "cannot build": 2, "refused": 3, "exact": 4}
# The dense reference row's note of tpify.authoring.reference.perturb_constants: how many tensors.
_PERTURBED = re.compile(r"(\d+) tensors the family's init leaves constant")


def sweep_types() -> list[str]:
    """Every model_type with a TP plan on its config class, and every shipped recipe, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    from tpify.recipe import available_recipes

    found = set(available_recipes())
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a config class that cannot be imported here
            continue
        if getattr(cls, "base_model_tp_plan", None):
            found.add(model_type)
    return sorted(found)


def _first_line(text: str, limit: int = 300) -> str:
    """The most telling line of an error message, at most ``limit`` characters: the first line
    naming an exception, without the words every refusal of an imported plan repeats."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    telling = [i for i, ln in enumerate(lines) if re.search(r"\w(Error|Exception): ", ln)]
    at = telling[0] if telling else 0
    line = (lines or [""])[at].removeprefix("every rank: ")
    if line.endswith(":") and at + 1 < len(lines):  # a PlanError: its first problem on the next line
        line += " " + lines[at + 1]
    line = re.sub(r"cannot import transformers' tensor-parallel plan of \w+ \(model_type '[^']*'\): ", "", line)
    line = re.sub(r"\. Write a tpify recipe for it .*$", "", line)
    return line[:limit]


def classify(label: str, rows: list, seconds: float) -> dict:
    """One family's outcome from its verify rows (see the module docstring)."""
    heads: dict[str, list] = {}
    for r in rows:
        heads.setdefault(r.head, []).append(r)
    per_head = {}
    for head, hrows in heads.items():
        failed = [r for r in hrows if not r.passed]
        if not failed:
            per_head[head] = ("exact", "")
            continue
        r = failed[0]
        if r.check == "job":
            per_head[head] = ("cannot build", f"passed the sweep's time or memory bound: {_first_line(r.message)}")
        elif r.check == "setup" or r.check.startswith("dense reference"):
            per_head[head] = ("cannot build", f"{r.check}: {_first_line(r.message)}")
        elif r.check.endswith(": raised") and any(k in r.message for k in _REFUSALS):
            per_head[head] = ("refused", _first_line(r.message))
        elif r.check.endswith(": raised"):
            per_head[head] = ("fails", f"{r.check}: {_first_line(r.message)}")
        else:
            per_head[head] = ("wrong", f"{r.check}: max |diff| {r.max_diff:.3g} {_first_line(r.message, 200)}")
    outcome, reason = min(per_head.values(), key=lambda v: _ORDER[v[0]]) if per_head else ("cannot build", "no rows")
    compared = [r for r in rows if r.passed and r.max_diff is not None
                and r.tolerance not in ("bitwise", "identical", "exact", "-")]
    worst = max((r.max_diff for r in compared), default=None)
    dtype = "float32" if any(r.check.startswith("dense reference: float32") for r in rows) else "float64"
    stated = [r for r in rows if r.passed and r.check.startswith("dense reference: ")]
    notes = sorted({r.check.removeprefix("dense reference: ") for r in stated} - {"float64, left-padded batch"})
    perturbed = [int(m.group(1)) for r in stated for m in [_PERTURBED.search(r.message)] if m]
    return {"type": label, "outcome": outcome, "reason": reason, "max_diff": worst, "dtype": dtype,
            "heads": {h: v[0] for h, v in per_head.items()}, "notes": notes,
            "perturbed": max(perturbed) if perturbed else (0 if stated else None), "seconds": round(seconds, 1)}


def _worker(types: list[str], per_type_s: float, memory_gib: float, result: Path) -> None:
    """Verify ``types`` in one rank job; write each family's outcome to ``result`` (JSON lines)."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from tpify.authoring.verify import Target, verify_many

    cases: dict[str, float] = {}

    def progress(case, rows, seconds):
        cases[case.label] = cases.get(case.label, 0.0) + seconds

    report = verify_many([Target(t) for t in types], (2,), timeout_s=per_type_s * len(types), progress=progress,
                         memory_limit_gib=memory_gib)
    with result.open("a") as f:
        for t in types:
            rows = [r for r in report.rows if r.target == t]
            job_failed = [r for r in rows if r.check == "job"]
            if job_failed and len(job_failed) == len({r.head for r in rows}):
                continue  # nothing reported: the parent runs it again alone
            f.write(json.dumps(classify(t, rows, cases.get(t, 0.0))) + "\n")


def _run_batch(types: list[str], args, result: Path) -> None:
    """A worker subprocess for ``types``, killed after ``per_type_s`` per family (plus start-up)."""
    cmd = [sys.executable, __file__, "--worker", "--types", ",".join(types), "--per-type-s", str(args.per_type_s),
           "--memory-gib", str(args.memory_gib), "--result", str(result)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in sys.path if p]))
    try:
        subprocess.run(cmd, env=env, timeout=args.per_type_s * len(types) + 120, check=False,
                       stdout=subprocess.DEVNULL if not args.verbose else None, stderr=subprocess.STDOUT
                       if not args.verbose else None)
    except subprocess.TimeoutExpired:
        pass


def _load(path: Path) -> dict[str, dict]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[row["type"]] = row
    return out


def format_table(results: dict[str, dict]) -> str:
    """The markdown table: counts per outcome, then one row per family."""
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    lines = [f"{len(results)} families: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in sorted(_ORDER,
                                                                                                key=_ORDER.get)[::-1]),
             "", "| model_type | outcome | max diff | dtype | head classes | constants perturbed | reason / notes | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in sorted(results):
        r = results[t]
        diff = "-" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        heads = len(r["heads"]) if r["heads"] else 0
        text = r["reason"] or "; ".join(r["notes"])
        text = text.replace("|", "\\|").replace("\n", " ")
        perturbed = "-" if r.get("perturbed") is None else r["perturbed"]
        lines.append(f"| {t} | {r['outcome']} | {diff} | {r['dtype']} | {heads} | {perturbed} | {text[:240]} "
                     f"| {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default=None, help="comma-separated model types (default: every family, see above)")
    p.add_argument("--batch", type=int, default=6, help="families per rank job (default 6)")
    p.add_argument("--per-type-s", type=float, default=300.0, help="seconds each family may take (default 300)")
    p.add_argument("--memory-gib", type=float, default=4.0, help="address-space limit of each rank (default 4)")
    p.add_argument("--out", type=Path, default=OUT / "sweep_verify.json")
    p.add_argument("--again", action="store_true", help="verify families already in --out again")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        resource.setrlimit(resource.RLIMIT_AS, (int(8 * 2**30), resource.getrlimit(resource.RLIMIT_AS)[1]))
        _worker(args.types.split(","), args.per_type_s, args.memory_gib, args.result)
        return 0
    types = args.types.split(",") if args.types else sweep_types()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = _load(args.out)
    if args.again:
        done = {t: r for t, r in done.items() if t not in types}
        args.out.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    todo = [t for t in types if t not in done]
    start = time.perf_counter()
    print(f"sweep: {len(types)} families, {len(todo)} to verify, batches of {args.batch}", flush=True)
    for i in range(0, len(todo), args.batch):
        batch = todo[i:i + args.batch]
        t0 = time.perf_counter()
        _run_batch(batch, args, args.out)
        got = _load(args.out)
        for t in batch:
            if t not in got and len(batch) > 1:
                _run_batch([t], args, args.out)
        got = _load(args.out)
        for t in batch:
            if t not in got:
                row = {"type": t, "outcome": "cannot build", "reason": f"passed the sweep's bounds "
                       f"({args.per_type_s:.0f} s, {args.memory_gib:g} GiB per rank) or its worker died",
                       "max_diff": None, "dtype": "-", "heads": {}, "notes": [], "seconds": args.per_type_s}
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                got[t] = row
            print(f"  {t:40s} {got[t]['outcome']:13s} {got[t]['reason'][:110]}", flush=True)
        print(f"  batch {i // args.batch + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
    results = {t: r for t, r in _load(args.out).items() if t in types}
    table = format_table(results)
    (args.out.with_suffix(".md")).write_text(table)
    print(table.splitlines()[0], f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
