"""PEFT models on a tpify model: adapters added, trained, loaded and saved as PEFT's own.

The adapter layer is :class:`~tpify.integrations.lora.LoraTPLinear`; this module connects it
through PEFT's extension points, without patching PEFT: the layer mapping
(``LoraConfig._register_custom_module``), ``target_modules="all-linear"`` resolved with the
parallel layers counted as linear, dense adapter files sliced on load (a ``load_state_dict``
pre-hook) and gathered on save (:func:`save_adapter`), ``modules_to_save`` copies that stay
parallel. Plain ``peft.PeftModel.from_pretrained(tp_model, dir)`` fails with PEFT's "Target
module ColumnParallelLinear(...) is not supported": use :func:`load_peft_adapter`. Each seam:
docs/training.md, "tpify/integrations/peft.py".
"""

from __future__ import annotations

import types

from peft import LoraConfig, PeftConfig, PeftModel
from peft import get_peft_model as _peft_get_peft_model
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from ..hf_modules import is_conv1d
from ..info import TPUsageError, find_tp_model, get_tp_info, param_specs, record_specs
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..quantized import check_lora_on_quantized
from ..sharding import is_dtensor, shard_spec_of
from .lora import LoraTPLinear

__all__ = ["LoraTPLinear", "get_peft_model", "load_peft_adapter", "save_adapter", "load_adapter_",
           "resolve_target_modules"]

# the parts of a PEFT parameter name that mark an adapter's tensors (LoRA factors, DoRA magnitudes,
# modules_to_save copies): what is saved, and what a dense adapter file may hold
_ADAPTER_MARKS = ("lora_", "modules_to_save.")


def _is_adapter_key(name: str) -> bool:
    return any(mark in name for mark in _ADAPTER_MARKS)


