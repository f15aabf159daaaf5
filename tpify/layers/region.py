"""The column-parallel region entry and its overlapped backward (Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``): :class:`ColumnParallelInput` (the layers
reading one activation share one all-reduce, or one reduce-scatter under sequence parallelism, of
their summed input gradients, started asynchronously beside the last weight-gradient matmul) and
the CUDA launch environment that overlap needs (:func:`overlap_environment`,
:func:`check_overlap_environment`). More: docs/mechanics.md.
"""

from __future__ import annotations

import os
import warnings
import weakref

import torch
import torch.distributed as dist

from .. import comm
from ..context import TPContext
from .common import _autocast_inputs, _matmul, _tokens


#: The variable the CUDA driver reads when it creates a context: how many hardware work queues
#: a process's streams map to. At 1, kernels start in the order they were launched, so the NCCL
#: kernel of an input-gradient all-reduce issued before the weight-gradient GEMM starts before it
#: and runs beside it, instead of queueing behind it (Megatron-LM's
#: ``LinearWithGradAccumulationAndAsyncCommunication``).
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def overlap_environment(tp_size: int, fsdp: bool = False, environ=None) -> dict[str, str]:
    """What a launcher adds to its ranks' environment, before they initialise CUDA, for the
    column-parallel layers' overlap: ``{"CUDA_DEVICE_MAX_CONNECTIONS": "1"}`` with CUDA and
    ``tp_size > 1``; nothing on a CPU-only host, at ``tp_size == 1`` (no TP collective), with
    ``fsdp`` (FSDP2 overlaps its own all-gathers on streams of their own, which want several
    queues: Megatron-LM's FSDP refuses 1) or when ``environ`` (default ``os.environ``) sets the
    variable already (the user's value is kept). Local; reads no CUDA state beyond
    ``torch.cuda.is_available()``."""
    environ = os.environ if environ is None else environ
    if tp_size > 1 and not fsdp and MAX_CONNECTIONS_ENV not in environ and torch.cuda.is_available():
        return {MAX_CONNECTIONS_ENV: "1"}
    return {}


def check_overlap_environment(device: torch.device, ctx: TPContext, environ=None) -> None:
    """Warn, once per model, when a column-parallel layer overlaps its input-gradient all-reduce on
    a CUDA ``device`` and ``CUDA_DEVICE_MAX_CONNECTIONS`` is unset (``environ``, default
    ``os.environ``): the collective may then queue behind the GEMM it should overlap (correct,
    slower). Nothing on other devices, and nothing when the variable is set to any value (1, or
    more on purpose, e.g. with FSDP2). Megatron-LM warns alike
    (``linear_with_grad_accumulation_and_async_allreduce``).

    Warns:
        UserWarning: naming the variable and where to set it.
    """
    if device.type != "cuda" or ctx.overlap_checked:
        return
    ctx.overlap_checked = True
    environ = os.environ if environ is None else environ
    if MAX_CONNECTIONS_ENV not in environ:
        warnings.warn(
            f"tpify: the column-parallel layers overlap their input-gradient all-reduce with the weight-gradient "
            f"matmul, but {MAX_CONNECTIONS_ENV} is not set, so the GPU may queue the NCCL kernel behind the matmul "
            f"it should overlap (the results are the same, the step slower). Set {MAX_CONNECTIONS_ENV}=1 in the "
            f"environment before the process initialises CUDA (export it before torchrun; `tpify finetune` does), as "
            f"Megatron-LM does; with FSDP2 set it to the value FSDP2 wants (any value silences this)",
            UserWarning, stacklevel=3)


def _graph_task_id() -> int:
    """The id of the backward pass (autograd graph task) now running; -1 outside one."""
    return torch._C._current_graph_task_id()


