"""Tensor-parallel training on GPUs, one process per GPU (docs/gpu.md).

    torchrun --nproc-per-node 2 docs/gpu_train.py              # 2 GPUs: tp 2
    torchrun --nproc-per-node 4 docs/gpu_train.py --tp 2       # 4 GPUs: dp 2 x tp 2 (DDP over dp)

Each process takes the GPU ``LOCAL_RANK`` names (``torch.cuda.set_device`` before any CUDA work),
joins the NCCL group, builds the same dense model (one seed), parallelizes it, and trains a few
AdamW steps with clipping by the dense model's norm; rank 0 prints each step's loss. On a
machine without a GPU the same script runs on the CPU over gloo (so the test suite runs it:
tests/distributed/test_gpu_script.py).
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import tpify
from tpify.training import clip_grad_norm_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=None, help="ranks per TP group (default: every rank)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", help="write the dense HF directory here after training")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it: this process's index on its host
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # one GPU per process, before any CUDA work (NCCL needs it)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)

    torch.manual_seed(0)  # the same dense model on every rank
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    dense = LlamaForCausalLM(config).to(device)  # or tpify.from_pretrained(path, tp_size=...).to(device)
    model = tpify.parallelize(dense, tp_size=args.tp)  # each rank keeps its shard, on its GPU
    ddp = tpify.replicate_data_parallel(model)  # DDP over the DP group (the model itself when dp = 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    info = model.tp_info
    dp_rank = dist.get_rank(info.dp_group) if info.dp_group is not None else 0  # a TP group shares a batch
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        ids = torch.randint(0, config.vocab_size, (4, 32), generator=g).to(device)
        loss = ddp(ids, labels=ids).loss
        loss.backward()
        norm = clip_grad_norm_(model, 1.0)  # the dense model's norm, over TP (and DP)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {float(norm):.4f}, tp {info.tp_size}, "
                  f"world {dist.get_world_size()}, device {device}", flush=True)
    if args.save:
        tpify.save_pretrained(model, args.save)  # collective: every rank calls it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
