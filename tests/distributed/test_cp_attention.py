"""Ring attention and the Ulysses all-to-all under context parallelism, float64 against the dense model.

``tpify.parallelize(model, mesh=tpify.init_mesh(tp, cp_size=cp), cp_attention="ring" | "alltoall")``:
the logits gathered over the CP group, the ``labels=`` loss and every gradient equal a
single-process dense model's in float64 (tolerance ``atol=1e-10, rtol=1e-9``: the same sums in
another order, the softmax merged block by block, ~1e-16), for Llama (grouped-query), Mistral
(sliding window of 5 over 16 tokens: the ring skips the blocks outside it) and GPT-2 (learned
positions, Conv1D), plain and packed (3 documents in one row), at cp 2 (dp 2 x cp 2), cp 4 and
cp 2 x tp 2 (Ulysses there: 2 heads per TP rank over cp 2, the one K/V head per TP rank
repeated). Also in the same job: the ring's query rows cut into tiles of 2 (``TILE_SCORES``),
Ulysses' gathered queries in chunks of 3 rows (``MASK_BYTES``);
gradient checkpointing with the ring; ``from_pretrained(..., cp_attention=...)`` of the saved
dense model (each form); the collectives of a cp 2
step counted for each form; the ring's sub-blocks per step (the load-balanced plan); the ring
with its merge replaced by a plain sum (no online-softmax rescale) differs from dense; what is
refused on every rank (heads that cp does not divide for Ulysses, an unknown ``cp_attention``).

One spawned job of 4 gloo ranks (slow: about 30 s on the 2-core machine).
"""

import copy

import pytest
import torch

import tputil
from test_context_parallel import TOL, B, H, L, T, _compare, _ids, _packed_positions, _reference


def _layouts(rank, world):
    import tpify

    worst = {}
    for mode in ("ring", "alltoall"):
        for tp, cp in ((1, 2), (1, 4), (2, 2)):
            mesh = tpify.init_mesh(tp, cp_size=cp)
            for name in ("llama", "mistral", "gpt2"):
                ref = _reference(name)
                par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, cp_attention=mode)
                what = f"{name} {mode} cp {cp} x tp {tp}"
                _compare(par, ref, what, _ids(), worst)
                _compare(par, ref, what + " packed", _ids(2), worst, position_ids=_packed_positions())
    from tpify.hooks import cp_ring

    ref = _reference("mistral")  # the query rows of each sub-block in tiles of 2 (T/cp = 8: c = 4 rows)
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(1, cp_size=2), cp_attention="ring")
    tile, cp_ring.TILE_SCORES = cp_ring.TILE_SCORES, B * 4 * (T // 4) * 2
    try:
        _compare(par, ref, "mistral ring cp 2 rows in tiles of 2", _ids(3), worst, position_ids=_packed_positions())
    finally:
        cp_ring.TILE_SCORES = tile
    from tpify.hooks import cp_ulysses

    ref = _reference("mistral")  # the T = 16 gathered queries in chunks of 3 rows (two packed rows: B' = 2)
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(1, cp_size=2), cp_attention="alltoall")
    mask_bytes, cp_ulysses.MASK_BYTES = cp_ulysses.MASK_BYTES, 2 * T * 3
    try:
        _compare(par, ref, "mistral alltoall cp 2 rows in chunks of 3", _ids(4), worst,
                 position_ids=_packed_positions())
    finally:
        cp_ulysses.MASK_BYTES = mask_bytes
    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(2, cp_size=2), cp_attention="ring")
    par.gradient_checkpointing_enable()
    par.train()
    ref.train()
    _compare(par, ref, "llama ring cp 2 x tp 2 gradient checkpointing", _ids(5), worst)
    return worst


