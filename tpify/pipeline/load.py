"""Loading and saving by stage: each rank reads only its stages' tensors (and only its TP slices
of them); the dense save writes one file per stage into one plain Hugging Face directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..agree import agree
from ..api import from_pretrained as _from_pretrained
from ..checkpoint import dense_state_dict
from ..dcp_entries import tp_shard
from ..info import tp_info_of
from ..io.keys import saved_tensors
from .plan import PipelineError
from .split import PipelineInfo, plan_stages
from .stage import trim_model

__all__ = ["from_pretrained", "save_pretrained", "cut_for_rank"]


def cut_for_rank(model: nn.Module, mesh, n_virtual: int = 1, split_points=None, style: str = "loop",
                 recipe=None) -> None:
    """Remove from ``model``, in place, every module this rank's stages do not hold (the layers of
    other stages; the embeddings unless it holds the first stage; the final norm and head unless
    it holds the last) and record the cut (``model.tpify_pipeline_cut``), which
    :func:`tpify.pipeline.split_model` checks. Pure checks, then local.

    Raises:
        PipelineError: as :func:`tpify.pipeline.split_model` (the same on every rank).
    """
    plan, ranges, mine = plan_stages(model, mesh, n_virtual, split_points, style, recipe)
    layers = {i for s in mine for i in ranges[s]}
    trim_model(model, plan, layers, first=0 in mine, last=len(ranges) - 1 in mine)
    model.tpify_pipeline_cut = (tuple(ranges), tuple(mine), plan)


def from_pretrained(path: str | os.PathLike, mesh, *, n_virtual: int = 1, split_points: list[int] | None = None,
                    style: str = "loop", **kwargs) -> nn.Module:
    """:func:`tpify.from_pretrained` on a mesh with a ``"pp"`` axis: the model built on the meta
    device and parallelized over ``mesh``'s tp axis, then cut to this rank's stages before
    anything is read, so each rank reads only its stages' tensors, and of those only its TP
    slices. Returns that model (pass it to :func:`tpify.pipeline.pipeline` with the same
    ``n_virtual``, ``split_points`` and ``style``).

    ``kwargs``: :func:`tpify.from_pretrained`'s (``dtype``, ``recipe``, ...).
    Communication and Raises: :func:`tpify.from_pretrained`'s; PipelineError as
    :func:`tpify.pipeline.split_model` (the same on every rank).
    """
    recipe = kwargs.get("recipe")

    def cut(model):
        cut_for_rank(model, mesh, n_virtual, split_points, style, recipe)

    return _from_pretrained(path, mesh=mesh, stage_cut=cut, **kwargs)


def _stage_tensors(stage) -> dict[str, torch.Tensor]:
    """The dense tensors of one stage as transformers saves them (tied copies left out): a
    DTensor (FSDP2 / HSDP / ``replicate`` on the stage) gathered over the dp mesh
    (``full_tensor``), then a TP shard over the TP group. Collective over dp and TP (one
    all-gather each per tensor), in the same order on every rank of the stage."""
    if tp_info_of(stage.model) is not None:
        return dense_state_dict(stage.model)
    return {k: tp_shard(t).contiguous() for k, t in saved_tensors(stage.model)}


def save_pretrained(schedule_or_info, path: str | os.PathLike) -> None:
    """Save the pipeline's model as one plain Hugging Face directory: one safetensors file per
    stage (``model-0000s-of-0000S.safetensors``), one ``model.safetensors.index.json``, the dense
    ``config.json``; transformers' and tpify's ``from_pretrained`` load it at any layout.

    Each stage's tensors are gathered to their dense layout: under FSDP2 / HSDP / ``replicate``
    (:mod:`tpify.pipeline.data_parallel`) first over the dp mesh (``full_tensor``), then over its
    TP group; the rank at tp, cp and dp coordinate 0 of each stage writes its file (one writer
    per stage); global rank 0 writes the index and config.
    Not atomic (unlike :func:`tpify.save_pretrained`), so it refuses a directory that already
    holds weights (files of an older save would mix with the new ones): write to a new directory.

    Communication: one agreement; per DTensor one all-gather over dp, per sharded tensor one over
    TP; one ``all_gather_object`` of the file names and keys (or a writer's error) over the world;
    a barrier.

    Raises:
        PipelineError: on every rank: ``path`` is a file or holds ``*.safetensors`` /
            ``*.safetensors.index.json`` / ``pytorch_model*.bin`` files; a writer failed (its
            rank and error named; the index is then not written, so nothing loads the partial
            directory).
    """
    info: PipelineInfo = getattr(schedule_or_info, "tpify_pipeline", schedule_or_info)
    path = Path(path)
    error = PipelineError(f"save_pretrained: {path} is a file; pass a directory") if path.is_file() else None
    held = sorted(f.name for pattern in ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
                  for f in path.glob(pattern)) if path.is_dir() else []
    if error is None and held:
        error = PipelineError(f"save_pretrained: {path} already holds weights ({', '.join(held[:3])}"
                              f"{', ...' if len(held) > 3 else ''}); a pipeline save is not atomic and would mix its "
                              "files with them: save into a new directory (or remove the old save first)")
    agree("tpify.pipeline.save_pretrained", {"path": str(path)}, error)
    coords = info.mesh.get_coordinate()
    writer = all(c == 0 for c in coords[1:])  # tp, cp and dp coordinates 0: one writer per stage
    written = {}
    for stage in info.stages:
        tensors = _stage_tensors(stage)
        name = f"model-{stage.stage_index + 1:05d}-of-{info.num_stages:05d}.safetensors"
        if writer and "error" not in written:
            from safetensors.torch import save_file

            try:
                path.mkdir(parents=True, exist_ok=True)
                save_file({k: t.cpu() for k, t in tensors.items()}, str(path / name), metadata={"format": "pt"})
            except OSError as e:  # reported to every rank below, not left to hang the others
                written = {"error": f"rank {dist.get_rank()} writing {path / name}: {type(e).__name__}: {e}"}
                continue
            written[name] = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    everyone = comm.all_gather_objects(written, None)
    failures = [w["error"] for w in everyone if "error" in w]
    if failures:
        raise PipelineError(f"save_pretrained into {path} failed, no index written: {'; '.join(failures)}")
    if dist.get_rank() == 0:
        weight_map, total = {}, 0
        for files in everyone:
            for name, sizes in files.items():
                for key, size in sizes.items():
                    weight_map[key] = name
                    total += size
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        model = info.stages[0].model
        model.config.save_pretrained(str(path))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(path))
    comm.barrier(None)
