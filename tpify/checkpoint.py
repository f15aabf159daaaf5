"""Training checkpoints that load at any layout, with torch.distributed.checkpoint (DCP).

A parallelized model's ``state_dict()`` holds each rank's shards under the dense names, tagged
with their rank and layout (:mod:`tpify.hooks.state_dict`): nothing DCP can reshard. Two views
instead: :func:`dense_state_dict` (the dense Hugging Face tensors, gathered, on every rank) and
:func:`sharded_state_dict` (each parameter as DTensors on the TP mesh, :mod:`tpify.dcp_entries`),
so that ``dcp.load`` at another ``tp_size`` or ``dp_size`` reads each rank's new slices.

:func:`save_checkpoint` / :func:`load_checkpoint` add the optimizer state (a state tensor of its
parameter's shape follows the parameter, ``optim.<NAME>.<key>``; other state is replicated), the
schedulers, the param groups' hyperparameters and the generators. Under FSDP2 / HSDP (and
torch's ``replicate``) a parameter tensor parallelism does not split (at tp 1: every one but
packed parts and padded vocabularies) is saved
as the engine's DTensor over the dp mesh (each rank writes its dim-0 slice, DCP one copy of what
replicas share) and read back into a DTensor of its placements (each rank reads its slice: no
gather); a TP shard is first gathered over the dp mesh (``full_tensor``) and sliced back on load.
The generators of
each rank are restored only at the saved layout (same ``tp_size`` and world size); at another,
every rank takes global rank 0's Python, NumPy and torch generators and tpify's TP stream
restarts from ``seed + 2718 + tp_rank`` (:mod:`tpify.random`), so dropout masks in sharded
regions differ from the uninterrupted run's, as between any two ``tp_size`` s. Each rank writes
its own ``__<rank>_0.distcp`` in parallel; global rank 0 writes ``.metadata``.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from .agree import agree
from .dcp_entries import ShardContext, is_whole_entry, load_targets, save_entries, tp_shard
from .info import find_tp_model, get_tp_info, param_specs
from .io import CheckpointError
from .io.keys import saved_tensors
from .mesh import mesh_device_type, model_device_type
from .random import get_rng_tracker
from .sharding import ShardSpec, copy_local_, is_dtensor

__all__ = ["sharded_state_dict", "dense_state_dict", "save_checkpoint", "load_checkpoint", "checkpoint_layout",
           "read_metadata"]


def _context(model: nn.Module) -> ShardContext:
    """The TP mesh, size and rank of ``model``'s shards: the mesh's ``"tp"`` axis, or the TP group
    as a 1-D mesh on the shards' own device (never the backend's name: DCP then copies no shard
    to another device), made once per device type and kept in :attr:`TPInfo.tp_meshes`."""
    tp_model = find_tp_model(model)
    if tp_model is None:
        raise CheckpointError(f"{type(model).__name__} was not parallelized by tpify: a tpify checkpoint describes "
                              f"a tpify model's shards; use torch.distributed.checkpoint directly for other models")
    info = get_tp_info(tp_model)
    if info.tp_size == 1:
        return ShardContext(None, 1, 0)
    if info.mesh is not None:
        return ShardContext(info.mesh["tp"], info.tp_size, info.tp_rank)
    device = model_device_type(tp_model) or mesh_device_type()
    if device not in info.tp_meshes:
        group = info.tp_group if info.tp_group is not None else dist.group.WORLD
        info.tp_meshes[device] = DeviceMesh.from_group(group, device)
    return ShardContext(info.tp_meshes[device], info.tp_size, info.tp_rank)


def _named_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters by the names the model gives them (a DDP's ``module.`` prefix left out)."""
    return list(_unwrap(model).named_parameters())


def _unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


# ---------------------------------------------------------------------------------------------
# The public views of a parallelized model's state.

