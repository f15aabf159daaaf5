"""Surgery: swap a model's modules for their parallel layers, as a layout says.

Data flows ``recipe -> layout -> surgery -> hooks``: :func:`tpify.layout.build_layout` decides
everything (pure, no collective); :func:`apply_layout` swaps each module the layout splits for the
parallel layer its style builds (:meth:`tpify.styles.Style.build`; Megatron-LM,
arXiv:1909.08053, section 3), keeps tied parameters tied, and divides per-rank attributes and
config values. It never replaces a Hugging Face ``forward`` method and adds no hook (the hooks
are :mod:`tpify.hooks`).
"""

from __future__ import annotations

import warnings

from torch import nn

from .context import TPContext
from .hf_modules import config_set
from .layout import Layout, PlanError

__all__ = ["apply_layout"]


def apply_layout(model: nn.Module, layout: Layout, ctx: TPContext) -> None:
    """Swap the modules of ``model`` in place for their parallel layers; no collectives.

    Each new layer is built in the model's context ``ctx`` (group, size, rank, the shared region
    entry) and holds only this rank's shard (the dense module is dropped and freed); parameters
    that were the same object before (tied embeddings, ``BertLMPredictionHead.bias``) are the
    same object after; the module attributes the layout divides (head counts) and its
    ``config_divides`` are divided by ``tp_size`` (HF code reading them at forward time sees
    per-rank values). Works on the meta device too. Rules that matched nothing warn.

    Raises:
        PlanError: ``ctx``'s group size differs from the layout's ``tp_size``, or two tied
            parameters were given styles that shard them to different shapes.
    """
    if ctx.size != layout.tp_size:
        raise PlanError(f"the layout is for tp_size = {layout.tp_size} but tp_group has {ctx.size} ranks")
    for rule in layout.unmatched_rules:
        warnings.warn(f"tpify: {rule.describe()} of recipe {layout.recipe.source} matched no module of "
                      f"{type(model).__name__}", stacklevel=3)
    _swap(model, layout, ctx)
    _divide(model, layout)


def _swap(model: nn.Module, layout: Layout, ctx: TPContext) -> None:
    """Replace every split module by its parallel layer, keeping tied parameters one object."""
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    for fqn, entry in layout.modules.items():
        if not entry.styler.shards:
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, child)
        before = dict(dense.named_parameters(recurse=False))  # a style may split the module's own parameters
        layer = entry.styler.build(dense, entry, ctx)
        for name, new in list(layer.named_parameters(recurse=False)):
            old = before[name] if name in before else getattr(dense, name)
            tied = replaced.get(id(old), (None, None))[1]
            if tied is not None:
                if tied.shape != new.shape:
                    raise PlanError(f"{fqn}.{name} is tied to a parameter sharded to shape {tuple(tied.shape)}, "
                                    f"but its own style gives {tuple(new.shape)}")
                setattr(layer, name, tied)
            else:
                replaced[id(old)] = (old, new)
        setattr(parent, child, layer)
    # Re-point every other holder of a replaced parameter (tied weights held by plain modules).
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            old, new = replaced.get(id(param), (None, None))
            if old is param:
                module._parameters[name] = new


def _divide(model: nn.Module, layout: Layout) -> None:
    """Divide the module attributes (head counts, split sizes) and config values the layout names."""
    for fqn, attrs in layout.divides.items():
        module = model.get_submodule(fqn)
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // layout.tp_size)
    for fqn, pairs in layout.kv_divides.items():  # query heads per KV head, where KV heads are replicated
        module = model.get_submodule(fqn)
        for attr, divisor in pairs:
            setattr(module, attr, getattr(module, attr) // divisor)
    config = getattr(model, "config", None)
    for name, dense in layout.config_divides.items():
        config_set(config, name, dense // layout.tp_size)
