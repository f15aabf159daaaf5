"""Gradients over the pipeline: the global norm over pp x dp x tp and clipping by it.

A stage's parameters are counted by the ranks of its stage; a tied head's weight (the same
parameter as the first stage's embedding, its gradient summed between them by
:func:`tpify.pipeline.step`) is counted once, on the first stage. Under FSDP2 (stages sharded by
:func:`tpify.pipeline.shard_stages`) each rank holds a dim-0 slice of each gradient: its squares
are summed over ``dp_shard`` first (:func:`tpify.training.params_grad_norm`); under DDP the
replicas hold the same summed gradient and count it once each.
"""

from __future__ import annotations

import torch

from .. import comm
from ..sharding import is_dtensor
from ..training import params_grad_norm
from .split import PipelineInfo

__all__ = ["parameters", "grad_norm", "clip_grad_norm_"]


def parameters(schedule_or_info) -> list[torch.nn.Parameter]:
    """This rank's parameters, each once (a parameter shared by two local stages counted once)."""
    info = getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)
    seen, out = set(), []
    for stage in info.stages:
        for p in stage.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def grad_norm(schedule_or_info) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank of the pipeline.

    ``sqrt(sum over pp of ||g_stage||^2)``, each stage's from :func:`tpify.training.params_grad_norm`
    over its TP group (shards summed over TP, replicated parameters once; FSDP2's dim-0 slices
    summed over ``dp_shard`` first, with the ShardSpecs kept in ``info.specs``); the tied head
    counted on the first stage only. Communication: params_grad_norm's all-reduces (over
    ``dp_shard`` under FSDP2, then TP), one all-reduce of one value over the pipeline group. No
    host sync.
    """
    info: PipelineInfo = getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)
    holds_first = any(s.is_first for s in info.stages)
    skip = set() if holds_first else {id(p) for p in info.tied_params}
    counted = [p for p in parameters(info) if id(p) not in skip]
    norm = params_grad_norm(counted, info.tp_group, specs=info.specs)
    squares = norm * norm
    comm.all_reduce(squares, info.pp_group)
    return squares.sqrt()


def clip_grad_norm_(schedule_or_info, max_norm: float) -> torch.Tensor:
    """Scale this rank's gradients so that the whole model's norm (:func:`grad_norm`) is at most
    ``max_norm`` (torch's rule: coefficient ``max_norm / (norm + 1e-6)`` clamped to 1, nothing
    scaled when the norm is not finite); returns the norm before clipping. On the device: no host
    sync (an FSDP2 DTensor gradient is scaled through its local shard). Communication:
    :func:`grad_norm`'s."""
    params = [p for p in parameters(schedule_or_info) if p.grad is not None]
    total = grad_norm(schedule_or_info)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    with torch.no_grad():
        for p in params:
            grad = p.grad.to_local() if is_dtensor(p.grad) else p.grad
            grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return total
