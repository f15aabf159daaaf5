"""Guards: what a parallelized model refuses because it would be silently wrong.

Each is a forward pre-hook on the model, registered before every other hook (``prepend``) so
that it runs before any collective of the call, and kept by :func:`tpify.remove_hooks` (it
removes the hooks that compute like the dense model, never these):

* :class:`BatchCheck`: the ranks of the TP group were given the same inputs;
* :func:`refuse_foreign_ddp`: a ``DistributedDataParallel`` over other ranks than the model's DP
  group (what ``transformers.Trainer`` and ``accelerate.Accelerator.prepare`` build over the
  world) would have broadcast rank 0's shards and would average gradients of different shards;
* :func:`refuse_fused_lm_head`: TRL's fused LM head multiplies by ``lm_head.weight``, a vocabulary
  shard here;
* :mod:`tpify.hooks.state_dict` (``state_dict`` and ``load_state_dict`` hooks, not forward ones):
  the state dict tagged with the rank and layout of its shards; another rank's shards refused on
  every rank, dense tensors loaded sliced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..info import TPUsageError
from . import state_dict

__all__ = ["BatchCheck", "refuse_foreign_ddp", "refuse_fused_lm_head", "install"]


class BatchCheck(comm.SharesProcessGroups):
    """Forward pre-hook of a parallelized model: every rank of the TP group got the same inputs.

    The ranks of a TP group hold one replica of the model and must see one batch. A rank given
    other token ids (data sampled with a per-rank seed, as DP code often does) would sum the
    embeddings of different tokens and train on the mix without an error; one given another
    sequence length would break the next collective (gloo aborts inside the all-reduce, NCCL can
    hang or return garbage). Before any collective of the call, this hook compares the names,
    shapes, dtypes and values of every tensor argument of the model's forward across the TP
    group (:func:`tpify.comm.check_same_inputs`: one all-reduce of 4 int64 values, one host
    sync), so every rank raises the same ``ValueError`` instead. The embedding's own check then
    has nothing left to do for these ids. Under ``torch.compile`` the hook is skipped (the
    vocab-parallel embedding and loss still check ids and targets).

    Installed with ``prepend=True`` by :func:`install` (kept by :func:`tpify.remove_hooks`).
    Cost per forward (``generate``: per token): one small all-reduce and one pass over the inputs.
    """

    def __init__(self, model_name: str, tp_group):
        self.model_name, self.tp_group = model_name, tp_group

    def __call__(self, module, args, kwargs):
        comm.forget_checked()
        if torch.compiler.is_compiling():
            return None
        named = [(f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        named += [(k, v) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
        comm.check_same_inputs(named, self.tp_group, f"{self.model_name}.forward", remember=True)
        return None

    def install(self, model: nn.Module) -> list:
        """Register the check before every other pre-hook, and, after the forward (also when it
        raises), the end of the call's checked inputs; return the two handles."""
        return [model.register_forward_pre_hook(self, with_kwargs=True, prepend=True),
                model.register_forward_hook(comm.forget_checked, always_call=True)]


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def refuse_foreign_ddp(model: nn.Module, args, kwargs):
    """Forward pre-hook: raise when run inside a DDP whose group is not the model's DP group."""
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = getter() if getter is not None else None
    if ddp is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not any(m is model for m in ddp.module.modules()):
        return None
    info = model.tp_info
    ddp_ranks = _ranks(ddp.process_group)
    tp_ranks = _ranks(info.tp_group) if info.tp_group is not None else [dist.get_rank()]
    if set(ddp_ranks) & set(tp_ranks) != {dist.get_rank()}:  # a DDP peer holds another shard of this replica
        dp_ranks = _ranks(info.dp_group) if info.dp_group is not None else "(none)"
        raise TPUsageError(
            f"{type(model).__name__} is tensor-parallel (tp_size = {info.tp_size}) but runs inside a "
            f"DistributedDataParallel over ranks {ddp_ranks}, not over its DP group {dp_ranks}: DDP broadcast rank 0's "
            f"shards to the other TP ranks and would average gradients of different shards. Use "
            f"tpify.integrations.TPTrainer instead of transformers.Trainer, tpify.integrations.TPAccelerator instead of "
            f"accelerate.Accelerator, or DistributedDataParallel(model, process_group=model.tp_info.dp_group). "
            f"Reload the model: its shards were overwritten.")
    return None


def refuse_fused_lm_head(model: nn.Module, args, kwargs):
    """Forward pre-hook: raise on TRL's fused LM head call (``fused_lm_head=True``) when the LM
    head is split over the vocabulary."""
    if not kwargs.get("fused_lm_head"):
        return None
    info = model.tp_info
    head = info.layout.lm_head
    raise TPUsageError(
        f"{type(model).__name__} was called with fused_lm_head=True: TRL's fused LM head (trl's add_fused_lm_head, "
        f"used by SFTTrainer, DPOTrainer, GRPOTrainer and others) multiplies the hidden states by "
        f"{head or 'the LM head'}.weight directly, which on this tensor-parallel model (tp_size = {info.tp_size}) is "
        f"this rank's shard of the vocabulary: its log-probs and loss would be silently wrong. Build the TRL "
        f"trainer with tpify.integrations.tp_trainer_class (e.g. tp_trainer_class(SFTTrainer)(model, ...)), which "
        f"computes them vocab-parallel; after tpify.remove_hooks it cannot")


def install(model: nn.Module, info) -> list:
    """Register the guards on a freshly parallelized model, each before every other hook
    (``prepend``): the inputs check (tp > 1), TRL's fused LM head refused (a vocabulary-split
    head), a foreign DDP refused; the state dict's tag and load check (:mod:`tpify.hooks.state_dict`).
    Returns the handles (:attr:`tpify.info.TPInfo.guards`)."""
    handles = state_dict.install(model, info)
    if info.tp_size > 1:
        handles += BatchCheck(type(model).__name__, info.tp_group).install(model)
    if info.tp_size > 1 and info.layout.lm_head is not None:
        handles.append(model.register_forward_pre_hook(refuse_fused_lm_head, with_kwargs=True, prepend=True))
    handles.append(model.register_forward_pre_hook(refuse_foreign_ddp, with_kwargs=True, prepend=True))
    return handles
