"""bitsandbytes 8-bit (LLM.int8) bases under tensor parallelism, sharded by rank.

transformers' ``BitsAndBytesConfig(load_in_8bit=True)`` stores each ``nn.Linear`` / ``Conv1D``
weight ``W`` ``[out, in]`` (``Conv1D`` transposed) as bitsandbytes' ``Int8Params``: int8 codes
``CB = round(W * 127 / SCB)`` with one float32 absmax per output row ``SCB_o = max_i |W_oi|``
(``int8_vectorwise_quant`` on the float16 weight; Dettmers et al., arXiv:2208.07339). Its matmul
(``bnb.matmul``) takes one of two paths:

* ``MatMul8bitFp`` (CPU and XPU, module in training mode): ``y = x (CB * SCB / 127)^T + b``, the
  weight dequantized and a float matmul;
* ``MatMul8bitLt`` (CUDA, or any device in eval mode): each activation row quantized to int8 by its
  absmax over **all** input features, with the input columns holding a value above
  ``llm_int8_threshold`` kept in float (outlier columns), then an int8 matmul.

Here each rank holds the int8 form of its Megatron shard (arXiv:1909.08053, section 3), quantized
and computed with bitsandbytes' own functions (``int8_vectorwise_quant``, ``bnb.matmul``).

**Weights: sharding equals quantizing.** Column-parallel (whole rows): a row's ``SCB`` depends on
that row alone, so quantizing the shard gives the dense codes and scales of its rows bit for bit.
Row-parallel (columns ``[a, b)`` of every row): ``SCB`` is a max over all input features. Each rank
takes its shard's per-row absmax, the TP group all-reduces them with MAX (at load time), and each
rank runs ``int8_vectorwise_quant`` on its shard with one column appended that holds the dense
absmax: the function's row statistic is then the dense ``SCB`` and its codes of the shard's columns
are the dense codes' columns (the appended column is dropped). No quantization arithmetic of ours.

**Activations.** bitsandbytes' API takes no row statistics from outside (``MatMul8bitLt`` calls
``int8_vectorwise_quant`` / ``int8_double_quant`` on the input it is given), so a row-parallel
shard cannot be made to use the dense rows' absmax, nor the dense outlier columns, without a
quantization kernel of ours. Hence what is built, exact against the dense 8-bit model:

* column-parallel, on both paths (its input is whole, so its activation rows and outlier columns
  are the dense ones);
* row-parallel on the ``MatMul8bitFp`` path (input on CPU/XPU, module in training mode), equal to
  the dense layer up to float summation order (each rank's partial product, then the all-reduce).

A row-parallel layer at ``tp_size > 1`` called on the ``MatMul8bitLt`` path (eval mode, or a CUDA
input) raises a ``TPUsageError`` naming it, on every rank, before its all-reduce: it would not equal
the dense 8-bit model. Also refused: ``llm_int8_has_fp16_weight=True`` (its weights train: full
fine-tuning), ``llm_int8_enable_fp32_cpu_offload``, the styles without a quantized form (as 4-bit),
pre-quantized 8-bit checkpoints (not built: quantize from the dense checkpoint).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from .layers import ColumnParallelLinear, RowParallelLinear
from .quantized import QuantizedColumnParallelLinear, QuantizedRowParallelLinear, convert_layers
from .sharding import shard_spec_of

__all__ = ["Int8Spec", "is_int8_config", "int8_spec", "quantize_int8_",
           "Int8LtColumnParallelLinear", "Int8LtRowParallelLinear"]


def is_int8_config(config) -> bool:
    """Whether ``config`` is a ``transformers.BitsAndBytesConfig`` (or its dict) with ``load_in_8bit=True``."""
    if isinstance(config, dict):
        return bool(config.get("load_in_8bit", False))
    return bool(getattr(config, "load_in_8bit", False)) and type(config).__name__ == "BitsAndBytesConfig"


@dataclass(frozen=True)
class Int8Spec:
    """What tpify reads from ``BitsAndBytesConfig(load_in_8bit=True)``.

    Attributes:
        threshold: ``llm_int8_threshold``: an input value above it puts its column on the float
            (outlier) path of ``MatMul8bitLt``.
        skip: ``llm_int8_skip_modules``, matched as for 4-bit.
    """

    threshold: float = 6.0
    skip: tuple[str, ...] = ()
    quant_type = "int8"
    blocksize = 1  # per output row: no element block a split could cut (the row-parallel absmax is all-reduced)
    double_quant = False
    skip_option = "llm_int8_skip_modules"

    def skips(self, fqn: str) -> bool:
        return any(fqn == s or fqn.endswith("." + s) or s in fqn.split(".") for s in self.skip)

    def quantizes(self, module: nn.Module | None) -> bool:
        """transformers' bitsandbytes quantizer converts ``nn.Linear`` and GPT-2's ``Conv1D`` (the style decides)."""
        return True

    def label(self) -> str:
        return "bitsandbytes int8 (LLM.int8), one absmax per output row"


def int8_spec(config) -> Int8Spec:
    """Validate ``BitsAndBytesConfig(load_in_8bit=True)`` (or its dict) and return what tpify builds.

    Raises:
        ImportError: bitsandbytes is not installed.
        NotImplementedError: ``llm_int8_has_fp16_weight=True`` (trainable 8-bit weights: full
            fine-tuning), ``llm_int8_enable_fp32_cpu_offload=True``.
    """
    from transformers import BitsAndBytesConfig

    if isinstance(config, dict):
        config = BitsAndBytesConfig(**config)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("quantization_config=BitsAndBytesConfig(load_in_8bit=True) needs the package bitsandbytes: "
                          "pip install bitsandbytes (or tpify[quant])")
    if config.llm_int8_has_fp16_weight:
        raise NotImplementedError("BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True): its weights "
                                  "train (full fine-tuning of the base), not built; pass False and train LoRA adapters")
    if config.llm_int8_enable_fp32_cpu_offload:
        raise NotImplementedError("BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True): CPU offload is not "
                                  "built in tpify's tensor-parallel layers; pass False")
    return Int8Spec(float(config.llm_int8_threshold), tuple(config.llm_int8_skip_modules or ()))


class _Int8Lt:
    """What the 8-bit column- and row-parallel layers share: the int8 codes ``weight_CB``
    ``(out_local, in_local)`` of this rank's shard and its row absmax ``weight_SCB`` ``(out_local,)``
    float32 (whole rows: the dense values on a row-parallel layer), buffers (no gradient); the
    dequantized ``weight`` (read-only) and the local matmul (``bnb.matmul``)."""

    def _set_int8(self, cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype, threshold: float) -> None:
        self.register_buffer("weight_CB", cb, persistent=False)
        self.register_buffer("weight_SCB", scb, persistent=False)
        for b in (self.weight_CB,) + ((self.weight_SCB,) if self._scale_sharded else ()):
            if self.weight_shard_spec is not None:
                b.tp_shard_spec = self.weight_shard_spec
        self.quant_dtype, self.quant_type, self.llm_int8_threshold = dtype, "int8", threshold
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @property
    def weight(self) -> torch.Tensor:
        """This rank's shard dequantized ``CB * SCB / 127`` (as ``MatMul8bitFp`` computes it), in the
        layer's layout and the dtype it was quantized from; carries the dense weight's ShardSpec; read-only."""
        w = self.weight_CB.to(self.quant_dtype).mul_(self.weight_SCB.unsqueeze(1).mul(1.0 / 127.0))
        w = w.t() if self.weight_layout == "conv1d" else w
        if self.weight_shard_spec is not None:
            w.tp_shard_spec = self.weight_shard_spec
        return w

    def _lt_path(self, x: torch.Tensor) -> bool:
        """Whether ``bnb.matmul`` takes ``MatMul8bitLt`` (activation rows quantized) for this call."""
        return not (self.training and x.device.type in ("cpu", "xpu"))

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x deq(CB_r)^T + b`` on this rank's shard, as ``Linear8bitLt`` computes it (``bnb.matmul``
        with a ``MatmulLtState`` holding the codes, ``is_training`` = the module's mode).
        ``(B, T, in_local) -> (B, T, out_local)`` in ``x``'s dtype; no communication.

        Raises:
            TPUsageError: the bias takes a gradient (full fine-tuning of a quantized base).
        """
        import bitsandbytes as bnb
        from bitsandbytes.autograd._functions import MatmulLtState

        if torch.is_grad_enabled() and self.bias is not None and self.bias.requires_grad:
            from .info import TPUsageError

            raise TPUsageError(f"{type(self).__name__}: full fine-tuning of a quantized base is not supported; "
                               f"train adapters on it (tpify.integrations.get_peft_model)")
        state = MatmulLtState()
        state.CB, state.SCB, state.threshold = self.weight_CB, self.weight_SCB, self.llm_int8_threshold
        state.has_fp16_weights, state.is_training = False, self.training
        return bnb.matmul(x, self.weight_CB, bias=None if bias is None else bias.to(x.dtype), state=state)

    def quantized_bytes(self) -> int:
        """Bytes of this rank's quantized weight: codes and row absmax."""
        return sum(b.numel() * b.element_size() for b in (self.weight_CB, self.weight_SCB))

    def _quant_repr(self) -> str:
        return f", quant_type=int8 (bitsandbytes LLM.int8, threshold={self.llm_int8_threshold})"


