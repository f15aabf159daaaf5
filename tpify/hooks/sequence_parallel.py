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

__all__ = ["install", "SequenceParallel", "ScatterOutput", "MoEBlock"]


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

    With the recipe's ``[sequence_parallel]`` table: ``split`` scatters the first layer's hidden
    states ``(B, T, H)`` to ``(B, T/p, H)``; ``gather`` all-gathers each attention / MLP input along
    ``T`` (backward: one reduce-scatter, overlapped with the weight gradient); row-parallel layers
    reduce-scatter their output along ``T`` (:class:`ScatterOutput`); ``exit`` all-gathers the last
    module's output; a gathered mixture-of-experts block is :class:`MoEBlock`. Decided per forward
    at ``split`` (``T`` divisible by ``tp_size``), kept in :class:`~tpify.context.CallState`.
    Collectives per layer, LayerNorm gradients, dropout, memory: docs/sequence-parallelism.md,
    "SequenceParallel".

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
        moe_blocks = where.get("moe_blocks", {})
        for fqn in where["gather"]:
            container = model.get_submodule(fqn)
            if fqn in moe_blocks:
                _, routers, expert_parallel = moe_blocks[fqn]
                handles += MoEBlock(self.ctx, expert_parallel).install(container, [model.get_submodule(r)
                                                                                   for r in routers])
                continue
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
        self.ctx.rng.tokens_split = True
        if module.training and self.ctx.rng.active:  # the block has no weight: its devices are its hidden states'
            self.ctx.rng.switch(TP, devices_of(module, hidden))
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
        if self.state.sequence_active and module.training and self.ctx.rng.active:
            self.ctx.rng.switch(TP, devices_of(module, output))

    def _exit(self, module, args, output):
        if not self.state.sequence_active:
            return None
        self.state.sequence_active = False
        self.ctx.rng.tokens_split = False
        self.ctx.rng.switch(DEFAULT, devices_of(module, output))
        if isinstance(output, torch.Tensor):
            return comm.gather_from_sequence_region(output, self.ctx.group, False)
        first = comm.gather_from_sequence_region(output[0], self.ctx.group, False)
        return (first,) + tuple(output[1:])


class MoEBlock:
    """Sequence parallelism around one mixture-of-experts block (Mixtral's ``MixtralSparseMoeBlock``),
    its hooks installed by :class:`SequenceParallel` on the layout's ``moe_blocks``.

    The router runs on the gathered tokens, alike on every rank (its load-balancing loss is a
    product of means over all tokens, arXiv:2101.03961, eq. 4). The gradients of each case:
    docs/sequence-parallelism.md, "MoEBlock".

    Shapes: block input ``(B, T/p, H)``, output ``(B, T/p, H)``; router and experts see
    ``(B*T, H)``. Communication per block and step: tensor-parallel experts, forward one
    all-gather and one reduce-scatter of ``B*T*H`` values, backward one all-gather, one
    reduce-scatter and the all-reduce of the routing weights' gradient (``B*T*k``); expert
    parallelism, forward one all-gather (besides its exchange), backward one all-gather.

    Raises:
        ValueError: (forward) the block draws router jitter noise in training (each rank would draw
            other noise for the same tokens); a router called with other than the block's ``B*T``
            tokens.
    """

    def __init__(self, ctx: TPContext, expert_parallel: bool):
        self.ctx, self.state, self.expert_parallel = ctx, ctx.state, expert_parallel
        self.tokens: tuple[int, int] | None = None  # (B, T) of the call in flight

    def install(self, block: nn.Module, routers: list[nn.Module]) -> list:
        """Register the block's gather and scatter hooks and each router's gradient mask."""
        handles = [block.register_forward_pre_hook(self._gather, with_kwargs=True),
                   block.register_forward_hook(self._scatter)]
        if not self.expert_parallel:
            handles += [router.register_forward_pre_hook(self._router_input, with_kwargs=True) for router in routers]
        return handles

    def _gather(self, module, args, kwargs):
        if not self.state.sequence_active:
            return None
        if module.training and getattr(module, "jitter_noise", 0):
            raise ValueError(f"tpify sequence parallelism: {type(module).__name__} draws router jitter noise "
                             f"(router_jitter_noise = {module.jitter_noise}) in training, which the ranks would draw "
                             f"differently for the same tokens; set config.router_jitter_noise = 0 or run without "
                             f"sequence_parallel")
        hidden, where = _hidden(args, kwargs)
        gathered = comm.gather_from_sequence_region(hidden, self.ctx.group, not self.expert_parallel)
        self.tokens = tuple(gathered.shape[:2])
        self.state.moe_gathered = True
        return _replace(args, kwargs, where, gathered)

    def _router_input(self, module, args, kwargs):
        if not (self.state.moe_gathered and torch.is_grad_enabled()):
            return None
        hidden, where = _hidden(args, kwargs)
        batch, tokens = self.tokens
        if hidden.shape[0] != batch * tokens:
            raise ValueError(f"tpify sequence parallelism: the router {type(module).__name__} was called with "
                             f"{hidden.shape[0]} rows, not the block's {batch} x {tokens} tokens")
        return _replace(args, kwargs, where, _OwnTokensGradient.apply(hidden, batch, tokens, self.ctx.rank,
                                                                      self.ctx.size))

    def _scatter(self, module, args, output):
        if not self.state.moe_gathered:
            return None
        self.state.moe_gathered = False
        split = comm.scatter_to_sequence_region if self.expert_parallel else comm.reduce_scatter_to_sequence_region
        if isinstance(output, torch.Tensor):
            return split(output, self.ctx.group)
        return (split(output[0], self.ctx.group),) + tuple(output[1:])


class _OwnTokensGradient(torch.autograd.Function):
    """Identity forward on ``(B*T, H)`` rows; backward keeps the gradient of this rank's tokens
    ``[r T/p, (r+1) T/p)`` of each sequence and zeroes the rest (so that a reduce-scatter of
    gradients that are the same on every rank counts them once)."""

    @staticmethod
    def forward(ctx, x, batch, tokens, rank, size):
        ctx.where = (batch, tokens, rank, size)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        batch, tokens, rank, size = ctx.where
        chunk = tokens // size
        full = grad.reshape(batch, tokens, -1)
        mine = torch.zeros_like(full)
        mine[:, rank * chunk:(rank + 1) * chunk] = full[:, rank * chunk:(rank + 1) * chunk]
        return mine.view_as(grad), None, None, None, None


def install(model: nn.Module, layout, ctx: TPContext) -> list:
    """:class:`SequenceParallel`'s hooks for ``layout.sequence_parallel`` (none without it, or at
    ``ctx.size == 1``); the handles. Communication: none here."""
    if layout.sequence_parallel is None or ctx.size == 1:
        return []
    return SequenceParallel(ctx, layout.sequence_parallel).install(model)
