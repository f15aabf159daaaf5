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

LoRA (``--lora-r``, default 8): the adapters are added to each rank's cut model as
:mod:`tpify.cli.finetune` adds them (:func:`tpify.cli.finetune.add_lora`, the names of every
rank's parallel linear layers), with the values PEFT gives them on the whole dense model from
the same seed (:func:`init_lora_as_dense`: the run is the ``--pp 1`` run's, step by step);
``out_dir/adapter`` is one dense PEFT adapter gathered by stage
(:func:`tpify.pipeline.save_adapter`), ``out_dir/final`` the merged model
(:func:`tpify.pipeline.merge_adapters`, then the save by stage). Checkpoints every
``save_every`` steps (:func:`save_pipeline_checkpoint`: the model, AdamW, the LR schedule and
the generators through :func:`tpify.pipeline.save_checkpoint`, the step and losses in
``state.json``, LoRA's dense adapter beside) and ``--resume`` at any ``--pp`` of 2 or more,
any ``--tp`` and ``--dp`` with the same global batch (:func:`tpify.pipeline.load_checkpoint`);
the data position is the step's.

Data parallelism (``--dp M``, full fine-tuning): ``M`` replicas of the whole pipeline under
torch's ``replicate`` (:func:`tpify.pipeline.replicate_stages`, DDP's semantics), the global batch
``batch_size x dp`` split over them as :mod:`tpify.cli.finetune` splits it (each replica's
``batch_size`` rows cut into the microbatches); :func:`tpify.pipeline.step` divides by the global
batch's target count (summed over dp) and sums the replicas' parts, so the logged loss is the
global batch's mean and the gradients the dense run's; the saves and checkpoints gather over dp
and write one copy per stage.

Not built here (refused before the ranks start, :func:`pipeline_problem`): ``--dp-shard``
(FSDP2 / HSDP of the stages: the library takes it, the command does not test it), LoRA with
``--dp`` (the adapter save and merge of stages under a data-parallel engine), the greedy
continuation (generation through the stages), context parallelism and quantized bases; a resume
between a pipeline run and one without ``--pp`` (:func:`tpify.cli.finetune.resume_point`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..agree import agree

__all__ = ["pipeline_problem", "n_virtual", "data_parallel_of", "finetune_pipeline", "pipeline_memory_report", "init_lora_as_dense",
           "save_pipeline_checkpoint"]


def n_virtual(cfg) -> int:
    """Stages per pipeline rank: 2 for the interleaved and V schedules, else 1
    (:func:`tpify.pipeline.schedule.default_n_virtual`)."""
    from ..pipeline.schedule import default_n_virtual

    return default_n_virtual(cfg.pp_schedule)


def data_parallel_of(cfg) -> str | None:
    """The engine of ``cfg``'s dp replicas of the stages (:func:`tpify.pipeline.pipeline`'s
    ``data_parallel``): ``"fsdp"`` with ``dp_shard > 1`` (FSDP2, HSDP with ``dp / dp_shard``
    replicas; :func:`pipeline_problem` refuses it for now), ``"replicate"`` with ``dp > 1``
    (DDP's semantics), else None."""
    if cfg.dp_shard > 1:
        return "fsdp"
    return "replicate" if cfg.dp > 1 else None


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
    ``--pp``: ``--dp-shard`` > 1, ``--dp`` > 1 with LoRA, context parallelism and quantized bases (the other helpers' ``cp`` / ``quantize`` options, when the
    config has them); a batch the microbatches do not divide; a microbatch count the schedule
    cannot take (:func:`tpify.pipeline.schedule.check_microbatches`); more stages than layers.
    """
    from ..pipeline.plan import PipelineError
    from ..pipeline.schedule import check_microbatches, stage_style

    if cfg.pp == 1:
        if cfg.microbatches is not None or cfg.pp_schedule != "1F1B":
            return "--microbatches and --pp-schedule take effect with pipeline stages only: pass --pp 2 or more"
        return None
    refused = []
    if cfg.dp_shard > 1:
        refused.append(f"--dp-shard {cfg.dp_shard}: FSDP2 / HSDP of the stages through the command is not tested "
                       "(tpify.pipeline.pipeline(..., data_parallel='fsdp') from Python is); pass --dp-shard 1 (--dp "
                       "replicas of the stages, DDP's semantics)")
    if cfg.dp > 1 and cfg.lora_r:
        refused.append(f"--dp {cfg.dp} with LoRA (--lora-r {cfg.lora_r}): the adapter save and merge of stages under "
                       "a data-parallel engine (DTensor parameters) are not built; pass --lora-r 0 (every weight "
                       "trained) or --dp 1")
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
        check_microbatches(cfg.pp_schedule, m, cfg.pp, cfg.pp * nv, nv, stage_style(cfg.pp_schedule))
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
    dense model (the trainable ones' gradients take their bytes again, AdamW's state twice: every
    weight, or LoRA's adapters); each global rank's parameter bytes. Collective: one
    ``all_gather_object`` over the world."""
    from .. import pipeline as pp

    stages = pp.stages_of(schedule)
    local = sum(p.numel() * p.element_size() for p in params)
    train = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    mine = [(s.stage_index, s.layer_ids.start, s.layer_ids.stop - 1) for s in stages]
    per_rank = comm.all_gather_objects((dist.get_rank(), mine, local, train))
    dense = _dense_bytes(cfg)

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    lines = [f"memory: dense model: parameters {mib(dense)}{'' if cfg.lora_r else f' (gradients {mib(dense)}, AdamW state {mib(2 * dense)})'}; "
             f"pp {cfg.pp} x tp {cfg.tp} x dp {cfg.dp}, {cfg.pp_schedule}, {cfg.microbatches or cfg.pp} microbatches"]
    for r, on, nbytes, tbytes in per_rank:
        where = ", ".join(f"stage {s} (layers {a}..{b})" for s, a, b in on)
        lines.append(f"  rank {r}: {where}: parameters {mib(nbytes)} = {nbytes / dense:.3f} x dense"
                     + (f"; trainable (LoRA) {mib(tbytes)}" if cfg.lora_r else "")
                     + f" (gradients {mib(tbytes)}, AdamW state {mib(2 * tbytes)})")
    return lines, [nbytes for _, _, nbytes, _ in sorted(per_rank)]


def _agreed(cfg):
    """The checks of every rank (limits, world size, :func:`pipeline_problem`, :func:`check_run`)
    and one agreement (the store): a problem on any rank stops every rank, before any collective.
    Returns ``(checkpoint, its state)`` to resume from, or ``(None, None)``.

    Raises:
        ValueError: as the checks; on every rank.
    """
    from .finetune import check_run
    from .finetune_resume import _run_args

    error, ckpt, state = None, None, None
    try:
        cfg.check()
        world = dist.get_world_size()
        if cfg.pp * cfg.tp * cfg.dp != world:
            raise ValueError(f"--pp {cfg.pp} x --tp {cfg.tp} x --dp {cfg.dp} = {cfg.pp * cfg.tp * cfg.dp} ranks, but "
                             f"{world} ranks were started; pass sizes whose product is {world}")
        problem = pipeline_problem(cfg)
        if problem:
            raise ValueError(problem)
        ckpt, state = check_run(cfg)
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree("tpify finetune --pp", {"args": _run_args(cfg), "pp": (cfg.pp, cfg.pp_schedule, cfg.microbatches),
                                  "resume step": state["step"] if state else None}, error)
    return ckpt, state


def init_lora_as_dense(peft_model, dtype: torch.dtype) -> tuple[int, int]:
    """Give the LoRA adapters of ``peft_model`` (PEFT on this rank's cut model,
    :func:`tpify.pipeline.from_pretrained`) the values PEFT gives them on the whole dense model
    from the random state at the call, and leave the generator where that dense run leaves it; returns
    ``(trainable, total)``: the dense model's LoRA and all parameter counts.

    PEFT draws each adapted layer's factors from the default generator in the model's module order,
    so a rank holding layers 15..29 would draw layer 0's values for layer 15. Here every adapted
    layer of the dense model (built on the meta device) is created again in that order by PEFT's own
    ``lora.Linear`` on a stand-in base of the dense ``(in, out)`` and ``dtype`` (holding no weight);
    this rank's layers take those values, sliced to their TP shard. Local; no communication.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import check_target_module_exists
    from torch import nn

    from ..hf_modules import is_conv1d
    from ..sharding import shard_spec_of

    state = torch.get_rng_state()  # what the dense run's get_peft_model starts from
    model = peft_model.base_model.model
    config = peft_model.peft_config["default"]
    with torch.device("meta"):
        dense = type(model)._from_config(model.config)
    held = dict(model.named_modules())
    trainable, total = 0, sum(p.numel() for p in dense.parameters())
    torch.set_rng_state(state)
    for name, module in dense.named_modules():
        if not check_target_module_exists(config, name):
            continue
        if is_conv1d(module):
            fan_in, fan_out = module.weight.shape  # Conv1D: (in, out)
        elif isinstance(module, nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        else:
            continue
        stand_in = nn.Linear(fan_in, fan_out, bias=module.bias is not None, device="meta")
        stand_in.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)  # the device and dtype
        layer = LoraLinear(stand_in, "default", config=config, r=config.r, lora_alpha=config.lora_alpha)
        trainable += sum(p.numel() for p in layer.parameters() if p is not stand_in.weight and p.requires_grad)
        real = held.get(name)
        if real is None:
            continue
        with torch.no_grad():
            for factor in ("lora_A", "lora_B"):
                target = getattr(real, factor)["default"].weight
                value = getattr(layer, factor)["default"].weight.detach()
                spec = shard_spec_of(target)
                value = spec.slice_dense(value, real.get_base_layer().tp_rank) if spec is not None else value
                target.copy_(value.to(target.dtype))
    return trainable, total + trainable


def save_pipeline_checkpoint(schedule, optimizer, scheduler, step: int, losses: list[float], cfg, out_dir: Path) -> Path:
    """Write ``out_dir/checkpoint-<step>`` atomically (a temporary directory renamed): ``trainer/``,
    the model (every parameter of every stage, LoRA's frozen base too), AdamW, the LR schedule,
    the generators and the step (:func:`tpify.pipeline.save_checkpoint`: resumes at another pp and
    tp) and ``state.json`` (step, losses, layout, run arguments); with LoRA ``adapter/``, the dense
    adapter (:func:`tpify.pipeline.save_adapter`, plain PEFT loads it). Every rank calls it."""
    from .. import pipeline as pp
    from .finetune_resume import _run_args, publish_checkpoint, stage_checkpoint

    tmp, final = stage_checkpoint(out_dir, step)
    if cfg.lora_r:
        pp.save_adapter(schedule, tmp / "adapter")
    pp.save_checkpoint(tmp / "trainer", schedule, [optimizer], [scheduler], extra={"step": step})
    return publish_checkpoint(tmp, final, {"step": step, "losses": losses, "pp": cfg.pp, "tp": cfg.tp, "dp": cfg.dp,
                                           "world": dist.get_world_size(), "lora_r": cfg.lora_r,
                                           "args": _run_args(cfg)})


def finetune_pipeline(cfg) -> list[float]:
    """:func:`tpify.cli.finetune.finetune` with ``cfg.pp > 1`` stages; returns the loss of every
    step (the global batch's mean) on every rank.

    ``world = pp * tp * dp``. Writes ``out_dir/checkpoint-<k>`` every ``save_every`` steps
    (:func:`save_pipeline_checkpoint`), ``out_dir/final`` (one safetensors file per stage, an
    index, the config and tokenizer; LoRA: merged, and ``out_dir/adapter`` the dense adapter),
    ``losses.json`` and ``loss.png``. ``resume``: continues from the latest checkpoint at this
    run's ``pp`` and ``tp``.

    Raises:
        ValueError: an option outside its limits or refused (:func:`pipeline_problem`), a world of
            another size, a bad ``out_dir``, ``data`` or ``model_dir``, a checkpoint ``resume``
            cannot use (:func:`tpify.cli.finetune.resume_point`); on every rank before anything
            is read.
        ImportError: matplotlib, or peft with LoRA, is not installed (before training).
        tpify.pipeline.PipelineError: the model has no pipeline plan (on every rank).
        tpify.io.CheckpointError: the checkpoint holds another model (on every rank).
    """
    from transformers import AutoTokenizer

    import tpify
    from tpify import pipeline as pp

    from .finetune import (_lr_lambda, _plot, _StepLines, add_lora, batch_indices, default_text_files, lora_targets,
                           pack_texts)

    ckpt, state = _agreed(cfg)
    start_step, losses = (state["step"], list(state["losses"])) if state else (0, [])
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    data = pack_texts(tokenizer, cfg.data or [str(p) for p in default_text_files()], cfg.seq_len)
    # dp = dp_replicate x dp_shard, as the plain run: FSDP2 (HSDP) over dp_shard, else replicas of the stages
    mesh = tpify.init_mesh(cfg.tp, dp_replicate=cfg.dp // cfg.dp_shard, pp_size=cfg.pp, device_type=device.type)
    nv, m = n_virtual(cfg), cfg.microbatches or cfg.pp
    tpify.manual_seed(cfg.seed)
    model = pp.from_pretrained(cfg.model_dir, mesh, n_virtual=nv, style=pp.stage_style(cfg.pp_schedule),
                               dtype=getattr(torch, cfg.dtype)).to(device)
    trainable = None
    if cfg.lora_r:  # the names of every rank's layers (stages may hold other kinds), the dense run's values
        targets = sorted(set().union(*comm.all_gather_objects(lora_targets(model))))
        state_rng = torch.get_rng_state()
        absent = model.get_input_embeddings() is None  # not the first stage: PEFT's tie check reads it
        if absent:
            model.set_input_embeddings(torch.nn.Module())  # a stand-in holding no parameter: nothing is tied to it
        peft_model, _, _ = add_lora(model, cfg, targets)
        if absent:
            model.set_input_embeddings(None)
        torch.set_rng_state(state_rng)
        trainable, total = init_lora_as_dense(peft_model, getattr(torch, cfg.dtype))
        model = peft_model.base_model.model  # the HF model with the adapter layers: cut into stages
        if rank == 0 and cfg.progress:
            print(f"tpify finetune: LoRA r={cfg.lora_r}: {trainable:,} trainable parameters of {total:,} "
                  f"({100 * trainable / total:.2f}%)", flush=True)
    schedule = pp.pipeline(model, mesh, schedule=cfg.pp_schedule, n_microbatches=m, n_virtual=nv, device=device,
                           data_parallel=data_parallel_of(cfg))
    del model  # the stages hold what this rank keeps
    info = schedule.tpify_pipeline
    params = pp.parameters(schedule)
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup, cfg.steps))
    if ckpt is not None:  # the model, AdamW, the schedule and the generators, at this run's pp and tp
        pp.load_checkpoint(ckpt / "trainer", schedule, [optimizer], [scheduler])
    report = cfg.progress and rank == 0
    lines_, rank_bytes = pipeline_memory_report(cfg, schedule, params)
    for line in lines_:
        if report:
            print(line, flush=True)
    if report and cfg.sample_tokens:
        print("tpify finetune --pp: no greedy continuation (generation through the stages is not built); load "
              f"{Path(cfg.out_dir) / 'final'} in transformers to generate", flush=True)
    lines = _StepLines(cfg, losses, report)
    stages = pp.stages_of(schedule)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    dp_rank = comm.group_rank(info.dp_group)
    out_dir = Path(cfg.out_dir)
    for step in range(start_step, cfg.steps):
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
        # the last stage's loss (the global batch's mean: pp.step sums the replicas' parts over dp, the target
        # count too) on every rank of the pipeline: one all-reduce of a scalar
        shared = loss.float() if loss is not None else torch.zeros((), dtype=torch.float32, device=device)
        shared = comm.all_reduce(shared, info.pp_group)
        lines.hold(step, lr, t0, comm.HostCopy([shared] + ([norm] if norm is not None else []), torch.float64))
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            lines.flush()
            save_pipeline_checkpoint(schedule, optimizer, scheduler, step + 1, lines.losses, cfg, out_dir)
    lines.flush()
    if cfg.lora_r:
        pp.save_adapter(schedule, out_dir / "adapter")  # one dense PEFT adapter, gathered by stage
        pp.merge_adapters(schedule)  # each stage's B A into its base shards: final/ is the merged model
    pp.save_pretrained(schedule, out_dir / "final")  # gathered by stage: one file per stage
    if rank == 0:
        from dataclasses import asdict

        tokenizer.save_pretrained(out_dir / "final")
        (out_dir / "losses.json").write_text(json.dumps({"losses": lines.losses, "config": asdict(cfg),
                                                         "trainable_parameters": trainable,
                                                         "rank_param_bytes": rank_bytes}, indent=1))
        _plot(lines.losses, out_dir / "loss.png")
    comm.barrier()
    return lines.losses