def sharded_state_dict(model: nn.Module) -> dict:
    """The model's parameters as torch.distributed.checkpoint entries that reshard on load.

    Keys: the parameters' names in ``model`` (a tpify model, a PEFT model on one, under DDP or
    ``torch.compile``), a packed parameter's parts as ``NAME.part<i>``. Values: DTensors on the TP
    mesh (``Shard(dim)``) with the dense tensor's (or part's) shape, e.g. ``c_attn.weight.part0``
    ``(H, H)`` of GPT-2's ``(H, 3H)``, a padded vocabulary's ``V`` rows; plain tensors when
    replicated or at tp 1; the parameters' dtypes (:mod:`tpify.dcp_entries`). ``dcp.save`` it;
    :func:`load_checkpoint` builds the same dict at the new layout and loads it.

    Communication: none for the common specs (the shards are wrapped, not copied); one all-gather
    over TP per vocabulary padded beyond DTensor's chunks; under FSDP2 one over DP per parameter.

    Raises:
        CheckpointError: ``model`` is not a tpify model.
        TPUsageError: a DTensor parameter whose TP split tpify did not record.
    """
    ctx = _context(model)
    specs = param_specs(_unwrap(model))
    out = {}
    for name, p in _named_params(model):
        out.update(save_entries(name, tp_shard(p), specs.get(id(p)), ctx))
    return out


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense Hugging Face state dict of a parallelized model, on every rank.

    Keys: the names :func:`tpify.save_pretrained` writes (tied copies left out). Values: the dense
    tensors (padding stripped, ``[Q|K|V]`` packed again), contiguous, on the parameters' device and
    dtype; the dense model's ``load_state_dict`` takes it (``strict=False`` for tied keys). Holds
    the whole dense model on every rank (:func:`tpify.save_pretrained` writes file by file instead).

    Communication: per sharded tensor one all-gather over TP (under FSDP2 first one over DP).

    Raises:
        CheckpointError: ``model`` is not a tpify model.
    """
    tp_model = find_tp_model(_unwrap(model))
    if tp_model is None:
        raise CheckpointError(f"dense_state_dict: {type(model).__name__} was not parallelized by tpify; its own "
                              f"state_dict() is already dense")
    info = get_tp_info(tp_model)
    specs = param_specs(tp_model)
    out = {}
    for key, t in saved_tensors(tp_model):
        local = tp_shard(t)
        spec = specs.get(id(t))
        out[key] = (spec.gather(local, info.tp_group) if spec is not None else local).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# Training checkpoints: models, optimizers, schedulers, generators.

def _models(models) -> list[nn.Module]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def _prefix(i: int, what: str) -> str:
    return f"{what}." if i == 0 else f"{what}_{i}."


def _optimizer(opt):
    """accelerate's ``AcceleratedOptimizer`` keeps the user's optimizer as ``.optimizer``."""
    inner = getattr(opt, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else opt


def _param_index(models: list[nn.Module]) -> tuple[dict[int, str], dict[int, ShardSpec | None], ShardContext]:
    """``(names, specs, ctx)``: every parameter's checkpoint name (``model.``/``model_<i>.``
    prefixed) and spec, by id."""
    names, specs, ctx = {}, {}, None
    for i, model in enumerate(models):
        if find_tp_model(_unwrap(model)) is not None:
            ctx = ctx or _context(model)
            specs.update(param_specs(_unwrap(model)))
        for fqn, p in _named_params(model):
            names.setdefault(id(p), _prefix(i, "model") + fqn)
    if ctx is None:
        raise CheckpointError("a tpify checkpoint needs a tpify model among the models")
    return names, specs, ctx


def checkpoint_layout() -> dict:
    """This run's layout as a checkpoint records it: ``{"world_size": n}`` (local)."""
    return {"world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1}


def _rng_state(models) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tpify": [get_rng_tracker(find_tp_model(_unwrap(m))).state_dict() for m in models
                      if find_tp_model(_unwrap(m)) is not None]}


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(path, models, optimizers=(), schedulers=(), extra: dict | None = None, *,
                    model_state: bool = True, generators: bool = True, partial: bool = False) -> None:
    """Write a training checkpoint that :func:`load_checkpoint` reads back at any layout.

    ``path`` receives DCP's files: ``__<rank>_0.distcp`` from every rank in parallel and
    ``.metadata`` from global rank 0. Keys: ``model.<name>`` (:func:`sharded_state_dict`;
    ``model_<i>.`` for the ``i``-th model), ``optim.<name>.<key>`` (state following its parameter),
    ``optim.meta`` (param groups, state structure), ``sched``, ``extra``, ``layout`` (tp size, world
    size), ``rng.rank<k>`` (rank ``k``'s generators).

    Args:
        path: the checkpoint directory (created).
        models: a model or a list (tpify models, PEFT models on them, other models).
        optimizers, schedulers: lists (may be empty) over the models' parameters.
        extra: small picklable values (the same on every rank).
        model_state, generators: False for a caller that saves the weights (TPTrainer: densely) or
            the generators itself.
        partial: each rank holds a part of the model the others do not (pipeline stages: the
            same global names, other parameters per stage); each rank's optimizer structure is
            then saved as ``optim.meta.rank<k>`` and :func:`load_checkpoint` (``partial=True``)
            merges them, so a resume may hold another part (another pp).

    Communication: :func:`sharded_state_dict`'s, then DCP's (gather and scatter of the save plans,
    a gather of the results). Every rank of the world calls it.

    Raises:
        CheckpointError: no tpify model; an optimizer parameter belongs to none of ``models``.
    """
    models = _models(models)
    names, specs, ctx = _param_index(models)
    state: dict = {}
    for i, model in enumerate(models if model_state else ()):
        for name, p in _named_params(model):
            state.update(_entries(_prefix(i, "model") + name, p, specs.get(id(p)), ctx))
    for i, opt in enumerate(_optimizer(o) for o in optimizers):
        meta = {"param_groups": [], "state": {}}
        saved = opt.state_dict()
        for group, saved_group in zip(opt.param_groups, saved["param_groups"]):
            params = []
            for p in group["params"]:
                if id(p) not in names:
                    raise CheckpointError(f"save_checkpoint: optimizer {i} holds a parameter of shape "
                                          f"{list(p.shape)} that belongs to none of the models given")
                params.append(names[id(p)])
            meta["param_groups"].append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": params})
        for p, values in opt.state.items():
            name, kinds = names[id(p)], {}
            for k, v in values.items():
                key = _prefix(i, "optim") + name + "." + k
                if torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                    kinds[k] = ("param", None)
                    state.update(_entries(key, v, specs.get(id(p)), ctx))
                elif torch.is_tensor(v):
                    kinds[k] = ("tensor", None)
                    state[key] = v.full_tensor() if is_dtensor(v) else v
                else:
                    kinds[k] = ("object", v)
            meta["state"][name] = kinds
        state[_prefix(i, "optim") + "meta" + (f".rank{_rank()}" if partial else "")] = _blob(meta)
    state["sched"] = _blob([s.state_dict() for s in schedulers])
    state["extra"] = _blob(dict(extra or {}))
    state["layout"] = _blob({"tp_size": ctx.tp_size, **checkpoint_layout()})
    if generators:
        state[f"rng.rank{_rank()}"] = _blob(_rng_state(models))
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(path), no_dist=_no_dist())


