"""What a training checkpoint was written for, and the refusal of a resume into another model.

Every tpify training checkpoint holds its optimizer state as a torch.distributed.checkpoint
(:mod:`tpify.checkpoint`): it resumes at any ``tp_size``, ``dp_size``, FSDP2 sharding and
``pad_vocab_multiple``. The manifest ``tpify_layout.json`` (:func:`training_layout`: format 2,
the layout, the model class and adapters, every optimized parameter's name and dense shape,
each optimizer's class and param groups) is compared by :func:`check_resume` through
:func:`tpify.agree.agree`, so a mismatch or a missing file raises on every rank before any read.
The fields: docs/training.md, "tpify/integrations/resume.py".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .model import TPUsageError, is_peft, tp_model_of

__all__ = ["MANIFEST_NAME", "ResumeError", "training_layout", "write_manifest", "check_resume", "same_layout"]

MANIFEST_NAME = "tpify_layout.json"
FORMAT = 2
_MAX_LISTED = 3  # parameters named in a message; the rest are counted

_NOTE = ("Training state of a tpify tensor-parallel run, a torch.distributed.checkpoint (DCP): every tensor "
         "described by the dense tensor it is a piece of, so it resumes at any tp_size, dp_size and FSDP2 "
         "sharding (tpify.checkpoint.load_checkpoint). This manifest records the model and optimizer it fits.")


class ResumeError(TPUsageError):
    """A checkpoint's state was written for another model or optimizer, or its manifest is
    missing, unreadable or of the old per-rank format. Raised on every rank (on the others as an
    ``AgreementError``)."""


def _dense_shape(param, specs: dict) -> list[int]:
    """A parameter's dense shape (its TP shard's shape with the split dimension whole, the
    vocabulary unpadded); ``specs``: ``{id(param): ShardSpec}`` (:func:`tpify.info.param_specs`,
    also for FSDP2's DTensors, whose shape is the TP shard's)."""
    from ..sharding import shard_spec_of

    spec = specs[id(param)] if id(param) in specs else shard_spec_of(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.global_size
    return shape


def _unwrap_optimizer(optimizer):
    """accelerate's ``AcceleratedOptimizer`` keeps the user's optimizer as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def training_layout(models, optimizers=None, *, written_by: str, dp_shard: int | None = None) -> dict:
    """The manifest of this run (JSON-able; the same on every rank).

    Args:
        models: a model or a list of models (a tpify model, or a PEFT model on one; other models
            may be in the list: their parameters are named too). Parameters of the ``i``-th model
            (``i > 0``) are named ``model_<i>.<fqn>``.
        optimizers: the optimizers whose state is saved, or None (then the manifest describes
            the trainable parameters and no param groups; :func:`check_resume` compares what
            both sides have).
        written_by: the tool, for a reader of the file.
        dp_shard: FSDP2's shard count, for a model not sharded yet (a resume checks before
            ``prepare`` shards it); default: read from the parameters (1 without FSDP2).

    Raises:
        ResumeError: no tpify model among ``models``.
    """
    import torch.distributed as dist

    from ..info import get_tp_info, param_specs
    from ..sharding import is_dtensor

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    tp_models = [m for m in (tp_model_of(x) for x in models) if m is not None]
    if not tp_models:
        raise ResumeError(f"{written_by}: no tpify model to describe the checkpoint of")
    info = get_tp_info(tp_models[0])
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        for fqn, p in model.named_parameters():
            names.setdefault(id(p), f"model_{i}.{fqn}" if i else fqn)

    def name(p) -> str:
        return names.get(id(p), f"<a parameter of no model, shape {list(p.shape)}>")

    groups = None
    if optimizers is None:
        params = [p for m in models for p in m.parameters() if p.requires_grad]
    else:
        optimizers = [_unwrap_optimizer(opt) for opt in optimizers]
        groups = [{"class": type(opt).__name__,
                   "param_groups": [[name(p) for p in g["params"]] for g in opt.param_groups]} for opt in optimizers]
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    specs = {k: v for m in models for k, v in param_specs(m).items()}
    parameters, found = {}, 1
    for p in params:
        parameters.setdefault(name(p), {"shape": _dense_shape(p, specs)})
        if is_dtensor(p):  # FSDP2: the slice of each TP shard this rank holds
            found = max(found, p.device_mesh.size(len(p.placements) - 1))
    adapters = sorted({a for m in models if is_peft(m) for a in getattr(m, "peft_config", {})})
    out = {"format": FORMAT, "written_by": written_by, "note": _NOTE, "tp_size": info.tp_size,
           "dp_size": world // info.tp_size, "world_size": world,
           "dp_shard": dp_shard if dp_shard is not None else found, "model_class": info.layout.model_class,
           "pad_vocab_multiple": info.layout.pad_vocab_multiple, "adapters": adapters, "parameters": parameters}
    if groups is not None:
        out["optimizers"] = groups
    return out


def same_layout(saved: dict, mine: dict) -> bool:
    """Whether two manifests were written at the same layout (tp size, world size, FSDP2 sharding,
    padding): then each rank's generators are restored exactly (:mod:`tpify.checkpoint`)."""
    keys = ("tp_size", "world_size", "dp_shard", "pad_vocab_multiple")
    return all(saved.get(k) == mine.get(k) for k in keys)


