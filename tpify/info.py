"""What tpify sets on a model, and the one place that reads it.

:func:`tpify.parallelize` stores a :class:`TPInfo` as ``model.tp_info`` (the only attribute tpify
sets on the root model; a model is parallelized by tpify exactly when it has one). Everything
else asks this module: :func:`get_tp_info`, :func:`find_tp_model` (through wrappers: PEFT, DDP,
``torch.compile``), :func:`param_specs` (each parameter's :class:`~tpify.sharding.ShardSpec`,
also once FSDP2 has replaced the parameters). :class:`TPUsageError` is the error for a tool or
method used on a tensor-parallel model in a way tpify does not support.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from .comm import SharesProcessGroups
from .sharding import KeepsShardSpecs, is_dtensor, shard_spec_of

__all__ = ["TPInfo", "TPUsageError", "get_tp_info", "find_tp_model", "param_specs", "record_specs", "foreign_shards"]


class TPUsageError(RuntimeError):
    """A tool or method was used on a tensor-parallel model in a way tpify does not support."""


@dataclass
class TPInfo(SharesProcessGroups):
    """What tpify did to a model; stored as ``model.tp_info``.

    Attributes:
        tp_size, tp_rank: the TP group's size and this process's rank in it.
        tp_group, dp_group: the process groups (``None``: the default group / no DP group).
        layout: the :class:`~tpify.layout.Layout` the model was split by.
        rng: the model's dropout-stream tracker (:class:`tpify.random.RNGStreamTracker`).
        hooks: the hook handles that make the model compute what the dense one does (dropout
            streams, head inputs, sequence parallelism, the parallel LM loss);
            :func:`tpify.remove_hooks` removes them.
        guards: the hook handles that refuse what would be silently wrong (inputs that differ
            between the ranks of the TP group, a foreign DDP, TRL's fused LM head); kept by
            :func:`tpify.remove_hooks`.
        specs: every parameter's :class:`~tpify.sharding.ShardSpec` (``None``: replicated), by
            FQN in the parallelized model, recorded after surgery: a wrapper that replaces the
            parameters (FSDP2's ``fully_shard``) drops the ``tp_shard_spec`` attribute, and
            the gradient norm, the replica check and saving then read the spec from here.
        dp_source: how ``dp_group`` was found: ``"mesh"`` (the DeviceMesh, :func:`tpify.mesh.init_mesh`),
            ``"argument"`` (``parallelize(dp_group=...)``), ``"inferred"`` (from the TP groups of
            every rank: the ranks holding the same TP rank) or ``"none"`` (no data parallelism).
        state: the model's per-call state that hooks share (:class:`tpify.context.CallState`).
        mesh: the ``("dp_replicate", "dp_shard", "tp")`` DeviceMesh the groups come from
            (:func:`tpify.mesh.init_mesh`, or ``parallelize(mesh=...)``), or None (groups passed
            or inferred); :mod:`tpify.data_parallel` shards over its data-parallel axes.
        foreign_shards: ``(parameter, spec)`` of the split parameters that modules tpify did not
            build hold (fused experts keep their transformers class; :func:`foreign_shards`).
        replica_groups: ``{n_kv: group}``: this rank's group of the ranks holding the same KV
            head, for each KV head count held by groups of ranks (:func:`tpify.mesh.replica_groups`).
            ``copy.deepcopy`` of the model copies them along with this object and puts each spec
            back on the copy (a deep copy of a Parameter drops its attributes, and a shard without
            its spec would count as replicated in the gradient norm and be saved at its local
            shape).
    """

    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    layout: object
    rng: object = None
    hooks: list = field(default_factory=list)
    guards: list = field(default_factory=list)
    specs: dict = field(default_factory=dict)
    dp_source: str = "none"
    state: object = None
    mesh: object = None
    foreign_shards: list = field(default_factory=list)
    replica_groups: dict = field(default_factory=dict)

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)  # within a model's deepcopy: the copied model's parameters (memo)
        for param, spec in new.foreign_shards:
            param.tp_shard_spec = spec
        return new


def foreign_shards(model: nn.Module) -> list:
    """``[(parameter, spec)]``: the split parameters held by modules that are not tpify's layers
    (the ``experts`` style splits the parameters of transformers' own experts module in place)."""
    out = []
    for module in model.modules():
        if isinstance(module, KeepsShardSpecs):
            continue
        for param in module._parameters.values():
            spec = shard_spec_of(param) if param is not None else None
            if spec is not None:
                out.append((param, spec))
    return out


def get_tp_info(model: nn.Module) -> TPInfo:
    """The :class:`TPInfo` of a parallelized model.

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    info = getattr(model, "tp_info", None)
    if not isinstance(info, TPInfo):
        raise ValueError(f"{type(model).__name__} was not parallelized by tpify (no tp_info)")
    return info


def find_tp_model(model) -> nn.Module | None:
    """The module inside ``model`` (itself included) that tpify parallelized (the one holding
    ``tp_info``), or None: through wrappers that keep it as a submodule (a PEFT model, a DDP, a
    compiled module)."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        if isinstance(module.__dict__.get("tp_info"), TPInfo):
            return module
    return None


def record_specs(tp_model: nn.Module) -> None:
    """Record the :class:`~tpify.sharding.ShardSpec` of every parameter of a parallelized model by
    name in :attr:`TPInfo.specs` (added to those recorded before: names that changed keep both).

    :func:`tpify.parallelize` records them after surgery; :func:`tpify.integrations.get_peft_model`
    again once the adapters are in (their factors, and the base weights under their new names
    ``...q_proj.base_layer.weight``); :func:`tpify.data_parallel.shard_data_parallel` once more
    before ``fully_shard`` replaces the parameters by DTensors. Local; no communication.
    """
    info = get_tp_info(tp_model)
    for name, p in tp_model.named_parameters(remove_duplicate=False):
        if not is_dtensor(p):
            info.specs[name] = shard_spec_of(p)


def param_specs(model: nn.Module) -> dict[int, object]:
    """``{id(parameter): its ShardSpec or None}`` for every parameter of ``model`` (a parallelized
    model or a wrapper of one).

    A parameter's spec is its ``tp_shard_spec`` attribute, or, for a parameter FSDP2 replaced
    (a sharded DTensor, or between a forward and the next reshard the plain unsharded parameter:
    both drop the attribute), the spec recorded by name (:attr:`TPInfo.specs`,
    :func:`record_specs`). Local; no communication.

    Raises:
        TPUsageError: a DTensor parameter whose name tpify did not record (added after
            ``parallelize``, e.g. a LoRA factor, then sharded by FSDP2): its split is unknown.
    """
    tp_model = find_tp_model(model)
    recorded = get_tp_info(tp_model).specs if tp_model is not None else {}
    names = {id(p): n for n, p in (tp_model or model).named_parameters(remove_duplicate=False)}
    out = {}
    for p in model.parameters():
        spec = shard_spec_of(p)
        name = names.get(id(p))
        if spec is None and name in recorded:  # FSDP2's sharded DTensor, or its unsharded parameter
            spec = recorded[name]
        elif spec is None and is_dtensor(p):
            raise TPUsageError(f"parameter {name or '<unnamed>'} is a DTensor (FSDP2) that tpify did not record "
                               f"when it parallelized the model: its tensor-parallel split is unknown. Shard with "
                               f"tpify.shard_data_parallel (or fully_shard) what tpify.parallelize and "
                               f"tpify.integrations.get_peft_model returned; modules added after parallelize by other "
                               f"means are not known to tpify")
        out[id(p)] = spec
    return out
