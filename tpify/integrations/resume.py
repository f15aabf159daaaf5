"""The layout a training checkpoint was written at, and the refusal of a resume that does not fit.

A tensor-parallel run saves its optimizer state per rank: each file holds the moments of this
rank's shards, keyed by the position of each parameter in the optimizer's param groups. Loaded
at another layout, those tensors land on parameters of other shapes (a bare size error, or a
crash inside fused AdamW) or, worse, on parameters of the same shape that hold other values:
another ``pad_vocab_multiple`` moves vocabulary rows between ranks, so rows of the embedding
would train with another token's Adam moments, silently. Until optimizer state can be resharded,
every tpify training checkpoint (:class:`~tpify.integrations.TPTrainer`,
:class:`~tpify.integrations.TPAccelerator`, ``tpify finetune``) carries a manifest of the layout
it was written at, ``tpify_layout.json`` next to its optimizer files, and every resume compares
it with its own before it reads anything.

The manifest (:func:`training_layout`, JSON) holds what decides the per-rank optimizer tensors:

* ``tp_size`` and ``dp_size`` (``world_size // tp_size``), and ``optimizer_files``: ``"per TP
  rank"`` (TPTrainer under DDP: DP replicas average their gradients before every step, so they
  hold the same optimizer state and one file per TP rank serves any ``dp_size``) or ``"per rank"``
  (TPAccelerator, ``tpify finetune``, TPTrainer under FSDP2: one file per global rank, which also
  holds that rank's generators or FSDP2's slice of the state, so ``dp_size`` must match too);
* ``dp_shard``: how many ranks FSDP2 splits each TP shard over (1 without FSDP2): the optimizer
  state of a rank is that slice;
* the model class, ``pad_vocab_multiple`` and the PEFT adapters present (names);
* every optimized parameter: its name, this rank's shape and its
  :class:`~tpify.sharding.ShardSpec` (split dimension, packed parts, padded vocabulary size,
  replicated parts), the same on every TP rank;
* each optimizer's class and param groups (the parameter names of each, in order).

:func:`check_resume` reads the saved manifest and compares; the outcome goes through
:func:`tpify.agree.agree`, so a mismatch or a missing file on one rank raises on every rank
(there, an :class:`~tpify.agree.AgreementError` naming it) before any collective or any read of
the state. The message lists what differs, with the numbers, and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .model import TPUsageError, is_peft, tp_model_of

__all__ = ["MANIFEST_NAME", "ResumeError", "training_layout", "write_manifest", "check_resume"]

MANIFEST_NAME = "tpify_layout.json"
FORMAT = 1
PER_TP_RANK, PER_RANK = "per TP rank", "per rank"
_MAX_LISTED = 3  # parameters named in a message; the rest are counted

_NOTE = ("Optimizer state of a tpify tensor-parallel run: one file {files}, each holding that rank's shards "
         "of the optimizer state. It resumes only at this layout (resharding is not supported yet). The model "
         "weights beside it are a dense Hugging Face checkpoint that loads at any layout.")


class ResumeError(TPUsageError):
    """A checkpoint's optimizer state does not fit this run's layout, or its layout manifest is
    missing or unreadable. Raised on every rank (on the others as an ``AgreementError``)."""


def _spec(param, vocabulary: set[int], specs: dict) -> dict | None:
    """A parameter's split, as JSON; for a vocabulary table (``vocabulary``: ids of the embedding's
    and LM head's parameters) also its padded rows, which decide which Adam moments go where.
    ``specs``: ``{id(param): ShardSpec}`` (:func:`tpify.info.param_specs`, also for FSDP2's
    DTensors)."""
    from ..sharding import shard_spec_of

    spec = specs[id(param)] if id(param) in specs else shard_spec_of(param)
    if spec is None:
        return None
    out = {"dim": spec.dim, "parts": list(spec.parts), "padded_size": spec.padded_size,
           "replicated": list(spec.replicated)}
    if id(param) in vocabulary:
        out["vocab_rows"] = spec.padded_size or spec.global_size
    return out


def _vocabulary_params(tp_models) -> set[int]:
    """Ids of the parameters of the modules whose style splits a vocabulary (embedding, LM head)."""
    from ..info import get_tp_info

    ids = set()
    for model in tp_models:
        for fqn, entry in get_tp_info(model).layout.modules.items():
            if entry.styler.vocab_rows:
                ids.update(id(p) for p in model.get_submodule(fqn).parameters(recurse=False))
    return ids


def _unwrap_optimizer(optimizer):
    """accelerate's ``AcceleratedOptimizer`` keeps the user's optimizer as ``.optimizer``."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def training_layout(models, optimizers=None, *, optimizer_files: str, written_by: str,
                    dp_shard: int | None = None) -> dict:
    """The manifest of this rank's training layout (JSON-able; the same on every rank).

    Args:
        models: a model or a list of models (a tpify model, or a PEFT model on one; other models
            may be in the list: their parameters are named too). Parameters of the ``i``-th model
            (``i > 0``) are named ``model_<i>.<fqn>``.
        optimizers: the optimizers whose state is saved, or None (then the manifest describes
            the trainable parameters and no param groups; :func:`check_resume` compares what
            both sides have).
        optimizer_files: ``PER_TP_RANK`` or ``PER_RANK`` (see the module docstring).
        written_by: the tool, for a reader of the file.
        dp_shard: FSDP2's shard count, for a model not sharded yet (a resume checks before
            ``prepare`` shards it); default: read from the parameters (1 without FSDP2).

    Raises:
        ResumeError: no tpify model among ``models``.
        ValueError: ``optimizer_files`` is neither.
    """
    import torch.distributed as dist

    from ..info import get_tp_info

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    tp_models = [m for m in (tp_model_of(x) for x in models) if m is not None]
    if not tp_models:
        raise ResumeError(f"{written_by}: no tpify model to describe the checkpoint layout of")
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
    from ..info import param_specs
    from ..sharding import is_dtensor

    parameters = {}
    vocabulary = _vocabulary_params(tp_models)
    specs = {k: v for m in models for k, v in param_specs(m).items()} if tp_models else {}
    found = 1
    for p in params:
        parameters.setdefault(name(p), {"shape": list(p.shape), "shard": _spec(p, vocabulary, specs)})
        if is_dtensor(p):  # FSDP2: the slice of each TP shard this rank holds
            found = max(found, p.device_mesh.size(len(p.placements) - 1))
    dp_shard = dp_shard if dp_shard is not None else found
    adapters = sorted({a for m in models if is_peft(m) for a in getattr(m, "peft_config", {})})
    if optimizer_files not in (PER_TP_RANK, PER_RANK):
        raise ValueError(f"optimizer_files must be {PER_TP_RANK!r} or {PER_RANK!r}, got {optimizer_files!r}")
    out = {"format": FORMAT, "written_by": written_by, "note": _NOTE.format(files=optimizer_files),
           "optimizer_files": optimizer_files, "tp_size": info.tp_size, "dp_size": world // info.tp_size,
           "dp_shard": dp_shard, "model_class": info.layout.model_class,
           "pad_vocab_multiple": info.layout.pad_vocab_multiple, "adapters": adapters, "parameters": parameters}
    if groups is not None:
        out["optimizers"] = groups
    return out


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
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(f"format {saved.get('format') if isinstance(saved, dict) else saved!r}, "
                             f"expected {FORMAT}")
    except (OSError, ValueError) as e:
        missing = isinstance(e, FileNotFoundError)
        raise ResumeError(
            f"{checkpoint} cannot be resumed: its layout manifest {file} is "
            f"{'missing' if missing else f'unreadable ({type(e).__name__}: {e})'}. Every tpify training checkpoint "
            f"records the layout its optimizer state was written at (a checkpoint written before tpify did, or by "
            f"another tool, has none); without it the optimizer state could be loaded into the wrong shards. Resume "
            f"from a checkpoint with a manifest, or start from the dense weights with a fresh optimizer") from e
    return saved


