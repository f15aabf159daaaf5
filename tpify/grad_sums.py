"""Gradients of replicated parameters that each rank computes only in part, summed over the TP
group in one all-reduce per backward pass.

Partial gradients: LayerNorms and row-parallel biases under sequence parallelism
(arXiv:2205.05198, section 4.2.2), per-head norms inside a region, ``replicate_sum_grads``
modules. :class:`SummedGrads` keeps each partial gradient (a tensor hook, before accumulation)
and all-reduces them per bucket once the pass ends, as Megatron-LM's
``_allreduce_layernorm_grads`` does after it; DDP, FSDP2 and ``torch.autograd.grad`` get the
per-parameter sum instead (:attr:`SummedGrads.eager`). The mechanism: docs/mechanics.md,
"tpify/grad_sums.py".
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from . import comm

__all__ = ["SummedGrads", "BUCKET_BYTES"]

BUCKET_BYTES = 32 * 2 ** 20  # the gradients of one all-reduce at most (norms: a few MB for a 70B model)


class SummedGrads(comm.SharesProcessGroups):
    """The replicated parameters of one model whose gradients are summed over ``group``, batched.

    :meth:`watch` adds a parameter (once per parameter object: a wrapper that replaces the
    parameters, FSDP2's ``fully_shard``, gets its new ones watched at their next use). Each
    backward pass then issues one all-reduce per bucket of ``bucket_bytes`` (per dtype and
    device) of the watched parameters that received a gradient in it, at its end, instead of one
    per parameter; :attr:`eager` passes (DDP synchronizing, FSDP2, ``torch.autograd.grad``) one
    per parameter, before accumulation, as before.

    Shapes and dtypes: each gradient as autograd gives it; summed in its own dtype.
    Communication: backward, one all-reduce (sum) over ``group`` per bucket; forward none.
    Errors: none of its own.
    """

    def __init__(self, group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES):
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
        self.eager = False
        self.handed_off = False  # hand_off(): an engine sums these gradients; watch nothing
        self._hooks: dict[int, tuple[weakref.ref, object]] = {}  # id(param) -> (its weakref, the hook's handle)
        self._pending: dict[int, dict[int, list]] = {}  # graph task -> {id(param): [param, partial gradient]}

    # ---- which parameters -----------------------------------------------------------------------

    def watch(self, param: torch.Tensor) -> bool:
        """Sum ``param``'s gradient over the group from now on; True if it was not watched yet
        (False after :meth:`hand_off`)."""
        if not param.requires_grad or self.handed_off:
            return False
        known = self._hooks.get(id(param))
        if known is not None and known[0]() is param:
            return False
        ref = weakref.ref(param)
        self._hooks[id(param)] = (ref, param.register_hook(functools.partial(self._partial_grad, ref)))
        return True

    def watches(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is summed by this object."""
        known = self._hooks.get(id(param))
        return known is not None and known[0]() is param

    def unwatch(self, param: torch.Tensor) -> bool:
        """Stop summing ``param``'s gradient (another :class:`SummedGrads` sums it over a larger
        group: context parallelism's, :mod:`tpify.hooks.context_parallel`); True if it was watched.
        Call it between backward passes (a pass already running keeps what it kept)."""
        if not self.watches(param):
            return False
        self._hooks.pop(id(param))[1].remove()
        return True

    def remove(self) -> None:
        """Remove every gradient hook (:func:`tpify.remove_hooks`); parameters watched later are hooked anew."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def hand_off(self) -> None:
        """An engine sums these gradients over the group from now on (FSDP2 sharding over
        ``dp_shard x cp``: its reduce-scatter adds the CP group's partial gradients,
        :func:`tpify.shard_data_parallel`): remove every gradient hook and watch nothing more.
        Call it between backward passes."""
        self.remove()
        self.handed_off = True

    def __len__(self) -> int:
        return sum(1 for ref, _ in self._hooks.values() if ref() is not None)

    # ---- forward: how this call's backward sums ----------------------------------------------------

    def at_root(self, model, *args) -> None:
        """Forward pre-hook of the root model: :attr:`eager` for this call when an engine reads the
        gradients during the backward pass (DDP synchronizing it, FSDP2)."""
        self.eager = _engine_reads_grads_in_backward(model)

    # ---- backward ----------------------------------------------------------------------------------

    def _partial_grad(self, ref: weakref.ref, grad: torch.Tensor) -> torch.Tensor:
        """Tensor hook of a watched parameter: keep ``grad`` for the pass's one all-reduce and hand
        autograd zeros (or, eagerly, the summed gradient)."""
        param = ref()
        if param is None:
            return grad
        if self.eager or not _accumulates(param):
            return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), self.group)
        task = torch._C._current_graph_task_id()
        pending = self._pending.get(task)
        if pending is None:
            pending = self._pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._flush, task))
        kept = pending.get(id(param))
        if kept is None:
            pending[id(param)] = [param, grad]
        else:  # a parameter used twice in one pass
            kept[1] = kept[1] + grad
        return torch.zeros_like(grad)

    def _flush(self, task: int) -> None:
        """At the end of backward pass ``task``: all-reduce the kept gradients, one bucket at a time,
        and add each sum to its parameter's ``.grad``."""
        pending = self._pending.pop(task, None)
        if not pending:
            return
        for bucket in _buckets(list(pending.values()), self.bucket_bytes):
            grads = [g for _, g in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, self.group)
            offset = 0
            with torch.no_grad():
                for (param, grad), n in zip(bucket, (g.numel() for g in grads)):
                    summed = flat[offset: offset + n].view(grad.shape)
                    offset += n
                    if param.grad is None:  # set to None since the hook ran (autograd left zeros)
                        param.grad = summed.clone()
                    else:
                        param.grad.add_(summed)

    def __deepcopy__(self, memo):
        """A copy (of a copied model) watches nothing yet: its parameters are new objects."""
        new = type(self)(self.group, self.bucket_bytes)
        new.handed_off = self.handed_off
        memo[id(self)] = new
        return new


def _buckets(entries: list, bucket_bytes: int) -> list[list]:
    """``[param, grad]`` entries grouped by (device, dtype), in order, each group cut at ``bucket_bytes``."""
    by_kind: dict[tuple, list[list]] = {}
    for entry in entries:
        grad = entry[1]
        groups = by_kind.setdefault((grad.device, grad.dtype), [[]])
        size = sum(g.numel() * g.element_size() for _, g in groups[-1])
        if groups[-1] and size + grad.numel() * grad.element_size() > bucket_bytes:
            groups.append([])
        groups[-1].append(entry)
    return [bucket for groups in by_kind.values() for bucket in groups]


def _accumulates(param: torch.Tensor) -> bool:
    """Whether the backward pass now running accumulates into ``param.grad`` (not ``torch.autograd.grad``,
    which captures the gradient instead: torch refuses the question there)."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return False


def _engine_reads_grads_in_backward(model) -> bool:
    """A data-parallel engine reads this call's gradients before its backward pass ends: a DDP whose
    forward is running and will synchronize in backward, or FSDP2 (``fully_shard``) on the model or
    one of its modules."""
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = getter() if getter is not None else None
    if ddp is not None and getattr(ddp, "require_backward_grad_sync", True):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