class Int8LtColumnParallelLinear(_Int8Lt, QuantizedColumnParallelLinear):
    """:class:`~tpify.layers.ColumnParallelLinear` whose shard is bitsandbytes 8-bit (module doc).

    ``Y_r = copy(X) deq(CB_r)^T + b_r``; ``CB_r``, ``SCB_r``: the dense codes and absmax of this rank's
    rows. Exact on both of bitsandbytes' paths (its input rows are whole).
    Shapes: input ``(B, T, in_features)``; output ``(B, T, out_features_per_partition)`` (or gathered).
    Communication: as :class:`tpify.quantized.QuantizedColumnParallelLinear`.
    Raises: as it (a bias that takes a gradient, ``return_input``).
    """

    _scale_sharded = True


class Int8LtRowParallelLinear(_Int8Lt, QuantizedRowParallelLinear):
    """:class:`~tpify.layers.RowParallelLinear` whose shard is bitsandbytes 8-bit (module doc).

    ``Y = reduce(X_r deq(CB_r)^T) + b``: ``CB_r`` the dense codes' columns of this rank, ``SCB`` the
    dense row absmax, whole on every rank; the bias added once after the reduce.
    Shapes: input ``(B, T, in_features // tp_size)``; output ``(B, T, out_features)``.
    Communication: one all-reduce forward (as :class:`tpify.quantized.QuantizedRowParallelLinear`).
    Raises:
        TPUsageError: at ``tp_size > 1`` on bitsandbytes' ``MatMul8bitLt`` path (eval mode, or an
            input not on CPU/XPU), before the all-reduce: it quantizes each activation row of the
            shard by the shard's absmax, not the dense row's, so the sum would not equal the dense
            8-bit layer.
    """

    _scale_sharded = False

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.tp_size > 1 and self._lt_path(x):
            from .info import TPUsageError

            raise TPUsageError(
                f"{type(self).__name__} ({self.in_features} -> {self.out_features}, tp_size = {self.tp_size}): "
                f"bitsandbytes 8-bit takes its MatMul8bitLt path here (module in eval mode: {not self.training}, "
                f"input on {x.device.type}), which quantizes each activation row by its absmax over all "
                f"{self.in_features} input features; this rank sees {self.in_features // self.tp_size}, so the "
                f"result would not equal the dense 8-bit model. Row-parallel 8-bit is built on the MatMul8bitFp "
                f"path only (CPU/XPU input, model.train()); use load_in_4bit=True (exact everywhere) otherwise")
        return super().local_matmul(x, bias)


