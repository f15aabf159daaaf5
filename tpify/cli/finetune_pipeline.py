"""``tpify finetune --pp N``: the fine-tuning loop over pipeline stages (:mod:`tpify.pipeline`).

The model (default: the embedded SmolLM2, 30 layers) is cut into ``pp`` stages (``pp x 2`` with
``Interleaved1F1B``), tensor-parallel over ``tp`` ranks inside each stage, ``dp`` replicas of the
whole pipeline. Each rank reads only its stages' tensors and only its TP slices
(:func:`tpify.pipeline.from_pretrained`); a step is :func:`tpify.pipeline.step` on torch's
schedule (the batch cut into ``microbatches``: gradient accumulation, the dense model's mean loss),
the global-norm clip over pp x tp (:func:`tpify.pipeline.clip_grad_norm_`), AdamW and the same
warm-up and decay as :mod:`tpify.cli.finetune`. The loss lives on the last stage; one all-reduce
of that scalar over the pipeline group per step brings it to rank 0, which reads it one step late
(:class:`tpify.comm.HostCopy`: no host sync in a step). The dense save is gathered by stage
(:func:`tpify.pipeline.save_pretrained`): plain transformers loads ``out_dir/final``.

Not built here (refused before the ranks start, :func:`pipeline_problem`): LoRA, FSDP2
(``--dp-shard``), checkpoints and ``--resume``, the greedy continuation (generation through the
stages), context parallelism and quantized bases.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..agree import agree

__all__ = ["pipeline_problem", "n_virtual", "finetune_pipeline", "pipeline_memory_report"]


def n_virtual(cfg) -> int:
    """Stages per pipeline rank: 2 for ``Interleaved1F1B``, else 1."""
    return 2 if cfg.pp_schedule == "Interleaved1F1B" else 1


def _n_layers(model_dir) -> int | None:
    """``num_hidden_layers`` (or ``n_layer``) of ``model_dir/config.json``, or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    n = config.get("num_hidden_layers", config.get("n_layer"))
    return n if isinstance(n, int) else None


def pipeline_problem(cfg) -> str | None:
    """Why ``tpify finetune`` cannot run ``cfg``'s pipeline options, or None. Pure (reads
    ``config.json`` only); the launcher calls it once before the ranks start, and each rank again
    before its first collective.

    Refused: ``--microbatches`` or a ``--pp-schedule`` other than 1F1B without ``--pp``; with
    ``--pp``: LoRA (``--lora-r``), ``--dp-shard``, ``--save-every`` and ``--resume``, context
    parallelism and quantized bases (the other helpers' ``cp`` / ``quantize`` options, when the
    config has them); a batch the microbatches do not divide; a microbatch count the schedule
    cannot take (:func:`tpify.pipeline.schedule.check_microbatches`); more stages than layers.
    """
    from ..pipeline.plan import PipelineError
    from ..pipeline.schedule import check_microbatches

    if cfg.pp == 1:
        if cfg.microbatches is not None or cfg.pp_schedule != "1F1B":
            return "--microbatches and --pp-schedule take effect with pipeline stages only: pass --pp 2 or more"
        return None
    refused = []
    if cfg.lora_r:
        refused.append("LoRA (--lora-r): tpify.pipeline trains PEFT models, but the adapter save and the merged save "
                       "by stage are not built in tpify finetune; pass --lora-r 0 (every weight trained)")
    if cfg.dp > 1 or cfg.dp_shard > 1:
        refused.append("--dp / --dp-shard with --pp: data-parallel pipeline replicas run under FSDP2 or replicate "
                       "(tpify.pipeline.pipeline(..., data_parallel=...), from Python), whose save by stage is not "
                       "built; pass --dp 1 --dp-shard 1")
    if cfg.save_every or cfg.resume:
        refused.append("--save-every / --resume: checkpoints of a pipeline run are not built in tpify finetune "
                       "(tpify.pipeline.save_checkpoint is, from Python); pass --save-every 0 without --resume")
    if getattr(cfg, "cp", 1) not in (None, 1):
        refused.append("--cp: context parallelism inside pipeline stages is not built; pass --cp 1")
    if getattr(cfg, "quantize", None):
        refused.append("--quantize: a quantized base in pipeline stages is not built; leave --quantize out")
    m = cfg.microbatches or cfg.pp
    if cfg.batch_size % m:
        refused.append(f"--batch-size {cfg.batch_size} is not a multiple of the {m} microbatches "
                       f"({'--microbatches' if cfg.microbatches else 'the default, --pp'}): each microbatch gets "
                       f"batch / microbatches rows; pass a --batch-size that {m} divides")
    nv = n_virtual(cfg)
    try:
        check_microbatches(cfg.pp_schedule, m, cfg.pp, cfg.pp * nv, nv)
    except PipelineError as e:
        refused.append(f"--pp-schedule {cfg.pp_schedule} with --microbatches {m}: {e}")
    layers = _n_layers(cfg.model_dir)
    if layers is not None and cfg.pp * nv > layers:
        refused.append(f"--pp {cfg.pp}{' x 2 virtual stages' if nv > 1 else ''} = {cfg.pp * nv} stages, but the "
                       f"model has {layers} layers; pass a --pp of at most {layers // nv}")
    return "; ".join(f"--pp {cfg.pp}: {r}" for r in refused) or None


