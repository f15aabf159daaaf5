"""``TPTrainer`` and ``tp_trainer_class``: ``transformers.Trainer`` (and its subclasses, TRL's
trainers included) for tpify's tensor-parallel models (docs/training.md, "Trainer").

Plain ``Trainer`` treats a model as tensor-parallel only when its parameters are DTensors; on a
tpify model (plain tensors, one shard per rank) it would wrap a DDP over the world (refused at
the first forward, :mod:`tpify.integrations.model`), save rank 0's shards and restore rank 0's
optimizer state everywhere. :class:`TPTrainerMixin` changes only that: the accelerator is
:class:`~tpify.integrations.accelerate.TPAccelerator` (DDP or FSDP2/HSDP over the DP group,
batches split over DP replicas only, clipping by the dense norm); ``get_tp_size`` is the
model's (``num_items_in_batch`` counts each token once); evaluation gathers vocab-sharded
logits; saving writes the dense HF directory (:func:`tpify.save_pretrained`); checkpoints hold
the optimizer state as a torch.distributed.checkpoint in ``tpify_optimizer/`` with a manifest
(:mod:`tpify.integrations.resume`), resumed at any layout after the manifest is compared on
every rank. The optimizer files sit in a subdirectory so that plain ``Trainer`` resuming such a
checkpoint fails loudly (``optimizer.pt`` missing) instead of restarting the optimizer silently.

Context parallelism (a model parallelized with ``cp_size > 1``; ``parallelism_config`` may say
the same ``cp_size``): every rank of a CP group gets the same whole sequences, Trainer counts
``num_items_in_batch`` over them (each target once: :meth:`TPTrainerMixin.get_tp_size` is the
``tp x cp`` ranks of a replica), and each micro-batch is split by
:func:`tpify.context_parallel.split_batch` (labels shifted before the split) just before the
model's forward. TRL's trainers are refused under context parallelism, each with its reason
(:func:`tpify.integrations.trl.refuse_context_parallel`).

Refused at construction, on every rank: DeepSpeed, FSDP version 1 and the FSDP options
:func:`~tpify.integrations.accelerate.data_parallel_plan` refuses, fp16, ``load_best_model_at_end``,
a model tpify did not parallelize, TRL trainers tpify has not checked (:mod:`tpify.integrations.trl`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from .. import comm
from ..checkpoint import load_checkpoint, save_checkpoint
from ..data_parallel import planned_dp_shard
from ..context_parallel import split_batch
from ..info import get_tp_info
from ..quantized import refuse_full_finetuning
from ..random import get_rng_tracker
from ..sharding import is_dtensor
from .accelerate import TPAccelerator, data_parallel_plan
from .model import TPUsageError, load_dense_, save_dense, tp_model_of
from .resume import MANIFEST_NAME, check_resume, same_layout, training_layout, write_manifest
from .trl import (after_init, after_optimizer_loaded, check_trainer, check_trainer_class, data_parallel_metrics,
                  is_trl_trainer, prepare_args, refuse_context_parallel, trl_construction, uses_data_parallel_view)

__all__ = ["TPTrainer", "TPTrainerMixin", "tp_trainer_class", "OPTIMIZER_DIR"]

#: The subdirectory of a checkpoint holding the optimizer state (torch.distributed.checkpoint) and its manifest.
OPTIMIZER_DIR = "tpify_optimizer"


class TPTrainerMixin:
    """What a ``transformers.Trainer`` subclass needs to train a tpify model exactly (the module
    docstring); first among the bases (``class X(TPTrainerMixin, SFTTrainer)``) or through
    :func:`tp_trainer_class`. :class:`TPTrainer` is this mixin on ``transformers.Trainer``.

    Same arguments as the trainer; launch ``N = dp * cp * tp`` ranks with the model parallelized at
    ``tp_size = tp`` (and ``cp_size = cp`` on :func:`tpify.init_mesh`: the module docstring).
    ``per_device_train_batch_size`` is per DP replica. ``fsdp="full_shard"`` with
    ``fsdp_config={"version": 2}`` shards with FSDP2 over the DP group; ``parallelism_config`` asks
    for HSDP; else DDP over the DP group. TRL trainers (:data:`tpify.integrations.trl.CHECKED_TRAINERS`)
    get what :mod:`tpify.integrations.trl` adds (vocab-parallel fused LM head, ``peft_config``,
    seeds, reference models, metrics over DP). Communication: the model's and
    :class:`TPAccelerator`'s; saving gathers every sharded tensor over TP.

    Raises:
        TPUsageError: not a tpify model (or a PEFT model on one); DeepSpeed, FSDP version 1 or
            refused FSDP options, fp16, ``load_best_model_at_end``; a TRL trainer or option tpify
            refuses (:func:`tpify.integrations.trl.check_trainer`); a TRL trainer without ``args``.
            Under context parallelism: any TRL trainer (the reason per trainer), a
            ``parallelism_config`` whose ``cp_size`` is not the model's,
            ``label_smoothing_factor``, ``compute_loss_func``; at evaluation, logits asked for.
        ResumeError: resuming a checkpoint of another model or param groups, without a manifest, or
            incomplete; on every rank.
    """

    def __init__(self, *pos, **kwargs):
        bound = inspect.signature(super().__init__).bind_partial(*pos, **kwargs).arguments
        model, args = bound.get("model"), bound.get("args")
        name = type(self).__name__
        on_trl = is_trl_trainer(type(self))
        tp_model = tp_model_of(model) if model is not None and not isinstance(model, str) else None
        if on_trl and tp_model is not None:
            refuse_context_parallel(type(self), get_tp_info(tp_model))
        if on_trl:
            check_trainer_class(type(self))
        if tp_model is None:
            raise TPUsageError(f"{name} trains models parallelized by tpify (tpify.parallelize or "
                               "tpify.from_pretrained, optionally with tpify.integrations.get_peft_model); "
                               f"got {type(model).__name__}")
        info = get_tp_info(tp_model)
        refuse_full_finetuning(model, name)
        if on_trl:
            if args is None:
                raise TPUsageError(f"{name}: pass args= (TRL's config for the trainer): its defaults count "
                                   f"batches over the whole world, the TP ranks included")
            check_trainer(type(self), args, model)
            prepare_args(args, model)
        plan = None
        if args is not None:
            bad = [opt for opt, on in (("deepspeed", bool(args.deepspeed)), ("fp16", bool(args.fp16)),
                                       ("load_best_model_at_end", bool(args.load_best_model_at_end))) if on]
            if args.fsdp and args.fsdp_plugin_args is None:  # XLA FSDP
                bad.append("fsdp_config xla")
            if bad:
                raise TPUsageError(f"{name} does not support {bad} with a tensor-parallel model")
            plugin = None
            version = (args.fsdp_plugin_args or {}).get("fsdp_version", 2)
            if version != 2:  # refused before accelerate builds an FSDP1 plugin (which needs a GPU)
                raise TPUsageError(f"{name}: fsdp_config version {version} (FSDP1) is not supported with a "
                                   f"tensor-parallel model: fsdp_version=1 (FSDP1): use fsdp_config={{'version': 2}} "
                                   f"(FSDP2's fully_shard over the model's DP group)")
            if args.fsdp_plugin_args is not None:
                from accelerate.utils import FullyShardedDataParallelPlugin

                plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
            plan = data_parallel_plan(plugin, args.parallelism_config)
            if plan.cp_size is not None and plan.cp_size != info.cp_size:
                raise TPUsageError(f"{name}: parallelism_config asks for cp_size {plan.cp_size}, the model was "
                                   f"parallelized with cp_size {info.cp_size}; parallelize it on "
                                   f"tpify.init_mesh(tp_size, cp_size={plan.cp_size}) or ask for "
                                   f"cp_size={info.cp_size}")
            if info.cp_size > 1 and args.label_smoothing_factor:
                raise TPUsageError(f"{name}: label_smoothing_factor={args.label_smoothing_factor} under context "
                                   f"parallelism: Trainer's label smoother reads the logits and labels of the whole "
                                   f"sequence, and a rank holds {info.cp_size}th of it; use label_smoothing_factor=0 "
                                   f"or cp_size=1")
            if info.cp_size > 1 and bound.get("compute_loss_func") is not None:
                raise TPUsageError(f"{name}: compute_loss_func under context parallelism: it would see this rank's "
                                   f"tokens only (the model's loss is the one tpify adds over the CP group); drop it "
                                   f"or use cp_size=1")
        self._tp_model = tp_model
        self._tp_plan = plan
        if on_trl:
            self._tp_dp_view = uses_data_parallel_view(type(self))
        if on_trl:
            with trl_construction(type(self), model):
                super().__init__(*pos, **kwargs)
            self.accelerator.register_tp_model(self.model)
            after_init(self)
        else:
            super().__init__(*pos, **kwargs)
            self.accelerator.register_tp_model(self.model)

    # -- distributed setup -----------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        # Trainer's own FSDP and ParallelismConfig paths stay off (they would shard over the world);
        # the accelerator applies them over the model's DP group from the plan instead.
        saved = self.args.fsdp_plugin_args, self.args.parallelism_config
        self.args.fsdp_plugin_args, self.args.parallelism_config = None, None
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.fsdp_plugin_args, self.args.parallelism_config = saved
        if type(self.accelerator) is not TPAccelerator:
            # Same object and state; only the methods of TPAccelerator change.
            self.accelerator.__class__ = TPAccelerator
            # Trainer bound its gather function to the instance before: bind it again.
            self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                     use_gather_object=self.args.eval_use_gather_object)
        if getattr(self, "_tp_plan", None) is not None:
            self.accelerator.set_data_parallel_plan(self._tp_plan)
        _check_accelerate_sees_the_world(self.accelerator.state.num_processes)

    def get_tp_size(self) -> int:
        """The ranks of one DP replica, which hold the same batch and compute the same loss: the
        model's ``tp_size x cp_size``. Trainer divides the gathered ``num_items_in_batch`` by it
        (each target counted once), scales the loss by ``num_processes // get_tp_size()`` (the DP
        size, which DDP's average undoes: the CP group's gradient is a sum, made by tpify) and
        counts the DP world with it; :meth:`get_cp_size` is then 1 (counted here)."""
        info = get_tp_info(self._tp_model)
        return info.tp_size * info.cp_size

    def get_cp_size(self) -> int:
        """1: the model's context-parallel ranks are counted in :meth:`get_tp_size` (Trainer's own
        context parallelism, torch's, averages each rank's partial loss; tpify's loss is the dense
        one on every rank of the CP group)."""
        return 1

    def _split_for_context_parallel(self, inputs):
        """This rank's part of a batch of whole sequences (:func:`tpify.context_parallel.split_batch`),
        when the model is context-parallel; the batch itself otherwise. Local (one host sync when the
        batch has an ``attention_mask``, to check that it pads nothing)."""
        if get_tp_info(self._tp_model).cp_size == 1 or not isinstance(inputs, dict) or \
                inputs.get("input_ids") is None and inputs.get("inputs_embeds") is None:
            return inputs
        try:
            return split_batch(inputs, self._tp_model)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__} under context parallelism: {e}") from e

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's ``include_num_input_tokens_seen`` count, gathered over DP only: the TP ranks of
        a replica hold the same batch (a world-wide gather would count it ``tp_size`` times)."""
        with self.accelerator.data_parallel_view():
            super()._track_num_input_tokens(inputs)

    def _metrics_view(self):
        """GRPO's generation and loss see the accelerator over DP only
        (:func:`tpify.integrations.trl.data_parallel_metrics`); other trainers the world."""
        if getattr(self, "_tp_dp_view", False):
            return data_parallel_metrics(self)

        return contextlib.nullcontext()

    def _prepare_inputs(self, inputs):
        """Trainer's (the tensors on the device), then, under context parallelism, this rank's
        tokens (:meth:`_split_for_context_parallel`; ``num_items_in_batch`` was counted before, on
        the whole sequences)."""
        with self._metrics_view():
            return self._split_for_context_parallel(super()._prepare_inputs(inputs))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's; under context parallelism only the loss (``prediction_loss_only=True``).

        Raises:
            TPUsageError: logits or labels asked for under context parallelism (each rank holds a
                part of every sequence's tokens: metrics would see them out of order), on every rank.
        """
        if get_tp_info(self._tp_model).cp_size > 1 and not prediction_loss_only:
            raise TPUsageError(f"{type(self).__name__}: evaluation with logits (compute_metrics, or "
                               f"prediction_loss_only=False) under context parallelism is not built: each rank holds "
                               f"{get_tp_info(self._tp_model).cp_size}th of every sequence. Evaluate the loss only "
                               f"(TrainingArguments(prediction_loss_only=True)), or save the model and evaluate it "
                               f"with cp_size=1")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss; when the outputs are returned (evaluation, prediction), vocab-sharded
        LM logits are all-gathered to the full vocabulary first, so metrics see dense logits.
        GRPO's runs in :func:`tpify.integrations.trl.data_parallel_metrics`."""
        if not return_outputs:
            with self._metrics_view():
                return super().compute_loss(model, inputs, return_outputs=False,
                                            num_items_in_batch=num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        head = self._lm_head()
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        if head is not None and torch.is_tensor(logits) and logits.shape[-1] == head.out_features_per_partition \
                and head.out_features_per_partition != head.out_features:
            outputs["logits"] = comm.gather_from_tp_region(logits, head.tp_group)[..., : head.out_features]
        return loss, outputs

    def _lm_head(self):
        info = get_tp_info(self._tp_model)
        return self._tp_model.get_submodule(info.layout.lm_head) if info.layout.lm_head is not None else None

    # -- saving ------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Every rank: gather and write the dense model (or adapter); rank 0 adds tokenizer and args."""
        if state_dict is not None:
            raise TPUsageError("TPTrainer saves the dense model itself; state_dict= is not supported")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_dense(self.accelerator.unwrap_model(self.model, keep_torch_compile=False), output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _sharded(self) -> bool:
        """Whether FSDP2 shards the model."""
        return any(is_dtensor(p) for p in self._tp_model.parameters())

    def _training_layout(self, with_optimizer: bool) -> dict:
        plan = getattr(self, "_tp_plan", None)
        planned = plan is not None and plan.shard and not self._sharded()  # a resume checks before sharding
        if planned:
            dp_shard = planned_dp_shard(self._tp_model, plan.dp_replicate)
        return training_layout(self.model, [self.optimizer] if with_optimizer else None, written_by="TPTrainer",
                               dp_shard=dp_shard if planned else None)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank: the optimizer state as a torch.distributed.checkpoint in ``tpify_optimizer/``
        (each rank writing its pieces; :func:`tpify.checkpoint.save_checkpoint`), with the
        manifest; the scheduler as Trainer writes it."""
        directory = os.path.join(output_dir, OPTIMIZER_DIR)
        save_checkpoint(directory, self.accelerator.unwrap_model(self.model, keep_torch_compile=False),
                        [self.optimizer], model_state=False, generators=False)
        if self.args.should_save:
            write_manifest(directory, self._training_layout(True))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

        if dist.is_available() and dist.is_initialized():
            comm.barrier()

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        rank = self.args.process_index
        torch.save(get_rng_tracker(self._tp_model).state_dict(), os.path.join(output_dir, f"tpify_rng_{rank}.pt"))

    # -- resuming ----------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Every rank: refuse a checkpoint of another model (the optimizer is not built yet: its
        param groups are compared later), then read the dense weights back slice by slice (at
        this run's layout, whatever the saved one)."""
        model = model if model is not None else self.model
        check_resume(os.path.join(resume_from_checkpoint, OPTIMIZER_DIR), self._training_layout(False),
                     "TPTrainer resume", checkpoint=resume_from_checkpoint)
        load_dense_(self.accelerator.unwrap_model(model, keep_torch_compile=False), resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Every rank: the full check (param groups included, the files present), then the
        optimizer state resharded to this run's layout (:func:`tpify.checkpoint.load_checkpoint`)
        and the scheduler.

        On a TRL trainer, what TRL's own ``_load_optimizer_and_scheduler`` restores besides
        (GRPO's adaptive entropy controller) is restored after
        (:func:`tpify.integrations.trl.after_optimizer_loaded`).
        """
        if checkpoint is None:
            return

        directory = os.path.join(checkpoint, OPTIMIZER_DIR)
        check_resume(directory, self._training_layout(True), "TPTrainer resume (optimizer)", checkpoint=checkpoint,
                     files=[os.path.join(directory, ".metadata"), os.path.join(checkpoint, SCHEDULER_NAME)])
        load_checkpoint(directory, self.accelerator.unwrap_model(self.model, keep_torch_compile=False),
                        [self.optimizer], model_state=False, generators=False)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        if is_trl_trainer(type(self)):
            after_optimizer_loaded(self, checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Trainer's generators (each rank's file, as Trainer does); tpify's dropout streams only
        at the saved layout (same tp_size, world size, FSDP2 sharding), else the TP stream
        restarts from ``seed + 2718 + tp_rank`` (:mod:`tpify.checkpoint`)."""
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return

        file = os.path.join(checkpoint, f"tpify_rng_{self.args.process_index}.pt")
        with open(os.path.join(checkpoint, OPTIMIZER_DIR, MANIFEST_NAME)) as f:  # checked by the resume before
            saved = json.load(f)
        tracker = get_rng_tracker(self._tp_model)
        if same_layout(saved, self._training_layout(False)) and os.path.isfile(file):
            tracker.load_state_dict(torch.load(file, weights_only=True))
        else:
            tracker.reset(tracker.seed)


def tp_trainer_class(base: type) -> type:
    """``base`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``, ``DPOTrainer``,
    ``GRPOTrainer``, ``RewardTrainer``, your own) made to train tpify models: ``class TP<base>(TPTrainerMixin, base)``.

    ``tp_trainer_class(transformers.Trainer)`` is :class:`TPTrainer`. Construction raises what
    :class:`TPTrainerMixin` raises (a TRL trainer tpify has not checked, by name).
    """
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"tp_trainer_class: {base!r} is not a transformers.Trainer subclass")
    if issubclass(base, TPTrainerMixin):
        return base
    if base is transformers.Trainer:
        return TPTrainer
    return type(f"TP{base.__name__}", (TPTrainerMixin, base), {"__module__": __name__,
                                                                "__doc__": f"{base.__name__} for tpify models "
                                                                           f"(tpify.integrations.tp_trainer_class)."})


class TPTrainer(TPTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that trains a tpify model exactly: :class:`TPTrainerMixin` on
    ``Trainer`` (see the module docstring and the mixin's)."""


def _check_accelerate_sees_the_world(num_processes: int) -> None:
    """accelerate counts the processes from torchrun's environment (``WORLD_SIZE``, ``RANK``), not
    from torch.distributed. Ranks started another way (``mp.spawn``, a hand-made process group)
    leave it at 1, and Trainer then scales each loss by ``num_processes // tp_size`` = 0: the loss
    and every gradient silently zero. Raises :class:`TPUsageError` on every rank (each sees the
    same mismatch) before any step."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    if num_processes != world:
        raise TPUsageError(
            f"TPTrainer: accelerate sees {num_processes} process(es) but torch.distributed has {world} ranks; "
            f"Trainer would scale the loss by num_processes // tp_size and train on a wrong (zero) loss. Launch "
            f"with torchrun, or set torchrun's environment in every rank before building the trainer (RANK, "
            f"WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
