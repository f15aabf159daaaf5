"""The RNG stream tracker (tpify.random): idempotent switches, independent streams, seeding."""

import torch

from tpify import random as tprandom


def test_streams_advance_independently_and_switch_idempotently():
    tracker = tprandom.RNGStreamTracker()  # what install_rng_hooks gives each parallelized model
    tprandom._LIVE.add(tracker)  # as install_rng_hooks registers it, so that manual_seed reseeds it
    tprandom.manual_seed(7, tp_rank=1)
    # Reference draws: the default stream is torch.manual_seed(7); the TP stream 7 + offset + 1.
    default_ref = torch.rand(6, generator=torch.Generator().manual_seed(7))
    tp_ref = torch.rand(6, generator=torch.Generator().manual_seed(7 + tprandom.TP_SEED_OFFSET + 1))
    a = torch.rand(3)
    tracker.switch("tp")
    tracker.switch("tp")  # idempotent: no state is lost or duplicated
    b = torch.rand(3)
    tracker.switch("default")
    tracker.switch("default")
    c = torch.rand(3)
    tracker.switch("tp")
    d = torch.rand(3)
    tracker.switch("default")
    assert torch.equal(torch.cat([a, c]), default_ref)
    assert torch.equal(torch.cat([b, d]), tp_ref)
    with tracker.tp_rng():
        assert tracker.current == "tp"
    assert tracker.current == "default"
    # Re-seeding restarts both streams.
    tprandom.manual_seed(7, tp_rank=1)
    assert torch.equal(torch.rand(3), default_ref[:3])
    with tracker.tp_rng():
        assert torch.equal(torch.rand(3), tp_ref[:3])


# ---- CUDA generators, simulated on the CPU ---------------------------------------------------
# 'cuda:0' is a torch.Generator of its own (seeded alike on every simulated rank, as CUDA's default
# stream is after torch.manual_seed), reached through the tracker's device get/seed/set functions;
# the hooks see FakeTensors that report device cuda:0 (no CUDA needed, no computation done).

def _simulated_cuda(monkeypatch, seed: int = 0) -> dict:
    gens = {"cuda:0": torch.Generator().manual_seed(seed)}
    tracker = tprandom.RNGStreamTracker
    monkeypatch.setattr(tracker, "_get", staticmethod(
        lambda d: torch.get_rng_state() if d == "cpu" else gens[d].get_state()))
    monkeypatch.setattr(tracker, "_set", staticmethod(
        lambda d, s: torch.set_rng_state(s) if d == "cpu" else gens[d].set_state(s)))
    monkeypatch.setattr(tracker, "_seed", staticmethod(lambda d, s: gens[d].manual_seed(s)), raising=False)
    return gens


def _on_cuda(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


def _stream(seed: int, n: int = 4) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_a_switch_names_a_cuda_device_first_seen_while_on_the_tp_stream(monkeypatch):
    gens = _simulated_cuda(monkeypatch)
    tracker = tprandom.RNGStreamTracker()
    tracker.reset(seed=7, tp_rank=1)
    tracker.switch("tp")  # the CPU only: no CUDA tensor seen yet
    tracker.switch("tp", ("cuda:0",))  # already on "tp": the new device must still be brought onto it
    assert torch.equal(torch.rand(4, generator=gens["cuda:0"]), _stream(7 + tprandom.TP_SEED_OFFSET + 1))
    tracker.switch("default")  # a device seen once is switched at every later switch
    assert torch.equal(torch.rand(4, generator=gens["cuda:0"]), _stream(0))
    assert tracker.cuda_devices() == ("cuda:0",)


def test_sequence_parallel_dropout_on_cuda_draws_a_stream_of_its_own_on_each_tp_rank(monkeypatch):
    """The region switch at the first decoder block (no weight of its own), then the column layer's
    (already on the TP stream): the CUDA generator must hold the per-rank TP stream. Before the fix
    only the CPU generator was switched, so dropout on cuda:0 drew the default stream, the same
    draws on both ranks (correlated masks)."""
    from types import SimpleNamespace

    from torch import nn

    from tpify.context import TPContext
    from tpify.hooks.sequence_parallel import SequenceParallel

    hidden, weight = _on_cuda(2, 4, 8), _on_cuda(8, 8)
    draws = {}
    for tp_rank in (0, 1):  # one process plays each rank in turn
        gens = _simulated_cuda(monkeypatch)
        tracker = tprandom.RNGStreamTracker()
        tracker.reset(seed=7, tp_rank=tp_rank)
        sp = SequenceParallel(TPContext(None, rng=tracker), {"split": "", "gather": [], "exit": ""})
        block = nn.Module().train()  # a decoder block: hooks see its hidden states, it has no .weight
        sp._split(block, (hidden,), {})
        column = SimpleNamespace(weight=weight, training=True)
        tracker.enter_region(column, (hidden,), hidden)
        draws[tp_rank] = torch.rand(4, generator=gens["cuda:0"])  # what dropout on cuda:0 draws here
        assert torch.equal(draws[tp_rank], _stream(7 + tprandom.TP_SEED_OFFSET + tp_rank)), \
            f"rank {tp_rank}: cuda:0 did not hold the TP stream inside the region"
        sp._exit(block, (hidden,), hidden)  # the default stream again, on cuda:0 too
        assert torch.equal(torch.rand(4, generator=gens["cuda:0"]), _stream(0)), "the default CUDA stream moved"
    assert not torch.equal(draws[0], draws[1]), "both TP ranks drew the same CUDA dropout stream"


def test_devices_of_reads_the_weight_and_the_tensors_a_hook_sees():
    from torch import nn

    x = _on_cuda(2, 3)
    assert tprandom.devices_of(nn.Module()) == ()
    assert tprandom.devices_of(nn.Module(), (x, None), {"h": x}, torch.zeros(1)) == ("cuda:0",)
    assert tprandom.devices_of(nn.Linear(2, 2), torch.zeros(1)) == ()
