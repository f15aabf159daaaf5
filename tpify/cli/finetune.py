"""Fine-tuning a pretrained causal LM across DP x CP x TP ranks: the loop behind ``tpify finetune``.

Each rank loads only its shard (:func:`tpify.from_pretrained`); the ``tp`` ranks of a TP group
see the same micro-batch, the ``dp`` replicas different ones; a step is the usual Hugging Face
``model(input_ids, labels=input_ids).loss.backward()`` (the loss is vocab-parallel, see
:mod:`tpify.loss`) inside torch's DDP over the DP group (gradients averaged over DP while the
backward runs), or, with ``dp_shard > 1``, with the model sharded by FSDP2 over ``dp_shard`` ranks
(HSDP over ``dp / dp_shard`` replicas; :mod:`tpify.data_parallel`); then gradients are clipped
by the global norm, and AdamW steps with a linear warm-up and decay. Checkpoints (HF model
directory + the optimizer, scheduler and generators as a torch.distributed.checkpoint,
:mod:`tpify.checkpoint`, + the manifest, :mod:`tpify.integrations.resume`) are written
atomically every ``save_every`` steps, and ``resume`` continues: data order and learning rate
depend only on the step number; at the saved layout exactly, at another (``--tp``, ``--dp``,
``--dp-shard``, the same global batch) with the optimizer state resharded; a checkpoint of
another model is refused on every rank. The
loss curve (``loss.png``) needs matplotlib, the ``cli`` extra (``pip install "tpify[cli]"``).

Long documents: with ``cp > 1`` the model is context-parallel (``tpify.init_mesh(tp, cp_size=cp)``,
docs/context-parallelism.md): the text is cut into sequences of ``seq_len`` tokens as always
(:func:`pack_texts`: the files concatenated, so a sequence runs across the text's paragraphs and
sections, one long document), every rank of a CP group takes the same rows and
:func:`tpify.context_parallel.split_batch` gives it ``seq_len / cp`` tokens of each (a front and a
back chunk); the loss and the gradients are the dense model's. ``seq_len`` must be a multiple of
``2 x cp``; with ``dp_shard > 1`` FSDP2 shards over ``dp_shard x cp`` ranks
(:func:`tpify.shard_data_parallel`); the greedy continuation is not shown (``generate`` is
refused under context parallelism).

What rank 0 prints: the parameter memory of each rank against the dense model (and the
gradients and AdamW state of the trainable parameters), a greedy continuation of a fixed prompt
before training, one line per step (loss, gradient norm, learning rate, time), and the same
continuation from the final model (with LoRA: the merged model, which ``out_dir/final`` holds).
"""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..agree import agree
from .launch import world_mismatch
from .checks import check, output_problem
from .finetune_resume import _restore, _run_args, _save_checkpoint, check_resume_files, resume_point
from .options import DEFAULT_PROMPT, DTYPES, LIMITS, QUANTIZE

__all__ = ["FinetuneConfig", "cp_world_mismatch", "LIMITS", "DTYPES", "DEFAULT_PROMPT", "pack_texts", "batch_indices",
           "finetune",
           "default_text_files", "add_lora", "lora_targets", "resume_point", "check_resume_files", "check_run",
           "greedy_continuation", "memory_report"]


def cp_world_mismatch(tp: int, cp: int, dp: int, world: int) -> str | None:
    """Why ``tp x cp x dp`` ranks do not fit a world of ``world`` ranks, or None (``cp == 1``:
    :func:`tpify.cli.launch.world_mismatch`'s message). Pure."""
    if cp == 1:
        return world_mismatch(tp, dp, world)
    if tp * cp * dp == world:
        return None
    return (f"--tp {tp} x --cp {cp} x --dp {dp} = {tp * cp * dp} ranks, but {world} ranks were started; pass sizes "
            f"whose product is {world}, or start {tp * cp * dp} ranks (run without torchrun, tpify starts them itself)")


def default_text_files() -> list[Path]:
    """Real English text shipped with tpify's command line (``tpify/cli/data/``): the GNU GPL v3
    (its licence allows verbatim copies)."""
    return [Path(__file__).resolve().parent / "data" / "gpl-3.0.txt"]


