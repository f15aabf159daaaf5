"""The parallel LM-head loss: ``model(..., labels=labels).loss`` from the vocabulary shards.

Hooks, no HF ``forward`` replaced: the model's pre-hook takes ``labels`` out of the call and
keeps the logits split (:class:`KeepLogitsSharded` on the head: ``runtime_gather_output=False``),
its hook computes :func:`tpify.loss.vocab_parallel_cross_entropy` from the shards with HF's label
semantics (Megatron-LM, arXiv:1909.08053, section 3). With ``lm_loss_chunk`` the head does not
run (:class:`HeadInputForLoss`) and the loss is computed ``c`` tokens at a time. The recipe's
``[loss] logits`` ops are applied as the model would; undeclared ones are refused
(:class:`~tpify.info.TPUsageError`, every rank). More: docs/loss.md.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from ..context import CallState, ModeArgument, OutputWatch
from ..hf_modules import config_get
from ..info import TPUsageError
from ..layers import ColumnParallelLinear
from .. import comm
from ..loss import cross_entropy_deferred, linear_cross_entropy_deferred, mean_or_nan

__all__ = ["ParallelLMLoss", "KeepLogitsSharded", "HeadInputForLoss", "install"]


class KeepLogitsSharded(ModeArgument):
    """Forward pre-hook of the LM head: ``runtime_gather_output=False`` while the model's call
    computes the parallel loss (:attr:`CallState.logits_sharded`), nothing otherwise."""

    argument = "runtime_gather_output"

    def value(self):
        return False if self.state.logits_sharded else None


class HeadInputForLoss(ModeArgument):
    """Forward pre-hook of the LM head with ``lm_loss_chunk``: while the model's call computes the
    chunked loss (:attr:`CallState.head_deferred`) it passes ``return_input=True`` (the head
    returns its input and computes nothing) and keeps the head that ran and its input for the
    loss hook (:meth:`take`); nothing otherwise. Shared by copies of the head (PEFT's
    ``modules_to_save``: the copy's weight is the one used).

    Raises:
        TPUsageError: the head is wrapped by an adapter (LoRA on the LM head): the chunked loss
            reads the head's weight shard, which would leave the adapter out.
    """

    argument = "return_input"

    def __init__(self, state: CallState):
        super().__init__(state)
        self.kept = None

    def value(self):
        return True if self.state.head_deferred else None

    def __call__(self, module, args, kwargs):
        if not self.state.head_deferred:
            return None
        if not isinstance(module, ColumnParallelLinear):
            raise TPUsageError(f"lm_loss_chunk: the LM head is wrapped by {type(module).__name__} (an adapter on the "
                               f"head); the chunked loss computes the logits from the head's own weight shard and "
                               f"would leave the adapter out. Leave the LM head out of the adapter's target modules, "
                               f"or parallelize without lm_loss_chunk")
        self.kept = (module, args[0] if args else kwargs["x"])
        return super().__call__(module, args, kwargs)

    def take(self):
        """``(head, input)`` of this call's head (None: the head did not run), forgotten here."""
        kept, self.kept = self.kept, None
        return kept


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


def _apply_logit_ops(x: torch.Tensor, ops) -> torch.Tensor:
    """``ops`` applied to ``x`` as HF applies them (``logits / cap``, ``tanh``, ``* cap``), out of place."""
    for op, value in ops:
        if op == "multiply":
            x = x * value
        elif op == "divide":
            x = x / value
        else:
            x = torch.tanh(x / value) * value
    return x


class ParallelLMLoss:
    """The pre-hook/hook pair on the model that computes ``output.loss`` from the vocab-sharded
    logits, or with ``chunk`` from the head's input (see :func:`install`). Shared by copies of the
    model (``copy.deepcopy`` returns it): it holds only the head's sizes and group and the call
    in flight."""

    def __init__(self, head: nn.Module, kind: str | None, honours_num_items: bool, terms=(),
                 state: CallState | None = None, logit_ops=(), chunk: int | None = None, cp_group=None):
        self.head = head
        self.cp_group = cp_group  # context parallelism: the ranks holding the other tokens of the sequences
        self.kind = kind
        self.honours_num_items = honours_num_items
        self.terms = tuple(terms)
        self.logit_ops = tuple(logit_ops)
        self.chunk = chunk
        self.state = state if state is not None else CallState()
        self.pending: dict | None = None
        self.ops_seen = False  # the declared logit ops were found equal to what the model did, once (chunked loss)
        # what the model did with its head (the head's output; or its input, with chunk)
        self.watch = OutputWatch(self.state) if chunk is None and not self.logit_ops else None
        self.head_input = HeadInputForLoss(self.state) if chunk is not None else None

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
        if self.cp_group is not None and any(output.get(name) is not None for name, _ in self.terms
                                             if hasattr(output, "get")):
            raise TPUsageError(f"{type(model).__name__} under context parallelism: the loss terms "
                               f"{[name for name, _ in self.terms]} are computed over this rank's tokens only; run "
                               f"without them (output_router_logits=False) or with cp_size=1")
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
            scale = config_get(model.config, coefficient) if isinstance(coefficient, str) else coefficient
            loss = loss + scale * value.to(loss.device)
        return loss

    def _ops(self, model: nn.Module) -> tuple[tuple[str, float], ...]:
        """The declared logit ops with this call's values (a config attribute read now; None: off)."""
        ops = []
        for op, value in self.logit_ops:
            value = config_get(model.config, value) if isinstance(value, str) else value
            if value is not None:
                ops.append((op, float(value)))
        return tuple(ops)

    def _undeclared(self, model: nn.Module, ops) -> TPUsageError:
        return TPUsageError(
            f"{type(model).__name__} returns logits that are not its LM head's output, by what its recipe does not "
            f"declare (declared: {list(self.logit_ops) or 'nothing'}; in effect: {list(ops) or 'nothing'}): the "
            f"vocab-parallel loss would not be the loss HF computes. Declare what the model does to the head's "
            f"output in the recipe's [loss] table, in order: logits = [{{ softcap = \"final_logit_softcapping\" }}] "
            f"(or multiply / divide = the config attribute it reads; docs/recipes.md), or run without labels= and "
            f"compute the loss from the gathered logits. Nothing was computed")

    def pre_hook(self, model, args, kwargs):
        # Every call decides afresh, so a call that raised cannot leave the logits sharded.
        self.state.logits_sharded = self.state.head_deferred = False
        self.pending = None
        if self.watch is not None:
            self.watch.take()
        if self.head_input is not None:
            self.head_input.take()
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
        self.state.head_deferred = self.chunk is not None
        return args, kwargs

    def _target(self, pending: dict, device) -> torch.Tensor:
        """The target of every position, with HF's semantics: causal LMs shift the labels by one
        (``shift_labels`` honoured), masked and seq2seq ones do not."""
        labels = pending["labels"].to(device)
        if self.kind != "causal":
            return labels
        target = pending["shift_labels"]
        if target is None:  # HF ForCausalLMLoss: tokens < n predict n, the last one predicts nothing
            target = F.pad(labels, (0, 1), value=pending["ignore_index"])[..., 1:]
        return target.to(device)

    def _sharded_logits_loss(self, model, logits, pending, reduction):
        """The loss from the vocab-sharded logits the model returned (HF's post-processing, which
        the recipe declares, applied by the model itself on the shard)."""
        if logits.shape[-1] != self.head.out_features_per_partition:
            raise ValueError(f"tpify's parallel LM loss expected the logits of {type(model).__name__} split over the "
                             f"vocabulary, {self.head.out_features_per_partition} columns per rank, but they have "
                             f"{logits.shape[-1]}: the logits did not come from the vocab-parallel head (a wrapper "
                             f"that replaces it, or code that gathers them). Nothing was computed")
        if self.watch is not None and self.watch.take() is not logits:
            raise self._undeclared(model, ())
        return cross_entropy_deferred(logits, self._target(pending, logits.device), ignore_index=pending["ignore_index"],
                                      label_smoothing=0.0, reduction=reduction, tp_group=self.head.tp_group,
                                      vocab_size=self.head.out_features, defer=self.state.checks)

    def _chunked_loss(self, model, returned, pending, reduction):
        """The loss from the head's input and weight shard, in chunks, with the declared logit ops
        (checked against what the model did to the input the head returned)."""
        kept = self.head_input.take()
        if kept is None:
            raise TPUsageError(f"lm_loss_chunk: {type(model).__name__}'s LM head did not run in this call, so there "
                               f"are no hidden states to compute the chunked loss from. Nothing was computed")
        head, hidden = kept
        ops = self._ops(model)
        if returned is not hidden:
            # HF applied something to what the head returned; on the hidden states it must be the
            # declared ops, exactly (a few element-wise ops on (B, T, H) values): compared at once on
            # the first such call (a host sync), on the device afterwards (raised at the next call)
            if not ops or returned.shape != hidden.shape:
                raise self._undeclared(model, ops)
            if not torch.compiler.is_compiling():
                same = (_apply_logit_ops(hidden.detach(), ops) == returned.detach()).all()
                error = self._undeclared(model, ops)
                if self.ops_seen:
                    comm.raise_unless(same, TPUsageError, str(error), defer=self.state.checks)
                elif not bool(same):
                    raise error
                self.ops_seen = True
        elif ops:
            raise self._undeclared(model, ops)
        weight = head.weight if head.weight_layout == "linear" else head.weight.t()
        return linear_cross_entropy_deferred(
            hidden, weight, self._target(pending, hidden.device), bias=head.bias, ignore_index=pending["ignore_index"],
            label_smoothing=0.0, reduction=reduction, tp_group=head.tp_group, vocab_size=head.out_features,
            chunk_size=None if self.chunk == "auto" else self.chunk, softcap=None, logit_ops=ops,
            defer=self.state.checks, grad_reduce_dtype=head.ctx.grad_reduce_dtype)

    def _over_context_parallel(self, total: torch.Tensor, pending: dict, device, num_items) -> torch.Tensor:
        """The dense model's loss from this rank's sum over its tokens under context parallelism:
        the sums (and, without ``num_items_in_batch``, the counts of targets not ignored) added over
        the CP group in one all-reduce of 2 values, whose backward is the identity
        (:func:`tpify.comm.reduce_from_tp_region` over the CP group): every rank's ``loss`` is the
        dense one, and its backward gives the gradient of its own tokens' terms, which the CP
        gradient sum (:mod:`tpify.hooks.context_parallel`) adds up."""
        if num_items is not None:
            return mean_or_nan(comm.reduce_from_tp_region(total, self.cp_group), num_items)
        count = (self._target(pending, device) != pending["ignore_index"]).sum()
        packed = comm.reduce_from_tp_region(torch.stack([total, count.to(total.dtype)]), self.cp_group)
        return mean_or_nan(packed[0], packed[1].detach())

    def hook(self, model, args, kwargs, output):
        pending, self.pending = self.pending, None
        if pending is None:
            return output
        chunked = self.state.head_deferred
        self.state.logits_sharded = self.state.head_deferred = False
        returned = output.logits if hasattr(output, "logits") else output[0]  # (B, T, V_padded/p); chunked: (B, T, H)
        if isinstance(output, tuple) and self.terms:
            raise ValueError(f"tpify's parallel LM loss adds the recipe's [loss] terms "
                             f"{[name for name, _ in self.terms]} from the model's output fields; call "
                             f"{type(model).__name__} with return_dict=True")
        num_items = pending["num_items_in_batch"] if self.honours_num_items else None
        reduction = "mean" if num_items is None and self.cp_group is None else "sum"
        if chunked:
            loss = self._chunked_loss(model, returned, pending, reduction)
        else:
            loss = self._sharded_logits_loss(model, returned, pending, reduction)
        if self.cp_group is not None:
            loss = self._over_context_parallel(loss, pending, returned.device, num_items)
        elif num_items is not None:
            loss = mean_or_nan(loss, num_items)
        loss = self._add_terms(model, output, loss)
        if isinstance(output, tuple):
            return (loss, None) + output[1:] if chunked else (loss,) + output
        values = {k: v for k, v in output.items() if k != "loss" and not (chunked and k == "logits")}
        return type(output)(loss=loss, **values)


def install(model: nn.Module, layout, ctx) -> list:
    """Make ``model(..., labels=labels).loss`` use :func:`~tpify.loss.vocab_parallel_cross_entropy`
    (or, with ``layout.lm_loss_chunk``, :func:`~tpify.loss.vocab_parallel_linear_cross_entropy`).

    Installed by :func:`tpify.parallelize` when the layout has an LM head. With ``labels`` the loss
    is computed from the head's shards with HF's semantics for ``layout.loss_kind`` (``causal``,
    ``masked``, ``seq2seq``); ``output.logits`` is this rank's shard ``(B, T, V_padded/tp_size)``
    (None when chunked); without ``labels`` nothing changes. Details (terms, ``num_items_in_batch``,
    post-processing, context parallelism): docs/loss.md, "tpify.hooks.lm_loss.install".

    Communication: with labels, the loss's 2 all-reduces (``B*T`` and ``2*B*T`` values) instead of
    the all-gather of ``B*T*V/p`` logits; chunked, 2 per chunk; under CP one more of 2 values.

    Raises:
        TPUsageError: (at call time, alike on every rank, before the loss's collectives) logits that
            are not the head's output by what the recipe declares; with ``lm_loss_chunk`` an adapter
            on the head; an output that holds another loss term.

    Returns:
        the hook handles, or ``[]`` when the layout has no LM head.
    """
    if layout.lm_head is None:
        return []
    state = ctx.state
    head = model.get_submodule(layout.lm_head)
    owner = ParallelLMLoss(head, layout.loss_kind, layout.honours_num_items, layout.loss_terms, state,
                           layout.logit_ops, layout.lm_loss_chunk, cp_group=ctx.cp_group)
    handles = [model.register_forward_pre_hook(owner.pre_hook, with_kwargs=True),
               model.register_forward_hook(owner.hook, with_kwargs=True, always_call=False),
               head.register_forward_pre_hook(KeepLogitsSharded(state), with_kwargs=True)]
    if owner.head_input is not None:
        handles.append(head.register_forward_pre_hook(owner.head_input, with_kwargs=True))
    if owner.watch is not None:
        handles.append(head.register_forward_hook(owner.watch))
    return handles
