"""Surgery: swap a model's modules for their parallel layers, as a layout says.

Data flows ``recipe -> layout -> surgery``: :func:`tpify.layout.build_layout` decides everything
(pure, no collective); :func:`apply_layout` swaps each ``nn.Linear``/``Conv1D``/``nn.Embedding``
for its parallel counterpart (Megatron-LM, arXiv:1909.08053, section 3), divides per-rank
attributes and config values, keeps tied parameters tied, and installs the dropout-stream hooks.
It never replaces a Hugging Face ``forward`` method.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .layers import (ColumnParallelEmbedding, ColumnParallelInput, ColumnParallelLinear, RowParallelLinear,
                     VocabParallelEmbedding)
from .layout import Layout, ModuleLayout, PlanError
from .random import DEFAULT, TP, RNGStreamTracker, _devices_of, install_rng_hooks

__all__ = ["apply_layout", "ReplicatedInRegion", "HeadInputs", "SequenceParallel", "BatchCheck"]


def _build_layer(module: nn.Module, entry: ModuleLayout, tp_group: dist.ProcessGroup | None) -> nn.Module:
    if entry.style == "embedding_rowwise":
        scale = getattr(module, entry.scale_attr) if entry.scale_attr else None
        return VocabParallelEmbedding.from_dense(module, tp_group, padded_num_embeddings=entry.padded_size,
                                                 output_scale=scale)
    if entry.style == "embedding_colwise":
        return ColumnParallelEmbedding.from_dense(module, tp_group)
    if entry.style == "rowwise":
        return RowParallelLinear.from_dense(module, tp_group, input_is_parallel=True)
    return ColumnParallelLinear.from_dense(
        module, tp_group, gather_output=entry.style == "colwise_rep", partition_sizes=entry.partition_sizes,
        padded_out_features=entry.padded_size, replicated_parts=entry.replicated_parts)


def apply_layout(model: nn.Module, layout: Layout,
                 tp_group: dist.ProcessGroup | None) -> tuple[RNGStreamTracker, list]:
    """Swap the modules of ``model`` in place for their parallel layers; no collectives.

    Each new layer holds only this rank's shard (the dense module is dropped and freed); the
    attributes the layout divides (head counts) and its ``config_divides`` are divided by
    ``tp_size``; parameters that were the same object before (tied embeddings,
    ``BertLMPredictionHead.bias``) are the same object after. Works on the meta device too.
    Installs the dropout-stream hooks (:func:`tpify.random.install_rng_hooks`). The
    column-parallel layers share one :class:`~tpify.layers.ColumnParallelInput` (layers reading
    the same activation all-reduce its gradient once), cleared by a forward hook on ``model``.

    Returns:
        ``(tracker, handles)``: the model's dropout-stream tracker and every hook handle added.
    Raises:
        PlanError: ``tp_group``'s size differs from the layout's ``tp_size``, or two tied
            parameters were given styles that shard them differently.
    """
    group_size = comm.group_size(tp_group)
    if group_size != layout.tp_size:
        raise PlanError(f"the layout is for tp_size = {layout.tp_size} but tp_group has {group_size} ranks")
    for rule in layout.unmatched_rules:
        warnings.warn(f"tpify: {rule.describe()} of recipe {layout.recipe.source} matched no module of "
                      f"{type(model).__name__}", stacklevel=3)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    region_input = ColumnParallelInput()  # one input-gradient all-reduce per activation the layers share
    for fqn, entry in layout.modules.items():
        if entry.style == "replicate":
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, child)
        layer = _build_layer(dense, entry, tp_group)
        if isinstance(layer, ColumnParallelLinear):
            layer.region_input = region_input
        for name, new in list(layer.named_parameters(recurse=False)):
            old = getattr(dense, name)
            tied = replaced.get(id(old), (None, None))[1]
            if tied is not None:
                if tied.shape != new.shape:
                    raise PlanError(f"{fqn}.{name} is tied to a parameter sharded to shape {tuple(tied.shape)}, "
                                    f"but its own style gives {tuple(new.shape)}")
                setattr(layer, name, tied)
            else:
                replaced[id(old)] = (old, new)
        setattr(parent, child, layer)
    # Re-point every other holder of a replaced parameter (tied weights held by plain modules).
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            old, new = replaced.get(id(param), (None, None))
            if old is param:
                module._parameters[name] = new
    for fqn, attrs in layout.divides.items():
        module = model.get_submodule(fqn)
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // layout.tp_size)
    config = getattr(model, "config", None)
    for name, dense in layout.config_divides.items():  # HF code reading them at forward time sees per-rank values
        setattr(config, name, dense // layout.tp_size)
    handles = [model.register_forward_hook(region_input.clear)]
    for fqn, inputs in layout.head_inputs.items():
        module = model.get_submodule(fqn)
        hook = HeadInputs(fqn, module, inputs, tp_group)
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    # Dropout: TP-distinct random stream between column- and row-parallel layers (tpify.random).
    tracker, rng_handles = install_rng_hooks(model, layout, comm.group_rank(tp_group))
    handles += rng_handles
    sequence = None
    if layout.sequence_parallel is not None and layout.tp_size > 1:
        sequence = SequenceParallel(tracker, tp_group, layout.tp_size)
        handles += sequence.install(model, layout.sequence_parallel)
    if layout.tp_size > 1:
        watcher = ReplicatedInRegion(tracker, tp_group, handles, sequence)
        parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnParallelEmbedding)
        for fqn, module in model.named_modules():
            if not isinstance(module, parallel) and any(True for _ in module.parameters(recurse=False)):
                watcher.names[id(module)] = fqn
                handles.append(module.register_forward_pre_hook(watcher))
    return tracker, handles


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

    Installed with ``prepend=True`` by :func:`tpify.api.finish` as a guard (kept by
    :func:`tpify.remove_hooks`). Cost per forward (``generate``: per token): one small
    all-reduce and one pass over the inputs.
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


class ReplicatedInRegion(comm.SharesProcessGroups):
    """Gradient all-reduce for replicated parameters used inside a sharded region, found by construction.

    Between a column-parallel layer's output and the next row-parallel layer's input each rank
    holds only its heads (or its slice of the MLP). A replicated module that runs there (phi's
    ``q_layernorm``/``k_layernorm`` with ``qk_layernorm=True``, normalising each head) sees only
    the local heads, so each rank's gradient of its parameters is a partial sum; the true
    gradient is their sum over the TP group (Megatron all-reduces such gradients, as it does the
    LayerNorm weights of sequence parallelism). This forward pre-hook, on every module that holds
    parameters and is not a parallel layer, asks the model's dropout-stream tracker whether the
    call is inside a region (the region hooks keep ``tracker.in_region``, in train and eval
    mode), or whether the tokens are split (sequence parallelism: a LayerNorm there sees ``T/p``
    tokens, so its gradient is a partial sum as well); the first time it is, each of the
    module's parameters gets a gradient hook that all-reduces (sums) its gradient over the TP
    group. ``found`` lists those modules' FQNs.

    Communication: backward, one all-reduce per such parameter (none for a model without them).
    """

    def __init__(self, tracker, tp_group, handles: list, sequence: "SequenceParallel | None" = None):
        self.tracker, self.tp_group, self.handles, self.sequence = tracker, tp_group, handles, sequence
        self.names: dict[int, str] = {}
        self.found: list[str] = []
        self._done: set[int] = set()

    def _reduce(self, grad):
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), self.tp_group)

    def __call__(self, module, args):
        in_sequence = self.sequence is not None and self.sequence.active
        if not (self.tracker.in_region or in_sequence) or id(module) in self._done:
            return None
        self._done.add(id(module))
        self.found.append(self.names.get(id(module), type(module).__name__))
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                self.handles.append(param.register_hook(self._reduce))
        return None


class HeadInputs(comm.SharesProcessGroups):
    """Forward pre-hook giving a module this rank's heads of the per-head tensors it is passed.

    Some base models build a tensor for all attention heads and pass it to every layer: ALiBi
    biases (bloom's ``alibi`` of shape ``(B * n_head, 1, T)``, falcon's ``(B, n_head, 1, T)`` and
    its attention mask with the ALiBi folded in, ``(B, n_head, T, T)``). The attention module on
    rank ``r`` computes heads ``[r*n/p, (r+1)*n/p)`` only (its q/k/v are column-parallel), so it
    must get those heads' slice. For each ``(argument, dim, n_heads)`` of the recipe's
    ``head_inputs``, the argument's dimension ``dim`` is either 1 (broadcast over heads: left
    alone) or a multiple ``m * n_heads`` of the dense head count with the heads fastest (``m`` =
    1: heads; ``m`` = B: batch-major ``B * n_heads``); the hook keeps this rank's heads of it.

    The slice is :func:`tpify.comm.scatter_to_tp_region` along the heads (no communication
    forward; when the argument requires grad, its gradient is all-gathered in backward, so a
    learned per-head tensor upstream gets every head's gradient).

    Raises:
        ValueError: (forward) the dimension is neither 1 nor a multiple of the head count, or the
            call does not pass the argument at all (a misspelt name in the recipe); the message
            names the module, the argument and the shapes. Every rank holds the same shapes and
            arguments, so every rank raises.
    """

    def __init__(self, fqn: str, module: nn.Module, inputs: tuple[tuple[str, int, int], ...], tp_group):
        self.fqn, self.inputs, self.tp_group = fqn, inputs, tp_group
        self.names = [n for n in inspect.signature(type(module).forward).parameters][1:]  # drop self

    def _slice(self, arg: str, t: torch.Tensor, dim: int, heads: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            return t
        dim = dim % t.dim()
        size = t.shape[dim]
        if size == 1:
            return t
        if size % heads:
            raise ValueError(f"tpify: {self.fqn} gets argument {arg!r} of shape {tuple(t.shape)}; the recipe's "
                             f"head_inputs says dimension {dim} holds {heads} heads (fastest), but {size} is neither 1 "
                             f"nor a multiple of {heads}: fix head_inputs (dim, heads) in the recipe")
        split = t.unflatten(dim, (size // heads, heads)).movedim(dim + 1, -1)
        local = comm.scatter_to_tp_region(split, self.tp_group)
        return local.movedim(-1, dim + 1).flatten(dim, dim + 1)

    def __call__(self, module, args, kwargs):
        args = list(args)
        for arg, dim, heads in self.inputs:
            if arg in kwargs:
                kwargs[arg] = self._slice(arg, kwargs[arg], dim, heads)
            elif arg in self.names and self.names.index(arg) < len(args):
                i = self.names.index(arg)
                args[i] = self._slice(arg, args[i], dim, heads)
            else:  # a misspelt name (the forward takes **kwargs) would leave every head on every rank
                raise ValueError(f"tpify: {self.fqn} ({type(module).__name__}) was called without argument {arg!r}, "
                                 f"which the recipe's head_inputs slices per rank; fix the argument name in the "
                                 f"recipe (the call passed {sorted(kwargs)} and {len(args)} positional arguments)")
        return tuple(args), kwargs


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, str | int]:
    """The hidden states a layer is called with: the ``hidden_states`` keyword, else the first
    positional argument; and where it was."""
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], "hidden_states"
    if args:
        return args[0], 0
    raise ValueError(f"tpify sequence parallelism: a call without hidden states (kwargs {sorted(kwargs)})")


def _replace(args: tuple, kwargs: dict, where, value):
    if where == "hidden_states":
        kwargs["hidden_states"] = value
        return args, kwargs
    return (value,) + tuple(args[1:]), kwargs


class SequenceParallel(comm.SharesProcessGroups):
    """Sequence parallelism (Korthikanti et al., arXiv:2205.05198, section 4.2.2) by hooks.

    Outside attention and MLP, every transformer layer's work (LayerNorms, dropout, residual
    adds) is the same on every rank of the TP group: sequence parallelism splits it along the
    tokens. With the recipe's ``[sequence_parallel]`` table:

    * ``split``: a forward pre-hook splits the first layer's hidden states ``(B, T, H)`` into
      this rank's tokens ``(B, T/p, H)`` (:func:`tpify.comm.scatter_to_sequence_region`); the
      residual stream stays split from there on.
    * ``gather``: a forward pre-hook on each attention and MLP module all-gathers its input
      along ``T`` (Megatron's ``g``); its backward reduce-scatters the partial input gradients,
      replacing the column-parallel layers' all-reduce (they issue none while it is active).
      The gather is a region entry of the layers' :class:`~tpify.layers.ColumnParallelInput`:
      the layers reading the gathered tensor add up their input gradients, and the last of them
      starts the one reduce-scatter asynchronously and computes its weight gradient while it
      runs (Megatron's overlap under sequence parallelism); under ``torch.compile`` the plain
      :func:`tpify.comm.gather_from_sequence_region`.
      Each row-parallel layer reduce-scatters its output along ``T`` instead of all-reducing
      it (same bytes as the all-reduce it replaces: an all-reduce is a reduce-scatter plus an
      all-gather) and sums its bias gradient.
    * ``exit``: a forward hook all-gathers the output of the last module of the split stretch
      (the final norm), so the heads and ``last_hidden_state`` see every token.

    LayerNorm weights in the split stretch see ``T/p`` tokens: their gradients are summed over
    the group (:class:`ReplicatedInRegion`). Dropout there draws from the per-rank stream (each
    rank holds other tokens). Activation memory of the split stretch is ``1/p`` per rank.

    ``active`` is decided per forward at ``split``: ``T`` divisible by ``tp_size``. Otherwise
    (``generate`` decoding one token at a time) the forward runs without sequence parallelism,
    exactly as tensor parallelism alone, which is allowed only without gradients: a backward
    through such a forward would meet the LayerNorm gradient all-reduce meant for split tokens.

    Raises:
        ValueError: (forward) ``T`` not divisible by ``tp_size`` while gradients are enabled.
    """

    def __init__(self, tracker, tp_group, tp_size: int):
        self.tracker, self.tp_group, self.tp_size = tracker, tp_group, tp_size
        self.active = False
        self.region_input = None  # the column-parallel layers' ColumnParallelInput (install)

    def install(self, model: nn.Module, where: dict) -> list:
        handles = [model.register_forward_pre_hook(self._reset), model.register_forward_hook(self._reset)]
        handles.append(model.get_submodule(where["split"]).register_forward_pre_hook(self._split, with_kwargs=True))
        for fqn in where["gather"]:
            container = model.get_submodule(fqn)
            handles.append(container.register_forward_pre_hook(self._gather, with_kwargs=True))
            for module in container.modules():
                if isinstance(module, ColumnParallelLinear):
                    self.region_input = module.region_input  # the model's one ColumnParallelInput
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.sequence_parallel = self
                    if isinstance(module, RowParallelLinear):  # its output is split again: the per-rank stream
                        handles.append(module.register_forward_hook(self._after_row))
        handles.append(model.get_submodule(where["exit"]).register_forward_hook(self._exit))
        return handles

    def _reset(self, module, *args):
        self.active = False

    def _split(self, module, args, kwargs):
        hidden, where = _hidden(args, kwargs)
        tokens = hidden.shape[1]
        self.active = tokens % self.tp_size == 0
        if not self.active:
            if torch.is_grad_enabled():
                raise ValueError(f"tpify sequence parallelism: the sequence length {tokens} is not divisible by "
                                 f"tp_size = {self.tp_size}; pad the batch to a multiple of {self.tp_size} tokens "
                                 f"(without gradients, e.g. generate(), it runs without sequence parallelism)")
            return None
        if module.training:
            self.tracker.switch(TP, _devices_of(module))
        return _replace(args, kwargs, where, comm.scatter_to_sequence_region(hidden, self.tp_group))

    def _gather(self, module, args, kwargs):
        if not self.active:
            return None
        hidden, where = _hidden(args, kwargs)
        if self.region_input is None or torch.compiler.is_compiling():
            # the plain g (under torch.compile the compiler schedules the collectives itself)
            return _replace(args, kwargs, where, comm.gather_from_sequence_region(hidden, self.tp_group, True))
        # a region entry the column-parallel layers inside share: one reduce-scatter of their summed
        # input gradients, overlapped with the last one's weight gradient
        return _replace(args, kwargs, where, self.region_input.gather(hidden, self.tp_group))

    def _after_row(self, module, args, output):
        if self.active and module.training:
            self.tracker.switch(TP, _devices_of(module))

    def _exit(self, module, args, output):
        if not self.active:
            return None
        self.active = False
        self.tracker.switch(DEFAULT, _devices_of(module))
        if isinstance(output, torch.Tensor):
            return comm.gather_from_sequence_region(output, self.tp_group, False)
        first = comm.gather_from_sequence_region(output[0], self.tp_group, False)
        return (first,) + tuple(output[1:])
