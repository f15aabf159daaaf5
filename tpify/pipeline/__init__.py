"""Pipeline parallelism on ``torch.distributed.pipelining``: the model's own layers cut into stages.

The third dimension beside tensor and data parallelism (Megatron-LM, Narayanan et al.,
arXiv:2104.04473): a mesh with an outermost ``"pp"`` axis (``tpify.init_mesh(tp, pp_size=P)``),
each pipeline rank holding the HF model with only its stage's layers (:mod:`.stage`), run by
torch's schedules (:mod:`.schedule`). One job per module:

* :mod:`.plan`: where the model is cut (recipe ``[pipeline]`` or transformers' ``base_model_pp_plan``)
  and the layer ranges of the stages;
* :mod:`.stage`: :class:`StageModule`, one stage of the HF model;
* :mod:`.split`: :func:`split_model`, this rank's stages and the embedding group;
* :mod:`.data_parallel`: FSDP2 / HSDP (:func:`shard_stages`) or replicas (:func:`replicate_stages`) on
  each stage, over the mesh's dp axes, before the schedule is built;
* :mod:`.schedule`: :func:`build_schedule` (torch's schedule objects), :class:`PipelineLoss`, :func:`step`;
* :mod:`.grads`: the global gradient norm over pp x dp x tp and clipping;
* :mod:`.load`: :func:`from_pretrained` reading only this rank's stages, :func:`save_pretrained` by stage;
* :mod:`.checkpoint`: training checkpoints (DCP) that resume at another pp and tp;
* :mod:`.adapter`: a PEFT model's dense adapter saved by stage (:func:`save_adapter`), merged
  into the stages (:func:`merge_adapters`).

Usage (docs/pipeline-parallelism.md)::

    mesh = tpify.init_mesh(tp_size=2, pp_size=2)
    model = tpify.parallelize(model, mesh=mesh)            # tp inside each stage (skip at tp 1)
    schedule = tpify.pipeline.pipeline(model, mesh, schedule="1F1B", n_microbatches=4)
    del model                                              # the other stages' layers are freed
    opt = torch.optim.AdamW(tpify.pipeline.parameters(schedule))
    loss = tpify.pipeline.step(schedule, input_ids=ids if first else None, labels=labels if last else None)
    tpify.pipeline.clip_grad_norm_(schedule, 1.0); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from .adapter import merge_adapters, save_adapter
from .checkpoint import load_checkpoint, save_checkpoint
from .data_parallel import apply_data_parallel, replicate_stages, shard_stages
from .grads import clip_grad_norm_, grad_norm, parameters
from .load import from_pretrained, save_pretrained
from .plan import PipelineError, PipelinePlan, layer_ranges, pipeline_plan
from .schedule import PipelineLoss, build_schedule, default_n_virtual, stage_style, step
from .split import PipelineInfo, split_model
from .stage import StageModule

__all__ = ["pipeline", "split_model", "shard_stages", "replicate_stages", "build_schedule", "step", "parameters", "grad_norm", "clip_grad_norm_",
           "stages_of", "from_pretrained", "save_pretrained", "save_checkpoint", "load_checkpoint", "save_adapter", "merge_adapters", "PipelineError", "PipelineInfo", "PipelineLoss", "PipelinePlan", "StageModule",
           "layer_ranges", "pipeline_plan"]


def pipeline(model, mesh, *, schedule: str = "1F1B", n_microbatches: int = 1, n_virtual: int | None = None,
             split_points: list[int] | None = None, recipe=None, device=None, lm_loss_chunk=None,
             data_parallel: str | None = None):
    """:func:`split_model`, the data-parallel engine on the stages, then :func:`build_schedule`:
    torch's schedule object over this rank's stages of ``model`` (a causal LM, dense or
    parallelized over ``mesh``'s tp axis).

    ``n_virtual``: stages per rank (default 2 for ``Interleaved1F1B``, ``InterleavedZeroBubble`` and
    the V schedules ``ZBVZeroBubble`` and ``DualPipeV``, whose stages are placed in a V, else 1); ``lm_loss_chunk``:
    the chunked linear cross-entropy (:class:`PipelineLoss`); ``data_parallel``: with dp > 1 in
    ``mesh`` (``dp_replicate x dp_shard``), ``"fsdp"`` (FSDP2, HSDP with ``dp_replicate > 1``:
    :func:`shard_stages` with its defaults) or ``"replicate"`` (DDP's semantics:
    :func:`replicate_stages`); required
    then, ignored at dp 1 (no default: the engine decides the memory per rank and what the
    checkpoints take). The stages: :func:`stages_of`; a training step: :func:`step`.
    Communication and Raises: those of :func:`split_model`, the engine's and
    :func:`build_schedule` (PipelineError on every rank, before any collective: an unknown
    ``data_parallel``, dp > 1 without one).
    """
    if n_virtual is None:
        n_virtual = default_n_virtual(schedule)
    info = split_model(model, mesh, n_virtual=n_virtual, split_points=split_points, recipe=recipe,
                       style=stage_style(schedule), data_parallel=data_parallel)  # checked there, before any collective
    apply_data_parallel(info, data_parallel)
    return build_schedule(info, schedule, n_microbatches, device, lm_loss_chunk)


def stages_of(schedule) -> list[StageModule]:
    """This rank's :class:`StageModule` s of a schedule :func:`build_schedule` made (their ``.model``
    is the HF model holding the stage's layers under their global names)."""
    return schedule.tpify_pipeline.stages
