"""Checks of the ``tpify`` command's arguments, one for the parser and for Python: numbers, output paths.

A :class:`Limit` describes a numeric option's values (an integer or a finite number, its bounds,
whether ``None`` is allowed). :func:`flag` turns one into an argparse ``type``, so a bad flag is a
usage error at parse time (exit status 2, naming the flag, the value and the range, before any
rank starts); :func:`check` gives the message the Python entry points raise as a ``ValueError``
for the same value (:class:`tpify.cli.finetune.FinetuneConfig`). Both call :meth:`Limit.allows`.

:func:`output_problem` says why an output path (``--out``) cannot be written before any work is
done: a parent folder that is a file, a file where a directory is wanted, or the reverse.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limit", "POSITIVE_INT", "NON_NEGATIVE_INT", "check", "flag", "tp_list", "output_problem"]


@dataclass(frozen=True)
class Limit:
    """The values of one numeric option.

    Attributes:
        integer: an ``int`` (``bool`` is not one); else a finite ``int`` or ``float``.
        low: the smallest value allowed (itself excluded when ``above``), or None.
        high: the value every allowed value is below, or None.
        none: ``None`` is allowed too (a default decided later).
        note: why, or what a boundary value means; appended to the error.
    """

    integer: bool = True
    low: float | None = None
    above: bool = False
    high: float | None = None
    none: bool = False
    note: str = ""

    def describe(self) -> str:
        """``"an integer >= 1"``, ``"a finite number > 0"``, ...: what the error says is allowed."""
        text = "an integer" if self.integer else "a finite number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.above else '>='} {self.low:g}")
        if self.high is not None:
            big = isinstance(self.high, int) and self.high >= 2**16 and self.high & (self.high - 1) == 0
            bounds.append(f"< 2**{self.high.bit_length() - 1}" if big else f"< {self.high:g}")
        return text + (" " + " and ".join(bounds) if bounds else "") + (" (or unset)" if self.none else "")

    def allows(self, value) -> bool:
        """Whether ``value`` is one of the option's values (the one check behind both errors)."""
        if value is None:
            return self.none
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value < self.high

    def _suffix(self) -> str:
        return f" ({self.note})" if self.note else ""


POSITIVE_INT = Limit(low=1)
NON_NEGATIVE_INT = Limit(low=0)


def check(name: str, value, limit: Limit) -> str | None:
    """The problem with ``value`` for option ``name`` (``"seq_len must be an integer >= 2, got 0
    (...)"``), or None when ``limit`` allows it."""
    if limit.allows(value):
        return None
    return f"{name} must be {limit.describe()}, got {value!r}{limit._suffix()}"


def flag(limit: Limit):
    """An argparse ``type`` that parses a flag's text and checks it against ``limit``.

    argparse prints the error as ``tpify ...: error: argument --seq-len: must be an integer >= 2,
    got 0 (...)`` and exits with status 2.
    """
    def parse(text: str):
        try:
            value = int(text) if limit.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {limit.describe()}, got {text!r}") from None
        if not limit.allows(value):
            raise argparse.ArgumentTypeError(f"must be {limit.describe()}, got {text}{limit._suffix()}")
        return value

    parse.__name__ = "integer" if limit.integer else "number"
    parse.limit = limit
    return parse


def tp_list(text: str) -> list[int]:
    """An argparse ``type`` for a comma-separated list of tp sizes (``2,4``), each an integer >= 1."""
    try:
        sizes = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        sizes = []
    if not sizes or not all(POSITIVE_INT.allows(s) for s in sizes):
        raise argparse.ArgumentTypeError(f"takes integers >= 1 separated by commas (e.g. 2,4), got {text!r}")
    return sizes


def output_problem(path: str | os.PathLike, kind: str, flag_name: str = "--out") -> str | None:
    """Why ``path`` cannot be written as a ``kind`` (``"file"`` or ``"directory"``), or None.

    Looks, without writing, at ``path`` and its nearest existing ancestor: a ``path`` of the
    other kind, an ancestor that is not a directory (``notes.txt/recipe.toml`` with
    ``notes.txt`` a file), or an ancestor this process cannot write into. The message names the
    path, what is wrong and the fix, on one line.
    """
    path = Path(path)
    if path.exists():
        if kind == "file" and path.is_dir():
            return f"{flag_name} {path} is a directory; pass the path of a file to write"
        if kind == "directory" and not path.is_dir():
            return f"{flag_name} {path} is a file, not a directory; pass a directory (it is created if missing)"
        return None
    for parent in path.absolute().parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            return (f"{flag_name} {path} cannot be created: {parent} is a file, not a directory; pass a path whose "
                    f"parent folders are directories or do not exist yet")
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{flag_name} {path} cannot be created: no permission to write in {parent}; pass another path"
        return None
    return None
