"""Communication primitives for tensor parallelism.

This is the only module of tpify that calls ``torch.distributed`` collectives. It holds the
four region operators of Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, figure 3),
each an autograd function over an explicit process group, the plain collectives the
vocab-parallel loss, loading and saving need, and the check that the ranks of a TP group were
given the same inputs (:func:`check_same_inputs`), and the record of a model call's data checks
that the host reads one call later, without a host sync (:class:`DeferredChecks`,
:class:`HostCopy`). The protocols that make every rank learn
whether every rank succeeded are in :mod:`tpify.agree`, over these collectives.

| operator                 | forward                          | backward                          |
| ------------------------ | -------------------------------- | --------------------------------- |
| ``copy_to_tp_region``    | identity (Megatron's ``f``)      | all-reduce (sum) over the group   |
| ``reduce_from_tp_region``| all-reduce (sum) (Megatron's ``g``) | identity                       |
| ``scatter_to_tp_region`` | split the last dim, keep chunk r | all-gather the last dim           |
| ``gather_from_tp_region``| all-gather the last dim, concat  | split the last dim, keep chunk r  |
| ``sum_grad_ranges``      | identity                         | all-reduce (sum) of given slices  |

Expert parallelism (whole experts per rank, Lepikhin et al., arXiv:2006.16668; Fedus et al.,
arXiv:2101.03961) adds three along the token rows ``N`` of ``(N, H)`` (uneven splits allowed):

| operator             | forward                                   | backward                          |
| -------------------- | ----------------------------------------- | --------------------------------- |
| ``scatter_rows``     | keep rows ``[r N/p, (r+1) N/p)``          | all-gather the rows               |
| ``gather_rows``      | all-gather the rows, concat in rank order | keep this rank's rows             |
| ``all_to_all_rows``  | rows ``j`` of given sizes to rank ``j``   | the reverse exchange              |

Sequence parallelism (Korthikanti et al., arXiv:2205.05198) adds three along the tokens ``T``:

| operator                             | forward                  | backward                         |
| ------------------------------------ | ------------------------ | -------------------------------- |
| ``scatter_to_sequence_region``       | split ``T``, keep chunk r | all-gather ``T``                |
| ``gather_from_sequence_region``      | all-gather ``T``         | reduce-scatter ``T`` (or split)  |
| ``reduce_scatter_to_sequence_region``| reduce-scatter ``T``     | all-gather ``T``                 |

With a group of one rank (or ``group=None`` and no initialised process group) every operator
is the identity and issues nothing, so a ``tp_size == 1`` model runs without ``torch.distributed``.

Every collective issued here is recorded by :func:`count_collectives`, which tests and
benchmarks use to compare what a step really issues with the analytic minimum.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "group_size",
    "group_rank",
    "copy_to_tp_region",
    "copy_many_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "sum_grad_ranges",
    "row_range",
    "scatter_rows",
    "gather_rows",
    "all_to_all_rows",
    "all_to_all_counts",
    "scatter_to_sequence_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "all_reduce",
    "all_reduce_async",
    "grad_reduce_dtype",
    "reduce_scatter_dim_async",
    "all_gather_dim",
    "all_gather_dim_async",
    "PendingGather",
    "all_gather_last_dim",
    "barrier",
    "all_gather_objects",
    "backend_map",
    "collective_device",
    "count_collectives",
    "SharesProcessGroups",
    "HostCopy",
    "DeferredChecks",
    "raise_unless",
    "checksum",
    "check_same_inputs",
    "inputs_checksum",
    "layout_code",
    "remember_checked",
    "was_checked",
    "forget_checked",
]

_counters: list[tuple[Counter, bool]] = []


def _record(op: str, tensor: torch.Tensor) -> None:
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


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (a TP or a DP group; ``None``: the world); 1 when
    torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (a TP or a DP group; ``None``: the world); 0 when
    torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` (no autograd rule).

    Args:
        tensor: any shape and dtype; reduced in place and returned.
        group: the process group; a one-rank group is a no-op.
        op: ``"sum"`` or ``"max"``.
    """
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
    if group_size(group) == 1:
        return tensor
    _record("all_reduce", tensor)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Start an in-place all-reduce (sum) of ``tensor`` over ``group`` and return its work handle
    (call ``.wait()`` before reading ``tensor``), or None for a one-rank group (nothing to do).

    Used by the column-parallel backward to overlap the input-gradient all-reduce with the
    weight-gradient matmul (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``).
    Counted by :func:`count_collectives` as an ``all_reduce``.
    """
    if group_size(group) == 1:
        return None
    _record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def grad_reduce_dtype(compute: torch.dtype, floor: torch.dtype | None = None) -> torch.dtype:
    """The dtype an input gradient is summed over the group in: the dtype of the matmul that made
    it (``compute``: autocast's ``bfloat16`` under autocast, else the layer's dtype), or the wider
    of that and ``floor`` (``parallelize(grad_reduce_dtype=torch.float32)``: never narrower than
    float32; a float64 model keeps float64). Local."""
    return compute if floor is None else torch.promote_types(compute, floor)


def all_gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather equal-sized shards along the last dim and concatenate them in rank order.

    Shapes: input ``(..., n)`` on each of the ``p`` ranks, output ``(..., p * n)``.
    """
    return all_gather_dim(tensor, -1, group)


