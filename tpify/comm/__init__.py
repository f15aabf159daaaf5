"""Communication for tensor parallelism: the only package of tpify that issues collectives.

One job per module, imported one way (``counting``, ``groups`` -> ``collectives`` -> ``regions``,
``rows``; ``deferred`` -> ``inputs``); every public name is also here, as ``tpify.comm.<name>``:

* :mod:`~tpify.comm.groups`: size, rank and backends of a process group; copies share groups;
* :mod:`~tpify.comm.counting`: :func:`count_collectives`, what a step really issues, for tests;
* :mod:`~tpify.comm.collectives`: the raw collectives, no autograd rule;
* :mod:`~tpify.comm.regions`: Megatron-LM's region operators and the sequence-parallel ones;
* :mod:`~tpify.comm.rows`: expert parallelism's token rows;
* :mod:`~tpify.comm.ring`: ring attention's P2P shift to the next rank of a group;
* :mod:`~tpify.comm.ulysses`: the all-to-all between a sequence split and a head split;
* :mod:`~tpify.comm.deferred`: a call's data checks read by the host one call later;
* :mod:`~tpify.comm.inputs`: the check that the ranks of a TP group were given one batch.

The protocols that make every rank learn whether every rank succeeded are in :mod:`tpify.agree`.

| operator (Megatron-LM, arXiv:1909.08053, s. 3) | forward                       | backward                       |
| ---------------------------------------------- | ----------------------------- | ------------------------------ |
| ``copy_to_tp_region`` (``f``)                  | identity                      | all-reduce (sum)               |
| ``reduce_from_tp_region`` (``g``)              | all-reduce (sum)              | identity                       |
| ``scatter_to_tp_region``                       | keep chunk r of the last dim  | all-gather the last dim        |
| ``gather_from_tp_region``                      | all-gather the last dim       | keep chunk r                   |
| ``sum_grad_ranges``                            | identity                      | all-reduce of given slices     |
| sequence parallelism (arXiv:2205.05198)        |                               |                                |
| ``scatter_to_sequence_region``                 | keep chunk r of ``T``         | all-gather ``T``               |
| ``gather_from_sequence_region``                | all-gather ``T``              | reduce-scatter ``T`` (or split)|
| ``reduce_scatter_to_sequence_region``          | reduce-scatter ``T``          | all-gather ``T``               |
| expert parallelism (rows ``N`` of ``(N, H)``)  |                               |                                |
| ``scatter_rows``                               | keep rows ``[rN/p, (r+1)N/p)``| all-gather the rows            |
| ``gather_rows``                                | all-gather the rows           | keep this rank's rows          |
| ``all_to_all_rows``                            | rows of given sizes to rank j | the reverse exchange           |
| context parallelism                            |                               |                                |
| ``all_to_all_dims`` (Ulysses)                  | split dim a, gather dim b     | the reverse all-to-all         |
| ``ring_shift_start`` (no autograd)             | send to r+1, receive from r-1 |                                |

With a one-rank group (or ``group=None`` and no process group) every operator is the identity
and issues nothing, so a ``tp_size == 1`` model runs without ``torch.distributed``.
"""

from .collectives import (PendingGather, all_gather_dim, all_gather_dim_async, all_gather_last_dim, all_gather_objects,
                          all_reduce, all_reduce_async, all_to_all_counts, barrier, reduce_scatter_dim_async)
from .counting import count_collectives
from .deferred import FOUND_LATE, DeferredChecks, HostCopy, raise_unless
from .groups import SharesProcessGroups, backend_map, collective_device, group_rank, group_size
from .inputs import (CheckedInputs, check_same_inputs, checksum, different_layouts_message, different_values_message,
                     inputs_checksum, layout_code)
from .regions import (copy_many_to_tp_region, copy_to_tp_region, gather_from_sequence_region, gather_from_tp_region,
                      grad_reduce_dtype, reduce_from_tp_region, reduce_scatter_to_sequence_region,
                      scatter_to_sequence_region, scatter_to_tp_region, sum_grad_ranges)
from .ring import RingShift, ring_shift_start
from .rows import all_to_all_rows, gather_rows, row_range, scatter_rows
from .ulysses import all_to_all_dims

__all__ = [
    "group_size", "group_rank", "backend_map", "collective_device", "SharesProcessGroups",
    "count_collectives",
    "all_reduce", "all_reduce_async", "all_gather_dim", "all_gather_dim_async", "PendingGather", "all_gather_last_dim",
    "reduce_scatter_dim_async", "all_to_all_counts", "barrier", "all_gather_objects",
    "grad_reduce_dtype", "copy_to_tp_region", "copy_many_to_tp_region", "reduce_from_tp_region",
    "scatter_to_tp_region", "gather_from_tp_region", "sum_grad_ranges", "scatter_to_sequence_region",
    "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
    "row_range", "scatter_rows", "gather_rows", "all_to_all_rows", "RingShift", "ring_shift_start", "all_to_all_dims",
    "FOUND_LATE", "HostCopy", "DeferredChecks", "raise_unless",
    "checksum", "layout_code", "inputs_checksum", "check_same_inputs", "CheckedInputs", "different_layouts_message",
    "different_values_message",
]
