"""Training checkpoints of a pipeline (torch.distributed.checkpoint) that resume at another pp,
tp and dp: every rank saves its stages under the global names, and its optimizer's structure apart
(:func:`tpify.checkpoint.save_checkpoint` with ``partial=True``); a resume reads the keys its own
stages hold, whichever ranks wrote them.

Stages under FSDP2 / HSDP or ``replicate`` (:mod:`tpify.pipeline.data_parallel`) are saved as
:mod:`tpify.checkpoint` saves a model under :func:`tpify.shard_data_parallel`: each DTensor
parameter (and optimizer state of its shape) gathered over the dp mesh (``full_tensor``: this
rank's TP shard), then described by its ShardSpec on the TP mesh (DCP writes one copy of the
entries the dp replicas share); on load each rank takes its dim-0 slice of the TP shard back
(``distribute_tensor`` with ``src_data_rank=None``: no communication). The checkpoint is the same
with or without an engine, so it resumes at any pp x dp x tp.
"""

from __future__ import annotations

import os

from torch import nn

from ..checkpoint import load_checkpoint as _load_checkpoint
from ..checkpoint import save_checkpoint as _save_checkpoint
from ..hf_modules import base_model_and_prefix
from .split import PipelineInfo
from .stage import shell_of

__all__ = ["union_model", "save_checkpoint", "load_checkpoint"]


def union_model(info: PipelineInfo) -> nn.Module:
    """One module holding every parameter of this rank's stages under its global name (the
    layers of all its stages; the embeddings and the head where it holds the first / last
    stage): a shell sharing the stages' parameters, for checkpoints. Local."""
    stages = info.stages
    top = shell_of(stages[0].model)
    base, prefix = base_model_and_prefix(stages[0].model)
    union = shell_of(base)
    setattr(top, prefix, union)
    layers = nn.ModuleList()
    layers._modules = {k: v for s in stages
                       for k, v in getattr(base_model_and_prefix(s.model)[0], info.plan.layers)._modules.items()}
    setattr(union, info.plan.layers, layers)
    for names, holder in ((info.plan.first, next((s for s in stages if s.is_first), None)),
                          (info.plan.last, next((s for s in stages if s.is_last), None))):
        for name in names if holder is not None else ():
            setattr(union, name, getattr(base_model_and_prefix(holder.model)[0], name))
    last = next((s for s in stages if s.is_last), None)
    setattr(top, info.plan.head, getattr(last.model, info.plan.head) if last is not None else None)
    return top


def save_checkpoint(path: str | os.PathLike, schedule_or_info, optimizers=(), schedulers=(),
                    extra: dict | None = None) -> None:
    """:func:`tpify.checkpoint.save_checkpoint` of this rank's stages (keys ``model.<global name>``,
    the optimizer state following its parameter), each rank's optimizer structure apart, so that
    :func:`load_checkpoint` resumes at another pp and tp. Every rank of the world calls it.

    Under FSDP2 / HSDP / ``replicate`` each DTensor parameter and its optimizer state are
    gathered over the dp mesh first (the module docstring).

    Communication: per DTensor parameter (and state tensor) one all-gather over dp; then those of
    :func:`tpify.checkpoint.save_checkpoint`. Every rank of the world calls it.

    Raises: those of :func:`tpify.checkpoint.save_checkpoint` (a tpify model is needed: parallelize
    the model, at tp 1 too, or load it with :func:`tpify.pipeline.from_pretrained`, before cutting it).
    """
    info = getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)
    _save_checkpoint(path, [union_model(info)], optimizers, schedulers, extra, partial=True)


def load_checkpoint(path: str | os.PathLike, schedule_or_info, optimizers=(), schedulers=()) -> dict:
    """Read what :func:`save_checkpoint` wrote (at any pp, tp) into this rank's stages and
    ``optimizers`` (over this rank's parameters), in place; return its ``extra``.

    Under FSDP2 / HSDP / ``replicate`` each rank copies its dim-0 slice of the TP shard it read
    into the DTensor parameter, and the optimizer state becomes DTensors of the parameter's
    placements (no communication: every rank slices its own copy).

    Communication and Raises: those of :func:`tpify.checkpoint.load_checkpoint`.
    """
    info = getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)
    return _load_checkpoint(path, [union_model(info)], optimizers, schedulers, partial=True)