def _entries(key: str, t: torch.Tensor, spec: ShardSpec | None, ctx: ShardContext) -> dict:
    """DCP entries of a parameter (or a state tensor of its shape): a DTensor of a data-parallel
    engine (FSDP2 / HSDP / ``replicate``, over the dp mesh) whose TP shard is its own one entry
    (:func:`tpify.dcp_entries.is_whole_entry`: not split over TP, or tp 1 without packed parts or
    padding) as it is, each rank's dim-0 slice written, no communication; else this rank's TP
    shard (gathered over dp: one all-gather) as its ShardSpec's entries
    (:func:`tpify.dcp_entries.save_entries`)."""
    if is_dtensor(t) and is_whole_entry(key, tuple(t.shape), spec, ctx):
        return {key: t.detach()}
    return save_entries(key, tp_shard(t), spec, ctx)


def _targets(key: str, p: torch.Tensor, spec: ShardSpec | None, ctx: ShardContext):
    """``(entries, assemble)`` that ``dcp.load`` fills for a parameter (or a state tensor of its
    shape): for a DTensor that is its own one entry (:func:`_entries`), an empty DTensor of ``p``'s
    placements (DCP reads this rank's slice), returned as it is; else
    :func:`tpify.dcp_entries.load_targets` (this rank's TP shard). Local."""
    if is_dtensor(p) and is_whole_entry(key, tuple(p.shape), spec, ctx):
        target = torch.empty_like(p.detach())
        return {key: target}, lambda: target
    return load_targets(key, tuple(p.shape), p.dtype, p.device, spec, ctx)


