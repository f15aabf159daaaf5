"""What tpify sets on a model, and the one place that reads it.

:func:`tpify.parallelize` stores a :class:`TPInfo` as ``model.tp_info`` (:func:`set_tp_info`; a
model is parallelized by tpify exactly when it has one). Everything else asks this module:
:func:`get_tp_info` (raises), :func:`tp_info_of` (or None), :func:`find_tp_model` (through
wrappers: PEFT, DDP, ``torch.compile``), :func:`param_specs` (each parameter's
:class:`~tpify.sharding.ShardSpec`, also once FSDP2 has replaced the parameters).
:class:`TPUsageError` is the error for a tool or method used on a tensor-parallel model in a
way tpify does not support.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch.distributed as dist
from torch import nn

from .comm import SharesProcessGroups
from .sharding import KeepsShardSpecs, is_dtensor, shard_spec_of

__all__ = ["TPInfo", "TPUsageError", "get_tp_info", "tp_info_of", "set_tp_info", "find_tp_model", "param_specs",
           "record_specs", "foreign_shards"]


class TPUsageError(RuntimeError):
    """A tool or method was used on a tensor-parallel model in a way tpify does not support."""


class TPInfo(SharesProcessGroups):
    """What tpify did to a model; stored as ``model.tp_info`` (:func:`set_tp_info`).

    ``repr(info)`` is one line (tp size and rank, the TP and DP groups' ranks, the parallel
    modules counted by style, this rank's parameter bytes); :meth:`describe` gives the whole
    layout (every module's style and rule, every parameter's local shape and split).

    Attributes:
        ctx: the model's :class:`~tpify.context.TPContext`, the one its layers and hooks share;
            ``tp_size``, ``tp_rank``, ``tp_group``, ``rng``, ``state``, ``replica_groups`` and ``cp_group``/``cp_size``/``cp_rank`` read it.
        dp_group: the DP process group (``None``: no data parallelism); ``dp_source`` how it was
            found: ``"mesh"``, ``"argument"``, ``"inferred"`` (the ranks holding the same TP rank)
            or ``"none"``.
        layout: the :class:`~tpify.layout.Layout` the model was split by.
        mesh: the ``("dp_replicate", "dp_shard", "cp", "tp")`` DeviceMesh the groups come from, or None.
        hooks: the handles of the hooks that make the model compute what the dense one does
            (:func:`tpify.remove_hooks` removes them); guards: those that refuse what would be
            silently wrong (kept).
        specs: every parameter's :class:`~tpify.sharding.ShardSpec` (``None``: replicated) by FQN,
            for once a wrapper (FSDP2) has replaced the parameters and dropped the attribute.
        foreign_shards: ``(parameter, spec)`` of split parameters held by modules tpify did not
            build (:func:`foreign_shards`); a deep copy of the model puts each spec back.
        tp_meshes: ``{device type: DeviceMesh}``, the TP group as a 1-D mesh, made once per device
            type by :mod:`tpify.checkpoint` (DCP's DTensors) when the groups come from no mesh.
        model_ref: a ``weakref.ref`` to the model holding this object (for the repr's bytes), or None.
    """

    def __init__(self, ctx, dp_group: dist.ProcessGroup | None, layout, *, dp_source: str = "none", mesh=None,
                 foreign_shards: list | None = None):
        self.ctx = ctx
        self.dp_group = dp_group
        self.layout = layout
        self.dp_source = dp_source
        self.mesh = mesh
        self.hooks: list = []
        self.guards: list = []
        self.specs: dict = {}
        self.foreign_shards = list(foreign_shards or [])
        self.tp_meshes: dict = {}
        self.model_ref = None

    @property
    def tp_size(self) -> int:
        return self.ctx.size

    @property
    def tp_rank(self) -> int:
        return self.ctx.rank

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.ctx.group

    @property
    def rng(self):
        """The model's dropout-stream tracker (:class:`tpify.random.RNGStreamTracker`)."""
        return self.ctx.rng

    @property
    def state(self):
        """The model's per-call state that its hooks share (:class:`tpify.context.CallState`)."""
        return self.ctx.state

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group (the mesh's ``"cp"`` axis: ranks that split the tokens of the
        same sequences, :mod:`tpify.context_parallel`), or None."""
        return self.ctx.cp_group

    @property
    def cp_size(self) -> int:
        """Ranks of the context-parallel group (1 without context parallelism)."""
        return self.ctx.cp_size

    @property
    def cp_rank(self) -> int:
        """This rank's place in the context-parallel group (0 without context parallelism)."""
        return self.ctx.cp_rank

    @property
    def replica_groups(self) -> dict:
        """``{n_kv: group}``: this rank's group of the ranks holding the same KV head."""
        return self.ctx.replica_groups

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)  # within a model's deepcopy: the copied model's parameters (memo)
        for param, spec in new.foreign_shards:
            param.tp_shard_spec = spec
        old = self._model()
        if old is not None and id(old) in memo:  # a weakref is copied as itself: point it at the copy
            new.model_ref = weakref.ref(memo[id(old)])
        return new

    def _model(self) -> nn.Module | None:
        return self.model_ref() if isinstance(self.model_ref, weakref.ref) else None

    def style_counts(self) -> dict[str, int]:
        """``{style: modules}`` of the layout (``replicate`` included), most frequent first."""
        modules = getattr(self.layout, "modules", None) or {}
        return dict(Counter(m.style for m in modules.values()).most_common())

    def param_bytes(self) -> tuple[int, int] | None:
        """``(bytes of this rank's parameters, bytes of the dense model's)``, each parameter once
        (tied ones once; under FSDP2 this rank's slice of its TP shard; the dense figure counts a
        sharded parameter whole, unpadded); None once the model is gone. Local; no communication."""
        model = self._model()
        if model is None:
            return None
        local = dense = 0
        for name, p in model.named_parameters():
            spec = shard_spec_of(p) or self.specs.get(name)
            size = p.element_size()
            local += (p.to_local().numel() if is_dtensor(p) else p.numel()) * size
            dense += (p.numel() // p.shape[spec.dim] * spec.global_size if spec is not None else p.numel()) * size
        return local, dense

    def __repr__(self) -> str:
        styles = ", ".join(f"{style} {n}" for style, n in self.style_counts().items()) or "none"
        nbytes = self.param_bytes()
        memory = "" if nbytes is None else (
            f", parameters {_mib(nbytes[0])} on this rank ({nbytes[0] / max(nbytes[1], 1):.3f} x dense)")
        cp = (f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, cp_group={_ranks(self.cp_group)}, "
              if self.cp_group is not None else "")
        return (f"TPInfo(tp_size={self.tp_size}, tp_rank={self.tp_rank}, tp_group={_ranks(self.tp_group)}, {cp}"
                f"dp_group={_ranks(self.dp_group, none='none')} ({self.dp_source}), modules: {styles}{memory}; "
                f".describe() for the layout)")

    def describe(self) -> str:
        """The whole layout, as text: the groups, the recipe and what it set (LM head, loss,
        sequence parallelism, vocabulary padding), the hooks, then every module tpify styled (its
        style and recipe rule) and every parameter of this rank (its local shape and dtype, and
        how it is split: dimension, dense size, packed parts, replicated parts). Local; no
        communication."""
        layout = self.layout
        lines = [repr(self)]
        recipe = getattr(layout, "recipe", None)
        lines.append(f"recipe: {getattr(recipe, 'source', '-')} (model_type {getattr(recipe, 'model_type', '-')}), "
                     f"model class {getattr(layout, 'model_class', '') or '-'}, "
                     f"pad_vocab_multiple {getattr(layout, 'pad_vocab_multiple', 1)}")
        lines.append(f"LM head: {getattr(layout, 'lm_head', None) or '-'}, "
                     f"loss: {getattr(layout, 'loss_kind', None) or '-'}, "
                     f"sequence parallel: {'yes' if getattr(layout, 'sequence_parallel', None) else 'no'}, "
                     f"ep_size: {getattr(layout, 'ep_size', 1)}")
        replicas = ", ".join(f"{n} KV heads: ranks {_ranks(g)}" for n, g in self.replica_groups.items())
        lines.append(f"hooks: {len(self.hooks)}, guards: {len(self.guards)}, "
                     f"mesh: {'yes' if self.mesh is not None else 'no'}"
                     + (f", KV replica groups: {replicas}" if replicas else ""))
        modules = getattr(layout, "modules", None) or {}
        lines.append(f"modules ({len(modules)}):")
        width = max((len(f) for f in modules), default=0)
        for fqn, m in modules.items():
            lines.append(f"  {fqn:<{width}}  {m.style:<18} rule #{m.rule}")
        model = self._model()
        if model is not None:
            params = list(model.named_parameters())
            lines.append(f"parameters on this rank ({len(params)}):")
            width = max((len(n) for n, _ in params), default=0)
            for name, p in params:
                spec = shard_spec_of(p) or self.specs.get(name)
                local = tuple(p.to_local().shape) if is_dtensor(p) else tuple(p.shape)
                lines.append(f"  {name:<{width}}  {str(list(local)):<14} {str(p.dtype).removeprefix('torch.'):<9} "
                             f"{_split(spec)}")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _ranks(group, none: str = "world") -> str:
    """``"[0, 1]"``: the global ranks of ``group`` (None: the default group, or ``none``);
    ``"?"`` when they cannot be read (the process group is gone)."""
    try:
        if group is None:
            if none != "world":
                return none
            group = dist.group.WORLD
        if not (dist.is_available() and dist.is_initialized()):
            return "?"
        return str(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a repr never raises
        return "?"


def _split(spec) -> str:
    if spec is None:
        return "replicated"
    text = f"split on dim {spec.dim} over {spec.tp_size} (dense {spec.global_size}"
    if len(spec.parts) > 1:
        text += f" in parts {list(spec.parts)}"
    if spec.padded_size is not None:
        text += f", padded to {spec.padded_size}"
    if spec.replicated:
        text += f", parts {list(spec.replicated)} held by groups of {spec.replica_group_size}"
    return text + ")"


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
    info = tp_info_of(model)
    if info is None:
        raise ValueError(f"{type(model).__name__} was not parallelized by tpify (no tp_info)")
    return info


def tp_info_of(model) -> TPInfo | None:
    """The :class:`TPInfo` of ``model`` (or of the model a PEFT wrapper forwards attributes to),
    or None for a model tpify did not parallelize."""
    info = getattr(model, "tp_info", None)
    return info if isinstance(info, TPInfo) else None


def set_tp_info(model: nn.Module, info: TPInfo) -> None:
    """Store ``info`` as ``model.tp_info`` (the only attribute tpify sets on the root model), with
    a weak reference back to the model (no cycle through it)."""
    info.model_ref = weakref.ref(model)
    model.tp_info = info


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
