"""PEFT LoRA on tensor-parallel layers, with no collective beyond the base layer's.

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

:func:`get_peft_model` registers :class:`LoraTPLinear` for ``ColumnParallelLinear`` and
``RowParallelLinear`` through PEFT's custom-module extension point
(``LoraConfig._register_custom_module``) and returns PEFT's ``PeftModel``; other targets
(replicated ``nn.Linear`` heads) get PEFT's own layers. Adapters are initialised dense, exactly
as PEFT initialises them on the dense model from the same random state, then sliced, so a run
is comparable with dense PEFT step by step. The model's ``save_pretrained`` writes a standard
adapter directory with the dense factors (:func:`save_adapter`, a collective);
``merge_and_unload()`` merges each rank's slice into its shard, and :func:`tpify.save_pretrained`
of the result is the dense merged model.
"""

from __future__ import annotations

import contextlib

import types
import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel
from peft import get_peft_model as _peft_get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from .. import comm
from ..context import mode_arguments
from ..info import get_tp_info
from ..layers import ColumnParallelLinear, RowParallelLinear, _matmul
from ..random import DEFAULT, TP
from ..sharding import KeepsShardSpecs, ShardSpec, lora_factor_spec, shard_spec_of
from ..info import TPUsageError

__all__ = ["LoraTPLinear", "get_peft_model", "save_adapter", "load_adapter_"]


