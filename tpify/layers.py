"""Tensor-parallel layers: column- and row-parallel linear layers, vocab-parallel embedding.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3). The layers hold only this rank's
shard of each weight and talk to other ranks only through :mod:`tpify.comm`'s region
operators. Every sharded parameter carries its :class:`~tpify.sharding.ShardSpec` as the attribute
``tp_shard_spec`` (read it with :func:`~tpify.sharding.shard_spec_of`), so the spec follows
the parameter wherever it is tied; parameters without one are replicated.

The layers accept the two weight layouts found in Hugging Face models and keep the one they
were built from, so parameter names and layouts stay those of the checkpoint:

* ``weight_layout="linear"``: ``nn.Linear``, weight ``[out, in]``;
* ``weight_layout="conv1d"``: ``transformers.pytorch_utils.Conv1D`` (GPT-2), weight ``[in, out]``.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm
from .context import TPContext
from .hf_modules import dense_dims
from .sharding import (KeepsShardSpecs, ShardSpec, column_specs, divide, embedding_columns_spec, row_spec,
                       shard_spec_of, vocab_rows_spec)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ColumnParallelEmbedding",
           "ColumnParallelInput", "MAX_CONNECTIONS_ENV", "overlap_environment", "check_overlap_environment"]

_LAYOUTS = ("linear", "conv1d")


def _weight_shape(in_features: int, out_features: int, layout: str) -> tuple[int, int]:
    if layout not in _LAYOUTS:
        raise ValueError(f"weight_layout must be one of {_LAYOUTS}, got {layout!r}")
    return (out_features, in_features) if layout == "linear" else (in_features, out_features)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``(..., n) -> (N, n)``, the leading dimensions flattened; also for ``n = 0`` (the shard of a
    rank that holds no feature of an uneven split), where ``reshape(-1, 0)`` is ambiguous."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    if layout == "linear":
        return F.linear(x, weight, bias)
    # Same kernel as transformers' Conv1D: addmm on the flattened tokens.
    out_shape = x.shape[:-1] + (weight.shape[1],)
    x2 = _tokens(x)
    y = torch.addmm(bias, x2, weight) if bias is not None else x2 @ weight
    return y.view(out_shape)


def _autocast_inputs(x: torch.Tensor, *tensors: torch.Tensor | None) -> tuple:
    """``(x, *tensors)`` cast to the autocast dtype of ``x``'s device when autocast is on there
    (what ``torch.amp.custom_fwd(cast_inputs=...)`` does), unchanged otherwise.

    A custom autograd Function runs its backward outside autocast: a forward that let autocast
    cast the matmul's operands but saved the originals would meet a ``bfloat16`` gradient and
    ``float32`` weights there. Casting once in forward and saving the cast operands makes the
    backward run the matmuls in the dtype the forward used, as autocast does for ``F.linear``
    (the gradients reach the ``float32`` parameters cast back by autograd, as through
    autocast's own cast nodes), and saves the half-size copies, as autocast does.
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() else t

    return (cast(x), *(cast(t) for t in tensors))


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in: autocast's on ``x``'s device when it is on there
    (``bfloat16`` over ``float32`` activations), else ``x``'s."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


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


def _new_param(shape, spec: ShardSpec | None, device, dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    if spec is not None:
        param.tp_shard_spec = spec
    return param


def _copy_shards(layer: nn.Module, dense: nn.Module, tp_rank: int) -> nn.Module:
    """Fill ``layer``'s parameters from the dense module's, slicing those with a ShardSpec."""
    with torch.no_grad():
        for name, param in layer.named_parameters(recurse=False):
            source = getattr(dense, name)
            spec = shard_spec_of(param)
            value = spec.slice_dense(source, tp_rank) if spec is not None else source.detach().clone()
            new = nn.Parameter(value, requires_grad=source.requires_grad)
            if spec is not None:
                new.tp_shard_spec = spec
            setattr(layer, name, new)
    return layer


def _resolve_context(layer: nn.Module, tp_group, context: TPContext | None) -> None:
    """Set ``layer.ctx`` (the model's :class:`~tpify.context.TPContext`, or one of its own for a
    layer built alone) and its ``tp_group``/``tp_size``/``tp_rank``, resolved once."""
    layer.ctx = context if context is not None else TPContext(tp_group)
    layer.tp_group, layer.tp_size, layer.tp_rank = layer.ctx.group, layer.ctx.size, layer.ctx.rank


class _ParallelLinear(KeepsShardSpecs, nn.Module):
    """What column- and row-parallel layers share: sizes, group, weight layout, ``from_dense``."""

    def _init_common(self, in_features: int, out_features: int, tp_group, weight_layout: str, context) -> None:
        self.in_features = in_features
        self.out_features = out_features
        _resolve_context(self, tp_group, context)
        self.weight_layout = weight_layout

    @classmethod
    def from_dense(cls, module: nn.Module, tp_group: dist.ProcessGroup | None, **kwargs):
        """Build this rank's shard from a dense ``nn.Linear`` or ``Conv1D`` (weights copied exactly).

        ``kwargs`` go to the constructor. ``module`` may live on the meta device; the shard is
        then on meta too.
        """
        in_f, out_f, layout = dense_dims(module)
        layer = cls(in_f, out_f, bias=module.bias is not None, tp_group=tp_group, weight_layout=layout,
                    device="meta", dtype=module.weight.dtype, **kwargs)
        return _copy_shards(layer, module, layer.tp_rank)


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer whose output features are split over the TP group.

    ``Y = X A + b`` with ``A = [A_1 ... A_p]`` split along the output features; rank ``r`` holds
    ``A_r`` and ``b_r`` and computes ``Y_r = copy(X) A_r + b_r`` (Megatron-LM,
    arXiv:1909.08053, section 3, eq. 3). Packed projections (``partition_sizes``, e.g. GPT-2
    ``c_attn`` = ``[Q | K | V]``) split each part separately so rank ``r`` holds
    ``[Q_r | K_r | V_r]``. Parts listed in ``replicated_parts`` are cut into ``replica_shards``
    slices (KV heads), each held by ``g = tp_size / replica_shards`` consecutive ranks: rank ``r``
    holds ``[Q_r | K_{r//g} | V_{r//g}]``, the KV head of its query group (grouped-query attention
    at ``tp_size`` above the KV heads; multi-query attention, one K/V head, is
    ``replica_shards = 1``: K and V whole on every rank). Each rank computes only its query heads'
    share of their gradient, so the gradients of those rows (and bias entries) are summed over
    the ``g`` ranks holding them in backward (:func:`tpify.comm.sum_grad_ranges` over the
    context's :meth:`~tpify.context.TPContext.replica_group`).
    A padded output (``padded_out_features``, for a vocabulary that ``p`` does not divide)
    carries zero rows that are stripped when the output is gathered. With ``uneven`` a part that
    ``p`` does not divide (an MLP's intermediate size, never heads: the planner decides) is split
    by torch.chunk's rule, ``ceil(n / p)`` features per rank and fewer, possibly none, on the last
    ones (:func:`tpify.sharding.chunk_range`); ``out_features_per_partition`` is then this rank's.

    Shapes:
        input: ``(B, T, in_features)``, replicated on every rank.
        output: ``(B, T, out_features_per_partition)`` this rank's shard, or with
        ``gather_output=True`` ``(B, T, out_features)`` on every rank (padding stripped).
    Communication:
        forward: none, or one all-gather of the output with ``gather_output``.
        backward: one all-reduce (sum) of the input gradient ``(B, T, in_features)``, started
        asynchronously and overlapped with the weight-gradient matmul (``overlap_grad_reduce``,
        default True; Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``; the
        plain synchronous ``copy_to_tp_region`` under ``torch.compile``), shared with the other
        layers of ``region_input`` that read the same tensor (:class:`ColumnParallelInput`: one
        all-reduce of their summed input gradients, not one each); with replicated
        parts, one more of their weight (and bias) gradient rows over the replica group. With sequence parallelism
        active: none of its own (the input was all-gathered along ``T`` before the layer, by a
        region entry of ``region_input`` whose one reduce-scatter of the summed input gradients
        the last layer reading it starts, overlapped with its weight gradient); the layers
        reading it save this rank's tokens ``(B, T/p, in_features)``, not the gathered input,
        and the first of them in backward all-gathers them again, overlapped with its input
        gradient (one all-gather per gathered input, shared by its readers; none when the
        weights take no gradient).
    Dtype: the parameters' dtype, or autocast's (the matmul's operands cast once in forward, as
        ``F.linear`` under autocast). The input gradient is summed over the group in the matmul's
        dtype (``bfloat16`` under bf16 autocast with ``float32`` weights and activations: each
        rank's partial ``dX`` is a ``bfloat16`` matmul's output), then cast to the input's dtype, as
        Megatron-LM all-reduces ``grad_input`` in the dtype its matmul produced; the context's
        ``grad_reduce_dtype`` (``parallelize(grad_reduce_dtype=torch.float32)``) makes it at least
        that dtype (docs/mechanics.md, "Precision of the reductions").
    Overlap: on CUDA the GPU starts the all-reduce beside the weight-gradient matmul only when
        ``CUDA_DEVICE_MAX_CONNECTIONS=1`` was set before CUDA initialised (kernels then start in
        launch order); unset, the first overlapped forward warns once
        (:func:`check_overlap_environment`; ``tpify finetune`` sets it for its ranks).
    Raises:
        ValueError: a part of the output features is not divisible by ``tp_size`` (without
            ``uneven``); a packed layer, or one whose ranks hold different sizes, asked to gather
            its output (the gathered order would not be the dense one; an all-gather takes equal
            sizes), at construction or per call (``runtime_gather_output``, on every rank alike);
            replicated parts that are not distinct part indices; ``replica_shards`` not dividing
            ``tp_size`` or a replicated part; ``replica_shards > 1`` without the context's replica
            groups (a layer built alone).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        partition_sizes: list[int] | None = None,
        padded_out_features: int | None = None,
        replicated_parts: tuple[int, ...] = (),
        replica_shards: int = 1,
        weight_layout: str = "linear",
        sequence_parallel: bool = False,
        uneven: bool = False,
        context: TPContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self._init_common(in_features, out_features, tp_group, weight_layout, context)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.overlap_grad_reduce = True  # see forward; False: the plain copy_to_tp_region (for comparisons)
        # the model's one region entry (layers reading one activation share it), or the layer's own
        self.region_input = self.ctx.region_input if self.ctx.region_input is not None else ColumnParallelInput()
        w_spec, spec = column_specs(out_features, self.tp_size, weight_layout, partition_sizes, padded_out_features,
                                    tuple(replicated_parts), replica_shards, uneven)
        if gather_output and (len(spec.parts) > 1 or spec.replicated):
            raise ValueError("a packed ColumnParallelLinear cannot gather its output in dense order")
        if gather_output and not spec.is_uniform:
            raise ValueError(f"an uneven ColumnParallelLinear ({out_features} output features over tp_size = "
                             f"{self.tp_size}: {spec.local_sizes()} per rank) cannot gather its output; keep it "
                             f"sharded (gather_output=False) for the row-parallel layer that reads it")
        self.uneven = uneven
        self._local_sizes = spec.local_sizes()  # every rank's output features (they differ when uneven)
        replicated = spec.replicated
        # the ranks holding the same replicated slices (the same KV head), whose partial gradients are summed
        self.replica_group = self.ctx.replica_group(replica_shards) if replicated else None
        self.out_features_per_partition = spec.local_size_of(self.tp_rank)
        # (tensor name, dim, local ranges) whose gradients are partial sums (replicated parts)
        self._partial_grads = ([("weight", w_spec.dim, w_spec.replicated_local_ranges()),
                                ("bias", 0, spec.replicated_local_ranges())] if replicated else [])
        w_shape = _weight_shape(in_features, self.out_features_per_partition, weight_layout)
        self.weight = _new_param(w_shape, w_spec, device, dtype)
        if bias:
            self.bias = _new_param((self.out_features_per_partition,), spec, device, dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, runtime_gather_output: bool | None = None,
                return_input: bool = False) -> torch.Tensor:
        """``(B, T, in_features) -> (B, T, out_features_per_partition)``, or gathered to
        ``(B, T, out_features)`` when ``runtime_gather_output`` (default: ``gather_output``) is
        true (Megatron's per-call argument: the parallel LM loss passes False through a hook).
        ``return_input``: return ``x`` itself and compute nothing (the chunked LM loss passes it
        through a hook and computes the loss from ``x`` and this layer's weight shard)."""
        if return_input:
            return x
        weight, bias = self.weight, self.bias
        if self._partial_grads:
            where = [(n, d, r) for n, d, r in self._partial_grads if getattr(self, n) is not None]
            summed = comm.sum_grad_ranges([getattr(self, n) for n, _, _ in where], [(d, r) for _, d, r in where],
                                          self.replica_group)
            weight, bias = summed[0], (summed[1] if len(summed) > 1 else None)
        if self.sequence_parallel:
            # sequence parallelism: the input was all-gathered along T by the enclosing module's hook
            # (a region entry of region_input), whose backward reduce-scatters the partial input
            # gradients instead of copy's all-reduce: the layers reading that tensor share it, and the
            # last of them starts it overlapped with its weight gradient; any other input's partial
            # gradient flows back to that entry through autograd
            overlap = self.overlap_grad_reduce and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            shared = self.region_input.lookup(x) if overlap else None
            if shared is not None and x.requires_grad:
                _, state, tokens = shared
                state.consumers += 1
                if tokens is not None and weight.requires_grad:
                    state.input_readers += 1  # saves this rank's tokens, gathers them again in backward
                else:
                    tokens = None
                check_overlap_environment(x.device, self.ctx)
                y = _ColumnParallelMatmul.apply(x, weight, bias, self.tp_group, self.weight_layout, state,
                                                None if tokens is None else tokens.detach(), self.ctx.grad_reduce_dtype)
            else:
                y = _matmul(x, weight, bias, self.weight_layout)
        elif self.tp_size > 1 and self.overlap_grad_reduce and not torch.compiler.is_compiling():
            if torch.is_grad_enabled() and x.requires_grad:
                check_overlap_environment(x.device, self.ctx)
                entry, state = self.region_input.enter(x, self.tp_group)
                state.consumers += 1
                y = _ColumnParallelMatmul.apply(entry, weight, bias, self.tp_group, self.weight_layout, state, None,
                                                self.ctx.grad_reduce_dtype)
            else:  # no input gradient: nothing to all-reduce
                y = _matmul(x, weight, bias, self.weight_layout)
        else:  # under torch.compile the plain region operator (inductor schedules the collective itself)
            reduce_dtype = comm.grad_reduce_dtype(matmul_dtype(x), self.ctx.grad_reduce_dtype)
            y = _matmul(comm.copy_to_tp_region(x, self.tp_group, reduce_dtype), weight, bias, self.weight_layout)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            y = self.gather(y)
        return y

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """All-gather this layer's output shards ``(B, T, out/p)`` to ``(B, T, out_features)``,
        padding stripped (one all-gather; backward keeps this rank's columns).

        Raises:
            ValueError: the ranks hold different sizes (an uneven split), on every rank, before
                the all-gather.
        """
        if len(set(self._local_sizes)) > 1:
            raise ValueError(f"an uneven ColumnParallelLinear ({self.out_features} output features over tp_size = "
                             f"{self.tp_size}: {self._local_sizes} per rank) cannot gather its output "
                             f"(runtime_gather_output); keep it sharded")
        y = comm.gather_from_tp_region(y, self.tp_group)
        return y[..., : self.out_features] if y.shape[-1] != self.out_features else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_partition={self.out_features_per_partition}, tp_size={self.tp_size}, "
                f"gather_output={self.gather_output}, weight_layout={self.weight_layout}"
                + (", uneven=True" if self.uneven else ""))


class RowParallelLinear(_ParallelLinear):
    """Linear layer whose input features are split over the TP group.

    ``Y = reduce(X_r A_r) + b``, with ``A`` split along its input dimension (Megatron-LM,
    arXiv:1909.08053, section 3, eq. 3). The bias is replicated and added once, after the
    reduce (added before it, it would count ``p`` times).

    With ``uneven``, ``in_features`` that ``tp_size`` does not divide (an MLP's intermediate size)
    is split by torch.chunk's rule as the column-parallel layer before it splits its output
    (:func:`tpify.sharding.chunk_range`); ``in_features_per_partition`` is then this rank's.

    Shapes:
        input: ``(B, T, in_features // tp_size)``, this rank's shard (``input_is_parallel``), or
        ``(B, T, in_features)`` replicated, which is then scattered.
        output: ``(B, T, out_features)``, identical on every rank.
    Communication:
        forward: one all-reduce (sum) of the output. backward: none (one all-gather of the
        input gradient when the input was scattered). With sequence parallelism active
        (``sequence_parallel``, Korthikanti et al., arXiv:2205.05198): one reduce-scatter along
        ``T`` forward, output ``(B, T/p, out_features)``; backward one all-gather of the output
        gradient and the bias gradient summed over the group (in the model's one all-reduce of
        replicated gradients per backward pass, :meth:`add_bias`; alone, one of its own).
    Raises:
        ValueError: ``in_features`` is not divisible by ``tp_size`` (without ``uneven``); an
            uneven split with ``input_is_parallel=False`` (the scatter cuts equal chunks).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        tp_group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
        weight_layout: str = "linear",
        sequence_parallel: bool = False,
        uneven: bool = False,
        context: TPContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self._init_common(in_features, out_features, tp_group, weight_layout, context)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        if not uneven:
            divide(in_features, self.tp_size, "in_features")
        w_spec = row_spec(in_features, self.tp_size, weight_layout, uneven)
        if not w_spec.is_uniform and not input_is_parallel:
            raise ValueError(f"an uneven RowParallelLinear ({in_features} input features over tp_size = "
                             f"{self.tp_size}: {w_spec.local_sizes()} per rank) takes its input already split "
                             f"(input_is_parallel=True); scattering it would cut equal chunks")
        self.uneven = uneven
        self.in_features_per_partition = w_spec.local_size_of(self.tp_rank)
        w_shape = _weight_shape(self.in_features_per_partition, out_features, weight_layout)
        self.weight = _new_param(w_shape, w_spec, device, dtype)
        if bias:
            self.bias = _new_param((out_features,), None, device, dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, scatter_output: bool | None = None) -> torch.Tensor:
        """``(B, T, in_features // tp_size) -> (B, T, out_features)``, replicated; or, with
        ``scatter_output`` (default: ``sequence_parallel``; the sequence-parallel hook passes it per
        call), this rank's tokens ``(B, T/p, out_features)``."""
        if not self.input_is_parallel:
            x = comm.scatter_to_tp_region(x, self.tp_group)
        scatter = self.sequence_parallel if scatter_output is None else scatter_output
        return self.add_bias(self.collect(_matmul(x, self.weight, None, self.weight_layout), scatter), scatter)

    def collect(self, partial: torch.Tensor, scatter_output: bool) -> torch.Tensor:
        """Sum this layer's partial outputs ``(B, T, n)`` over the group: one all-reduce, or with
        ``scatter_output`` one reduce-scatter along ``T`` (this rank's tokens ``(B, T/p, n)``: an
        all-reduce is a reduce-scatter plus an all-gather). ``n`` may exceed ``out_features``:
        a LoRA adapter's partial products ride on the same collective."""
        if scatter_output:
            return comm.reduce_scatter_to_sequence_region(partial, self.tp_group)
        return comm.reduce_from_tp_region(partial, self.tp_group)

    def add_bias(self, y: torch.Tensor, scatter_output: bool) -> torch.Tensor:
        """``y + bias``, once, after the collective, in ``y``'s dtype (as ``F.linear`` adds it:
        bfloat16 under autocast). With ``scatter_output`` the bias meets ``T/p`` tokens only, so
        its gradient is a partial sum, summed over the group in backward (:meth:`summed_bias`)."""
        if self.bias is None:
            return y
        return y + self.summed_bias(scatter_output).to(y.dtype)

    def summed_bias(self, scatter_output: bool) -> torch.Tensor:
        """The bias to add to this call's output: with ``scatter_output`` (it meets ``T/p`` tokens)
        its gradient is summed over the group, by the model's
        :class:`~tpify.grad_sums.SummedGrads` (the context's ``summed_grads``: one all-reduce per
        backward pass for it and the model's other replicated parameters, as Megatron-LM sums the
        LayerNorm and bias gradients of sequence parallelism together; every use of the bias in
        the call is summed alike), or, for a layer built alone, by an all-reduce of its own per
        use (:func:`tpify.comm.sum_grad_ranges`)."""
        bias = self.bias
        if not scatter_output or bias is None or not bias.requires_grad:
            return bias
        if self.ctx.summed_grads is not None:
            self.ctx.summed_grads.watch(bias)
            return bias
        return comm.sum_grad_ranges([bias], [(0, [(0, bias.shape[0])])], self.tp_group)[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, in_features_per_partition={self.in_features_per_partition}, "
                f"out_features={self.out_features}, tp_size={self.tp_size}, weight_layout={self.weight_layout}"
                + (", uneven=True" if self.uneven else ""))


class VocabParallelEmbedding(KeepsShardSpecs, nn.Module):
    """Embedding table split by rows (vocabulary entries) over the TP group.

    Rank ``r`` holds the rows of ids ``[vocab_start_index, vocab_end_index)`` of the table padded
    to ``padded_num_embeddings`` rows (a multiple of ``tp_size``). Ids outside this rank's range
    are looked up as row 0 and their output zeroed; the partial outputs are then summed with
    ``reduce`` (Megatron-LM, arXiv:1909.08053, section 3, "input embedding"). Padded rows are
    zeros that no id reaches.

    ``output_scale`` multiplies the output by a constant, after the reduce, as the scaled
    embeddings of some families do (Gemma's ``GemmaTextScaledWordEmbedding``: the lookup times
    ``sqrt(hidden_size)``). A tensor (the dense module's own 0-dim buffer) is kept as a
    non-persistent buffer, so dtype conversions of the model treat it as they treat the dense
    module's; a float is taken as float32. Either is cast to the weight's dtype before the
    multiply, as there.

    Shapes:
        input: ``(B, T)`` integer ids in ``[0, num_embeddings)``.
        output: ``(B, T, embedding_dim)``, identical on every rank.
    Communication:
        forward: one all-reduce (sum) of the output. backward: none.
    Raises:
        IndexError: (forward) an id outside ``[0, num_embeddings)``, as ``nn.Embedding``, on every
            rank before the output's all-reduce; inside a parallelized model's call (ids its
            :class:`~tpify.hooks.guards.BatchCheck` compares) at the model's next call instead
            (read one call late, :class:`~tpify.comm.DeferredChecks`: no host sync; the ids
            outside every rank's rows embed as zeros meanwhile).
        ValueError: (forward) the ranks of the TP group were given different ids (or shapes):
            each would sum the embeddings of different tokens. Checked by one all-reduce of 5
            values (the bounds ride on it) before the output's (:func:`tpify.comm.check_same_inputs`),
            unless the model's own call checked these ids already (:class:`tpify.hooks.guards.BatchCheck`).
        NotImplementedError: the dense embedding uses ``max_norm``, ``scale_grad_by_freq`` or
            ``sparse``, which cannot be computed from one shard of the table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        tp_group: dist.ProcessGroup | None = None,
        padded_num_embeddings: int | None = None,
        output_scale: float | torch.Tensor | None = None,
        context: TPContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        if isinstance(output_scale, torch.Tensor):  # a buffer, as the dense module's: .to()/.double() convert it alike
            self.register_buffer("output_scale", output_scale.detach().clone(), persistent=False)
        else:
            self.output_scale = output_scale
        _resolve_context(self, tp_group, context)
        self.padded_num_embeddings = padded_num_embeddings or num_embeddings
        spec = vocab_rows_spec(num_embeddings, self.tp_size, self.padded_num_embeddings)
        self.num_embeddings_per_partition = spec.local_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = _new_param((self.num_embeddings_per_partition, embedding_dim), spec, device, dtype)

    @property
    def _local_padding_idx(self) -> int | None:
        if self.padding_idx is not None and self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            return self.padding_idx - self.vocab_start_index
        return None

    @classmethod
    def from_dense(cls, module: nn.Embedding, tp_group: dist.ProcessGroup | None, **kwargs) -> "VocabParallelEmbedding":
        """Build this rank's shard from a dense ``nn.Embedding`` (rows copied exactly)."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"expected nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse")
        layer = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, tp_group=tp_group,
                    device="meta", dtype=module.weight.dtype, **kwargs)
        return _copy_shards(layer, module, layer.tp_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids -> ``(B, T, embedding_dim)`` embeddings, replicated.

        Raises:
            IndexError: an id outside ``[0, num_embeddings)``, as ``nn.Embedding`` raises (every
                rank holds the same ids, so every rank raises, before the all-reduce; within a
                parallelized model's call, at its next call: see the class).
        """
        if self.tp_size == 1:
            return self._scaled(F.embedding(input_ids, self.weight, self.padding_idx))
        if input_ids.numel():
            low, high = torch.aminmax(input_ids)
            bad = (low < 0) | (high >= self.num_embeddings)
            message = f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings}) (index out of range in self)"
            if self.ctx.state.checked.holds(input_ids):
                # the model's call compares these ids across the TP group (tpify.hooks.guards.BatchCheck): the
                # bounds are read at its next call, no host sync (ids outside every rank's rows embed as zeros)
                comm.raise_unless(~bad, IndexError, message, defer=self.ctx.state.checks,
                                  detail=((low, high), lambda lo, hi: f"this rank: min {lo}, max {hi}"))
            else:
                # called alone: check that every rank holds these ids, with the bounds riding on the check, so
                # that every rank raises alike (a host sync, as the dense lookup's bounds check)
                bad = comm.check_same_inputs([("input_ids", input_ids)], self.tp_group, "VocabParallelEmbedding",
                                             flag=bad)
                comm.raise_unless(~bad, IndexError, message,
                                  detail=lambda: f"this rank: min {int(low)}, max {int(high)}")
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._scaled(comm.reduce_from_tp_region(out, self.tp_group))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """``out * output_scale`` in the weight's dtype (a float scale rounded to float32 first, as
        HF's ``torch.tensor(scale)``); a float scale's tensor is made once per device and dtype, so a
        step copies nothing from the host."""
        scale = self.output_scale
        if scale is None:
            return out
        if isinstance(scale, torch.Tensor):
            return out * scale.to(device=out.device, dtype=self.weight.dtype)
        key = (out.device, self.weight.dtype, scale)
        cache = self.__dict__.setdefault("_scale_tensors", {})
        if key not in cache:
            cache[key] = torch.tensor(scale, dtype=torch.float32).to(device=out.device, dtype=self.weight.dtype)
        return out * cache[key]

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, padded={self.padded_num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, vocab_range=[{self.vocab_start_index}, "
                f"{self.vocab_end_index}), tp_size={self.tp_size}"
                + (f", output_scale={float(self.output_scale)}" if self.output_scale is not None else ""))


class ColumnParallelEmbedding(KeepsShardSpecs, nn.Module):
    """Embedding table split by columns (``embedding_dim``) over the TP group; output left sharded.

    For tables whose columns are attention heads: T5's ``relative_attention_bias``
    (``nn.Embedding(num_buckets, n_heads)``) gives, per relative-position bucket, one bias per
    head. Rank ``r`` holds columns ``[r*D/p, (r+1)*D/p)`` (its heads, as the column-parallel
    q/k/v projections give it heads ``r*n/p ..``), so the lookup yields exactly the biases of the
    local heads. Only those heads read them, so each rank's weight gradient is complete: no
    communication at all (the extension of Megatron's column split, arXiv:1909.08053 section 3,
    to a lookup table).

    Shapes:
        input: ``(...)`` integer ids in ``[0, num_embeddings)``, replicated.
        output: ``(..., embedding_dim // tp_size)``, this rank's columns.
    Communication: none, forward or backward (the input is integer: it has no gradient).
    Raises:
        ValueError: ``embedding_dim`` is not divisible by ``tp_size``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int | None = None,
                 tp_group: dist.ProcessGroup | None = None, context: TPContext | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        _resolve_context(self, tp_group, context)
        self.embedding_dim_per_partition = divide(embedding_dim, self.tp_size, "embedding_dim")
        spec = embedding_columns_spec(embedding_dim, self.tp_size)
        self.weight = _new_param((num_embeddings, self.embedding_dim_per_partition), spec, device, dtype)

    @classmethod
    def from_dense(cls, module: nn.Embedding, tp_group: dist.ProcessGroup | None, **kwargs) -> "ColumnParallelEmbedding":
        """Build this rank's columns from a dense ``nn.Embedding`` (copied exactly).

        Raises:
            NotImplementedError: ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` (they need whole rows).
        """
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("ColumnParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse")
        layer = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, tp_group=tp_group,
                    device="meta", dtype=module.weight.dtype, **kwargs)
        return _copy_shards(layer, module, layer.tp_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(...)`` ids -> ``(..., embedding_dim // tp_size)``, this rank's columns."""
        return F.embedding(input_ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"embedding_dim_per_partition={self.embedding_dim_per_partition}, tp_size={self.tp_size}")