@dataclass
class FinetuneConfig:
    """Options of :func:`finetune` (the ``tpify finetune`` flags), checked when made.

    Raises:
        ValueError: a numeric option outside :data:`LIMITS` (every one listed, each with its
            allowed range), a ``dtype`` not in :data:`DTYPES`, ``dp_shard`` not dividing ``dp``,
            and with ``cp > 1`` a ``seq_len`` that ``2 x cp`` does not divide.
    """

    model_dir: str
    out_dir: str
    data: list[str] = field(default_factory=list)
    tp: int = 1
    cp: int = 1                  # > 1: context parallelism, each rank seq_len / cp tokens of every sequence
    dp: int = 1
    dp_shard: int = 1            # > 1: FSDP2 over dp_shard ranks (HSDP with dp / dp_shard replicas)
    seq_len: int = 128
    batch_size: int = 4          # sequences per DP replica per step
    lr: float = 5e-5
    warmup: int = 2
    steps: int = 10
    clip: float = 1.0
    weight_decay: float = 0.0
    save_every: int = 0          # 0: only the final model
    resume: bool = False
    seed: int = 0
    dtype: str = "float32"       # parameter dtype: float32, or bfloat16 (pure bf16 training)
    lora_r: int = 0              # > 0: train LoRA adapters of this rank on every parallel linear layer
    lora_alpha: int | None = None  # default 2 * lora_r
    allow_changes: bool = False  # resume even if the run's arguments differ from the checkpoint's
    progress: bool = True        # rank 0 prints the memory report and one line per step
    prompt: str = DEFAULT_PROMPT  # continued greedily before and after training
    sample_tokens: int = 20      # tokens of that continuation; 0: none
    quantize: str | None = None  # "nf4" / "fp4": QLoRA, the base frozen in bitsandbytes 4-bit (needs lora_r > 0)
    pp: int = 1                  # > 1: pipeline stages (tpify.pipeline; tpify/cli/finetune_pipeline.py)
    pp_schedule: str = "1F1B"    # the pipeline schedule (PP_SCHEDULES)
    microbatches: int | None = None  # microbatches per step of the pipeline; None: pp

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise a ``ValueError`` naming every option outside its limits (:data:`LIMITS`, :data:`DTYPES`)."""
        problems = [problem for name, limit in LIMITS.items()
                    if (problem := check(name, getattr(self, name), limit)) is not None]
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.dp_shard, int) and isinstance(self.dp, int) and self.dp_shard >= 1 and self.dp >= 1 \
                and self.dp % self.dp_shard:
            problems.append(f"dp_shard = {self.dp_shard} does not divide dp = {self.dp}: FSDP2 shards over "
                            f"dp_shard ranks within each of dp / dp_shard replicas; pass a divisor of {self.dp}")
        if isinstance(self.cp, int) and self.cp > 1:
            if isinstance(self.seq_len, int) and self.seq_len % (2 * self.cp):
                low = self.seq_len - self.seq_len % (2 * self.cp)
                problems.append(f"seq_len = {self.seq_len} is not a multiple of 2 x cp = {2 * self.cp}: context "
                                f"parallelism cuts each sequence into 2 x cp equal chunks (each rank a front and a "
                                f"back one); pass --seq-len {low or 2 * self.cp} or {low + 2 * self.cp}")
        if isinstance(self.cp, int) and self.cp > 1 and self.quantize:
            problems.append(f"quantize = {self.quantize!r} with cp = {self.cp}: QLoRA under context parallelism is "
                            f"not tested; pass --cp 1")
        problems += _quantize_problems(self)
        if problems:
            raise ValueError("FinetuneConfig: " + "; ".join(problems))


def _quantize_problems(cfg: FinetuneConfig) -> list[str]:
    """What ``quantize`` (QLoRA) does not combine with: full fine-tuning and FSDP2 (docs/quantization.md)."""
    if cfg.quantize is None:
        return []
    if cfg.quantize not in QUANTIZE:
        return [f"quantize must be one of {list(QUANTIZE)} (bitsandbytes 4-bit) or None, got {cfg.quantize!r}"]
    problems = []
    if not cfg.lora_r:
        problems.append(f"quantize={cfg.quantize!r} with lora_r = 0: full fine-tuning of a quantized base is not "
                        f"supported (its 4-bit weights take no gradient); pass --lora-r > 0 (QLoRA)")
    if isinstance(cfg.dp_shard, int) and cfg.dp_shard > 1:
        problems.append(f"quantize={cfg.quantize!r} with dp_shard = {cfg.dp_shard}: FSDP2 over a quantized base is "
                        f"not built (its 4-bit shards are buffers FSDP2 would not shard); pass --dp-shard 1 (DDP)")
    return problems


def pack_texts(tokenizer, files: list[str | Path], seq_len: int) -> torch.Tensor:
    """Tokenize ``files``, join them with the EOS token and cut into ``(N, seq_len)`` int64 rows.

    Raises:
        ValueError: the text holds fewer than ``seq_len`` tokens.
    """
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for f in files:
        ids.extend(tokenizer(Path(f).read_text(encoding="utf-8"), verbose=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text files hold {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def batch_indices(step: int, n_rows: int, global_batch: int, seed: int) -> torch.Tensor:
    """Rows of the packed data for ``step`` (a pure function of the step: resume is exact).

    Epoch ``e`` visits the rows in the order of a permutation seeded with ``seed + e``.
    """
    out, perms = [], {}
    start = step * global_batch
    for pos in range(start, start + global_batch):
        epoch, i = divmod(pos, n_rows)
        if epoch not in perms:  # one permutation per epoch the batch touches
            perms[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
        out.append(perms[epoch][i])
    return torch.stack(out)


def _lr_lambda(warmup: int, steps: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))
    return f


def lora_targets(model) -> list[str]:
    """Names (last FQN segment) of the tensor-parallel linear layers LoRA adapts: every
    ``ColumnParallelLinear``/``RowParallelLinear`` except a gathering LM head."""
    from ..layers import ColumnParallelLinear, RowParallelLinear

    names = set()
    for fqn, m in model.named_modules():
        if isinstance(m, RowParallelLinear) or (isinstance(m, ColumnParallelLinear) and not m.gather_output):
            names.add(fqn.rpartition(".")[2])
    return sorted(names)


def _dense_numel(p: torch.Tensor, spec) -> int:
    """Elements of ``p`` in the dense model: a sharded parameter counted whole (unpadded), a
    replicated one as it is (``spec``: its ShardSpec; ``p.shape`` is the TP shard's, also for
    FSDP2's DTensors)."""
    return p.numel() // p.shape[spec.dim] * spec.global_size if spec is not None else p.numel()


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds: under FSDP2 its slice of the TP shard."""
    from ..sharding import is_dtensor

    return p.to_local().numel() if is_dtensor(p) else p.numel()


def add_lora(model, cfg: FinetuneConfig, targets: list[str] | None = None):
    """``model`` with LoRA adapters (rank ``cfg.lora_r``) on its parallel linear layers (``targets``:
    their names, default :func:`lora_targets`); returns ``(peft_model, trainable, total)``:
    dense-equivalent parameter counts of ``model`` (sharded ones counted whole)."""
    import peft

    from ..integrations.peft import get_peft_model

    config = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_r, lora_dropout=0.0,
                             target_modules=targets if targets is not None else lora_targets(model),
                             init_lora_weights=True)
    with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5 deprecates: not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, config)
    from ..info import param_specs

    specs = param_specs(model)
    trainable = sum(_dense_numel(p, specs[id(p)]) for p in model.parameters() if p.requires_grad)
    total = sum(_dense_numel(p, specs[id(p)]) for p in model.parameters())
    return model, trainable, total


def memory_report(model) -> list[str]:
    """Lines comparing each rank's parameter memory with the dense model's (a collective); on a
    quantized model (QLoRA) one more line per rank: the bytes of its 4-bit shards.

    Parameters are counted once (tied ones once), in bytes of their dtype; the dense figure counts
    each sharded parameter whole, unpadded. The trainable parameters' gradients take their bytes
    again and AdamW's state (``exp_avg``, ``exp_avg_sq``, in the parameter dtype) twice.
    """
    from ..info import param_specs

    specs = param_specs(model)
    params = list(model.parameters())
    local = sum(_local_numel(p) * p.element_size() for p in params)
    dense = sum(_dense_numel(p, specs[id(p)]) * p.element_size() for p in params)
    train = sum(_local_numel(p) * p.element_size() for p in params if p.requires_grad)
    dense_train = sum(_dense_numel(p, specs[id(p)]) * p.element_size() for p in params if p.requires_grad)
    from ..quantized import is_quantized, quantized_bytes

    base4 = quantized_bytes(model)["quantized"] if is_quantized(model) else None
    per_rank = comm.all_gather_objects((dist.get_rank(), local, train, base4))

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    lines = [f"memory: dense model: parameters {mib(dense)}; trainable {mib(dense_train)} "
             f"(gradients {mib(dense_train)}, AdamW state {mib(2 * dense_train)})"]
    for r, nbytes, tbytes, qbytes in per_rank:
        lines.append(f"  rank {r}: parameters {mib(nbytes)} = {nbytes / dense:.3f} x dense; trainable {mib(tbytes)} "
                     f"= {tbytes / max(dense_train, 1):.3f} x dense (gradients {mib(tbytes)}, AdamW state "
                     f"{mib(2 * tbytes)})")
        if qbytes is not None:  # QLoRA: the 4-bit codes and absmax are buffers, not parameters
            lines.append(f"  rank {r}: quantized base (4-bit codes + absmax, besides the parameters) {mib(qbytes)}")
    return lines


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    """The text ``model`` appends to ``prompt`` in ``max_new_tokens`` greedy steps (every rank
    calls it: ``generate`` on a tensor-parallel model is a collective; the same text on every rank).

    Greedy decoding with the KV cache, as ``transformers`` generates on the dense model with
    ``do_sample=False``; eval mode for the call (dropout off), the previous mode restored.
    """
    was_training = model.training
    model.eval()
    batch = tokenizer(prompt, return_tensors="pt").to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    model.train(was_training)
    return tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


_NO_MATPLOTLIB = ('the loss curve of tpify finetune needs matplotlib, which is not installed; '
                  'pip install "tpify[cli]"')


def _require_matplotlib() -> None:
    """Raise, before any training, when :func:`_plot` could not run (no import: a cheap check).

    Raises:
        ImportError: matplotlib is not installed; the message names ``pip install "tpify[cli]"``.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(_NO_MATPLOTLIB, name="matplotlib")


def _require_peft() -> None:
    """Raise, before any training, when LoRA is asked for and peft is missing (no import).

    Raises:
        ImportError: peft is not installed; the message names ``pip install "tpify[peft]"`` and
            ``--lora-r 0``.
    """
    if importlib.util.find_spec("peft") is None:
        raise ImportError('LoRA (tpify finetune --lora-r, 8 by default) needs peft, which is not installed; '
                          'pip install "tpify[peft]", or pass --lora-r 0 to fine-tune every parameter', name="peft")


def _require_bitsandbytes() -> None:
    """Raise, before any training, when ``--quantize`` is asked for and bitsandbytes is missing (no import).

    Raises:
        ImportError: bitsandbytes is not installed; the message names ``pip install "tpify[quant]"``.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError('tpify finetune --quantize (QLoRA) needs bitsandbytes, which is not installed; '
                          'pip install "tpify[quant]", or drop --quantize', name="bitsandbytes")


def _plot(losses: list[float], path: Path) -> None:
    """Save the loss curve to ``path``; matplotlib (the ``cli`` extra) is imported only here."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(_NO_MATPLOTLIB, name="matplotlib") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("tpify finetune")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_run(cfg: FinetuneConfig) -> tuple[Path | None, dict | None]:
    """The local checks of a run, before anything is loaded: ``(checkpoint, its state)`` to
    resume from, or ``(None, None)``. Every rank runs them before the agreement in
    :func:`finetune`; ``tpify finetune`` runs them once more before it starts the ranks, so a
    bad argument or file is one clean error, not one per rank.

    Raises:
        ValueError: ``out_dir`` cannot be a directory (:func:`tpify.cli.checks.output_problem`),
            a ``data`` file is missing or not a file, ``model_dir`` has no ``config.json``, or
            ``resume`` finds no usable checkpoint (:func:`resume_point`,
            :func:`check_resume_files`).
        ImportError: matplotlib (the ``cli`` extra), or peft with ``lora_r > 0``, is not installed.
    """
    problem = output_problem(cfg.out_dir, "directory")
    if problem:
        raise ValueError(problem)
    missing = [f for f in cfg.data if not Path(f).is_file()]
    if missing:
        raise ValueError(f"--data: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a file; pass text "
                         f"files (or no --data: the text shipped with tpify)")
    if not (Path(cfg.model_dir) / "config.json").is_file():
        raise ValueError(f"--model-dir {cfg.model_dir} is not a Hugging Face model directory (no config.json); pass a "
                         f"local directory with config.json and safetensors weights (nothing is downloaded)")
    _require_matplotlib()  # the loss curve is written at the end: fail now, not after training
    if cfg.lora_r:
        _require_peft()
    if cfg.quantize:
        _require_bitsandbytes()
    if not cfg.resume:
        return None, None
    ckpt, state = resume_point(cfg)
    check_resume_files(ckpt, cfg)  # a truncated adapter or .distcp file, named on every rank
    return ckpt, state


def finetune(cfg: FinetuneConfig) -> list[float]:
    """Run the fine-tune described by ``cfg`` on the already initialised process group; return the
    loss of every step (mean over DP) on every rank.

    ``world = cfg.tp * cfg.cp * cfg.dp``; ``cfg.cp > 1``: context parallelism (the module
    docstring); ``cfg.dp_shard > 1`` shards the model with FSDP2 over that many
    ranks of the DP group, else DDP over it. Writes ``out_dir/checkpoint-<k>`` every ``save_every``
    steps, ``out_dir/final`` (LoRA: merged; ``out_dir/adapter`` the dense adapter),
    ``losses.json`` and ``loss.png``. What rank 0 prints and the checkpoint contents: docs/training.md,
    "tpify finetune".

    Raises:
        ImportError: matplotlib, or peft with ``lora_r > 0``, is not installed (before training).
        ValueError: an option outside its limits, ``tp * cp * dp`` not the world size, a bad ``out_dir``,
            ``data`` or ``model_dir``, or a checkpoint ``resume`` cannot use (other arguments, a
            corrupt ``state.json``, a missing or truncated file: :func:`check_resume_files`); on
            every rank, before anything is read.
        ResumeError: the checkpoint's optimizer state does not fit this run
            (:func:`tpify.integrations.resume.check_resume`), or no manifest; on every rank.
    """
    from transformers import AutoTokenizer

    from tpify.training import check_replicas

    if cfg.pp > 1:  # pipeline stages: their own loop (tpify/cli/finetune_pipeline.py)
        from .finetune_pipeline import finetune_pipeline

        return finetune_pipeline(cfg)
    start_step, losses, model_dir, trainer_dir = _agreed_start(cfg)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    data = pack_texts(tokenizer, cfg.data or [str(p) for p in default_text_files()], cfg.seq_len)
    model, step_model, trainable = _build_model(cfg, model_dir, device, rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup, cfg.steps))
    if trainer_dir is not None:
        _restore(trainer_dir, model, optimizer, scheduler, cfg.lora_r > 0)
    check_replicas(model)  # every copy of every parameter bitwise equal before training
    report = cfg.progress and rank == 0
    for line in memory_report(model):
        if report:
            print(line, flush=True)
    if cfg.sample_tokens and cfg.cp > 1:
        if report:
            print(f"no greedy continuation at cp {cfg.cp} (generate is refused under context parallelism: decoding "
                  f"has no sequence to split); {cfg.out_dir}/final loads at cp 1", flush=True)
    elif cfg.sample_tokens:
        text = greedy_continuation(model, tokenizer, cfg.prompt, cfg.sample_tokens, device)
        if report:
            print(f"before (step {start_step}), greedy: {cfg.prompt!r} -> {text!r}", flush=True)
    _train(cfg, model, step_model, optimizer, scheduler, data, device, start_step, _StepLines(cfg, losses, report))
    model = _save_final(cfg, model, tokenizer, losses, trainable)
    if cfg.sample_tokens and cfg.cp == 1:
        text = greedy_continuation(model, tokenizer, cfg.prompt, cfg.sample_tokens, device)
        if report:
            merged = ", LoRA merged" if cfg.lora_r and not cfg.quantize else ""
            print(f"after (step {cfg.steps}{merged}), greedy: {cfg.prompt!r} -> {text!r}", flush=True)
    comm.barrier()
    return losses