def _counted(rank, world):
    """The collectives of one cp 2 step (tp 1, dp 2) per form, and the ring's plan."""
    import tpify
    from tpify import comm
    from tpify.context_parallel import split_batch
    from tpify.hooks import cp_ring

    mesh = tpify.init_mesh(1, cp_size=2)
    params = None
    kv = B * 2 * (T // 2) * 2 * (H // 4)  # B * n_kv * T/cp * (d + d_v) per layer
    q = B * 4 * (T // 2) * (H // 4)  # B * n * T/cp * d
    for mode in ("ring", "alltoall"):
        ref = _reference("llama")
        par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, cp_attention=mode)
        params = sum(p.numel() for p in par.parameters())
        mine = split_batch({"input_ids": _ids(), "labels": _ids()}, par)
        cp_ring.ATTENTION_BLOCKS, cp_ring.KERNEL_CALLS = {}, {}
        try:
            with comm.count_collectives() as fwd:
                loss = par(**mine).loss
            blocks, kernels_fwd = dict(cp_ring.ATTENTION_BLOCKS), dict(cp_ring.KERNEL_CALLS)
            with comm.count_collectives() as bwd:
                loss.backward()
            kernels = dict(cp_ring.KERNEL_CALLS)
        finally:
            cp_ring.ATTENTION_BLOCKS, cp_ring.KERNEL_CALLS = None, None
        common_fwd = {"all_gather": 1, "all_gather_numel": T // 2, "all_reduce": 1, "all_reduce_numel": 2}
        if mode == "ring":
            # forward: per layer one shift of [K | V] (cp - 1 = 1); backward: per layer one shift of [K | V]
            # and two of [dK | dV] (cp = 2: the second brings each rank its own block's gradient)
            assert dict(fwd) == {**common_fwd, "send_recv": L, "send_recv_numel": L * kv}, dict(fwd)
            assert dict(bwd) == {"send_recv": 3 * L, "send_recv_numel": 3 * L * kv, "all_reduce": 1,
                                 "all_reduce_numel": params}, dict(bwd)
            # causal, load-balanced: 3 sub-blocks on this rank's own block, 2 on the other's
            assert blocks == {0: 3, 1: 2}, blocks
            # one document per row, no window: every sub-block by the CPU flash kernel (float64), forward
            # and backward, none by the masked einsum
            assert kernels_fwd == {"flash": 5 * L} and kernels == {"flash": 10 * L}, (kernels_fwd, kernels)
        else:
            # forward: per layer q and [K | V] to heads, the output back; backward: the three reversed
            act = (q + kv + q)
            assert dict(fwd) == {**common_fwd, "all_to_all": 3 * L, "all_to_all_numel": L * act}, dict(fwd)
            assert dict(bwd) == {"all_to_all": 3 * L, "all_to_all_numel": L * act, "all_reduce": 1,
                                 "all_reduce_numel": params}, dict(bwd)


def _no_rescale(rank, world):
    """The ring with its merge replaced by a plain sum of the blocks (no online-softmax rescale)
    is far from dense: the test above would catch it."""
    import tpify
    from tpify.context_parallel import split_batch
    from tpify.hooks import cp_ring

    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(1, cp_size=2), cp_attention="ring")
    ids = _ids()
    want = ref(ids, labels=ids, use_cache=False).loss
    good = cp_ring.merge
    cp_ring.merge = lambda out, lse, out_b, lse_b: (out + out_b, torch.logaddexp(lse, lse_b))
    try:
        with torch.no_grad():
            wrong = par(**split_batch({"input_ids": ids, "labels": ids}, par)).loss
    finally:
        cp_ring.merge = good
    assert float((wrong - want.detach()).abs()) > 1e-3, (float(wrong), float(want))
    with torch.no_grad():
        right = par(**split_batch({"input_ids": ids, "labels": ids}, par)).loss
    torch.testing.assert_close(right, want.detach(), **TOL)


def _refused(rank, world):
    import tpify
    from tpify.info import TPUsageError
    from transformers import LlamaConfig, LlamaForCausalLM

    six = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=48, num_attention_heads=6,
                                       num_key_value_heads=2, intermediate_size=48, vocab_size=101))
    with pytest.raises(TPUsageError, match=r"6 query heads / tp_size 1 = 6 per TP rank do not divide by cp_size 4"):
        tpify.parallelize(copy.deepcopy(six), mesh=tpify.init_mesh(1, cp_size=4), cp_attention="alltoall")
    with pytest.raises(ValueError, match="cp_attention must be one of 'allgather', 'ring', 'alltoall'"):
        tpify.parallelize(copy.deepcopy(six), mesh=tpify.init_mesh(1, cp_size=2), cp_attention="flash")
    par = tpify.parallelize(six, mesh=tpify.init_mesh(1, cp_size=2), cp_attention="alltoall")  # 6 / 2 divides
    assert par.tp_info.cp_size == 2


def _loaded(rank, path: str) -> dict:
    """``tpify.from_pretrained(..., cp_attention=...)`` of the saved dense model, each form, cp 2 (dp 2)."""
    import torch.distributed as dist

    import tpify

    ref = _reference("llama")
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    worst = {}
    for mode in ("ring", "alltoall"):
        par = tpify.from_pretrained(path, mesh=tpify.init_mesh(1, cp_size=2), cp_attention=mode, dtype=torch.float64)
        assert par.tp_info.ctx.cp_attention == mode
        _compare(par, ref, f"llama from_pretrained {mode} cp 2", _ids(6), worst)
    return worst


def _job(rank, world, path):
    worst = _layouts(rank, world)
    worst.update(_loaded(rank, path))
    _counted(rank, world)
    _no_rescale(rank, world)
    _refused(rank, world)
    return worst


@pytest.mark.slow
def test_ring_and_ulysses_match_dense_every_family_and_layout(tmp_path):
    results = tputil.spawn(_job, 4, str(tmp_path / "llama"), timeout=900)
    print("measured: max |difference from dense| (loss and every gradient):", results[0])
