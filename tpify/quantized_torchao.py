"""torchao int8 weight-only and NF4 bases under tensor parallelism, sharded by rank.

torchao's ``Int8WeightOnlyConfig`` (transformers: ``TorchAoConfig(Int8WeightOnlyConfig())``) stores
each ``nn.Linear`` weight ``W`` ``[out, in]`` as int8 codes ``Q`` with one float32 scale per output
row, symmetric: ``s_o = max(|min_i W_oi|, |max_i W_oi|) / 127.5`` (``choose_qparams_affine``),
``Q_oi = clamp(round(W_oi / s_o), -128, 127)``, and computes ``y = (x Q^T) * s + b`` (torchao's
``Int8Tensor`` linear). Here each rank holds the int8 form of its Megatron shard (arXiv:1909.08053,
section 3) of every column- and row-parallel layer, quantized and computed with torchao's own
functions (``Int8Tensor.from_hp``, ``choose_qparams_affine``, its ``F.linear``); no kernel of ours.

**Sharding equals quantizing.**

* column-parallel (whole rows, each packed part separately): a row's scale depends on that row
  alone, so quantizing the shard gives the dense codes and scales of its rows bit for bit;
* row-parallel (columns ``[a, b)`` of every row): a row's scale is a max over **all** its input
  features, which a shard does not see. Each rank takes its shard's per-row ``(min, max)``, the TP
  group all-gathers them (at load time), and every rank runs torchao's ``choose_qparams_affine`` on
  the gathered ``(min, max)`` values: a row's min and max over them are the dense row's, so the
  scale is the dense scale bit for bit, kept whole ``(out, 1)`` on every rank; the shard's codes
  are then ``quantize_affine`` with it, elementwise, hence the dense codes' columns ``[a, b)``.
  ``Y = reduce(X_r Q_r^T) * s``: torchao multiplies by ``s`` after each rank's partial product, the
  dense model after the whole sum, equal up to float summation order.

So every split that tpify's layout takes is exact (no block constraint, unlike 4-bit:
:mod:`tpify.quantized`). transformers quantizes ``nn.Linear`` modules only, so GPT-2's ``Conv1D``
layers stay unquantized here as in the dense torchao model.

**torchao NF4** (``TorchAoConfig(NF4WeightOnlyConfig())``, ``torchao.prototype._nf4tensor_api``;
QLoRA's format as torchao/torchtune store it, arXiv:2305.14314): ``NF4Tensor`` codes per block of
64 elements of the flattened weight, the block absmax double-quantized (minus their mean over the
whole weight, int8 in blocks of 256 scalers). Each rank's ``NF4Tensor`` dequantizes bit for bit
to the dense one's slice: its codes are its blocks' own, its scalers come from torchao's
``double_quantize_scalers`` run on the all-gathered dense absmax (:func:`_nf4_shard`), and where a
split cuts a scaler block the local ``scaler_block_size`` shrinks to runs that stay in one dense
block. Refused (:class:`~tpify.layout.PlanError`): a split that cuts a block of 64, a weight whose
size is not a multiple of 64 x 256 (torchao refuses it dense). Forward: torchao's ``linear_nf4``.

**What is built** (everything else raises, by name): ``Int8WeightOnlyConfig`` with the default
``granularity=PerRow()`` (version 2) and ``NF4WeightOnlyConfig``, ``include_input_output_embeddings=False``,
on layers of styles ``colwise``, ``packed_colwise``, ``rowwise``. Refused: ``PerTensor`` / ``PerGroup``
granularities, every other torchao config (``Int4WeightOnlyConfig``, ``Int8DynamicActivationInt8WeightConfig``,
float8, ``FqnToConfig``), quantized embeddings, an LM head that transformers would quantize
(``modules_to_not_convert`` given without it), checkpoints saved by torchao.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from .hf_modules import dense_dims
from .layers import ColumnParallelLinear, RowParallelLinear
from .layout import PlanError
from .quantized import (_KEPT_STYLES, QuantizedColumnParallelLinear, QuantizedRowParallelLinear, _byte_ranges,
                        check_layout, convert_layers)
from .sharding import shard_spec_of

__all__ = ["TorchAoSpec", "is_torchao_config", "torchao_spec", "check_torchao_layout", "quantize_torchao_",
           "Int8ColumnParallelLinear", "Int8RowParallelLinear", "NF4ColumnParallelLinear", "NF4RowParallelLinear"]


def is_torchao_config(config) -> bool:
    """Whether ``config`` is transformers' ``TorchAoConfig`` (or its dict, ``quant_method="torchao"``)."""
    if isinstance(config, dict):
        return config.get("quant_method") == "torchao"
    try:
        from transformers import TorchAoConfig
    except ImportError:
        return False
    return isinstance(config, TorchAoConfig)


