"""The parallel LM-head loss: ``model(..., labels=labels).loss`` from the vocabulary shards.

A parallelized causal or masked LM computes its ``labels=`` loss with
:func:`tpify.loss.vocab_parallel_cross_entropy`, with Hugging Face's label semantics, without
replacing any HF ``forward``: a forward pre-hook on the model takes ``labels`` out of the call (so
HF computes no loss) and records in the model's :class:`~tpify.context.CallState` that the logits
stay split; a forward pre-hook on the LM head (:class:`KeepLogitsSharded`, shared by every copy of
the head) passes that to it as ``runtime_gather_output=False``; a forward hook on the model
computes the loss from the shards. Megatron-LM, arXiv:1909.08053, section 3 ("output embedding").
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..context import CallState, ModeArgument
from ..info import TPUsageError
from ..loss import mean_or_nan, vocab_parallel_cross_entropy

__all__ = ["ParallelLMLoss", "KeepLogitsSharded", "install"]


class KeepLogitsSharded(ModeArgument):
    """Forward pre-hook of the LM head: ``runtime_gather_output=False`` while the model's call
    computes the parallel loss (:attr:`CallState.logits_sharded`), nothing otherwise."""

    argument = "runtime_gather_output"

    def value(self):
        return False if self.state.logits_sharded else None


def _labels_from_call(model: nn.Module, args: tuple, kwargs: dict):
    """Pop ``labels`` from a forward call (keyword, or positional by HF's signature)."""
    if "labels" in kwargs:
        return args, kwargs, kwargs.pop("labels")
    params = list(inspect.signature(type(model).forward).parameters)[1:]  # drop self
    if "labels" in params and params.index("labels") < len(args):
        i = params.index("labels")
        labels = args[i]
        return args[:i] + (None,) + args[i + 1:], kwargs, labels
    return args, kwargs, None


class ParallelLMLoss:
    """The pre-hook/hook pair on the model that computes ``output.loss`` from the vocab-sharded
    logits (see :func:`install`). Shared by copies of the model (``copy.deepcopy`` returns it):
    it holds only the head's sizes and group and the call in flight."""

    def __init__(self, head: nn.Module, kind: str | None, honours_num_items: bool, terms=(),
                 state: CallState | None = None):
        self.head = head
        self.kind = kind
        self.honours_num_items = honours_num_items
        self.terms = tuple(terms)
        self.state = state if state is not None else CallState()
        self.pending: dict | None = None

    def __deepcopy__(self, memo):
        return self

    def _add_terms(self, model: nn.Module, output, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the terms HF adds to its LM loss (``[loss] terms``: a mixture of experts'
        ``router_aux_loss_coef * aux_loss`` when ``output_router_logits`` is on), as HF adds them.

        Raises:
            TPUsageError: the output holds another loss term (a field named ``*loss`` with a value)
                that the recipe does not declare: HF would have added it to ``labels=``'s loss, and
                the vocab-parallel loss, which replaces HF's, would silently drop it.
        """
        declared = {name for name, _ in self.terms}
        fields = output.keys() if hasattr(output, "keys") else ()
        undeclared = [k for k in fields if k.endswith("loss") and k != "loss" and k not in declared
                      and output[k] is not None]
        if undeclared:
            raise TPUsageError(
                f"{type(model).__name__}'s output holds {undeclared}, loss terms HF adds to its labels= loss; tpify "
                f"computes that loss from the vocabulary shards instead of HF and would drop them. Declare each in the "
                f"recipe's [loss] table: terms = [{{ output = \"{undeclared[0]}\", coefficient = \"<the config "
                f"attribute HF multiplies it by>\" }}] (docs/recipes.md), or run without them")
        for name, coefficient in self.terms:
            value = output.get(name) if hasattr(output, "get") else None
            if value is None:  # HF adds it only when computed (MoE: output_router_logits)
                continue
            scale = getattr(model.config, coefficient) if isinstance(coefficient, str) else coefficient
            loss = loss + scale * value.to(loss.device)
        return loss

    def pre_hook(self, model, args, kwargs):
        # Every call decides afresh, so a call that raised cannot leave the logits sharded.
        self.state.logits_sharded = False
        self.pending = None
        if self.kind is None:
            # Not a plain LM loss (GPT2DoubleHeadsModel, BertForPreTraining): leave the call as it
            # is; HF computes its own loss from the gathered, full-vocabulary logits.
            return None
        args, kwargs, labels = _labels_from_call(model, args, kwargs)
        if labels is None:
            return args, kwargs
        if self.kind == "seq2seq":  # the model would build its decoder inputs from the labels it no longer sees
            bound = inspect.signature(type(model).forward).bind_partial(model, *args, **kwargs).arguments
            if bound.get("decoder_input_ids") is None and bound.get("decoder_inputs_embeds") is None:
                kwargs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
        self.pending = {"labels": labels, "num_items_in_batch": kwargs.get("num_items_in_batch"),
                        "shift_labels": kwargs.get("shift_labels"), "ignore_index": kwargs.get("ignore_index", -100)}
        self.state.logits_sharded = True
        return args, kwargs

    def hook(self, model, args, kwargs, output):
        pending, self.pending = self.pending, None
        if pending is None:
            return output
        self.state.logits_sharded = False
        logits = output.logits if hasattr(output, "logits") else output[0]  # (B, T, V_padded/p)
        if logits.shape[-1] != self.head.out_features_per_partition:
            raise ValueError(f"tpify's parallel LM loss expected the logits of {type(model).__name__} split over the "
                             f"vocabulary, {self.head.out_features_per_partition} columns per rank, but they have "
                             f"{logits.shape[-1]}: the logits did not come from the vocab-parallel head (a wrapper "
                             f"that replaces it, or code that gathers them). Nothing was computed")
        if isinstance(output, tuple) and self.terms:
            raise ValueError(f"tpify's parallel LM loss adds the recipe's [loss] terms "
                             f"{[name for name, _ in self.terms]} from the model's output fields; call "
                             f"{type(model).__name__} with return_dict=True")
        labels = pending["labels"].to(logits.device)
        ignore_index = pending["ignore_index"]
        if self.kind == "causal":
            target = pending["shift_labels"]
            if target is None:  # HF ForCausalLMLoss: tokens < n predict n, the last one predicts nothing
                target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            target = target.to(logits.device)
        else:  # "masked" and "seq2seq": each position predicts its own label
            target = labels
        num_items = pending["num_items_in_batch"] if self.honours_num_items else None
        reduction = "mean" if num_items is None else "sum"
        loss = vocab_parallel_cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                                            tp_group=self.head.tp_group, vocab_size=self.head.out_features)
        if num_items is not None:
            loss = mean_or_nan(loss, num_items)
        loss = self._add_terms(model, output, loss)
        if isinstance(output, tuple):
            return (loss,) + output
        values = {k: v for k, v in output.items() if k != "loss"}
        return type(output)(loss=loss, **values)


def install(model: nn.Module, layout, state: CallState) -> list:
    """Make ``model(..., labels=labels).loss`` use :func:`~tpify.loss.vocab_parallel_cross_entropy`.

    Installed by :func:`tpify.parallelize` when the layout has an LM head (``layout.lm_head``, a
    ``colwise_rep`` ``ColumnParallelLinear``) and ``model`` is the top-level HF model. The layout's
    ``loss_kind`` (from the recipe's ``[loss]`` table, or HF's ``loss_type``) says what the loss is.
    With ``labels`` the call runs with the head's output kept sharded, HF computes no loss, and
    the loss is computed from the shards with HF's semantics: ``"causal"`` shifts the labels by
    one (``shift_labels`` honoured), ``"masked"`` does not, ``"seq2seq"`` (T5) does not either and
    builds the decoder inputs from the labels as the model would
    (``prepare_decoder_input_ids_from_labels``) when the call gives none; ``-100`` (or ``ignore_index``) is
    ignored; the mean is over the non-ignored tokens, or the sum divided by
    ``num_items_in_batch`` when the model's own loss honours it (``layout.honours_num_items``).
    The recipe's ``[loss] terms`` are added as HF adds them (a mixture of experts'
    ``router_aux_loss_coef * aux_loss``); an output that holds another loss term raises.
    ``output.logits`` is then this rank's shard ``(B, T, V_padded/tp_size)`` (columns
    ``[r*V_padded/p, (r+1)*V_padded/p)``, padded columns hold 0). Without ``labels`` nothing
    changes: logits are gathered (``generate`` works).

    Communication: with labels, the loss's 2 all-reduces (``B*T`` and ``2*B*T`` values) replace the
    all-gather of ``B*T*V/p`` logits per rank.

    Head classes whose loss kind is None (``GPT2DoubleHeadsModel``, ``BertForPreTraining``: a
    loss that is not a plain LM loss) keep HF's own loss, computed from the gathered logits:
    correct, but not vocab-parallel (one all-gather of ``B*T*V/p`` logits per rank).

    Returns:
        the three hook handles (the model's pre-hook and hook, the head's pre-hook), or ``[]``
        when the layout has no LM head.
    """
    if layout.lm_head is None:
        return []
    head = model.get_submodule(layout.lm_head)
    owner = ParallelLMLoss(head, layout.loss_kind, layout.honours_num_items, layout.loss_terms, state)
    return [model.register_forward_pre_hook(owner.pre_hook, with_kwargs=True),
            model.register_forward_hook(owner.hook, with_kwargs=True, always_call=False),
            head.register_forward_pre_hook(KeepLogitsSharded(state), with_kwargs=True)]
