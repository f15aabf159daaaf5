"""``TPAccelerator``: accelerate's ``Accelerator`` for tpify's tensor-parallel models.

accelerate knows tensor parallelism only as DTensor parameters (``ParallelismConfig(tp_size)``)
and otherwise wraps every model in a ``DistributedDataParallel`` over the whole world, which
for a tpify model overwrites the other TP ranks' shards with rank 0's, hands the TP ranks of one
model replica different batches, averages gradients of different shards, and clips by each
rank's local norm. :class:`TPAccelerator` is ``Accelerator`` with five methods changed, so that
``prepare(model, optimizer, dataloader)``, ``backward`` and ``clip_grad_norm_`` are exact
(docs/mechanics.md "Groups"; Megatron-LM, arXiv:1909.08053, section 3):

* ``prepare_model``: no DDP wrap (device placement, autocast and compile as accelerate does
  them); the model's TP/DP groups are recorded.
* ``prepare_data_loader``: the data is split over the DP replicas only (``num_processes = dp``,
  ``process_index = dp_rank``), with accelerate's own sharding, so every rank of a TP group gets
  the same batches and the DP replicas different ones.
* ``backward``: when gradients are synchronised (``accelerator.sync_gradients``, False inside
  ``accumulate`` before the last micro-batch, as with DDP's ``no_sync``), every gradient is
  averaged over the DP group (:func:`tpify.training.sync_gradients`).
* ``clip_grad_norm_``: the norm of the dense model (:func:`tpify.training.params_grad_norm`:
  sharded gradients' squares summed over TP, replicated ones counted once).
* ``save_model``: the dense Hugging Face checkpoint (or a PEFT model's dense adapter), a
  collective every rank calls; ``save_state``/``load_state``: that checkpoint plus one state file
  per rank (optimizer shards, scheduler, generators, tpify's dropout streams) and the layout
  manifest (:mod:`tpify.integrations.resume`), read back in place; ``load_state`` refuses, on
  every rank, a state saved at another layout.
  ``get_state_dict`` raises :class:`~tpify.integrations.model.TPUsageError` (a state dict of
  shards is not the model's).

Everything else is accelerate's. ``gather_for_metrics`` (what Trainer's evaluation uses) counts
each sample once; ``gather``/``reduce`` still span the world, where each TP group holds
``tp_size`` copies of one replica's values (means are unchanged).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import accelerate
from accelerate.data_loader import prepare_data_loader

from ..info import get_tp_info, param_specs
from ..training import clip_params_grad_norm_, sync_gradients
from .model import TPUsageError, load_dense_, save_dense, tp_model_of
from .resume import PER_RANK, check_resume, training_layout, write_manifest

__all__ = ["TPAccelerator"]


class TPAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that trains tpify models exactly (see the module docstring).

    Use it as ``Accelerator``: ``model, opt, dl = accelerator.prepare(model, opt, dl)``, then
    ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_(model.parameters(), 1.0)``,
    ``opt.step()``. Under torchrun with ``world = dp * tp``.

    Communication: that of the model; ``backward`` adds the DP all-reduces of
    :func:`~tpify.training.sync_gradients` on synchronising steps; ``clip_grad_norm_`` one
    all-reduce of one value over TP.

    Raises:
        TPUsageError: fp16 mixed precision (a per-rank inf check would let TP ranks diverge), an
            FSDP plugin, DeepSpeed or a ``ParallelismConfig`` (they would re-wrap the shards),
            ``dispatch_batches``, a data loader prepared before any tpify model, two models
            with different groups, ``get_state_dict``.
        ResumeError: (a TPUsageError) ``load_state`` of a state saved at another layout.
    """

    # -- what tpify models were prepared --------------------------------------------------------
    def _tp_models(self) -> list:
        if "_tpify_models" not in self.__dict__:
            self.__dict__["_tpify_models"] = []
        return self.__dict__["_tpify_models"]

    def register_tp_model(self, model) -> None:
        """Record the TP/DP layout of a tpify model (done by ``prepare``; call it to prepare data first)."""
        tp_model = tp_model_of(model)
        if tp_model is None:
            return
        models = self._tp_models()
        if any(m is tp_model for m in models):
            return
        info = get_tp_info(tp_model)
        if models:
            first = get_tp_info(models[0])
            if (first.tp_group, first.dp_group) != (info.tp_group, info.dp_group):
                raise TPUsageError("TPAccelerator: the tpify models prepared use different TP/DP groups; "
                                   "parallelize them with the same tp_size")
        if self.mixed_precision == "fp16":
            raise TPUsageError("TPAccelerator: fp16 mixed precision is not supported with tensor parallelism (the "
                               "loss scaler's inf check is per rank, so TP ranks could skip different steps); use "
                               "mixed_precision='bf16' or 'no'")
        from accelerate.utils import DistributedType

        engines = [name for name, on in (
            ("an FSDP plugin (fsdp_plugin / ACCELERATE_USE_FSDP)", self.distributed_type == DistributedType.FSDP
             or getattr(self.state, "fsdp_plugin", None) is not None
             or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"),
            ("DeepSpeed", self.distributed_type == DistributedType.DEEPSPEED),
            ("a ParallelismConfig (accelerate's own DTensor tensor/context parallelism)",
             getattr(self, "parallelism_config", None) is not None)) if on]
        if engines:
            raise TPUsageError(f"TPAccelerator: {engines[0]} is not supported with a tpify model: its data or tensor "
                               f"parallelism would wrap or re-shard the tensor-parallel shards. Use TPAccelerator "
                               f"without it (the model's DP group averages the gradients)")
        models.append(tp_model)

    def _layout(self):
        models = self._tp_models()
        if not models:
            return None
        from .. import comm

        info = get_tp_info(models[0])
        return comm.group_size(info.dp_group), comm.group_rank(info.dp_group), info

    # -- accelerate's methods -------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        for obj in args:  # learn the layout first, whatever the argument order
            self.register_tp_model(obj)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        self.register_tp_model(model)
        if tp_model_of(model) is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # evaluation_mode=True: accelerate's placement, autocast and compile, without its DDP wrap.
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        layout = self._layout()
        if layout is None:
            if self.num_processes > 1:
                raise TPUsageError("TPAccelerator: prepare the tpify model before (or in the same prepare call as) "
                                   "the data loader, so that its batches can be split over the DP replicas only")
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise TPUsageError("TPAccelerator: dispatch_batches=True is not supported with tensor parallelism")
        dp_size, dp_rank, _ = layout
        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=dp_size, process_index=dp_rank,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False, even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def backward(self, loss, **kwargs):
        super().backward(loss, **kwargs)
        if self.sync_gradients:
            for model in self._tp_models():
                sync_gradients(model)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        owners = {id(p): m for m in self._tp_models() for p in m.parameters()}
        mine = [p for p in parameters if id(p) in owners]
        if not mine:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if len(mine) != len(parameters):
            raise TPUsageError("TPAccelerator.clip_grad_norm_: pass the parameters of one tpify model "
                               "(model.parameters()), not a mix with other models' parameters")
        if norm_type != 2:
            raise TPUsageError("TPAccelerator.clip_grad_norm_: only norm_type=2 is supported for tpify models")
        self.unscale_gradients()
        owner = owners[id(mine[0])]
        return clip_params_grad_norm_(mine, max_norm, get_tp_info(owner).tp_group, specs=param_specs(owner))

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        if tp_model_of(model) is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        save_dense(self.unwrap_model(model), save_directory, max_shard_size=max_shard_size)

    def get_state_dict(self, model, unwrap=True):
        if tp_model_of(model) is not None:
            raise TPUsageError("TPAccelerator.get_state_dict: a tpify model's state dict holds this rank's shards; "
                               "save the dense checkpoint with accelerator.save_model(model, dir) on every rank")
        return super().get_state_dict(model, unwrap=unwrap)

    def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
        """Save what a resume needs, for tpify models (a collective every rank calls).

        ``output_dir/model`` (``model_<i>`` for further models) holds each model's dense Hugging
        Face checkpoint, or a PEFT model's dense adapter; ``output_dir/tpify_state_rank<k>.pt``
        holds rank ``k``'s optimizer and scheduler states (its shards), accelerate's step
        counter, the Python, NumPy and torch generators and tpify's dropout streams;
        ``output_dir/tpify_layout.json`` the layout they were written at (tp_size, dp_size, the
        models' shards, the optimizers' param groups; :func:`~tpify.integrations.resume.training_layout`).
        The data position is the caller's, as with accelerate (``skip_first_batches``).

        Raises:
            TPUsageError: no ``output_dir`` (automatic checkpoint naming is not supported here).
        """
        if not self._tp_models():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if output_dir is None:
            raise TPUsageError("TPAccelerator.save_state needs output_dir for tpify models")
        import random

        import numpy as np
        import torch

        from .. import comm
        from ..random import get_rng_tracker

        out = Path(output_dir)
        for i, model in enumerate(self._models):
            self.save_model(model, out / ("model" if i == 0 else f"model_{i}"))
        state = {"optimizers": [o.state_dict() for o in self._optimizers],
                 "schedulers": [s.state_dict() for s in self._schedulers], "step": self.step,
                 "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                 "tpify_rng": [get_rng_tracker(m).state_dict() for m in self._tp_models()], "world": self.num_processes}
        out.mkdir(parents=True, exist_ok=True)
        if self.process_index == 0:
            write_manifest(out, self._training_layout())
        torch.save(state, out / f"tpify_state_rank{self.process_index}.pt")
        comm.barrier()
        return str(out)

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        """Restore what :meth:`save_state` wrote, into the prepared models and optimizers in place.

        First every rank compares the saved layout manifest with this run's
        (:func:`~tpify.integrations.resume.check_resume`: tp_size, dp_size, pad_vocab_multiple,
        model class, adapters, every optimized parameter's shard, the param groups); then each
        rank reads its slices of the dense weights (or adapter) and its own state file.

        Communication: one agreement (:func:`tpify.agree.agree`) before anything is read.

        Raises:
            TPUsageError: no ``input_dir``.
            ResumeError: on every rank: the state was saved at another layout (the message names
                both and what differs), has no manifest, or lacks a rank's state file.
            CheckpointError: the weights do not fit the model.
        """
        if not self._tp_models():
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if input_dir is None:
            raise TPUsageError("TPAccelerator.load_state needs input_dir for tpify models")
        import random

        import numpy as np
        import torch

        from ..random import get_rng_tracker

        src = Path(input_dir)
        file = src / f"tpify_state_rank{self.process_index}.pt"
        check_resume(src, self._training_layout(), "TPAccelerator.load_state", files=[file])
        state = torch.load(file, map_location="cpu", weights_only=False)
        for i, model in enumerate(self._models):
            load_dense_(self.unwrap_model(model), src / ("model" if i == 0 else f"model_{i}"))
        for opt, saved in zip(self._optimizers, state["optimizers"]):
            opt.load_state_dict(saved)
        for sched, saved in zip(self._schedulers, state["schedulers"]):
            sched.load_state_dict(saved)
        self.step = state["step"]
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        for model, saved in zip(self._tp_models(), state["tpify_rng"]):
            get_rng_tracker(model).load_state_dict(saved)

    def _training_layout(self) -> dict:
        models = [self.unwrap_model(m) for m in self._models] or self._tp_models()
        return training_layout(models, self._optimizers,
                               optimizer_files=PER_RANK, written_by="TPAccelerator")

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """As accelerate's, counting each sample once: the TP ranks of a replica hold the same
        batch, so only TP rank 0's copy of each replica's values is kept (tensors only)."""
        layout = self._layout()
        if layout is None or layout[2].tp_size == 1:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        if use_gather_object:
            raise TPUsageError("TPAccelerator.gather_for_metrics supports tensors only for tpify models")
        self.__dict__["_tpify_dedupe"] = layout[2].tp_size
        try:
            return super().gather_for_metrics(input_data, use_gather_object=False)
        finally:
            self.__dict__["_tpify_dedupe"] = 0

    def gather(self, tensor):
        out = super().gather(tensor)
        tp = self.__dict__.get("_tpify_dedupe", 0)
        if not tp:
            return out
        from accelerate.utils import recursively_apply

        world = self.num_processes
        return recursively_apply(lambda t: t.reshape(world, -1, *t.shape[1:])[::tp].reshape(-1, *t.shape[1:]), out)

    @contextlib.contextmanager
    def no_sync(self, model):
        """As accelerate's: gradients are not averaged over DP by ``backward`` inside the block."""
        previous = self.gradient_state.sync_gradients
        self.gradient_state._set_sync_gradients(False)
        try:
            with super().no_sync(model):
                yield
        finally:
            self.gradient_state._set_sync_gradients(previous)