def all_gather_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather equal shards along ``dim`` in rank order, no autograd rule.

    Shapes: ``(..., n, ...)`` per rank -> ``(..., p * n, ...)``. Communication: one all-gather
    (``all_gather_into_tensor``) of ``tensor.numel()`` values per rank, counted by
    :func:`count_collectives` as ``all_gather``. The shards are gathered as they are, into a
    ``(p, *shape)`` buffer, and the result is that buffer with the rank axis moved next to
    ``dim`` and merged into it: a contiguous tensor (one copy where ``dim`` is not the outermost
    non-trivial dimension, e.g. ``T`` of ``(B, T, H)`` with ``B > 1``; none otherwise), so its
    consumers need not copy it again.
    """
    world = group_size(group)
    if world == 1:
        return tensor
    out, shape = _all_gather_start(tensor, group, async_op=False)[:2]
    return _merge_gathered(out, shape, dim % tensor.dim(), world)


class PendingGather:
    """An all-gather started by :func:`all_gather_dim_async`: :meth:`wait` returns its result."""

    __slots__ = ("_out", "_shape", "_dim", "_world", "_work", "_result")

    def __init__(self, out, shape, dim, world, work, result=None):
        self._out, self._shape, self._dim, self._world, self._work = out, shape, dim, world, work
        self._result = result

    def wait(self) -> torch.Tensor:
        """The gathered tensor, as :func:`all_gather_dim` returns it (waits for the collective
        the first time)."""
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = _merge_gathered(self._out, self._shape, self._dim, self._world)
            self._out = self._work = None
        return self._result


def all_gather_dim_async(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> PendingGather:
    """Start :func:`all_gather_dim` and return at once: ``.wait()`` on the result gives the
    gathered tensor (``tensor`` itself for a one-rank group).

    Used by the column-parallel backward under sequence parallelism, which saved this rank's
    ``(B, T/p, H)`` tokens instead of the gathered ``(B, T, H)`` input and gathers them again
    while it computes the input gradient (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``). Counted as ``all_gather``.
    """
    world = group_size(group)
    if world == 1:
        return PendingGather(None, None, None, 1, None, result=tensor)
    out, shape, work = _all_gather_start(tensor, group, async_op=True)
    return PendingGather(out, shape, dim % tensor.dim(), world, work)


def _all_gather_start(tensor: torch.Tensor, group, async_op: bool):
    """Issue the all-gather of ``tensor`` into a ``(p * shape[0], *shape[1:])`` buffer: (buffer, shape, work)."""
    shard = tensor.contiguous()
    _record("all_gather", shard)
    shape = tuple(shard.shape)
    # gloo wants the output as the shards stacked along dim 0: (p * shape[0], *shape[1:])
    out = torch.empty((group_size(group) * shape[0],) + shape[1:], dtype=shard.dtype, device=shard.device)
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, shard, group=group, async_op=True) if async_op else gather(out, shard, group=group)
    return out, shape, work


def _merge_gathered(out: torch.Tensor, shape: tuple, dim: int, world: int) -> torch.Tensor:
    """The gathered buffer ``(p * shape[0], ...)`` as one tensor with the rank axis merged into ``dim``."""
    return out.view((world,) + shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_dim_async(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None):
    """Start a reduce-scatter (sum) of ``tensor`` along ``dim``: ``(out, work)``, where ``out`` will
    hold this rank's chunk of the sum once ``work.wait()`` returns (``work`` is None for a
    one-rank group, where ``out`` is ``tensor``).

    Shapes: ``tensor`` ``(..., n, ...)`` with ``n`` at ``dim``; ``out`` ``(..., n/p, ...)``,
    contiguous in the input's dimension order. The input is laid out once as ``(p, ..., n/p,
    ...)`` (rank ``r``'s chunk contiguous; a copy unless ``dim`` is already outermost).
    Communication: one reduce-scatter of ``tensor.numel()`` values in (counted by
    :func:`count_collectives` as ``reduce_scatter``). Used by the column-parallel backward under
    sequence parallelism, overlapped with the weight gradient.

    Raises:
        ValueError: ``n`` is not divisible by the group size.
    """
    world = group_size(group)
    if world == 1:
        return tensor, None
    chunks, out = _reduce_scatter_layout(tensor, dim, world)
    # the input as the chunks stacked along dim 0: (p * chunk.shape[0], *chunk.shape[1:])
    work = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
        out, chunks.flatten(0, 1), group=group, async_op=True)
    return out, work


def _reduce_scatter_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk along ``dim`` (one reduce-scatter, waited for).

    Synchronous (no ``async_op``), so that ``torch.compile`` traces it instead of breaking the
    graph there (dynamo does not trace ``async_op=True``)."""
    world = group_size(group)
    if world == 1:
        return tensor
    chunks, out = _reduce_scatter_layout(tensor, dim, world)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, chunks.flatten(0, 1), group=group)
    return out