def _agreed_start(cfg: FinetuneConfig) -> tuple[int, list[float], Path, Path | None]:
    """``(start step, losses so far, model directory to load, trainer directory or None)``, after
    the local checks (:func:`check_run`) and one agreement of every rank (a bad argument or file on
    one rank stops every rank).

    Raises:
        ValueError: ``cfg`` outside its limits, ``tp * cp * dp`` is not the world size, or a check of
            :func:`check_run` failed on some rank (every rank).
    """
    cfg.check()
    problem = cp_world_mismatch(cfg.tp, cfg.cp, cfg.dp, dist.get_world_size())
    if problem:
        raise ValueError(problem)
    error, state, ckpt = None, None, None
    try:
        ckpt, state = check_run(cfg)
    except Exception as e:  # noqa: BLE001 - re-raised by agree here, reported on the other ranks
        error = e
    agree("tpify finetune", {"args": _run_args(cfg), "resume step": state["step"] if state else None}, error)
    if not cfg.resume:
        return 0, [], Path(cfg.model_dir), None
    model_dir = Path(cfg.model_dir) if cfg.lora_r else ckpt / "model"  # LoRA: the base model and the saved adapter
    return state["step"], state["losses"], model_dir, ckpt / "trainer"


def _build_model(cfg: FinetuneConfig, model_dir: Path, device: torch.device, rank: int):
    """``(model, step_model, trainable)``: the model loaded by slices at ``cfg.tp`` (on the mesh
    ``tpify.init_mesh(cfg.tp, cp_size=cfg.cp)`` when ``cfg.cp > 1``; LoRA adapters
    added when ``cfg.lora_r``), and what a step calls: the model sharded by FSDP2 in place when
    ``cfg.dp_shard > 1``, else wrapped in DDP over the DP group; ``trainable``: LoRA's
    dense-equivalent trainable parameter count, or None."""
    import tpify
    from tpify.data_parallel import replicate_data_parallel, shard_data_parallel

    tpify.manual_seed(cfg.seed)
    layout = {"mesh": tpify.init_mesh(cfg.tp, cp_size=cfg.cp)} if cfg.cp > 1 else {"tp_size": cfg.tp}
    model = tpify.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype), quantization_config=qlora_config(cfg),
                                  **layout).to(device)
    if cfg.quantize:
        norms_to_float32(model)
    trainable = None
    if cfg.lora_r:
        model, trainable, total = add_lora(model, cfg)
        if rank == 0:
            print(f"tpify finetune: LoRA r={cfg.lora_r}: {trainable:,} trainable parameters of {total:,} "
                  f"({100 * trainable / total:.2f}%)", flush=True)
    if cfg.dp_shard > 1:  # FSDP2 (HSDP) over the DP group; the optimizer is built on its shards
        shard_data_parallel(model, dp_replicate=cfg.dp // cfg.dp_shard)
        return model, model, trainable
    return model, replicate_data_parallel(model), trainable  # DDP over the DP group (the model itself at dp 1)


def qlora_config(cfg: FinetuneConfig):
    """The ``transformers.BitsAndBytesConfig`` of ``cfg.quantize`` (4-bit codes of the base's
    linear layers, computed in the run's dtype), or None without it."""
    if not cfg.quantize:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quantize,
                              bnb_4bit_compute_dtype=getattr(torch, cfg.dtype))


