"""Gradients of replicated parameters used where each rank sees only part of the activations.

A replicated module that runs inside a sharded region (per-head norms between a column- and a
row-parallel layer) or inside a sequence-parallel stretch (a LayerNorm over ``T/p`` tokens) gets a
partial gradient on each rank; the true gradient is its sum over the TP group (Megatron-LM,
arXiv:1909.08053 section 3; Korthikanti et al., arXiv:2205.05198 section 4.2.2).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import comm
from ..context import CallState
from ..layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..sharding import shard_spec_of
from .per_head import GroupSummedGrads

__all__ = ["ReplicatedInRegion", "install"]


class ReplicatedInRegion(comm.SharesProcessGroups):
    """Gradient all-reduce for replicated parameters used inside a sharded region, found by construction.

    Between a column-parallel layer's output and the next row-parallel layer's input each rank
    holds only its heads (or its slice of the MLP). A replicated module that runs there (phi's
    ``q_layernorm``/``k_layernorm`` with ``qk_layernorm=True``, normalising each head) sees only
    the local heads, so each rank's gradient of its parameters is a partial sum; the true
    gradient is their sum over the TP group (Megatron all-reduces such gradients, as it does the
    LayerNorm weights of sequence parallelism). This forward pre-hook, on every module that holds
    parameters and is not a parallel layer, asks the model's dropout-stream tracker whether the
    call is inside a region (the region hooks keep ``tracker.in_region``, in train and eval
    mode), or whether the tokens are split (sequence parallelism: a LayerNorm there sees ``T/p``
    tokens, so its gradient is a partial sum as well; not the router of a mixture-of-experts block
    whose tokens were gathered, :attr:`CallState.moe_gathered`, which sees every token); the
    first time it is, each of the
    module's parameters gets a gradient hook that all-reduces (sums) its gradient over the TP
    group. ``found`` lists those modules' FQNs.

    The hooks are kept per parameter object, not per module: a wrapper that replaces a module's
    parameters after a forward (FSDP2's ``fully_shard``, whose unsharded parameters the forward
    sees) gets its new parameters hooked at their first call. A tensor hook on a leaf runs before
    the gradient is accumulated into ``.grad`` (torch's ``AccumulateGrad`` tensor pre-hook), so the
    sum is complete before DDP's reducer (a post-hook of the same node) or FSDP2's post-backward
    reads the gradient.

    Communication: backward, one all-reduce per such parameter (none for a model without them).
    """

    def __init__(self, tracker, tp_group, handles: list, state: CallState):
        self.tracker, self.tp_group, self.handles, self.state = tracker, tp_group, handles, state
        self.names: dict[int, str] = {}
        self.found: list[str] = []
        self._done: dict[int, weakref.ref] = {}  # id -> the parameter already hooked (ids of dead ones are reused)

    def _reduce(self, grad):
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), self.tp_group)

    def __call__(self, module, args):
        if not (self.tracker.in_region or (self.state.sequence_active and not self.state.moe_gathered)):
            return None
        new = [p for p in module.parameters(recurse=False)
               if p.requires_grad and (id(p) not in self._done or self._done[id(p)]() is not p)]
        if not new:
            return None
        name = self.names.get(id(module), type(module).__name__)
        if name not in self.found:
            self.found.append(name)
        for param in new:
            self._done[id(param)] = weakref.ref(param)
            self.handles.append(param.register_hook(self._reduce))
        return None


def install(model: nn.Module, tracker, tp_group, state: CallState, handles: list,
            declared: tuple[str, ...] = ()) -> ReplicatedInRegion:
    """A :class:`ReplicatedInRegion` pre-hook on every module that holds parameters and is not a
    parallel layer nor holds split ones (fused experts); the gradient hooks it adds later go into
    ``handles`` too. ``declared``: the FQNs of modules whose parameters' gradients the recipe says
    are partial on each rank (style ``replicate_sum_grads``): summed over the TP group at every
    backward (:class:`tpify.hooks.per_head.GroupSummedGrads` over the whole group), and left out of
    the watcher (summed once, not twice)."""
    watcher = ReplicatedInRegion(tracker, tp_group, handles, state)
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnParallelEmbedding)
    for fqn in declared:
        module = model.get_submodule(fqn)
        names = tuple(name for name, _ in module.named_parameters(recurse=False))
        handles.append(module.register_forward_pre_hook(GroupSummedGrads(names, tp_group, handles)))
    for fqn, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if any(shard_spec_of(p) is not None for p in own):  # split by a style (fused experts): not replicated
            continue
        if fqn in declared:
            continue
        if not isinstance(module, parallel) and own:
            watcher.names[id(module)] = fqn
            handles.append(module.register_forward_pre_hook(watcher))
    return watcher
