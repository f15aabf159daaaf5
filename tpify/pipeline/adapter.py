"""PEFT adapters (LoRA, DoRA) on pipeline stages: the dense adapter saved by stage, and merged.

A PEFT model's HF model cut into stages (:func:`tpify.pipeline.pipeline` on
``peft_model.base_model.model``) keeps its adapter layers under their global names, so each
stage's adapter tensors are the dense adapter's tensors of that stage's layers.
:func:`save_adapter` gathers them over each stage's TP group and writes ONE standard PEFT
directory (``adapter_config.json`` + ``adapter_model.safetensors`` with the dense model's keys):
plain ``peft.PeftModel.from_pretrained(dense_model, path)`` loads it.
:func:`merge_adapters` merges them into the base weights, stage by stage, and removes the adapter
layers (PEFT's ``merge_and_unload``), so :func:`tpify.pipeline.save_pretrained` writes the merged
dense model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..agree import agree
from ..info import param_specs, tp_info_of
from ..sharding import is_dtensor
from .plan import PipelineError
from .split import PipelineInfo

__all__ = ["save_adapter", "merge_adapters"]

#: The prefix PEFT's saved keys carry (a ``PeftModel``'s ``base_model.model.``).
PEFT_PREFIX = "base_model.model."


def _info(schedule_or_info) -> PipelineInfo:
    return getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)


def _peft_config(info: PipelineInfo, adapter_name: str, what: str):
    """The adapter's PEFT config (PEFT keeps it on the HF model it adapted: ``model.peft_config``).

    Raises:
        PipelineError: no PEFT adapter ``adapter_name`` on the stages; an adapter with trainable
            copies of whole modules (``modules_to_save``, trainable tokens: not built here); stages
            under a data-parallel engine (not built). The same on every rank.
    """
    from peft.utils.other import AuxiliaryTrainingWrapper

    configs = getattr(info.stages[0].model, "peft_config", None) or {}
    if adapter_name not in configs:
        raise PipelineError(f"{what}: the stages hold no PEFT adapter {adapter_name!r} (adapters: {sorted(configs)}); "
                            f"cut the HF model of a PEFT model (peft_model.base_model.model) into stages")
    wrapped = sorted({n for s in info.stages for n, m in s.model.named_modules()
                      if isinstance(m, AuxiliaryTrainingWrapper)})
    if wrapped:
        raise PipelineError(f"{what}: modules_to_save / trainable tokens ({wrapped[:3]}) on pipeline stages are not "
                            f"built; adapt with LoRA / DoRA layers only")
    if info.data_parallel is not None:
        raise PipelineError(f"{what} of stages under {info.data_parallel!r} (DTensor parameters) is not built: use a "
                            f"pipeline without data-parallel replicas (dp 1)")
    return configs[adapter_name]


def _stage_adapter(stage, adapter_name: str) -> dict[str, torch.Tensor]:
    """One stage's dense adapter tensors under PEFT's saved keys (``base_model.model.<name>``, the
    adapter name removed: PEFT's ``get_peft_model_state_dict``), on the CPU. Collective over the
    TP group: one all-gather per sharded adapter tensor, in the same order on every rank."""
    from peft.utils import get_peft_model_state_dict

    model = stage.model
    specs = param_specs(model) if tp_info_of(model) is not None else {}
    group = tp_info_of(model).tp_group if tp_info_of(model) is not None else None
    dense = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # the same order on every rank of the stage
        if "lora_" not in name:
            continue
        local = p.detach()
        spec = specs.get(id(p))
        dense[name] = (spec.gather(local, group) if spec is not None else local).cpu()
    out = get_peft_model_state_dict(model, state_dict=dense, adapter_name=adapter_name, save_embedding_layers=False)
    return {PEFT_PREFIX + k: v.contiguous() for k, v in out.items()}


def save_adapter(schedule_or_info, path: str | os.PathLike, adapter_name: str = "default") -> None:
    """Write the dense adapter of a pipeline's PEFT model as ONE standard PEFT directory
    (``adapter_model.safetensors`` with the dense model's keys, ``adapter_config.json``), which
    plain ``peft.PeftModel.from_pretrained(dense_model, path)`` loads (and
    :func:`tpify.integrations.load_peft_adapter` at any tp).

    Each stage's adapter tensors are gathered to their dense shapes over its TP group; the rank at
    tp coordinate 0 of each stage sends them to global rank 0, which merges the stages and writes
    the files as ``PeftModel.save_pretrained`` does (the config with ``inference_mode=True``).
    Every rank of the world calls it.

    Communication: one agreement; per sharded adapter tensor one all-gather over TP; one
    ``all_gather_object`` of the stages' adapter tensors (rank 0 keeps them) over the world; one
    agreement on the write (:func:`tpify.agree.on_writing_rank`).

    Raises:
        PipelineError: on every rank: ``path`` is a file; no PEFT adapter ``adapter_name`` on the
            stages (or merged already: no adapter tensor on any stage); ``modules_to_save`` or
            trainable tokens; stages under a data-parallel engine; two stages holding one key.
        RuntimeError: the write failed (its error on rank 0, this one on the others).
    """
    from safetensors.torch import save_file

    from ..agree import on_writing_rank

    info = _info(schedule_or_info)
    path = Path(path)
    error, config = None, None
    try:
        if path.is_file():
            raise PipelineError(f"save_adapter: {path} is a file; pass a directory")
        config = _peft_config(info, adapter_name, "tpify.pipeline.save_adapter")
    except PipelineError as e:
        error = e
    agree("tpify.pipeline.save_adapter", {"path": str(path), "adapter": adapter_name}, error)
    writer = all(c == 0 for c in info.mesh.get_coordinate()[1:])  # tp (cp, dp) coordinate 0: one sender per stage
    mine = {}
    for stage in info.stages:
        tensors = _stage_adapter(stage, adapter_name)
        if writer:
            mine.update(tensors)
    everyone = comm.all_gather_objects(mine, None)
    merged: dict[str, torch.Tensor] = {}
    doubled = []
    for part in everyone:
        doubled += [k for k in part if k in merged]
        merged.update(part)
    if doubled:  # a parameter two stages hold: a tie the adapter layers must not have
        raise PipelineError(f"save_adapter: adapter keys held by two stages: {doubled[:3]}")
    if not merged:  # every rank sees every stage's part: the same decision everywhere
        raise PipelineError(f"save_adapter: the stages hold no tensor of the adapter {adapter_name!r} (merged "
                            f"already?); nothing written to {path}")
    device = next(p.device for s in info.stages for p in s.parameters())
    with on_writing_rank(f"writing the adapter to {path}", device) as writing:
        if writing:
            import copy

            path.mkdir(parents=True, exist_ok=True)
            save_file(dict(sorted(merged.items())), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
            config = copy.copy(config)
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = info.stages[0].model.__dict__.get("name_or_path", None) or None
            config.inference_mode = True
            auto = None
            if config.task_type is None:  # as PeftModel.save_pretrained: the class a plain PeftModel adapted
                cls = type(info.stages[0].model)
                auto = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
            config.save_pretrained(str(path), auto_mapping_dict=auto)


def merge_adapters(schedule_or_info) -> int:
    """Merge every adapter layer of this rank's stages into its base layer and put the base layer
    in its place (PEFT's ``merge_and_unload``, stage by stage; tpify's LoRA layers merge each
    rank's slice of ``B A`` into its shard), in place; returns the count merged. The stages then
    hold the merged dense model's layers (and no ``peft_config``: :func:`save_adapter` refuses
    them): :func:`tpify.pipeline.save_pretrained` writes it.

    Communication: none (DoRA on a row-parallel base: one all-reduce over TP per layer).

    Raises:
        PipelineError: as :func:`save_adapter`'s checks (no adapter, ``modules_to_save``, an engine),
            on every rank (the layout is the same).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    info = _info(schedule_or_info)
    name = next(iter(getattr(info.stages[0].model, "peft_config", None) or {"default": None}))
    _peft_config(info, name, "tpify.pipeline.merge_adapters")
    n = 0
    for stage in info.stages:
        for parent in list(stage.model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, BaseTunerLayer):
                    child.merge()
                    setattr(parent, child_name, child.get_base_layer())
                    n += 1
        del stage.model.peft_config  # as PEFT's unload: the stage holds no adapter now (its own shell's dict)
    return n
