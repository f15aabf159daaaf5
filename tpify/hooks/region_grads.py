"""Gradients of replicated parameters used where each rank sees only part of the activations.

A replicated module that runs inside a sharded region (per-head norms between a column- and a
row-parallel layer) or inside a sequence-parallel stretch (a LayerNorm over ``T/p`` tokens) gets a
partial gradient on each rank; the true gradient is its sum over the TP group (Megatron-LM,
arXiv:1909.08053 section 3; Korthikanti et al., arXiv:2205.05198 section 4.2.2), taken for all
of them together in one all-reduce per backward pass (:class:`tpify.grad_sums.SummedGrads`).
"""

from __future__ import annotations

from torch import nn

from ..context import CallState
from ..grad_sums import SummedGrads
from ..layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..sharding import shard_spec_of

__all__ = ["ReplicatedInRegion", "WatchedParams", "install"]


class ReplicatedInRegion:
    """Gradient sums for replicated parameters used inside a sharded region, found by construction.

    A forward pre-hook on every module that holds parameters and is not a parallel layer: the
    first time it runs inside a sharded region (phi's per-head ``q_layernorm``) or on split tokens
    (sequence parallelism; not a router of a gathered MoE block), its trainable parameters are
    watched by the model's :class:`~tpify.grad_sums.SummedGrads` (their gradients are partial sums
    per rank). ``found`` lists those modules' FQNs. Why, and FSDP2 / frozen parameters:
    docs/mechanics.md, "ReplicatedInRegion".

    Communication: backward, one all-reduce (sum) of all such gradients per backward pass (per
    bucket of :data:`tpify.grad_sums.BUCKET_BYTES`); none for a model without them.
    """

    def __init__(self, tracker, summed: SummedGrads, state: CallState):
        self.tracker, self.summed, self.state = tracker, summed, state
        self.names: dict[int, str] = {}
        self.found: list[str] = []
        self.handles: list = []  # its pre-hooks on the modules it watches

    def remove(self) -> None:
        """Remove its pre-hooks (a handle of the model's hooks)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __call__(self, module, args):
        if not (self.tracker.in_region or (self.state.sequence_active and not self.state.moe_gathered)):
            return None
        new = [p for p in module.parameters(recurse=False) if self.summed.watch(p)]
        if new:
            name = self.names.get(id(module), type(module).__name__)
            if name not in self.found:
                self.found.append(name)
        return None


class WatchedParams:
    """Forward pre-hook of a module the recipe declares ``replicate_sum_grads``: its named trainable
    parameters' gradients are partial on each rank, summed over the TP group by the model's
    :class:`~tpify.grad_sums.SummedGrads` at every backward pass (watched at each call: FSDP2's
    unsharded parameters are other objects than the sharded ones). Communication: none of its own."""

    def __init__(self, names: tuple[str, ...], summed: SummedGrads):
        self.names, self.summed = names, summed

    def __call__(self, module, args):
        for name in self.names:
            self.summed.watch(getattr(module, name))
        return None


def install(model: nn.Module, layout, ctx) -> list:
    """At ``ctx.size > 1``: a :class:`ReplicatedInRegion` pre-hook on every module that holds
    parameters and is not a parallel layer nor holds split ones (fused experts), a
    :class:`WatchedParams` pre-hook on every module whose style says its gradients are partial
    (``sums_own_grads``: ``replicate_sum_grads``, left out of the watcher: summed once, not twice),
    and the forward pre-hook of ``ctx.summed_grads`` (:meth:`~tpify.grad_sums.SummedGrads.at_root`,
    how this call's backward sums) on the root. Returns the handles: the hooks', ``summed`` itself
    (whose ``remove`` removes its gradient hooks) and the watcher (whose ``found`` lists the
    modules it summed). Communication: none here (the sums run in backward)."""
    if ctx.size == 1:
        return []
    summed = ctx.summed_grads if ctx.summed_grads is not None else SummedGrads(ctx.group)
    declared = tuple(fqn for fqn, entry in layout.modules.items() if entry.styler.sums_own_grads)
    watcher = ReplicatedInRegion(ctx.rng, summed, ctx.state)
    handles = [model.register_forward_pre_hook(summed.at_root), summed, watcher]
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnParallelEmbedding)
    for fqn in declared:
        module = model.get_submodule(fqn)
        names = tuple(name for name, _ in module.named_parameters(recurse=False))
        handles.append(module.register_forward_pre_hook(WatchedParams(names, summed)))
    for fqn, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if any(shard_spec_of(p) is not None for p in own):  # split by a style (fused experts): not replicated
            continue
        if fqn in declared:
            continue
        if not isinstance(module, parallel) and own:
            watcher.names[id(module)] = fqn
            watcher.handles.append(module.register_forward_pre_hook(watcher))
    return handles
