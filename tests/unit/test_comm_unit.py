"""tpify.comm's region operators and plain collectives, each against its analytic result.

What it proves:

* at tp=2 (one spawned gloo job, two ranks, float64): ``copy_to_tp_region`` (identity forward,
  sum of the gradients backward), ``copy_many_to_tp_region`` (the same for several tensors in one
  all-reduce, in the widest dtype), ``reduce_from_tp_region`` (sum forward, identity backward),
  ``scatter_to_tp_region`` (this rank's chunk of the last dim forward, all-gather backward),
  ``gather_from_tp_region`` (all-gather forward, this rank's chunk backward), ``all_reduce``
  (sum / max, in place) and ``all_gather_last_dim`` (rank order) give the values and gradients
  written out by hand from every rank's inputs (each rank can rebuild the others' inputs from
  their seeds);
* ``count_collectives`` records exactly the expected calls and element counts (forward and
  backward counted separately), nests, and stops counting when its block ends;
* on a one-rank group inside the two-rank world, and in-process without any process group,
  every operator is the identity (the same tensor object), issues nothing and counts nothing;
* ``raise_unless`` raises the given error with its detail eagerly, ``torch._assert_async``'s
  ``RuntimeError`` under ``torch.compile``.

Tolerance: none; comparisons are exact (``rtol=0, atol=0``). With two ranks each reduced element
is one IEEE addition ``a + b``, which is commutative, so the gloo sum and the reference sum
computed here are the same float; gathers, splits and copies move values without arithmetic.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import tputil
from tpify import comm

WORLD = 2
SHAPE = (2, 3, 4)
F64 = torch.float64
EXACT = dict(rtol=0, atol=0)


def _t(seed, shape=SHAPE, dtype=F64):
    """A float64 normal tensor from ``seed``, so every rank can rebuild every rank's input."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


# ---------------------------------------------------------------------------------------------
# Multi-rank checks: each runs on every rank, issues the same collectives on every rank whatever
# the values, and asserts only after its last collective (a failed check cannot desynchronise the
# ranks for the next one). ``_body`` runs them all in one spawned job and returns, per rank,
# ``{check name: None or the traceback}``.

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


@_check
def copy_to(c):
    x = _t(1).requires_grad_()
    with comm.count_collectives() as fwd:
        y = comm.copy_to_tp_region(x, c.group)
    with comm.count_collectives() as bwd:
        y.backward(_t(100 + c.rank))
    torch.testing.assert_close(y, x, **EXACT)
    torch.testing.assert_close(x.grad, _t(100) + _t(101), **EXACT)
    assert dict(fwd) == {}, f"forward must issue nothing: {dict(fwd)}"
    assert dict(bwd) == {"all_reduce": 1, "all_reduce_numel": 24}, dict(bwd)


@_check
def copy_to_shared_gradient(c):
    # Two copies whose outputs are added: autograd hands both backwards the same gradient tensor.
    # Each input's gradient must be the sum over ranks of that gradient, once.
    x1, x2 = _t(1).requires_grad_(), _t(2).requires_grad_()
    g = _t(100 + c.rank)
    g_before = g.clone()
    (comm.copy_to_tp_region(x1, c.group) + comm.copy_to_tp_region(x2, c.group)).backward(g)
    expected = _t(100) + _t(101)
    torch.testing.assert_close(x1.grad, expected, **EXACT, msg=lambda m: f"x1.grad: {m}")
    torch.testing.assert_close(x2.grad, expected, **EXACT, msg=lambda m: f"x2.grad: {m}")
    torch.testing.assert_close(g, g_before, **EXACT, msg=lambda m: f"the caller's gradient was modified: {m}")


@_check
def copy_many(c):
    a = _t(1, (2, 3, 4), torch.float32).requires_grad_()   # activation X
    b = _t(2, (2, 3, 2)).requires_grad_()                   # adapter h = A X, float64
    frozen = _t(3, (5,))                                    # needs no gradient
    with comm.count_collectives() as fwd:
        ya, yb, yf = comm.copy_many_to_tp_region([a, b, frozen], c.group)
    with comm.count_collectives() as bwd:
        torch.autograd.backward([ya, yb], [_t(100 + c.rank, (2, 3, 4), torch.float32), _t(200 + c.rank, (2, 3, 2))])
    for y, x in ((ya, a), (yb, b), (yf, frozen)):
        torch.testing.assert_close(y, x, **EXACT)
    # Reduced in float64 (the widest), cast back: the float32 sum rounded once.
    ref_a = (_t(100, (2, 3, 4), torch.float32).double() + _t(101, (2, 3, 4), torch.float32).double()).float()
    torch.testing.assert_close(a.grad, ref_a, **EXACT)
    assert a.grad.dtype == torch.float32 and b.grad.dtype == F64
    torch.testing.assert_close(b.grad, _t(200, (2, 3, 2)) + _t(201, (2, 3, 2)), **EXACT)
    assert frozen.grad is None
    assert dict(fwd) == {}, dict(fwd)
    assert dict(bwd) == {"all_reduce": 1, "all_reduce_numel": 24 + 12}, \
        f"one all-reduce of the gradients that are needed only: {dict(bwd)}"


