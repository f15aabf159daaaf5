"""The model-level hooks a parallelized model needs, one module each, installed after surgery.

HF ``forward`` methods are never replaced; what tensor parallelism adds around them is hooks.
Every installer has one signature, ``install(model, layout, ctx) -> handles`` (``ctx``: the
model's :class:`~tpify.context.TPContext`; each handle has ``remove()``), and :data:`INSTALLERS`
lists them in the order they are installed, which is the order their forward pre-hooks run on
a module they share:

* :func:`region_entry`: the model's shared region entry, cleared after each call;
* :mod:`~tpify.hooks.head_inputs`: each rank's heads of per-head inputs (ALiBi biases);
* :func:`module_styles`: each module's style installs its own hooks
  (:meth:`tpify.styles.Style.install`: fused experts, latent projections, per-KV-head
  parameters), before region_grads, whose pre-hook on a latent module must see the region ended;
* :mod:`~tpify.hooks.dropout`: the TP-distinct dropout stream inside sharded regions;
* :mod:`~tpify.hooks.sequence_parallel`: the split, gather and exit of sequence parallelism;
* :mod:`~tpify.hooks.region_grads`: gradients of replicated parameters used inside a sharded
  region or a sequence-parallel stretch, or declared partial, summed over the TP group;
* :mod:`~tpify.hooks.context_parallel`: attention over a sequence split over the CP group, the
  call's checks, the gradients summed over the group (before lm_loss, whose labels it checks);
* :mod:`~tpify.hooks.lm_loss`: the ``labels=`` loss from the vocabulary shards.

:mod:`~tpify.hooks.guards` (with :mod:`~tpify.hooks.state_dict`) holds what the model refuses,
installed apart and kept by :func:`tpify.remove_hooks`. The per-call decisions the hooks share
live in the model's :class:`~tpify.context.CallState`; the layers get them as forward arguments.
"""

from __future__ import annotations

from torch import nn

from ..context import TPContext
from . import context_parallel, dropout, head_inputs, lm_loss, region_grads, sequence_parallel

__all__ = ["install", "INSTALLERS", "region_entry", "module_styles"]


def region_entry(model: nn.Module, layout, ctx: TPContext) -> list:
    """The model's one region entry (:class:`~tpify.layers.ColumnParallelInput`) cleared after
    each call. Communication: none."""
    return [model.register_forward_hook(ctx.region_input.clear)]


def module_styles(model: nn.Module, layout, ctx: TPContext) -> list:
    """Each module's style's own hooks (:meth:`tpify.styles.Style.install`), in layout order.
    Communication: none here (the hooks communicate when the model runs)."""
    handles = []
    for fqn, entry in layout.modules.items():
        handles += entry.styler.install(model.get_submodule(fqn), entry, ctx)
    return handles


#: The installers, in the order they run (see the module docstring for why this order).
INSTALLERS = (region_entry, head_inputs.install, module_styles, dropout.install, sequence_parallel.install,
              region_grads.install, context_parallel.install, lm_loss.install)


def install(model: nn.Module, layout, ctx: TPContext) -> list:
    """Install the hooks that make a freshly swapped model compute what the dense model does
    (:data:`INSTALLERS`, in order); return their handles (:attr:`tpify.info.TPInfo.hooks`, which
    :func:`tpify.remove_hooks` removes). Communication: none (the hooks communicate when the
    model runs)."""
    handles = []
    for installer in INSTALLERS:
        handles += installer(model, layout, ctx)
    return handles
