"""Per-KV-head parameters held by groups of ranks: their gradients summed within each group.

A ``per_head`` parameter with ``kv_heads`` (one value per KV head, :mod:`tpify.styles`) is split
by KV heads when ``tp_size`` divides them. When ``tp_size`` is a multiple of them instead, each
KV head's value is held by the ``g = tp_size / kv_heads`` ranks whose query heads read it (as the
K/V weights are, Megatron-LM's KV-head replication), so each rank's gradient of it is a partial
sum over its own query heads; the true gradient is the sum over the group. The module's own
``forward`` reads the parameter directly, so the sum is a hook on the parameter's gradient, added
by a forward pre-hook on the module to every parameter object it sees (a wrapper that replaces
the parameters, FSDP2's ``fully_shard``, gets its new ones hooked at their first call).
Query-head parameters (attention sinks) need nothing: each rank's slice is read by its heads only.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import comm
from ..context import TPContext

__all__ = ["GroupSummedGrads", "install"]


class GroupSummedGrads(comm.SharesProcessGroups):
    """Forward pre-hook of one module: each named parameter's gradient summed over ``group``.

    Shapes: the gradient has the parameter's local shape (its KV heads' slice), any dtype.
    Communication: backward, one all-reduce of each named parameter's gradient over ``group``
    (the ranks holding the same KV heads); forward none.
    """

    def __init__(self, names: tuple[str, ...], group, handles: list):
        self.names, self.group, self.handles = names, group, handles
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


def install(model: nn.Module, layout, ctx: TPContext, handles: list) -> None:
    """A :class:`GroupSummedGrads` pre-hook on every ``per_head`` module of ``layout`` whose
    parameters are held by groups of more than one rank; its handles (and those of the gradient
    hooks it adds later) go into ``handles``. Communication: none here."""
    if layout.tp_size == 1:
        return
    for fqn, entry in layout.modules.items():
        if entry.style != "per_head" or not entry.replicated_parts:
            continue
        group = ctx.replica_group(entry.replica_shards)
        names = tuple(name for name, _, _ in entry.params)
        handles.append(model.get_submodule(fqn).register_forward_pre_hook(GroupSummedGrads(names, group, handles)))
