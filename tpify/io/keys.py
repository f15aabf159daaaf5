"""Checkpoint keys against the model's names, on load and on save.

On load (:func:`match_checkpoint`), every checkpoint key is mapped to the model's naming as
transformers 5 maps it (the recipe's suffix renames, then the base-model prefix added or
stripped; a key that still names nothing, through transformers' own renamings of the model's
checkpoint conversion mapping, :func:`_hf_renamer`), every tensor the model needs is found under one of its names (tied parameters under
any of theirs), shapes are compared with the dense model's (:func:`dense_shapes`), and what is
missing or unused is reported. On save (:func:`saved_tensors`) tied copies are dropped as
transformers 5 drops them. Persistent buffers are checkpoint tensors, non-persistent ones never
are. Local: no communication.
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn

from ..sharding import shard_spec_of
from . import CheckpointError

__all__ = ["match_checkpoint", "dense_shapes", "replicated_head", "saved_tensors", "persistent_buffers"]


def _rename(key: str, expected: set[str], prefix: str, renames=()) -> str:
    """Map a checkpoint key to the model's naming, as transformers 5 does on load.

    The recipe's ``[checkpoint] renames`` (suffix ``(old, new)`` pairs, BERT's legacy
    ``LayerNorm.gamma/beta``) apply first; then the base-model prefix (``bert.``,
    ``transformer.``) is stripped or added when that makes the key one the model has.
    """
    for old, new in renames:
        if key.endswith(old):
            key = key[: -len(old)] + new
    if prefix and key not in expected:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
            return key[len(prefix) + 1:]
        if f"{prefix}.{key}" in expected:
            return f"{prefix}.{key}"
    return key


def _hf_renamer(model: nn.Module):
    """transformers' own key renamings for ``model`` (its checkpoint conversion mapping: the
    legacy layouts of composite models, ``language_model.model.*`` -> ``model.language_model.*``
    in LLaVA checkpoints), as ``key -> renamed key``, or None when it has none. Renamings only: a
    key that a weight converter would transform (tensors merged or split) is left as it is, and
    is then reported missing or unused like any other."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - another transformers, or a model it has no mapping for
        return None
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    if not renamings:
        return None

    def rename(key: str) -> str | None:
        renamed, converted = rename_source_key(key, renamings, converters)
        return None if converted is not None else renamed
    return rename


def _tied_names(model: nn.Module) -> set[str]:
    """Names transformers declares as tied copies (``lm_head.weight``): not stored on save."""
    from transformers.modeling_utils import _get_tied_weight_keys

    return set(_get_tied_weight_keys(model))


def _param_groups(model: nn.Module) -> list[list[str]]:
    """FQNs of every parameter, grouped by object (a tied weight gives one group of several)."""
    groups: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(fqn)
    return list(groups.values())


def persistent_buffers(model: nn.Module) -> list[str]:
    """FQNs of the buffers a checkpoint holds (registered persistent, not ``None``)."""
    out = []
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                out.append(f"{mname}.{bname}" if mname else bname)
    return out


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    """FQNs of the buffers a checkpoint never holds (old checkpoints may: their tensors are ignored)."""
    out = set()
    for mname, module in model.named_modules():
        for bname in module._non_persistent_buffers_set:
            out.add(f"{mname}.{bname}" if mname else bname)
    return out


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (tied ones under each name) and persistent buffer, by FQN."""
    named = list(model.named_parameters(remove_duplicate=False))
    return named + [(fqn, model.get_buffer(fqn)) for fqn in persistent_buffers(model)]


def replicated_head(model: nn.Module, fqns: list[str], layout) -> bool:
    """Whether tied parameter names ``fqns`` lie outside the base model, in modules the layout
    replicates (a head a base checkpoint lacks may then be initialised)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if base is None or any(f.startswith(prefix + ".") for f in fqns):
        return False
    sharded = layout.sharded()
    return not any(f.rpartition(".")[0] in sharded for f in fqns)


