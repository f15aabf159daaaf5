"""One rank of the two-host test (tests/distributed/test_scaling_out.py), started by
``torchrun --nnodes 2 --nproc-per-node 2 two_hosts.py OUT``: host-local TP groups, DDP across the
nodes, 3 AdamW steps against the dense model; writes ``OUT/rank<k>.json``."""

import contextlib
import copy
import datetime
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    import tpify
    from test_scaling_out import _reference, _train, _weights_match

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        tpify.init_mesh(4, host_local_tp=True)  # one TP group over both nodes: refused on every rank
        refused = "not refused"
    except ValueError as e:
        refused = f"ValueError: {e}"
    mesh = tpify.init_mesh(2, host_local_tp=True)  # a TP group per node, DP across the nodes
    ref = _reference()
    par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
    ddp = tpify.replicate_data_parallel(par)
    c = SimpleNamespace(rank=rank, world=world)
    norm_rel = _train(c, ddp, par, ref, lambda last: contextlib.nullcontext() if last else ddp.no_sync())
    weights_abs = _weights_match(c, par, ref, "two nodes")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "node": os.environ.get("GROUP_RANK"), "tp_ranks": dist.get_process_group_ranks(par.tp_info.tp_group),
        "split_refused": refused, "norm_rel": norm_rel, "weights_abs": weights_abs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