class _InputGradSum:
    """The input-gradient bookkeeping of one replicated input shared by column-parallel layers.

    ``consumers`` counts, in forward, the layers that read the input with gradients on. In a
    backward pass each of them adds its partial input gradient to ``pending`` (their local sum)
    instead of handing it to autograd; the last to arrive starts the one reduction of the sum
    asynchronously and computes its weight gradient while it runs. The reduction is an all-reduce
    (``scatter_dim`` None: tensor parallelism's ``f``, ``result`` is ``pending`` summed in place)
    or, under sequence parallelism, a reduce-scatter along ``scatter_dim`` (``result`` is this
    rank's tokens of the sum). The entry node (:class:`_EnterColumnParallelRegion`), which
    autograd runs after every consumer, hands ``result`` on, or reduces the sum itself when fewer
    consumers ran than read the input (an output left out of the loss). The state belongs to one
    backward pass (``task``): a pass that reached the consumers but not the entry
    (``torch.autograd.grad`` with respect to weights only) leaves a stale sum that the next pass
    discards.

    Under sequence parallelism the consumers that compute a weight gradient (``input_readers``,
    counted in forward) saved this rank's tokens ``(B, T/p, H)``, not the gathered ``(B, T, H)``
    input: the first of them in a backward pass starts the all-gather of the tokens again
    (``regather``) and computes its input gradient while it runs; each reads the gathered input
    (cast once per dtype), and the last one to read it drops it (Korthikanti et al.,
    arXiv:2205.05198, section 4.2.2; Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``).
    """

    __slots__ = ("consumers", "input_readers", "scatter_dim", "task", "pending", "arrived", "result", "regather",
                 "casts", "read")

    def __init__(self, scatter_dim: int | None = None):
        self.consumers = 0
        self.input_readers = 0
        self.scatter_dim = scatter_dim
        self.reset(None)

    def reset(self, task: int | None) -> None:
        self.task, self.pending, self.arrived, self.result = task, None, 0, None
        self.regather, self.casts, self.read = None, {}, 0

    def _join(self) -> None:
        """Make the state that of the backward pass now running (a new pass starts afresh)."""
        task = _graph_task_id()
        if self.task != task:
            self.reset(task)

    def reduce_async(self, tensor: torch.Tensor, group) -> tuple[torch.Tensor, object | None]:
        """Start this entry's reduction of ``tensor``: (the result once waited for, the work handle)."""
        if self.scatter_dim is None:
            return tensor, comm.all_reduce_async(tensor, group)
        return comm.reduce_scatter_dim_async(tensor, self.scatter_dim, group)

    def reduce(self, tensor: torch.Tensor, group) -> torch.Tensor:
        """This entry's reduction of ``tensor``, waited for."""
        out, work = self.reduce_async(tensor, group)
        if work is not None:
            work.wait()
        return out

    def add(self, grad_x: torch.Tensor, group) -> object | None:
        """Add one consumer's partial input gradient; the reduction's work handle if it was the last."""
        self._join()
        if self.pending is None:
            self.pending = grad_x
        else:  # the consumers' reduce dtypes agree within a model; a wider one widens the sum
            if grad_x.dtype != self.pending.dtype:
                self.pending = self.pending.to(torch.promote_types(self.pending.dtype, grad_x.dtype))
            self.pending.add_(grad_x)
        self.arrived += 1
        if self.arrived == self.consumers:
            self.result, work = self.reduce_async(self.pending, group)
            return work
        return None

    def gather_input(self, shard: torch.Tensor, group) -> None:
        """Start the all-gather of the saved tokens ``shard`` again, once per backward pass (the
        first reader to ask; the others share it)."""
        self._join()
        if self.regather is None:
            self.regather = comm.all_gather_dim_async(shard, self.scatter_dim, group)

    def gathered_input(self, dtype: torch.dtype) -> torch.Tensor:
        """The input gathered again (:meth:`gather_input`), waited for, in ``dtype`` (the dtype the
        forward's matmul used: autocast's); dropped after the last reader."""
        full = self.regather.wait()
        x = full
        if full.dtype != dtype:
            x = self.casts.get(dtype)
            if x is None:
                x = self.casts[dtype] = full.to(dtype)
        self.read += 1
        if self.read >= self.input_readers:
            self.regather, self.casts = None, {}
        return x


