"""A pipeline stage: the Hugging Face model itself holding only its stage's layers.

:func:`split_model` cuts a (dense or :func:`tpify.parallelize`-d) causal LM into this rank's
stages (:class:`StageModule`). Each stage is the HF model with the decoder ModuleList keeping only
its layers, under their original indices (``model.layers.5.mlp.up_proj`` is the same name on
every layout: recipe rules, checkpoint and DCP keys stay global); the embeddings only on the first
stage, the final norm and the head only on the last (elsewhere what the plan says:
absent, the identity, zero). Every stage runs the HF base model's own ``forward``: later stages
pass the hidden states as ``inputs_embeds``, so rotary embeddings, masks and positions are
computed as the dense forward computes them; the decoder layers' ``forward`` is HF's, unchanged.
GPipe / 1F1B (Huang et al., arXiv:1811.06965; Narayanan et al., arXiv:2104.04473, section 2).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..hf_modules import base_model_and_prefix
from ..info import tp_info_of
from ..layers import ColumnParallelLinear

__all__ = ["StageModule", "Zero", "context_parallel_hooks_of", "stage_config", "build_stage", "n_layers_of", "trim_model", "shell_of"]


class Zero(nn.Module):
    """What a first-stage module that adds a term to the embeddings becomes on the other stages
    (GPT-2's position embedding ``wpe``): returns a 0-dim 0 on its input's device, so
    ``inputs_embeds + wpe(position_ids)`` is ``inputs_embeds`` exactly (a 0-dim tensor does not
    change the dtype of the sum)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros((), device=x.device)


def _elsewhere(kind: str) -> nn.Module | None:
    """What a first- or last-stage module becomes on the other stages (``absent``: removed)."""
    return {"absent": None, "identity": nn.Identity(), "zero": Zero()}[kind]


def shell_of(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s parameters, buffers and children, with dicts of its
    own (replacing a child of the shell leaves ``module`` as it was)."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    return new


def stage_config(config, layer_ids: range, n_layers: int):
    """A copy of ``config`` for a stage holding ``layer_ids`` of ``n_layers`` layers:
    ``num_hidden_layers`` is the stage's count and every per-layer list (``layer_types``,
    ``mlp_layer_types``, ...: a list of ``n_layers`` values) is cut to the stage's layers, so that
    a forward indexing ``config.layer_types[i]`` over ``enumerate(self.layers)`` reads the right
    entry."""
    out = copy.copy(config)
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == n_layers and key != "architectures":
            setattr(out, key, type(value)(value[i] for i in layer_ids))
    out.num_hidden_layers = len(layer_ids)
    return out


class StageModule(nn.Module):
    """One pipeline stage, what ``torch.distributed.pipelining.PipelineStage`` runs.

    ``self.model`` is the HF model holding this stage's layers under their global names (use
    ``stage.model.named_parameters()`` for optimizers, comparisons and checkpoints).

    Shapes:
        input: ``(B, T)`` token ids (int64) on the first stage, else ``(B, T, H)`` hidden states.
        ``position_ids``: ``(B, T / cp)`` int64, the global positions of this rank's tokens, under
            context parallelism only (:func:`tpify.pipeline.step` passes them to every stage); then
            the model's context-parallel hooks run here (:func:`context_parallel_hooks_of`).
        output: ``(B, T, H)`` hidden states, on the last stage the logits ``(B, T, V_padded / tp_size)``,
            this rank's vocabulary shard (``(B, T, V)`` at tp 1), never gathered; with
            ``return_hidden`` (the chunked loss) the head's input ``(B, T, H)`` instead.
    Communication: the tensor-parallel layers' (none at tp 1); under context parallelism one
    all-gather of the positions and the attention's over the CP group, and in backward the
    gradient sums over it; the pipeline's sends are torch's.

    Raises:
        TPUsageError: under context parallelism, the hooks' checks (no ``position_ids``, ...), or
            a count of attention layers through tpify's attention other than the stage's.
    """

    def __init__(self, model: nn.Module, *, stage_index: int, num_stages: int, layer_ids: range,
                 head: str, tied: bool):
        super().__init__()
        self.model = model
        self.stage_index, self.num_stages, self.layer_ids, self.head, self.tied = (stage_index, num_stages,
                                                                                  layer_ids, head, tied)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.return_hidden = False  # the chunked loss (lm_loss_chunk): the last stage returns the head's input

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        base = base_model_and_prefix(self.model)[0]
        kwargs = {"input_ids" if self.is_first else "inputs_embeds": x, "use_cache": False}
        cp = context_parallel_hooks_of(self.model)
        if cp is None:
            hidden = base(**kwargs).last_hidden_state  # (B, T, H)
        else:  # the model's context-parallel hooks, run for this stage's layers (the stage calls the base model)
            kwargs["position_ids"] = position_ids  # (b, T / cp): the global positions of this rank's tokens
            _, kwargs = cp.pre_hook(self.model, (), kwargs)  # checks, one all-gather of the positions
            call, cp.call = cp.call, None
            hidden = base(**kwargs).last_hidden_state  # (B, T / cp, H)
            # the stage's attention layers all through tpify's; its parameters' gradients summed over the CP group
            cp.finish(self.model, call, len(self.layer_ids), f"{type(self.model).__name__} stage {self.stage_index}")
        if not self.is_last or self.return_hidden:
            # a view (GPT-2's final ``view``) copied: the split backward schedules detach the stage's output in
            # place (torch's stage_backward_input), which torch refuses on a view
            return hidden.clone() if hidden._is_view() else hidden
        head = getattr(self.model, self.head)
        if isinstance(head, ColumnParallelLinear):
            return head(hidden, runtime_gather_output=False)  # (B, T, V_padded / tp): kept sharded for the loss
        return head(hidden)  # (B, T, V)

    def extra_repr(self) -> str:
        return (f"stage {self.stage_index} of {self.num_stages}, layers {self.layer_ids.start}.."
                f"{self.layer_ids.stop - 1}{', tied head' if self.tied and self.is_last else ''}")


def context_parallel_hooks_of(model: nn.Module):
    """The :class:`tpify.hooks.context_parallel.ContextParallelHooks` the model was parallelized with
    (its forward pre-hook's owner; a stage's shell shares the model's hook dicts), or None (cp 1)."""
    from ..hooks.context_parallel import ContextParallelHooks

    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, ContextParallelHooks):
            return owner
    return None


def n_layers_of(base: nn.Module, plan) -> int:
    """The dense model's layer count: the config's ``num_hidden_layers`` (a model :func:`trim_model`
    cut holds fewer), else the ModuleList's length."""
    n = getattr(base.config, "num_hidden_layers", None)
    return n if isinstance(n, int) else len(getattr(base, plan.layers))


def trim_model(model: nn.Module, plan, layer_ids: set[int], first: bool, last: bool) -> None:
    """Remove from ``model``, in place, what a rank holding ``layer_ids`` (and the first / last
    stage or not) does not hold: the other layers (the ModuleList keeps the global indices as
    keys), the first / last stage's modules as the plan says, the head. ``from_pretrained`` then
    reads only the tensors left. Local."""
    base = base_model_and_prefix(model)[0]
    layers = getattr(base, plan.layers)
    layers._modules = {k: v for k, v in layers._modules.items() if int(k) in layer_ids}
    for names, here in ((plan.first, first), (plan.last, last)):
        for name, elsewhere in ({} if here else names).items():
            setattr(base, name, _elsewhere(elsewhere))
    if not last:
        setattr(model, plan.head, None)


def build_stage(model: nn.Module, plan, layer_ids: range, stage_index: int, num_stages: int,
                tied: bool) -> StageModule:
    """The :class:`StageModule` of ``stage_index`` cut from ``model`` (which stays as it was: the
    stage is a shell sharing its parameters). Local; no communication."""
    base, prefix = base_model_and_prefix(model)
    top, stage_base = shell_of(model), shell_of(base)
    setattr(top, prefix, stage_base)
    dense_layers = getattr(base, plan.layers)
    layers = nn.ModuleList()
    layers._modules = {str(i): dense_layers._modules[str(i)] for i in layer_ids}  # the global indices as keys
    setattr(stage_base, plan.layers, layers)
    first, last = stage_index == 0, stage_index == num_stages - 1
    for names, here in ((plan.first, first), (plan.last, last)):
        for name, elsewhere in ({} if here else names).items():
            setattr(stage_base, name, _elsewhere(elsewhere))
    if not last:
        setattr(top, plan.head, None)
    config = stage_config(base.config, layer_ids, n_layers_of(base, plan))
    stage_base.config = config
    info = tp_info_of(model)
    if info is not None:
        top.tp_info = info
    return StageModule(top, stage_index=stage_index, num_stages=num_stages, layer_ids=layer_ids,
                       head=plan.head, tied=tied)