class LoraTPLinear(KeepsShardSpecs, nn.Module, LoraLayer):
    """A LoRA adapter on a :class:`ColumnParallelLinear` or :class:`RowParallelLinear` (module doc).

    Shapes: as the base layer (input ``(B, T, in)`` replicated for a column base,
    ``(B, T, in/p)`` for a row base; output ``(B, T, out/p)``, ``(B, T, out)`` or gathered).
    Parameters: column base: ``lora_A.weight (r, in)`` replicated, ``lora_B.weight (out/p, r)``
    sharded (carries a ShardSpec); row base: ``lora_A.weight (r, in/p)`` sharded,
    ``lora_B.weight (out, r)`` replicated.
    Communication: exactly the base layer's collectives (forward all-reduce of a row base,
    backward all-reduce of a column base, all-gather of a gathering head), ``B*T*r`` values wider
    per adapter; no other.
    Dtype: the adapter's (PEFT keeps adapters in float32 for half-precision models); the
    collective runs in the wider of the two dtypes.
    Dropout: on the replicated input of a column base from the default stream (same mask on
    every TP rank); on the sharded input of a row base from the TP stream (tpify.random).

    Raises:
        ValueError: DoRA, ``lora_bias``, LoRA variants or initialisations that need the whole
            base weight (PiSSA, CorDA, OLoRA, LoftQ, MiCA): not supported on a sharded base.
    """

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs):
        unsupported = [name for name, on in (("use_dora", config.use_dora), ("lora_bias", config.lora_bias),
                                             ("init_lora_weights=" + str(config.init_lora_weights),
                                              isinstance(config.init_lora_weights, str)
                                              and config.init_lora_weights not in ("gaussian",)))
                       if on]
        for attr in ("velora_config", "arrow_config", "monteclora_config", "kasa_config", "alora_invocation_tokens"):
            if getattr(config, attr, None):
                unsupported.append(attr)
        if getattr(config, "use_bdlora", False):
            unsupported.append("use_bdlora")
        if unsupported:
            raise ValueError(f"tpify LoRA on tensor-parallel layers does not support {unsupported}; use plain LoRA "
                             f"(init_lora_weights=True or 'gaussian')")
        super().__init__()
        kwargs.pop("fan_in_fan_out", None)
        kwargs.pop("is_target_conv_1d_layer", None)
        with warnings.catch_warnings():  # PEFT warns that it cannot read in/out features of unknown layer types
            warnings.filterwarnings("ignore", message="Unsupported layer type")
            LoraLayer.__init__(self, base_layer, **kwargs)
        base = self.get_base_layer()
        self.is_row = isinstance(base, RowParallelLinear)
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

    def _factor_spec(self) -> tuple[str, ShardSpec]:
        """Which factor is sharded and how (:func:`tpify.sharding.lora_factor_spec`)."""
        base = self.get_base_layer()
        spec = shard_spec_of(base.weight)
        if not self.is_row and spec.replicated:
            raise NotImplementedError(
                f"tpify LoRA: {type(base).__name__} keeps packed parts {list(spec.replicated)} whole on every rank "
                f"(multi-query K/V); an adapter on it is not supported. Leave this module out of target_modules "
                f"(adapt the other projections)")
        return lora_factor_spec(spec, self.is_row, base.in_features)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """PEFT's dense adapter (same init as on the dense model), then this rank's slice of one factor."""
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        base = self.get_base_layer()
        which, spec = self._factor_spec()
        linear = getattr(self, which)[adapter_name]
        dense = linear.weight
        local = nn.Parameter(spec.slice_dense(dense.detach(), base.tp_rank), requires_grad=dense.requires_grad)
        local.tp_shard_spec = spec
        linear.weight = local
        if which == "lora_A":
            linear.in_features = local.shape[1]
        else:
            linear.out_features = local.shape[0]

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Base output plus the active adapters' ``s B A x``, with the base layer's collectives only.

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

    def _adapter_inputs(self, x: torch.Tensor, adapters: list[str], stream: str) -> list[torch.Tensor]:
        """``A_a dropout(x)`` per adapter ``(B, T, r)``, the dropout drawn from ``stream``."""
        hs = []
        for a in adapters:
            lora_a = self.lora_A[a]
            with self._rng.on(stream) if self._rng is not None else contextlib.nullcontext():
                xd = self.lora_dropout[a](self._cast_input_dtype(x, lora_a.weight.dtype))
            hs.append(lora_a(xd))
        return hs

    def _column(self, base: ColumnParallelLinear, x: torch.Tensor, adapters: list[str], gather: bool) -> torch.Tensor:
        # x is replicated on every rank: the same dropout mask everywhere (the shared stream)
        if base.sequence_parallel:
            return self._column_sequence_parallel(base, x, adapters, gather)
        hs = self._adapter_inputs(x, adapters, DEFAULT)  # (B, T, r) each
        # one all-reduce of dX and dh backward (the layer keeps its own, not the entry it would share
        # with the other layers reading x: dh needs an all-reduce anyway, and dX rides on it)
        x, *hs = comm.copy_many_to_tp_region([x, *hs], base.tp_group)
        y = _matmul(x, base.weight, base.bias, base.weight_layout)  # (B, T, out/p)
        dtype = y.dtype
        for a, h in zip(adapters, hs):
            y = y + self.lora_B[a](h).to(dtype) * self.scaling[a]
        return base.gather(y) if gather else y

    def _column_sequence_parallel(self, base: ColumnParallelLinear, x: torch.Tensor, adapters: list[str],
                                  gather: bool) -> torch.Tensor:
        """Under sequence parallelism ``x`` is the all-gathered input ``(B, T, H)``, whose region entry
        reduce-scatters the summed input gradient of every reader: the base layer shares it, and the
        adapter's ``A^T dh`` reaches it through autograd (a partial sum per rank, summed there). ``dh``
        itself is a partial sum (each rank's rows of ``B``), so ``A``'s gradient is summed over the
        group (one all-reduce of ``r x H`` values in backward) instead of ``dh``."""
        hs = []
        for a in adapters:
            lora_a = self.lora_A[a]
            with self._rng.on(DEFAULT) if self._rng is not None else contextlib.nullcontext():
                xd = self.lora_dropout[a](self._cast_input_dtype(x, lora_a.weight.dtype))
            weight, = comm.sum_grad_ranges([lora_a.weight], [(0, [(0, lora_a.weight.shape[0])])], base.tp_group)
            hs.append(F.linear(xd, weight))  # (B, T, r)
        y = base(x, runtime_gather_output=False)  # (B, T, out/p)
        dtype = y.dtype
        for a, h in zip(adapters, hs):
            y = y + self.lora_B[a](h).to(dtype) * self.scaling[a]
        return base.gather(y) if gather else y

    def _row(self, base: RowParallelLinear, x: torch.Tensor, adapters: list[str], scatter: bool) -> torch.Tensor:
        if not base.input_is_parallel:
            x = comm.scatter_to_tp_region(x, base.tp_group)
        partial = _matmul(x, base.weight, None, base.weight_layout)  # (B, T, out), partial sum
        hs = self._adapter_inputs(x, adapters, TP)  # sharded input: TP-distinct masks; (B, T, r) partial sums
        wide = partial.dtype
        for h in hs:
            wide = torch.promote_types(wide, h.dtype)
        # the base layer's one collective, r wider: all-reduce, or reduce-scatter along T (sequence parallelism)
        summed = base.collect(torch.cat([partial.to(wide), *(h.to(wide) for h in hs)], dim=-1), scatter)
        y, *hs = summed.split([base.out_features] + [h.shape[-1] for h in hs], dim=-1)
        y = base.add_bias(y.to(partial.dtype), scatter)
        for a, h in zip(adapters, hs):
            weight = self.lora_B[a].weight
            if scatter:  # B meets this rank's T/p tokens only: its gradient is a partial sum
                weight, = comm.sum_grad_ranges([weight], [(0, [(0, weight.shape[0])])], base.tp_group)
            y = y + F.linear(h.to(weight.dtype), weight).to(y.dtype) * self.scaling[a]
        return y

    # -- merging ----------------------------------------------------------------------------
    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``s B A`` for this rank's shard of the base weight, in the base weight's layout and dtype."""
        base = self.get_base_layer()
        delta = (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]
        if base.weight_layout == "conv1d":
            delta = delta.T
        return delta.to(base.weight.dtype)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """Add the adapters' ``s B A`` slices to this rank's base shard (no communication)."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        base = self.get_base_layer()
        for a in check_adapters_to_merge(self, adapter_names):
            if a not in self.lora_A:
                continue
            delta = self.get_delta_weight(a)
            if safe_merge and not torch.isfinite(base.weight.data + delta).all():
                raise ValueError(f"NaNs detected in the merged weights; adapter {a} seems to be broken")
            base.weight.data += delta
            self.merged_adapters.append(a)

    def unmerge(self) -> None:
        """Subtract the merged adapters' slices again."""
        base = self.get_base_layer()
        while self.merged_adapters:
            a = self.merged_adapters.pop()
            if a in self.lora_A:
                base.weight.data -= self.get_delta_weight(a)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def _adapter_tensors(peft_model: nn.Module):
    """``(name, tensor)`` of what PEFT saves (LoRA factors, modules_to_save), in a fixed order."""
    return [(n, p) for n, p in peft_model.named_parameters() if "lora_" in n or "modules_to_save" in n]