def _reduce_scatter_layout(tensor: torch.Tensor, dim: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` laid out as ``(p, ..., n/p, ...)`` (rank r's chunk contiguous) and the empty
    output chunk; the collective recorded."""
    dim = dim % tensor.dim()
    if tensor.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter a dimension of {tensor.shape[dim]} over {world} ranks")
    chunks = tensor.unflatten(dim, (world, tensor.shape[dim] // world)).movedim(dim, 0).contiguous()
    _record("reduce_scatter", chunks)
    return chunks, torch.empty(tuple(chunks.shape[1:]), dtype=chunks.dtype, device=chunks.device)


def _split_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of ``dim`` (a new contiguous tensor); no communication."""
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.shape[dim] % world:
        which = "a last dimension" if dim % tensor.dim() == tensor.dim() - 1 else f"dimension {dim}"
        raise ValueError(f"cannot split {which} of {tensor.shape[dim]} over {world} ranks: it is not divisible")
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


def backend_map(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``{device type: backend}`` of ``group`` (default: the world), from torch's backend
    configuration rather than the backend's name: ``{"cuda": "nccl"}`` for
    ``init_process_group("nccl")`` (and for ``init_process_group()`` on a CUDA host, whose
    backend is called ``"undefined"``), ``{"cpu": "gloo", "cuda": "nccl"}`` for
    ``"cpu:gloo,cuda:nccl"``, ``{"cpu": "gloo", "cuda": "gloo"}`` for ``"gloo"``. Empty without
    torch.distributed. Local."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # a torch without it, or a group it does not know
        name = str(dist.get_backend(group))
        config = f"cuda:{name}" if name == "nccl" else f"cpu:{name},cuda:{name}"
    return dict(pair.split(":", 1) for pair in config.lower().split(",") if ":" in pair)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device torch's object collectives and barriers run on over ``group``: the CPU when the
    group has a CPU backend (gloo, ``"cpu:gloo,cuda:nccl"``), else this process's current CUDA
    device (NCCL alone), which is this rank's own GPU after ``torch.cuda.set_device(LOCAL_RANK)``
    (checked by :func:`tpify.agree.agree`). Local."""
    backends = backend_map(group)
    if "cpu" in backends or "cuda" not in backends or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (default: the world); a no-op without torch.distributed.

    Over NCCL alone it runs on this rank's current CUDA device (``device_ids``), never on a GPU
    torch would guess."""
    if dist.is_available() and dist.is_initialized():
        _record("barrier", torch.empty(0))
        device = collective_device(group)
        if device.type == "cuda":
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order (for reports, not for tensors on a hot path).

    torch runs it on :func:`collective_device` (the CPU, or under NCCL alone this rank's current
    CUDA device)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    _record("all_gather_object", torch.empty(0))
    dist.all_gather_object(out, obj, group=group)
    return out


class SharesProcessGroups:
    """Mixin: ``copy.deepcopy`` shares the process groups an object holds instead of copying them.

    A ``ProcessGroup`` cannot be copied (nor pickled): it is a connection to the other ranks,
    and a copy of a tensor-parallel module must talk to the same ranks as the original. Every
    tpify object that holds a group (the parallel layers, ``TPInfo``, the model's hooks) copies
    its attributes as ``copy.deepcopy`` would, with its groups (and DeviceMeshes), held directly or
    as the values of a dict attribute (the KV replica groups), entered in the copy's memo as themselves; everything else is copied. So ``copy.deepcopy`` of a parallelized model (or of
    one parallel layer: PEFT's ``modules_to_save`` copies the LM head) works and shares the
    groups.
    """

    def __deepcopy__(self, memo):
        import copy

        from torch.distributed.device_mesh import DeviceMesh

        for value in self.__dict__.values():
            for held in (value.values() if isinstance(value, dict) else (value,)):  # {n_kv: group} too
                if isinstance(held, (dist.ProcessGroup, DeviceMesh)):  # a mesh holds groups too
                    memo[id(held)] = held
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new


#: Appended to the message of a check raised at the model's next call (:class:`DeferredChecks`).
FOUND_LATE = ("(found at the model's next call: tpify checks a call's data on the device and reads the result "
              "one call later, so as not to stop the host from queuing work ahead; the step in between used that "
              "call's data)")


class HostCopy:
    """0-dim tensors copied to host memory without blocking, read later (:meth:`values`).

    From an accelerator: one ``torch.stack`` in ``dtype``, copied into page-locked memory with
    ``non_blocking=True`` and an event recorded after the copy; :meth:`values` waits for that event
    (the device reaching this point of its queue, not the end of it) and reads host memory with
    ``numpy`` (which refuses a device tensor). On a CPU the stacked tensor itself.
    """

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype):
        values = [t.detach().reshape(()) for t in tensors]
        device = values[0].device
        packed = torch.stack([v.to(device=device, dtype=dtype) for v in values])
        self.event = None
        if device.type != "cpu":
            try:
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory for this device: the copy then blocks
                host = torch.empty(packed.shape, dtype=packed.dtype)
            host.copy_(packed, non_blocking=True)  # queued on the device's current stream
            module = torch.get_device_module(device)  # torch.cuda, ...: its Event and streams
            self.event = module.Event()
            self.event.record(module.current_stream(device))
            packed = host
        self.host = packed

    def values(self) -> list:
        """The values as Python numbers (waits for the copy, not for the device's queue)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().tolist()


class DeferredChecks:
    """Data checks of a model's call computed on the device and read by the host at the model's
    next call: no host sync in a steady-state step, a failure raised at most one call late.

    During a call, :func:`raise_unless` with ``defer=`` records here a 0-dim bool tensor that
    must be true, with the error to raise and, for the message, values to show (:meth:`expect`);
    :class:`tpify.hooks.guards.BatchCheck` keeps its checksum of the call's inputs
    (:meth:`keep`). When the call ends (:meth:`submit`, a forward hook that runs even when the
    call raises) they are packed into one int64 vector and copied to host memory without
    blocking: page-locked, with an event, from an accelerator; the tensor itself on a CPU. At the
    next call (:meth:`collect`, the model's first pre-hook) the host waits for that event, the copy
    queued one call earlier (normally long complete; at most until the device reaches the end of
    that call's forward, never for its queue to drain), and reads the values from host memory
    (``numpy``, which refuses a device tensor: a read that would sync cannot slip in); then
    :meth:`raise_failed` raises the first failed check. Every rank of a TP group raises alike:
    the checks recorded are on values every rank holds alike (results of an all-reduce, or inputs
    :class:`~tpify.hooks.guards.BatchCheck` compares), which the model's guard compares first.

    Held by the model's :class:`~tpify.context.CallState` (shared by copies of the model).
    """

    def __init__(self):
        self._staged: list[tuple] = []  # (key or None, [tensors], error or note, message, detail)
        self._pending: list[tuple] = []  # per call not yet collected: (HostCopy, entries)

    def expect(self, ok: torch.Tensor, error: type[Exception], message: str, detail=None) -> None:
        """Record that ``ok`` (0-dim bool) must be true, else ``error(message)``; ``detail``: None or
        ``(tensors, format)``, ``format(*values)`` appended to the message (values as Python ints)."""
        tensors, fmt = detail if detail is not None else ((), None)
        self._staged.append((None, [ok, *tensors], error, message, fmt))

    def keep(self, key: str, value: torch.Tensor, note=None) -> None:
        """Record a 0-dim integer ``value`` (and any host ``note``) to read at the next call
        (:meth:`collect`'s ``key``)."""
        self._staged.append((key, [value], note, "", None))

    def submit(self, *_hook_args) -> None:
        """End the call: start the copy of what it recorded to host memory (no wait)."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        self._pending.append((HostCopy([t for entry in staged for t in entry[1]], torch.int64), staged))

    def collect(self) -> tuple[dict[str, tuple[int, object]], list[Exception]]:
        """What the calls since the last collect recorded: the kept values ``{key: (int, note)}``
        (the latest) and the failed checks (errors, in the order recorded, each message followed
        by :data:`FOUND_LATE`); forgotten here."""
        pending, self._pending = self._pending, []
        kept, failed = {}, []
        for copy, staged in pending:
            values, at = copy.values(), 0  # the copy queued one call ago
            for key, tensors, error, message, fmt in staged:
                got, at = values[at: at + len(tensors)], at + len(tensors)
                if key is not None:
                    kept[key] = (got[0], error)  # error: the note, for a kept value
                elif not got[0]:
                    text = message if fmt is None else f"{message} ({fmt(*got[1:])})"
                    failed.append(error(f"{text} {FOUND_LATE}"))
        return kept, failed

    def __deepcopy__(self, memo):  # a copy of the model shares its CallState: never reached; fresh if it is
        return DeferredChecks()


def raise_unless(ok: torch.Tensor, error: type[Exception], message: str, detail=None,
                 defer: DeferredChecks | None = None) -> None:
    """Raise ``error(message)`` unless the 0-dim bool tensor ``ok`` is true.

    For data checks whose tensor every rank holds alike (the result of an all-reduce, or the same
    batch), so that every rank raises at the same point. Eagerly it costs one host sync, and
    ``detail()`` (values read from the data) is appended to the message. With ``defer`` (a model
    call's :class:`DeferredChecks`) nothing is read now: the check is recorded and raised at the
    model's next call; ``detail`` is then ``(tensors, format)``, ``format(*values)`` the text.
    Under ``torch.compile`` it becomes ``torch._assert_async(ok, message)``, which stays in the
    graph (no graph break) and raises ``RuntimeError(message)`` when the compiled code runs.
    """
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif defer is not None:
        defer.expect(ok, error, message, detail)
    elif not bool(ok):
        if detail is not None and not callable(detail):
            tensors, fmt = detail
            detail = lambda: fmt(*(int(t) for t in tensors))  # noqa: E731
        raise error(message if detail is None else f"{message} ({detail()})")


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An order-sensitive checksum of a tensor's values, a 0-dim int64 tensor in ``[0, 2**24)``
    (exact in float32, so it can ride on a float all-reduce).

    Integer and bool tensors are summed as integers; floating tensors by their bit patterns
    (viewed as integers of their width), so the checksum is exact and independent of the order
    of summation: equal tensors give equal checksums on every rank and device. A pass over the
    tensor on its device; no communication, no host sync.
    """
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    flat = flat.to(torch.int64).remainder(1000003)
    weights = torch.arange(flat.numel(), device=flat.device) % 9973 + 1
    return ((flat + 101) * weights).sum().remainder(16777213)


_checked: list[tuple[weakref.ref, int]] = []  # what check_same_inputs(..., remember=True) compared, with versions


def was_checked(tensor: torch.Tensor) -> bool:
    """Whether the model call now running compares ``tensor``'s values across the TP group
    (:func:`check_same_inputs` with ``remember=True``, or :class:`~tpify.hooks.guards.BatchCheck`,
    which compares them at the model's next call, :func:`remember_checked`): that tensor, or a
    view of all of its elements (HF models reshape ``input_ids`` before the embedding),
    unmodified since (views share the version counter). Every rank of the group passed the same
    check of the names and shapes, so every rank answers alike; :func:`forget_checked` ends the call."""
    for ref, version in _checked:
        checked = ref()
        if (checked is not None and version == tensor._version and checked.dtype == tensor.dtype
                and checked.numel() == tensor.numel() and checked.data_ptr() == tensor.data_ptr()
                and checked.is_contiguous() and tensor.is_contiguous()):
            return True
    return False


def layout_code(named: list[tuple[str, torch.Tensor]]) -> int:
    """A deterministic integer in ``[0, 2**44)`` of the names, shapes and dtypes of ``named``: the
    same on every rank for the same layout (Python's ``hash`` of a string is salted per process),
    from integer arithmetic alone, so that ``torch.compile`` folds it without a graph break."""
    code = 1469598103
    for name, t in named:
        for value in (len(name), *map(ord, name[:32]), t.dim(), *t.shape, t.element_size(), int(t.is_floating_point())):
            code = (code * 1099511627 + int(value) + 7) % 17592186044399  # a prime below 2**44
    return code


def forget_checked(*_args) -> None:
    """End the model call whose checked inputs :func:`was_checked` knows (a forward hook that
    runs even when the forward raises)."""
    _checked.clear()


def check_same_inputs(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, what: str,
                      flag: torch.Tensor | None = None, remember: bool = False) -> torch.Tensor | None:
    """Raise, on every rank of ``group``, unless every rank holds the same tensors (names, shapes,
    dtypes and values).

    The ranks of a TP group hold one model replica, so they must be given one batch: a rank
    that sampled other token ids (a per-rank seed) would otherwise sum the embeddings of
    different tokens and train on a mix, silently; one given another sequence length would make
    the next collective mismatch (an abort inside gloo, a hang or garbage with NCCL). This check
    runs before any other collective of the call.

    Method: a digest of the names, shapes and dtypes and the sum of :func:`checksum` of the
    values (weighted by position), each with its negation, in one all-reduce (max) of 4 int64
    values: all equal exactly when ``max == -max(-x)``. Cost: one pass over the tensors, one
    small all-reduce and one host sync.

    ``flag``: a 0-dim bool tensor of this rank's (a local check that failed, say) that rides
    on the same all-reduce (a 5th value); returned as "true on any rank", so the caller raises
    on every rank. ``None`` when not given (or on a one-rank group: ``flag`` itself).
    ``remember``: record the tensors as checked for the model call now starting
    (:func:`was_checked`, until :func:`forget_checked`).

    Raises:
        ValueError: the ranks hold tensors of other names, shapes or dtypes, or other values;
            every rank raises (under ``torch.compile``: ``RuntimeError``, from
            ``torch._assert_async``).
    """
    if group_size(group) == 1 or not named:
        return flag
    device = named[0][1].device
    layout = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in named)
    # the layout code made on the device by a fill (torch.tensor(code, device=...) would copy from the host)
    code = torch.full((), layout_code(named), dtype=torch.int64, device=device)
    value_code = inputs_checksum(named)
    values = [code, -code, value_code.to(device), -value_code.to(device)]
    if flag is not None:
        values.append(flag.to(device=device, dtype=torch.int64))
    packed = torch.stack(values)
    all_reduce(packed, group, op="max")
    raise_unless(packed[0] == -packed[1], ValueError, different_layouts_message(what, layout))
    raise_unless(packed[2] == -packed[3], ValueError, different_values_message(what, layout))
    if remember:
        remember_checked(named)
    return packed[4] > 0 if flag is not None else None


def inputs_checksum(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The checksum of the values of ``named`` (each tensor's :func:`checksum`, weighted by its
    position), a 0-dim int64 tensor on the first one's device; no host sync."""
    return sum((i + 1) * checksum(t) for i, (_, t) in enumerate(named))


def remember_checked(named: list[tuple[str, torch.Tensor]]) -> None:
    """Record the tensors of ``named`` as checked for the model call now starting (:func:`was_checked`)."""
    if not torch.compiler.is_compiling():
        _checked[:] = [(weakref.ref(t), t._version) for _, t in named]


def different_layouts_message(what: str, layout: str) -> str:
    """The message of inputs of other names, shapes or dtypes on the ranks of a TP group."""
    return (f"{what}: the ranks of the TP group were given inputs of different names, shapes or dtypes (this "
            f"rank: {layout}). Every rank of a TP group must get the same batch: split the data over DP "
            f"replicas only")


def different_values_message(what: str, layout: str) -> str:
    """The message of other input values (same layout) on the ranks of a TP group."""
    return (f"{what}: the ranks of the TP group were given different input values (same shapes: {layout}). "
            f"Every rank of a TP group must get the same batch: split the data over DP replicas only, and "
            f"seed any sampling identically on the ranks of a TP group")


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A copy (autograd may hand the same gradient tensor to other consumers too), in the dtype to reduce in.
        dtype = ctx.reduce_dtype or grad.dtype
        if dtype == grad.dtype:
            return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None, None
        return all_reduce(grad.to(dtype, memory_format=torch.contiguous_format), ctx.group).to(grad.dtype), None, None


class _CopyManyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, reduce_dtypes, *xs):
        ctx.group, ctx.reduce_dtypes = group, reduce_dtypes
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        needed = [(i, g) for i, (g, need) in enumerate(zip(grads, ctx.needs_input_grad[2:])) if need]
        out = [None, None] + [None] * len(grads)
        if not needed:
            return tuple(out)
        if ctx.reduce_dtypes is None:  # all in the widest of their dtypes, one all-reduce
            widest = needed[0][1].dtype
            for _, g in needed[1:]:
                widest = torch.promote_types(widest, g.dtype)
            targets = [widest] * len(needed)
        else:  # each in its own reduce dtype: one all-reduce per dtype
            targets = [ctx.reduce_dtypes[i] or g.dtype for i, g in needed]
        for dtype in dict.fromkeys(targets):
            members = [(i, g) for (i, g), t in zip(needed, targets) if t == dtype]
            flat = torch.cat([g.reshape(-1).to(dtype) for _, g in members])
            all_reduce(flat, ctx.group)
            offset = 0
            for i, g in members:
                out[2 + i] = flat[offset: offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
        return tuple(out)


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, -1, ctx.group), None


class _SumGradRanges(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, where, *xs):
        ctx.group, ctx.where = group, where
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else g.clone(memory_format=torch.contiguous_format) for g in grads]
        pieces = [(g, dim, a, b) for g, (dim, ranges) in zip(grads, ctx.where) if g is not None for a, b in ranges]
        if pieces:  # one all-reduce for every slice of every tensor
            flat = torch.cat([g.narrow(dim, a, b - a).reshape(-1) for g, dim, a, b in pieces])
            all_reduce(flat, ctx.group)
            offset = 0
            for g, dim, a, b in pieces:
                view = g.narrow(dim, a, b - a)
                view.copy_(flat[offset: offset + view.numel()].view_as(view))
                offset += view.numel()
        return (None, None, *grads)


def sum_grad_ranges(xs: list[torch.Tensor], where: list[tuple[int, list[tuple[int, int]]]],
                    group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Identity forward; backward, sum over the group the gradient slices ``where`` names.

    ``where[i] = (dim, [(start, stop), ...])`` names the slices of ``xs[i]``, along ``dim``, that
    hold a replicated value whose gradient each rank computes only in part: the K/V parts of a
    multi-query ``[Q_r | K | V]`` projection, read by this rank's query heads only. The true
    gradient of those slices is the sum over the group; the other slices are left as they are.
    Communication: backward, one all-reduce (sum) of all the named slices of all the tensors
    together; forward none.
    """
    if group_size(group) == 1:
        return tuple(xs)
    return _SumGradRanges.apply(group, tuple(where), *xs)


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, partial_grad):
        ctx.group, ctx.partial_grad = group, partial_grad
        return all_gather_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grad:  # each rank holds part of the gradient of every token: sum, keep mine
            return _reduce_scatter_dim(grad, 1, ctx.group), None, None
        return _split_dim(grad, 1, ctx.group), None, None  # the same full gradient on every rank


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, 1, ctx.group), None


def scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism: keep this rank's chunk of the tokens, ``(B, T, H) -> (B, T/p, H)``.

    Forward: no communication. Backward: one all-gather of the gradient along ``T``
    (Korthikanti et al., arXiv:2205.05198, section 4.2.2).

    Raises:
        ValueError: ``T`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                partial_grad: bool = True) -> torch.Tensor:
    """Sequence parallelism: all-gather the tokens, ``(B, T/p, H) -> (B, T, H)``.

    Forward: one all-gather along ``T`` (Megatron's ``g``). Backward: with ``partial_grad``
    (the input of column-parallel layers, whose input gradients are partial sums per rank) one
    reduce-scatter along ``T`` (Megatron's ``g-bar``), which replaces the column-parallel
    all-reduce; without (the gathered output feeds replicated computation) a split, no
    communication.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, partial_grad)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sequence parallelism: sum the partial outputs of a row-parallel layer and keep this rank's
    tokens, ``(B, T, H) -> (B, T/p, H)``: one reduce-scatter forward (half an all-reduce's
    traffic), one all-gather of the gradient backward.

    Raises:
        ValueError: ``T`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                      reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward.

    Placed where a replicated activation ``(B, T, H)`` enters a column-parallel region, so that
    the partial gradients each rank computes for it are summed. One all-reduce of ``B*T*H``
    values in backward, none in forward: in ``reduce_dtype`` (the gradient cast to it, summed,
    cast back to its own dtype), default the gradient's own dtype. Column-parallel layers pass
    the dtype their matmul ran in (autocast's ``bfloat16`` over ``float32`` activations: the
    partial gradient is a ``bfloat16`` matmul's output, exact in it), as Megatron-LM all-reduces
    the input gradient in the dtype of the matmul that made it.
    """
    if group_size(group) == 1:
        return x
    return _CopyToTPRegion.apply(x, group, reduce_dtype)