@dataclass(frozen=True)
class TorchAoSpec:
    """What tpify reads from a ``transformers.TorchAoConfig`` (int8 weight-only per output row, or NF4).

    Attributes:
        quant_type: ``"int8_weight_only"`` or ``"nf4"``.
        skip: transformers' ``modules_to_not_convert`` patterns (None: its defaults, the output
            embeddings and ``_keep_in_fp32_modules``, resolved on the model by
            :func:`check_torchao_layout`).
        blocksize: elements of the flattened ``[out, in]`` weight per quantization block that a split
            must not cut: 1 for int8 (per row; the row-parallel scale is gathered), NF4's
            ``block_size`` (64).
        scaler_blocksize: NF4's ``scaler_block_size`` (256): block scalers per double-quantization
            block (0 for int8).
    """

    quant_type: str = "int8_weight_only"
    skip: tuple[str, ...] | None = None
    blocksize: int = 1
    scaler_blocksize: int = 0
    skip_option = "TorchAoConfig(modules_to_not_convert=...)"

    def skips(self, fqn: str) -> bool:
        """As transformers' ``TorchAoHfQuantizer.param_needs_quantization`` reads ``modules_to_not_convert``."""
        from transformers.quantizers.quantizers_utils import should_convert_module

        return not should_convert_module(fqn + ".weight", list(self.skip or ()))

    def quantizes(self, module: nn.Module | None) -> bool:
        """transformers' torchao quantizer converts ``nn.Linear`` weights only (GPT-2's ``Conv1D`` stays)."""
        return isinstance(module, nn.Linear)

    def label(self) -> str:
        if self.quant_type == "nf4":
            return (f"torchao NF4, blocks of {self.blocksize}, scalers double-quantized in blocks of "
                    f"{self.scaler_blocksize}")
        return "torchao int8 weight-only, one scale per output row"


def torchao_spec(config) -> TorchAoSpec:
    """Validate a ``transformers.TorchAoConfig`` and return what tpify builds from it.

    Raises:
        ImportError: torchao is not installed (``pip install torchao``, or ``tpify[quant]``).
        NotImplementedError: a torchao config other than ``Int8WeightOnlyConfig(granularity=PerRow())``
            and ``NF4WeightOnlyConfig`` (named, with the reason), ``include_input_output_embeddings=True``,
            an odd NF4 ``block_size``.
    """
    if importlib.util.find_spec("torchao") is None:
        raise ImportError("quantization_config=TorchAoConfig(...) needs the package torchao: pip install torchao "
                          "(or tpify[quant])")
    from transformers import TorchAoConfig

    if isinstance(config, dict):
        config = TorchAoConfig.from_dict(dict(config))
    from torchao.quantization import Int8WeightOnlyConfig, PerRow

    qt = config.quant_type
    name = type(qt).__name__
    if name == "NF4WeightOnlyConfig" and type(qt).__module__.startswith("torchao"):
        skip = None if config.modules_to_not_convert is None else tuple(config.modules_to_not_convert)
        if config.include_input_output_embeddings:
            raise NotImplementedError("TorchAoConfig(include_input_output_embeddings=True): quantized embeddings and "
                                      "LM head are not built in tpify (they stay unquantized); pass False")
        block, scaler_block = int(qt.block_size), int(qt.scaler_block_size)
        if block < 2 or block % 2:
            raise NotImplementedError(f"TorchAoConfig(NF4WeightOnlyConfig(block_size={block})): an even block size "
                                      f"is needed (two 4-bit codes per byte); torchao's default is 64")
        return TorchAoSpec("nf4", skip, block, scaler_block)
    if not isinstance(qt, Int8WeightOnlyConfig):
        why = {"Int8DynamicActivationInt8WeightConfig": " (quantizes each activation row over all its input "
                                                        "features, which a row-parallel shard does not see)"}
        raise NotImplementedError(
            f"quantization_config=TorchAoConfig({name}(...)): not built in tpify's tensor-parallel layers"
            f"{why.get(name, '')}; built: TorchAoConfig(Int8WeightOnlyConfig()) (int8 weight-only, one scale per "
            f"output row), TorchAoConfig(NF4WeightOnlyConfig()) (torchao NF4, from "
            f"torchao.prototype._nf4tensor_api) and bitsandbytes 4-bit (BitsAndBytesConfig(load_in_4bit=True))")
    gran = qt.granularity
    if not isinstance(gran, PerRow) or gran.dim not in (-1, 1):
        raise NotImplementedError(
            f"TorchAoConfig(Int8WeightOnlyConfig(granularity={gran!r})): not built; only the default "
            f"granularity=PerRow() (one scale per output row) is")
    if config.include_input_output_embeddings:
        raise NotImplementedError("TorchAoConfig(include_input_output_embeddings=True): quantized embeddings and LM "
                                  "head are not built in tpify (they stay unquantized); pass False")
    skip = None if config.modules_to_not_convert is None else tuple(config.modules_to_not_convert)
    return TorchAoSpec("int8_weight_only", skip)