def norms_to_float32(model) -> int:
    """Cast, in place, the weights of the normalization layers (the leaf modules whose parameters
    are all 1-D: LayerNorm, RMSNorm) to float32, as PEFT's ``prepare_model_for_kbit_training`` keeps
    them for QLoRA; the linear layers and embeddings keep their dtype. Returns the count cast.
    Local; a no-op on a float32 model."""
    n = 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if next(module.children(), None) is None and params and all(p.dim() == 1 for p in params):
            for p in params:
                if p.is_floating_point() and p.dtype != torch.float32:
                    p.data = p.data.float()
                    n += 1
    return n


class _StepLines:
    """Rank 0's line per step, printed one step late: the loss and norm were copied to the host
    without blocking (:class:`tpify.comm.HostCopy`), so reading them waits only for that copy, and
    a step has no host sync. Appends each step's loss (mean over DP) to ``losses`` on every rank."""

    def __init__(self, cfg: FinetuneConfig, losses: list[float], report: bool):
        self.cfg, self.losses, self.report = cfg, losses, report
        self.tokens_per_step = cfg.batch_size * cfg.dp * cfg.seq_len  # whole sequences (over the CP group)
        self.width = len(str(cfg.steps))
        self.logged = None  # the last step's (step, lr, start time, values copied to the host)

    def hold(self, step: int, lr: float, started: float, values) -> None:
        self.logged = (step, lr, started, values)

    def flush(self, until: float | None = None) -> None:
        """Read the held step's values and print its line (its time runs until ``until``, else now)."""
        if self.logged is None:
            return
        done, step_lr, started, values = self.logged
        self.logged = None
        values = values.values()
        self.losses.append(values[0])
        if self.report:
            seconds = (until if until is not None else time.perf_counter()) - started
            norm_text = f"{values[1]:.3f}" if len(values) > 1 else "-"
            print(f"step {done + 1:>{self.width}}/{self.cfg.steps}: loss {values[0]:.4f}  grad norm {norm_text}  "
                  f"lr {step_lr:.2e}  {seconds:.2f} s  {self.tokens_per_step / seconds:.0f} tokens/s", flush=True)


