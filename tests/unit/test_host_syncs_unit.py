"""Host syncs in one process: the counter, the deferred checks, clipping without a host read.

* ``tpify.syncs.count_host_syncs`` counts ``.item()``, ``bool()``, ``nonzero``, ``bincount`` and
  ``repeat_interleave`` without ``output_size`` (none with it), a marked sync once whatever it
  holds, and AdamW's reads of its own step counters apart, outside the total;
* ``tpify.comm.DeferredChecks`` reads nothing while a call records, raises the first failed check
  at the next collect with its detail and the "found at the model's next call" note, keeps values
  for the next call, keeps a pending call when the next records nothing;
* ``raise_unless`` without ``defer`` still raises at once, with a detail of tensors;
* ``clip_params_grad_norm_`` (tp = 1): the norm and the clipped gradients of the formula it had
  before ``torch._foreach_norm`` (a float32 copy of each gradient, squares summed; float32 and
  bfloat16 gradients) and, in float32, of ``torch.nn.utils.clip_grad_norm_``; the gradients
  untouched when the norm is not finite; no host sync;
* ``mean_or_nan`` with a Python count: the mean, or NaN with a zero gradient.

Tolerances: norms ``rtol=1e-6`` (the same float32 squares summed in another order, from norms
squared again); clipped gradients ``rtol=1e-6`` (the same product, the coefficient within that).
"""

import pytest
import torch

from tpify import comm
from tpify.loss import mean_or_nan
from tpify.syncs import OPTIMIZER, count_host_syncs, host_sync
from tpify.training import clip_params_grad_norm_


def test_the_counter_counts_reads_and_value_dependent_ops_and_a_marked_sync_once():
    x = torch.arange(6)
    with count_host_syncs() as counts:
        x.sum().item()
        bool(x[0] == 0)
        torch.nonzero(x)
        torch.bincount(x)
        with host_sync("split sizes"):
            x.tolist()
            x.max().item()
    assert counts["aten::_local_scalar_dense"] == 2 and counts["aten::nonzero"] == 1, counts
    assert counts["aten::bincount"] == 1 and counts["tpify.host_sync: split sizes"] == 1, counts
    assert counts["total"] == 5, counts
    with count_host_syncs() as counts:
        torch.repeat_interleave(torch.ones(3, dtype=torch.long), x[:3], output_size=3)
    assert counts["total"] == 0, counts
    with count_host_syncs() as counts:
        torch.repeat_interleave(torch.ones(3, dtype=torch.long), x[:3])
    assert counts["total"] > 0, counts


def test_the_optimizers_reads_of_its_step_counters_are_counted_apart():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with count_host_syncs() as counts:
        opt.step()
    assert counts["total"] == 0 and counts[OPTIMIZER] >= 2, counts


def test_deferred_checks_read_nothing_while_recording_and_raise_at_the_next_collect():
    checks = comm.DeferredChecks()
    ids = torch.tensor([3, 9, -1])
    low, high = torch.aminmax(ids)
    with count_host_syncs() as counts:
        comm.raise_unless(low >= 0, IndexError, "ids must be in [0, 5)", defer=checks,
                          detail=((low, high), lambda lo, hi: f"min {lo}, max {hi}"))
        comm.raise_unless(high < 100, ValueError, "never", defer=checks)
        checks.keep("inputs", torch.tensor(7), "note")
        checks.submit()
    assert counts["total"] == 0, counts
    kept, failed = checks.collect()
    assert kept == {"inputs": (7, "note")}
    assert len(failed) == 1 and isinstance(failed[0], IndexError)
    assert str(failed[0]).startswith("ids must be in [0, 5) (min -1, max 9) (found at the model's next call")
    assert checks.collect() == ({}, []), "collected once"


def test_a_call_that_records_nothing_keeps_the_previous_calls_checks_pending():
    checks = comm.DeferredChecks()
    comm.raise_unless(torch.tensor(False), ValueError, "first", defer=checks)
    checks.submit()
    checks.submit()  # a call that raised before recording anything
    comm.raise_unless(torch.tensor(False), ValueError, "second", defer=checks)
    checks.submit()
    _, failed = checks.collect()
    assert [str(e).split(" (found")[0] for e in failed] == ["first", "second"]


def test_raise_unless_without_defer_raises_at_once_with_a_detail_of_tensors():
    with pytest.raises(IndexError, match=r"^bad \(got -3\)$"):
        comm.raise_unless(torch.tensor(False), IndexError, "bad", detail=((torch.tensor(-3),), lambda v: f"got {v}"))


def test_host_copy_reads_the_values_on_the_host():
    copy = comm.HostCopy([torch.tensor(2.5), torch.tensor(3)], torch.float64)
    assert copy.values() == [2.5, 3.0]


def _grads(dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 4, dtype=dtype)), torch.nn.Parameter(torch.randn(7, dtype=dtype)),
              torch.nn.Parameter(torch.randn(3, dtype=torch.float32))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_at_tp1_equals_the_float32_formula_with_no_host_sync(dtype):
    params, ref = _grads(dtype), _grads(dtype)
    with count_host_syncs() as counts:
        norm = clip_params_grad_norm_(params, 1.0, None)
    assert counts["total"] == 0, counts
    # the formula before torch._foreach_norm: a float32 copy of each gradient, its squares summed
    want = torch.stack([r.grad.float().pow(2).sum() for r in ref]).sum().sqrt()
    coef = torch.clamp(1.0 / (want + 1e-6), max=1.0)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad * coef.to(r.grad.dtype), rtol=1e-6, atol=0)
    if dtype == torch.float32:  # and torch's own clip (float32: the same sums)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(_grads(dtype), 1.0), rtol=1e-6, atol=0)


def test_a_non_finite_norm_leaves_the_gradients_untouched():
    params = _grads(torch.float32)
    params[1].grad[2] = float("inf")
    before = [p.grad.clone() for p in params]
    norm = clip_params_grad_norm_(params, 1.0, None)
    assert not torch.isfinite(norm)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_mean_or_nan_with_a_python_count():
    total = torch.tensor(6.0, requires_grad=True)
    assert mean_or_nan(total, 3).item() == 2.0
    empty = mean_or_nan(total, 0)
    empty.backward()
    assert torch.isnan(empty) and total.grad.item() == 0.0