@_check
def reduce_from(c):
    x = _t(10 + c.rank).requires_grad_()
    x_before = x.detach().clone()
    with comm.count_collectives() as fwd:
        y = comm.reduce_from_tp_region(x, c.group)
    g = _t(100 + c.rank)
    with comm.count_collectives() as bwd:
        y.backward(g)
    torch.testing.assert_close(y, _t(10) + _t(11), **EXACT)
    torch.testing.assert_close(x, x_before, **EXACT, msg=lambda m: f"the input was reduced in place: {m}")
    torch.testing.assert_close(x.grad, g, **EXACT, msg=lambda m: f"backward must be the identity: {m}")
    assert dict(fwd) == {"all_reduce": 1, "all_reduce_numel": 24}, dict(fwd)
    assert dict(bwd) == {}, dict(bwd)


@_check
def scatter_to(c):
    x = _t(1, (2, 3, 6)).requires_grad_()
    with comm.count_collectives() as fwd:
        y = comm.scatter_to_tp_region(x, c.group)
    with comm.count_collectives() as bwd:
        y.backward(_t(100 + c.rank, (2, 3, 3)))
    torch.testing.assert_close(y, x.detach()[..., 3 * c.rank: 3 * c.rank + 3], **EXACT)
    assert y.is_contiguous()
    torch.testing.assert_close(x.grad, torch.cat([_t(100, (2, 3, 3)), _t(101, (2, 3, 3))], dim=-1), **EXACT)
    assert dict(fwd) == {}, dict(fwd)
    assert dict(bwd) == {"all_gather": 1, "all_gather_numel": 18}, dict(bwd)


@_check
def scatter_indivisible(c):
    with pytest.raises(ValueError, match="last dimension of 5 over 2 ranks"):
        comm.scatter_to_tp_region(torch.zeros(2, 5, dtype=F64), c.group)


@_check
def gather_from(c):
    x = _t(10 + c.rank, (2, 3, 2)).requires_grad_()
    with comm.count_collectives() as fwd:
        y = comm.gather_from_tp_region(x, c.group)
    with comm.count_collectives() as bwd:
        y.backward(_t(100, (2, 3, 4)))  # the same upstream gradient on every rank (replicated output)
    torch.testing.assert_close(y, torch.cat([_t(10, (2, 3, 2)), _t(11, (2, 3, 2))], dim=-1), **EXACT)
    torch.testing.assert_close(x.grad, _t(100, (2, 3, 4))[..., 2 * c.rank: 2 * c.rank + 2], **EXACT)
    assert dict(fwd) == {"all_gather": 1, "all_gather_numel": 12}, f"numel counts this rank's shard: {dict(fwd)}"
    assert dict(bwd) == {}, dict(bwd)


@_check
def all_reduce_ops(c):
    s = _t(10 + c.rank)
    m = _t(20 + c.rank)
    with comm.count_collectives() as counts:
        out_s = comm.all_reduce(s, c.group)
        out_m = comm.all_reduce(m, c.group, op="max")
    assert out_s is s and out_m is m, "all_reduce works in place and returns its argument"
    torch.testing.assert_close(s, _t(10) + _t(11), **EXACT)
    torch.testing.assert_close(m, torch.maximum(_t(20), _t(21)), **EXACT)
    assert dict(counts) == {"all_reduce": 2, "all_reduce_numel": 48}, dict(counts)


@_check
def all_gather_last_dim(c):
    shard = _t(10 + c.rank, (4, 3)).t()  # (3, 4), not contiguous
    with comm.count_collectives() as counts:
        out = comm.all_gather_last_dim(shard, c.group)
    torch.testing.assert_close(out, torch.cat([_t(10, (4, 3)).t(), _t(11, (4, 3)).t()], dim=-1), **EXACT)
    assert out.shape == (3, 8)
    assert dict(counts) == {"all_gather": 1, "all_gather_numel": 12}, dict(counts)


@_check
def counting_nests_and_stops(c):
    x = _t(1)
    with comm.count_collectives() as outer:
        comm.all_reduce(x.clone(), c.group)
        with comm.count_collectives() as inner:
            comm.all_gather_last_dim(x, c.group)
            comm.barrier(c.group)
        comm.all_reduce(x[0].clone(), c.group)
    comm.all_reduce(x.clone(), c.group)  # after the block: counted by nobody
    try:
        with comm.count_collectives() as failed:
            raise KeyError("inside")
    except KeyError:
        pass
    comm.all_reduce(x.clone(), c.group)
    assert dict(inner) == {"all_gather": 1, "all_gather_numel": 24, "barrier": 1, "barrier_numel": 0}, dict(inner)
    assert dict(outer) == {"all_reduce": 2, "all_reduce_numel": 36, "all_gather": 1, "all_gather_numel": 24,
                           "barrier": 1, "barrier_numel": 0}, dict(outer)
    assert dict(failed) == {}, "a block left by an exception stops counting"


