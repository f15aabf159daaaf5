"""Context parallelism by hooks: attention over the split sequence, the call's checks, the gradients.

Each rank of the CP group holds ``T / cp`` tokens of every sequence; no HF ``forward`` is
replaced. :func:`context_parallel_attention` (transformers' ``AttentionInterface``,
``"tpify_context_parallel"``) all-gathers ``[K | V]`` over the CP group per layer (backward: one
reduce-scatter of ``[dK | dV]``), recomputed in backward (Llama 3's form, arXiv:2407.21783,
section 3.3.2), or runs the ring (:mod:`tpify.hooks.cp_ring`) or the Ulysses all-to-all
(:mod:`tpify.hooks.cp_ulysses`) as ``parallelize(cp_attention=...)`` chose;
:class:`ContextParallelHooks` checks each call, gathers the position ids, and sums the
parameters' gradients over the CP group; ``generate`` is refused. How and why:
docs/context-parallelism.md.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..context import TPContext
from .cp_ring import ring_attention
from .cp_ulysses import ulysses_attention
from ..context_parallel import ONE_DOCUMENT_KWARG, load_balanced_index, sequence_order
from ..grad_sums import SummedGrads
from ..info import TPUsageError

__all__ = ["ATTN_IMPLEMENTATION", "CALL_KWARG", "ContextParallelCall", "ContextParallelHooks",
           "context_parallel_attention", "install"]

#: The name of :func:`context_parallel_attention` in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "tpify_context_parallel"
#: The keyword argument that carries a call's :class:`ContextParallelCall` to the attention function.
CALL_KWARG = "tpify_context_parallel"

_FIRST_DOCUMENT_ONLY = ("context parallelism: the position ids gathered over the CP group restart at a value other "
                        "than 0 inside a sequence: pass the position_ids tpify.context_parallel.split_batch returns "
                        "(global positions of this rank's tokens), not positions counted from 0 on each rank; "
                        "packed documents restart at position 0")


class ContextParallelCall:
    """What one forward call of a context-parallel model tells its attention layers.

    Attributes:
        group, size: the CP group and its size.
        q_index: ``(T / cp,)`` global token indices of this rank's tokens (the queries).
        k_index: ``(T,)`` global token indices of the gathered keys (rank order).
        doc_q, doc_k: ``(B', T / cp)`` and ``(B', T)`` the document of each query and key (packed
            sequences: a new document where the position ids do not go up by one), ``B'`` 1 or B.
        calls: attention layers that ran in this call (checked against the model's layers).
        one_document: True when the host knows that every row is one document (the batch came
            through ``split_batch`` without ``position_ids``), else None (the ring reads it once).
    """

    __slots__ = ("group", "size", "rank", "mode", "q_index", "k_index", "doc_q", "doc_k", "calls", "one_document")

    def __init__(self, group, size: int, q_index, k_index, doc_q, doc_k, rank: int = 0, mode: str = "allgather"):
        self.group, self.size, self.rank, self.mode = group, size, rank, mode
        self.q_index, self.k_index, self.doc_q, self.doc_k = q_index, k_index, doc_q, doc_k
        self.calls = 0
        self.one_document = None  # True: known on the host (split_batch made the positions); None: read if needed

    @classmethod
    def from_positions(cls, group, size: int, rank: int, gathered: torch.Tensor,
                       mode: str = "allgather") -> tuple["ContextParallelCall", torch.Tensor]:
        """The call of rank ``rank`` of ``size`` from the position ids of every rank's tokens,
        ``gathered`` ``(B', T)`` in rank order (an all-gather of each rank's ``(B', T/cp)``), and a
        0-dim bool: True when every document after the first of a sequence starts at position 0.

        Documents are transformers' (``find_packed_sequence_indices``): a new one wherever the
        position ids, in sequence order, do not go up by one. Pure; no communication."""
        total = gathered.shape[1]
        k_index = sequence_order(total, size, gathered.device)
        natural = gathered.index_select(1, torch.argsort(k_index))  # sequence order
        starts = torch.ones_like(natural, dtype=torch.bool)
        starts[:, 1:] = natural[:, 1:] != natural[:, :-1] + 1
        ok = ~(starts[:, 1:] & (natural[:, 1:] != 0)).any()
        docs = starts.cumsum(1)
        q_index = load_balanced_index(total, size, rank, gathered.device)
        return cls(group, size, q_index, k_index, docs.index_select(1, q_index), docs.index_select(1, k_index),
                   rank, mode), ok

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(B', 1, T / cp, T)`` bool, True where a local query attends to a gathered key: the same
        document, the key not after the query and, with ``sliding_window = w``, fewer than ``w``
        tokens before it (transformers' ``sliding_window_overlay``: ``k > q - w``). Built at each
        attention call (a few element-wise ops over ``T^2 / cp`` values) and not kept: it lives
        while the attention kernel runs."""
        return _mask(self.q_index, self.k_index, self.doc_q, self.doc_k, sliding_window)

    def rows_mask(self, rows: slice, sliding_window: int | None) -> torch.Tensor:
        """``(B', 1, rows, T)`` bool: :meth:`mask` for the gathered tokens ``rows`` (rank order) as
        queries, what the Ulysses form's attention over the whole sequence of its heads takes."""
        return _mask(self.k_index[rows], self.k_index, self.doc_k[:, rows], self.doc_k, sliding_window)


def _mask(q_index, k_index, doc_q, doc_k, sliding_window: int | None) -> torch.Tensor:
    """``(B', 1, Tq, Tk)`` bool from global indices and documents (see :meth:`ContextParallelCall.mask`)."""
    q, k = q_index[:, None], k_index[None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (k > q - sliding_window)
    same = doc_q[:, :, None] == doc_k[:, None, :]
    return (same & allowed).unsqueeze(1)


def _refused_kwargs(module: nn.Module, attention_mask, dropout: float, kwargs: dict) -> list[str]:
    """What :func:`context_parallel_attention` cannot compute exactly, described (empty: none)."""
    problems = []
    if attention_mask is not None:
        problems.append("an attention mask (under context parallelism the mask is built from the position ids)")
    if dropout:
        problems.append(f"attention dropout {dropout} in training (set config.attention_dropout = 0)")
    for name in ("softcap", "s_aux", "sinks", "position_bias", "head_mask"):
        if kwargs.get(name) is not None:
            problems.append(f"{name}")
    if kwargs.get("output_attentions"):
        problems.append("output_attentions=True")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        problems.append("non-causal attention")
    if getattr(module, "is_cross_attention", False):
        problems.append("cross attention")
    return problems


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of this rank's queries over the whole sequence, for transformers' attention interface.

    The call's ``mode`` (``parallelize(cp_attention=...)``) picks the form: ``"allgather"``
    (below), ``"ring"`` (:func:`tpify.hooks.cp_ring.ring_attention`) or ``"alltoall"``
    (:func:`tpify.hooks.cp_ulysses.ulysses_attention`); the same shapes, checks and result, their
    own communication and memory. What follows describes ``"allgather"``.

    Shapes: ``query`` ``(B, n, T/cp, d)``, ``key`` ``(B, n_kv, T/cp, d)``, ``value`` ``(B, n_kv,
    T/cp, d_v)`` (this rank's tokens; under TP this rank's heads); returns ``((B, T/cp, n, d_v),
    None)`` as transformers' ``sdpa_attention_forward`` does. Any floating dtype (``float64`` on
    the CPU). The keys and values are gathered in rank order; the mask of the call
    (:meth:`ContextParallelCall.mask`, ``sliding_window`` from the layer's keyword argument)
    decides what each query sees; ``torch.nn.functional.scaled_dot_product_attention`` computes
    it, ``scale=scaling``.

    Communication: forward, one all-gather of ``[K | V]`` (``B * n_kv * T/cp * (d + d_v)`` values
    per rank) over the CP group; backward, the same all-gather again and one reduce-scatter of
    ``[dK | dV]`` (each rank's queries give part of the gradient of every key). Memory: with
    gradients, the gather and the attention run under activation recomputation
    (``torch.utils.checkpoint``, non-reentrant), so a layer keeps for its backward only this
    rank's ``q``, ``k``, ``v`` (``1/cp`` of the dense model's attention inputs); the gathered
    ``K``, ``V`` of the whole sequence (repeated to the query heads) and the ``(B', 1, T/cp, T)``
    boolean mask exist only while one layer's attention runs (forward, and its recomputation in
    backward). Cost: the attention forward runs twice per step.

    Raises:
        TPUsageError: the call did not come through a context-parallel model's forward (no
            :class:`ContextParallelCall`: the attention module called alone, or tpify's hooks
            removed); an attention mask, attention dropout in training, soft-capping, sinks, a
            position bias, ``output_attentions``, non-causal or cross attention.
    """
    call = kwargs.get(CALL_KWARG)
    if not isinstance(call, ContextParallelCall):
        raise TPUsageError(f"{type(module).__name__}: the attention implementation is tpify's context-parallel one, "
                           f"but this call did not come through the context-parallel model's forward (the attention "
                           f"module called alone, or tpify.remove_hooks removed the hooks that split the sequence)")
    problems = _refused_kwargs(module, attention_mask, dropout, kwargs)
    if problems:
        raise TPUsageError(f"{type(module).__name__} under context parallelism: tpify's attention over the split "
                           f"sequence does not compute {'; '.join(problems)}. Nothing was computed")
    call.calls += 1
    window = kwargs.get("sliding_window")
    if call.mode != "allgather":
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        attend = ring_attention if call.mode == "ring" else ulysses_attention
        return attend(query, key, value, call, window, scale).transpose(1, 2).contiguous(), None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        # backward gathers K/V again and recomputes the attention: only this rank's q, k, v are saved
        out = checkpoint(_attend, query, key, value, call, window, scaling, use_reentrant=False)
    else:
        out = _attend(query, key, value, call, window, scaling)
    return out.transpose(1, 2).contiguous(), None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: ContextParallelCall,
            window: int | None, scaling: float | None) -> torch.Tensor:
    """``(B, n, T/cp, d_v)``: this rank's queries over the keys and values of every rank (one
    all-gather of ``[K | V]``, backward a reduce-scatter of ``[dK | dV]``), under the call's mask."""
    d_k = key.shape[-1]
    kv = torch.cat([key, value], dim=-1).transpose(1, 2)  # (B, T/cp, n_kv, d + d_v)
    kv = comm.gather_from_sequence_region(kv, call.group, partial_grad=True).transpose(1, 2)  # (B, n_kv, T, d + d_v)
    key, value = kv[..., :d_k], kv[..., d_k:]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query heads: each KV head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=call.mask(window), scale=scaling)


@functools.lru_cache(maxsize=None)
def _forward_params(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s parameters after ``self``, read once per class."""
    return tuple(inspect.signature(cls.forward).parameters)[1:]


def _argument(model: nn.Module, args: tuple, kwargs: dict, name: str):
    """The value of ``name`` in a call of ``model`` (keyword, or positional by its forward's signature)."""
    if name in kwargs:
        return kwargs[name]
    params = _forward_params(type(model))
    if name in params and params.index(name) < len(args):
        return args[params.index(name)]
    return None


class ContextParallelHooks(comm.SharesProcessGroups):
    """The model-level hooks of context parallelism (see the module's docstring).

    Communication per call: forward, one all-gather of the ``(B', T/cp)`` position ids over the CP
    group; backward, the gradients of the parameters summed over the CP group in one all-reduce per
    bucket (:class:`~tpify.grad_sums.SummedGrads`; parameters that the TP group's sum covers are
    summed there, over the ``cp x tp`` ranks).

    Raises (forward, on every rank of the CP group alike, before any collective of the call's):
        TPUsageError: no ``position_ids``; an ``attention_mask``; a cache (``past_key_values``,
            ``use_cache=True``: decoding is not split); ``labels`` without ``shift_labels`` (the
            labels must be shifted before the split: :func:`tpify.context_parallel.split_batch`);
            ``labels`` on a model whose loss tpify does not compute; ``logits_to_keep``;
            ``output_attentions``; after the forward, layers whose attention did not run through
            :func:`context_parallel_attention`.
        ValueError: a local length that is not even (two chunks), position ids of another length.
            At the next call (deferred, no host sync): position ids that restart at a value other
            than 0 inside a sequence.
    """

    def __init__(self, ctx: TPContext, layout, layers: int):
        self.ctx, self.layout, self.layers = ctx, layout, layers
        self.group, self.size, self.rank = ctx.cp_group, ctx.cp_size, ctx.cp_rank
        self.mode = ctx.cp_attention
        self.summed = SummedGrads(ctx.cp_group)
        self.call: ContextParallelCall | None = None

    def __deepcopy__(self, memo):
        return self

    def _check(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, int]:
        """The call's position ids and local length, after the local checks."""
        name = type(model).__name__
        problems = []
        if _argument(model, args, kwargs, "attention_mask") is not None:
            problems.append("attention_mask= (the mask is built from the position ids: pass none; pad at the end or "
                            "pack, tpify.context_parallel.split_batch)")
        if _argument(model, args, kwargs, "past_key_values") is not None or _argument(model, args, kwargs,
                                                                                        "cache") is not None:
            problems.append("a cache (past_key_values): decoding is not split under context parallelism, and "
                            "generate() is refused")
        if _argument(model, args, kwargs, "use_cache"):
            problems.append("use_cache=True (the cache would hold this rank's tokens only)")
        if _argument(model, args, kwargs, "output_attentions"):
            problems.append("output_attentions=True")
        keep = _argument(model, args, kwargs, "logits_to_keep")
        if keep not in (None, 0):
            problems.append(f"logits_to_keep={keep!r} (the last tokens of the sequence are not this rank's)")
        labels = _argument(model, args, kwargs, "labels")
        if labels is not None and kwargs.get("shift_labels") is None:
            problems.append("labels= without shift_labels= (shifted after the split, each chunk would lose the target "
                            "of its last token and get a wrong one for its first: pass the batch through "
                            "tpify.context_parallel.split_batch, which shifts over the whole sequence first)")
        if labels is not None and (self.layout.lm_head is None or self.layout.loss_kind != "causal"):
            problems.append(f"labels= on a model whose loss tpify does not compute (loss kind "
                            f"{self.layout.loss_kind!r}): its own loss would average over this rank's tokens only")
        positions = _argument(model, args, kwargs, "position_ids")
        if positions is None:
            problems.append("no position_ids (pass the global positions of this rank's tokens, "
                            "tpify.context_parallel.split_batch)")
        if problems:
            raise TPUsageError(f"{name} under context parallelism (cp_size {self.size}) cannot take "
                               + "; ".join(problems) + ". Nothing was computed")
        x = _argument(model, args, kwargs, "input_ids")
        x = x if x is not None else _argument(model, args, kwargs, "inputs_embeds")
        tokens = x.shape[1] if x is not None else positions.shape[-1]
        if tokens % 2 or positions.dim() != 2 or positions.shape[-1] != tokens:
            raise ValueError(f"{name} under context parallelism: this rank holds {tokens} tokens per sequence with "
                             f"position_ids of shape {tuple(positions.shape)}; it must hold an even number (a front and "
                             f"a back chunk) and position_ids (B, {tokens}): split the batch with "
                             f"tpify.context_parallel.split_batch")
        return positions, tokens

    def pre_hook(self, model: nn.Module, args: tuple, kwargs: dict):
        self.summed.at_root(model)
        self.call = None
        one_document = kwargs.pop(ONE_DOCUMENT_KWARG, None)
        positions, tokens = self._check(model, args, kwargs)
        gathered = comm.all_gather_dim(positions.contiguous(), 1, self.group)  # (B', T) in rank order
        self.call, ok = ContextParallelCall.from_positions(self.group, self.size, self.rank, gathered, self.mode)
        self.call.one_document = True if one_document is True else None
        comm.raise_unless(ok, ValueError, _FIRST_DOCUMENT_ONLY, defer=self.ctx.state.checks)
        kwargs[CALL_KWARG] = self.call
        if "use_cache" in _forward_params(type(model)):
            kwargs["use_cache"] = False
        return args, kwargs

    def hook(self, model: nn.Module, args, output):
        call, self.call = self.call, None
        if call is None:
            return None
        self.finish(model, call, self.layers)
        return None

    def finish(self, model: nn.Module, call: ContextParallelCall, layers: int, what: str | None = None) -> None:
        """After a forward of ``model`` (or of a pipeline stage of it, ``what`` naming it) whose
        ``layers`` attention layers should all have run through :func:`context_parallel_attention`
        for ``call``: raise if another count did; then sum the gradients of ``model``'s trainable
        parameters over the CP group (:meth:`_watch`).

        Raises:
            TPUsageError: ``call.calls != layers``.
        """
        if call.calls != layers:
            raise TPUsageError(f"{what or type(model).__name__} under context parallelism: {call.calls} attention "
                               f"layers ran through tpify's attention over the split sequence, but "
                               f"{'the model has' if what is None else 'it holds'} {layers}: the others attended to "
                               f"this rank's tokens only. This model is not supported with cp_size > 1")
        if torch.is_grad_enabled():
            self._watch(model)

    def _watch(self, model: nn.Module) -> None:
        """Sum the gradient of every trainable parameter over the CP group, except those the TP
        group's :class:`~tpify.grad_sums.SummedGrads` sums (over the ``cp x tp`` ranks). After the
        forward, so that the TP sum has found its parameters (they are found during the forward,
        and a parameter is summed once)."""
        tp_summed = self.ctx.summed_grads
        for param in model.parameters():
            if not param.requires_grad:
                continue
            if tp_summed is not None and tp_summed.watches(param):
                self.summed.unwatch(param)
            else:
                self.summed.watch(param)


class _InstanceAttribute:
    """A handle that puts an attribute of a model instance back as it was (``remove``)."""

    def __init__(self, target, name: str, value):
        self.target, self.name = target, name
        self.had, self.old = name in vars(target), vars(target).get(name)
        setattr(target, name, value)

    def remove(self) -> None:
        if self.had:
            setattr(self.target, self.name, self.old)
        else:
            delattr(self.target, self.name)


class _AttnImplementation:
    """A handle that sets ``config._attn_implementation`` and puts the old one back (``remove``)."""

    def __init__(self, config, value: str):
        self.config, self.old = config, config._attn_implementation
        config._attn_implementation = value

    def remove(self) -> None:
        self.config._attn_implementation = self.old


class _RefuseGenerate:
    """``model.generate`` of a context-parallel model (holds the class name only: no cycle through the model)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise TPUsageError(f"{self.name}.generate under context parallelism: decoding one token at a time has no "
                           f"sequence to split over the CP group. Generate with a model parallelized with cp_size=1 "
                           f"(load the saved checkpoint with tpify.from_pretrained(path, tp_size=...)). Nothing was "
                           f"computed")


def install(model: nn.Module, layout, ctx: TPContext) -> list:
    """Make ``model`` context-parallel over ``ctx.cp_group``; return the handles (nothing and ``[]``
    with ``ctx.cp_size == 1``).

    Registers :func:`context_parallel_attention` in transformers' ``AttentionInterface`` and sets
    it as ``model.config._attn_implementation`` (a handle puts the old one back); the
    :class:`ContextParallelHooks` pre-hook (before :mod:`tpify.hooks.lm_loss`'s, which it checks the
    labels for) and hook; ``model.generate`` refused. Communication: none here.
    """
    if ctx.cp_size == 1:
        return []
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, context_parallel_attention)
    owner = ContextParallelHooks(ctx, layout, model.config.num_hidden_layers)
    return [_AttnImplementation(model.config, ATTN_IMPLEMENTATION),
            model.register_forward_pre_hook(owner.pre_hook, with_kwargs=True),
            model.register_forward_hook(owner.hook),
            owner.summed,
            _InstanceAttribute(model, "generate", _RefuseGenerate(type(model).__name__))]
