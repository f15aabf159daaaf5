"""The resolved context a parallelized model's layers and hooks share, and its per-call state.

:class:`TPContext` is made once per model by :func:`tpify.parallelize`, passed to every parallel
layer and hook at construction and held by the model's :class:`~tpify.info.TPInfo` (``ctx``).
:class:`CallState` is what one forward call decides and several hooks need (tokens split,
logits kept sharded or not computed); the hooks set it and pass it to the layers as forward
arguments (:class:`ModeArgument`), the layers never read it; activation recomputation restores
it (:meth:`CallState.snapshot`).
"""

from __future__ import annotations

import torch.distributed as dist

from . import comm

__all__ = ["CallState", "TPContext", "ModeArgument", "mode_arguments", "OutputWatch", "output_watches"]


class CallState:
    """What the current forward call of one model decided, shared by its hooks.

    Attributes:
        sequence_active: the tokens are split along ``T`` in this call (sequence parallelism with
            ``T`` a multiple of ``tp_size``); False outside a call.
        logits_sharded: the call computes the parallel LM loss (the LM head keeps its output split).
        head_deferred: the call computes the chunked LM loss (``lm_loss_chunk``): the LM head returns
            its input.
        moe_gathered: inside a mixture-of-experts block whose tokens sequence parallelism gathered
            (:mod:`tpify.hooks.sequence_parallel`).
        checks: the model's :class:`~tpify.comm.DeferredChecks` (a call's data checks, raised at the
            next call; kept across calls).
        checked: the model's :class:`~tpify.comm.CheckedInputs`: the inputs this call compares
            across the TP group (the vocab-parallel embedding then defers its bounds check).

    A copy of the model (``copy.deepcopy``, PEFT's copy of a module) shares it: calls run one at a
    time, and every copy of a layer must follow the call that runs it.
    """

    __slots__ = ("sequence_active", "logits_sharded", "head_deferred", "moe_gathered", "checks", "checked")

    def __init__(self):
        self.reset()
        self.checks = comm.DeferredChecks()
        self.checked = comm.CheckedInputs()

    def reset(self) -> None:
        """Outside a call: nothing split, logits gathered."""
        self.sequence_active = False
        self.logits_sharded = False
        self.head_deferred = False
        self.moe_gathered = False

    def snapshot(self) -> tuple[bool, bool, bool, bool]:
        """The state now (for activation recomputation to put back)."""
        return self.sequence_active, self.logits_sharded, self.head_deferred, self.moe_gathered

    def restore(self, snapshot: tuple[bool, bool, bool, bool]) -> None:
        """Go back to a :meth:`snapshot`."""
        self.sequence_active, self.logits_sharded, self.head_deferred, self.moe_gathered = snapshot

    def __deepcopy__(self, memo):
        return self


