"""TRL's trainers on a tpify model: what :class:`~tpify.integrations.trainer.TPTrainerMixin` adds
when the trainer class derives from one of TRL's.

TRL 1.x computes its losses from per-token log-probs of its fused LM head, which multiplies the
hidden states by this rank's vocabulary shard ``(V_padded/p, H)``: silently wrong on a
tensor-parallel model (step-1 SFT loss 5.81 against 3.80 dense at tp = 2). The seams, rebound
only while a TRL trainer's ``__init__`` runs (:func:`trl_construction`): the fused head run
vocab-parallel (:class:`VocabParallelFusedHead`), ``get_peft_model``, reference models loaded
tensor-parallel, seeds ``seed + dp_rank``; GRPO's gathers over DP (:func:`data_parallel_metrics`);
GRPO's entropy controller on resume (:func:`after_optimizer_loaded`). Refused by
:func:`check_trainer`, alike on every rank. Each seam and refusal: docs/trl.md.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .. import comm
from ..info import TPUsageError, get_tp_info
from ..loss import vocab_parallel_entropy, vocab_parallel_is_top1, vocab_parallel_log_probs
from .model import tp_model_of

__all__ = ["CHECKED_TRAINERS", "is_trl_trainer", "check_trainer_class", "check_trainer", "prepare_args",
           "CONTEXT_PARALLEL_REFUSALS", "refuse_context_parallel",
           "trl_construction", "VocabParallelFusedHead", "add_fused_lm_head", "after_init", "uses_data_parallel_view",
           "data_parallel_metrics", "after_optimizer_loaded"]

#: TRL trainer classes checked against the same trainer on the dense model (tests/distributed/test_trl.py).
CHECKED_TRAINERS = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RewardTrainer")
_TRL_BASES = ("BaseTrainer", "_BaseTrainer")
_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits")


def _trl_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]


def is_trl_trainer(cls: type) -> bool:
    """Whether ``cls`` derives from a TRL class."""
    return bool(_trl_classes(cls))


def _refused_options(args) -> list[str]:
    """The TRL options (of ``args``) this integration refuses, each with its reason."""
    bad = []
    on = lambda name: bool(getattr(args, name, False))  # noqa: E731
    if on("use_vllm"):
        bad.append("use_vllm=True (vLLM generation: generate with the tensor-parallel policy itself, use_vllm=False)")
    if on("use_liger_kernel"):
        bad.append("use_liger_kernel=True (Liger's kernels read whole weights; tpify's layers are shards)")
    if on("cast_lm_head_to_fp32"):
        bad.append("cast_lm_head_to_fp32=True (GRPO replaces the LM head by a dense nn.Linear over this rank's "
                   "vocabulary shard)")
    if on("use_weighting"):
        bad.append("use_weighting=True (DPO's WPO weights: not checked on a vocabulary-split head)")
    if getattr(args, "use_transformers_paged", False) or getattr(args, "use_transformers_continuous_batching", False):
        bad.append("transformers' paged / continuous-batching generation (not checked with tensor-parallel layers)")
    return bad


#: Why each TRL trainer is refused under context parallelism (each rank holds ``T / cp`` tokens of
#: every sequence, :mod:`tpify.context_parallel`); TRL itself refuses ``cp_size > 1`` in GRPO and RLOO.
CONTEXT_PARALLEL_REFUSALS = {
    "SFTTrainer": "SFT's compute_loss adds token accuracy and entropy from the logits and labels of the batch "
                  "(this rank's tokens, out of order) and its padding-free packing collator's position ids are not "
                  "passed through tpify.context_parallel.split_batch; not checked against the dense run",
    "DPOTrainer": "DPO sums each sequence's log-probs over its tokens (chosen and rejected, concatenated) and "
                  "compares the sums across sequences: a rank holds only part of each sum, and the sum over the CP "
                  "group is not built",
    "GRPOTrainer": "GRPO generates its completions (generate is refused under context parallelism: decoding has "
                   "no sequence to split) and averages per-sequence log-probs over the completion tokens of "
                   "whole sequences",
    "RewardTrainer": "the reward model scores each sequence at its last token, which lives on one rank of the CP "
                     "group",
    "RLOOTrainer": "RLOO generates its completions (generate is refused under context parallelism) and sums "
                   "per-sequence log-probs",
}


def refuse_context_parallel(cls: type, info) -> None:
    """Refuse a TRL trainer on a context-parallel model (``info.cp_size > 1``), naming the reason for
    the trainer (:data:`CONTEXT_PARALLEL_REFUSALS`). Local: the same on every rank, before anything
    is built.

    Raises:
        TPUsageError: ``cls`` derives from a TRL class and the model has ``cp_size > 1``.
    """
    if info is None or info.cp_size == 1 or not is_trl_trainer(cls):
        return
    names = [c.__name__ for c in _trl_classes(cls) if c.__name__ not in _TRL_BASES]
    name = names[0] if names else cls.__name__
    reason = CONTEXT_PARALLEL_REFUSALS.get(name, "it is not one of TRL's trainers tpify has checked")
    raise TPUsageError(f"{cls.__name__}: TRL's {name} under context parallelism (cp_size {info.cp_size}) is not "
                       f"supported: {reason}. Train with cp_size=1 (tpify.init_mesh(tp_size, cp_size=1)), or with "
                       f"tpify.integrations.TPTrainer (a causal LM loss over split sequences) or your own loop "
                       f"(docs/context-parallelism.md)")


def check_trainer_class(cls: type) -> None:
    """Refuse a TRL trainer class tpify has not checked (a local check: the same on every rank).

    Raises:
        TPUsageError: ``cls`` derives from a TRL trainer not in :data:`CHECKED_TRAINERS`, named.
    """
    names = [c.__name__ for c in _trl_classes(cls)]
    unchecked = [n for n in names if n not in CHECKED_TRAINERS + _TRL_BASES]
    if unchecked:
        raise TPUsageError(f"{cls.__name__} derives from TRL's {unchecked[0]}, which tpify has not checked on tensor-"
                           f"parallel models (checked: {', '.join(CHECKED_TRAINERS)}); it may compute from "
                           f"lm_head.weight or full-vocabulary logits, which are vocabulary shards here, and train "
                           f"silently wrong. Use one of the checked trainers, or tpify.integrations.TPTrainer")


def check_trainer(cls: type, args, model: nn.Module) -> None:
    """Refuse, before anything is built, a TRL option that is not supported on a tpify model, or
    a model TRL's trainers cannot use (local checks: the same outcome on every rank).

    Raises:
        TPUsageError: a refused option (:mod:`tpify.integrations.trl`'s docstring lists them); a
            model parallelized with ``lm_loss_chunk``.
    """
    info = get_tp_info(tp_model_of(model))
    if info.layout.lm_loss_chunk is not None and info.layout.lm_head is not None:
        raise TPUsageError(f"{cls.__name__}: the model was parallelized with lm_loss_chunk={info.layout.lm_loss_chunk}"
                           f", so its labels= call returns no logits, and TRL's log-probs, entropy and accuracy are "
                           f"computed from the logits shard; parallelize without lm_loss_chunk for TRL trainers")
    if args is None:
        return
    bad = _refused_options(args)
    if bad:
        raise TPUsageError(f"{cls.__name__} on a tensor-parallel model (tp_size = {info.tp_size}) does not support: "
                           + "; ".join(bad))


def prepare_args(args, model: nn.Module) -> None:
    """GRPO's ``generation_batch_size``: TRL derives it as ``per_device_train_batch_size *
    world_size * steps_per_generation``; with tensor parallelism the TP ranks of a DP replica share
    one batch, so it is ``per_device_train_batch_size * dp * steps_per_generation`` (``per_device``
    is per DP replica, as for :class:`~tpify.integrations.TPTrainer`).

    Raises:
        TPUsageError: a ``generation_batch_size`` that is neither TRL's world-derived value nor a
            multiple of ``per_device_train_batch_size * dp`` with that ``steps_per_generation``.
    """
    if getattr(args, "generation_batch_size", None) is None or not hasattr(args, "steps_per_generation"):
        return
    info = get_tp_info(tp_model_of(model))
    dp = comm.group_size(info.dp_group)
    per_device, steps = args.per_device_train_batch_size, args.steps_per_generation
    if args.generation_batch_size == per_device * dp * steps:
        return
    if args.generation_batch_size == per_device * args.world_size * steps:
        args.generation_batch_size = per_device * dp * steps
        return
    raise TPUsageError(f"generation_batch_size = {args.generation_batch_size} does not fit dp = {dp} (tp_size = "
                       f"{info.tp_size}): with tensor parallelism it is per_device_train_batch_size * dp * "
                       f"steps_per_generation = {per_device * dp * steps}; set steps_per_generation instead")


class VocabParallelFusedHead:
    """TRL's fused LM head (``model(..., labels=labels, fused_lm_head=True)`` returning
    ``FusedCausalLMOutput``) on a tpify model, from the vocabulary shards.

    A forward pre-hook (registered first, ``prepend``) removes ``fused_lm_head`` from the call and
    remembers the labels; ``labels`` stay in the call, so tpify's LM-loss hook keeps the head's
    output split over the vocabulary and returns the shard ``z`` ``(B, T, V_padded/p)`` (HF's
    declared post-processing, e.g. softcapping, applied). The forward hook (registered last) then
    returns, with TRL's semantics (causal shift, or ``shift_labels``; every field 0 where the
    label is -100)::

        log_probs  = log softmax(z / T)[target]        vocab_parallel_log_probs   (B, T-1)
        entropy    = -sum_v p_v log p_v                vocab_parallel_entropy     (B, T-1)
        is_top1    = argmax_v z == target              vocab_parallel_is_top1     (B, T-1)
        mean_logits = mean_{v < V} z_v / T             one all-reduce, no grad    (B, T-1)
        loss       = -sum(log_probs) / (num_items_in_batch or the number of labels)

    Dtype: the statistics in float32 (float64 for a float64 model), gradients in the logits'
    dtype. Communication per call, beyond the model's: tpify's own ``labels=`` loss (2
    all-reduces, its result dropped), then 2 all-reduces for ``log_probs``, 2 for ``entropy``, 1
    for ``is_top1``, 1 for ``mean_logits`` (those asked for); backward none.

    Raises:
        TPUsageError: ``fused_lm_head=True`` without ``labels``, or with ``shift_labels`` only;
            logits that are not the vocabulary shard (tpify's hooks removed).
    """

    def __init__(self, head: nn.Module, temperature: float = 1.0, outputs=("log_probs",)):
        self.head = head
        self.configure(temperature, outputs)
        self.request = None
        self.handles = []

    def configure(self, temperature: float, outputs) -> None:
        unknown = [o for o in outputs if o not in _FUSED_OUTPUTS]
        if unknown:
            raise TPUsageError(f"TRL's fused LM head asks for {unknown}, which tpify's vocab-parallel fused head does "
                               f"not compute ({list(_FUSED_OUTPUTS)})")
        self.temperature, self.outputs = float(temperature), tuple(outputs)

    def install(self, model: nn.Module) -> list:
        self.handles = [model.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True),
                        model.register_forward_hook(self.hook, with_kwargs=True)]
        return self.handles

    def pre_hook(self, model, args, kwargs):
        self.request = None
        if "fused_lm_head" not in kwargs:
            return None
        fused = kwargs.pop("fused_lm_head")
        if not fused:
            return args, kwargs
        if kwargs.get("labels") is None:
            raise TPUsageError(f"{type(model).__name__} was called with fused_lm_head=True without labels: tpify's "
                               f"vocab-parallel fused head needs labels= (shift_labels alone is not supported)")
        self.request = {"labels": kwargs["labels"], "shift_labels": kwargs.get("shift_labels"),
                        "num_items_in_batch": kwargs.pop("num_items_in_batch", None)}
        kwargs["use_cache"] = False
        return args, kwargs

    def hook(self, model, args, kwargs, output):
        request, self.request = self.request, None
        if request is None:
            return None
        from trl.trainer.utils import FusedCausalLMOutput

        head = self.head
        logits = output["logits"] if hasattr(output, "keys") else None
        if logits is None or logits.shape[-1] != head.out_features_per_partition:
            raise TPUsageError(f"{type(model).__name__}: TRL's fused head expected the logits split over the "
                               f"vocabulary ({head.out_features_per_partition} columns per rank), got "
                               f"{None if logits is None else tuple(logits.shape)}: tpify's hooks were removed "
                               f"(tpify.remove_hooks) or a wrapper replaced the head. Nothing was computed")
        target = request["shift_labels"]
        if target is None:
            logits, target = logits[:, :-1], request["labels"][:, 1:]
        target = target.to(logits.device)
        mask = target != -100
        group, vocab, t = head.tp_group, head.out_features, self.temperature
        log_probs = vocab_parallel_log_probs(logits, target, tp_group=group, vocab_size=vocab, temperature=t)
        entropy = is_top1 = mean_logits = None
        if "entropy" in self.outputs:
            entropy = vocab_parallel_entropy(logits, tp_group=group, vocab_size=vocab, temperature=t)
            entropy = entropy.masked_fill(~mask, 0.0)
        if "is_top1" in self.outputs:
            is_top1 = vocab_parallel_is_top1(logits, target, tp_group=group, vocab_size=vocab)
        if "mean_logits" in self.outputs:
            with torch.no_grad():
                total = comm.all_reduce(logits.sum(dim=-1, dtype=torch.float32), group)  # padded columns hold 0
                mean_logits = (total / (vocab * t)).masked_fill(~mask, 0.0)
        num_items = request["num_items_in_batch"]
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
        aux_loss = output.get("aux_loss") if hasattr(output, "get") else None
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1,
                                   mean_logits=mean_logits, label_mask=mask, aux_loss=aux_loss)


def add_fused_lm_head(model: nn.Module, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs=("log_probs",), _trl_original=None) -> None:
    """TRL's ``add_fused_lm_head`` for a tpify model: a :class:`VocabParallelFusedHead` on it
    (once per model; a second call sets its temperature and outputs). A model tpify did not
    parallelize gets TRL's own.

    Raises:
        TPUsageError: ``cast_lm_head_to_fp32=True``; a tpify model without an LM head.
    """
    tp_model = tp_model_of(model)
    if tp_model is None:
        return _trl_original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                             outputs=outputs)
    if cast_lm_head_to_fp32:
        raise TPUsageError("cast_lm_head_to_fp32=True is not supported on a tensor-parallel model")
    info = get_tp_info(tp_model)
    if info.layout.lm_head is None:
        raise TPUsageError(f"TRL's fused LM head on {type(tp_model).__name__}: the layout has no LM head")
    existing = tp_model.__dict__.get("_tpify_fused_head")
    if existing is not None:
        existing.configure(temperature, outputs)
        return None
    fused = VocabParallelFusedHead(tp_model.get_submodule(info.layout.lm_head), temperature, outputs)
    info.hooks.extend(fused.install(tp_model))  # removed by tpify.remove_hooks (the guard then refuses the call)
    tp_model.__dict__["_tpify_fused_head"] = fused
    return None


def _get_peft_model(model, peft_config, *args, **kwargs):
    """TRL's ``get_peft_model(model, peft_config, ...)`` call, routed to tpify's for a tpify model."""
    if tp_model_of(model) is None:
        from peft import get_peft_model

        return get_peft_model(model, peft_config, *args, **kwargs)
    from .peft import get_peft_model

    return get_peft_model(model, peft_config, *args, **kwargs)


def _reference_loader(policy: nn.Module, original):
    """TRL's ``create_model_from_path`` for the reference model: tensor-parallel like ``policy``
    (:func:`tpify.from_pretrained` on its groups and recipe), from the directory the policy's
    config names."""

    def create(path, *args, **kwargs):
        import os

        from ..api import from_pretrained

        if args or str(path) != str(getattr(policy.config, "_name_or_path", None)):
            return original(path, *args, **kwargs)  # another model (a reward model): TRL's own loading
        info = get_tp_info(policy)
        if not os.path.isdir(str(path)):
            raise TPUsageError(f"TRL wants a reference model loaded from {path!r} (the policy's config path): tpify "
                               f"loads it tensor-parallel from a local directory only; save the initial policy with "
                               f"tpify.save_pretrained and load the policy from there, or pass ref_model= (DPO)")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return from_pretrained(path, tp_group=info.tp_group, dp_group=info.dp_group, dtype=dtype,
                               model_class=type(policy), pad_vocab_multiple=info.layout.pad_vocab_multiple,
                               sequence_parallel=info.layout.sequence_parallel is not None)

    return create


def _seeder(policy: nn.Module, original):
    """``set_seed`` with ``device_specific=True`` (GRPO): ``seed + dp_rank``, the same on the ranks
    of a TP group."""

    def set_seed(seed, device_specific=False, deterministic=False):
        if device_specific:
            seed = seed + comm.group_rank(get_tp_info(policy).dp_group)
        return original(seed, deterministic=deterministic)

    return set_seed


@contextlib.contextmanager
def trl_construction(cls: type, model: nn.Module):
    """While a TRL trainer's ``__init__`` runs: TRL's module-level ``add_fused_lm_head``,
    ``get_peft_model``, ``create_model_from_path`` (reference models) and ``set_seed`` in the
    modules of ``cls``'s TRL classes are tpify's (see the module docstring); put back on exit,
    also when ``__init__`` raises. Not thread-safe (two trainers built at once in two threads)."""
    policy = tp_model_of(model)
    with _rebound(cls, {"add_fused_lm_head": lambda o: _bind_original(add_fused_lm_head, o),
                        "get_peft_model": lambda o: _get_peft_model,
                        "create_model_from_path": lambda o: _reference_loader(policy, o),
                        "set_seed": lambda o: _seeder(policy, o)}):
        yield


@contextlib.contextmanager
def _rebound(cls: type, makers: dict):
    """In the modules of ``cls``'s TRL classes, each module-level name of ``makers`` bound to
    ``makers[name](original)`` for the block, and put back on exit, also when the block raises."""
    saved = []
    for module in {sys.modules[c.__module__] for c in _trl_classes(cls)}:
        for name, make in makers.items():
            if name in module.__dict__:
                original = module.__dict__[name]
                saved.append((module, name, original))
                setattr(module, name, make(original))
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _bind_original(function, original):
    def bound(*args, **kwargs):
        return function(*args, _trl_original=original, **kwargs)

    return bound


def after_init(trainer) -> None:
    """After a TRL trainer's ``__init__``: its reference model registered with the accelerator."""
    ref = getattr(trainer, "ref_model", None)
    if ref is not None and tp_model_of(ref) is not None:
        trainer.accelerator.register_tp_model(ref)


def uses_data_parallel_view(cls: type) -> bool:
    """Whether ``cls``'s generation and loss run in :func:`data_parallel_metrics`: GRPO, which pairs
    its gathers with ``process_index``/``num_processes``. SFT's loss scale reads ``num_processes``
    with Trainer's world meaning (``num_processes // get_tp_size()``), so SFT, DPO and
    RewardTrainer keep the world view and count through ``gather_for_metrics`` (over DP)."""
    return any(c.__name__ == "GRPOTrainer" for c in _trl_classes(cls))


@contextlib.contextmanager
def data_parallel_metrics(trainer):
    """While GRPO generates and scores completions or computes its loss: the accelerator's
    ``gather``, ``reduce``, ``num_processes`` and ``process_index`` over the DP group
    (:meth:`~tpify.integrations.accelerate.TPAccelerator.data_parallel_view`), and the names
    ``gather`` and ``gather_object`` (accelerate's world-wide functions, imported by TRL's GRPO
    module for its rewards and its completions log) bound to the accelerator's view methods; put
    back on exit, also when the block raises. What TRL computes from them is then the dense run's
    on ``dp`` processes: the rewards gathered over DP (each replica's completions once, in DP rank
    order), each replica's slice of the advantages at ``process_index = dp_rank``, the loss
    normalizer ``num_items_in_batch / num_processes`` (both over DP), every logged metric.

    Not thread-safe (two GRPO trainers stepping at once in two threads of one process). A no-op at
    ``tp_size == 1``.
    """
    accelerator = trainer.accelerator
    with accelerator.data_parallel_view():
        if accelerator._dp_view() is None:
            yield
            return
        with _rebound(type(trainer), {"gather": lambda o: accelerator.gather,
                                      "gather_object": lambda o: accelerator.gather_object}):
            yield


def after_optimizer_loaded(trainer, checkpoint: str) -> None:
    """What TRL restores in its own ``_load_optimizer_and_scheduler`` (which
    :class:`~tpify.integrations.trainer.TPTrainerMixin` replaces to reshard the optimizer): GRPO's
    adaptive entropy controller (``entropy_coef`` and the last window's entropy), from the
    ``entropy_ctrl_state.json`` TRL writes into each checkpoint (the same value on every rank).
    A checkpoint without that file leaves the controller as constructed, as TRL does."""
    import json
    import os

    if not getattr(trainer, "use_adaptive_entropy", False):
        return
    path = os.path.join(checkpoint, "entropy_ctrl_state.json")
    if os.path.exists(path):
        with open(path) as f:
            state = json.load(f)
        trainer.entropy_coef = state["entropy_coef"]
        trainer._last_world_entropy = state["last_world_entropy"]
