"""The state dict of a parallelized model says what it holds; ``load_state_dict`` takes only what fits.

:class:`TagShards` (a ``state_dict`` post-hook) tags the state dict's ``_metadata`` with the tp
size and rank, the layout's digest and each sharded tensor's :class:`~tpify.sharding.ShardSpec`.
:class:`CheckShards` (a ``load_state_dict`` pre-hook) loads this rank's own shards as they are,
slices dense tensors (:meth:`ShardSpec.slice_dense`), and refuses another rank's or layout's
shard or an untagged local-shape tensor at tp > 1, agreed over the model's ranks
(:func:`tpify.agree.agree`) before anything is copied. The cases, ``strict=False`` and
``assign=True``: docs/loading-and-saving.md, "tpify/hooks/state_dict.py".
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..agree import agree
from ..info import TPUsageError, foreign_shards, get_tp_info
from ..sharding import ShardSpec, is_dtensor, shard_spec_of

__all__ = ["TAG", "TagShards", "CheckShards", "install"]

#: The key of tpify's entry in the model's ``state_dict._metadata[prefix]``.
TAG = "tpify"
_FORMAT = 1
_SHOWN = 4  # tensors named per kind of problem

_FIXES = ("model.state_dict() holds this rank's shards only. Load into each rank the state dict that rank saved "
          "(torch.save(model.state_dict(), f'model-rank{rank}.pt') on every rank: torch.save keeps the tag), or "
          "save the dense model: tpify.save_pretrained(model, dir) then tpify.from_pretrained(dir) (at any tp size); "
          "tpify.dense_state_dict(model), which load_state_dict slices on each rank; or a training checkpoint at any "
          "layout with torch.distributed.checkpoint and tpify.sharded_state_dict (tpify.checkpoint)")


def _sharded(model: nn.Module, info) -> dict[str, tuple[nn.Parameter, ShardSpec]]:
    """``{name: (parameter, spec)}`` of the sharded parameters of the parallelized ``model`` (tied
    ones under each name): the parameter's own spec, or the one recorded by name (FSDP2's
    DTensors lost theirs, :attr:`tpify.info.TPInfo.specs`). Local."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = shard_spec_of(p) or info.specs.get(name)
        if spec is not None:
            out[name] = (p, spec)
    return out


def _spec_from(data) -> ShardSpec | None:
    """The ShardSpec a tag describes, or None when the entry is not one."""
    try:
        return ShardSpec(**{**data, "parts": tuple(data["parts"]), "replicated": tuple(data["replicated"])})
    except (TypeError, KeyError, ValueError):
        return None


class TagShards:
    """``state_dict`` post-hook of a parallelized model: tag the state dict with what it holds.

    Writes ``local_metadata["tpify"]`` (this model's entry of ``state_dict._metadata``):
    ``{"format": 1, "tp_size", "tp_rank", "rank" (global), "layout" (digest), "shards": {name:
    ShardSpec fields}}``, names relative to the model (a wrapper's prefix is the metadata's key).
    Local; no communication. The state dict's tensors are untouched.
    """

    def __init__(self):
        self.layout: str | None = None  # the layout's digest, computed at the first state_dict()

    def __call__(self, module: nn.Module, state_dict, prefix: str, local_metadata: dict) -> None:
        info = get_tp_info(module)
        if self.layout is None:
            self.layout = info.layout.digest()
        local_metadata[TAG] = {
            "format": _FORMAT, "tp_size": info.tp_size, "tp_rank": info.tp_rank,
            "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0, "layout": self.layout,
            "shards": {name: dataclasses.asdict(spec) for name, (_, spec) in _sharded(module, info).items()}}


def _tag_of(local_metadata: dict) -> dict | None:
    tag = local_metadata.get(TAG)
    ok = isinstance(tag, dict) and tag.get("format") == _FORMAT and isinstance(tag.get("shards"), dict)
    return tag if ok else None


def _source(tag: dict) -> str:
    return (f"TP rank {tag.get('tp_rank')} of tp_size {tag.get('tp_size')} (global rank {tag.get('rank')}, "
            f"layout {tag.get('layout')})")


def _model_group(info):
    """The ranks a load must agree over: the TP group, with its DP replicas when the TP and DP
    groups cover the world (``None``: the world)."""
    if info.dp_group is None or not (dist.is_available() and dist.is_initialized()):
        return info.tp_group
    if comm.group_size(info.tp_group) * comm.group_size(info.dp_group) == dist.get_world_size():
        return None
    return info.tp_group


