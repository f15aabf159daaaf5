"""The recipe styles, one object each: what a style accepts, how it splits, what it builds.

A recipe names a style per module (``colwise``, ``rowwise``, ...; docs/recipes.md). Each
:class:`Style` here does the three things a style means, so that nothing else interprets its
name (as torch's ``ParallelStyle`` objects and torchtitan's ``colwise_config()`` do):

* :meth:`Style.plan` checks a module against the style at a tp size (kind, divisibility or an
  uneven split, packed parts, padding, a subclass's ``forward``) and fills its :class:`ModuleLayout`;
* :meth:`Style.param_specs` gives each parameter's :class:`~tpify.sharding.ShardSpec` (the
  layout stores them; the plan report, loading, saving and LoRA read them);
* :meth:`Style.build` builds the parallel module from the dense one (surgery).

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) is the method. ``STYLES`` maps each
name to its object; adding a style is adding a class here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .context import TPContext
from .hf_modules import SHARDABLE_TYPES, config_get, dense_dims, module_kind, overrides_forward, qualname
from .layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .sharding import (ShardSpec, column_specs, embedding_columns_spec, pad_vocab_size, row_spec,
                       vocab_rows_spec)

__all__ = ["Style", "ModuleLayout", "PlanContext", "STYLES", "style_of"]


@dataclass
class ModuleLayout:
    """What happens to one module: its FQN, the style, the rule that said so, per-style sizes.

    Attributes:
        partition_sizes: global widths of the packed parts (``packed_colwise``), each split alike.
        padded_size: the vocabulary padded to a multiple of ``tp_size`` (vocab-row styles), or None.
        replicated_parts: indices of the parts replicated over groups of ranks (the KV parts when
            ``tp_size`` exceeds the KV heads; multi-query K/V whole on every rank).
        replica_shards: the KV heads of the replicated parts (each held by ``tp_size /
            replica_shards`` consecutive ranks); 1 with none, or one KV head.
        output_scale: the constant a scaled-embedding subclass multiplies its output by (the
            recipe's ``[subclasses]``), or None; ``scale_attr`` the module attribute holding it
            (surgery hands the attribute itself, a number or the module's buffer, to the layer).
        specs: each parameter's :class:`ShardSpec` (``None``: replicated), by parameter name
            (``weight``, ``bias``), as :meth:`Style.param_specs` gives them.
        sequence_parallel: the module lies in a sequence-parallel stretch (inside a module whose
            input is gathered along ``T``): its layer is built with ``sequence_parallel=True``.
        params: ``experts`` and ``per_head``: the rule's ``(parameter name, split dimension, packed
            parts)`` (dimension :data:`AFTER_SUM`: an experts bias kept whole, counted once);
            ``replicate``: the module's own parameters kept whole (dimension :data:`WHOLE`).
        expert_parallel: ``experts`` only: whole experts per rank (``parallelize(..., ep_size=)``),
            every parameter split along dim 0 (the experts), the tokens exchanged between ranks.
        shared_features: ``latent`` only: the trailing output features every head reads directly
            (multi-head latent attention's rotary key), whose gradient is summed over the ranks.
        uneven: a split dimension ``tp_size`` does not divide is split by torch.chunk's rule
            (:func:`tpify.sharding.chunk_range`: an MLP's or the experts' intermediate size), which
            the planner allows only where it finds no head (:meth:`PlanContext.split_size`).
        identity_experts: ``experts`` only: the first expert index of the zero-computation identity
            experts (their output is the token itself, weighted), or None: each rank's partial output
            holds them whole, so :mod:`tpify.hooks.experts` counts them once after the sum.
    """

    fqn: str
    style: str
    rule: int
    partition_sizes: list[int] | None = None
    padded_size: int | None = None
    replicated_parts: tuple[int, ...] = ()
    replica_shards: int = 1
    output_scale: float | None = None
    scale_attr: str | None = None
    specs: dict[str, ShardSpec | None] = field(default_factory=dict)
    sequence_parallel: bool = False
    params: tuple[tuple[str, int, int], ...] = ()
    expert_parallel: bool = False
    shared_features: int = 0
    uneven: bool = False
    identity_experts: int | None = None

    @property
    def styler(self) -> "Style":
        """The :class:`Style` object of :attr:`style`."""
        return STYLES[self.style]


@dataclass
class PlanContext:
    """What a style's :meth:`Style.plan` checks a module against: the model, its config, the
    recipe, the tp size and padding, and where problems go (``errors``; ``need_divisible(what,
    value)`` records a count ``tp_size`` must divide); ``ep_size``: ``tp_size`` when the experts
    are split whole over the ranks (expert parallelism), else 1; ``may_be_uneven(fqn)``: whether
    the planner lets module ``fqn`` split a dimension ``tp_size`` does not divide (it holds no
    attention head; :func:`tpify.layout.build_layout`), None: never (every split size must be
    divisible)."""

    model: nn.Module
    config: object
    recipe: object
    tp_size: int
    pad_vocab_multiple: int
    errors: list[str]
    need_divisible: Callable[[str, int], None]
    packed_sizes: Callable = None  # (rule, out_features, owner, fqn) -> global part widths or None
    ep_size: int = 1
    kv_shards: Callable = None  # (what, kv heads) -> None (split) or the KV heads (replicated); False: error
    may_be_uneven: Callable[[str], bool] | None = None  # module FQN -> may it split unevenly (no heads in it)

    def split_size(self, fqn: str, what: str, value: int, entry: "ModuleLayout") -> None:
        """A size module ``fqn`` splits over the ranks (output or input features, an intermediate
        size): ``tp_size`` must divide it (:attr:`need_divisible`, the error and the sizes that
        would work), unless the planner lets the module split unevenly (:attr:`may_be_uneven`: it
        holds no heads); then a size ``tp_size`` does not divide sets ``entry.uneven`` (split by
        torch.chunk's rule) and constrains nothing."""
        if self.may_be_uneven is not None and self.may_be_uneven(fqn):
            if value % self.tp_size:
                entry.uneven = True
            return
        self.need_divisible(what, value)

    def kv_placement(self, what: str, kv: int):
        """How ``kv`` KV heads go over the ranks: None (``tp_size`` divides them: split), ``kv``
        (``tp_size`` is a multiple of them: each held by ``tp_size / kv`` ranks), False (neither;
        the error recorded). The planner's :meth:`kv_shards` when given (it reports the legal
        sizes), else the same rule here."""
        if self.kv_shards is not None:
            return self.kv_shards(what, kv)
        if kv % self.tp_size == 0:
            return None
        if self.tp_size % kv == 0:
            return kv
        self.errors.append(f"{what}: {kv} KV heads at tp_size = {self.tp_size}: tp_size must divide them or be a "
                           f"multiple of them")
        return False

    def kv_heads(self, rule, fqn: str) -> int | None:
        """The rule's ``kv_heads`` as a number (a config attribute read), or None (an error
        recorded when the attribute is no positive integer)."""
        value = rule.kv_heads if not isinstance(rule.kv_heads, str) else config_get(self.config, rule.kv_heads)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.errors.append(f"{fqn}: {rule.describe()} reads its KV heads from config.{rule.kv_heads}, which is "
                               f"{value!r}, not a positive integer")
            return None
        return value


class Style:
    """One recipe style. Subclasses set the class attributes and override what differs.

    Attributes:
        name: the recipe's name for it.
        kind: the module kind it splits (``"linear"``: ``nn.Linear``/``Conv1D``; ``"embedding"``;
            ``"params"``: named parameters of any other module, fused MoE experts), or None
            (``replicate``: any module).
        region: ``"start"`` when the module's output stays sharded (a sharded region begins
            after it: column styles), ``"end"`` when its input is sharded (a region ends before
            it: ``rowwise``), else None. The dropout streams and the region-gradient hooks
            follow the regions (tpify.hooks.dropout, tpify.hooks.region_grads).
        lm_head: the vocabulary-parallel LM head (``colwise_rep``): the parallel LM loss reads its
            shards.
        vocab_rows: splits a vocabulary's rows (a tied embedding and LM head must both do so).
        sequence_parallel: whether ``sequence_parallel=True`` supports the style.
    """

    name = ""
    kind: str | None = None
    region: str | None = None
    lm_head = False
    vocab_rows = False
    sequence_parallel = True  # may lie in a sequence-parallel stretch (its maths does not depend on T)
    sequence_parallel_refusal = ""  # why not, when sequence_parallel is False

    @property
    def shards(self) -> bool:
        """Whether the style splits the module at all (every style but ``replicate``)."""
        return self.kind is not None

    def accepts(self, module: nn.Module) -> bool:
        """Whether ``module`` is of the kind this style splits (any module for ``replicate``)."""
        return self.kind is None or module_kind(module) == self.kind

    def plan(self, ctx: PlanContext, fqn: str, module: nn.Module, rule) -> ModuleLayout | None:
        """Check ``module`` for this style and return its :class:`ModuleLayout` (specs included),
        or None after appending to ``ctx.errors``. Pure; no communication."""
        entry = ModuleLayout(fqn, self.name, rule.index)
        before = len(ctx.errors)
        if not self._check_module(ctx, fqn, module, rule, entry) or not self._sizes(ctx, fqn, module, rule, entry):
            return None
        try:
            entry.specs = self.param_specs(module, entry, ctx.tp_size)
        except ValueError as e:  # sizes tp_size does not divide: reported by need_divisible, unless something else
            if len(ctx.errors) == before:
                ctx.errors.append(f"{fqn} ({type(module).__name__}, {self.name}): {e}")
        return entry

    def _check_module(self, ctx: PlanContext, fqn: str, module: nn.Module, rule, entry: ModuleLayout) -> bool:
        """The module is of this style's kind and computes what the plain layer computes (or the
        recipe's ``[subclasses]`` says what its ``forward`` adds)."""
        kind = module_kind(module)
        if not self.accepts(module):
            ctx.errors.append(f"{fqn} is a {type(module).__name__}; style {self.name!r} ({rule.describe()}) does not "
                              f"apply to it" if kind is not None else
                              f"{fqn} is a {qualname(module)}, not one of {SHARDABLE_TYPES}; {rule.describe()} gives "
                              f"it style {self.name!r} (only 'replicate' applies to a container module)")
            return False
        overridden = overrides_forward(module)
        if not overridden:
            return True
        declared = ctx.recipe.subclasses.get(type(module).__name__)
        if declared is None:
            ctx.errors.append(f"{fqn} is a {qualname(module)}, a subclass of {overridden} that overrides forward; "
                              f"tpify swaps only what it understands (its parallel version would drop what that "
                              f"forward adds). Give it style 'replicate', or declare in the recipe's [subclasses] "
                              f"what its forward computes (forward = 'plain' or 'scaled', docs/recipes.md)")
            return False
        forward, scale_attr = declared
        if forward != "scaled":
            return True
        scale = getattr(module, scale_attr, None)
        number = (isinstance(scale, (int, float)) and not isinstance(scale, bool)) or (
            isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.is_meta and scale.is_floating_point())
        if self.name != "embedding_rowwise" or not number:
            ctx.errors.append(f"{fqn} ({type(module).__name__}): [subclasses] forward = 'scaled' applies to an "
                              f"nn.Embedding with style 'embedding_rowwise' whose attribute {scale_attr!r} is a number "
                              f"or a one-element float tensor holding a value; here the style is {self.name!r} and "
                              f"{scale_attr} = {scale!r}")
            return False
        entry.output_scale, entry.scale_attr = float(scale), scale_attr
        return True

    def _sizes(self, ctx: PlanContext, fqn: str, module: nn.Module, rule, entry: ModuleLayout) -> bool:
        """Check and record the style's sizes (divisibility, padding, parts); False on an error."""
        return True

    def param_specs(self, module: nn.Module, entry: ModuleLayout, tp_size: int) -> dict[str, ShardSpec | None]:
        """Each parameter's spec, by name (``None``: replicated)."""
        return {}

    def build(self, module: nn.Module, entry: ModuleLayout, ctx: TPContext) -> nn.Module:
        """The parallel module holding this rank's shard of ``module`` (surgery), built in the
        model's context ``ctx`` (:class:`~tpify.context.TPContext`: group, size, rank, the shared
        region entry); ``module`` itself when the style does not split. Works on the meta device."""
        return module


class _Replicate(Style):
    """``replicate``: a full copy on every rank (any module; a container's whole contents). With the
    rule's ``params`` (a module that is no layer): only the module's own parameters it names, on
    purpose (a position table held by a vision tower whose layers are split), its children keeping
    their own rules; a name the module does not hold itself is a plan error."""

    name = "replicate"

    def plan(self, ctx, fqn, module, rule):
        entry = ModuleLayout(fqn, self.name, rule.index, params=rule.params)
        own = dict(module.named_parameters(recurse=False))
        missing = [name for name, _, _ in rule.params if name not in own]
        if missing:
            ctx.errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} keeps its parameters {missing} "
                              f"whole, but it holds no such parameter of its own (it holds {sorted(own)})")
            return None
        return entry


class _ReplicateSumGrads(_Replicate):
    """``replicate_sum_grads``: a full copy on every rank (any module that is no container of split
    layers: a norm) whose parameters' gradients are partial sums on each rank, summed over the TP
    group in backward (:mod:`tpify.hooks.region_grads`; transformers' ``replicated_with_grad_allreduce``).

    For a module that runs on replicated activations but whose output only this rank's heads read,
    where tpify cannot find it by construction: dots3's ``k_rope_only_layernorm`` normalises
    multi-head latent attention's rotary key, which goes from the ``latent`` projection (the sharded
    region ended before it) straight into every local head, so each rank's gradient of its weight is
    the part of its own heads. (A replicated module inside a sharded region needs no rule: tpify
    sums its gradients by construction, :class:`tpify.hooks.region_grads.ReplicatedInRegion`.)
    Declared on a module whose gradient is already whole it would come out ``tp_size`` times too
    large: ``tpify verify`` checks every gradient.

    Communication: backward, one all-reduce of each of its parameters' gradients.
    """

    name = "replicate_sum_grads"
    sequence_parallel = False
    sequence_parallel_refusal = ("its gradient would be partial over the tokens as well as the heads; not supported "
                                 "yet")


class _Embedding(Style):
    kind = "embedding"

    def _sizes(self, ctx, fqn, module, rule, entry):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            ctx.errors.append(f"{fqn}: {self.name} cannot shard an nn.Embedding with max_norm, scale_grad_by_freq or "
                              f"sparse (they need the whole table); use 'replicate'")
            return False
        return self._table_sizes(ctx, fqn, module, entry)

    def _table_sizes(self, ctx, fqn, module, entry) -> bool:
        return True


class _EmbeddingRowwise(_Embedding):
    """``embedding_rowwise``: :class:`VocabParallelEmbedding`, the vocabulary rows split and padded
    to a multiple of ``pad_vocab_multiple * tp_size``; one all-reduce forward."""

    name = "embedding_rowwise"
    vocab_rows = True

    def _table_sizes(self, ctx, fqn, module, entry):
        entry.padded_size = pad_vocab_size(module.num_embeddings, ctx.tp_size, ctx.pad_vocab_multiple)
        return True

    def param_specs(self, module, entry, tp_size):
        return {"weight": vocab_rows_spec(module.num_embeddings, tp_size, entry.padded_size)}

    def build(self, module, entry, ctx):
        scale = getattr(module, entry.scale_attr) if entry.scale_attr else None
        return VocabParallelEmbedding.from_dense(module, ctx.group, padded_num_embeddings=entry.padded_size,
                                                 output_scale=scale, context=ctx)


class _EmbeddingColwise(_Embedding):
    """``embedding_colwise``: :class:`ColumnParallelEmbedding`, a table whose columns are heads (T5's
    relative attention bias) split by columns; no communication."""

    name = "embedding_colwise"
    region = "start"
    sequence_parallel = False
    sequence_parallel_refusal = "relative attention biases are built for all (T, T) positions"

    def _table_sizes(self, ctx, fqn, module, entry):
        ctx.need_divisible(f"{fqn}.embedding_dim ({type(module).__name__}, embedding_colwise)", module.embedding_dim)
        return True

    def param_specs(self, module, entry, tp_size):
        return {"weight": embedding_columns_spec(module.embedding_dim, tp_size)}

    def build(self, module, entry, ctx):
        return ColumnParallelEmbedding.from_dense(module, ctx.group, context=ctx)


class _Colwise(Style):
    """``colwise``: :class:`ColumnParallelLinear`, the output features split, output left sharded."""

    name = "colwise"
    kind = "linear"
    region = "start"

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        if rule.kv_heads is not None:  # K/V projections: KV heads split, or each held by a group of ranks
            kv = ctx.kv_heads(rule, fqn)
            shards = None if kv is None else ctx.kv_placement(f"{fqn} ({type(module).__name__}, colwise, kv_heads = "
                                                           f"{rule.kv_heads})", kv)
            if kv is None or shards is False:  # the error is recorded (the layout is refused); the module is
                entry.replicated_parts = (0,)  # covered, with specs that hold (whole on every rank)
                return True
            if shards is not None:
                entry.replicated_parts, entry.replica_shards = (0,), shards
                return True
        ctx.split_size(fqn, f"{fqn}.out_features ({type(module).__name__}, colwise)", out_f, entry)
        return True

    def param_specs(self, module, entry, tp_size):
        _, out_f, layout = dense_dims(module)
        weight, bias = column_specs(out_f, tp_size, layout, entry.partition_sizes, entry.padded_size,
                                    entry.replicated_parts, entry.replica_shards, entry.uneven)
        return {"weight": weight, "bias": bias if module.bias is not None else None}

    def build(self, module, entry, ctx):
        return ColumnParallelLinear.from_dense(
            module, ctx.group, gather_output=self.lm_head, partition_sizes=entry.partition_sizes,
            padded_out_features=entry.padded_size, replicated_parts=entry.replicated_parts,
            replica_shards=entry.replica_shards, sequence_parallel=entry.sequence_parallel, uneven=entry.uneven,
            context=ctx)


class _PackedColwise(_Colwise):
    """``packed_colwise``: column-parallel, each packed part (GPT-2's ``[Q | K | V]``, grouped-query
    parts of unequal widths) split separately; ``replicated_parts`` (the K/V parts, of ``kv_heads``
    heads, 1 by default: multi-query) split by KV heads when ``tp_size`` divides them, else each
    KV head held by ``tp_size / kv_heads`` ranks (whole on every rank for one KV head). Equal parts
    (``parts = <n>``, no replicated parts, no ``kv_heads``: phi3's ``gate_up_proj``) may be split
    unevenly where the planner finds no heads; parts weighed by head counts never are."""

    name = "packed_colwise"

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        owner = ctx.model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else None
        sizes = ctx.packed_sizes(rule, out_f, owner, fqn)
        if sizes is None:
            return False
        entry.partition_sizes = sizes
        if rule.replicated_parts:
            kv = 1 if rule.kv_heads is None else ctx.kv_heads(rule, fqn)
            shards = None if kv is None else ctx.kv_placement(
                f"{fqn} ({type(module).__name__}, packed_colwise, parts {list(rule.replicated_parts)} of kv_heads = "
                f"{1 if rule.kv_heads is None else rule.kv_heads})", kv)
            if kv is None or shards is False:  # the error is recorded (the layout is refused); the module is
                entry.replicated_parts = rule.replicated_parts  # covered, with specs that hold
            elif shards is not None:
                entry.replicated_parts, entry.replica_shards = rule.replicated_parts, shards
        equal = isinstance(rule.parts, int) and not entry.replicated_parts and rule.kv_heads is None
        for i, size in enumerate(sizes):
            if i in entry.replicated_parts:
                continue
            what = f"{fqn} packed part {i} of out_features"
            if equal:
                ctx.split_size(fqn, what, size, entry)
            else:  # parts weighed by head counts: whole heads per rank
                ctx.need_divisible(what, size)
        return True


class _ColwiseRep(_Colwise):
    """``colwise_rep``: the LM head, column-parallel over the vocabulary, padded when ``p`` does not
    divide it, the logits gathered (padding stripped), or kept sharded for the parallel loss."""

    name = "colwise_rep"
    region = None
    lm_head = True
    vocab_rows = True

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        if out_f % (ctx.pad_vocab_multiple * ctx.tp_size):
            entry.padded_size = pad_vocab_size(out_f, ctx.tp_size, ctx.pad_vocab_multiple)
        return True


class _Rowwise(Style):
    """``rowwise``: :class:`RowParallelLinear`, the input features split (the input already sharded),
    the bias replicated and added once after the all-reduce."""

    name = "rowwise"
    kind = "linear"
    region = "end"

    def _sizes(self, ctx, fqn, module, rule, entry):
        in_f, _, _ = dense_dims(module)
        ctx.split_size(fqn, f"{fqn}.in_features ({type(module).__name__}, rowwise)", in_f, entry)
        return True

    def param_specs(self, module, entry, tp_size):
        in_f, _, layout = dense_dims(module)
        return {"weight": row_spec(in_f, tp_size, layout, entry.uneven), "bias": None}

    def build(self, module, entry, ctx):
        return RowParallelLinear.from_dense(module, ctx.group, input_is_parallel=True,
                                            sequence_parallel=entry.sequence_parallel, uneven=entry.uneven, context=ctx)


class _Params(Style):
    """A style splitting named parameters (the rule's ``params``) of a module no layer style knows."""

    kind = "params"

    def accepts(self, module):
        return module_kind(module) is None

    def _named(self, ctx, fqn, module, rule, holds: str) -> tuple[dict, list[str]] | None:
        """``(the module's own parameters, problems with the rule's params)``: a parameter it lacks,
        a dimension it lacks; None after recording an error when the module is a layer."""
        if not self.accepts(module):
            ctx.errors.append(f"{fqn} is a {type(module).__name__}; style {self.name!r} ({rule.describe()}) splits "
                              f"the named parameters of {holds}, not an {SHARDABLE_TYPES} layer")
            return None
        own = dict(module.named_parameters(recurse=False))
        problems = [f"it holds no parameter {name!r}" for name, _, _ in rule.params if name not in own]
        problems += [f"{name} has {own[name].dim()} dimensions, so it has no dimension {dim}"
                     for name, dim, _ in rule.params if name in own and own[name].dim() <= dim]
        return own, problems


class _Experts(_Params):
    """``experts``: a module holding fused expert weights (transformers' ``*Experts``:
    ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), its named parameters split.

    Tensor-parallel experts (Megatron-LM's TP experts; Shazeer et al., arXiv:1701.06538, for the
    layer): each parameter of the rule's ``params`` is split along its ``dim`` (``gate_up_proj`` by
    each of its 2 packed parts ``[gate | up]``, ``down_proj`` by its input), so rank ``r`` holds
    every expert's intermediate columns ``[r I/p, (r+1) I/p)`` (an intermediate size ``p`` does not
    divide: torch.chunk's ``ceil(I/p)`` columns per rank, fewer on the last ones; not for
    interleaved gate/up pairs) and the module's output is a partial sum: the module keeps its own
    forward (``experts_implementation``), and :mod:`tpify.hooks.experts` copies its inputs into the
    region (Megatron's ``f``: their gradients all-reduced in backward) and all-reduces its output
    (``g``). With ``ep_size = tp_size`` (expert parallelism): every parameter is split along dim 0
    instead, rank ``r`` holds experts ``[r E/p, (r+1) E/p)`` whole (its ``num_experts`` becomes
    ``E/p``), and the hooks exchange the tokens with all-to-all. Under sequence parallelism the MoE
    block holding the module is gathered (:func:`tpify.layout._moe_blocks`,
    :mod:`tpify.hooks.sequence_parallel`).

    The module must compute a sum over the split dimension (what ``tpify verify`` proves). What
    would count ``p`` times or see a partial sum is refused: a parameter the rule does not name,
    a child with parameters (a norm after each expert), transformers' ``has_post_expert_norm``.
    transformers' experts interface (``is_concatenated``, ``is_transposed``, ``has_bias``) is
    checked against the split: concatenated ``[gate | up]`` in 2 parts, interleaved ``[g0, u0,
    g1, u1, ...]`` (gpt-oss) in ONE contiguous part (each rank's range holds whole pairs, in the
    order the forward reads them), each parameter along its intermediate dimension, and
    ``down_proj_bias`` (added to each expert's output) named ``{ after_sum = true }``: kept whole,
    counted once after the sum (:class:`tpify.hooks.experts.TensorParallelExperts`).
    """

    name = "experts"
    kind = "params"

    def _check_module(self, ctx, fqn, module, rule, entry):
        cls = type(module).__name__
        named = self._named(ctx, fqn, module, rule, "a module holding fused expert weights")
        if named is None:
            return False
        own, problems = named
        names = [name for name, _, _ in rule.params]
        extra = sorted(set(own) - set(names))
        if extra:
            problems.append(f"it holds parameters {extra} that the rule does not split: the experts' output is "
                            f"summed over the ranks, so a parameter each rank would apply whole (a bias added after "
                            f"down_proj) would count tp_size times")
        children = sorted(n for n, c in module.named_children() if any(True for _ in c.parameters()))
        if children:
            problems.append(f"its children {children} hold parameters (a norm after each expert would see a partial "
                            f"sum)")
        flags = {"has_post_expert_norm": True, "_is_expert_parallel": True}
        problems += [f"{flag} = {value} (transformers' experts interface)" for flag, value in flags.items()
                     if getattr(module, flag, not value) is value]
        problems += _interface_problems(module, own, rule.params, ctx.ep_size > 1)
        if ctx.ep_size > 1:
            problems += self._expert_parallel_problems(module, own, names)
        identity = rule.identity_from
        if isinstance(identity, str):
            identity = config_get(ctx.config, identity)
        if rule.identity_from is not None and (not isinstance(identity, int) or isinstance(identity, bool)
                                               or identity < 0):
            problems.append(f"identity_from = {rule.identity_from!r} is {identity!r}, not a non-negative integer (the "
                            f"first expert index of the identity experts)")
        elif rule.identity_from is not None and ctx.ep_size > 1:
            problems.append("identity experts (identity_from) with expert parallelism: a token routed to one has no "
                            "rank to travel to (not supported: use tensor-parallel experts)")
        if problems:
            ctx.errors.append(f"{fqn} ({cls}): style 'experts' ({rule.describe()}) cannot split it: "
                              + "; ".join(problems) + ". tpify splits only what it understands: give the module "
                              "style 'replicate' to keep it whole")
            return False
        entry.params, entry.expert_parallel = rule.params, ctx.ep_size > 1
        entry.identity_experts = identity if rule.identity_from is not None else None
        return True

    @staticmethod
    def _expert_parallel_problems(module, own, names) -> list[str]:
        """What expert parallelism needs of the module: ``num_experts`` = dim 0 of every split
        parameter, and transformers' experts signature ``(hidden_states, top_k_index, top_k_weights)``."""
        problems = []
        experts = getattr(module, "num_experts", None)
        sizes = {name: tuple(own[name].shape)[0] for name in names if name in own}
        if not isinstance(experts, int) or isinstance(experts, bool) or any(s != experts for s in sizes.values()):
            problems.append(f"expert parallelism splits dim 0 of {sorted(sizes)} (sizes {sorted(set(sizes.values()))}) "
                            f"as the experts, but its num_experts is {experts!r}")
        try:
            signature = list(inspect.signature(type(module).forward).parameters)[1:4]
        except (TypeError, ValueError):
            signature = []
        if [_EXPERTS_ALIASES.get(name, name) for name in signature] != list(_EXPERTS_ARGUMENTS):
            problems.append(f"expert parallelism exchanges the arguments {list(_EXPERTS_ARGUMENTS)} of its forward, "
                            f"which takes {signature}")
        return problems

    def _sizes(self, ctx, fqn, module, rule, entry):
        if entry.expert_parallel:
            ctx.need_divisible(f"{fqn}.num_experts ({type(module).__name__}, experts, ep_size)", module.num_experts)
            return True
        ok = True
        for name, dim, parts in rule.params:
            if dim == AFTER_SUM:
                continue
            size = getattr(module, name).shape[dim]
            if name in _GATE_UP and getattr(module, "is_concatenated", True) is False:
                # interleaved [g0, u0, g1, u1, ...]: each rank's contiguous slice must hold whole (g, u) pairs,
                # as many on every rank (torch.chunk's rule over 2I columns could cut a pair: never uneven)
                ctx.need_divisible(f"{fqn}.{name} dimension {dim} (interleaved gate/up pairs, never split unevenly)",
                                   size // 2)
                continue
            if size % parts:
                ctx.errors.append(f"{fqn}.{name}: dimension {dim} of size {size} cannot hold {parts} equal parts")
                ok = False
                continue
            ctx.split_size(fqn, f"{fqn}.{name} dimension {dim}" + (f" (each of {parts} parts)" if parts > 1 else ""),
                           size // parts, entry)
        return ok

    def param_specs(self, module, entry, tp_size):
        specs = {}
        for name, dim, parts in entry.params:
            shape = getattr(module, name).shape
            if entry.expert_parallel:
                specs[name] = ShardSpec(0, (shape[0],), tp_size)
            elif dim == AFTER_SUM:
                specs[name] = None  # replicated, counted once after the sum (tpify.hooks.experts)
            else:
                specs[name] = ShardSpec(dim, (shape[dim] // parts,) * parts, tp_size, uneven=entry.uneven)
        return specs

    def build(self, module, entry, ctx):
        """``module`` itself, each split parameter replaced by this rank's slice (carrying its spec);
        with expert parallelism its ``num_experts`` divided. Works on the meta device."""
        _slice_params(module, entry.specs, ctx.rank)
        if entry.expert_parallel:
            module.num_experts //= ctx.size
        return module


class _Latent(Style):
    """``latent``: a low-rank down projection of multi-head latent attention, a full copy on every rank.

    DeepSeek-V2 (arXiv:2405.04434, section 2.1.2) compresses the keys and values of all heads into
    one latent ``c = x W_DKV`` of ``kv_lora_rank`` features (and the queries into one of
    ``q_lora_rank``), then up-projects it per head (``kv_b_proj``, ``q_b_proj``: ``colwise`` by
    heads); a decoupled rotary key ``k_pe = RoPE(x W_KR)`` of ``qk_rope_head_dim`` features,
    computed by the same ``nn.Linear`` (``kv_a_proj_with_mqa``, its last features), is shared by
    every head. Megatron-LM keeps such down projections whole on every rank
    (``linear_q_down_proj``, ``linear_kv_down_proj``): they are small (their width is the latent's
    rank, not heads x head dim) and their output is read by every head.

    Gradients: the column-parallel up projections sum the latent's gradient over the ranks (their
    region entry, Megatron's ``f``), so the latent's gradient, and every gradient upstream of it,
    is whole on every rank. The rotary key goes to the heads without such a layer: each rank's
    heads give only part of its gradient, so :mod:`tpify.hooks.latent` sums the gradient of the
    last ``shared`` output features over the ranks (one all-reduce of ``B*T*shared`` values in
    backward), as transformers' ``mla_kv_a_proj`` does. The module reads the replicated hidden
    states although it runs after the query's column-parallel layer: the hook ends the sharded
    region before it (as before a row-parallel layer), so that it and the norm after it are not
    taken for replicated modules inside a region (whose gradients would then be summed twice).

    Errors (``PlanError``, at planning): ``shared`` not a non-negative integer below the output
    features.
    """

    name = "latent"
    kind = "linear"
    sequence_parallel = False
    sequence_parallel_refusal = ("the latent would be computed from T/p tokens and gathered by the up projections; "
                                 "not supported yet")

    @property
    def shards(self) -> bool:
        """A full copy: nothing is split (the hooks make its gradients whole)."""
        return False

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        shared = rule.shared if not isinstance(rule.shared, str) else config_get(ctx.config, rule.shared)
        if shared is None and rule.shared is None:
            shared = 0
        if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < out_f:
            ctx.errors.append(f"{fqn} ({type(module).__name__}, latent): {rule.describe()} gives shared = "
                              f"{rule.shared!r} = {shared!r}, not an integer in [0, {out_f}) (its output features)")
            return False
        entry.shared_features = shared
        return True


def _slice_params(module: nn.Module, specs: dict, rank: int) -> None:
    """Each parameter of ``module`` that has a spec replaced by this rank's slice (carrying the
    spec); parameters without one (``None``) stay whole. Works on the meta device."""
    with torch.no_grad():
        for name, spec in specs.items():
            if spec is None:
                continue
            dense = getattr(module, name)
            shard = nn.Parameter(spec.slice_dense(dense, rank), requires_grad=dense.requires_grad)
            shard.tp_shard_spec = spec
            setattr(module, name, shard)


#: ``dim`` of an ``experts`` rule's parameter that is not split: a bias added to every expert's
#: output (``down_proj_bias (E, H)``), kept whole and counted once after the sum over the ranks.
AFTER_SUM = -1
#: The "dimension" of a parameter a ``replicate`` rule's ``params`` names: kept whole on purpose.
WHOLE = -2
#: transformers' experts interface (integrations/moe.py): the packed gate/up parameters, the
#: dimension of ``I`` in each parameter (by ``is_transposed``), and the bias added after ``down_proj``.
_GATE_UP = ("gate_up_proj", "gate_up_proj_bias")
_INTERMEDIATE_DIM = {"gate_up_proj": {False: 1, True: 2}, "gate_up_proj_bias": {False: 1, True: 1},
                     "up_proj": {False: 1, True: 2}, "up_proj_bias": {False: 1, True: 1},
                     "down_proj": {False: 2, True: 1}}
_DOWN_BIAS = "down_proj_bias"


def _interface_problems(module: nn.Module, own: dict, params, expert_parallel: bool) -> list[str]:
    """What would split a transformers experts module wrong, from its interface flags
    (``is_concatenated``, ``is_transposed``, ``has_bias``) and the names it uses: the packed
    ``[gate | up]`` (concatenated) split as 2 parts, interleaved ``[g0, u0, g1, u1, ...]`` as one
    contiguous range (whole pairs per rank), each parameter along its intermediate dimension, and
    ``down_proj_bias`` (added after ``down_proj``) kept whole and counted once (``after_sum``)."""
    problems = []
    transposed = getattr(module, "is_transposed", None)
    concatenated = getattr(module, "is_concatenated", None)
    for name, dim, parts in params:
        if dim == AFTER_SUM:
            if name != _DOWN_BIAS or getattr(module, "has_bias", False) is not True:
                problems.append(f"{name}: after_sum is for transformers' {_DOWN_BIAS} (has_bias = True), the bias "
                                f"added to each expert's output")
            continue
        if expert_parallel:
            continue
        if name == _DOWN_BIAS:
            problems.append(f"{name} is added to each expert's output after down_proj: split, it would be added "
                            f"tp_size times; give it after_sum = true")
        if name in _GATE_UP and concatenated is True and parts != 2:
            problems.append(f"{name} holds [gate | up] concatenated (is_concatenated = True): split it as parts = 2")
        if name in _GATE_UP and concatenated is False and parts != 1:
            problems.append(f"{name} holds gate and up interleaved [g0, u0, g1, u1, ...] (is_concatenated = "
                            f"False): two contiguous parts would cut it wrong; split it as one part (each rank a "
                            f"contiguous range of whole (gate, up) pairs)")
        want = _INTERMEDIATE_DIM.get(name, {}).get(transposed) if isinstance(transposed, bool) else None
        if want is not None and dim != want:
            problems.append(f"{name} has its intermediate dimension at dim {want} (is_transposed = {transposed}), "
                            f"not {dim}")
    named = {name for name, _, _ in params}
    if (not expert_parallel and getattr(module, "has_bias", False) is True and _DOWN_BIAS in own
            and _DOWN_BIAS not in named):
        problems.append(f"has_bias = True: name {_DOWN_BIAS} in params with after_sum = true")
    return problems


class _PerHead(_Params):
    """``per_head``: named parameters of a module (an attention module or a part of it) that hold one
    value per head, split with the heads: attention sinks ``(num_heads,)`` (gpt-oss, Xiao et al.,
    arXiv:2309.17453), neomme's exclusive-attention ``alpha (num_heads,)``.

    Each parameter of the rule's ``params`` is split along its ``dim`` in ``tp_size`` contiguous
    ranges, as the column-parallel ``q_proj`` splits the heads (rank ``r`` holds heads ``[r n/p,
    (r+1) n/p)``), so each rank's slice is read by its own heads only: its gradient is complete on
    the rank that holds it, and no collective is issued. With the rule's ``kv_heads`` the
    parameters hold one value per KV head: split by KV heads when ``tp_size`` divides them, else
    (``tp_size`` a multiple of them) each KV head's value held by the ``tp_size / kv_heads`` ranks
    whose query heads read it, its gradient summed over that group in backward (one all-reduce of
    the parameter's gradient per backward, :mod:`tpify.hooks.per_head`), as the K/V weights'.
    The module keeps its own forward and its other parameters (norms over ``head_dim``) whole.

    Raises (as plan errors): the module holds no such parameter or it has no such dimension; its
    size along ``dim`` is not divisible by ``tp_size`` (or, with ``kv_heads``, differs from the KV
    heads or fits the ranks neither way).
    """

    name = "per_head"

    def _check_module(self, ctx, fqn, module, rule, entry):
        cls = type(module).__name__
        named = self._named(ctx, fqn, module, rule, "a module holding values per head (attention sinks)")
        if named is None:
            return False
        own, problems = named
        problems += [f"{name}: parts = {parts} (a per-head parameter is one run of heads)"
                     for name, _, parts in rule.params if parts != 1]
        extra = sorted(set(own) - {name for name, _, _ in rule.params})
        if extra:
            problems.append(f"it also holds parameters {extra} that the rule does not name (a module whose "
                            f"parameters a style splits gets no replicated-gradient hook: tpify.hooks.region_grads)")
        if problems:
            ctx.errors.append(f"{fqn} ({cls}): style 'per_head' ({rule.describe()}) cannot split it: "
                              + "; ".join(problems))
            return False
        entry.params = rule.params
        return True

    def _sizes(self, ctx, fqn, module, rule, entry):
        sizes = {name: getattr(module, name).shape[dim] for name, dim, _ in rule.params}
        if rule.kv_heads is None:
            for name, size in sizes.items():
                ctx.need_divisible(f"{fqn}.{name} heads ({type(module).__name__}, per_head)", size)
            return True
        kv = ctx.kv_heads(rule, fqn)
        if kv is None:
            return False
        wrong = {name: size for name, size in sizes.items() if size != kv}
        if wrong:
            ctx.errors.append(f"{fqn} ({type(module).__name__}, per_head, kv_heads = {rule.kv_heads}): parameters "
                              f"{wrong} do not hold one value per KV head ({kv})")
            return False
        shards = ctx.kv_placement(f"{fqn} ({type(module).__name__}, per_head, kv_heads = {rule.kv_heads})", kv)
        if shards is False:  # the error is recorded; the specs hold (whole on every rank)
            entry.replicated_parts = (0,)
        elif shards is not None:
            entry.replicated_parts, entry.replica_shards = (0,), shards
        return True

    def param_specs(self, module, entry, tp_size):
        return {name: ShardSpec(dim, (getattr(module, name).shape[dim],), tp_size, None, entry.replicated_parts,
                                entry.replica_shards)
                for name, dim, _ in entry.params}

    def build(self, module, entry, ctx):
        """``module`` itself, each named parameter replaced by this rank's slice (carrying its spec).
        Works on the meta device."""
        _slice_params(module, entry.specs, ctx.rank)
        return module


#: The arguments of transformers' experts forward (integrations/moe.py), in order.
_EXPERTS_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
#: Other names of the same arguments (gpt-oss's experts forward: router_indices, routing_weights).
_EXPERTS_ALIASES = {"router_indices": "top_k_index", "routing_weights": "top_k_weights"}


STYLES: dict[str, Style] = {s.name: s for s in (_Colwise(), _PackedColwise(), _ColwiseRep(), _Rowwise(),
                                                _EmbeddingRowwise(), _EmbeddingColwise(), _Experts(), _Latent(), _PerHead(),
                                                _Replicate(), _ReplicateSumGrads())}


def style_of(name: str) -> Style:
    """The :class:`Style` named ``name``.

    Raises:
        KeyError: no such style (recipes are validated against ``STYLES`` when read).
    """
    return STYLES[name]
