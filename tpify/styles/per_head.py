"""The ``per_head`` style: parameters holding one value per head, split with the heads.

Attention sinks ``(num_heads,)`` (gpt-oss, Xiao et al., arXiv:2309.17453), neomme's
exclusive-attention ``alpha``, a per-head norm's ``(heads, head_dim)`` weight: each parameter of
the rule's ``params`` is split along its ``dim`` in ``tp_size`` contiguous ranges, as the
column-parallel ``q_proj`` splits the heads, so each rank's slice is read by its own heads only
(no collective). With ``kv_heads`` (one value per KV head) and ``tp_size`` a multiple of them,
each KV head's value is held by the ``tp_size / kv_heads`` ranks whose query heads read it, its
gradient summed over that group (:class:`GroupSummedGrads`). docs/recipes.md, "Per-head parameters".
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..hf_modules import forward_source
from ..sharding import ShardSpec
from .base import KV_HEADS_ONLY, PARAMS_ONLY, RuleError, config_ref_or_int, slice_params
from .params import ParamsStyle, read_split_params

__all__ = ["PerHead", "PerHeadOptions", "GroupSummedGrads"]


@dataclass(frozen=True)
class PerHeadOptions:
    """``per_head``'s key: ``params`` ``((name, head dimension, 1), ...)``."""

    params: tuple[tuple[str, int, int], ...]
    CONFIG_REFS = ()


