"""Dropout streams: the TP-distinct stream inside sharded regions, the shared one outside.

Megatron-LM (arXiv:1909.08053, section 3) draws dropout masks of sharded activations from a
stream distinct per TP rank and those of replicated activations from one stream every rank
shares (:mod:`tpify.random`: the tracker and its streams). This module places the switches by
construction, for any recipe: a sharded region begins at the output of a layer whose style
starts one (column-parallel, output sharded) and ends at the input of the next layer whose style
ends one (row-parallel): the layout's ``region_starts`` / ``region_ends``. HF ``forward``
methods are untouched: in GPT-2, ``attn_dropout`` (between ``c_attn`` and ``c_proj``) uses the TP
stream and ``resid_dropout`` (after ``c_proj``, inside the same ``GPT2Attention.forward``) the
shared one, which a hook around the whole attention module could not get right.
"""

from __future__ import annotations

from torch import nn

__all__ = ["install"]


def install(model: nn.Module, layout, tracker) -> list:
    """Hook the model's dropout-stream ``tracker`` (:class:`tpify.random.RNGStreamTracker`) in:
    after every layer of ``layout.region_starts``, in training mode, the TP stream; before every
    layer of ``layout.region_ends``, the shared stream; before and after the root ``model``'s
    forward, the shared stream. Returns the hook handles. Communication: none."""
    handles = []
    for fqn in layout.region_starts:
        handles.append(model.get_submodule(fqn).register_forward_hook(tracker.enter_region))
    for fqn in layout.region_ends:
        handles.append(model.get_submodule(fqn).register_forward_pre_hook(tracker.leave_region))
    handles.append(model.register_forward_pre_hook(tracker.at_root))
    handles.append(model.register_forward_hook(tracker.at_root))
    return handles