def _blob(value) -> io.BytesIO:
    """``value`` pickled (``torch.save``) as one opaque DCP entry: DCP would flatten a dict or a
    list into one entry per element, whose keys the loading side would have to know."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


_INCOMPLETE = ("the checkpoint is incomplete or damaged (interrupted while saving, copied in part, or changed "
               "since): resume from an earlier checkpoint.")


def read_metadata(path):
    """The DCP ``Metadata`` of the checkpoint in ``path``, once every file it points into is
    there and long enough (each entry's ``offset + length`` within its file). Local: no
    communication; the same result on every rank that sees the same files.

    Raises:
        CheckpointError: ``.metadata`` is missing or unreadable, or a ``.distcp`` file is missing or
            shorter than the metadata says (truncated); the message names every such file, its
            size and the size it needs, and says to resume from an earlier checkpoint.
    """
    path = Path(path)
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, or pickle's errors on a truncated file
        raise CheckpointError(f"load_checkpoint: cannot read {path / '.metadata'} ({type(e).__name__}: {e}); "
                              f"{_INCOMPLETE}") from e
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if name is not None:
            needed[name] = max(needed.get(name, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            problems.append(f"{file} is missing")
        elif size < end:
            problems.append(f"{file} is truncated: {size:,} bytes, its .metadata places data up to byte {end:,}")
    if problems:
        raise CheckpointError(f"load_checkpoint: {'; '.join(problems)}; {_INCOMPLETE}")
    return metadata


def _dcp_load(state: dict, path) -> None:
    """``dcp.load`` (a collective), a failure while reading named: DCP gathers every rank's
    exception into a ``CheckpointException`` raised on every rank; this raises a
    :class:`CheckpointError` naming the checkpoint and the first rank's error instead."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    except CheckpointException as e:
        failures = getattr(e, "failures", {}) or {}
        first = next(iter(sorted(failures.items())), None)
        cause = first[1] if first is not None else e
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its stack summary)
        ranks = f" on rank(s) {sorted(failures)}" if failures else ""
        raise CheckpointError(f"load_checkpoint: reading {path} failed{ranks}: {type(cause).__name__}: {cause}; "
                              f"{_INCOMPLETE}") from e


def _load_objects(path, keys: list[str]) -> dict:
    """Load the non-tensor entries ``keys`` (every rank asks for the same or its own)."""
    out = {k: None for k in keys}
    _dcp_load(out, path)
    for k, v in out.items():
        if isinstance(v, io.BytesIO):  # what _blob wrote
            v.seek(0)
            out[k] = torch.load(v, weights_only=False)
    return out