def save_adapter(peft_model: PeftModel, save_directory, **kwargs) -> None:
    """Write the dense adapter directory of a PEFT model on a tpify model (a collective).

    Every sharded factor is all-gathered to its dense shape, then global rank 0 writes with
    PEFT's own ``save_pretrained`` (``adapter_model.safetensors`` + ``adapter_config.json``), so
    plain ``peft.PeftModel.from_pretrained(dense_model, dir)`` loads it. Installed as the PEFT
    model's ``save_pretrained`` by :func:`get_peft_model`; every rank must call it.

    Communication: one all-gather over TP per sharded factor (under FSDP2, before it, one
    all-gather over DP per factor); one all-reduce of one int over the world
    (:func:`tpify.agree.on_writing_rank`: a failed write raises on every rank).

    Raises:
        TPUsageError: ``state_dict=`` given (local shards cannot be the dense adapter).
    """
    from ..agree import on_writing_rank

    if kwargs.pop("state_dict", None) is not None:
        raise TPUsageError("save_pretrained of a tensor-parallel PEFT model takes no state_dict=; every rank calls "
                           "it and the dense adapter is gathered")
    kwargs.pop("is_main_process", None)
    from ..info import param_specs
    from ..sharding import is_dtensor

    group = get_tp_info(peft_model).tp_group
    specs = param_specs(peft_model)  # also for DTensor factors (FSDP2), by the names recorded
    full = {}
    for name, t in _adapter_tensors(peft_model):
        spec = specs[id(t)]
        local = t.detach().full_tensor() if is_dtensor(t) else t.detach()  # FSDP2: gathered over DP first
        value = spec.gather(local, group) if spec is not None else local
        full[name] = value.cpu()
    with on_writing_rank(f"writing the adapter to {save_directory}", next(peft_model.parameters()).device) as writing:
        if writing:
            kwargs.setdefault("save_embedding_layers", False)
            PeftModel.save_pretrained(peft_model, str(save_directory), state_dict=full, is_main_process=True,
                                      safe_serialization=True, **kwargs)