class CheckShards:
    """``load_state_dict`` pre-hook (and, for ``assign=True``, post-hook) of a parallelized model:
    this rank's own shards load, dense tensors load sliced, other ranks' shards are refused on
    every rank (see the module docstring for the rules).

    Shapes: a sharded parameter of local shape ``L`` (``spec.dim`` of size ``spec.local_size``)
    takes a tensor of shape ``L`` (its own shard) or of the dense shape (``spec.dim`` of size
    ``spec.global_size``, sliced here on the tensor's device, in its dtype).

    Communication: at tp > 1, one agreement (:func:`tpify.agree.agree`: the rendezvous store, no
    collective) over the model's ranks, after the local checks and before anything is copied;
    every rank of the TP group (and of its DP replicas) must call ``load_state_dict`` together.
    None at tp = 1.

    Raises:
        TPUsageError: (on the rank that found it; :class:`~tpify.agree.AgreementError` naming it on
            the others) a tensor that is another rank's or another layout's shard, a local-shaped
            tensor without a tag at tp > 1, a tensor of neither the dense nor the local shape;
            each kind naming up to four tensors, where they came from and the fix.
    """

    def __init__(self):
        self._assigned: tuple | None = None  # (sharded names -> (old parameter, spec), tie groups) during an assign

    def __call__(self, module: nn.Module, state_dict, prefix: str, local_metadata: dict, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        info = get_tp_info(module)
        error = None
        try:
            sliced = self._check(module, info, state_dict, prefix, _tag_of(local_metadata))
        except Exception as e:  # noqa: BLE001 - raised by agree on this rank, reported on the others
            error, sliced = e, {}
        if info.tp_size > 1:
            agree(f"{type(module).__name__}.load_state_dict", {}, error, group=_model_group(info))
        elif error is not None:
            raise error
        state_dict.update(sliced)  # the state dict is load_state_dict's own copy
        if local_metadata.get("assign_to_params_buffers"):
            ties: dict[int, tuple[nn.Parameter, list[str]]] = {}
            for name, p in module.named_parameters(remove_duplicate=False):
                ties.setdefault(id(p), (p, []))[1].append(name)
            self._assigned = (_sharded(module, info), [tie for tie in ties.values() if len(tie[1]) > 1])

    @staticmethod
    def _check(module: nn.Module, info, state_dict, prefix: str, tag: dict | None) -> dict[str, torch.Tensor]:
        """``{key: this rank's slice}`` of the dense tensors of ``state_dict``; raises
        :class:`TPUsageError` listing every tensor refused. Local; no communication."""
        what = f"{type(module).__name__}.load_state_dict"
        own = tag is not None and tag.get("tp_rank") == info.tp_rank
        sliced, foreign, untagged, misshapen = {}, [], [], []
        for name, (param, spec) in _sharded(module, info).items():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue  # absent (strict=False, or torch reports it missing), or not a tensor (torch reports it)
            shape, local = list(value.shape), list(param.shape)
            dense = list(local)
            dense[spec.dim] = spec.global_size
            written = _spec_from(tag["shards"][name]) if tag is not None and name in tag["shards"] else None
            if own and written == spec:
                continue  # this rank's own shard (torch compares the shapes)
            whole = tag is None or name not in tag["shards"] or (
                written is not None and written.tp_size == 1 and written.padded_size in (None, written.global_size))
            if whole and shape == dense and not is_dtensor(value):
                sliced[key] = spec.slice_dense(value, info.tp_rank)
            elif tag is not None and name in tag["shards"]:
                foreign.append(f"{key} (shape {shape} of the dense {dense})")
            elif tag is None and shape == local and info.tp_size > 1:
                untagged.append(key)
            elif shape != local or not (tag is None and info.tp_size == 1):
                misshapen.append(f"{key}: shape {shape}, expected the dense {dense} or this rank's {local}")
        problems = []
        if foreign:
            problems.append(f"{len(foreign)} tensors are the shards of {_source(tag)}, and this is TP rank "
                            f"{info.tp_rank} of tp_size {info.tp_size} (layout {info.layout.digest()}): they hold "
                            f"other rows or columns of the dense weights than this rank's: "
                            f"{', '.join(foreign[:_SHOWN])}{' ...' if len(foreign) > _SHOWN else ''}")
        if untagged:
            problems.append(f"{len(untagged)} tensors have this rank's local shape but the state dict does not say "
                            f"which rank wrote them (no 'tpify' entry in its _metadata: a dict comprehension, "
                            f"safetensors or a copy drops it), so they may be another rank's shards: "
                            f"{', '.join(untagged[:_SHOWN])}{' ...' if len(untagged) > _SHOWN else ''}")
        if misshapen:
            problems.append(f"{len(misshapen)} tensors fit neither: {'; '.join(misshapen[:_SHOWN])}"
                            f"{' ...' if len(misshapen) > _SHOWN else ''}")
        if problems:
            raise TPUsageError(f"{what} on TP rank {info.tp_rank} of tp_size {info.tp_size} refuses the state dict: "
                               + "; ".join(problems) + f". Nothing was loaded. {_FIXES}")
        return sliced

    def after(self, module: nn.Module, incompatible_keys) -> None:
        """``load_state_dict`` post-hook: after ``assign=True``, each new sharded parameter gets its
        ShardSpec back and tied parameters are one object again (the first holder's that the state
        dict replaced). Local."""
        if self._assigned is None:
            return
        sharded, ties = self._assigned
        self._assigned = None
        for name, (old, spec) in sharded.items():
            new = module.get_parameter(name)
            if new is not old and not is_dtensor(new):
                new.tp_shard_spec = spec
        for old, names in ties:
            loaded = [p for p in map(module.get_parameter, names) if p is not old]
            for name in names if loaded else []:
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._parameters[leaf] = loaded[0]
        get_tp_info(module).foreign_shards = foreign_shards(module)


def install(model: nn.Module, info) -> list:
    """Register :class:`TagShards` and :class:`CheckShards` on a freshly parallelized model; return
    the handles (kept with the guards, :attr:`tpify.info.TPInfo.guards`). Local."""
    check = CheckShards()
    return [model.register_state_dict_post_hook(TagShards()),
            model.register_load_state_dict_pre_hook(check),
            model.register_load_state_dict_post_hook(check.after)]