def load_checkpoint(path, models, optimizers=(), schedulers=(), *, model_state: bool = True,
                    generators: bool = True, partial: bool = False) -> dict:
    """Read what :func:`save_checkpoint` wrote into ``models``, ``optimizers`` and ``schedulers``,
    in place, at this run's layout (which may differ from the saved one); return its ``extra``.

    Parameters are copied into (holders stay valid); each optimizer's state is rebuilt by parameter
    name and loaded with ``load_state_dict`` (a fresh optimizer is fine); schedulers get their saved
    state; generators as the module docstring says. ``model_state``/``generators``/``partial``: as
    saved (``partial``: the ranks' optimizer structures merged, each rank takes its parameters').

    Communication: one agreement on the local checks first; DCP's (three loads: the small objects,
    the tensors, the generators); one all-gather over TP per tensor of the dense-order fallback.
    Every rank of the world calls it.

    Raises:
        CheckpointError: on every rank, before any collective: a parameter missing from the
            checkpoint or of another dense shape (up to three named); ``.metadata`` or a ``.distcp``
            missing or truncated (:func:`read_metadata`). While reading: what DCP failed to read.
            After the first load, alike on every rank: other param groups, another scheduler count.
        AgreementError: on the other ranks, when one rank failed its checks.
    """
    models = _models(models)
    optimizers = [_optimizer(o) for o in optimizers]
    names, specs, ctx = _param_index(models)
    metadata, state, finish, by_name, error = None, {}, [], {}, None
    try:
        metadata = read_metadata(path).state_dict_metadata  # every file there and long enough
        _model_targets(path, models, model_state, metadata, specs, ctx, state, finish, by_name)
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree("tpify.load_checkpoint", {"checkpoint": str(path)}, error)
    objects = _load_objects(path, ["sched", "extra", "layout"] + ([] if partial else [
        _prefix(i, "optim") + "meta" for i in range(len(optimizers))]))
    if partial:  # every rank's optimizer structure (pipeline stages), merged
        saved_world = objects["layout"]["world_size"]
        for i in range(len(optimizers)):
            key = _prefix(i, "optim") + "meta"
            parts = _load_objects(path, [f"{key}.rank{k}" for k in range(saved_world)])
            objects[key] = _merged_meta([parts[f"{key}.rank{k}"] for k in range(saved_world)])
    if len(objects["sched"]) != len(schedulers):
        raise CheckpointError(f"{path} holds {len(objects['sched'])} scheduler(s); this run has {len(schedulers)}")
    optim_states = [_optimizer_targets(i, opt, objects[_prefix(i, "optim") + "meta"], names, by_name, metadata,
                                       specs, ctx, state, partial) for i, opt in enumerate(optimizers)]
    _dcp_load(state, path)
    with torch.no_grad():
        for p, assemble in finish:
            value = assemble()
            if is_dtensor(value):  # read as a DTensor of p's placements: this rank's slice
                p.to_local().copy_(value.to_local())
            else:
                copy_local_(p, value) if is_dtensor(p) else p.copy_(value)
    for opt, built, groups in optim_states:
        _load_optimizer(opt, built, groups)
    for sched, saved in zip(schedulers, objects["sched"]):
        sched.load_state_dict(saved)
    if generators:
        _restore_rng(path, models, objects["layout"], ctx)
    return objects["extra"]


def _model_targets(path, models, model_state: bool, metadata, specs, ctx, state: dict, finish: list,
                   by_name: dict) -> None:
    """Fill ``by_name`` (checkpoint key -> parameter) and, with ``model_state``, ``state`` (the
    tensors DCP reads into) and ``finish`` (``(parameter, assemble)`` pairs), checking every
    parameter's dense shape against ``metadata``. Local, no collective.

    Raises:
        CheckpointError: a parameter missing from the checkpoint or of another dense shape (up to
            three named).
    """
    problems = []
    for i, model in enumerate(models):
        for name, p in _named_params(model):
            key = _prefix(i, "model") + name
            by_name[key] = p
            if not model_state:
                continue
            entries, assemble = _targets(key, p, specs.get(id(p)), ctx)
            for k, t in entries.items():
                saved = getattr(metadata.get(k), "size", None)
                if saved is None:
                    problems.append(f"{k} is not in the checkpoint")
                elif tuple(saved) != tuple(t.shape):
                    problems.append(f"{k} has dense shape {tuple(saved)} there, {tuple(t.shape)} here")
            state.update(entries)
            finish.append((p, assemble))
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(f"load_checkpoint: {path} was written for another model: {'; '.join(problems[:3])}"
                              f"{more}. Resume with the model the checkpoint was saved from (any tp_size and "
                              f"dp_size), or start from its dense weights with a fresh optimizer")


def _merged_meta(metas: list[dict]) -> dict:
    """The optimizer structures several ranks saved (``partial``), as one: each param group's
    names in a union (its hyperparameters from the first rank naming it), every state entry."""
    groups, state = [], {}
    for meta in metas:
        for g, group in enumerate(meta["param_groups"]):
            if g == len(groups):
                groups.append({**group, "params": []})
            groups[g]["params"] += [n for n in group["params"] if n not in groups[g]["params"]]
        state.update(meta["state"])
    return {"param_groups": groups, "state": state}