def write_manifest(directory, manifest: dict) -> None:
    """Write ``manifest`` to ``directory/tpify_layout.json`` (atomically; call on one rank)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST_NAME)


def _read(directory: Path, checkpoint) -> dict:
    file = directory / MANIFEST_NAME
    try:
        saved = json.loads(file.read_text())
        if not isinstance(saved, dict) or saved.get("format") not in (1, FORMAT):
            raise ValueError(f"format {saved.get('format') if isinstance(saved, dict) else saved!r}, "
                             f"expected {FORMAT}")
    except (OSError, ValueError) as e:
        missing = isinstance(e, FileNotFoundError)
        raise ResumeError(
            f"{checkpoint} cannot be resumed: its layout manifest {file} is "
            f"{'missing' if missing else f'unreadable ({type(e).__name__}: {e})'}. Every tpify training checkpoint "
            f"records the model and optimizer its state was written for (a checkpoint written before tpify did, or "
            f"by another tool, has none); without it the optimizer state could be loaded onto the wrong parameters. "
            f"Resume from a checkpoint with a manifest, or start from the dense weights with a fresh optimizer") from e
    if saved["format"] == 1:
        raise ResumeError(
            f"{checkpoint} was written by an earlier tpify in the per-rank format (one optimizer file per rank, "
            f"tp_size {saved.get('tp_size')}, dp_size {saved.get('dp_size')}), which this tpify no longer reads. "
            f"Finish that run with the tpify release that wrote it, or continue from its dense weights "
            f"(config.json and model*.safetensors in the checkpoint: tpify.from_pretrained, at any layout) with a "
            f"fresh optimizer; checkpoints written from now on resume at any layout")
    return saved


def _describe(m: dict) -> str:
    return (f"{m['model_class']}" + (f" with adapters {m['adapters']}" if m["adapters"] else "")
            + f" at tp_size {m['tp_size']}, dp_size {m['dp_size']}"
            + (f" (FSDP2 over {m['dp_shard']})" if m.get("dp_shard", 1) > 1 else ""))


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return "; ".join(items[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def differences(saved: dict, mine: dict) -> list[str]:
    """What differs between a saved manifest and this run's in what must match (the model class,
    adapters, the optimized (without optimizers: trainable) parameters' names and dense shapes,
    the optimizers' classes and param groups), each with both values; empty when the saved state
    fits. The layout (tp_size, dp_size, FSDP2, padding) may differ. Param groups only when both
    manifests have them."""
    out = []
    for key in ("model_class", "adapters"):
        if saved.get(key) != mine.get(key):
            out.append(f"{key} {saved.get(key)!r} then, {mine.get(key)!r} now")
    a, b = saved.get("parameters", {}), mine.get("parameters", {})
    both = "optimizers" in saved and "optimizers" in mine
    gone, new = [n for n in a if n not in b], [n for n in b if n not in a]
    if gone:
        out.append(f"optimized parameters missing now: {_listed(gone)}")
    if new:
        out.append(f"optimized parameters new now: {_listed(new)}")
    changed = [f"{n} dense shape {a[n]['shape']} then, {b[n]['shape']} now"
               for n in a if n in b and a[n]["shape"] != b[n]["shape"]]
    if changed:
        out.append(f"the parameters differ: {_listed(changed)}")
    if both:
        so, mo = saved["optimizers"], mine["optimizers"]
        if len(so) != len(mo):
            out.append(f"{len(so)} optimizer(s) then, {len(mo)} now")
        for i, (s, m) in enumerate(zip(so, mo)):
            label = f"optimizer {i}" if len(mo) > 1 else "the optimizer"
            if s["class"] != m["class"]:
                out.append(f"{label} is {s['class']} then, {m['class']} now")
            sg, mg = s["param_groups"], m["param_groups"]
            if [len(g) for g in sg] != [len(g) for g in mg]:
                out.append(f"{label}'s param groups hold {[len(g) for g in sg]} parameters then, "
                           f"{[len(g) for g in mg]} now")
            elif sg != mg:
                out.append(f"{label}'s param groups list the parameters in another order")
    return out


def check_resume(directory, mine: dict, what: str, *, checkpoint=None, files=()) -> dict:
    """Refuse, on every rank, a resume into another model or optimizer; return the saved manifest.

    Each rank reads ``directory/tpify_layout.json``, compares it with ``mine``
    (:func:`training_layout` of this run) and checks that ``files`` exist; then
    :func:`tpify.agree.agree` (over the world) makes every rank raise if any rank failed.
    Call it on every rank before reading any state. Another layout (tp_size, dp_size, FSDP2,
    ``pad_vocab_multiple``) is fine: the state is resharded on load.

    Communication: one agreement (:func:`tpify.agree.agree`: the store, no collective).

    Raises:
        ResumeError: the manifest is missing, unreadable or of the old per-rank format (the
            message says how to continue); the model or optimizer differs (the message names
            both, every difference and the fix); one of ``files`` is missing.
        AgreementError: another rank raised one of these, or the ranks resume from different
            checkpoints.
    """
    from ..agree import agree, digest

    directory = Path(directory)
    checkpoint = checkpoint if checkpoint is not None else directory
    error, saved = None, None
    try:
        saved = _read(directory, checkpoint)
        problems = differences(saved, mine)
        if problems:
            raise ResumeError(
                f"{what}: {checkpoint} was saved from {_describe(saved)}; this run: {_describe(mine)}. "
                f"Differences: {'; '.join(problems)}. A checkpoint resumes at any tp_size and dp_size, but only into "
                f"the model (architecture, shapes, adapters) and optimizer param groups it was written for: resume "
                f"with those, or load the saved weights (tpify.from_pretrained) and train without resuming")
        lost = [str(f) for f in files if not Path(f).exists()]
        if lost:
            raise ResumeError(f"{what}: {checkpoint} was saved from {_describe(saved)}, but {lost} are missing; the "
                              f"checkpoint is incomplete (interrupted while saving, or copied in part): resume from "
                              f"another checkpoint")
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree(what, {"checkpoint": str(checkpoint), "saved layout": digest(saved)} if saved else {}, error)
    return saved