# -- configs --------------------------------------------------------------------------------------
def _all_linear_names(model: nn.Module, config: LoraConfig) -> set[str]:
    """PEFT's ``"all-linear"`` on a tpify model: the names PEFT gives on the dense model.

    PEFT's rule: every ``nn.Linear`` and ``Conv1D`` (and adapter layer whose class name says
    ``Linear``), except, on a transformers model, the output embedding (``get_output_embeddings()``)
    or, when it has none and the task is sequence classification, the first of PEFT's classifier
    head names; never a module inside an adapter layer. tpify's parallel linear layers count as
    linear (they stand for the dense ``nn.Linear`` / ``Conv1D``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES
    from peft.utils.peft_types import TaskType
    from transformers import PreTrainedModel

    linear = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    names = {name for name, m in model.named_modules()
             if isinstance(m, linear) or is_conv1d(m)
             or (isinstance(m, BaseTunerLayer) and "Linear" in type(m).__name__)}
    heads = []
    if isinstance(model, PreTrainedModel):
        output = model.get_output_embeddings()
        if output is not None:
            heads = [output]
        elif config.task_type == TaskType.SEQ_CLS:
            heads = [getattr(model, n) for n in SEQ_CLS_HEAD_NAMES if getattr(model, n, None) is not None][:1]
    for head in heads:
        names.discard(next(name for name, m in model.named_modules() if m is head))
    for prefix, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):  # no adapter on an adapter's own parts
            names -= {f"{prefix}.{suffix}" for suffix, _ in m.named_modules() if suffix}
    return names


def resolve_target_modules(model: nn.Module, config: LoraConfig) -> None:
    """Resolve ``target_modules="all-linear"`` (any case) of ``config`` in place to the module names
    PEFT adapts on the dense model (:func:`_all_linear_names`); other values are left as they are
    (PEFT matches names and regular expressions by module name, which surgery keeps)."""
    from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

    targets = getattr(config, "target_modules", None)
    if isinstance(targets, str) and targets.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND:
        config.target_modules = _all_linear_names(model, config)


# LoraConfig options that would read or copy whole tensors of sharded layers: refused by name
_REFUSED_CONFIG = {
    "trainable_token_indices": "PEFT's trainable tokens index the embedding table by token id, and each rank "
                               "holds only its vocabulary rows: train the embedding with modules_to_save instead",
    "layer_replication": "PEFT's layer replication copies decoder layers, with their parallel layers and hooks",
    "target_parameters": "LoRA on nn.Parameter targets reads the whole parameter; target the modules instead",
}


def _prepare_config(model: nn.Module, config, what: str) -> None:
    """Make ``config`` adapt ``model``'s parallel layers with :class:`LoraTPLinear` (PEFT's custom
    module mapping) and resolve ``"all-linear"``.

    Raises:
        TPUsageError: a PEFT method other than LoRA; ``trainable_token_indices``,
            ``layer_replication`` or ``target_parameters`` (:data:`_REFUSED_CONFIG`).
    """
    if not isinstance(config, LoraConfig):
        raise TPUsageError(f"{what}: tpify supports LoRA (and DoRA) adapters on tensor-parallel models, not "
                           f"{type(config).__name__}")
    refused = [f"{name} ({why})" for name, why in _REFUSED_CONFIG.items() if getattr(config, name, None)]
    if refused:
        raise TPUsageError(f"{what}: {'; '.join(refused)}: not supported on a tensor-parallel model")
    resolve_target_modules(model, config)
    _refuse_shared_latents(model, config, what)
    check_lora_on_quantized(model, config, what)
    config._register_custom_module({ColumnParallelLinear: LoraTPLinear, RowParallelLinear: LoraTPLinear})


def _refuse_shared_latents(model: nn.Module, config, what: str) -> None:
    """Refuse LoRA on a ``latent`` module with shared features (multi-head latent attention's
    ``kv_a_proj_with_mqa``): tpify sums the gradient of the base layer's rotary-key features
    (:mod:`tpify.styles.latent`), not that of an adapter's output added after it, whose factors
    would then get a partial gradient on each rank, different replicas of one adapter.

    Raises:
        TPUsageError: the config targets such a module (every rank: the layout is the same).
    """
    layout = get_tp_info(model).layout
    tp_model = find_tp_model(model)
    names = {id(m): n for n, m in model.named_modules()}
    hit = []
    for fqn, entry in layout.modules.items():
        if entry.shared_features:  # a latent projection's features every head reads (style 'latent')
            name = names.get(id(tp_model.get_submodule(fqn)), fqn)
            if check_target_module_exists(config, name):
                hit.append(name)
    if hit:
        raise TPUsageError(f"{what}: target_modules adapts {sorted(hit)}, multi-head latent attention's projection of "
                           f"the latent and the rotary key (style 'latent'), whose rotary-key gradient tpify sums for "
                           f"the base layer only: an adapter there would train differently on each rank. Leave it "
                           f"out of target_modules (adapt q_a_proj, q_b_proj, kv_b_proj, o_proj)")


def _check_model(model: nn.Module, what: str, low_cpu_mem_usage: bool) -> None:
    """Refuse, before PEFT touches it, a model tpify cannot put adapters on.

    Raises:
        ValueError: ``model`` was not parallelized by tpify.
        TPUsageError: FSDP2-sharded parameters; ``low_cpu_mem_usage=True``.
    """
    get_tp_info(model)
    if any(is_dtensor(p) for p in model.parameters()):
        raise TPUsageError(f"{what}: the model's parameters are DTensors (FSDP2's fully_shard); add the adapters "
                           f"before sharding: {what} first, then tpify.shard_data_parallel (LoRA under FSDP2 x TP)")
    if low_cpu_mem_usage:
        raise TPUsageError(f"{what}: low_cpu_mem_usage=True loads with load_state_dict(assign=True), which drops "
                           f"the tensor-parallel split of each adapter parameter; call it without")


# -- loading dense adapter tensors ----------------------------------------------------------------
class _DenseAdapterSlices:
    """``load_state_dict`` pre-hook of a tpify model under PEFT: each dense adapter tensor (as in a
    standard adapter file, which PEFT's ``set_peft_model_state_dict`` passes on) is replaced by
    this rank's slice, read through its parameter's ShardSpec (vocabulary padding added). A tensor
    already of the parameter's local shape is left as it is. No communication. The model's own
    check (:class:`tpify.hooks.state_dict.CheckShards`, registered first) has usually sliced them
    already; this one also covers adapters whose spec PEFT's upcast dropped before it runs.

    Raises:
        TPUsageError: (every rank alike: the same file) an adapter tensor of neither the dense nor
            the local shape, naming both; ``assign=True`` (``low_cpu_mem_usage``), which would
            replace the parameters by tensors without their split.
    """

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
        _attach_specs(module)  # PeftModel.from_pretrained upcasts half-precision adapters before it loads
        rank = get_tp_info(module).tp_rank
        problems = []
        for name, param in module.named_parameters(remove_duplicate=False):
            key, spec = prefix + name, shard_spec_of(param)
            if spec is None or key not in state_dict or not _is_adapter_key(name):
                continue
            if local_metadata.get("assign_to_params_buffers"):
                raise TPUsageError("loading an adapter with assign=True (PEFT's low_cpu_mem_usage=True) would drop "
                                   f"the tensor-parallel split of {key}; load without low_cpu_mem_usage")
            value = state_dict[key]
            dense = list(param.shape)
            dense[spec.dim] = spec.global_size
            if list(value.shape) == list(param.shape):
                continue
            if list(value.shape) != dense:
                problems.append(f"{key}: shape {list(value.shape)}, expected the dense {dense} or this rank's "
                                f"{list(param.shape)}")
                continue
            state_dict[key] = spec.slice_dense(value, rank)
        if problems:
            raise TPUsageError(f"the adapter does not fit the tensor-parallel model's adapters ({len(problems)} "
                               f"tensors): {problems[:10]}")


def _attach_specs(model: nn.Module) -> None:
    """:meth:`LoraTPLinear.attach_specs` on every adapter layer of ``model`` (PEFT replaces the
    adapter parameters of half-precision models when it upcasts them)."""
    for m in model.modules():
        if isinstance(m, LoraTPLinear):
            m.attach_specs()


def _slice_dense_adapters_on_load(tp_model: nn.Module) -> None:
    """Register :class:`_DenseAdapterSlices` on ``tp_model`` (once)."""
    if not any(isinstance(getattr(h, "hook", h), _DenseAdapterSlices)
               for h in tp_model._load_state_dict_pre_hooks.values()):
        tp_model.register_load_state_dict_pre_hook(_DenseAdapterSlices())


# -- the PEFT model ----------------------------------------------------------------------------------
def _add_adapter(self: PeftModel, adapter_name: str, peft_config, low_cpu_mem_usage: bool = False,
                 autocast_adapter_dtype: bool = True) -> None:
    """``PeftModel.add_adapter`` on a tpify model (installed on the PEFT models tpify returns; PEFT's
    ``load_adapter`` calls it for a new adapter): the config is prepared first (:func:`_prepare_config`).

    Communication: DoRA on row-parallel layers: one all-reduce of ``out`` values per layer.

    Raises:
        TPUsageError: a method other than LoRA; ``low_cpu_mem_usage=True``.
    """
    _check_model(self.get_base_model(), "add_adapter", low_cpu_mem_usage)
    _prepare_config(self.get_base_model(), peft_config, "add_adapter")
    type(self).add_adapter(self, adapter_name, peft_config, low_cpu_mem_usage=low_cpu_mem_usage,
                           autocast_adapter_dtype=autocast_adapter_dtype)
    _attach_specs(self)


def _as_tpify_peft_model(peft_model: PeftModel) -> PeftModel:
    """Give a PEFT model on a tpify model its dense ``save_pretrained`` and its ``add_adapter``; its
    adapters' ShardSpecs (again: PEFT upcasts half-precision adapters by new parameters)."""
    _attach_specs(peft_model)
    record_specs(find_tp_model(peft_model))  # the adapters' specs by name, read back once FSDP2 shards them
    peft_model.save_pretrained = types.MethodType(save_adapter, peft_model)
    peft_model.add_adapter = types.MethodType(_add_adapter, peft_model)
    return peft_model


def get_peft_model(model: nn.Module, peft_config: LoraConfig, adapter_name: str = "default", **kwargs) -> PeftModel:
    """``peft.get_peft_model`` for a tpify-parallelized model: LoRA or DoRA on tensor-parallel layers.

    Prepares ``peft_config`` (:class:`LoraTPLinear` registered for the parallel layers, PEFT's
    custom-module extension point; ``"all-linear"`` resolved to the names PEFT adapts on the dense
    model), calls ``peft.get_peft_model``, and gives the returned model a ``save_pretrained`` that
    writes the dense adapter (:func:`save_adapter`) and an ``add_adapter`` (hence ``load_adapter``)
    that prepares new configs alike; dense adapter files load sliced (``load_adapter``,
    ``set_peft_model_state_dict``). Only the adapters (and ``modules_to_save``, each copy of a
    parallel layer sharded as its original) train, as in PEFT. Call it with the same random state
    on every rank (the adapters are initialised like PEFT's, identically on every rank).

    Communication: none; DoRA on row-parallel layers: one all-reduce of ``out`` values per layer
    (the magnitude is the dense weight's norm).

    Raises:
        ValueError: ``model`` was not parallelized by tpify; an option :class:`LoraTPLinear`
            refuses (LoRA variants other than DoRA, whole-weight initialisations).
        TPUsageError: a PEFT method other than LoRA; FSDP2-sharded parameters;
            ``low_cpu_mem_usage=True``; ``trainable_token_indices``, ``layer_replication``,
            ``target_parameters``.
    """
    _check_model(model, "get_peft_model", kwargs.get("low_cpu_mem_usage", False))
    _prepare_config(model, peft_config, "get_peft_model")
    _slice_dense_adapters_on_load(model)
    return _as_tpify_peft_model(_peft_get_peft_model(model, peft_config, adapter_name=adapter_name, **kwargs))


def load_peft_adapter(model: nn.Module, model_id, adapter_name: str = "default", is_trainable: bool = False,
                      **kwargs) -> PeftModel:
    """``peft.PeftModel.from_pretrained(model, model_id)`` for a tpify-parallelized model.

    Reads the adapter's config from ``model_id`` (a standard adapter directory, as dense PEFT or
    :func:`save_adapter` writes it), prepares it as :func:`get_peft_model` does, and calls PEFT's
    ``PeftModel.from_pretrained`` with it: each rank keeps its slice of every dense tensor
    (LoRA factors, DoRA magnitudes, ``modules_to_save`` copies). The returned model is a PEFT model
    as :func:`get_peft_model` returns one (``load_adapter`` / ``set_adapter`` for more adapters,
    ``save_pretrained`` dense). ``kwargs`` go to ``PeftModel.from_pretrained``.

    Communication: the agreement of the model's ``load_state_dict`` (the store, no collective:
    :mod:`tpify.hooks.state_dict`; every rank calls it); DoRA on row-parallel layers: one all-reduce
    of ``out`` values per layer.

    Raises:
        ValueError: ``model`` was not parallelized by tpify; an option :class:`LoraTPLinear` refuses.
        TPUsageError: not a LoRA adapter; an adapter tensor of neither the dense nor the local shape
            (every rank); ``low_cpu_mem_usage=True``.
    """
    _check_model(model, "load_peft_adapter", kwargs.get("low_cpu_mem_usage", False))
    config = kwargs.pop("config", None)
    if config is None:
        hub = {k: kwargs[k] for k in ("subfolder", "revision", "cache_dir", "token") if k in kwargs}
        config = PeftConfig.from_pretrained(str(model_id), **hub)
    _prepare_config(model, config, "load_peft_adapter")
    _slice_dense_adapters_on_load(model)
    peft_model = PeftModel.from_pretrained(model, str(model_id), adapter_name=adapter_name, is_trainable=is_trainable,
                                           config=config, **kwargs)
    return _as_tpify_peft_model(peft_model)


# -- saving ------------------------------------------------------------------------------------------
def save_adapter(peft_model: PeftModel, save_directory, **kwargs) -> None:
    """Write the dense adapter directory of a PEFT model on a tpify model (a collective).

    Every sharded adapter tensor (LoRA factors, DoRA magnitudes, ``modules_to_save`` copies of
    parallel layers) is all-gathered to its dense, unpadded shape, then global rank 0 writes with
    PEFT's own ``save_pretrained`` (``adapter_model.safetensors`` + ``adapter_config.json``; more
    adapters in subdirectories, as PEFT), so plain ``peft.PeftModel.from_pretrained(dense_model,
    dir)`` loads it. Installed as the PEFT model's ``save_pretrained`` by :func:`get_peft_model`;
    every rank must call it.

    Communication: one all-gather over TP per sharded adapter tensor (under FSDP2, before it, one
    all-gather over DP per adapter tensor); one all-reduce of one int over the world (:func:`tpify.agree.on_writing_rank`: a failed write raises on every rank).

    Raises:
        TPUsageError: ``state_dict=`` given (local shards cannot be the dense adapter).
    """
    from ..agree import on_writing_rank

    if kwargs.pop("state_dict", None) is not None:
        raise TPUsageError("save_pretrained of a tensor-parallel PEFT model takes no state_dict=; every rank calls "
                           "it and the dense adapter is gathered")
    kwargs.pop("is_main_process", None)
    group = get_tp_info(find_tp_model(peft_model)).tp_group
    params = dict(peft_model.named_parameters(remove_duplicate=False))
    specs = param_specs(peft_model)  # also for DTensor adapters (FSDP2), by the names recorded
    full = {}
    for name, value in peft_model.state_dict().items():  # the same order on every rank
        if _is_adapter_key(name):
            spec = specs.get(id(params[name])) if name in params else None
            value = value.full_tensor() if is_dtensor(value) else value  # FSDP2: gathered over DP first
            full[name] = (spec.gather(value, group) if spec is not None else value).cpu()
    with on_writing_rank(f"writing the adapter to {save_directory}", next(peft_model.parameters()).device) as writing:
        if writing:
            kwargs.setdefault("save_embedding_layers", False)
            PeftModel.save_pretrained(peft_model, str(save_directory), state_dict=full, is_main_process=True,
                                      safe_serialization=True, **kwargs)


def load_adapter_(peft_model: PeftModel, path, adapter_name: str = "default") -> None:
    """Read a dense adapter directory (as :func:`save_adapter` writes it) into the existing adapter
    ``adapter_name`` in place, each rank its slices (PEFT's ``set_peft_model_state_dict``).

    Communication: the agreement of the model's ``load_state_dict`` (the store, no collective:
    :mod:`tpify.hooks.state_dict`); every rank of the model calls it.

    Raises:
        TPUsageError: a tensor the adapter needs is missing from the file, or the file holds one the
            adapter does not have, or one of another shape.
    """
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if any(is_dtensor(p) for p in peft_model.parameters()):
        raise TPUsageError(f"load_adapter_: the model's parameters are DTensors (FSDP2's fully_shard); load the "
                           f"adapter {path} before sharding with tpify.shard_data_parallel")
    _slice_dense_adapters_on_load(find_tp_model(peft_model))
    result = set_peft_model_state_dict(peft_model, load_peft_weights(str(path), device="cpu"),
                                       adapter_name=adapter_name)
    missing = [k for k in result.missing_keys if _is_adapter_key(k) and f".{adapter_name}" in k]
    if missing or result.unexpected_keys:
        raise TPUsageError(f"adapter {path} does not fit the model's adapter {adapter_name!r}: missing "
                           f"{missing[:10]}, unexpected {list(result.unexpected_keys)[:10]}")
