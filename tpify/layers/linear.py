"""The column- and row-parallel linear layers (Megatron-LM, arXiv:1909.08053, section 3):
:class:`ColumnParallelLinear` (``Y_r = X A_r + b_r``) and :class:`RowParallelLinear`
(``Y = reduce(X_r A_r) + b``), in either weight layout. More: docs/mechanics.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..context import TPContext
from ..hf_modules import dense_dims
from ..sharding import KeepsShardSpecs, column_specs, divide, row_spec
from .common import _copy_shards, _matmul, _new_param, _resolve_context, _weight_shape, matmul_dtype
from .region import ColumnParallelInput, _ColumnParallelMatmul, check_overlap_environment


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

    ``Y = X A + b``, ``A = [A_1 ... A_p]`` split along the output features; rank ``r`` computes
    ``Y_r = copy(X) A_r + b_r`` (Megatron-LM, arXiv:1909.08053, section 3, eq. 3). Packed parts
    (``partition_sizes``, GPT-2's ``[Q | K | V]``) are split one by one; ``replicated_parts`` are
    cut into ``replica_shards`` slices (KV heads) held by ``tp_size / replica_shards`` ranks each,
    their gradients summed over those ranks; ``padded_out_features`` adds zero rows stripped on
    gather; ``uneven`` splits a part ``p`` does not divide by torch.chunk's rule.

    Shapes:
        input: ``(B, T, in_features)`` replicated, or under sequence parallelism the tensor a
        region entry all-gathered along ``T``.
        output: ``(B, T, out_features_per_partition)`` this rank's shard, or with
        ``gather_output`` ``(B, T, out_features)`` on every rank (padding stripped).
    Communication:
        forward: none, or one all-gather of the output with ``gather_output``.
        backward: one all-reduce (sum) of the input gradient ``(B, T, in_features)`` started
        asynchronously beside the weight-gradient matmul and shared by the layers reading the same
        tensor (:class:`ColumnParallelInput`); under sequence parallelism that region entry's one
        reduce-scatter instead; ``overlap_grad_reduce=False`` and ``torch.compile`` take the plain
        ``copy_to_tp_region`` (the same sums, no overlap, no sharing); with replicated parts one
        more all-reduce of their gradient rows over the replica group.
    Dtype: the parameters', or autocast's; the input gradient is summed in the matmul's dtype, at
        least the context's ``grad_reduce_dtype``. On CUDA the overlap needs
        ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (:func:`check_overlap_environment` warns once).
    Raises:
        ValueError: a part not divisible by ``tp_size`` (without ``uneven``); a packed or uneven
            layer asked to gather its output (at construction or per call, on every rank alike);
            replicated parts that are not distinct part indices; ``replica_shards`` not dividing
            ``tp_size`` or a replicated part; ``replica_shards > 1`` without the context's
            replica groups (a layer built alone).

    More (the replicated KV heads, the saved tokens under sequence parallelism, the precision of
    the reductions, the launch order on CUDA): docs/mechanics.md, "Reference: details moved from
    the docstrings".
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
        overlap_grad_reduce: bool = True,
        context: TPContext | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self._init_common(in_features, out_features, tp_group, weight_layout, context)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.overlap_grad_reduce = overlap_grad_reduce  # False: the plain copy_to_tp_region, as under torch.compile
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
