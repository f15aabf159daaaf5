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