class _EnterColumnParallelRegion(torch.autograd.Function):
    """Where a replicated activation enters the column-parallel layers that share it.

    Tensor parallelism (``state.scatter_dim`` None): Megatron's ``f``, identity forward. Sequence
    parallelism: Megatron's ``g``, the all-gather of the tokens ``(B, T/p, H) -> (B, T, H)``
    forward. Backward: the reduced sum of the consumers' input gradients (all-reduced, or
    reduce-scattered back to this rank's tokens; see :class:`_InputGradSum`)."""

    @staticmethod
    def forward(ctx, x, group, state):
        ctx.group, ctx.state, ctx.dtype = group, state, x.dtype
        ctx.set_materialize_grads(False)
        if state.scatter_dim is None:
            return x.view_as(x)
        return comm.all_gather_dim(x, state.scatter_dim, group)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        total = None
        if state.task == _graph_task_id() and state.pending is not None:
            # the last consumer started the reduction and waited for it; else one did not run
            total = state.result if state.result is not None else state.reduce(state.pending, ctx.group)
        state.reset(None)
        if grad is not None:  # a reader other than the sharing layers (or one not sharing): its partial gradient,
            # reduced in the consumers' reduce dtype when they ran
            dtype = total.dtype if total is not None else grad.dtype
            grad = state.reduce(grad.to(dtype, memory_format=torch.contiguous_format, copy=True), ctx.group)
            total = grad if total is None else total + grad
        if total is not None and total.dtype != ctx.dtype:  # summed in the matmuls' dtype: back to the input's
            total = total.to(ctx.dtype)
        return total, None, None