@_check
def one_rank_group(c):
    g = c.single  # a group of this rank only, inside the two-rank world
    x = _t(1, (2, 5)).requires_grad_()  # 5: not divisible by the world, but the group has one rank
    with comm.count_collectives() as counts:
        outs = [comm.copy_to_tp_region(x, g), comm.reduce_from_tp_region(x, g), comm.scatter_to_tp_region(x, g),
                comm.gather_from_tp_region(x, g), comm.all_reduce(x, g), comm.all_gather_last_dim(x, g)]
        many = comm.copy_many_to_tp_region([x, x], g)
        sum(o.sum() for o in outs).backward()
    assert all(o is x for o in outs) and all(o is x for o in many), "one-rank operators return their input"
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0), **EXACT)
    assert dict(counts) == {}, dict(counts)
    assert (comm.group_size(g), comm.group_rank(g)) == (1, 0)
    assert (comm.group_size(c.group), comm.group_rank(c.group)) == (2, c.rank)


def _body(rank, world):
    c = SimpleNamespace(rank=rank, world=world, group=dist.new_group(list(range(world))))
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    c.single = singles[rank]
    return tputil.run_checks(_CHECKS, c)


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, WORLD, timeout=120)


_ok = tputil.assert_checks_ok


def test_copy_to_tp_region_is_identity_forward_and_sums_gradient_backward(tp2):
    _ok(tp2, "copy_to")


def test_copy_to_tp_region_sums_a_shared_gradient_once_and_leaves_it_unchanged(tp2):
    _ok(tp2, "copy_to_shared_gradient")


def test_copy_many_to_tp_region_sums_needed_gradients_in_one_all_reduce_in_widest_dtype(tp2):
    _ok(tp2, "copy_many")


def test_reduce_from_tp_region_sums_forward_without_touching_input_and_passes_gradient(tp2):
    _ok(tp2, "reduce_from")


def test_scatter_to_tp_region_keeps_rank_chunk_and_gathers_gradient(tp2):
    _ok(tp2, "scatter_to")


def test_scatter_to_tp_region_rejects_indivisible_last_dim(tp2):
    _ok(tp2, "scatter_indivisible")


def test_gather_from_tp_region_concatenates_in_rank_order_and_keeps_rank_chunk_of_gradient(tp2):
    _ok(tp2, "gather_from")


def test_all_reduce_sums_or_takes_max_in_place(tp2):
    _ok(tp2, "all_reduce_ops")


def test_all_gather_last_dim_concatenates_non_contiguous_shards_in_rank_order(tp2):
    _ok(tp2, "all_gather_last_dim")


def test_count_collectives_records_exact_counts_nests_and_stops_at_block_end(tp2):
    _ok(tp2, "counting_nests_and_stops")


def test_operators_on_a_one_rank_group_are_identity_and_count_nothing(tp2):
    _ok(tp2, "one_rank_group")


def test_every_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_CHECKS)] * WORLD


# ---------------------------------------------------------------------------------------------
# In-process: no process group at all.

def test_without_process_group_every_operator_is_identity_and_counts_nothing():
    assert not dist.is_initialized(), "these checks need a process without torch.distributed"
    assert (comm.group_size(None), comm.group_rank(None)) == (1, 0)
    x = _t(1, (2, 5)).requires_grad_()
    before = x.detach().clone()
    with comm.count_collectives() as counts:
        outs = [comm.copy_to_tp_region(x, None), comm.reduce_from_tp_region(x, None),
                comm.scatter_to_tp_region(x, None), comm.gather_from_tp_region(x, None),
                comm.all_reduce(x, None), comm.all_reduce(x, None, op="max"), comm.all_gather_last_dim(x, None)]
        many = comm.copy_many_to_tp_region([x, x], None)
        sum(o.sum() for o in outs).backward()
        comm.barrier()
        assert comm.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert all(o is x for o in outs), "each operator returns its input itself"
    assert isinstance(many, tuple) and all(o is x for o in many)
    torch.testing.assert_close(x, before, **EXACT)
    torch.testing.assert_close(x.grad, torch.full_like(x, 7.0), **EXACT)
    assert dict(counts) == {}


def test_raise_unless_raises_the_given_error_with_detail_only_when_false():
    comm.raise_unless(torch.tensor(True), IndexError, "never", detail=lambda: 1 / 0)  # detail not evaluated
    with pytest.raises(IndexError, match=r"^ids out of range$"):
        comm.raise_unless(torch.tensor(False), IndexError, "ids out of range")
    with pytest.raises(ValueError, match=r"^bad labels \(got min -3\)$"):
        comm.raise_unless(torch.tensor(-3) >= 0, ValueError, "bad labels", detail=lambda: "got min -3")


def test_raise_unless_under_torch_compile_stays_in_graph_and_raises_runtime_error():
    def f(x):
        comm.raise_unless(x.min() >= 0, ValueError, "x must be non-negative")
        return x * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0), **EXACT)
    with pytest.raises(RuntimeError, match="x must be non-negative"):
        compiled(-torch.ones(3))
