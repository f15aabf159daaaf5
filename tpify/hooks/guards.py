"""Guards: what a parallelized model refuses because it would be silently wrong.

Each is a forward pre-hook on the model, registered before every other hook (``prepend``) so
that it runs before any collective of the call, and kept by :func:`tpify.remove_hooks` (it
removes the hooks that compute like the dense model, never these):

* :class:`BatchCheck`: the ranks of the TP group were given the same inputs (shapes at once,
  values at the next call), and what the previous call's data checks found, raised on every
  rank (:class:`tpify.comm.DeferredChecks`: no host sync in a step);
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
from ..context import CallState
from ..info import TPUsageError, get_tp_info
from . import state_dict

__all__ = ["BatchCheck", "flush_checks", "host_group", "refuse_foreign_ddp", "refuse_fused_lm_head", "install"]


class BatchCheck(comm.SharesProcessGroups):
    """Forward pre-hook of a parallelized model: every rank of the TP group got the same inputs,
    and the data checks of the model's previous call passed; no host sync in a steady state.

    Before any collective of the call, one all-reduce (max) over the TP group on the host
    (:func:`host_group`) of four int64 values: a code of this call's names, shapes and dtypes
    (:func:`tpify.comm.layout_code`) and the previous call's device checksum
    (:func:`tpify.comm.checksum`, copied without blocking), each with its negation. Skipped under
    ``torch.compile``; at ``tp_size == 1`` no collective. Why and what it catches: docs/errors.md,
    "BatchCheck".

    Raises:
        ValueError: on every rank alike: at once for other names, shapes or dtypes; at the next call
            for other values, or for the data checks recorded in the previous call.
    """

    def __init__(self, model_name: str, tp_group, state: CallState | None = None):
        self.model_name, self.tp_group = model_name, tp_group
        self.state = state if state is not None else CallState()
        self.host_group = host_group(tp_group)

    def __call__(self, module, args, kwargs):
        self.state.checked.forget()
        if torch.compiler.is_compiling():
            return None
        named = [(f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        named += [(k, v) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
        self._raise_found(named)
        if named and comm.group_size(self.tp_group) > 1:
            layout = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in named)
            self.state.checks.keep("inputs", comm.inputs_checksum(named), layout)  # compared at the next call
            self.state.checked.remember(named)
        return None

    def _raise_found(self, named: list) -> None:
        """Raise, on every rank alike, what the previous call's checks found, then whether this
        call's inputs (``named``) have other names, shapes or dtypes on another rank: one host
        all-reduce at tp > 1 (none when there is nothing to compare)."""
        kept, failed = self.state.checks.collect()  # the previous call's checks, copied to the host then
        what = f"{self.model_name}.forward"
        if comm.group_size(self.tp_group) > 1 and (named or "inputs" in kept):
            previous, previous_layout = kept.get("inputs", (0, ""))
            code = comm.layout_code(named)
            got = comm.all_reduce(torch.tensor([code, -code, previous, -previous], dtype=torch.int64), self.host_group,
                                  op="max").numpy().tolist()
            if got[2] != -got[3]:  # the previous call's, raised first: it happened first
                raise ValueError(comm.different_values_message(what, previous_layout) + " " + comm.FOUND_LATE)
            if failed:
                raise failed[0]
            if got[0] != -got[1]:
                layout = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in named)
                raise ValueError(comm.different_layouts_message(what, layout))
        elif failed:
            raise failed[0]

    def flush(self) -> None:
        """Raise now, on every rank alike, what the model's last call's checks found (else raised
        at its next call). Communication: one all-reduce of 4 values on the host at tp > 1, when
        a call left inputs to compare."""
        self._raise_found([])

    def end(self, *_hook_args) -> None:
        """Forward hook (also when the call raises): the call's checked inputs forgotten, its
        recorded checks copied to the host for the next call."""
        self.state.checked.forget()
        self.state.checks.submit()

    def install(self, model: nn.Module) -> list:
        """Register the check before every other pre-hook, and, after the forward (also when it
        raises), the end of the call (:meth:`end`); return the two handles."""
        return [model.register_forward_pre_hook(self, with_kwargs=True, prepend=True),
                model.register_forward_hook(self.end, always_call=True)]


def flush_checks(model: nn.Module) -> None:
    """:meth:`BatchCheck.flush` of ``model``'s inputs check (a parallelized model, or a wrapper
    around one: PEFT, DDP): raise now, on every rank alike, what its last call's data checks found,
    instead of at its next call; nothing when it has none. Every rank of the TP group calls it."""
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, BatchCheck):
                hook.flush()
                return


def _takes_cpu_tensors(group) -> bool:
    """Whether ``group``'s backend takes CPU tensors (gloo, ``cpu:gloo,cuda:nccl``), not NCCL
    alone (:func:`tpify.comm.backend_map`)."""
    return "cpu" in comm.backend_map(group)


def host_group(group):
    """The group :class:`BatchCheck` all-reduces its host values over: ``group`` itself when its
    backend takes CPU tensors, else (NCCL only) a gloo group of the same ranks, made once here
    (``new_group(..., use_local_synchronization=True)``: only those ranks take part, in the order
    they parallelize). A host all-reduce makes the host wait for the other ranks' hosts, never for
    a device."""
    if comm.group_size(group) == 1 or _takes_cpu_tensors(group):
        return group
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


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
    info = get_tp_info(model)
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
    info = get_tp_info(model)
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
    (``prepend``): the inputs check (at tp = 1 only the previous call's data checks,
    :class:`BatchCheck`), TRL's fused LM head refused (a vocabulary-split
    head), a foreign DDP refused; the state dict's tag and load check (:mod:`tpify.hooks.state_dict`).
    Returns the handles (:attr:`tpify.info.TPInfo.guards`)."""
    handles = state_dict.install(model, info)
    handles += BatchCheck(type(model).__name__, info.tp_group, info.state).install(model)
    if info.tp_size > 1 and info.layout.lm_head is not None:
        handles.append(model.register_forward_pre_hook(refuse_fused_lm_head, with_kwargs=True, prepend=True))
    handles.append(model.register_forward_pre_hook(refuse_foreign_ddp, with_kwargs=True, prepend=True))
    return handles