class ColumnParallelInput:
    """Where replicated activations enter the column-parallel layers of one model (one TP group).

    Megatron applies ``f`` (identity forward, all-reduce of the gradient backward) once where an
    activation enters a column-parallel region, however many layers read it: its fused QKV is one
    layer. Hugging Face models read the same normed hidden states with several layers (Llama's
    ``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj`` and ``up_proj``). The column-parallel layers
    of a model share one ``ColumnParallelInput``: a layer that gets the same tensor (the same
    object, unmodified) as the previous one reuses its region entry, so the layers reading one
    activation issue one all-reduce of its gradient in backward, not one each, and it still
    overlaps a weight-gradient matmul (the last consumer's, :class:`_InputGradSum`). The cached
    entry is dropped when the model's forward returns.

    Under sequence parallelism the entry is the all-gather of the tokens (:meth:`gather`, called
    by the sequence-parallel hook before attention or the MLP); the layers reading the gathered
    tensor share it the same way (:meth:`lookup`), and its backward is one reduce-scatter of their
    summed input gradients, started by the last of them and overlapped with its weight gradient.

    The layers reading a gathered tensor save this rank's ``(B, T/p, H)`` tokens for their weight
    gradients, not the gathered ``(B, T, H)``: the first of them in backward all-gathers the
    tokens again (overlapped with its input gradient) and the others share the result, as
    Megatron-LM saves the sequence shard and gathers it in backward.

    Shapes: the input ``(B, T, H)`` (any shape), replicated on every rank; the entry is a view of
    it (sequence parallelism: ``(B, T/p, H)`` in, ``(B, T, H)`` gathered out).
    Communication: forward none (sequence parallelism: one all-gather); backward one all-reduce
    (sum) of the input's shape per shared input (sequence parallelism: one reduce-scatter and one
    all-gather of the tokens again), issued by the last consumer (the all-gather by the first;
    the reduction by the entry node when a consumer's output did not reach the loss). Errors: none of its own. Method: Megatron-LM's ``f`` operator (arXiv:1909.08053,
    section 3), applied once per activation as its fused QKV layer does; with sequence
    parallelism ``g``/``g-bar`` (Korthikanti et al., arXiv:2205.05198, section 4.2.2).
    """

    def __init__(self):
        # (weakref to the layers' input, its _version, entry output, _InputGradSum, the tokens gathered or None)
        self._cached = None

    def enter(self, x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, _InputGradSum]:
        """``x``'s region entry and its gradient bookkeeping, created once per input tensor.
        Call only with gradients recorded for ``x`` (``torch.is_grad_enabled() and x.requires_grad``)."""
        cached = self.lookup(x)
        if cached is not None:
            return cached[:2]
        state = _InputGradSum()
        y = _EnterColumnParallelRegion.apply(x, group, state)
        self._cached = (weakref.ref(x), x._version, y, state, None)
        return y, state

    def gather(self, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
        """Sequence parallelism: all-gather ``x`` along ``dim`` (``(B, T/p, H) -> (B, T, H)``) as a
        region entry whose backward reduce-scatters the summed input gradients of the layers
        that read the result (they find it with :meth:`lookup`)."""
        state = _InputGradSum(scatter_dim=dim)
        y = _EnterColumnParallelRegion.apply(x, group, state)
        self._cached = (weakref.ref(y), y._version, y, state, x)
        return y

    def lookup(self, x: torch.Tensor) -> tuple[torch.Tensor, _InputGradSum, torch.Tensor | None] | None:
        """The cached entry, its bookkeeping and the tokens it gathered (sequence parallelism; else
        None) for input ``x`` (the same object, unmodified), or None."""
        cached = self._cached
        if cached is not None and cached[0]() is x and cached[1] == x._version:
            return cached[2], cached[3], cached[4]
        return None

    def clear(self, *_args) -> None:
        """Drop the cached entry (a forward hook of the model's root module)."""
        self._cached = None

    def __getstate__(self):  # pickling and copy.deepcopy: a copy shares nothing with this model's graph
        return {"_cached": None}


class _ColumnParallelMatmul(torch.autograd.Function):
    """``f(X) A_r + b_r`` for one consumer of a shared region entry, with the input-gradient
    all-reduce overlapped (backward).

    Forward: the local matmul, no communication (Megatron's ``f`` is the identity). Backward:
    ``dX_r = dY_r A_r^T`` is computed first and added to the entry's sum of partial input
    gradients; the last consumer to arrive starts the all-reduce of that sum asynchronously. The
    weight and bias gradients (``X^T dY_r``, ``sum dY_r``), which need no communication, are
    computed while it runs; then it is awaited. One all-reduce of ``B*T*in`` values per shared
    input, as Megatron-LM's fused layers do (``LinearWithGradAccumulationAndAsyncCommunication``,
    arXiv:2104.04473 section 4.3).

    Saved for backward: the input only when the weight takes a gradient (a frozen weight, LoRA's
    base, needs none). Under sequence parallelism (``shard``: this rank's tokens ``(B, T/p, H)``
    of the gathered input ``x``) the tokens are saved instead of ``x`` (``1/p`` of its memory) and
    all-gathered again in backward, started before ``dX_r`` is computed so that the two overlap
    (one all-gather per shared input and backward pass, :meth:`_InputGradSum.gather_input`).

    Dtype of the reduction: ``dX_r`` is summed in the dtype the matmul ran in (``bfloat16`` under
    bf16 autocast over ``float32`` activations, where it is a ``bfloat16`` matmul's output; the
    entry casts the sum back to the input's dtype), as Megatron-LM all-reduces ``grad_input`` in
    the dtype its matmul produced; ``reduce_floor`` (``parallelize(grad_reduce_dtype=...)``) makes
    it at least that dtype (:func:`tpify.comm.grad_reduce_dtype`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, layout, state, shard=None, reduce_floor=None):
        x, weight, bias = _autocast_inputs(x, weight, bias)
        ctx.compute_dtype, ctx.regather = x.dtype, shard is not None
        ctx.reduce_dtype = comm.grad_reduce_dtype(x.dtype, reduce_floor)
        keep = None
        if ctx.needs_input_grad[1]:  # X is needed for the weight gradient only
            keep = shard if shard is not None else x
        ctx.save_for_backward(keep, weight)
        ctx.group, ctx.layout, ctx.has_bias, ctx.state = group, layout, bias is not None, state
        with torch.autocast(x.device.type, enabled=False):
            return _matmul(x, weight, bias, layout)

    @staticmethod
    def backward(ctx, grad):
        saved, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if need_w and ctx.regather:  # the tokens gathered again while dX is computed
            ctx.state.gather_input(saved, ctx.group)
        grad2 = _tokens(grad)
        work = None
        if need_x:  # linear: weight [out, in]; conv1d: [in, out]
            grad_x = grad.matmul(weight if ctx.layout == "linear" else weight.t())
            work = ctx.state.add(grad_x.to(ctx.reduce_dtype), ctx.group)
        grad_w = None
        if need_w:
            x = ctx.state.gathered_input(ctx.compute_dtype) if ctx.regather else saved
            x2 = _tokens(x)
            grad_w = grad2.t().mm(x2) if ctx.layout == "linear" else x2.t().mm(grad2)
        grad_b = grad2.sum(0) if need_b and ctx.has_bias else None
        if work is not None:
            work.wait()
        return None, grad_w, grad_b, None, None, None, None, None
