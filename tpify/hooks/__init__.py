"""The hooks a parallelized model needs, one module each, installed after surgery.

HF ``forward`` methods are never replaced; what tensor parallelism adds around them is hooks,
each owned by one module and testable on its own:

* :mod:`~tpify.hooks.dropout`: the TP-distinct dropout stream inside sharded regions (switched
  only when the model may draw dropout);
* :mod:`~tpify.hooks.head_inputs`: each rank's heads of per-head inputs (ALiBi biases);
* :mod:`~tpify.hooks.experts`: fused MoE experts split over the group (their inputs and output
  reduced, or their tokens exchanged);
* :mod:`~tpify.hooks.latent`: multi-head latent attention's whole down projections (the rotary
  key's gradient summed, the sharded region ended before them);
* :mod:`~tpify.hooks.per_head`: per-KV-head parameters held by groups of ranks (their gradients
  summed within each group);
* :mod:`~tpify.hooks.region_grads`: gradients of replicated parameters used inside a sharded
  region or a sequence-parallel stretch, or declared partial (``replicate_sum_grads``), summed
  over the TP group (:class:`tpify.grad_sums.SummedGrads`: one all-reduce per backward pass);
* :mod:`~tpify.hooks.sequence_parallel`: the split, gather and exit of sequence parallelism;
* :mod:`~tpify.hooks.context_parallel`: attention over a sequence split over the CP group, the
  call's checks, the gradients summed over the group;
* :mod:`~tpify.hooks.lm_loss`: the ``labels=`` loss from the vocabulary shards;
* :mod:`~tpify.hooks.guards`: what the model refuses (inputs that differ between ranks, a
  foreign DDP, TRL's fused LM head; with :mod:`~tpify.hooks.state_dict`, another rank's shards
  in ``load_state_dict``); kept by :func:`tpify.remove_hooks`.

:func:`install` installs the behaviour hooks (the guards: :func:`tpify.hooks.guards.install`).
The per-call decisions they share live in the model's :class:`~tpify.context.CallState`; the
layers get them as forward arguments (:class:`~tpify.context.ModeArgument`).
"""

from __future__ import annotations

from torch import nn

from ..context import TPContext
from . import context_parallel, dropout, experts, head_inputs, latent, lm_loss, per_head, region_grads
from .sequence_parallel import SequenceParallel

__all__ = ["install"]


def install(model: nn.Module, layout, ctx: TPContext) -> list:
    """Install the hooks that make a freshly swapped model compute what the dense model does;
    return their handles (:attr:`tpify.info.TPInfo.hooks`, which :func:`tpify.remove_hooks`
    removes). Communication: none (the hooks communicate when the model runs)."""
    handles = [model.register_forward_hook(ctx.region_input.clear)]  # the shared region entry, per call
    handles += head_inputs.install(model, layout, ctx.group)
    handles += experts.install(model, layout, ctx)
    handles += latent.install(model, layout, ctx)  # before region_grads: its pre-hooks see the region ended
    per_head.install(model, layout, ctx, handles)
    handles += dropout.install(model, layout, ctx.rng, mark_regions=layout.tp_size > 1)
    if layout.sequence_parallel is not None and layout.tp_size > 1:
        handles += SequenceParallel(ctx, layout.sequence_parallel).install(model)
    if layout.tp_size > 1:
        declared = tuple(f for f, m in layout.modules.items() if m.style == "replicate_sum_grads")
        region_grads.install(model, ctx.rng, ctx.summed_grads, ctx.state, handles, declared)
    handles += context_parallel.install(model, layout, ctx)  # before lm_loss: its pre-hook checks the labels
    handles += lm_loss.install(model, layout, ctx.state, cp_group=ctx.cp_group)
    return handles
