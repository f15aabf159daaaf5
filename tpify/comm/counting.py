"""Counting the collectives tpify issues (:func:`count_collectives`), for tests and benchmarks.

The counters are process-global on purpose: the collectives are issued by layers, hooks and
losses that are handed no counter, and a test or benchmark counts whatever one step issues
across all of them (as torch's ``CommDebugMode`` does with a dispatch mode). Only an open
``with count_collectives()`` block holds a counter; none is kept outside one.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

__all__ = ["count_collectives"]


_counters: list[tuple[Counter, bool]] = []


def record(op: str, tensor: torch.Tensor) -> None:
    """Count one ``op`` of ``tensor.numel()`` values in every open :func:`count_collectives` block
    (and per dtype in those that asked, ``by_dtype``)."""
    for counter, by_dtype in _counters:
        counter[op] += 1
        counter[op + "_numel"] += tensor.numel()
        if by_dtype:
            counter[f"{op}_numel:{str(tensor.dtype).removeprefix('torch.')}"] += tensor.numel()


@contextlib.contextmanager
def count_collectives(by_dtype: bool = False) -> Iterator[Counter]:
    """Count the collectives tpify issues inside the ``with`` block.

    Yields a :class:`collections.Counter` with, per operation (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``barrier``, ``all_gather_object``), the
    number of calls and, under ``"<op>_numel"``, the total
    number of elements communicated. With ``by_dtype`` the elements are also counted per dtype
    they travel in, under ``"<op>_numel:<dtype>"`` (``"all_reduce_numel:bfloat16"``): what the
    tests of the reductions' precision read. Backward passes run inside the block are counted too.
    Operators on a one-rank group issue nothing and count nothing.
    """
    counter: Counter = Counter()
    entry = (counter, by_dtype)
    _counters.append(entry)
    try:
        yield counter
    finally:  # by identity: nested blocks may hold equal counts
        del _counters[next(i for i, e in enumerate(_counters) if e is entry)]