def load_adapter_(peft_model: PeftModel, path, adapter_name: str = "default") -> None:
    """Read a dense adapter directory (as :func:`save_adapter` writes) into the adapters in place.

    Each rank copies its slice of each sharded factor (under FSDP2, its slice of that);
    no communication.

    Raises:
        TPUsageError: a tensor the adapters need is missing, or has another shape.
    """
    from peft.utils import load_peft_weights

    from ..info import param_specs
    from ..sharding import copy_local_

    info = get_tp_info(peft_model)
    saved = load_peft_weights(str(path), device="cpu")
    specs = param_specs(peft_model)  # also for DTensor factors (FSDP2)
    problems = []
    with torch.no_grad():
        for name, t in _adapter_tensors(peft_model):
            key = name.replace(f".{adapter_name}", "")
            value = saved.get(key)
            spec = specs[id(t)]
            if value is None:
                problems.append(f"missing {key}")
                continue
            try:
                local = spec.slice_dense(value, info.tp_rank) if spec is not None else value
            except ValueError as e:
                problems.append(f"{key}: {e}")
                continue
            if local.shape != t.shape:
                problems.append(f"{key} has shape {list(value.shape)}")
                continue
            copy_local_(t, local)  # under FSDP2, this rank's slice of its TP shard
    if problems:
        raise TPUsageError(f"adapter {path} does not fit the model's adapters: {problems[:10]}")


def get_peft_model(model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default", **kwargs) -> PeftModel:
    """``peft.get_peft_model`` for a tpify-parallelized model: LoRA on tensor-parallel layers.

    Registers :class:`LoraTPLinear` for ``ColumnParallelLinear`` and ``RowParallelLinear`` in
    ``peft_config`` (PEFT's custom-module extension point), calls ``peft.get_peft_model``, and
    makes the returned model's ``save_pretrained`` write the dense adapter (:func:`save_adapter`).
    Only the adapters (and ``modules_to_save``) train, as in PEFT. Call it with the same random
    state on every rank (the adapters are initialised like PEFT's, identically on every rank).

    Under FSDP2 (:func:`tpify.shard_data_parallel`), call it before sharding: the factors'
    ShardSpecs are recorded by name here (:func:`tpify.info.record_specs`), so clipping, the
    replica check and :func:`save_adapter` know their split once they are DTensors.

    Communication: none.

    Raises:
        ValueError: ``model`` was not parallelized by tpify.
        TPUsageError: a PEFT method other than LoRA; a model FSDP2 already sharded (add the
            adapters first).
    """
    get_tp_info(model)
    from ..info import record_specs
    from ..sharding import is_dtensor

    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError("get_peft_model: the model's parameters are DTensors (FSDP2's fully_shard); add the "
                           "adapters before sharding: get_peft_model first, then tpify.shard_data_parallel")
    if not isinstance(peft_config, LoraConfig):
        raise TPUsageError(f"tpify supports LoRA adapters on tensor-parallel models, not {type(peft_config).__name__}")
    peft_config._register_custom_module({ColumnParallelLinear: LoraTPLinear, RowParallelLinear: LoraTPLinear})
    peft_model = _peft_get_peft_model(model, peft_config, adapter_name=adapter_name, **kwargs)
    peft_model.save_pretrained = types.MethodType(save_adapter, peft_model)
    record_specs(model)  # the factors' specs and the base weights' new names, read back under FSDP2
    return peft_model
