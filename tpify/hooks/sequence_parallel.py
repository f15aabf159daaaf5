"""Sequence parallelism by hooks (Korthikanti et al., arXiv:2205.05198, section 4.2.2).

The split, gather and exit points come from the recipe's ``[sequence_parallel]`` table (the
layout's ``sequence_parallel``); the column- and row-parallel layers inside the gathered modules
are built with ``sequence_parallel=True`` (surgery), and this module tells them per call, as a
forward argument, whether the tokens are split.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..context import ModeArgument, TPContext
from ..layers import RowParallelLinear
from ..random import DEFAULT, TP, devices_of

__all__ = ["SequenceParallel", "ScatterOutput"]


class ScatterOutput(ModeArgument):
    """Forward pre-hook of a row-parallel layer in a gathered module: ``scatter_output`` is whether
    this call splits the tokens (:attr:`CallState.sequence_active`): reduce-scatter along ``T``,
    or all-reduce in a call that runs without sequence parallelism (``generate`` with other
    lengths)."""

    argument = "scatter_output"

    def value(self):
        return self.state.sequence_active


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, str | int]:
    """The hidden states a layer is called with: the ``hidden_states`` keyword, else the first
    positional argument; and where it was."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], "hidden_states"
    if args:
        return args[0], 0
    raise ValueError(f"tpify sequence parallelism: a call without hidden states (kwargs {sorted(kwargs)})")


def _replace(args: tuple, kwargs: dict, where, value):
    if where == "hidden_states":
        kwargs["hidden_states"] = value
        return args, kwargs
    return (value,) + tuple(args[1:]), kwargs


class SequenceParallel:
    """Sequence parallelism (Korthikanti et al., arXiv:2205.05198, section 4.2.2) by hooks.

    Outside attention and MLP, every transformer layer's work (LayerNorms, dropout, residual
    adds) is the same on every rank of the TP group: sequence parallelism splits it along the
    tokens. With the recipe's ``[sequence_parallel]`` table:

    * ``split``: a forward pre-hook splits the first layer's hidden states ``(B, T, H)`` into
      this rank's tokens ``(B, T/p, H)`` (:func:`tpify.comm.scatter_to_sequence_region`); the
      residual stream stays split from there on.
    * ``gather``: a forward pre-hook on each attention and MLP module all-gathers its input
      along ``T`` (Megatron's ``g``); its backward reduce-scatters the partial input gradients,
      replacing the column-parallel layers' all-reduce (they issue none while it is active).
      The gather is a region entry of the layers' :class:`~tpify.layers.ColumnParallelInput`:
      the layers reading the gathered tensor add up their input gradients, and the last of them
      starts the one reduce-scatter asynchronously and computes its weight gradient while it
      runs (Megatron's overlap under sequence parallelism); under ``torch.compile`` the plain
      :func:`tpify.comm.gather_from_sequence_region`.
      Each row-parallel layer reduce-scatters its output along ``T`` instead of all-reducing
      it (same bytes as the all-reduce it replaces: an all-reduce is a reduce-scatter plus an
      all-gather) and sums its bias gradient: the layer is built with ``sequence_parallel=True``
      (a fact of the layout) and :class:`ScatterOutput` passes it ``scatter_output`` per call.
    * ``exit``: a forward hook all-gathers the output of the last module of the split stretch
      (the final norm), so the heads and ``last_hidden_state`` see every token.

    LayerNorm weights in the split stretch see ``T/p`` tokens: their gradients are summed over
    the group (:class:`tpify.hooks.region_grads.ReplicatedInRegion`). Dropout there draws from the per-rank stream (each
    rank holds other tokens). Activation memory of the split stretch is ``1/p`` per rank.

    Whether the tokens are split is decided per forward at ``split`` (``T`` divisible by
    ``tp_size``) and kept in the model's :class:`~tpify.context.CallState`, which activation
    recomputation restores (so gradient checkpointing recomputes the split stretch as it ran). Otherwise
    (``generate`` decoding one token at a time) the forward runs without sequence parallelism,
    exactly as tensor parallelism alone, which is allowed only without gradients: a backward
    through such a forward would meet the LayerNorm gradient all-reduce meant for split tokens.

    Raises:
        ValueError: (forward) ``T`` not divisible by ``tp_size`` while gradients are enabled.
    """

    def __init__(self, ctx: TPContext, where: dict):
        self.ctx, self.where = ctx, where
        self.state = ctx.state

    def install(self, model: nn.Module) -> list:
        """Register the split, gather, scatter-output, stream and exit hooks; return the handles."""
        where = self.where
        handles = [model.register_forward_pre_hook(self._reset), model.register_forward_hook(self._reset)]
        handles.append(model.get_submodule(where["split"]).register_forward_pre_hook(self._split, with_kwargs=True))
        scatter = ScatterOutput(self.state)
        for fqn in where["gather"]:
            container = model.get_submodule(fqn)
            handles.append(container.register_forward_pre_hook(self._gather, with_kwargs=True))
            for module in container.modules():
                if isinstance(module, RowParallelLinear):  # its output is split again: the per-rank stream
                    handles.append(module.register_forward_pre_hook(scatter, with_kwargs=True))
                    handles.append(module.register_forward_hook(self._after_row))
        handles.append(model.get_submodule(where["exit"]).register_forward_hook(self._exit))
        return handles

    def _reset(self, module, *args):
        self.state.sequence_active = False

    def _split(self, module, args, kwargs):
        hidden, where = _hidden(args, kwargs)
        tokens = hidden.shape[1]
        self.state.sequence_active = tokens % self.ctx.size == 0
        if not self.state.sequence_active:
            if torch.is_grad_enabled():
                raise ValueError(f"tpify sequence parallelism: the sequence length {tokens} is not divisible by "
                                 f"tp_size = {self.ctx.size}; pad the batch to a multiple of {self.ctx.size} tokens "
                                 f"(without gradients, e.g. generate(), it runs without sequence parallelism)")
            return None
        if module.training:
            self.ctx.rng.switch(TP, devices_of(module))
        return _replace(args, kwargs, where, comm.scatter_to_sequence_region(hidden, self.ctx.group))

    def _gather(self, module, args, kwargs):
        if not self.state.sequence_active:
            return None
        hidden, where = _hidden(args, kwargs)
        if self.ctx.region_input is None or torch.compiler.is_compiling():
            # the plain g (under torch.compile the compiler schedules the collectives itself)
            return _replace(args, kwargs, where, comm.gather_from_sequence_region(hidden, self.ctx.group, True))
        # a region entry the column-parallel layers inside share: one reduce-scatter of their summed
        # input gradients, overlapped with the last one's weight gradient
        return _replace(args, kwargs, where, self.ctx.region_input.gather(hidden, self.ctx.group))

    def _after_row(self, module, args, output):
        if self.state.sequence_active and module.training:
            self.ctx.rng.switch(TP, devices_of(module))

    def _exit(self, module, args, output):
        if not self.state.sequence_active:
            return None
        self.state.sequence_active = False
        self.ctx.rng.switch(DEFAULT, devices_of(module))
        if isinstance(output, torch.Tensor):
            return comm.gather_from_sequence_region(output, self.ctx.group, False)
        first = comm.gather_from_sequence_region(output[0], self.ctx.group, False)
        return (first,) + tuple(output[1:])