class TPContext(comm.SharesProcessGroups):
    """The facts every parallel layer and hook of one model shares, resolved once.

    Attributes:
        group, size, rank: the TP process group (``None``: the default group, or no
            torch.distributed), its size and this process's rank in it.
        region_input: the model's :class:`~tpify.layers.ColumnParallelInput` (None: a layer built
            alone gets its own).
        rng: the model's :class:`~tpify.random.RNGStreamTracker` (None: no dropout streams).
        state: the model's :class:`CallState`.
        summed_grads: the model's :class:`~tpify.grad_sums.SummedGrads` (replicated parameters whose
            gradients are summed over the group in one all-reduce per backward), or None.
        replica_groups: ``{n_kv: group}``: for each KV head count ``n_kv < size`` held by groups of
            ranks, this rank's group of ``size / n_kv`` consecutive TP ranks
            (:func:`tpify.mesh.replica_groups`).
        cp_group, cp_size, cp_rank: the context-parallel group (the ranks that split the tokens of
            the same sequences, :mod:`tpify.context_parallel`; ``None`` and size 1 without it).
        cp_attention: how attention runs over the CP group: ``"allgather"``, ``"ring"`` or
            ``"alltoall"`` (:data:`tpify.context_parallel.CP_ATTENTION_MODES`).
        grad_reduce_dtype: the narrowest dtype the input-gradient all-reduces (and reduce-scatters)
            of the column-parallel layers, LoRA's and the chunked loss's run in
            (:func:`tpify.comm.grad_reduce_dtype`); None (default): the dtype of the matmul that
            made the gradient (``bfloat16`` under bf16 autocast, as Megatron-LM); ``torch.float32``:
            float32 or wider (``parallelize(grad_reduce_dtype=...)``).
    """

    def __init__(self, group: dist.ProcessGroup | None, region_input=None, rng=None, state: CallState | None = None,
                 replica_groups: dict | None = None, summed_grads=None, cp_group: dist.ProcessGroup | None = None,
                 grad_reduce_dtype=None, cp_attention: str = "allgather"):
        self.group = group
        self.cp_group = cp_group
        self.cp_attention = cp_attention
        self.cp_size = comm.group_size(cp_group) if cp_group is not None else 1
        self.cp_rank = comm.group_rank(cp_group) if cp_group is not None else 0
        self.grad_reduce_dtype = grad_reduce_dtype
        self.overlap_checked = False  # CUDA_DEVICE_MAX_CONNECTIONS looked at (tpify.layers.check_overlap_environment)
        self.summed_grads = summed_grads
        self.size = comm.group_size(group)
        self.rank = comm.group_rank(group)
        self.region_input = region_input
        self.rng = rng
        self.state = state if state is not None else CallState()
        self.replica_groups = dict(replica_groups or {})

    def replica_group(self, shards: int) -> dist.ProcessGroup | None:
        """The group of ranks holding the same slice of a part replicated as ``shards`` slices
        (grouped-query K/V with ``shards`` KV heads): the TP group itself for ``shards == 1``.

        Raises:
            ValueError: ``shards > 1`` and no such group was made (a layer built alone: pass a
                context from :func:`tpify.parallelize`).
        """
        if shards == 1 or self.size == shards:
            return self.group
        if shards not in self.replica_groups:
            raise ValueError(f"a part replicated as {shards} slices over {self.size} TP ranks needs the groups of "
                             f"{self.size // shards} ranks holding each slice; tpify.parallelize makes them (a layer "
                             f"built alone has none)")
        return self.replica_groups[shards]


class ModeArgument:
    """A forward pre-hook that passes one decision of the model's :class:`CallState` to a parallel
    layer as a forward argument (``scatter_output``, ``runtime_gather_output``): the layer takes
    its mode from its arguments and never reads the state.

    Subclasses name the ``argument`` and say what it is from the state (:meth:`value`; None:
    pass nothing, the layer's default). Shared by copies (``copy.deepcopy`` returns it: a copy of
    the LM head made by PEFT's ``modules_to_save`` follows the model's call as the original
    does); an adapter that wraps a layer takes its mode arguments over (tpify's LoRA layers).
    """

    argument = ""

    def __init__(self, state: CallState):
        self.state = state

    def value(self):
        """The argument's value for this call, or None for the layer's default."""
        raise NotImplementedError

    def __call__(self, module, args, kwargs):
        value = self.value()
        if value is None:
            return None
        kwargs[self.argument] = value
        return args, kwargs

    def __deepcopy__(self, memo):
        return self


def mode_arguments(module) -> list[ModeArgument]:
    """The :class:`ModeArgument` hooks registered on ``module`` (for an adapter that wraps it)."""
    return [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, ModeArgument)]


class OutputWatch:
    """A forward hook that keeps a layer's output for a model-level hook of the same call (the
    parallel LM loss checks that the model's logits are its LM head's output, unchanged). It
    keeps nothing outside the calls that :meth:`wanted` selects, and :meth:`take` hands it over
    once. Shared by copies (``copy.deepcopy`` returns it); an adapter that wraps the layer takes
    it over as it takes the :class:`ModeArgument` hooks (tpify's LoRA layers): the adapter's
    output, the last one kept, is what the model receives.
    """

    def __init__(self, state: CallState):
        self.state = state
        self.output = None

    def wanted(self) -> bool:
        """Whether this call's output is kept (default: calls that compute the parallel LM loss)."""
        return self.state.logits_sharded

    def __call__(self, module, args, output):
        if self.wanted():
            self.output = output
        return None

    def take(self):
        """The output kept in this call (None: the layer did not run), forgotten here."""
        output, self.output = self.output, None
        return output

    def __deepcopy__(self, memo):
        return self


def output_watches(module) -> list[OutputWatch]:
    """The :class:`OutputWatch` hooks registered on ``module`` (for an adapter that wraps it)."""
    return [hook for hook in module._forward_hooks.values() if isinstance(hook, OutputWatch)]