def copy_many_to_tp_region(xs: list[torch.Tensor], group: dist.ProcessGroup | None,
                           reduce_dtypes: list[torch.dtype | None] | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`copy_to_tp_region` of several replicated tensors with one all-reduce in backward.

    Used where a column-parallel region starts from more than one replicated activation, e.g. a
    LoRA adapter on a column-parallel layer: the input ``X (B, T, H)`` and the adapter's
    ``h = A X (B, T, r)`` both enter the region, and the gradients of both are summed over the
    group in a single all-reduce of ``B*T*(H + r)`` values (in the widest of their dtypes).
    With ``reduce_dtypes`` (one per tensor; None: the gradient's own dtype) each gradient is
    summed in its own reduce dtype instead: one all-reduce per distinct dtype (a ``bfloat16``
    base's ``dX`` and PEFT's ``float32`` adapters' ``dh``: two), one when they agree.
    Forward: identity, no communication.
    """
    if group_size(group) == 1:
        return tuple(xs)
    return _CopyManyToTPRegion.apply(group, None if reduce_dtypes is None else tuple(reduce_dtypes), *xs)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward.

    Sums the partial outputs ``(B, T, H)`` of a row-parallel layer or vocab-parallel embedding.
    One all-reduce of the output's size in forward, none in backward.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: ``(..., n) -> (..., n / p)``.

    No communication forward; one all-gather of the gradient backward.

    Raises:
        ValueError: the last dim is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather the last dim in rank order: ``(..., n / p) -> (..., n)``.

    One all-gather forward; backward keeps this rank's chunk of the gradient (no communication).
    """
    if group_size(group) == 1:
        return x
    return _GatherFromTPRegion.apply(x, group)


# ---------------------------------------------------------------------------------------------
# Expert parallelism: token rows moved between the ranks of a group (uneven sizes allowed).

def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows rank ``rank`` of ``world`` takes of ``rows`` token rows:
    ``[rank * rows // world, (rank + 1) * rows // world)`` (sizes differ by at most one; a rank may
    get none)."""
    return rank * rows // world, (rank + 1) * rows // world


def _gather_uneven_rows(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's :func:`row_range` slice ``x`` of ``rows`` rows, concatenated in rank order: one
    all-gather of the slices padded to ``ceil(rows / p)`` rows."""
    world = group_size(group)
    chunk = -(-rows // world)
    pad = chunk - x.shape[0]
    padded = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]) if pad else x
    gathered = all_gather_dim(padded, 0, group).view((world, chunk) + tuple(x.shape[1:]))
    sizes = [b - a for a, b in (row_range(rows, world, r) for r in range(world))]
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        a, b = row_range(x.shape[0], group_size(group), group_rank(group))
        return x[a:b].clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather_uneven_rows(grad.contiguous(), ctx.rows, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, group):
        ctx.group, ctx.rows = group, rows
        return _gather_uneven_rows(x.contiguous(), rows, group)

    @staticmethod
    def backward(ctx, grad):
        a, b = row_range(ctx.rows, group_size(ctx.group), group_rank(ctx.group))
        return grad[a:b].contiguous(), None, None


def scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's token rows of a replicated ``(N, ...)`` tensor: rows ``row_range(N, p, r)``.

    Forward: no communication. Backward: one all-gather of the row gradients (padded to
    ``ceil(N/p)`` rows), so the replicated input gets the gradient of every rank's rows.
    """
    if group_size(group) == 1:
        return x
    return _ScatterRows.apply(x, group)


def gather_rows(x: torch.Tensor, rows: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ``rows`` token rows of every rank (:func:`row_range` slices), in rank order: ``(N_r, ...)``
    -> ``(N, ...)``, replicated. Forward: one all-gather (slices padded to ``ceil(N/p)`` rows).
    Backward: this rank's rows of the (replicated) gradient, no communication."""
    if group_size(group) == 1:
        return x
    return _GatherRows.apply(x, rows, group)


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange per-destination counts: ``counts`` ``(p, ...)`` integer, row ``j`` for rank ``j``;
    returns ``(p, ...)``, row ``j`` received from rank ``j``. One all-to-all of ``counts.numel()``
    values (counted as ``all_to_all``); no autograd."""
    if group_size(group) == 1:
        return counts.clone()
    send = counts.contiguous()
    out = torch.empty_like(send)
    _record("all_to_all", send)
    dist.all_to_all_single(out, send, group=group)
    return out


def _all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
    _record("all_to_all", x)
    dist.all_to_all_single(out, x, recv_sizes, send_sizes, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.send_sizes, ctx.recv_sizes, ctx.group = send_sizes, recv_sizes, group
        return _all_to_all(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv_sizes, ctx.send_sizes, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send rows ``[sum(send_sizes[:j]), sum(send_sizes[:j+1]))`` of ``x`` ``(M, ...)`` to rank ``j``;
    return the rows received, ``recv_sizes[j]`` from rank ``j``, in rank order ``(sum(recv_sizes), ...)``.

    Forward: one all-to-all (``all_to_all_single`` with split sizes, counted as ``all_to_all``).
    Backward: the reverse exchange of the gradient (one all-to-all): a permutation of rows
    across ranks, whose adjoint is the inverse permutation. ``recv_sizes`` must be what the other
    ranks send (:func:`all_to_all_counts`).
    """
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, list(send_sizes), list(recv_sizes), group)
