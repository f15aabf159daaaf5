"""Per-head inputs: each rank's heads of a tensor the base model builds for all heads.

Some base models build a tensor for all attention heads and pass it to every layer (ALiBi
biases); the attention module on rank ``r`` computes only its heads, so it must get those heads'
slice (the recipe's ``head_inputs``).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .. import comm

__all__ = ["HeadInputs", "install"]


class HeadInputs(comm.SharesProcessGroups):
    """Forward pre-hook giving a module this rank's heads of the per-head tensors it is passed.

    Some base models build a tensor for all attention heads and pass it to every layer: ALiBi
    biases (bloom's ``alibi`` of shape ``(B * n_head, 1, T)``, falcon's ``(B, n_head, 1, T)`` and
    its attention mask with the ALiBi folded in, ``(B, n_head, T, T)``). The attention module on
    rank ``r`` computes heads ``[r*n/p, (r+1)*n/p)`` only (its q/k/v are column-parallel), so it
    must get those heads' slice. For each ``(argument, dim, n_heads)`` of the recipe's
    ``head_inputs``, the argument's dimension ``dim`` is either 1 (broadcast over heads: left
    alone) or a multiple ``m * n_heads`` of the dense head count with the heads fastest (``m`` =
    1: heads; ``m`` = B: batch-major ``B * n_heads``); the hook keeps this rank's heads of it.

    The slice is :func:`tpify.comm.scatter_to_tp_region` along the heads (no communication
    forward; when the argument requires grad, its gradient is all-gathered in backward, so a
    learned per-head tensor upstream gets every head's gradient).

    Raises:
        ValueError: (forward) the dimension is neither 1 nor a multiple of the head count, or the
            call does not pass the argument at all (a misspelt name in the recipe); the message
            names the module, the argument and the shapes. Every rank holds the same shapes and
            arguments, so every rank raises.
    """

    def __init__(self, fqn: str, module: nn.Module, inputs: tuple[tuple[str, int, int], ...], tp_group):
        self.fqn, self.inputs, self.tp_group = fqn, inputs, tp_group
        self.names = [n for n in inspect.signature(type(module).forward).parameters][1:]  # drop self

    def _slice(self, arg: str, t: torch.Tensor, dim: int, heads: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            return t
        dim = dim % t.dim()
        size = t.shape[dim]
        if size == 1:
            return t
        if size % heads:
            raise ValueError(f"tpify: {self.fqn} gets argument {arg!r} of shape {tuple(t.shape)}; the recipe's "
                             f"head_inputs says dimension {dim} holds {heads} heads (fastest), but {size} is neither 1 "
                             f"nor a multiple of {heads}: fix head_inputs (dim, heads) in the recipe")
        split = t.unflatten(dim, (size // heads, heads)).movedim(dim + 1, -1)
        local = comm.scatter_to_tp_region(split, self.tp_group)
        return local.movedim(-1, dim + 1).flatten(dim, dim + 1)

    def __call__(self, module, args, kwargs):
        args = list(args)
        for arg, dim, heads in self.inputs:
            if arg in kwargs:
                kwargs[arg] = self._slice(arg, kwargs[arg], dim, heads)
            elif arg in self.names and self.names.index(arg) < len(args):
                i = self.names.index(arg)
                args[i] = self._slice(arg, args[i], dim, heads)
            else:  # a misspelt name (the forward takes **kwargs) would leave every head on every rank
                raise ValueError(f"tpify: {self.fqn} ({type(module).__name__}) was called without argument {arg!r}, "
                                 f"which the recipe's head_inputs slices per rank; fix the argument name in the "
                                 f"recipe (the call passed {sorted(kwargs)} and {len(args)} positional arguments)")
        return tuple(args), kwargs


def install(model: nn.Module, layout, ctx) -> list:
    """A :class:`HeadInputs` pre-hook (over ``ctx.group``) on every module of ``layout.head_inputs``;
    the handles. Communication: none here."""
    handles = []
    for fqn, inputs in layout.head_inputs.items():
        module = model.get_submodule(fqn)
        handles.append(module.register_forward_pre_hook(HeadInputs(fqn, module, inputs, ctx.group), with_kwargs=True))
    return handles
