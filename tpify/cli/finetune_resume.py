"""Checkpoints and resume of ``tpify finetune``: ``checkpoint-<step>`` written atomically, and read back.

A checkpoint holds the HF model directory (LoRA: the adapter) and, in ``trainer/``, the optimizer,
scheduler and generators as a torch.distributed.checkpoint (:mod:`tpify.checkpoint`), ``state.json``
and the manifest (:mod:`tpify.integrations.resume`). A resume continues at the saved layout exactly,
at another (``tp``, ``dp``, ``dp_shard``, the same global batch) with the optimizer state resharded;
a checkpoint of another model or other run arguments is refused on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from .. import comm

if TYPE_CHECKING:
    from .finetune import FinetuneConfig

__all__ = ["resume_point", "check_resume_files"]


def _latest_checkpoint(out_dir: Path) -> Path | None:
    """The ``checkpoint-<step>`` folder with the highest step; other names (``checkpoint-old2``) are ignored."""
    import re

    ckpts = [(int(m.group(1)), p) for p in out_dir.glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()]
    return max(ckpts)[1] if ckpts else None


# Options that shape the run: a resume must use the values the checkpoint was written with.
_RUN_FIELDS = ("model_dir", "data", "tp", "cp", "dp", "dp_shard", "seq_len", "batch_size", "lr", "warmup", "steps",
               "clip", "weight_decay", "seed", "dtype", "lora_r", "lora_alpha", "quantize")


# The layout: a resume may change these (the state is resharded; context parallelism holds no state),
# as long as the global batch stays.
_LAYOUT_FIELDS = ("tp", "cp", "dp", "dp_shard", "batch_size")


def _run_args(cfg: "FinetuneConfig") -> dict:
    return {k: getattr(cfg, k) for k in _RUN_FIELDS}


def _read_state(ckpt: Path) -> dict:
    """``trainer/state.json`` of a checkpoint, or a clear error naming the file."""
    file = ckpt / "trainer" / "state.json"
    try:
        state = json.loads(file.read_text())
        state["step"], state["losses"]  # noqa: B018 - both must be there
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {file} is missing or corrupt ({type(e).__name__}: {e}); delete {ckpt} to "
                         f"resume from the checkpoint before it, or start without --resume") from e
    return state


def _training_layout(model, optimizer) -> dict:
    from ..integrations.resume import training_layout

    return training_layout(model, [optimizer], written_by="tpify finetune")


def stage_checkpoint(out_dir: Path, step: int) -> tuple[Path, Path]:
    """``(tmp, final)`` for ``checkpoint-<step>``: rank 0 empties ``.checkpoint-<step>.tmp`` and makes
    its ``trainer/``; a barrier. Every rank calls it, then writes into ``tmp`` and calls
    :func:`publish_checkpoint`."""
    final, tmp = out_dir / f"checkpoint-{step}", out_dir / f".checkpoint-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "trainer").mkdir(parents=True)
    comm.barrier()
    return tmp, final


def publish_checkpoint(tmp: Path, final: Path, state: dict, on_rank0=None) -> Path:
    """After every rank wrote into ``tmp``: a barrier; rank 0 writes ``trainer/state.json``, runs
    ``on_rank0(tmp)`` (the manifest) and renames ``tmp`` to ``final`` (atomic); a barrier."""
    comm.barrier()
    if dist.get_rank() == 0:
        (tmp / "trainer" / "state.json").write_text(json.dumps(state))
        if on_rank0 is not None:
            on_rank0(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    comm.barrier()
    return final


def _save_checkpoint(model, optimizer, scheduler, step, losses, cfg, out_dir: Path) -> Path:
    """Write ``checkpoint-<step>``: the HF model directory (LoRA: the adapter) and, in
    ``trainer/``, the training state as a torch.distributed.checkpoint (the trainable parameters'
    values, the optimizer, scheduler and generators, each rank writing its pieces;
    :func:`tpify.checkpoint.save_checkpoint`), ``state.json`` and the manifest
    ``tpify_layout.json``, atomically (a temporary directory renamed)."""
    import tpify

    from ..checkpoint import save_checkpoint
    from ..integrations.resume import write_manifest

    tmp, final = stage_checkpoint(out_dir, step)
    if cfg.lora_r:
        from ..integrations.peft import save_adapter

        save_adapter(model, tmp / "adapter")
    else:
        tpify.save_pretrained(model, tmp / "model")
    save_checkpoint(tmp / "trainer", model, [optimizer], [scheduler], extra={"step": step}, model_state=False)
    state = {"step": step, "losses": losses, "tp": cfg.tp, "dp": cfg.dp, "world": dist.get_world_size(),
             "lora_r": cfg.lora_r, "args": _run_args(cfg)}
    return publish_checkpoint(tmp, final, state,
                              lambda t: write_manifest(t / "trainer", _training_layout(model, optimizer)))


def _restore(trainer_dir: Path, model, optimizer, scheduler, lora: bool) -> None:
    """Continue from ``checkpoint-<k>/trainer`` at this run's layout (any tp, dp, dp_shard):
    refuse, on every rank, a checkpoint of another model or param groups
    (:func:`tpify.integrations.resume.check_resume`, before anything is read), then read the
    adapter (LoRA) and the optimizer, scheduler and generators (:func:`tpify.checkpoint.load_checkpoint`:
    resharded; the generators exactly at the saved layout only).

    Raises:
        ResumeError: the model or param groups differ, the manifest or the state is missing
            (every rank).
        CheckpointError: the state does not fit the model (every rank).
    """
    from ..checkpoint import load_checkpoint
    from ..integrations.resume import check_resume

    check_resume(trainer_dir, _training_layout(model, optimizer), "tpify finetune --resume",
                 checkpoint=trainer_dir.parent, files=[trainer_dir / ".metadata"])
    if lora:
        from ..integrations.peft import load_adapter_

        load_adapter_(model, trainer_dir.parent / "adapter")
    load_checkpoint(trainer_dir, model, [optimizer], [scheduler], model_state=False)


def resume_point(cfg: FinetuneConfig) -> tuple[Path, dict]:
    """The checkpoint ``--resume`` continues from and its state; local, the same on every rank.

    Raises:
        ValueError: no ``checkpoint-<step>`` folder; a missing or corrupt ``state.json``; a
            checkpoint written with another LoRA rank; a checkpoint of a pipeline run (``--pp`` of 2 or
            more) resumed without pipeline stages, or the other way round; other run arguments than ``cfg``'s (listed,
            unless ``cfg.allow_changes``): another layout (``tp``, ``cp``, ``dp``, ``dp_shard``, the per-replica
            ``batch_size``) is fine as long as the global batch ``batch_size x dp`` is the same.
    """
    out_dir = Path(cfg.out_dir)
    ckpt = _latest_checkpoint(out_dir)
    if ckpt is None:
        raise ValueError(f"--resume: no checkpoint-<step> directory in {out_dir}")
    state = _read_state(ckpt)
    if state.get("lora_r", 0) != cfg.lora_r:
        raise ValueError(f"--resume: {ckpt} was written with --lora-r {state.get('lora_r', 0)}; resume with it")
    if (state.get("pp", 1) > 1) != (cfg.pp > 1):  # the two loops' checkpoints hold other things
        raise ValueError(f"--resume: {ckpt} was written {'with' if state.get('pp', 1) > 1 else 'without'} pipeline "
                         f"stages (--pp {state.get('pp', 1)}), this run is at --pp {cfg.pp}; a pipeline run's "
                         f"checkpoint resumes at any --pp of 2 or more (and any --tp), another run's without --pp")
    changed = {k: (v, getattr(cfg, k)) for k, v in state.get("args", {}).items()
               if k in _RUN_FIELDS and k not in _LAYOUT_FIELDS and v != getattr(cfg, k)}
    if state.get("args") and (cfg.batch_size * cfg.dp != state["args"]["batch_size"] * state["args"]["dp"]) \
            and "batch_size" not in changed:
        changed["global batch (batch_size x dp)"] = (state["args"]["batch_size"] * state["args"]["dp"],
                                                     cfg.batch_size * cfg.dp)
    if changed and not cfg.allow_changes:
        raise ValueError(f"--resume: {ckpt} was written with other arguments: "
                         + ", ".join(f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changed.items())
                         + ". Resume with the same arguments, or pass --allow-changes to continue with the new "
                           "ones (data order and learning rate then differ from an uninterrupted run)")
    return ckpt, state


def check_resume_files(ckpt: Path, cfg: FinetuneConfig) -> None:
    """Every file the resume reads from ``ckpt`` (:func:`resume_point`'s) is whole: the adapter (LoRA;
    ``adapter/adapter_model.safetensors``) and the training state's ``.distcp`` files against
    its ``.metadata`` (:func:`tpify.checkpoint.read_metadata`). Local: run on every rank before
    the agreement, so a truncated file stops every rank with its name, not PEFT's
    ``SafetensorError`` or DCP's ``CheckpointException`` around an ``EOFError`` on some.

    Raises:
        ValueError: a missing or truncated file, named, with the fix (resume from the checkpoint
            before it, whose name is given when there is one).
    """
    from ..checkpoint import read_metadata
    from ..io import CheckpointError
    from ..io.files import check_safetensors

    out_dir = Path(cfg.out_dir)
    try:
        if cfg.lora_r:
            check_safetensors(ckpt / "adapter" / "adapter_model.safetensors", fix="resume from an earlier checkpoint")
        read_metadata(ckpt / "trainer")
    except CheckpointError as e:
        earlier = [p for p in sorted(out_dir.glob("checkpoint-*"), key=_step_of) if 0 <= _step_of(p) < _step_of(ckpt)]
        fix = (f"Move {ckpt} away and run again with --resume to continue from {earlier[-1].name}" if earlier else
               f"No earlier checkpoint is in {out_dir}: start again without --resume")
        raise ValueError(f"--resume: {ckpt} is damaged: {e} {fix}") from e


def _step_of(path: Path) -> int:
    """The step of a ``checkpoint-<step>`` folder; -1 for another name."""
    import re

    m = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(m.group(1)) if m and path.is_dir() else -1
