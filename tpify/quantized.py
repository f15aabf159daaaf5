"""Quantized bases under tensor parallelism: QLoRA's 4-bit weights, sharded by rank.

QLoRA (Dettmers et al., arXiv:2305.14314) freezes a base whose linear weights are stored in 4 bits
(NF4 or FP4 codes, two per byte) with one absmax per block of ``blocksize`` (64) consecutive
elements of the flattened ``[out, in]`` weight; LoRA adapters train on top. Here each rank holds
the quantized form of its Megatron shard (arXiv:1909.08053, section 3) of every column- and
row-parallel layer, built and computed with bitsandbytes' own functions (``quantize_4bit``,
``dequantize_4bit``, ``matmul_4bit``); tpify has no quantization kernel of its own.

**Sharding equals quantizing.** A block is quantized from its 64 elements alone (its absmax, then
each element's nearest code). If no block straddles a shard boundary, the blocks of a rank's
shard are exactly the dense weight's blocks that fall inside it, in the dense order, so
quantizing the shard gives bit for bit the dense quantized weight's codes and absmax restricted to
the shard (the tests compare both, and the dequantized weights, bitwise). Per layer, in the
``[out, in]`` form transformers quantizes (GPT-2's ``Conv1D`` weight transposed):

* column-parallel (whole rows, each packed part ``[Q|K|V]`` separately): every range of rows
  ``[a, b)`` a rank holds starts at an element ``a * in`` that is a multiple of the block;
* row-parallel (columns ``[a, b)`` of every row): ``o * in + a`` and ``o * in + b`` are multiples
  of the block for every row ``o``, i.e. ``in`` and ``in / tp`` multiples of 64.

A layer whose split would cut a block is refused with a :class:`~tpify.planner.PlanError` naming it
and the tp sizes at which it aligns, on every rank, before any collective (:func:`check_layout`
runs on the layout in :func:`tpify.parallelize`'s local checks).

**What is built** (everything else raises): bitsandbytes 4-bit, ``bnb_4bit_quant_type`` ``"nf4"`` or
``"fp4"``, with or without double quantization, ``bnb_4bit_quant_storage=torch.uint8``, on layers of
styles ``colwise``, ``packed_colwise`` and ``rowwise`` without sequence parallelism or uneven splits.
The LM head and embeddings stay unquantized, as transformers keeps them; ``llm_int8_skip_modules``
names more modules to keep. Double quantization quantizes the dense weight's absmax again in
blocks of 256 with one offset, the mean over the whole weight: a shard's own double quantization
differs, so each rank keeps its blocks' absmax as the dense model restores them
(:func:`_double_quantized_absmax`: exact at every split that keeps the 64-element blocks whole;
the statistics stay float32). Refused by name: 8-bit configs here (``load_in_8bit``: built in
:mod:`tpify.quantized_int8`, row-parallel on bitsandbytes' CPU training path only), a checkpoint
saved 8-bit, other configs (``TorchAoConfig`` int8 weight-only is :mod:`tpify.quantized_torchao`), the styles ``replicate``, ``experts``, ``latent`` and
``per_head``.

**Two paths, both exact.** Quantize on load (:func:`quantize_`: each rank quantizes the dense slice
it read) and a checkpoint transformers saved 4-bit (:func:`plan_prequantized`,
:func:`load_prequantized_`: each rank reads only its blocks' codes and absmax).
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
from .sharding import ShardSpec, shard_spec_of

__all__ = ["QuantizationSpec", "QuantizedColumnParallelLinear", "QuantizedRowParallelLinear", "quantization_spec",
           "check_layout", "quantize_", "convert_layers", "check_lora_on_quantized", "refuse_full_finetuning", "saved_quantization", "plan_prequantized",
           "load_prequantized_", "is_quantized", "quantized_bytes", "shard_bytes", "refuse_if_quantized"]

_COLUMN_STYLES = ("colwise", "packed_colwise")
_ROW_STYLES = ("rowwise",)
_KEPT_STYLES = ("colwise_rep", "embedding_rowwise", "embedding_colwise")  # LM head, embeddings: kept as they are


@dataclass(frozen=True)
class QuantizationSpec:
    """What tpify reads from a ``transformers.BitsAndBytesConfig``.

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: elements per absmax block (bitsandbytes' 4-bit default, 64).
        compute_dtype: the dtype the matmul runs in (``bnb_4bit_compute_dtype``), or None: the input's.
        skip: module names kept unquantized (``llm_int8_skip_modules``), matched as transformers
            matches them (a name equal to the FQN or to one of its dotted components / suffixes).
        double_quant: ``bnb_4bit_use_double_quant``: the dense weight's absmax quantized again
            (blocks of 256, one offset); each rank keeps its blocks' absmax as the dense model
            dequantizes them (:func:`_double_quantized_absmax`), float32.
    """

    quant_type: str
    blocksize: int = 64
    compute_dtype: torch.dtype | None = None
    skip: tuple[str, ...] = ()
    double_quant: bool = False

    skip_option = "llm_int8_skip_modules"  # the config field that keeps a module unquantized

    def skips(self, fqn: str) -> bool:
        return any(fqn == s or fqn.endswith("." + s) or s in fqn.split(".") for s in self.skip)

    def quantizes(self, module: nn.Module | None) -> bool:
        """Whether transformers quantizes this kind of module under the config (bitsandbytes:
        ``nn.Linear`` and GPT-2's ``Conv1D``; the style decides the rest)."""
        return True

    def label(self) -> str:
        """The format, as the refusals name it."""
        return f"{self.quant_type}, blocks of {self.blocksize}"


def quantization_spec(config) -> QuantizationSpec:
    """Validate a quantization config and return what tpify builds from it.

    Accepts ``transformers.BitsAndBytesConfig`` (4-bit) or a dict of its fields.

    Raises:
        ImportError: bitsandbytes is not installed (``pip install bitsandbytes``, or ``tpify[quant]``).
        NotImplementedError: 8-bit (:mod:`tpify.quantized_int8`; here: a checkpoint saved 8-bit), another quant storage, a config class other
            than ``BitsAndBytesConfig`` (GPTQ, AWQ, ...; ``TorchAoConfig`` is dispatched before, to
            :func:`tpify.quantized_torchao.torchao_spec`): not built, by name.
        ValueError: a 4-bit quant type other than nf4/fp4; a config that asks for no quantization.
    """
    from transformers import BitsAndBytesConfig

    if isinstance(config, dict):
        config = BitsAndBytesConfig(**config)
    if not isinstance(config, BitsAndBytesConfig):
        raise NotImplementedError(
            f"quantization_config={type(config).__name__}: tpify builds quantized tensor-parallel layers from "
            f"bitsandbytes 4-bit (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4' "
            f"or 'fp4', bnb_4bit_use_double_quant=True or False)) and torchao int8 weight-only "
            f"(transformers.TorchAoConfig(Int8WeightOnlyConfig()), tpify.quantized_torchao); "
            f"{type(config).__name__} (GPTQ, AWQ, ...) is not built")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("quantization_config=BitsAndBytesConfig(...) needs the package bitsandbytes: "
                          "pip install bitsandbytes (or tpify[quant])")
    if config.load_in_8bit:
        raise NotImplementedError(
            "quantization_config with load_in_8bit=True (LLM.int8) is not a 4-bit config: tpify.parallelize and "
            "tpify.from_pretrained build it from the dense weights with tpify.quantized_int8.int8_spec; a "
            "checkpoint saved 8-bit (pre-quantized) is not read (not built): load the unquantized checkpoint "
            "with quantization_config=BitsAndBytesConfig(load_in_8bit=True)")
    if not config.load_in_4bit:
        raise ValueError("quantization_config asks for no quantization (load_in_4bit=False, load_in_8bit=False)")
    if config.bnb_4bit_quant_type not in ("nf4", "fp4"):
        raise ValueError(f"bnb_4bit_quant_type must be 'nf4' or 'fp4', got {config.bnb_4bit_quant_type!r}")
    storage = getattr(config, "bnb_4bit_quant_storage", torch.uint8)
    if storage not in (None, torch.uint8, "uint8"):
        raise NotImplementedError(f"bnb_4bit_quant_storage={storage}: only torch.uint8 is built")
    skip = tuple(config.llm_int8_skip_modules or ())
    return QuantizationSpec(config.bnb_4bit_quant_type, 64, config.bnb_4bit_compute_dtype, skip,
                            bool(config.bnb_4bit_use_double_quant))


# ---------------------------------------------------------------------------------------------
# Block alignment: pure checks on the layout (no collective, the same outcome on every rank).

def _cuts(spec: ShardSpec, in_f: int, out_f: int, is_row: bool, block: int) -> list[str]:
    """Where rank shards of a ``[out_f, in_f]`` weight split by ``spec`` cut a block of ``block``
    elements of the flattened weight: one line per offending rank and range (empty: aligned)."""
    numel, out = in_f * out_f, []
    for r in range(spec.tp_size):
        for a, b in spec.ranges(r):
            if is_row:  # columns [a, b) of every row; offsets repeat with period `block` in the row index
                rows = range(min(out_f, block))
                starts, ends = [o * in_f + a for o in rows], [o * in_f + b for o in rows]
            else:  # rows [a, b)
                starts, ends = [a * in_f], [b * in_f]
            bad = [s for s in starts if s % block] + [e for e in ends if e % block and e != numel]
            if bad:
                what = f"columns [{a}, {b})" if is_row else f"rows [{a}, {b})"
                out.append(f"rank {r} holds {what}, starting or ending at element {bad[0]} of the flattened "
                           f"[{out_f}, {in_f}] weight, not a multiple of the block size {block}")
    return out


def _working_tp_sizes(spec: ShardSpec, in_f: int, out_f: int, is_row: bool, block: int, limit: int = 64) -> list[int]:
    """The tp sizes up to ``limit`` that split the layer's parts evenly (without replicated K/V
    heads) and cut no block."""
    sizes = []
    for t in range(1, limit + 1):
        try:
            other = dataclasses.replace(spec, tp_size=t, replicated=(), replica_shards=1, uneven=False)
        except ValueError:
            continue
        if not _cuts(other, in_f, out_f, is_row, block):
            sizes.append(t)
    return sizes


def check_layout(model: nn.Module, layout, qspec: QuantizationSpec) -> list[str]:
    """Check that every layer :func:`quantize_` would quantize can be, on the dense (or meta)
    model and its layout; return the FQNs it will quantize. Pure: no collective.

    Raises:
        PlanError: listing every problem: a split that would cut a block (naming the layer, the
            ranks, the offsets and the tp sizes that work), a style with no quantized form
            (``replicate``, ``experts``, ``latent``, ``per_head``: list the module in
            ``llm_int8_skip_modules`` to keep it unquantized, where it is an ``nn.Linear``), sequence
            parallelism or an uneven split on a layer to quantize.
    """
    problems, chosen = [], []
    modules = dict(model.named_modules())
    for fqn, ml in sorted(layout.modules.items()):
        if ml.style in _KEPT_STYLES or qspec.skips(fqn) or isinstance(modules.get(fqn), nn.Embedding) \
                or not qspec.quantizes(modules.get(fqn)):
            continue  # the LM head and embeddings stay unquantized, as transformers keeps them
        if ml.style not in _COLUMN_STYLES + _ROW_STYLES:
            problems.append(f"{fqn}: style {ml.style!r} has no quantized tensor-parallel form in tpify (built: "
                            f"colwise, packed_colwise, rowwise); list it in {qspec.skip_option} to keep it "
                            f"unquantized")
            continue
        if ml.sequence_parallel:
            problems.append(f"{fqn}: quantized layers under sequence parallelism are not built; "
                            f"pass sequence_parallel=False")
            continue
        if ml.uneven:
            problems.append(f"{fqn}: an uneven split (torch.chunk's rule) of a quantized layer is not built; "
                            f"use a tp size that divides its features")
            continue
        in_f, out_f, _ = dense_dims(modules[fqn])
        spec, is_row = ml.specs["weight"], ml.style in _ROW_STYLES
        cuts = _cuts(spec, in_f, out_f, is_row, qspec.blocksize)
        if cuts:
            works = _working_tp_sizes(spec, in_f, out_f, is_row, qspec.blocksize)
            problems.append(f"{fqn} ({'row' if is_row else 'column'}-parallel, [{out_f}, {in_f}] at tp_size = "
                            f"{spec.tp_size}): the split cuts a quantization block: {cuts[0]}"
                            + (f" (and {len(cuts) - 1} more)" if len(cuts) > 1 else "")
                            + f"; tp sizes that keep its blocks whole: {works}")
            continue
        chosen.append(fqn)
    if problems:
        raise PlanError(f"{len(problems)} layer(s) cannot be quantized as shards that equal the dense quantized "
                        f"weight ({qspec.label()}):\n  " + "\n  ".join(problems))
    return chosen


# ---------------------------------------------------------------------------------------------
# The layers.

class _Quantized:
    """What the quantized column- and row-parallel layers share: the 4-bit codes of this rank's
    shard, its absmax per block and the code table (buffers, not parameters: they take no gradient
    and move with the module), the dequantized ``weight`` (a read-only property) and the local
    matmul (bitsandbytes' ``matmul_4bit``, which dequantizes again in backward instead of saving
    the dense shard)."""

    def _quantize_own_weight(self, qspec: QuantizationSpec) -> None:
        import bitsandbytes.functional as bnbf

        param = self._parameters.pop("weight")
        self.weight_shard_spec = shard_spec_of(param)  # the dense weight's split, carried by `weight` below
        w = param.detach()
        if self.weight_layout == "conv1d":  # [in, out] -> the [out, in] form transformers quantizes
            w = w.t()
        codes, state = bnbf.quantize_4bit(w.contiguous(), blocksize=qspec.blocksize, compress_statistics=False,
                                          quant_type=qspec.quant_type, quant_storage=torch.uint8)
        self.register_buffer("weight_codes", codes, persistent=False)  # (numel / 2, 1) uint8, two codes per byte
        self.register_buffer("weight_absmax", state.absmax, persistent=False)  # (ceil(numel / blocksize),) float32
        self.register_buffer("weight_code_table", state.code, persistent=False)  # (16,) the NF4/FP4 values
        self._mark_sharded()
        self.quant_shape, self.quant_dtype = tuple(state.shape), state.dtype
        self.quant_type, self.quant_blocksize = qspec.quant_type, qspec.blocksize
        self.compute_dtype = qspec.compute_dtype
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def _mark_sharded(self) -> None:
        """Give the codes and absmax buffers the weight's ShardSpec: they hold this rank's shard (so the
        checks that compare replicated tensors across ranks leave them out). Non-persistent: no
        state dict, save or checkpoint reads them through it."""
        for b in (self.weight_codes, self.weight_absmax):
            if self.weight_shard_spec is not None:
                b.tp_shard_spec = self.weight_shard_spec

    @property
    def quant_state(self):
        """bitsandbytes' ``QuantState`` of this rank's shard (built from the buffers on each call,
        so that it follows ``.to(device)``)."""
        from bitsandbytes.functional import QuantState

        return QuantState(absmax=self.weight_absmax, shape=torch.Size(self.quant_shape), code=self.weight_code_table,
                          blocksize=self.quant_blocksize, quant_type=self.quant_type, dtype=self.quant_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """This rank's shard dequantized, in the layer's layout and the dtype it was quantized from
        (no gradient), carrying the dense weight's ShardSpec. Read-only: merging into it is refused
        (:func:`refuse_if_quantized`)."""
        import bitsandbytes.functional as bnbf

        w = bnbf.dequantize_4bit(self.weight_codes, self.quant_state)
        w = w.t() if self.weight_layout == "conv1d" else w
        if self.weight_shard_spec is not None:
            w.tp_shard_spec = self.weight_shard_spec
        return w

    def local_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W_r^T + b`` on this rank's shard, as bitsandbytes' ``Linear4bit`` computes it: the
        input cast to the compute dtype, ``matmul_4bit``, the result cast back. ``(B, T, in_local)
        -> (B, T, out_local)``; no communication.

        Raises:
            TPUsageError: the bias takes a gradient (full fine-tuning of a quantized base).
        """
        import bitsandbytes as bnb

        if torch.is_grad_enabled() and self.bias is not None and self.bias.requires_grad:
            from .info import TPUsageError

            raise TPUsageError(f"{type(self).__name__}: full fine-tuning of a quantized base is not supported "
                               f"(its 4-bit weight takes no gradient); train adapters on it "
                               f"(tpify.integrations.get_peft_model) and keep the base frozen")
        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        if bias is not None:
            bias = bias.to(x.dtype)
        return bnb.matmul_4bit(x, self.weight_codes, quant_state=self.quant_state, bias=bias).to(dtype)

    def quantized_bytes(self) -> int:
        """Bytes of this rank's quantized weight: codes, absmax, code table."""
        return sum(b.numel() * b.element_size() for b in (self.weight_codes, self.weight_absmax, self.weight_code_table))

    def _quant_repr(self) -> str:
        return f", quant_type={self.quant_type}, blocksize={self.quant_blocksize}"


class QuantizedColumnParallelLinear(_Quantized, ColumnParallelLinear):
    """:class:`~tpify.layers.ColumnParallelLinear` whose weight shard is stored 4-bit (module doc).

    ``Y_r = copy(X) deq(Q_r)^T + b_r`` (Megatron-LM, arXiv:1909.08053, section 3, with QLoRA's
    frozen NF4/FP4 base, arXiv:2305.14314).

    Shapes:
        input ``(B, T, in_features)`` replicated; output ``(B, T, out_features_per_partition)``, or
        gathered ``(B, T, out_features)`` with ``gather_output`` / ``runtime_gather_output``.
    Communication:
        forward: none (one all-gather when gathering). backward: one all-reduce of the input
        gradient ``(B, T, in_features)`` (Megatron's ``copy``; not shared with the other layers
        reading the same input as the unquantized layer's overlapped path is).
    Dtype: computed in ``compute_dtype`` (else the input's), returned in the input's.
    Raises:
        TPUsageError: the bias takes a gradient; ``return_input`` (the chunked LM loss: the LM
            head is never quantized).
    """

    def forward(self, x: torch.Tensor, runtime_gather_output: bool | None = None,
                return_input: bool = False) -> torch.Tensor:
        """``(B, T, in_features) -> (B, T, out_features_per_partition)`` (or gathered)."""
        from . import comm

        if return_input:
            from .info import TPUsageError

            raise TPUsageError(f"{type(self).__name__} cannot serve the chunked LM loss (return_input)")
        y = self.local_matmul(comm.copy_to_tp_region(x, self.tp_group), self.bias)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            y = self.gather(y)
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + self._quant_repr()


class QuantizedRowParallelLinear(_Quantized, RowParallelLinear):
    """:class:`~tpify.layers.RowParallelLinear` whose weight shard is stored 4-bit (module doc).

    ``Y = reduce(X_r deq(Q_r)^T) + b``, the bias added once after the reduce.

    Shapes:
        input ``(B, T, in_features // tp_size)`` (or replicated, scattered when
        ``input_is_parallel=False``); output ``(B, T, out_features)`` on every rank.
    Communication:
        forward: one all-reduce of the output. backward: none.
    Dtype: as :class:`QuantizedColumnParallelLinear`.
    Raises:
        TPUsageError: the bias takes a gradient.
    """

    def forward(self, x: torch.Tensor, scatter_output: bool | None = None) -> torch.Tensor:
        """``(B, T, in_features // tp_size) -> (B, T, out_features)``, replicated."""
        from . import comm

        if not self.input_is_parallel:
            x = comm.scatter_to_tp_region(x, self.tp_group)
        scatter = self.sequence_parallel if scatter_output is None else scatter_output
        return self.add_bias(self.collect(self.local_matmul(x, None), scatter), scatter)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._quant_repr()


_QUANTIZED = {ColumnParallelLinear: QuantizedColumnParallelLinear, RowParallelLinear: QuantizedRowParallelLinear}


def quantize_(model: nn.Module, fqns: list[str], qspec: QuantizationSpec) -> nn.Module:
    """Quantize, in place, the parallel layers ``fqns`` (from :func:`check_layout`) of a
    parallelized model: each rank quantizes its own shard, which equals the dense quantized
    weight's slice (module doc). The layer objects stay the same (their class becomes the
    quantized subclass, so hooks and references to them hold); their ``weight`` parameter is
    replaced by the codes and statistics buffers. Every parameter of the model is frozen afterwards
    (QLoRA: adapters are added on top and train).

    Communication: none; with double quantization one all-gather over the TP group per layer of
    its absmax, ``(numel / 64 / tp_size,)`` float32 (:func:`_double_quantized_absmax`).

    Raises:
        TypeError: a listed module is not a ColumnParallelLinear or RowParallelLinear.
    """
    def convert(fqn: str, layer: nn.Module, cls: type) -> None:
        layer.__class__ = cls
        layer._quantize_own_weight(qspec)
        if qspec.double_quant:
            layer.weight_absmax.copy_(_double_quantized_absmax(layer))

    return convert_layers(model, fqns, _QUANTIZED, qspec, convert)


def convert_layers(model: nn.Module, fqns: list[str], classes: dict, spec, convert) -> nn.Module:
    """What every quantized format's conversion shares: for each parallel layer ``fqns`` (from
    :func:`check_layout`), its quantized class ``classes[type(layer)]`` and ``convert(fqn, layer,
    cls)``, which turns the layer's own shard into that format (and the layer into ``cls``); then
    every parameter of the model frozen (adapters train on top) and ``model.tp_quantization = spec``.
    Communication: ``convert``'s.

    Raises:
        TypeError: a listed module is not one of ``classes``' keys (ColumnParallelLinear,
            RowParallelLinear); ``convert``'s errors.
    """
    for fqn in fqns:
        layer = model.get_submodule(fqn)
        cls = classes.get(type(layer))
        if cls is None:
            raise TypeError(f"{fqn}: expected a ColumnParallelLinear or RowParallelLinear, got {type(layer).__name__}")
        convert(fqn, layer, cls)
    for p in model.parameters():
        p.requires_grad_(False)
    model.tp_quantization = spec
    return model


def _block_index(layer) -> torch.Tensor:
    """Indices, in the dense weight's absmax vector (one per block of the flattened ``[out, in]``
    weight), of this rank's blocks, in the order its ``weight_absmax`` holds them. ``(n_local,)`` int64."""
    spec, block = layer.weight_shard_spec, layer.quant_blocksize
    out_f, in_f = _dense_quant_shape(layer)
    ranges = _byte_ranges(spec, in_f, out_f, layer.tp_rank, isinstance(layer, QuantizedRowParallelLinear), block)
    return torch.cat([torch.arange(a // block, b // block) for a, b in ranges])


def _dense_quant_shape(layer) -> tuple[int, int]:
    """``(out_features, in_features)`` of the dense ``[out, in]`` weight a layer's shard comes from."""
    spec = layer.weight_shard_spec  # its global_size: the dense size of the split dimension
    local = layer.quant_shape  # (out_local, in) column-parallel, (out, in_local) row-parallel
    if isinstance(layer, QuantizedRowParallelLinear):
        return local[0], spec.global_size
    return spec.global_size, local[1]


def _double_quantized_absmax(layer) -> torch.Tensor:
    """This rank's absmax as the dense double-quantized weight dequantizes them, ``(n_local,)`` float32.

    bitsandbytes' ``quantize_4bit(compress_statistics=True)`` quantizes the dense weight's absmax
    vector ``a`` again: ``offset = a.mean()``, ``quantize_blockwise(a - offset, blocksize=256)``; its
    ``dequantize_4bit`` restores ``dequantize_blockwise(...) + offset`` before decoding the codes. The
    offset is a mean over the whole dense weight and the blocks of 256 span rows, so a shard's own
    double quantization would differ; instead every rank gathers the dense ``a`` from the ranks'
    (exact, undoubled) absmax, runs bitsandbytes' two calls on it as the dense model does, and keeps
    its own blocks of the result: the dequantized weight equals the dense double-quantized one bit
    for bit at every split that keeps the 64-element blocks whole. The statistics are kept
    dequantized (float32): double quantization's saving (~0.37 bits per parameter) is not taken.

    Communication: one all-gather over the TP group of ``(n_local,)`` float32.
    """
    import bitsandbytes.functional as bnbf

    from . import comm

    own = _block_index(layer).to(layer.weight_absmax.device)
    out_f, in_f = _dense_quant_shape(layer)
    gathered = comm.all_gather_dim(layer.weight_absmax.contiguous(), 0, layer.tp_group)  # (tp * n_local,)
    index = comm.all_gather_dim(own, 0, layer.tp_group)  # every rank's block indices, in its order
    dense = torch.empty(-(-out_f * in_f // layer.quant_blocksize), dtype=gathered.dtype, device=gathered.device)
    dense[index] = gathered  # replicated K/V rows are written by each of their ranks, with equal values
    offset = dense.mean()
    qabsmax, state2 = bnbf.quantize_blockwise(dense - offset, blocksize=256)
    restored = bnbf.dequantize_blockwise(qabsmax, state2)
    restored += offset
    return restored[own].float()


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` (or the base of a PEFT model) holds quantized tensor-parallel layers."""
    return any(isinstance(m, _Quantized) for m in model.modules())


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes: ``quantized`` (codes and statistics of the quantized layers), ``params``
    (parameters, by ``trainable`` and ``frozen``)."""
    q = sum(m.quantized_bytes() for m in model.modules() if isinstance(m, _Quantized))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return {"quantized": q, "trainable": trainable, "frozen": frozen}


def shard_bytes(numel: int, qspec: QuantizationSpec) -> dict[str, int]:
    """Bytes a quantized shard of ``numel`` weight elements takes, as :func:`quantize_` stores it:
    ``codes`` (two 4-bit codes per uint8, ``ceil(numel / 2)``), ``absmax`` (one float32 per block,
    ``4 * ceil(numel / blocksize)``) and ``code_table`` (the 16 float32 NF4/FP4 values each layer
    keeps). Pure arithmetic (``tpify plan --quantize`` sizes layers on the meta device with it)."""
    return {"codes": -(-numel // 2), "absmax": 4 * -(-numel // qspec.blocksize), "code_table": 16 * 4}


def check_lora_on_quantized(model: nn.Module, config, what: str) -> None:
    """Refuse the adapter options not built on a quantized base (QLoRA: plain LoRA is).

    Raises:
        NotImplementedError: DoRA (``use_dora``) or trainable biases (``bias != "none"``) on a
            quantized model.
    """
    if not is_quantized(model):
        return
    refused = []
    if getattr(config, "use_dora", False):
        refused.append("use_dora=True (DoRA on a 4-bit tensor-parallel base is not built)")
    if getattr(config, "bias", "none") != "none":
        refused.append(f"bias={config.bias!r} (the quantized base's biases stay frozen)")
    if refused:
        raise NotImplementedError(f"{what} on a quantized tensor-parallel model: {'; '.join(refused)}")


# ---------------------------------------------------------------------------------------------
# Pre-quantized checkpoints (bitsandbytes 4-bit safetensors as transformers writes them), read by slices.

_STATE_KEY = ".quant_state.bitsandbytes__"
_AUX = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def saved_quantization(path) -> QuantizationSpec | None:
    """The :class:`QuantizationSpec` of a checkpoint saved quantized (its ``config.json``'s
    ``quantization_config``), or None for an unquantized one.

    Raises:
        NotImplementedError, ImportError, ValueError: as :func:`quantization_spec` (a
            ``quant_method`` other than bitsandbytes, 8-bit, ...).
    """
    import json
    from pathlib import Path

    try:
        saved = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # from_pretrained reports a missing or unreadable config itself
    if not saved:
        return None
    if not isinstance(saved, dict) or saved.get("quant_method") != "bitsandbytes":
        method = saved.get("quant_method", "?") if isinstance(saved, dict) else "?"
        raise NotImplementedError(f"{path}: a checkpoint quantized with quant_method={method!r}: not built (tpify "
                                  f"reads bitsandbytes 4-bit checkpoints)")
    from transformers import BitsAndBytesConfig

    return quantization_spec(BitsAndBytesConfig.from_dict(dict(saved)))


@dataclass
class SavedLayer:
    """One layer's 4-bit tensors in a pre-quantized checkpoint: the codes' key, its header, the
    absmax and code-table keys, and the saved quant state (quant_type, blocksize, dtype, shape)."""

    fqn: str
    key: str
    file: str
    state: dict


def plan_prequantized(model: nn.Module, layout, qspec: QuantizationSpec, snap, headers: dict) -> tuple[dict, dict]:
    """Match a pre-quantized checkpoint to the (meta) model: ``(headers, layers)``, where
    ``headers`` are the checkpoint's with each quantized weight given its dense shape and dtype
    (so that the usual key and shape matching checks it) and the statistics left out, and
    ``layers`` maps each layer FQN to quantize to its :class:`SavedLayer`. Pure apart from reading
    the small quant-state tensors; no collective.

    Raises:
        PlanError: as :func:`check_layout`.
        NotImplementedError: a quantized tensor of a layer tpify would not quantize, or the other
            way round (other skip lists); a quant type, block size or double quantization in a
            tensor's state other than the config's; a ``Conv1D`` layer (GPT-2: not built for pre-quantized loading).
    """
    from bitsandbytes.utils import unpack_tensor_to_dict
    from safetensors import safe_open

    from .hf_modules import is_conv1d
    from .io.files import TensorHeader

    fqns = check_layout(model, layout, qspec)
    saved, out, problems = {}, dict(headers), []
    for key, header in headers.items():
        if _STATE_KEY not in key:
            continue
        weight_key = key[: key.index(_STATE_KEY)]
        with safe_open(snap.where(header.file), framework="pt", device="cpu") as f:
            state = unpack_tensor_to_dict(f.get_tensor(key))
        saved[weight_key] = (header, state)
        del out[key]
        for aux in _AUX:
            out.pop(weight_key + aux, None)
    layers = {}
    for fqn in fqns:
        entry = saved.pop(fqn + ".weight", None)
        if entry is None:
            problems.append(f"{fqn}.weight is stored unquantized but tpify quantizes {fqn}")
            continue
        header, state = entry
        if is_conv1d(model.get_submodule(fqn)):
            problems.append(f"{fqn}: a Conv1D layer (GPT-2) read from a pre-quantized checkpoint is not built")
            continue
        nested = state.get("nested_blocksize")
        if nested != (256 if qspec.double_quant else None) or state.get("quant_type") != qspec.quant_type \
                or state.get("blocksize") != qspec.blocksize:
            problems.append(f"{fqn}: saved as {state} (the config says: {qspec.quant_type}, blocks of "
                            f"{qspec.blocksize}, " + ("double quantization in blocks of 256)" if qspec.double_quant
                                                      else "no double quantization)"))
            continue
        dtype = getattr(torch, state["dtype"])
        out[fqn + ".weight"] = TensorHeader(tuple(state["shape"]), header.file, dtype)
        layers[fqn] = SavedLayer(fqn, fqn + ".weight", header.file, state)
    problems += [f"{k} is stored quantized but tpify would not quantize it (llm_int8_skip_modules, or a style "
                 f"without a quantized form)" for k in sorted(saved)]
    if problems:
        raise NotImplementedError("reading this pre-quantized checkpoint by slices:\n  " + "\n  ".join(problems))
    return out, layers


def _byte_ranges(spec: ShardSpec, in_f: int, out_f: int, tp_rank: int, is_row: bool, block: int):
    """``[start, stop)`` ranges of elements of the flattened dense ``[out_f, in_f]`` weight that this
    rank's shard holds, in its order (each a whole number of blocks: :func:`check_layout`)."""
    for a, b in spec.ranges(tp_rank):
        if is_row:
            for o in range(out_f):
                yield o * in_f + a, o * in_f + b
        else:
            yield a * in_f, b * in_f


def load_prequantized_(model: nn.Module, layers: dict, qspec: QuantizationSpec, snap) -> nn.Module:
    """Fill the layers ``layers`` (from :func:`plan_prequantized`) of a parallelized model on the
    meta device from the checkpoint's 4-bit tensors, reading only this rank's blocks: the codes
    ``[a, b) / 2`` and absmax ``[a, b) / blocksize`` of each element range of its shard (one read per
    range: per row of a row-parallel layer). The result equals :func:`quantize_` of the dense
    weight bit for bit (the shard's blocks are the dense blocks it holds, module doc). Local; no
    communication. Every parameter is frozen afterwards.

    Raises:
        ValueError: a tensor in the file has another size than its saved quant state says.
    """
    from safetensors import safe_open

    for fqn, saved in layers.items():
        # one mapping per layer, dropped after it: the pages of codes a read touched leave the
        # resident set before the next layer (a mapping kept for the load would hold them all)
        f = safe_open(snap.where(saved.file), framework="pt", device="cpu")
        layer = model.get_submodule(fqn)
        cls = _QUANTIZED[type(layer)]
        param = layer._parameters.pop("weight")
        layer.__class__ = cls
        layer.weight_shard_spec = shard_spec_of(param)
        out_f, in_f = saved.state["shape"]
        block = qspec.blocksize
        ranges = list(_byte_ranges(layer.weight_shard_spec, in_f, out_f, layer.tp_rank, cls is
                                   QuantizedRowParallelLinear, block))
        codes_slice, absmax_slice = f.get_slice(saved.key), f.get_slice(saved.key + ".absmax")
        if codes_slice.get_shape()[0] * 2 < out_f * in_f or absmax_slice.get_shape()[0] * block < out_f * in_f:
            raise ValueError(f"{saved.key}: {codes_slice.get_shape()} codes / {absmax_slice.get_shape()} absmax "
                             f"for a [{out_f}, {in_f}] weight")
        codes = torch.cat([codes_slice[a // 2: (b + 1) // 2] for a, b in ranges])
        if "nested_blocksize" in saved.state:  # the absmax are uint8 codes of a second quantization
            absmax = _restore_nested_absmax(f, saved, ranges, block)
        else:
            absmax = torch.cat([absmax_slice[a // block: -(-b // block)] for a, b in ranges])
        local_shape = (sum(b - a for a, b in ranges) // in_f, in_f) if cls is QuantizedColumnParallelLinear \
            else (out_f, sum(b - a for a, b in ranges) // out_f)
        layer.register_buffer("weight_codes", codes.reshape(-1, 1).contiguous(), persistent=False)
        layer.register_buffer("weight_absmax", absmax.float().contiguous(), persistent=False)
        # a copy: a view (.float() of float32 is one) would keep the file's mapping, and every page
        # of codes the reads above touched, resident for the model's life
        layer.register_buffer("weight_code_table", f.get_tensor(saved.key + ".quant_map").to(torch.float32, copy=True),
                              persistent=False)
        layer._mark_sharded()
        layer.quant_shape, layer.quant_dtype = local_shape, getattr(torch, saved.state["dtype"])
        layer.quant_type, layer.quant_blocksize, layer.compute_dtype = qspec.quant_type, block, qspec.compute_dtype
        del f, codes_slice, absmax_slice
    for p in model.parameters():
        p.requires_grad_(False)
    model.tp_quantization = qspec
    return model


def _restore_nested_absmax(f, saved: SavedLayer, ranges, block: int) -> torch.Tensor:
    """The absmax of this rank's blocks (``ranges``: its element ranges of the dense weight) of a
    double-quantized checkpoint tensor, as bitsandbytes' ``dequantize_4bit`` restores them:
    ``dequantize_blockwise(absmax codes, nested absmax per 256, nested code map) + offset``, on the
    layer's whole (small: one byte per 64 weights) absmax vector, then this rank's entries.
    ``(n_local,)`` float32; local, no communication."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    state2 = QuantState(absmax=f.get_tensor(saved.key + ".nested_absmax").float(), blocksize=saved.state["nested_blocksize"],
                        code=f.get_tensor(saved.key + ".nested_quant_map").float(),
                        dtype=getattr(torch, saved.state["nested_dtype"]))
    restored = bnbf.dequantize_blockwise(f.get_tensor(saved.key + ".absmax"), state2)
    restored += torch.tensor(float(saved.state["nested_offset"]))  # float32, as QuantState.from_dict reads it
    own = torch.cat([torch.arange(a // block, b // block) for a, b in ranges])
    return restored.float()[own]


def refuse_full_finetuning(model: nn.Module, what: str) -> None:
    """Refuse training a quantized model with no adapter: its 4-bit weights take no gradient, so
    "full fine-tuning" would silently train only what is not quantized.

    Raises:
        TPUsageError: ``model`` is quantized and none of its trainable parameters is an adapter's
            (``lora_`` in the name).
    """
    if is_quantized(model) and not any("lora_" in n for n, p in model.named_parameters() if p.requires_grad):
        from .info import TPUsageError

        raise TPUsageError(f"{what}: full fine-tuning of a quantized base is not supported (its 4-bit weights "
                           f"take no gradient); add adapters with tpify.integrations.get_peft_model (QLoRA)")


def refuse_if_quantized(module: nn.Module, what: str) -> None:
    """Raise where ``what`` would write into a quantized base (merging an adapter, saving dense weights).

    Raises:
        NotImplementedError: ``module`` is (or holds) a quantized layer.
    """
    if isinstance(module, _Quantized) or (isinstance(module, nn.Module) and is_quantized(module)):
        raise NotImplementedError(
            f"{what} on a quantized tensor-parallel base is refused: the 4-bit weights cannot take a merged "
            f"adapter or be saved dense without dequantizing (not built); save the adapter instead "
            f"(peft_model.save_pretrained(dir)) and merge it into the unquantized checkpoint: "
            f"tpify.from_pretrained(dense_dir) (or transformers' from_pretrained, no quantization_config), "
            f"tpify.integrations.load_peft_adapter / peft.PeftModel.from_pretrained(model, dir), merge_and_unload(), "
            f"save_pretrained (docs/quantization.md)")
