"""LoRA and DoRA on tensor-parallel layers, with no collective beyond the base layer's.

LoRA adds ``scaling * B A x`` to a linear layer ``W x`` (Hu et al., arXiv:2106.09685), with
``A: (r, in)`` and ``B: (out, r)``. On tpify's layers the factors follow Megatron's rule
(Megatron-LM, arXiv:1909.08053, section 3; what PEFT's ``LoraParallelLinear`` does for
Megatron's layers):

* **column-parallel base** (``W_r``: this rank's output rows): ``A`` replicated, ``B_r`` split
  by output features (the same rows as ``W_r``, packed ``[Q|K|V]`` parts and vocabulary padding
  included). ``y_r = W_r x + b_r + s B_r (A x)``. Backward: the partial gradients of ``x`` (from
  ``W_r``) and of ``h = A x`` (from ``B_r``) are summed over the TP group in **one** all-reduce
  (:func:`tpify.comm.copy_many_to_tp_region`), the one the base layer issues anyway, ``r``
  values wider per token; ``A``'s gradient is then complete and identical on every rank.
* **row-parallel base** (``W_r``: this rank's input columns): ``A_r`` split by input features,
  ``B`` replicated. The partial sums ``W_r x_r`` and ``h_r = A_r x_r`` are summed in **one**
  all-reduce forward (the base layer's, ``r`` values wider per token); then
  ``y = (sum W_r x_r) + b + s B (sum h_r)``, so ``B``'s gradient is complete on every rank and
  the backward communicates nothing.
* **under sequence parallelism** (Korthikanti et al., arXiv:2205.05198): a column base reads the
  tokens all-gathered by a region entry whose backward reduce-scatters every reader's input
  gradient; the adapter reads the same tensor, its ``A^T dh`` goes there as a partial sum, and
  ``A``'s gradient (from the partial ``dh``) is summed over the group (``r x H`` values). A row
  base reduce-scatters along ``T`` (``r`` values wider); ``B`` then meets ``T/p`` tokens and its
  gradient is summed over the group. The per-call modes the model's hooks pass the base layer
  (:class:`tpify.context.ModeArgument`) are passed to the adapter layer instead.
* **replicated K/V rows** (a column base holding a KV head on a group of ranks,
  :mod:`tpify.sharding`): ``B``'s rows there (and their ``lora_bias``, DoRA's magnitude) are
  replicated like the base's, their gradients summed over the base's replica group in backward.
* **lora_bias** (PEFT's bias on ``B``): split like the base's bias on a column base (this
  rank's output features), replicated on a row base (added once, after the collective).
* **DoRA** (Liu et al., arXiv:2402.09353; PEFT's ``use_dora``): ``y = W x + b + (m / n - 1) W x
  + (m / n) s B A x`` with the magnitude ``m`` (one value per output feature, trained) and
  ``n = ||W + s B A||`` per output feature over the input dimension, detached (the paper's
  section 4.3, as PEFT). On a column base each rank holds whole rows: ``n_r`` and ``m_r`` are
  local, split like ``B``. On a row base the norm runs over the split input: one all-reduce of
  the ``out`` squared partial norms per adapter and forward (no backward), ``m`` replicated.

**Dtypes of the collectives.** Each piece is summed in the dtype of the matmul that made it: the
base's partial output and ``dX`` in the base's (``bfloat16`` for a bf16 model, and under bf16
autocast), ``h = A x`` and ``dh`` in the adapter's (PEFT keeps adapters in ``float32`` for a
half-precision model without autocast, ``autocast_adapter_dtype=True``; under autocast the adapter's
matmul, and so ``h``, is ``bfloat16`` too). Pieces of one dtype share the collective; a ``bfloat16``
base with ``float32`` adapters outside autocast issues two (the base's ``B*T*out`` values in
``bfloat16``, the adapters' ``B*T*r`` in ``float32``) instead of one ``float32`` collective of both, as
PEFT's ``LoraParallelLinear`` does on Megatron's layers (its ``lora_A`` is a layer with its own
all-reduce). The adapters' outputs are added after the base's sum, in the base's dtype.
``parallelize(grad_reduce_dtype=...)`` floors the backward reductions' dtype as for the base layers.

**No asynchronous overlap.** The column-parallel layers overlap their input-gradient all-reduce with
their weight-gradient matmul; a LoRA base is frozen and has none, and the adapters' own weight
gradients (``B*T*r*out/p`` multiply-adds) are too small to hide it, so the adapted layer's
all-reduce stays synchronous, its ``dh`` needed at once for ``A``'s gradient.

Adapters are initialised dense, exactly as PEFT initialises them on the dense model from the
same random state, then sliced, so a run is comparable with dense PEFT step by step (DoRA's
magnitude is then the dense norm: on a row base one all-reduce per adapted layer when the
adapter is added).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.layer import LoraVariant
from torch import nn

from .. import comm
from ..context import mode_arguments, output_watches
from ..layers import ColumnParallelLinear, RowParallelLinear, _matmul, matmul_dtype
from ..quantized import refuse_if_quantized
from ..random import DEFAULT, TP
from ..sharding import KeepsShardSpecs, ShardSpec, is_dtensor, lora_factor_spec, shard_spec_of

__all__ = ["LoraTPLinear"]

# PEFT initialisations that need the whole base weight (or data): not computable from one shard
_DENSE_INITS = ("pissa", "corda", "olora", "loftq", "mica", "eva", "orthogonal", "lora_ga")


def _refused_options(config: LoraConfig) -> list[str]:
    """The options of ``config`` that LoRA on a sharded base cannot honour, each with its reason."""
    refused = []
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower() != "gaussian":
        refused.append(f"init_lora_weights={init!r} (it reads the whole base weight or data)")
    for f in dataclasses.fields(config):  # LoRA variants (PEFT tags them): DoRA only
        if f.metadata.get("is_lora_variant") and f.name != "use_dora" and getattr(config, f.name, None):
            refused.append(f"{f.name} (a LoRA variant tpify has no tensor-parallel form of)")
    return refused


class _DoraTP(LoraVariant):
    """PEFT's variant hook for DoRA on a :class:`LoraTPLinear`: adds the magnitude holder (PEFT's
    ``DoraLinearLayer``, so names and state dicts are PEFT's); the layer fills it once its factors
    are sliced and computes DoRA in its own forward (the collectives differ by base)."""

    @staticmethod
    def init(module: "LoraTPLinear", adapter_name: str, **kwargs) -> None:
        module._add_magnitude(adapter_name)


def _base_matmul(base: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W_r^T + b`` on the base layer's shard: a quantized base's own matmul (it dequantizes again
    in backward instead of saving the dense shard, :mod:`tpify.quantized`), else the plain one."""
    local = getattr(base, "local_matmul", None)
    return local(x, bias) if local is not None else _matmul(x, base.weight, bias, base.weight_layout)


