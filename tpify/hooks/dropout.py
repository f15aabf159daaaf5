"""Dropout streams: the TP-distinct stream inside sharded regions, the shared one outside.

Megatron-LM (arXiv:1909.08053, section 3); the tracker and its streams are :mod:`tpify.random`.
Switches go at the layout's ``region_starts`` (after) and ``region_ends`` (before); a model whose
every dropout probability (:func:`dropout_probabilities`) is 0 switches nothing (each switch is
a graph break under ``torch.compile``), re-read at each training-mode call. Details:
docs/random-state.md, "tpify/hooks/dropout.py".
"""

from __future__ import annotations

import re

from torch import nn

__all__ = ["install", "dropout_probabilities", "DropoutStreams"]

_NAME = re.compile(r"dropout|pdrop|drop_prob|drop_path|drop_rate", re.IGNORECASE)


def dropout_probabilities(model: nn.Module) -> list[tuple[object, str]]:
    """Where ``model`` keeps its dropout probabilities: ``(object, attribute)`` pairs, for every
    ``nn.Dropout`` (``p``), every number (not a bool) a module holds under a dropout-like name
    (``attention_dropout``, ``dropout``, ``attn_pdrop``, ``drop_prob``), and the same in every
    Hugging Face config the modules hold (``model.config`` and its sub-configs). Read only."""
    found: list[tuple[object, str]] = []
    configs: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            found.append((module, "p"))
        found += _numbers(module)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            configs[id(config)] = config
    seen: set[int] = set()
    todo = list(configs.values())
    while todo:  # configs and their sub-configs (text_config, vision_config)
        config = todo.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        found += _numbers(config)
        todo += [v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return found


def _numbers(obj) -> list[tuple[object, str]]:
    return [(obj, name) for name, value in vars(obj).items()
            if not name.startswith("_") and _NAME.search(name) and isinstance(value, (int, float))
            and not isinstance(value, bool)]


class DropoutStreams:
    """The stream switches of one model, on when it may draw dropout.

    :meth:`install` registers the region hooks (:func:`install`) and leaves the tracker
    :attr:`~tpify.random.RNGStreamTracker.active` when any probability
    :func:`dropout_probabilities` found is above 0. Otherwise the tracker is inactive (the hooks
    keep ``in_region`` and switch nothing; at ``tp_size == 1``, where nothing reads
    ``in_region``, there are none) and :meth:`recheck` on the root model turns the switches on at
    the first training-mode call that finds a probability above 0. Communication: none.
    """

    def __init__(self, model: nn.Module, layout, tracker, handles: list, mark_regions: bool):
        self.model, self.layout, self.tracker, self.handles = model, layout, tracker, handles
        self.mark_regions = mark_regions
        self.sources = dropout_probabilities(model)
        self._recheck_handle = None

    def draws(self) -> bool:
        """Whether any dropout probability of the model is above 0 now."""
        for obj, name in self.sources:
            value = getattr(obj, name, 0)
            if isinstance(value, (int, float)) and value > 0:
                return True
        return False

    def install(self) -> None:
        """The region hooks, active or not, and :meth:`recheck`; handles go into ``handles``."""
        draws = self.draws()
        self.tracker.active = draws
        if draws or self.mark_regions:
            self.handles += _region_hooks(self.model, self.layout, self.tracker)
        if not draws:
            self._recheck_handle = self.model.register_forward_pre_hook(self.recheck)
            self.handles.append(self._recheck_handle)

    def recheck(self, module, args) -> None:
        """Root forward pre-hook while the switches are off: turn them on when, in training, a
        dropout probability is above 0 now (from this call on)."""
        if module.training and not self.tracker.active and self.draws():
            self._recheck_handle.remove()
            self.tracker.active = True
            if not self.mark_regions:
                self.handles += _region_hooks(self.model, self.layout, self.tracker)


def _region_hooks(model: nn.Module, layout, tracker) -> list:
    """After every layer of ``layout.region_starts`` the tracker's ``enter_region`` (the TP stream
    in training while the tracker is active; the region mark always), before every layer of
    ``layout.region_ends`` its ``leave_region`` (``leave_region_to_split`` inside a module that
    sequence parallelism gathers: the tokens are split again after it), before and after the
    root model's forward its ``at_root`` (the shared stream, no region outside the model)."""
    handles = []
    gathered = tuple((getattr(layout, "sequence_parallel", None) or {}).get("gather", ()))
    for fqn in layout.region_starts:
        handles.append(model.get_submodule(fqn).register_forward_hook(tracker.enter_region))
    for fqn in layout.region_ends:  # inside a module sequence parallelism gathers: its output is split again
        split = any(fqn.startswith(g + ".") for g in gathered)
        leave = tracker.leave_region_to_split if split else tracker.leave_region
        handles.append(model.get_submodule(fqn).register_forward_pre_hook(leave))
    handles.append(model.register_forward_pre_hook(tracker.at_root))
    handles.append(model.register_forward_hook(tracker.at_root))
    return handles


def install(model: nn.Module, layout, ctx) -> list:
    """Hook the model's dropout-stream tracker (``ctx.rng``, :class:`tpify.random.RNGStreamTracker`)
    in: after every layer of ``layout.region_starts``, in training mode, the TP stream; before every
    layer of ``layout.region_ends``, the shared stream; before and after the root ``model``'s
    forward, the shared stream. The switches are on only while the model may draw dropout
    (:class:`DropoutStreams`: a dropout probability above 0, at ``parallelize`` or at a later
    training call); off, at ``ctx.size > 1`` the hooks only mark the regions (what
    :mod:`tpify.hooks.region_grads` reads; at ``ctx.size == 1`` none are installed).
    Returns the hook handles. Communication: none."""
    handles: list = []
    DropoutStreams(model, layout, ctx.rng, handles, ctx.size > 1).install()
    return handles
