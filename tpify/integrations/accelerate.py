"""``TPAccelerator``: accelerate's ``Accelerator`` for tpify's tensor-parallel models
(docs/training.md, "accelerate").

accelerate knows tensor parallelism only as DTensor parameters; on a tpify model it would wrap
a DDP over the world (rank 0's shards everywhere, other batches per TP rank, averaged gradients
of different shards, a per-rank clipping norm). :class:`TPAccelerator` changes a few methods so
that ``prepare``, ``backward`` and ``clip_grad_norm_`` are exact (Megatron-LM, arXiv:1909.08053,
section 3):

* data parallelism is torch's over the model's DP group only (:func:`data_parallel_plan` reads
  accelerate's switches): DDP by default (:func:`tpify.data_parallel.replicate_data_parallel`);
  FSDP2/HSDP with an FSDP plugin of version 2 or a ``ParallelismConfig`` with ``dp_shard_size > 1``
  (:func:`tpify.data_parallel.shard_data_parallel`; accelerate never sees the plugin);
* ``prepare_data_loader`` splits the data over the DP replicas only (every TP rank of a replica
  gets the same batches); ``clip_grad_norm_`` clips by the dense model's norm;
* ``save_model`` writes the dense checkpoint (a collective); ``save_state``/``load_state`` add the
  training state as a torch.distributed.checkpoint with its manifest, read back at any layout;
  ``get_state_dict`` raises :class:`~tpify.integrations.model.TPUsageError`;
* context parallelism: a model parallelized on a mesh with ``cp_size > 1`` (or a ``ParallelismConfig``
  with ``cp_size``, which must be the model's): the data loader gives every rank of a CP group
  the same whole sequences; the training loop calls :func:`tpify.context_parallel.split_batch` on
  each batch (the labels shifted before the split); the loss is the dense one and tpify sums the
  gradients over the CP group (docs/context-parallelism.md); under FSDP2 the shards are split over
  ``dp_shard x cp`` and FSDP2's reduce-scatter adds the CP group's gradients
  (:func:`tpify.shard_data_parallel`);
* ``gather_for_metrics`` gathers over the DP group (each sample once);
  :meth:`~TPAccelerator.data_parallel_view` makes ``gather``, ``reduce``, ``num_processes`` and
  ``process_index`` do the same inside a block. Outside it they span the world, where each TP
  group holds ``tp_size`` copies of one replica's values.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import MethodType

import accelerate
import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from .. import comm
from ..checkpoint import load_checkpoint, save_checkpoint
from ..data_parallel import replicate_data_parallel, shard_data_parallel
from ..info import get_tp_info, param_specs
from ..quantized import refuse_full_finetuning
from ..sharding import is_dtensor
from ..training import clip_params_grad_norm_
from .model import TPUsageError, save_dense, tp_model_of
from .resume import MANIFEST_NAME, check_resume, training_layout, write_manifest

#: The subdirectory of ``save_state``'s directory holding the training state (DCP) and its manifest.
STATE_DIR = "tpify_state"

__all__ = ["TPAccelerator", "DataParallelPlan", "data_parallel_plan"]


@dataclass(frozen=True)
class DataParallelPlan:
    """How a tpify model's data parallelism is applied, read from accelerate's switches.

    ``shard``: FSDP2 (HSDP with ``dp_replicate > 1``) through
    :func:`tpify.data_parallel.shard_data_parallel`, else DDP over the DP group.
    ``dp_replicate``/``dp_shard``/``tp_size``/``cp_size``: the sizes a ``ParallelismConfig`` asked for
    (``None``: the model's); checked against the model when it is prepared. The rest is passed
    to ``fully_shard``. ``source`` names where the plan came from, for messages.
    """

    shard: bool = False
    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    reshard_after_forward: bool | None = None
    mp_policy: object = None
    offload_policy: object = None
    blocks: tuple | None = None
    source: str = "default (DDP over the DP group)"


def _plugin_options(plugin) -> dict:
    """``fully_shard`` options from an accelerate ``FullyShardedDataParallelPlugin``.

    Raises:
        TPUsageError: FSDP version 1, FSDP's own activation checkpointing, a size-based or custom
            wrap policy, ignored modules, a mixed precision policy that is not FSDP2's.
    """
    version = getattr(plugin, "fsdp_version", 1)
    problems = []
    if version != 2:
        problems.append(f"fsdp_version={version} (FSDP1): use fsdp_version=2 (FSDP2's fully_shard)")
    if getattr(plugin, "activation_checkpointing", False):
        problems.append("activation_checkpointing=True (FSDP's own): use model.gradient_checkpointing_enable() "
                        "(Trainer: gradient_checkpointing=True), which keeps tpify's dropout streams")
    policy = getattr(plugin, "auto_wrap_policy", None)
    if policy is not None and getattr(policy, "__name__", "") != "transformer_auto_wrap_policy":
        problems.append(f"auto_wrap_policy {getattr(policy, '__name__', policy)!r}: tpify shards per transformer "
                        f"block (TRANSFORMER_BASED_WRAP, optionally transformer_cls_names_to_wrap)")
    if getattr(plugin, "ignored_modules", None):
        problems.append("ignored_modules: not supported with a tpify model")
    mp = getattr(plugin, "mixed_precision_policy", None)
    if mp is not None and not isinstance(mp, MixedPrecisionPolicy):
        problems.append(f"mixed_precision_policy {type(mp).__name__}: pass FSDP2's MixedPrecisionPolicy")
    if problems:
        raise TPUsageError("TPAccelerator: the FSDP plugin asks for what tpify does not support with a "
                           "tensor-parallel model: " + "; ".join(problems))
    offload = getattr(plugin, "cpu_offload", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if isinstance(names, str):
        names = names.split(",")
    return {"reshard_after_forward": getattr(plugin, "reshard_after_forward", None), "mp_policy": mp,
            "offload_policy": offload if isinstance(offload, OffloadPolicy) and type(offload) is not OffloadPolicy
            else None, "blocks": tuple(names) if names else None}


def data_parallel_plan(fsdp_plugin=None, parallelism_config=None) -> DataParallelPlan:
    """The :class:`DataParallelPlan` accelerate's switches ask for (local; no communication).

    ``fsdp_plugin``: an accelerate ``FullyShardedDataParallelPlugin`` (FSDP2 over the whole DP
    group, or as ``parallelism_config`` splits it); ``parallelism_config``: an accelerate
    ``ParallelismConfig`` (``dp_shard_size > 1``: FSDP2, HSDP with ``dp_replicate_size > 1``;
    else DDP; ``cp_size``: the model's context-parallel size, checked when it is prepared).
    Neither: DDP over the DP group.

    Raises:
        TPUsageError: what :func:`_plugin_options` refuses; a ``ParallelismConfig`` with
            sequence parallelism (``sp_size`` above 1: DeepSpeed's Ulysses).
    """
    options = _plugin_options(fsdp_plugin) if fsdp_plugin is not None else {}
    if parallelism_config is None:
        return DataParallelPlan(shard=fsdp_plugin is not None, source="an FSDP plugin" if fsdp_plugin else
                                DataParallelPlan.source, **options)
    pc = parallelism_config
    if (getattr(pc, "sp_size", 1) or 1) > 1:
        raise TPUsageError(f"TPAccelerator: ParallelismConfig(sp_size={pc.sp_size}) (DeepSpeed's Ulysses sequence "
                           f"parallelism) is not supported with a tpify model; for long sequences use context "
                           f"parallelism: parallelize the model on tpify.init_mesh(tp_size, cp_size=...) and pass "
                           f"ParallelismConfig(cp_size=...) (or nothing)")
    cp_size = getattr(pc, "cp_size", 1) or 1
    shard = (pc.dp_shard_size or 1) > 1 or fsdp_plugin is not None
    return DataParallelPlan(shard=shard, dp_replicate=pc.dp_replicate_size or 1, dp_shard=pc.dp_shard_size or 1,
                            tp_size=pc.tp_size or 1, cp_size=cp_size, source=f"ParallelismConfig(dp_replicate_size="
                            f"{pc.dp_replicate_size}, dp_shard_size={pc.dp_shard_size}, cp_size={cp_size}, "
                            f"tp_size={pc.tp_size})", **options)


@contextlib.contextmanager
def _hidden_from_accelerate():
    """accelerate builds an FSDP plugin or a ParallelismConfig from the environment
    (``accelerate launch --use_fsdp``): hide those switches while the accelerator is made (they are
    read into the tpify plan instead), then restore them."""
    keys = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _env_switches():
    """The FSDP plugin and ParallelismConfig that accelerate would build from the environment."""
    plugin = config = None
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        from accelerate import ParallelismConfig

        config = ParallelismConfig()
    return plugin, config


class TPAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that trains tpify models exactly (see the module docstring).

    Use it as ``Accelerator``: ``model, opt, dl = accelerator.prepare(model, opt, dl)``, then
    ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_(model.parameters(), 1.0)``,
    ``opt.step()``. Under torchrun with ``world = dp * cp * tp`` (``cp`` 1 without context
    parallelism; else ``model(**tpify.context_parallel.split_batch(batch, model))`` in the loop).

    Communication: that of the model and of torch's engine (DDP's bucketed all-reduces over DP,
    or FSDP2's all-gathers and reduce-scatters); ``clip_grad_norm_`` one all-reduce of one value
    over TP (under FSDP2 one of two values over the shard axis before it).

    Raises:
        TPUsageError: fp16 mixed precision (a per-rank inf check would let TP ranks diverge),
            DeepSpeed, an FSDP plugin of version 1 or with options tpify does not support
            (:func:`data_parallel_plan`), a ``ParallelismConfig`` whose sizes are not the
            model's, ``dispatch_batches``, a data loader
            prepared before any tpify model, two models with different groups, an FSDP model
            prepared without its optimizer in the same call while an optimizer holds state,
            ``get_state_dict``.
        ResumeError: (a TPUsageError) ``load_state`` of a state saved from another model or
            param groups.
    """

    def __init__(self, *args, fsdp_plugin=None, parallelism_config=None, **kwargs):
        env_plugin, env_config = _env_switches()
        plan = data_parallel_plan(fsdp_plugin if fsdp_plugin is not None else env_plugin,
                                  parallelism_config if parallelism_config is not None else env_config)
        with _hidden_from_accelerate():
            super().__init__(*args, **kwargs)
        self.set_data_parallel_plan(plan)

    def set_data_parallel_plan(self, plan: DataParallelPlan) -> None:
        """Use ``plan`` for the tpify models prepared from now on (:class:`~tpify.integrations.TPTrainer`
        sets the one Trainer's ``fsdp``/``fsdp_config``/``parallelism_config`` ask for)."""
        self.__dict__["_tpify_plan"] = plan

    def _plan(self) -> DataParallelPlan:
        return self.__dict__.get("_tpify_plan") or DataParallelPlan()

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

        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP) \
                or getattr(self, "parallelism_config", None) is not None:
            what = "DeepSpeed" if self.distributed_type == DistributedType.DEEPSPEED else "accelerate's own FSDP"
            raise TPUsageError(f"TPAccelerator: {what} is not supported with a tpify model: it would wrap or re-shard "
                               f"the tensor-parallel shards. Pass the FSDP plugin (version 2) or ParallelismConfig to "
                               f"TPAccelerator itself, which applies FSDP2 over the model's DP group")
        self._check_plan(info)
        models.append(tp_model)

    def _check_plan(self, info) -> None:
        """Refuse a plan whose sizes are not the model's (local; the same outcome on every rank)."""
        plan = self._plan()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        dp = world // (info.tp_size * info.cp_size)
        wanted = [(name, value, actual) for name, value, actual in (
            ("tp_size", plan.tp_size, info.tp_size),
            ("cp_size", plan.cp_size, info.cp_size),
            ("dp_replicate_size x dp_shard_size", None if plan.dp_replicate is None else plan.dp_replicate *
             plan.dp_shard, dp)) if value is not None and value != actual]
        if wanted:
            cp = f" x cp {info.cp_size}" if info.cp_size > 1 else ""
            raise TPUsageError(f"TPAccelerator: {plan.source} does not fit the tpify model: "
                               + "; ".join(f"{n} {v} asked, the model has {a}" for n, v, a in wanted)
                               + f" (world {world} = dp {dp}{cp} x tp {info.tp_size}). Ask for the model's sizes, "
                                 f"or parallelize the model with tpify.init_mesh(tp_size={plan.tp_size or info.tp_size}"
                                 f", cp_size={plan.cp_size or info.cp_size})")

    def _layout(self):
        models = self._tp_models()
        if not models:
            return None

        info = get_tp_info(models[0])
        if info.dp_group is None:  # no data parallelism (comm.group_size(None) would be the world's)
            return 1, 0, info
        return comm.group_size(info.dp_group), comm.group_rank(info.dp_group), info

    # -- accelerate's methods -------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        for obj in args:  # learn the layout first, whatever the argument order
            self.register_tp_model(obj)
            if isinstance(obj, torch.nn.Module) and tp_model_of(obj) is not None:
                refuse_full_finetuning(obj, "TPAccelerator.prepare")
        if self._plan().shard:
            self._shard(args)
        return super().prepare(*args, device_placement=device_placement)

    def _shard(self, args) -> None:
        """FSDP2 on each tpify model among ``args`` not sharded yet, then the optimizers among
        ``args`` pointed at the sharded parameters (by name), as accelerate does for FSDP2."""
        plan = self._plan()
        optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer)
                      or isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]
        for model in [m for m in args if isinstance(m, torch.nn.Module) and tp_model_of(m) is not None]:
            if any(is_dtensor(p) for p in model.parameters()):
                continue
            before = dict(model.named_parameters())
            stale = [o for o in optimizers if o.state_dict()["state"]]
            if stale:
                raise TPUsageError("TPAccelerator: an optimizer passed with the model already holds state; FSDP2 "
                                   "replaces the parameters: prepare the model and a fresh optimizer together")
            shard_data_parallel(model, dp_replicate=plan.dp_replicate, reshard_after_forward=plan.reshard_after_forward,
                                mp_policy=plan.mp_policy, offload_policy=plan.offload_policy, blocks=plan.blocks)
            after = dict(model.named_parameters())
            new = {id(p): after[name] for name, p in before.items()}
            for opt in optimizers:
                inner = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
                for group in inner.param_groups:
                    group["params"] = [new.get(id(p), p) for p in group["params"]]

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        self.register_tp_model(model)
        if tp_model_of(model) is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        sharded = any(is_dtensor(p) for p in model.parameters())
        if sharded:
            device_placement = False  # FSDP2 placed the shards
        # evaluation_mode=True: accelerate's placement, autocast and compile, without its DDP over the world.
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        self._outputs_to_fp32_after_hooks(prepared)
        if evaluation_mode or sharded or not any(p.requires_grad for p in model.parameters()):
            return prepared

        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        wrapped = replicate_data_parallel(prepared, **kwargs)  # DDP over the model's DP group (dp 1: unwrapped)
        if wrapped is not prepared:
            if self.ddp_handler is not None:
                self.ddp_handler.register_comm_hook(wrapped)
            self._models[:] = [wrapped if m is prepared or m is model else m for m in self._models]
        return wrapped

    def _outputs_to_fp32_after_hooks(self, model) -> None:
        """Mixed precision: accelerate wraps ``model.forward`` in autocast and a conversion of the
        outputs to float32; inside ``forward`` that conversion runs before the model's forward hooks,
        so tpify's parallel LM loss would see converted logits, not its LM head's output, and refuse
        them. Here ``forward`` keeps only the autocast, and the same conversion
        (``accelerate.utils.convert_to_fp32``) is a forward hook registered after tpify's: the loss
        is computed from the head's own output, the caller gets float32 outputs as with accelerate."""
        from accelerate.utils import convert_to_fp32, get_mixed_precision_context_manager

        original = getattr(model, "_original_forward", None)
        if not self.native_amp or original is None or not hasattr(original, "__func__"):
            return
        autocast = get_mixed_precision_context_manager(self.native_amp, self.autocast_handler)
        model.forward = MethodType(autocast(original.__func__), model)
        if not getattr(model, "_tpify_fp32_outputs", False):  # prepared again: the hook is there
            model.register_forward_hook(lambda module, args, output: convert_to_fp32(output))
            model._tpify_fp32_outputs = True

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
        Face checkpoint, or a PEFT model's dense adapter (for users and transformers);
        ``output_dir/tpify_state/`` the training state as a torch.distributed.checkpoint
        (:func:`tpify.checkpoint.save_checkpoint`: the models' parameters, the optimizers' and
        schedulers' states, accelerate's step counter, every rank's Python, NumPy, torch and
        tpify generators), each rank writing its pieces in parallel, and its manifest
        ``tpify_layout.json`` (:func:`~tpify.integrations.resume.training_layout`). The data
        position is the caller's, as with accelerate (``skip_first_batches``).

        Raises:
            TPUsageError: no ``output_dir`` (automatic checkpoint naming is not supported here).
        """
        if not self._tp_models():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if output_dir is None:
            raise TPUsageError("TPAccelerator.save_state needs output_dir for tpify models")

        out = Path(output_dir)
        for i, model in enumerate(self._models):
            self.save_model(model, out / ("model" if i == 0 else f"model_{i}"))
        models = [self.unwrap_model(m) for m in self._models]
        save_checkpoint(out / STATE_DIR, models, self._optimizers, self._schedulers, extra={"step": self.step})
        if self.process_index == 0:
            write_manifest(out / STATE_DIR, self._training_layout())

        comm.barrier()
        return str(out)

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        """Restore what :meth:`save_state` wrote, into the prepared models and optimizers in place,
        at this run's layout (any tp_size, dp_size, FSDP2 sharding; :func:`tpify.checkpoint.load_checkpoint`).

        First every rank compares the saved manifest with this run's
        (:func:`~tpify.integrations.resume.check_resume`: model class, adapters, every optimized
        parameter's dense shape, the param groups); then the state is read, each rank its pieces.
        Generators are restored exactly at the saved layout (else: :mod:`tpify.checkpoint`).

        Communication: one agreement (:func:`tpify.agree.agree`) before anything is read; then
        :func:`~tpify.checkpoint.load_checkpoint`'s.

        Raises:
            TPUsageError: no ``input_dir``.
            ResumeError: on every rank: the state was saved from another model or param groups
                (the message names what differs), has no manifest or the old per-rank one, or is
                incomplete.
            CheckpointError: the state does not fit the models.
        """
        if not self._tp_models():
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if input_dir is None:
            raise TPUsageError("TPAccelerator.load_state needs input_dir for tpify models")

        src = Path(input_dir) / STATE_DIR
        if not src.is_dir() and (Path(input_dir) / MANIFEST_NAME).is_file():
            src = Path(input_dir)  # the earlier per-rank format: check_resume refuses it, saying how to continue
        check_resume(src, self._training_layout(), "TPAccelerator.load_state", checkpoint=Path(input_dir),
                     files=[src / ".metadata"])
        models = [self.unwrap_model(m) for m in self._models]
        extra = load_checkpoint(src, models, self._optimizers, self._schedulers)
        self.step = extra["step"]

    def _training_layout(self) -> dict:
        models = [self.unwrap_model(m) for m in self._models] or self._tp_models()
        return training_layout(models, self._optimizers, written_by="TPAccelerator")

    # -- the DP-only view: what TRL's metrics and GRPO's generation batch are computed over ----------
    @contextlib.contextmanager
    def data_parallel_view(self):
        """Inside the block, ``gather``, ``reduce``, ``num_processes`` and ``process_index`` are
        over the DP group of the tpify models prepared (the TP ranks of a replica hold the same
        batch, so the world would hold each value ``tp_size`` times): what accelerate returns for
        the dense model trained on ``dp`` processes. A no-op at ``tp_size x cp_size == 1`` or before any tpify
        model is prepared; re-entrant.

        Communication: in the block, ``gather`` is one all-gather over DP
        (:func:`tpify.comm.all_gather_dim`), ``reduce`` one all-reduce over DP; every rank of the
        world must call them in the same order, as outside the view.
        """
        layout = self._layout()
        if layout is None or layout[2].tp_size * layout[2].cp_size == 1:
            yield self
            return
        previous = self.__dict__.get("_tpify_dp_view")
        self.__dict__["_tpify_dp_view"] = layout
        try:
            yield self
        finally:
            self.__dict__["_tpify_dp_view"] = previous

    def _dp_view(self):
        return self.__dict__.get("_tpify_dp_view")

    @property
    def num_processes(self):
        view = self._dp_view()
        return self.state.num_processes if view is None else view[0]

    @property
    def process_index(self):
        view = self._dp_view()
        return self.state.process_index if view is None else view[1]

    def gather(self, tensor):
        """accelerate's ``gather`` (every process's tensors concatenated along dim 0, a 0-d tensor
        as one row); inside :meth:`data_parallel_view` over the DP group only."""
        view = self._dp_view()
        if view is None:
            return super().gather(tensor)
        from accelerate.utils import recursively_apply

        def one(t):  # values, not a graph: accelerate's gather is not differentiable either
            t = t.detach()
            return comm.all_gather_dim(t.reshape(1) if t.dim() == 0 else t, 0, view[2].dp_group)

        return recursively_apply(one, tensor, error_on_other_type=True)

    def gather_object(self, obj: list) -> list:
        """accelerate's ``gather_object`` (every process's list, concatenated); inside
        :meth:`data_parallel_view` over the DP group only."""
        view = self._dp_view()
        if view is None:
            from accelerate.utils import gather_object

            return gather_object(obj)

        return [x for part in comm.all_gather_objects(obj, view[2].dp_group) for x in part]

    def reduce(self, tensor, reduction="sum", scale=1.0):
        """accelerate's ``reduce`` (``"sum"``, ``"mean"``, ``"max"``); inside
        :meth:`data_parallel_view` over the DP group only."""
        view = self._dp_view()
        if view is None:
            return super().reduce(tensor, reduction=reduction, scale=scale)
        from accelerate.utils import recursively_apply

        def one(t):
            out = comm.all_reduce(t.detach().clone(), view[2].dp_group, "max" if reduction == "max" else "sum")
            return out / view[0] if reduction == "mean" else out

        return recursively_apply(one, tensor, error_on_other_type=True)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        """As accelerate's, over the DP group only (:meth:`data_parallel_view`): the TP ranks of a
        replica hold the same batch, so each sample counts once.

        Raises:
            TPUsageError: ``use_gather_object=True`` (or non-tensor data) at ``tp_size x cp_size > 1``.
        """
        layout = self._layout()
        if layout is not None and layout[2].tp_size * layout[2].cp_size > 1 and use_gather_object:
            raise TPUsageError("TPAccelerator.gather_for_metrics supports tensors only for tpify models")
        with self.data_parallel_view():
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)

    @contextlib.contextmanager
    def no_sync(self, model):
        """As accelerate's: no DP reduction of the gradients in the block (DDP's ``no_sync``; for a
        model FSDP2 shards, ``set_requires_gradient_sync(False)``: the unsharded gradients
        accumulate until a backward outside the block reduce-scatters them)."""
        tp_model = tp_model_of(model)
        if tp_model is not None and hasattr(tp_model, "set_requires_gradient_sync"):
            tp_model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                tp_model.set_requires_gradient_sync(True)
            return
        with super().no_sync(model):
            yield