def _assign(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set a base parameter's values (merging): in place for FSDP2's DTensor parameters, whose
    all-gather reads FSDP2's own sharded storage (``param.data = ...`` would leave it unchanged,
    silently); by rebinding ``.data`` otherwise (a weight that is a read-only view of a file stays
    untouched)."""
    if is_dtensor(param):
        param.data.copy_(value.to(param.dtype))
    else:
        param.data = value.to(param.dtype)


def _collect_by_dtype(base: RowParallelLinear, pieces: list[torch.Tensor], scatter: bool) -> list[torch.Tensor]:
    """``pieces`` ``(B, T, n_i)`` summed over the group by the base layer's collective
    (:meth:`RowParallelLinear.collect`), concatenated along the last dimension: one collective per
    distinct dtype, in the order the dtypes first appear (the same on every rank), each piece in its
    own dtype."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(pieces):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(pieces)
    for members in by_dtype.values():
        summed = base.collect(torch.cat([pieces[i] for i in members], dim=-1), scatter)
        for i, part in zip(members, summed.split([pieces[i].shape[-1] for i in members], dim=-1)):
            out[i] = part
    return out


class LoraTPLinear(KeepsShardSpecs, nn.Module, LoraLayer):
    """A LoRA (or DoRA) adapter on a :class:`ColumnParallelLinear` or :class:`RowParallelLinear`
    (module doc).

    Shapes: as the base layer (input ``(B, T, in)`` replicated for a column base,
    ``(B, T, in/p)`` for a row base; output ``(B, T, out/p)``, ``(B, T, out)`` or gathered).
    Parameters: column base: ``lora_A.weight (r, in)`` replicated, ``lora_B.weight (out/p, r)``,
    ``lora_B.bias (out/p,)`` (``lora_bias``) and DoRA's ``lora_magnitude_vector.<name>.weight
    (out/p,)`` sharded (each carries a ShardSpec); row base: ``lora_A.weight (r, in/p)`` sharded,
    ``lora_B.weight (out, r)``, ``lora_B.bias (out,)`` and the magnitude ``(out,)`` replicated.
    Communication: exactly the base layer's collectives (forward all-reduce of a row base,
    backward all-reduce of a column base, all-gather of a gathering head), ``B*T*r`` values wider
    per adapter; DoRA with active dropout (training, ``lora_dropout > 0``) adds its ``W x_dropped``
    to the same collective (``B*T*in`` values wider on a column base, ``B*T*out`` on a row base);
    DoRA on a row base adds one all-reduce of ``out`` values (the weight norm) per adapter and
    forward, and per merge.
    Dtype: the adapter's (PEFT keeps adapters in float32 for half-precision models); each piece of
    a collective is summed in its matmul's dtype, one collective per dtype (module doc).
    Dropout: on the replicated input of a column base from the default stream (same mask on
    every TP rank); on the sharded input of a row base from the TP stream (tpify.random).

    Raises:
        ValueError: LoRA variants other than DoRA, or initialisations that need the whole base
            weight (PiSSA, CorDA, OLoRA, LoftQ, MiCA, EVA, orthogonal, LoRA-GA): not supported on
            a sharded base; DoRA on a vocabulary-padded LM head (its padding rows have norm 0).
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs):
        super().__init__()
        kwargs.pop("fan_in_fan_out", None)
        kwargs.pop("is_target_conv_1d_layer", None)
        with warnings.catch_warnings():  # PEFT warns that it cannot read in/out features of unknown layer types
            warnings.filterwarnings("ignore", message="Unsupported layer type")
            LoraLayer.__init__(self, base_layer, **kwargs)
        base = self.get_base_layer()
        self.is_row = isinstance(base, RowParallelLinear)
        # The base's replicated K/V rows (a KV head held by a group of ranks), read now: under FSDP2
        # the base weight later becomes a DTensor without its ShardSpec (adapters come first).
        spec = shard_spec_of(base.weight)
        self._replica_ranges = (spec.replicated_local_ranges() if not self.is_row and spec is not None
                                and spec.replicated else None)
        self.in_features, self.out_features = base.in_features, base.out_features  # dense: init, then slice
        self.fan_in_fan_out = base.weight_layout == "conv1d"
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        # The dropout streams: as on the base layer, which this layer now stands for (tpify.random).
        self._rng = base.ctx.rng  # the model's tracker (None for a layer built alone)
        if self._rng is not None and self.is_row:
            self.register_forward_pre_hook(self._rng.leave_region)
        elif self._rng is not None and not base.gather_output:
            self.register_forward_hook(self._rng.enter_region)
        # The per-call modes the model's hooks pass the base layer (scatter_output under sequence
        # parallelism, runtime_gather_output for the parallel loss): this layer is called instead.
        for hook in mode_arguments(base):
            self.register_forward_pre_hook(hook, with_kwargs=True)
        for watch in output_watches(base):  # the model receives this layer's output, not the base's
            self.register_forward_hook(watch)

    @property
    def lora_variants(self):
        """PEFT's variant table (``LoraLayer.lora_variants``): plain LoRA and DoRA."""
        return {(): None, ("use_dora",): _DoraTP}

    def _factor_spec(self) -> tuple[str, ShardSpec]:
        """Which factor is sharded and how (:func:`tpify.sharding.lora_factor_spec`)."""
        base = self.get_base_layer()
        spec = shard_spec_of(base.weight)
        return lora_factor_spec(spec, self.is_row, base.in_features)

    def _replica_sums(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (``lora_B``'s weight and bias, DoRA's magnitude: one row per output feature of a
        column base), their replicated K/V rows' gradients summed over the base's replica group:
        each rank holding a KV head computes only its query heads' share (as the base's own rows)."""
        if self._replica_ranges is None:
            return tensors
        ranges = self._replica_ranges
        return list(comm.sum_grad_ranges(tensors, [(0, ranges)] * len(tensors), self.get_base_layer().replica_group))

    def _output_spec(self) -> ShardSpec | None:
        """The spec of a tensor with one value per output feature (``lora_B``'s bias, DoRA's
        magnitude): ``lora_B``'s rows on a column base, None (replicated) on a row base."""
        which, spec = self._factor_spec()
        return spec if which == "lora_B" else None

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """PEFT's dense adapter (same init as on the dense model), then this rank's slice of one factor
        (and of ``lora_B``'s bias on a column base); DoRA's magnitude from the dense weight norm.

        Raises:
            ValueError: an option that needs the whole base weight, or DoRA on a padded head.
        """
        refused = _refused_options(config)
        base = self.get_base_layer()
        if config.use_dora and shard_spec_of(base.weight).padded_size is not None:
            refused.append("use_dora on a vocabulary-padded layer (the padding rows have weight norm 0)")
        if refused:
            where = kwargs.get("target_name") or "a layer"
            raise ValueError(f"tpify LoRA on tensor-parallel layers does not support {refused} ({where}: "
                             f"{type(base).__name__} {base.in_features} -> {base.out_features}); use LoRA or DoRA "
                             f"with init_lora_weights=True, False or 'gaussian'")
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        which, spec = self._factor_spec()
        linear = getattr(self, which)[adapter_name]
        linear.weight = self._local(linear.weight, spec)
        if which == "lora_A":
            linear.in_features = linear.weight.shape[1]
        else:
            linear.out_features = linear.weight.shape[0]
            if linear.bias is not None:
                linear.bias = self._local(linear.bias, spec)
        if adapter_name in self.lora_magnitude_vector:
            with torch.no_grad():
                self.lora_magnitude_vector[adapter_name].weight.copy_(self._weight_norm(adapter_name))
        self.attach_specs()

    def _local(self, dense: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
        """This rank's slice of a dense adapter parameter (its spec: :meth:`attach_specs`)."""
        return nn.Parameter(spec.slice_dense(dense.detach(), self.get_base_layer().tp_rank),
                            requires_grad=dense.requires_grad)

    def attach_specs(self) -> None:
        """Put its ShardSpec on every sharded adapter tensor of every adapter (again).

        PEFT replaces adapter parameters by new ones when it upcasts half-precision adapters to
        float32 (``tuners_utils.cast_adapter_dtype``, on by default for bfloat16 and float16
        models), and a new parameter has no ``tp_shard_spec``: the gradient norm, the replica
        check, saving and loading would take the shards for replicated tensors. tpify's PEFT entry
        points call this after every PEFT call that may do so.

        Raises:
            RuntimeError: a tensor whose split dimension is not this rank's size (not a slice).
        """
        which, spec = self._factor_spec()
        out = self._output_spec()
        tensors = [(linear.weight, spec) for linear in getattr(self, which).values()]
        if out is not None:
            tensors += [(linear.bias, out) for linear in self.lora_B.values() if linear.bias is not None]
            tensors += [(holder.weight, out) for holder in self.lora_magnitude_vector.values()]
        rank = self.get_base_layer().tp_rank
        for tensor, s in tensors:
            if tensor.shape[s.dim] != s.local_size_of(rank):
                raise RuntimeError(f"tpify LoRA: an adapter tensor of shape {list(tensor.shape)} is not this rank's "
                                   f"slice (dimension {s.dim} should be {s.local_size_of(rank)})")
            tensor.tp_shard_spec = s

    def _add_magnitude(self, adapter_name: str) -> None:
        """DoRA's magnitude holder for ``adapter_name`` (PEFT's ``DoraLinearLayer``), its values set
        by :meth:`update_layer` once the factors are sliced."""
        if not self.lora_magnitude_vector:
            self.adapter_layer_names = self.adapter_layer_names[:] + ("lora_magnitude_vector",)
        spec = self._output_spec()
        size = spec.local_size_of(self.get_base_layer().tp_rank) if spec is not None else self.out_features
        holder = DoraLinearLayer(fan_in_fan_out=self.fan_in_fan_out)
        weight = self.lora_A[adapter_name].weight
        holder.weight = nn.Parameter(torch.zeros(size, dtype=weight.dtype, device=weight.device))
        if spec is not None:
            holder.weight.tp_shard_spec = spec
        self.lora_magnitude_vector[adapter_name] = holder

    # -- DoRA -------------------------------------------------------------------------------
    def _weight_norm(self, adapter: str, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``||W + s B A||`` per output feature over the whole input dimension, detached:
        ``(out/p,)`` on a column base (local rows), ``(out,)`` on a row base (one all-reduce of the
        squared partial norms). ``delta``: ``s B A`` in the base weight's layout, if computed."""
        base = self.get_base_layer()
        with torch.no_grad():
            lora_a = self.lora_A[adapter].weight
            if delta is None:
                delta = (self.lora_B[adapter].weight @ lora_a) * self.scaling[adapter]  # (out_local, in_local)
            elif base.weight_layout == "conv1d":
                delta = delta.T
            weight = base.weight.T if base.weight_layout == "conv1d" else base.weight
            whole = weight.to(delta.dtype) + delta  # (out_local, in_local)
            if not self.is_row:
                return torch.linalg.norm(whole, dim=1).to(whole.dtype)
            squares = (whole * whole).sum(dim=1)  # (out,) partial sums over this rank's columns
            return comm.all_reduce(squares, base.tp_group).sqrt()

    def _dora_scale(self, adapter: str, partial_grads: bool) -> torch.Tensor:
        """``m / ||W + s B A||``, ``(out_local,)``; with ``partial_grads`` (a row base under sequence
        parallelism: ``m`` meets ``T/p`` tokens) ``m``'s gradient is summed over the group."""
        magnitude = self.lora_magnitude_vector[adapter].weight
        if partial_grads:
            magnitude, = comm.sum_grad_ranges([magnitude], [(0, [(0, magnitude.shape[0])])],
                                              self.get_base_layer().tp_group)
        magnitude, = self._replica_sums([magnitude])
        return magnitude / self._weight_norm(adapter)

    def _dropout_is_active(self, adapter: str) -> bool:
        """PEFT's test in DoRA: dropout draws (then ``W x`` is recomputed on the dropped input)."""
        return not isinstance(self.lora_dropout[adapter], nn.Identity) and self.training

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Base output plus the active adapters' ``s B A x`` (DoRA: rescaled by ``m / n``), with the
        base layer's collectives only (DoRA on a row base: plus its weight norm's).

        ``runtime_gather_output`` / ``scatter_output``: the base layer's per-call modes (passed by
        the model's hooks), honoured as the base layer honours them."""
        modes = {k: kwargs.pop(k) for k in ("runtime_gather_output", "scatter_output") if k in kwargs}
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("tpify LoraTPLinear does not support mixed-adapter batches (adapter_names=)")
        base = self.get_base_layer()
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return base(x, *args, **kwargs, **modes)
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if self.merged or not adapters:
            return base(x, *args, **kwargs, **modes)
        if self.is_row:
            return self._row(base, x, adapters, modes.get("scatter_output", base.sequence_parallel))
        return self._column(base, x, adapters, modes.get("runtime_gather_output", base.gather_output))

    def _dropped(self, x: torch.Tensor, adapter: str, stream: str) -> torch.Tensor:
        """``dropout(x)`` for one adapter, in its dtype, the mask drawn from ``stream`` (DoRA, as PEFT:
        only when the dropout draws, :meth:`_dropout_is_active`)."""
        x = self._cast_input_dtype(x, self.lora_A[adapter].weight.dtype)
        if adapter in self.lora_variant and not self._dropout_is_active(adapter):
            return x
        with self._rng.on(stream) if self._rng is not None else contextlib.nullcontext():
            return self.lora_dropout[adapter](x)

    def _add_adapters(self, y: torch.Tensor, bias: torch.Tensor | None, adapters: list[str], hs: list[torch.Tensor],
                      recomputed: dict[str, torch.Tensor], partial_grads: bool) -> torch.Tensor:
        """``y`` plus each adapter's output from its summed ``h = A x`` (as PEFT adds them, in order).

        ``bias``: the base bias in ``y`` (DoRA rescales ``y - bias``, PEFT's ``base_result``);
        ``recomputed``: DoRA's ``W x_dropped`` per adapter whose dropout draws; ``partial_grads``:
        the replicated ``B`` and ``m`` meet ``T/p`` tokens (a row base under sequence parallelism),
        so their gradients are summed over the group."""
        dtype = y.dtype
        group = self.get_base_layer().tp_group
        for a, h in zip(adapters, hs):
            lora_b = self.lora_B[a]
            params = [p for p in (lora_b.weight, lora_b.bias) if p is not None]
            if partial_grads:
                params = comm.sum_grad_ranges(params, [(0, [(0, p.shape[0])]) for p in params], group)
            params = self._replica_sums(params)
            lora = F.linear(h.to(params[0].dtype), *params)  # (B, T, out_local)
            if a not in self.lora_variant:
                y = y + lora.to(dtype) * self.scaling[a]
                continue
            scale = self._dora_scale(a, partial_grads)  # (out_local,)
            base_result = recomputed.get(a)
            if base_result is None:
                base_result = y - bias if bias is not None else y
            y = y + ((scale - 1) * base_result + scale * lora * self.scaling[a]).to(dtype)
        return y

    def _column(self, base: ColumnParallelLinear, x: torch.Tensor, adapters: list[str], gather: bool) -> torch.Tensor:
        # x is replicated on every rank: the same dropout mask everywhere (the shared stream)
        if base.sequence_parallel:
            return self._column_sequence_parallel(base, x, adapters, gather)
        hs, dropped = [], {}
        for a in adapters:
            xd = self._dropped(x, a, DEFAULT)
            hs.append(self.lora_A[a](xd))  # (B, T, r)
            if a in self.lora_variant and self._dropout_is_active(a):
                dropped[a] = xd
        # one all-reduce of dX and dh backward (the layer keeps its own, not the entry it would share
        # with the other layers reading x: dh needs an all-reduce anyway, and dX rides on it), each
        # summed in its matmul's dtype: dX in the base's (bf16 under autocast), dh in the adapter's
        # (PEFT's fp32 adapters on a bf16 base: two all-reduces, one per dtype)
        floor = base.ctx.grad_reduce_dtype
        dtypes = [comm.grad_reduce_dtype(matmul_dtype(t), floor) for t in (x, *dropped.values())]
        dtypes += [comm.grad_reduce_dtype(h.dtype, floor) for h in hs]
        x, *entered = comm.copy_many_to_tp_region([x, *dropped.values(), *hs], base.tp_group, dtypes)
        recomputed = {a: _base_matmul(base, xd, None) for a, xd in zip(dropped, entered)}
        hs = entered[len(dropped):]
        y = _base_matmul(base, x, base.bias)  # (B, T, out/p)
        y = self._add_adapters(y, base.bias, adapters, hs, recomputed, partial_grads=False)
        return base.gather(y) if gather else y

    def _column_sequence_parallel(self, base: ColumnParallelLinear, x: torch.Tensor, adapters: list[str],
                                  gather: bool) -> torch.Tensor:
        """Under sequence parallelism ``x`` is the all-gathered input ``(B, T, H)``, whose region entry
        reduce-scatters the summed input gradient of every reader: the base layer shares it, and the
        adapter's ``A^T dh`` (and DoRA's recomputed ``W x_dropped``) reach it through autograd (a
        partial sum per rank, summed there). ``dh`` itself is a partial sum (each rank's rows of
        ``B``), so ``A``'s gradient is summed over the group (one all-reduce of ``r x H`` values in
        backward) instead of ``dh``."""
        hs, recomputed = [], {}
        for a in adapters:
            lora_a = self.lora_A[a]
            xd = self._dropped(x, a, DEFAULT)
            weight, = comm.sum_grad_ranges([lora_a.weight], [(0, [(0, lora_a.weight.shape[0])])], base.tp_group)
            hs.append(F.linear(xd, weight))  # (B, T, r)
            if a in self.lora_variant and self._dropout_is_active(a):
                recomputed[a] = _base_matmul(base, xd, None)
        y = base(x, runtime_gather_output=False)  # (B, T, out/p)
        y = self._add_adapters(y, base.bias, adapters, hs, recomputed, partial_grads=False)
        return base.gather(y) if gather else y

    def _row(self, base: RowParallelLinear, x: torch.Tensor, adapters: list[str], scatter: bool) -> torch.Tensor:
        if not base.input_is_parallel:
            x = comm.scatter_to_tp_region(x, base.tp_group)
        partial = _base_matmul(base, x, None)  # (B, T, out), partial sum
        hs, dropped = [], {}
        for a in adapters:  # sharded input: TP-distinct masks; (B, T, r) partial sums
            xd = self._dropped(x, a, TP)
            hs.append(self.lora_A[a](xd))
            if a in self.lora_variant and self._dropout_is_active(a):
                dropped[a] = _base_matmul(base, xd, None)  # (B, T, out), partial sum
        pieces = [partial, *dropped.values(), *hs]
        # the base layer's one collective, wider: all-reduce, or reduce-scatter along T (sequence
        # parallelism); one per dtype, each piece summed in its own (the base's partial output in the
        # base's, PEFT's fp32 adapters' h in fp32: two collectives then, one when the dtypes agree)
        y, *rest = _collect_by_dtype(base, pieces, scatter)
        recomputed = {a: t.to(partial.dtype) for a, t in zip(dropped, rest)}
        hs = rest[len(dropped):]
        y = base.add_bias(y.to(partial.dtype), scatter)
        bias = base.summed_bias(scatter)  # DoRA's y - b meets T/p tokens too: a trained bias's gradient is summed
        return self._add_adapters(y, bias, adapters, hs, recomputed, partial_grads=scatter)

    # -- merging ----------------------------------------------------------------------------
    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``s B A`` for this rank's shard of the base weight, in the base weight's layout and dtype.

        Under FSDP2 the factors and the base weight are DTensors over the DP axes: the product is
        redistributed to the base weight's placements (DTensor's matmul may leave it on others,
        e.g. sharded along another dimension), so that ``W + delta`` adds slice to slice."""
        base = self.get_base_layer()
        delta = (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]
        if base.weight_layout == "conv1d":
            delta = delta.T
        if is_dtensor(delta) and is_dtensor(base.weight):
            delta = delta.redistribute(base.weight.device_mesh, base.weight.placements)
        return delta.to(base.weight.dtype)

    def _dora_factor(self, adapter: str, norm: torch.Tensor) -> torch.Tensor:
        """``m / norm`` shaped to scale this rank's base weight shard by output feature."""
        factor = (self.lora_magnitude_vector[adapter].weight / norm).detach().to(self.get_base_layer().weight.dtype)
        return factor.view(1, -1) if self.fan_in_fan_out else factor.view(-1, 1)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """Merge the adapters into this rank's base shard, as PEFT merges them into the dense weight:
        ``W + s B A`` (and ``b + s b_B`` with ``lora_bias``); DoRA ``(m / ||W + s B A||) (W + s B A)``.

        Communication: none; DoRA on a row base: one all-reduce of ``out`` values (the norm).

        Raises:
            ValueError: non-finite merged weights (``safe_merge``); a DoRA adapter merged on top of
                another merged adapter (merge it first, alone).
            RuntimeError: ``lora_bias`` on a base without bias (as PEFT).
        """
        from peft.tuners.tuners_utils import check_adapters_to_merge

        base = self.get_base_layer()
        refuse_if_quantized(base, "merging a LoRA adapter")
        for a in check_adapters_to_merge(self, adapter_names):
            if a not in self.lora_A:
                continue
            if self.lora_bias[a] and base.bias is None:
                raise RuntimeError(f"Impossible to merge LoRA with `lora_bias=True` because the base layer "
                                   f"{type(base).__name__} has no bias")
            delta = self.get_delta_weight(a)
            if a in self.lora_variant:
                if self.merged_adapters:
                    raise ValueError(f"tpify: merge the DoRA adapter {a!r} first, alone (adapters "
                                     f"{self.merged_adapters} are merged already); unmerge them before")
                norm = self._weight_norm(a, delta)
                self._cache_store(f"{a}-weight_norm", norm)
                merged = self._dora_factor(a, norm) * (base.weight.data + delta)
            else:
                merged = base.weight.data + delta
            new_bias = base.bias.data + self.lora_B[a].bias.detach() * self.scaling[a] if self.lora_bias[a] else None
            if safe_merge and not (torch.isfinite(merged).all() and (new_bias is None or torch.isfinite(new_bias).all())):
                raise ValueError(f"NaNs detected in the merged weights; adapter {a} seems to be broken")
            _assign(base.weight, merged)
            if new_bias is not None:
                _assign(base.bias, new_bias)
            self.merged_adapters.append(a)

    def unmerge(self) -> None:
        """Undo :meth:`merge`, last merged first (DoRA with the norm cached at merging)."""
        base = self.get_base_layer()
        while self.merged_adapters:
            a = self.merged_adapters.pop()
            if a not in self.lora_A:
                continue
            delta = self.get_delta_weight(a)
            if a in self.lora_variant:
                factor = self._dora_factor(a, self._cache_pop(f"{a}-weight_norm"))
                _assign(base.weight, base.weight.data / factor - delta)
            else:
                _assign(base.weight, base.weight.data - delta)
            if self.lora_bias[a]:
                _assign(base.bias, base.bias.data - self.lora_B[a].bias.detach() * self.scaling[a])

    def __repr__(self) -> str:
        return "lora." + super().__repr__()