def match_checkpoint(model: nn.Module, headers: dict, shapes: dict[str, tuple[int, ...]], path, cls_name: str,
                     renames=(), may_init=None) -> tuple[dict[str, str], list[str]]:
    """``({model fqn: checkpoint key}, [fqns to initialise])``; local, before any collective.

    ``shapes``: the dense shape of every tensor the model needs, by FQN (:func:`dense_shapes`).
    A tied group is read from whichever of its names the checkpoint holds. ``may_init(fqns)``
    says whether a group missing from the checkpoint may be initialised instead (``None``: never).

    Raises:
        CheckpointError: missing tensors, or tensors whose shape differs (all listed).
    Warns:
        UserWarning: unused checkpoint tensors; tensors that will be newly initialised.
    """
    groups = _param_groups(model)  # buffers a checkpoint lacks keep the values the constructor gave them
    expected = set(shapes)
    prefix = getattr(model, "base_model_prefix", "") or ""
    source: dict[str, str] = {}  # model fqn -> checkpoint key
    unexpected = []
    skip = _non_persistent_buffers(model)
    hf_rename = _hf_renamer(model)
    for key in headers:
        name = _rename(key, expected, prefix, renames)
        if name not in expected and hf_rename is not None:  # a layout transformers converts on load
            renamed = hf_rename(key)
            if renamed is not None and _rename(renamed, expected, prefix, renames) in expected:
                name = _rename(renamed, expected, prefix, renames)
        if name in expected:
            source.setdefault(name, key)
        elif _rename(key, skip, prefix, renames) not in skip:
            unexpected.append(key)
    errors, to_init = [], []
    for fqns in groups:
        have = [f for f in fqns if f in source]
        if not have:
            if may_init is not None and may_init(fqns):
                to_init.extend(fqns)
            else:
                errors.append(f"missing tensor {fqns[0]} (shape {list(shapes[fqns[0]])})")
            continue
        for f in fqns:
            source[f] = source[have[0]]
    for fqn in list(source):
        shape = headers[source[fqn]].shape
        if shape != shapes[fqn]:
            errors.append(f"tensor {source[fqn]} in {headers[source[fqn]].file} has shape {list(shape)}, but "
                          f"{cls_name}.{fqn} needs {list(shapes[fqn])}")
    if errors:
        raise CheckpointError(f"checkpoint {path} does not fit {cls_name} (config {path / 'config.json'}):\n  - "
                              + "\n  - ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20
                                                               else "")
                              + "\nCheck model_class= and that the files belong to this config.")
    if unexpected:
        warnings.warn(f"tpify: some weights of {path} were not used when initializing {cls_name}: "
                      f"{sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}", stacklevel=3)
    if to_init:
        warnings.warn(f"tpify: some weights of {cls_name} were not in {path} and are newly initialized: "
                      f"{sorted(to_init)}. You should probably train this model.", stacklevel=3)
    return source, to_init


def dense_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The dense shape of every parameter (tied ones under each name) and persistent buffer, by
    FQN: a shard's split dimension at its :class:`~tpify.sharding.ShardSpec`'s global size."""
    out = {}
    for fqn, t in _named_tensors(model):
        spec = shard_spec_of(t)
        shape = list(t.shape)
        if spec is not None:
            shape[spec.dim] = spec.global_size
        out[fqn] = tuple(shape)
    return out


def saved_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, local tensor)`` pairs to save: tied copies dropped as transformers 5 does."""
    tied = _tied_names(model)
    out, seen = [], set()
    named = _named_tensors(model)
    by_id: dict[int, list[str]] = {}
    for fqn, t in named:
        by_id.setdefault(id(t), []).append(fqn)
    for fqn, t in named:
        if id(t) in seen:
            continue
        seen.add(id(t))
        names = by_id[id(t)]
        keep = [n for n in names if not any(re.search(pat, n) for pat in tied)] or names
        out.append((keep[0], t))
    return out
