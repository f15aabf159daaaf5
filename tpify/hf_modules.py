"""Facts about Hugging Face modules, each written once.

What tpify needs to know of a module before it decides anything: whether it is an
``nn.Linear``, a transformers ``Conv1D`` (GPT-2's weight ``[in, out]``) or an ``nn.Embedding``, its
dense sizes, whether its class overrides the plain layer's ``forward``, where the base model sits
in a head class (``base_model_prefix``), and whether it belongs to PEFT. Pure functions of the
module and its class; no communication, nothing set on any module.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["SHARDABLE_TYPES", "is_conv1d", "module_kind", "dense_dims", "overrides_forward", "forward_source",
           "qualname", "base_model_and_prefix", "relative_name", "base_model", "relative_fqn", "is_peft", "config_get",
           "config_set", "config_has",
           "head_dims"]

#: What the recipe styles split (and what must be covered by a rule).
SHARDABLE_TYPES = "nn.Linear, transformers Conv1D, nn.Embedding"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2 family): ``y = x W + b`` with ``W``
    stored ``[in, out]`` (``nx`` in, ``nf`` out). Recognised by name and attributes, so that a
    subclass or a copy from another transformers version counts too."""
    return (any(klass.__name__ == "Conv1D" for klass in type(module).__mro__)
            and hasattr(module, "nf") and hasattr(module, "nx"))


def module_kind(module: nn.Module) -> str | None:
    """``"linear"`` (``nn.Linear`` or ``Conv1D``), ``"embedding"`` (``nn.Embedding``) or None (a
    module no style splits: a container, a norm)."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return "linear"
    return None


def dense_dims(module: nn.Module) -> tuple[int, int, str]:
    """``(in_features, out_features, weight_layout)`` of an ``nn.Linear`` (``"linear"``, weight
    ``[out, in]``) or a ``Conv1D`` (``"conv1d"``, weight ``[in, out]``).

    Raises:
        TypeError: any other module.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, "linear"
    if is_conv1d(module):
        return module.nx, module.nf, "conv1d"
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


_PLAIN_FORWARDS = {nn.Linear: nn.Linear.forward, nn.Embedding: nn.Embedding.forward}


def overrides_forward(module: nn.Module) -> str | None:
    """The plain layer class (``"Linear"``, ``"Embedding"``, ``"Conv1D"``) whose ``forward``
    ``module``'s class overrides, or None (a plain layer, or not a layer at all). A parallel
    version built from the plain layer's maths would drop what the override adds."""
    for plain, forward in _PLAIN_FORWARDS.items():
        if isinstance(module, plain):
            return None if type(module).forward is forward else plain.__name__
    if is_conv1d(module):
        for klass in type(module).__mro__:
            if klass.__name__ == "Conv1D":
                return None if type(module).forward is klass.forward else "Conv1D"
    return None


def forward_source(module: nn.Module) -> str:
    """The source of ``type(module).forward`` (what its forward reads), or "" where it cannot be read."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def qualname(module: nn.Module) -> str:
    """``module.path.ClassName`` of a module's class, for messages."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def base_model_and_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    """``(base model, its attribute name)`` of a head class (``(model.transformer, "transformer")``
    for ``GPT2LMHeadModel``, by ``base_model_prefix``); ``(model, "")`` for a base model or a
    model without one."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return (base, prefix) if isinstance(base, nn.Module) and base is not model else (model, "")


def relative_name(name: str, prefix: str) -> tuple[str, bool]:
    """``(name relative to the base model whose attribute is prefix, whether it is inside it)``:
    ``transformer.h.0`` -> ``("h.0", True)``; the base model itself is ``""``; a head outside it
    keeps its name."""
    if not prefix:
        return name, True
    if name == prefix:
        return "", True
    if name.startswith(prefix + "."):
        return name[len(prefix) + 1:], True
    return name, False


def base_model(model: nn.Module) -> nn.Module:
    """The base model of a head class (``model.transformer`` of ``GPT2LMHeadModel``), or ``model``."""
    return base_model_and_prefix(model)[0]


def relative_fqn(model: nn.Module, fqn: str) -> str:
    """``fqn`` relative to the base model, as recipe rules are written (:func:`relative_name`)."""
    return relative_name(fqn, base_model_and_prefix(model)[1])[0]


def is_peft(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's (a ``PeftModel``, a tuner, an adapter layer)."""
    return type(module).__module__.startswith("peft.")


_MISSING = object()


def config_get(config, path: str, default=None):
    """The config value a recipe names: an attribute (``num_attention_heads``) or a dotted path
    through sub-configs (``text_config.num_attention_heads``: a composed recipe's rules read the
    sub-config of the part they were written for). ``default`` when any step is missing."""
    value = config
    for name in path.split("."):
        value = getattr(value, name, _MISSING) if value is not None else _MISSING
        if value is _MISSING:
            return default
    return value


def config_has(config, path: str) -> bool:
    """Whether every step of ``path`` (see :func:`config_get`) exists on ``config``."""
    return config_get(config, path, _MISSING) is not _MISSING


def config_set(config, path: str, value) -> None:
    """Set the value at ``path`` (see :func:`config_get`); the sub-configs on the way must exist.

    Raises:
        AttributeError: a sub-config on the way is missing.
    """
    owner, _, name = path.rpartition(".")
    target = config_get(config, owner, _MISSING) if owner else config
    if target is _MISSING or target is None:
        raise AttributeError(f"config has no sub-config {owner!r} (setting {path!r})")
    setattr(target, name, value)


def head_dims(shape, counts, head_dim: int | None) -> list[int]:
    """The dimensions of a parameter of ``shape`` that index heads: of a size in ``counts`` (the
    model's head counts above 1: query heads, KV heads), unless the parameter is one head's width
    (``(head_dim,)``: a q/k norm shared by every head, whatever the counts). Empty: nothing per
    head. A count equal to the head width is ambiguous and read as the width."""
    shape = tuple(shape)
    if head_dim is not None and shape == (head_dim,):
        return []
    return [i for i, size in enumerate(shape) if size in counts and size > 1]