def check_torchao_layout(model: nn.Module, layout, spec: TorchAoSpec) -> tuple[list[str], TorchAoSpec]:
    """``(the FQNs to quantize, the spec with transformers' skip list resolved on the model)``; pure,
    no collective. The skip list is transformers' (``get_modules_to_not_convert``: the given
    ``modules_to_not_convert``, or by default the output embeddings, plus ``_keep_in_fp32_modules``).

    Raises:
        PlanError: as :func:`tpify.quantized.check_layout` (a style without a quantized form, sequence
            parallelism, an uneven split, an NF4 split that cuts a block of 64), an ``nn.Linear`` tpify
            keeps unquantized (the LM head) that transformers would quantize under this config, and
            under NF4 a weight whose size is not a multiple of ``block_size * scaler_block_size``.
    """
    from transformers.quantizers.base import HfQuantizer

    skip = HfQuantizer.get_modules_to_not_convert(model, list(spec.skip) if spec.skip is not None else None,
                                                  getattr(model, "_keep_in_fp32_modules", None))
    spec = dataclasses.replace(spec, skip=tuple(sorted(skip)))
    modules = dict(model.named_modules())
    kept = [fqn for fqn, ml in sorted(layout.modules.items()) if ml.style in _KEPT_STYLES
            and isinstance(modules.get(fqn), nn.Linear) and not spec.skips(fqn)]
    if kept:
        raise PlanError(f"{', '.join(kept)}: transformers' TorchAoConfig would quantize it (modules_to_not_convert="
                        f"{list(spec.skip)}), tpify keeps the LM head unquantized; add it to modules_to_not_convert")
    if spec.quant_type == "nf4":  # torchao's NF4Tensor.from_tensor asserts this on the dense weight itself
        unit, bad = spec.blocksize * spec.scaler_blocksize, []
        for fqn, ml in sorted(layout.modules.items()):
            module = modules.get(fqn)
            if ml.style in _KEPT_STYLES or not isinstance(module, nn.Linear) or spec.skips(fqn):
                continue
            in_f, out_f, _ = dense_dims(module)
            if (in_f * out_f) % unit:
                bad.append(f"{fqn} [{out_f}, {in_f}] ({in_f * out_f} elements)")
        if bad:
            raise PlanError(f"torchao NF4 quantizes a weight whose number of elements is a multiple of block_size x "
                            f"scaler_block_size = {spec.blocksize} x {spec.scaler_blocksize} = {unit} only (its "
                            f"NF4Tensor.from_tensor refuses the dense weight too): {', '.join(bad)}; list them in "
                            f"TorchAoConfig(modules_to_not_convert=...) to keep them unquantized")
    return check_layout(model, layout, spec), spec