class GroupSummedGrads(comm.SharesProcessGroups):
    """Forward pre-hook of one module: each named parameter's gradient summed over ``group``
    (hooked on every parameter object the forward sees: FSDP2's unsharded ones at their first
    call). A handle: :meth:`remove` removes the gradient hooks it added.

    Shapes: the gradient has the parameter's local shape (its KV heads' slice), any dtype.
    Communication: backward, one all-reduce of each named parameter's gradient over ``group``
    (the ranks holding the same KV heads); forward none.
    """

    def __init__(self, names: tuple[str, ...], group):
        self.names, self.group = names, group
        self.handles: list = []  # the gradient hooks added so far
        self._done: dict[int, weakref.ref] = {}  # id -> the parameter already hooked (ids of dead ones are reused)

    def _reduce(self, grad):
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), self.group)

    def __call__(self, module, args):
        for name in self.names:
            param = getattr(module, name)
            if param.requires_grad and (id(param) not in self._done or self._done[id(param)]() is not param):
                self._done[id(param)] = weakref.ref(param)
                self.handles.append(param.register_hook(self._reduce))
        return None

    def remove(self) -> None:
        """Remove every gradient hook added so far."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._done.clear()


class PerHead(ParamsStyle):
    """``per_head``: the named parameters of a module (an attention module or a part of it) that
    hold one value per head; the module keeps its own forward and its other parameters whole.

    Raises (as plan errors): the module holds no such parameter, or no such dimension, or others
    the rule does not name; its size along ``dim`` is not divisible by ``tp_size`` (or, with
    ``kv_heads``, differs from the KV heads or fits the ranks neither way).
    """

    name = "per_head"
    KEYS = {"params": PARAMS_ONLY, "kv_heads": KV_HEADS_ONLY}
    Options = PerHeadOptions
    split_note = "; with the heads"

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        params = read_split_params(raw.get("params"), self.name, where, after_sum=False)
        if "kv_heads" in raw and not config_ref_or_int(raw["kv_heads"], 1):
            raise RuleError(f"{where}: {KV_HEADS_ONLY}")
        return PerHeadOptions(params)

    def head_owner(self, fqn, module, rule, widths):
        return fqn  # the module holds values per head: no dimension inside it is split unevenly

    def _check_module(self, ctx, fqn, module, rule, entry):
        cls = type(module).__name__
        named = self._named(ctx, fqn, module, rule, "a module holding values per head (attention sinks)")
        if named is None:
            return False
        own, problems = named
        params = rule.options.params
        problems += [f"{name}: parts = {parts} (a per-head parameter is one run of heads)"
                     for name, _, parts in params if parts != 1]
        extra = sorted(set(own) - {name for name, _, _ in params})
        if extra:
            problems.append(f"it also holds parameters {extra} that the rule does not name (a module whose "
                            f"parameters a style splits gets no replicated-gradient hook: tpify.hooks.region_grads)")
        if problems:
            ctx.errors.append(f"{fqn} ({cls}): style 'per_head' ({rule.describe()}) cannot split it: "
                              + "; ".join(problems))
            return False
        entry.params = params
        return True

    def _sizes(self, ctx, fqn, module, rule, entry):
        sizes = {name: getattr(module, name).shape[dim] for name, dim, _ in entry.params}
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
        slice_params(module, entry.specs, ctx.rank)
        return module

    def install(self, module, entry, ctx):
        """Per-KV-head parameters held by groups of ranks: a :class:`GroupSummedGrads` pre-hook
        (each rank's gradient is a partial sum over its own query heads). Query-head parameters
        need nothing."""
        if ctx.size == 1 or not entry.replicated_parts:
            return []
        hook = GroupSummedGrads(tuple(name for name, _, _ in entry.params), ctx.replica_group(entry.replica_shards))
        return [module.register_forward_pre_hook(hook), hook]

    # -- transformers' plans: colwise on a parameter of heads, local_params, per-head norms ----
    def from_hf(self, imp, entry):
        """HF's ``local_params`` (the module run with its split parameters as local tensors): nothing
        of its own where the plan splits a parameter of it (``colwise``: :meth:`hf_param`).
        Raises (``imp.error``): no such parameter (attention sinks)."""
        if not any(k.rpartition(".")[0] == entry.key and v == "colwise" and k in imp.param_keys
                   for k, v in imp.plan.items()):
            raise imp.error(f"{entry.where}: a module run with local shards of bare parameters (attention sinks) has "
                            f"no tpify style")

    def hf_param(self, imp, owner, leaf, hf_style, shape):
        """HF's ``colwise`` on a one-dimensional parameter of a head count (attention sinks)."""
        if not (hf_style == "colwise" and len(shape) == 1 and shape[0] in imp.heads.values() and owner in imp.by_key):
            return False
        imp.scratch.setdefault(self.name, {}).setdefault(owner, []).append(leaf)  # one value per head
        return True

    def complete_hf(self, imp):
        """A ``per_head`` rule for each module whose parameters HF splits by heads, and for each norm
        of each head (:func:`_per_head_norms`); ``imp.split_per_head`` lists them all."""
        per_head = imp.scratch.get(self.name, {})
        norms: dict[str, list[str]] = {}
        _per_head_norms(imp, norms)
        kv_name = "num_key_value_heads"
        for owner, leaves in list(per_head.items()) + list(norms.items()):
            holders = [n for n in imp.by_key[owner] if all(isinstance(getattr(imp.modules[n], leaf, None), nn.Parameter)
                                                            for leaf in leaves)]
            note = (f"HF colwise on {leaves} (one value per head) with local_params: split with the heads"
                    if owner in per_head else f"a norm of each head ({type(imp.modules[holders[0]]).__name__}, "
                                              f"{leaves} (heads, head_dim), normalising over head_dim): split with "
                                              f"the heads")
            kv = {}  # a norm of the KV heads (cohere's k_norm), fewer than the query heads: split by KV heads
            rows = {getattr(imp.modules[holders[0]], leaf).shape[0] for leaf in leaves}
            if (owner in norms and imp.heads.get(kv_name) in rows
                    and imp.heads.get(kv_name) != imp.heads.get("num_attention_heads")):
                kv = {"kv_heads": kv_name}
            imp.add_rule(owner, holders, self.name, note, params={leaf: {"dim": 0} for leaf in sorted(leaves)}, **kv)
        imp.split_per_head = {**per_head, **norms}


def _per_head_norms(imp, per_head: dict) -> None:
    """Norms inside a head-split attention whose weight holds one row per head, ``(heads, head_dim)``,
    normalising each head over its ``head_dim`` only (Cohere's ``q_norm`` with ``use_qk_norm``): the
    weight is split with the heads. A norm over all heads at once (ESMC's ``q_norm``) cannot be."""
    heads, hd = imp.heads, imp.head_dim
    if not heads or not hd:
        return
    for parent, rel, module in imp.attention_parts():
        own = dict(module.named_parameters(recurse=False))
        own_hd = getattr(imp.modules.get(parent), "head_dim", None)
        width = own_hd if isinstance(own_hd, int) else hd
        rows = {p.shape[0] for p in own.values()}
        if (rel != parent and own and len(rows) == 1 and all(tuple(p.shape) in {(n, width) for n in heads.values()
                                                                              if n > 1} for p in own.values())
                and normalises_last_dim(module)):
            leaves = per_head.setdefault(imp.wildcard(rel), [])
            leaves.extend(n for n in sorted(own) if n not in leaves)


def normalises_last_dim(module: nn.Module) -> bool:
    """Whether a norm module normalises over its input's last dimension only (its ``forward`` takes
    the mean over ``-1``: ``CohereLayerNorm``; torch's norms by a one-dimensional ``normalized_shape``),
    so that a weight ``(heads, head_dim)`` scales each head's own normalised values."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return isinstance(shape, tuple) and len(shape) == 1
    src = forward_source(module)
    return bool(re.search(r"\.mean\(\s*(dim\s*=\s*)?-1\s*[,)]", src)) and not re.search(r"\.mean\(\s*(dim\s*=\s*)?\(", src)