def _dense_bytes(cfg) -> int:
    """Bytes of the dense model's parameters in ``cfg.dtype``: the elements of every tensor in
    ``cfg.model_dir``'s safetensors files (read from their headers; a tied head is stored once)."""
    import math

    numel = 0
    for file in sorted(Path(cfg.model_dir).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        numel += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return numel * torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()


def pipeline_memory_report(cfg, schedule, params: list[torch.nn.Parameter]) -> tuple[list[str], list[int]]:
    """``(lines, bytes)``: lines giving each rank's stages, layers and parameter bytes against the
    dense model (every weight trains: gradients take the parameters' bytes again, AdamW's state
    twice); each global rank's parameter bytes. Collective: one ``all_gather_object`` over the world."""
    from .. import pipeline as pp

    stages = pp.stages_of(schedule)
    local = sum(p.numel() * p.element_size() for p in params)
    mine = [(s.stage_index, s.layer_ids.start, s.layer_ids.stop - 1) for s in stages]
    per_rank = comm.all_gather_objects((dist.get_rank(), mine, local))
    dense = _dense_bytes(cfg)

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    lines = [f"memory: dense model: parameters {mib(dense)} (gradients {mib(dense)}, AdamW state {mib(2 * dense)}); "
             f"pp {cfg.pp} x tp {cfg.tp} x dp {cfg.dp}, {cfg.pp_schedule}, {cfg.microbatches or cfg.pp} microbatches"]
    for r, on, nbytes in per_rank:
        where = ", ".join(f"stage {s} (layers {a}..{b})" for s, a, b in on)
        lines.append(f"  rank {r}: {where}: parameters {mib(nbytes)} = {nbytes / dense:.3f} x dense (gradients "
                     f"{mib(nbytes)}, AdamW state {mib(2 * nbytes)})")
    return lines, [nbytes for _, _, nbytes in sorted(per_rank)]


def _agreed(cfg) -> None:
    """The checks of every rank (limits, world size, :func:`pipeline_problem`, :func:`check_run`)
    and one agreement (the store): a problem on any rank stops every rank, before any collective.

    Raises:
        ValueError: as the checks; on every rank.
    """
    from .finetune import check_run
    from .finetune_resume import _run_args

    error = None
    try:
        cfg.check()
        world = dist.get_world_size()
        if cfg.pp * cfg.tp * cfg.dp != world:
            raise ValueError(f"--pp {cfg.pp} x --tp {cfg.tp} x --dp {cfg.dp} = {cfg.pp * cfg.tp * cfg.dp} ranks, but "
                             f"{world} ranks were started; pass sizes whose product is {world}")
        problem = pipeline_problem(cfg)
        if problem:
            raise ValueError(problem)
        check_run(cfg)
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree("tpify finetune --pp", {"args": _run_args(cfg), "pp": (cfg.pp, cfg.pp_schedule, cfg.microbatches)}, error)


def finetune_pipeline(cfg) -> list[float]:
    """:func:`tpify.cli.finetune.finetune` with ``cfg.pp > 1`` stages; returns the loss of every
    step (the global batch's mean) on every rank.

    ``world = pp * tp * dp``. Writes ``out_dir/final`` (one safetensors file per stage, an index,
    the config and tokenizer), ``losses.json`` and ``loss.png``.

    Raises:
        ValueError: an option outside its limits or refused (:func:`pipeline_problem`), a world of
            another size, a bad ``out_dir``, ``data`` or ``model_dir``; on every rank before anything
            is read.
        ImportError: matplotlib is not installed (before training).
        tpify.pipeline.PipelineError: the model has no pipeline plan (on every rank).
    """
    from transformers import AutoTokenizer

    import tpify
    from tpify import pipeline as pp

    from .finetune import _lr_lambda, _plot, _StepLines, batch_indices, default_text_files, pack_texts

    _agreed(cfg)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    data = pack_texts(tokenizer, cfg.data or [str(p) for p in default_text_files()], cfg.seq_len)
    mesh = tpify.init_mesh(cfg.tp, dp_replicate=cfg.dp, pp_size=cfg.pp, device_type=device.type)
    nv, m = n_virtual(cfg), cfg.microbatches or cfg.pp
    tpify.manual_seed(cfg.seed)
    model = pp.from_pretrained(cfg.model_dir, mesh, n_virtual=nv, dtype=getattr(torch, cfg.dtype)).to(device)
    schedule = pp.pipeline(model, mesh, schedule=cfg.pp_schedule, n_microbatches=m, n_virtual=nv, device=device)
    del model  # the stages hold what this rank keeps
    info = schedule.tpify_pipeline
    params = pp.parameters(schedule)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup, cfg.steps))
    report = cfg.progress and rank == 0
    lines_, rank_bytes = pipeline_memory_report(cfg, schedule, params)
    for line in lines_:
        if report:
            print(line, flush=True)
    if report and cfg.sample_tokens:
        print("tpify finetune --pp: no greedy continuation (generation through the stages is not built); load "
              f"{Path(cfg.out_dir) / 'final'} in transformers to generate", flush=True)
    lines = _StepLines(cfg, [], report)
    stages = pp.stages_of(schedule)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    dp_rank = comm.group_rank(info.dp_group)
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        lines.flush(until=t0)
        lr = scheduler.get_last_lr()[0]
        rows = batch_indices(step, data.shape[0], cfg.batch_size * cfg.dp, cfg.seed)
        ids = data[rows[dp_rank * cfg.batch_size: (dp_rank + 1) * cfg.batch_size]].to(device)  # (B, T)
        loss = pp.step(schedule, input_ids=ids if first else None, labels=ids if last else None)
        norm = pp.clip_grad_norm_(schedule, cfg.clip) if cfg.clip > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # the last stage's loss (the global batch's mean) on every rank of the pipeline: one all-reduce of a scalar
        shared = loss.float() if loss is not None else torch.zeros((), dtype=torch.float32, device=device)
        shared = comm.all_reduce(shared, info.pp_group)
        lines.hold(step, lr, t0, comm.HostCopy([shared] + ([norm] if norm is not None else []), torch.float64))
    lines.flush()
    out_dir = Path(cfg.out_dir)
    pp.save_pretrained(schedule, out_dir / "final")  # gathered by stage: one file per stage
    if rank == 0:
        from dataclasses import asdict

        tokenizer.save_pretrained(out_dir / "final")
        (out_dir / "losses.json").write_text(json.dumps({"losses": lines.losses, "config": asdict(cfg),
                                                         "trainable_parameters": None,
                                                         "rank_param_bytes": rank_bytes}, indent=1))
        _plot(lines.losses, out_dir / "loss.png")
    comm.barrier()
    return lines.losses