_INT8 = {ColumnParallelLinear: Int8LtColumnParallelLinear, RowParallelLinear: Int8LtRowParallelLinear}


def _dense_row_codes(shard: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CB_r, SCB)``: the dense 8-bit codes' columns of this rank ``(out, in_local)`` int8 and the
    dense row absmax ``(out,)`` float32, from this rank's columns ``shard`` ``(out, in_local)`` float16.
    Each rank's row absmax is all-reduced (MAX), appended as one column, and bitsandbytes'
    ``int8_vectorwise_quant`` quantizes ``[shard | absmax]``: its row statistic is the dense one.
    Communication: one all-reduce (MAX) over the TP group of ``(out,)`` float32.
    """
    import bitsandbytes.functional as bnbf

    from . import comm

    absmax = comm.all_reduce(shard.abs().amax(dim=1).float(), tp_group, op="max")  # (out,), exact fp16 values
    cb, scb, _ = bnbf.int8_vectorwise_quant(torch.cat([shard, absmax.to(shard.dtype).unsqueeze(1)], dim=1))
    return cb[:, :-1].contiguous(), scb


def quantize_int8_(model: nn.Module, fqns: list[str], spec: Int8Spec) -> nn.Module:
    """Quantize, in place, the parallel layers ``fqns`` (from :func:`tpify.quantized.check_layout`) to
    bitsandbytes 8-bit: each rank's codes and row absmax equal the dense ``Int8Params``' restricted to
    its shard (module doc). The layer objects stay (their class becomes the 8-bit subclass); every
    parameter of the model is frozen afterwards (adapters train on top).

    Communication: one all-reduce (MAX) per row-parallel layer at ``tp_size > 1``, ``(out,)`` float32
    (:func:`_dense_row_codes`), at load time.

    Raises:
        TypeError: a listed module is not a ColumnParallelLinear or RowParallelLinear.
    """
    import bitsandbytes.functional as bnbf

    def convert(fqn: str, layer: nn.Module, cls: type) -> None:
        param = layer._parameters.pop("weight")
        layer.__class__ = cls
        layer.weight_shard_spec = shard_spec_of(param)
        w = param.detach()
        w = (w.t() if layer.weight_layout == "conv1d" else w).contiguous().to(torch.float16)  # (out_l, in_l), as Int8Params
        if cls is Int8LtRowParallelLinear and layer.tp_size > 1:
            cb, scb = _dense_row_codes(w, layer.tp_group)
        else:
            cb, scb, _ = bnbf.int8_vectorwise_quant(w)
        layer._set_int8(cb, scb, param.dtype, spec.threshold)

    return convert_layers(model, fqns, _INT8, spec, convert)
