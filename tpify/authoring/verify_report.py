"""What verify reports: one :class:`Row` per comparison, gathered in a :class:`VerifyReport`
(``report.ok``, ``report.failures()``, ``report.format_table()``), and the merge of the ranks'
rows of one case (:func:`merge_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Row", "VerifyReport", "DENSE_REFERENCE", "merge_rows"]

DENSE_REFERENCE = "dense reference"  # the check names of the reference's own rows start with it


@dataclass(frozen=True)
class Row:
    """One comparison of one head class at one tp size.

    Attributes:
        target: what was verified (a ``model_type``, a directory, or a label).
        head: the head class name (``GPT2LMHeadModel``), or ``"-"`` for the whole target.
        tp: the tp size.
        check: what was compared (``forward logits``, ``labels= loss``, ``gradients (29 tensors)``,
            ``generate``, ``save/load logits``, ...), or the step that raised.
        max_diff: the largest ``|parallel - dense|`` (for ``generate``: the number of differing
            token ids), or None when nothing was compared (an error).
        tolerance: the criterion, in words.
        passed: whether the criterion held.
        message: why it failed (the worst tensors, or the exception), empty when it passed.
    """

    target: str
    head: str
    tp: int
    check: str
    max_diff: float | None
    tolerance: str
    passed: bool
    message: str = ""


@dataclass
class VerifyReport:
    """What :func:`tpify.authoring.verify.verify` / :func:`~tpify.authoring.verify.verify_many` found.

    Attributes:
        rows: every :class:`Row`, in the order the cases ran (tp size, target, head class).
        seconds: wall time of the whole verification (spawning the ranks included).
        case_seconds: ``(target, head, tp) -> seconds`` one case took on rank 0.
        job_seconds: ``tp -> seconds`` of each spawned job (start-up of the ranks included).
    """

    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    case_seconds: dict[tuple[str, str, int], float] = field(default_factory=dict)
    job_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when there is at least one row and every row passed."""
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[Row]:
        """The rows that failed."""
        return [r for r in self.rows if not r.passed]

    def dense_failures(self) -> list[Row]:
        """The failed rows of the dense reference itself (``dense reference not finite``, or
        ``dense reference: raised``): nothing was compared in those cases, and the parallel
        model is not at fault."""
        return [r for r in self.failures() if r.check.startswith(DENSE_REFERENCE)]

    def target_seconds(self) -> dict[tuple[str, int], float]:
        """``(target, tp) -> seconds`` summed over the target's cases (rank 0, without start-up)."""
        out: dict[tuple[str, int], float] = {}
        for (target, _, tp), s in self.case_seconds.items():
            out[(target, tp)] = out.get((target, tp), 0.0) + s
        return out

    def format_table(self, failures_only: bool = False) -> str:
        """A plain-text table: target, head class, tp, check, max |difference|, tolerance, result."""
        rows = self.failures() if failures_only else self.rows
        header = ("target", "head class", "tp", "check", "max |diff|", "tolerance", "result")
        body = [(r.target, r.head, str(r.tp), r.check, "-" if r.max_diff is None else f"{r.max_diff:.2e}",
                 r.tolerance, "pass" if r.passed else "FAIL") for r in rows]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        for r, b in zip(rows, body):
            lines.append("  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip())
            if r.message:
                lines.extend("      " + m for m in r.message.splitlines()[:12])
        return "\n".join(lines)


def merge_rows(per_rank: list[list[Row]]) -> list[Row]:
    """Rank 0's rows, each failed where any rank failed it, with the largest difference of all."""
    merged: dict[str, Row] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            old = merged.get(row.check)
            if old is None:
                merged[row.check] = row
                continue
            diffs = [d for d in (old.max_diff, row.max_diff) if d is not None]
            message = old.message
            if not row.passed and row.message and row.message not in message:
                message = (message + "\n" if message else "") + f"rank {rank}: {row.message}"
            merged[row.check] = Row(old.target, old.head, old.tp, old.check, max(diffs) if diffs else None,
                                    old.tolerance, old.passed and row.passed, message)
    return list(merged.values())
