"""Multi-head latent attention's down projections (style ``latent``): the hooks around their forward.

DeepSeek-V2's attention (arXiv:2405.04434, section 2.1) computes from the replicated hidden
states ``x`` a key/value latent and a rotary key shared by every head in one ``nn.Linear``
(``kv_a_proj_with_mqa``: ``[c_KV | k_pe]``), and, in most configs, a query latent
(``q_a_proj``). tpify keeps these projections whole on every rank (:class:`tpify.styles._Latent`
says why); the heads' up projections are column-parallel. Two things make their gradients the
dense ones:

* the rotary key ``k_pe`` (the last ``shared`` output features) goes straight into this rank's
  heads, so each rank computes only part of its gradient: :class:`LatentProjection` sums that
  slice of the output's gradient over the TP group (identity forward; one all-reduce of
  ``B*T*shared`` values in backward, :func:`tpify.comm.sum_grad_ranges`). The latent ``c_KV``
  needs nothing: ``kv_b_proj``'s region entry already sums its gradient (Megatron's ``f``);
* the module reads replicated activations although it runs after the query's column-parallel
  layer (HF computes the queries first): the pre-hook ends the sharded region before it, as a
  row-parallel layer does, so :mod:`tpify.hooks.region_grads` does not take it and the norm after
  it (``kv_a_layernorm``) for replicated modules fed split heads (their gradients, already whole,
  would be summed again: ``tp_size`` times too large). The next column-parallel layer
  (``kv_b_proj``) starts the region again.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..context import TPContext

__all__ = ["LatentProjection", "install"]


class LatentProjection(comm.SharesProcessGroups):
    """The pre-hook / hook pair of one ``latent`` module (see the module docstring).

    Shapes: input ``(B, T, H)``, replicated; output ``(B, T, rank + shared)``, replicated, returned
    unchanged (a view carrying the gradient rule).
    Communication: forward none; backward one all-reduce (sum) of the gradient of the last
    ``shared`` output features, ``B*T*shared`` values (none when ``shared`` is 0).
    Raises:
        TypeError: the module returned something other than one tensor of at least ``shared``
            features (its output could not be split as the recipe says).
    """

    def __init__(self, tracker, group, shared: int, fqn: str):
        self.tracker, self.group, self.shared, self.fqn = tracker, group, shared, fqn

    def enter(self, module, args):
        """The hidden states it reads are replicated: any sharded region ends here."""
        if self.tracker is not None:
            self.tracker.leave_region(module, args)
        return None

    def leave(self, module, args, output):
        """The last ``shared`` features' gradient summed over the ranks (identity forward)."""
        if not self.shared or not torch.is_grad_enabled():
            return None
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[-1] < self.shared:
            raise TypeError(f"tpify: {self.fqn} (style 'latent', shared = {self.shared}) returned "
                            f"{type(output).__name__}{tuple(getattr(output, 'shape', ()))}, not one tensor whose last "
                            f"dimension holds the {self.shared} shared features")
        if not output.requires_grad:
            return None
        width = output.shape[-1]
        return comm.sum_grad_ranges([output], [(output.dim() - 1, [(width - self.shared, width)])], self.group)[0]


def install(model: nn.Module, layout, ctx: TPContext) -> list:
    """The hooks of every ``latent`` module of ``layout``: returns their handles. Install before
    :func:`tpify.hooks.region_grads.install` (its pre-hook on the same module must see the region
    ended). Communication: none (the hooks communicate when the model runs)."""
    handles = []
    if layout.tp_size == 1:
        return handles
    for fqn, entry in layout.modules.items():
        if entry.style != "latent":
            continue
        module = model.get_submodule(fqn)
        hooks = LatentProjection(ctx.rng, ctx.group, entry.shared_features, fqn)
        handles.append(module.register_forward_pre_hook(hooks.enter))
        handles.append(module.register_forward_hook(hooks.leave))
    return handles
