"""Host syncs: the operations that make the host wait for the device, and a counter for them.

A CUDA host queues kernels ahead of the device; an operation whose result the host needs now
(a value read with ``.item()``, ``bool(t)``, ``float(t)``; an output whose size depends on the
values, as ``nonzero``, boolean indexing, ``bincount``, ``repeat_interleave`` without
``output_size``; ``torch.equal``) waits until the device has run everything queued before it,
and the device idles while the host catches up. A training step without any lets the host
queue the next step while the device runs this one.

:func:`count_host_syncs` counts them on any device, CPU included, with ``torch.profiler``: on a
CPU every ``.item()`` still runs ``aten::_local_scalar_dense``, so a test on CPU ranks counts
what a GPU step would sync on. What it cannot see on a CPU: a copy between the host and the
device (``.cpu()``, ``.tolist()``, ``torch.tensor(data, device="cuda")``), which is a plain host
copy there; tpify's step makes none except the one it marks (:func:`host_sync`). On a GPU,
``torch.cuda.set_sync_debug_mode("warn")`` reports those too.

This module imports nothing from tpify (the benchmarks load it by path to count an older tree).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

__all__ = ["SYNC_OPS", "MARK", "OPTIMIZER", "count_host_syncs", "host_sync"]

#: Profiler op names that make the host wait for the device (a value read, or an output whose
#: shape depends on the values). ``aten::_local_scalar_dense`` is what ``.item()``, ``bool()``,
#: ``float()``, ``int()`` and ``aten::is_nonzero`` end in, and what ``repeat_interleave`` with
#: tensor repeats and no ``output_size`` calls.
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique",
            "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::equal")
#: The prefix of the profiler range :func:`host_sync` opens around a sync tpify makes on purpose.
MARK = "tpify.host_sync: "
#: The key under which :func:`count_host_syncs` reports the optimizer's own reads.
OPTIMIZER = "optimizer step counters"


@contextlib.contextmanager
def host_sync(reason: str) -> Iterator[None]:
    """Mark a host sync tpify makes on purpose (a value the host must have now, e.g. the split
    sizes of an all-to-all): a profiler range named ``MARK + reason``, which :func:`count_host_syncs`
    counts once, whatever the ops inside it (a ``.tolist()`` of a device tensor is a device-to-host
    copy, invisible on a CPU otherwise)."""
    with torch.profiler.record_function(MARK + reason):
        yield


def _ancestors(event) -> Iterator:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Count the host syncs of the code run inside the ``with`` block (every thread, backward
    included), with ``torch.profiler`` on the CPU activity.

    Yields a :class:`collections.Counter`, filled when the block ends: per op name of
    :data:`SYNC_OPS` (the outermost one: an ``.item()`` inside ``bincount`` counts once), per
    marked range (:func:`host_sync`, its name), and ``"total"``, their sum. Reads inside
    ``Optimizer.step`` are counted apart, under :data:`OPTIMIZER`, and not in the total: torch's
    optimizers keep their step counters on the host (``capturable=False``, the default: a read
    of host memory, not a sync, on a GPU) or, fused on a GPU, on the device, read by the kernel;
    on a CPU, the fused kernel and ``foreach`` both read them with ``.item()``.
    """
    from torch.profiler import ProfilerActivity, profile

    counts: Counter = Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    for event in prof.events():
        name = event.name
        if name.startswith(MARK):
            if not any(a.name.startswith(MARK) for a in _ancestors(event)):
                counts[name] += 1
            continue
        if name not in SYNC_OPS:
            continue
        above = [a.name for a in _ancestors(event)]
        if any(a in SYNC_OPS or a.startswith(MARK) for a in above):
            continue  # inside a counted op or a marked sync: counted there
        if any(a.startswith("Optimizer.step#") for a in above):
            counts[OPTIMIZER] += 1
            continue
        counts[name] += 1
    counts["total"] = sum(v for k, v in counts.items() if k != OPTIMIZER)