def _vocab(m: dict) -> str:
    padded = [(n, p["shard"]) for n, p in m["parameters"].items() if p["shard"] and p["shard"].get("vocab_rows")]
    if not padded:
        return ""
    shown = [f"{n} padded to {s['vocab_rows']} rows" if s["vocab_rows"] > s["parts"][0]
             else f"{n} unpadded, {s['parts'][0]} rows" for n, s in padded[:2]]
    return f" ({'; '.join(shown)})"


def _describe(m: dict) -> str:
    return (f"tp_size {m['tp_size']}, dp_size {m['dp_size']}"
            + (f" (FSDP2 over {m['dp_shard']})" if m.get("dp_shard", 1) > 1 else "")
            + f", pad_vocab_multiple {m['pad_vocab_multiple']}"
            f"{_vocab(m)}, {m['model_class']}"
            + (f" with adapters {m['adapters']}" if m["adapters"] else ""))


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return "; ".join(items[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def differences(saved: dict, mine: dict) -> list[str]:
    """What differs between a saved manifest and this run's, each with both values; empty when
    the saved optimizer state fits. ``dp_size`` counts only for files written per rank; param
    groups only when both manifests have them."""
    out = []
    for key in ("tp_size", "dp_size", "dp_shard", "pad_vocab_multiple", "model_class", "adapters"):
        if key == "dp_size" and saved.get("optimizer_files") == PER_TP_RANK:
            continue
        default = 1 if key == "dp_shard" else None  # manifests written before FSDP2 had no dp_shard
        if saved.get(key, default) != mine.get(key, default):
            out.append(f"{key} {saved.get(key, default)!r} then, {mine.get(key, default)!r} now")
    a, b = saved.get("parameters", {}), mine.get("parameters", {})
    both = "optimizers" in saved and "optimizers" in mine
    if both:
        gone, new = [n for n in a if n not in b], [n for n in b if n not in a]
        if gone:
            out.append(f"optimized parameters missing now: {_listed(gone)}")
        if new:
            out.append(f"optimized parameters new now: {_listed(new)}")
    changed = [f"{n} shape {a[n]['shape']} then, {b[n]['shape']} now" if a[n]["shape"] != b[n]["shape"]
               else f"{n} sharding {a[n]['shard']} then, {b[n]['shard']} now"
               for n in a if n in b and a[n] != b[n]]
    if changed:
        out.append(f"this rank's shards differ: {_listed(changed)}")
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
    """Refuse, on every rank, a resume whose saved layout does not fit this run; return the
    saved manifest.

    Each rank reads ``directory/tpify_layout.json``, compares it with ``mine``
    (:func:`training_layout` of this run) and checks that its own ``files`` exist; then
    :func:`tpify.agree.agree` (over the world) makes every rank raise if any rank failed.
    Call it on every rank before reading any state.

    Communication: one agreement (:func:`tpify.agree.agree`: the store, no collective).

    Raises:
        ResumeError: the manifest is missing or unreadable; the layouts differ (the message
            names both layouts, every difference and the fix); one of ``files`` is missing.
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
                f"{what}: {checkpoint} was saved at {_describe(saved)}; this run: {_describe(mine)}. "
                f"Differences: {'; '.join(problems)}. Resume with the same tp_size"
                f"{'' if saved.get('optimizer_files') == PER_TP_RANK else ' and dp_size'} and pad_vocab_multiple, "
                f"the same model, adapters and optimizer param groups; resuming at another layout is not supported "
                f"yet (the optimizer state would need resharding). The model weights are saved dense and load at "
                f"any layout: to continue at this one with a fresh optimizer, load them (tpify.from_pretrained) and "
                f"train without resuming")
        lost = [str(f) for f in files if not Path(f).is_file()]
        if lost:
            raise ResumeError(f"{what}: {checkpoint} was saved at {_describe(saved)}, but this rank's files {lost} "
                              f"are missing; the checkpoint is incomplete (interrupted while saving, or copied in "
                              f"part): resume from another checkpoint")
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree(what, {"checkpoint": str(checkpoint), "saved layout": digest(saved)} if saved else {}, error)
    return saved