class _Int8:
    """What the int8 column- and row-parallel layers share: the codes of this rank's shard ``(out_local,
    in_local)`` int8, the per-row scales ``(out_local, 1)`` float32 (whole on a row-parallel layer) and
    zero points (buffers: no gradient), the dequantized ``weight`` (read-only) and the local matmul
    (torchao's ``Int8Tensor`` linear)."""

    def _set_int8(self, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  dtype: torch.dtype) -> None:
        self.register_buffer("weight_qdata", qdata, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("weight_zero_point", zero_point, persistent=False)
        for b in (self.weight_qdata,) + ((self.weight_scale, self.weight_zero_point) if self._scale_sharded else ()):
            if self.weight_shard_spec is not None and b is not None:
                b.tp_shard_spec = self.weight_shard_spec
        self.quant_dtype, self.quant_type = dtype, "int8_weight_only"
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def int8_tensor(self):
        """torchao's ``Int8Tensor`` of this rank's shard, built from the buffers (follows ``.to``)."""
        from torchao.quantization import Int8Tensor

        return Int8Tensor(self.weight_qdata, self.weight_scale, [1, self.weight_qdata.shape[1]], self.quant_dtype,
                          zero_point=self.weight_zero_point)

    @property
    def weight(self) -> torch.Tensor:
        """This rank's shard dequantized ``(out_local, in_local)`` in the dtype it was quantized from,
        carrying the dense weight's ShardSpec; read-only (merging is refused)."""
        w = self.int8_tensor().dequantize()
        if self.weight_shard_spec is not None:
            w.tp_shard_spec = self.weight_shard_spec
        return w

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``(x Q_r^T) * s + b`` on this rank's shard, torchao's ``Int8Tensor`` linear (the int8 codes
        cast to ``x``'s dtype, the scale applied to the product). ``(B, T, in_local) -> (B, T, out_local)``;
        no communication.

        Raises:
            TPUsageError: the bias takes a gradient (full fine-tuning of a quantized base).
        """
        if torch.is_grad_enabled() and self.bias is not None and self.bias.requires_grad:
            from .info import TPUsageError

            raise TPUsageError(f"{type(self).__name__}: full fine-tuning of a quantized base is not supported; "
                               f"train adapters on it (tpify.integrations.get_peft_model)")
        return nn.functional.linear(x, self.int8_tensor(), None if bias is None else bias.to(x.dtype))

    def quantized_bytes(self) -> int:
        """Bytes of this rank's quantized weight: codes, scales, zero points."""
        return sum(b.numel() * b.element_size() for b in (self.weight_qdata, self.weight_scale, self.weight_zero_point)
                   if b is not None)

    def _quant_repr(self) -> str:
        return ", quant_type=int8_weight_only (torchao, per row)"


class Int8ColumnParallelLinear(_Int8, QuantizedColumnParallelLinear):
    """:class:`~tpify.layers.ColumnParallelLinear` whose shard is torchao int8 weight-only (module doc).

    ``Y_r = (copy(X) Q_r^T) * s_r + b_r``; ``Q_r``, ``s_r``: the dense codes and scales of this rank's rows.

    Shapes: input ``(B, T, in_features)``; output ``(B, T, out_features_per_partition)`` (or gathered).
    Communication: as :class:`tpify.quantized.QuantizedColumnParallelLinear`.
    Raises: as it (a bias that takes a gradient, ``return_input``).
    """

    _scale_sharded = True


class Int8RowParallelLinear(_Int8, QuantizedRowParallelLinear):
    """:class:`~tpify.layers.RowParallelLinear` whose shard is torchao int8 weight-only (module doc).

    ``Y = reduce((X_r Q_r^T) * s) + b``; ``Q_r`` the dense codes' columns of this rank, ``s`` the dense
    per-row scale, whole on every rank; the bias added once after the reduce.

    Shapes: input ``(B, T, in_features // tp_size)``; output ``(B, T, out_features)``.
    Communication: as :class:`tpify.quantized.QuantizedRowParallelLinear` (one all-reduce forward).
    """

    _scale_sharded = False


_INT8 = {ColumnParallelLinear: Int8ColumnParallelLinear, RowParallelLinear: Int8RowParallelLinear}


class _NF4:
    """What the NF4 column- and row-parallel layers share: the pieces of torchao's ``NF4Tensor`` of
    this rank's shard as buffers (no gradient, they follow ``.to``): the codes ``(numel_local / 2,)``
    uint8 (two per byte), the double-quantized block scalers ``(n_local,)`` int8 (one per block of
    64), their factors ``(n_local / s,)`` (one per local scaler block of ``s``, the dense block's
    factor), the dense scalers' mean ``()`` and the 16 NF4 values; the dequantized ``weight``
    (read-only) and the local matmul (torchao's NF4 linear: dequantize, then matmul)."""

    def _set_nf4(self, nf4, dtype: torch.dtype) -> None:
        for name, t in (("nf4_data", nf4.quantized_data), ("nf4_scalers", nf4.quantized_scalers),
                        ("nf4_factor", nf4.quantization_factor), ("nf4_mean", nf4.scaler_mean),
                        ("nf4_table", nf4.nf4)):
            self.register_buffer(name, t, persistent=False)
        for b in (self.nf4_data, self.nf4_scalers, self.nf4_factor):
            if self.weight_shard_spec is not None:
                b.tp_shard_spec = self.weight_shard_spec
        self.quant_shape, self.quant_dtype = tuple(nf4.shape), dtype
        self.quant_blocksize, self.nf4_scaler_blocksize = nf4.block_size, nf4.scaler_block_size
        self.quant_type = "nf4"
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def nf4_tensor(self):
        """torchao's ``NF4Tensor`` of this rank's shard ``(out_local, in_local)``, built from the buffers."""
        from torchao.quantization import NF4Tensor
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

        shape = torch.Size(self.quant_shape)
        meta = SubclassTensorArgs(shape, (shape[1], 1), 0, self.quant_dtype, self.nf4_data.device, False)
        return NF4Tensor(meta, self.quant_blocksize, self.nf4_scalers.numel(), self.nf4_scaler_blocksize,
                         self.nf4_scalers, self.nf4_factor, self.nf4_mean, self.nf4_data, self.nf4_table)

    @property
    def weight(self) -> torch.Tensor:
        """This rank's shard dequantized ``(out_local, in_local)`` in the dtype it was quantized from
        (torchao's ``NF4Tensor.get_original_weight``), carrying the dense weight's ShardSpec; read-only."""
        w = self.nf4_tensor().get_original_weight()
        if self.weight_shard_spec is not None:
            w.tp_shard_spec = self.weight_shard_spec
        return w

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x deq(Q_r)^T + b`` on this rank's shard, torchao's ``linear_nf4`` (the shard dequantized to
        ``x``'s dtype, then a matmul; backward dequantizes again instead of saving it).
        ``(B, T, in_local) -> (B, T, out_local)``; no communication.

        Raises:
            TPUsageError: the bias takes a gradient (full fine-tuning of a quantized base).
        """
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        if torch.is_grad_enabled() and self.bias is not None and self.bias.requires_grad:
            from .info import TPUsageError

            raise TPUsageError(f"{type(self).__name__}: full fine-tuning of a quantized base is not supported; "
                               f"train adapters on it (tpify.integrations.get_peft_model)")
        y = linear_nf4(x, self.nf4_tensor())
        return y if bias is None else y + bias.to(x.dtype)

    def quantized_bytes(self) -> int:
        """Bytes of this rank's NF4 weight: codes, scalers, factors, mean, the NF4 table."""
        return sum(b.numel() * b.element_size() for b in (self.nf4_data, self.nf4_scalers, self.nf4_factor,
                                                          self.nf4_mean, self.nf4_table))

    def _quant_repr(self) -> str:
        return (f", quant_type=nf4 (torchao), block_size={self.quant_blocksize}, "
                f"scaler_block_size={self.nf4_scaler_blocksize}")


class NF4ColumnParallelLinear(_NF4, QuantizedColumnParallelLinear):
    """:class:`~tpify.layers.ColumnParallelLinear` whose shard is torchao NF4 (module doc).

    ``Y_r = copy(X) deq(Q_r)^T + b_r``; ``deq(Q_r)`` bit for bit the dense ``NF4Tensor``'s rows of this rank.

    Shapes: input ``(B, T, in_features)``; output ``(B, T, out_features_per_partition)`` (or gathered).
    Communication: as :class:`tpify.quantized.QuantizedColumnParallelLinear`.
    Raises: as it (a bias that takes a gradient, ``return_input``).
    """


class NF4RowParallelLinear(_NF4, QuantizedRowParallelLinear):
    """:class:`~tpify.layers.RowParallelLinear` whose shard is torchao NF4 (module doc).

    ``Y = reduce(X_r deq(Q_r)^T) + b``; ``deq(Q_r)`` bit for bit the dense ``NF4Tensor``'s columns of
    this rank; the bias added once after the reduce.

    Shapes: input ``(B, T, in_features // tp_size)``; output ``(B, T, out_features)``.
    Communication: as :class:`tpify.quantized.QuantizedRowParallelLinear` (one all-reduce forward).
    """


_NF4_CLASSES = {ColumnParallelLinear: NF4ColumnParallelLinear, RowParallelLinear: NF4RowParallelLinear}


def _local_scaler_block(index: torch.Tensor, scaler_block: int) -> int:
    """The largest divisor ``s`` of ``scaler_block`` such that every run of ``s`` consecutive local
    block scalers (dense indices ``index`` ``(n_local,)``, in local order) lies in one dense scaler
    block of ``scaler_block``: the local ``NF4Tensor``'s ``scaler_block_size``, each local run carrying
    its dense block's factor. ``scaler_block`` where the split keeps the scaler blocks whole."""
    dense_block = index // scaler_block
    for s in range(scaler_block, 0, -1):
        if scaler_block % s or index.numel() % s:
            continue
        runs = dense_block.view(-1, s)
        if bool((runs == runs[:, :1]).all()):
            return s
    return 1


def _nf4_shard(w: torch.Tensor, shard_spec, tp_rank: int, tp_group, is_row: bool, spec: TorchAoSpec):
    """torchao's ``NF4Tensor`` of this rank's shard ``w`` ``(out_local, in_local)`` (split by
    ``shard_spec``: rows, or columns where ``is_row``) that dequantizes bit for bit to the dense
    ``NF4Tensor``'s slice.

    torchao (``NF4Tensor.double_quantize_scalers``) quantizes the dense weight's block absmax ``a``
    (one per 64 elements) again: ``m = a.mean()``, then ``a - m`` in blocks of 256 with one factor
    each. ``m`` and the blocks of 256 span the whole weight, so each rank's absmax (``get_block_absmax``
    on its shard: the dense blocks it holds, a split cutting none) are all-gathered and put in the
    dense order, every rank runs ``double_quantize_scalers`` on that vector (block size 1: the absmax
    of one scaler is itself) exactly as the dense quantization does, and keeps its own scalers,
    their blocks' factors and ``m``; the codes are the shard's own (``from_tensor``: each from its
    block's absmax alone). Where a split cuts a scaler block (a row-parallel shard; a column-parallel
    shard of rows not a multiple of 256 scalers), the local ``scaler_block_size`` is the largest run
    that stays in one dense scaler block (:func:`_local_scaler_block`), carrying that block's factor.

    Communication: one all-gather over the TP group of ``(n_local,)`` absmax in the weight's dtype.
    """
    from torchao.quantization import NF4Tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs, get_block_absmax

    from . import comm

    block, scaler_block = spec.blocksize, spec.scaler_blocksize
    if shard_spec is None or shard_spec.tp_size == 1:
        return NF4Tensor.from_tensor(w, block, scaler_block)
    out_f, in_f = (w.shape[0], shard_spec.global_size) if is_row else (shard_spec.global_size, w.shape[1])
    ranks = [torch.cat([torch.arange(a // block, b // block)
                        for a, b in _byte_ranges(shard_spec, in_f, out_f, r, is_row, block)])
             for r in range(shard_spec.tp_size)]  # every rank's dense block indices, in its order (pure)
    own = ranks[tp_rank]
    absmax = get_block_absmax(w.flatten(), block)  # (n_local,) the dense blocks' absmax
    gathered = comm.all_gather_dim(absmax.contiguous(), 0, tp_group)  # (tp * n_local,)
    dense = torch.empty(out_f * in_f // block, dtype=w.dtype, device=w.device)
    dense[torch.cat(ranks).to(w.device)] = gathered  # replicated K/V rows: written by each of their ranks, equal
    scalers, factor, mean = NF4Tensor.double_quantize_scalers(dense, 1, scaler_block)
    s = _local_scaler_block(own, scaler_block)
    own = own.to(w.device)
    local = NF4Tensor.from_tensor(w, block, s)  # its codes; its own scalers are replaced by the dense ones
    local_factor = factor[own.view(-1, s)[:, 0] // scaler_block].contiguous()  # (n_local / s,)
    meta = SubclassTensorArgs(w.shape, w.stride(), 0, w.dtype, w.device, False)
    return NF4Tensor(meta, block, own.numel(), s, scalers[own].contiguous(), local_factor, mean,
                     local.quantized_data, local.nf4)


def _row_scale(shard: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense weight's per-row ``(scale, zero_point)`` ``(out, 1)`` from this rank's columns
    ``shard`` ``(out, in_local)``: each rank's per-row ``(min, max)`` all-gathered, then torchao's
    ``choose_qparams_affine`` (the arguments ``Int8Tensor.from_hp`` passes) over them.

    Communication: one all-gather over the TP group of ``(out, 2)`` in the weight's dtype.
    """
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine

    from . import comm

    minmax = torch.stack([shard.amin(dim=1), shard.amax(dim=1)], dim=1)  # (out, 2)
    gathered = comm.all_gather_dim(minmax.contiguous(), 1, tp_group)  # (out, 2 * tp)
    return choose_qparams_affine(input=gathered, mapping_type=MappingType.SYMMETRIC, block_size=[1, gathered.shape[1]],
                                 target_dtype=torch.int8, quant_min=-128, quant_max=127, scale_dtype=torch.float32,
                                 zero_point_dtype=torch.int8, keepdim=True, eps=torch.finfo(torch.float32).eps)


def quantize_torchao_(model: nn.Module, fqns: list[str], spec: TorchAoSpec) -> nn.Module:
    """Quantize, in place, the parallel layers ``fqns`` (from :func:`check_torchao_layout`) to int8
    weight-only or NF4: each rank's codes and scales equal the dense torchao weight's restricted to
    its shard (module doc). The layer objects stay (their class becomes the int8
    subclass); every parameter of the model is frozen afterwards (adapters train on top).

    Communication: int8: one all-gather per row-parallel layer, ``(out, 2)`` (:func:`_row_scale`);
    NF4: one all-gather per layer of its block absmax, ``(numel / 64 / tp_size,)`` (:func:`_nf4_shard`).

    Raises:
        TypeError: a listed module is not a ColumnParallelLinear or RowParallelLinear.
    """
    from torchao.quantization import Int8Tensor, PerRow

    def convert(fqn: str, layer: nn.Module, cls: type) -> None:
        if layer.weight_layout != "linear":
            raise TypeError(f"{fqn}: torchao int8 quantizes nn.Linear weights only, got layout {layer.weight_layout!r}")
        param = layer._parameters.pop("weight")
        layer.__class__ = cls
        layer.weight_shard_spec = shard_spec_of(param)
        w = param.detach().contiguous()  # (out_local, in_local)
        if spec.quant_type == "nf4":
            nf4 = _nf4_shard(w, layer.weight_shard_spec, layer.tp_rank, layer.tp_group,
                             cls is NF4RowParallelLinear, spec)
            layer._set_nf4(nf4, w.dtype)
            return
        scale = zero_point = None
        if cls is Int8RowParallelLinear and layer.tp_size > 1:
            scale, zero_point = _row_scale(w, layer.tp_group)
        q = Int8Tensor.from_hp(w, granularity=PerRow(), scale=scale, zero_point=zero_point)
        layer._set_int8(q.qdata, q.scale, q.zero_point, w.dtype)

    return convert_layers(model, fqns, _NF4_CLASSES if spec.quant_type == "nf4" else _INT8, spec, convert)