def _optimizer_targets(i: int, opt, meta: dict, names: dict, by_name: dict, metadata, specs, ctx, state: dict,
                       partial: bool = False):
    """``(opt, built, groups)``: optimizer ``i``'s state rebuilt by parameter name from its saved
    ``meta`` (objects as saved, tensors as buffers DCP fills, sharded tensors as ``(parameter,
    assemble)``), the tensors to read added to ``state``. Local, no collective.

    Raises:
        CheckpointError: its param groups list other parameters than the checkpoint's.
    """
    mine = [[names.get(id(p)) for p in g["params"]] for g in opt.param_groups]
    if partial:  # this rank's part of every rank's structure: its own names, in its order
        saved = [set(g["params"]) for g in meta["param_groups"]]
        if len(saved) != len(mine) or any(not set(m) <= s for m, s in zip(mine, saved)):
            raise CheckpointError(f"load_checkpoint: optimizer {i}'s param groups list parameters the checkpoint's "
                                  f"do not ({len(saved)} groups then, {len(mine)} now)")
        meta = {"param_groups": [{**g, "params": m} for g, m in zip(meta["param_groups"], mine)],
                "state": {n: v for n, v in meta["state"].items() if any(n in m for m in mine)}}
    if [g["params"] for g in meta["param_groups"]] != mine:
        raise CheckpointError(f"load_checkpoint: optimizer {i}'s param groups list other parameters than the "
                              f"checkpoint's ({[len(g['params']) for g in meta['param_groups']]} then, "
                              f"{[len(g) for g in mine]} now)")
    index = {name: k for k, name in enumerate(n for g in mine for n in g)}
    built: dict[int, dict] = {}
    for name, kinds in meta["state"].items():
        p = by_name[name]
        values = built.setdefault(index[name], {})
        for k, (kind, value) in kinds.items():
            key = _prefix(i, "optim") + name + "." + k
            if kind == "object":
                values[k] = value
            elif kind == "tensor":
                size = metadata[key].size
                props = metadata[key].properties
                buffer = torch.empty(size, dtype=props.dtype)
                state[key] = buffer
                values[k] = buffer
            else:
                entries, assemble = _targets(key, p, specs.get(id(p)), ctx)
                state.update(entries)
                values[k] = (p, assemble)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
    return opt, built, groups


def _load_optimizer(opt, built: dict, groups: list) -> None:
    """Assemble each sharded state tensor (a DTensor again under FSDP2) and load the state into ``opt``."""
    for values in built.values():
        for k, v in list(values.items()):
            if isinstance(v, tuple):
                p, assemble = v
                shard = assemble()
                if is_dtensor(shard):  # read as a DTensor of p's placements already
                    values[k] = shard
                elif is_dtensor(p):
                    values[k] = distribute_tensor(shard, p.device_mesh, p.placements, src_data_rank=None)
                else:
                    values[k] = shard
    opt.load_state_dict({"state": built, "param_groups": groups})


def _restore_rng(path, models, saved_layout: dict, ctx: ShardContext) -> None:
    """Every rank's generators as saved at the same layout; else rank 0's default stream on
    every rank and tpify's TP stream restarted (the module docstring)."""
    same = saved_layout == {"tp_size": ctx.tp_size, **checkpoint_layout()}
    key = f"rng.rank{_rank() if same else 0}"
    rng = _load_objects(path, [key])[key]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available() and same:
        torch.cuda.set_rng_state_all(rng["cuda"])
    trackers = [get_rng_tracker(find_tp_model(_unwrap(m))) for m in models if find_tp_model(_unwrap(m)) is not None]
    for tracker, saved in zip(trackers, rng["tpify"]):
        if same:
            tracker.load_state_dict(saved)
        else:
            tracker.reset(saved["seed"])  # the TP stream restarts from seed + offset + this rank's tp_rank