def _train(cfg: FinetuneConfig, model, step_model, optimizer, scheduler, data: torch.Tensor, device: torch.device,
           start_step: int, lines: _StepLines) -> None:
    """Steps ``start_step .. cfg.steps - 1``: forward and backward of this DP replica's rows of the
    global batch (``(B, T)`` token ids, labels the same ids; under context parallelism this rank's
    ``(B, T / cp)`` tokens, :func:`tpify.context_parallel.split_batch`), the global-norm clip, AdamW and the
    schedule; ``checkpoint-<step>`` every ``cfg.save_every`` steps. Collectives: DDP's or FSDP2's
    over DP in the backward, the clip's, one all-reduce of the loss over DP per step."""
    import tpify
    from tpify.context_parallel import split_batch
    from tpify.training import check_replicas, clip_grad_norm_

    info = tpify.get_tp_info(model)
    dp_rank = comm.group_rank(info.dp_group)
    model.train()
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        lines.flush(until=t0)  # the previous step's line: its time is until this step starts
        lr = scheduler.get_last_lr()[0]
        rows = batch_indices(step, data.shape[0], cfg.batch_size * cfg.dp, cfg.seed)
        ids = data[rows[dp_rank * cfg.batch_size: (dp_rank + 1) * cfg.batch_size]].to(device)  # (B, T)
        loss = step_model(**split_batch({"input_ids": ids, "labels": ids}, model)).loss  # cp 1: the batch itself
        loss.backward()  # DDP or FSDP2 reduces the gradients over DP as the backward runs
        norm = clip_grad_norm_(model, cfg.clip) if cfg.clip > 0 else None
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = comm.all_reduce(loss.detach().float().clone(), info.dp_group) / cfg.dp
        lines.hold(step, lr, t0, comm.HostCopy([mean_loss] + ([norm] if norm is not None else []), torch.float64))
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            lines.flush()
            check_replicas(model)  # never checkpoint replicas that drifted apart
            _save_checkpoint(model, optimizer, scheduler, step + 1, lines.losses, cfg, Path(cfg.out_dir))
    lines.flush()


def _save_final(cfg: FinetuneConfig, model, tokenizer, losses: list[float], trainable: int | None):
    """Write ``out_dir/final`` (LoRA: merged; ``out_dir/adapter`` the dense adapter; QLoRA: the
    adapter and the tokenizer only, no merged model), and on rank 0 the tokenizer, ``losses.json`` and
    ``loss.png``; returns the model (LoRA: the merged one; QLoRA: the adapted one)."""
    import tpify
    from tpify.training import check_replicas

    out_dir = Path(cfg.out_dir)
    check_replicas(model)
    if cfg.lora_r:
        model.save_pretrained(out_dir / "adapter")  # the dense adapter (plain peft loads it); collective
    if cfg.quantize:  # QLoRA: merging into a 4-bit base is refused (tpify.quantized); the adapter is the result
        if dist.get_rank() == 0:
            tokenizer.save_pretrained(out_dir / "adapter")
    else:
        if cfg.lora_r:
            model = model.merge_and_unload()  # each rank merges its slice of B A into its shard of W
        tpify.save_pretrained(model, out_dir / "final")
        if dist.get_rank() == 0:
            tokenizer.save_pretrained(out_dir / "final")
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps({"losses": losses, "config": asdict(cfg),
                                                         "trainable_parameters": trainable}, indent=1))
        _plot(losses, out_dir / "loss.png")
    return model
