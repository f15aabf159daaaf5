"""tpify.layers against the dense module it replaces: ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding and their ``from_dense``.

What it proves, at tp=2 (one spawned gloo job, two ranks, float64, every dense parameter drawn
from N(0, 1) so that every value matters, including bias and the embedding's padding row):

* each layer built with ``from_dense`` from an ``nn.Linear``, a transformers ``Conv1D`` or an
  ``nn.Embedding`` holds exactly (bitwise) its ``ShardSpec`` slice of the dense weights, and its
  output, input gradient and gathered weight gradients equal the dense module's: column-parallel
  plain, with ``gather_output`` True/False, packed GPT-2 ``[Q | K | V]`` (Conv1D), packed
  grouped-query ``[Q | K | V]`` of unequal widths, padded output features (gathered output
  stripped, local padding zero); row-parallel with ``input_is_parallel`` True/False, its bias
  added once; the vocab-parallel embedding with a padded vocabulary and ``padding_idx`` on either
  rank (no gradient into the padding row), and out-of-range ids raising ``IndexError`` on every
  rank before any collective;
* each layer issues exactly the communication its docstring states (counted with
  ``count_collectives``, forward and backward separately);
* the constructors reject what they document as errors;
* uneven splits (``uneven=True``, torch.chunk's rule: 5 features as 3 + 2, 1 as 1 + 0): a
  column layer, GELU and a row layer (``nn.Linear`` and ``Conv1D``) equal the dense pair with the
  collectives of an even split; gathering their gradients sends ``ceil(n / p)`` rows from every
  rank (the padded shards); gathering an uneven output and scattering into an uneven row layer
  are refused before any collective.

A few single-process checks (tp=1, no process group) cover ``from_dense``'s type checks and that
a one-rank layer is the dense module.

Tolerance: ``atol=1e-12, rtol=1e-12`` for computed values (outputs, gradients). The dense and the
parallel computations differ only in how sums are split (a row-parallel output is the sum of two
half dot products; column shards may be blocked differently by the BLAS), which moves float64
results of order 1 by a few ulps (~1e-16); a real error (a wrong shard, a bias added twice, a
missing or doubled all-reduce) is of order 1e-1 and more. Weights and anything only copied or
sliced are compared bitwise.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers.pytorch_utils import Conv1D

import tputil
from tpify import comm
from tpify.layers import ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpify.sharding import ShardSpec, chunk_range, shard_spec_of

WORLD = 2
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
EXACT = dict(atol=0, rtol=0)
#: One float64 rounding of the largest output (|y| < 8 here: 8.9e-16), where the layer and the
#: dense module reach the same sum through other kernels (a row-parallel Conv1D adds its bias
#: after the matmul, Conv1D inside ``addmm``); relative to a small output it is no bound.
ONE_ROUNDING = dict(atol=2e-15, rtol=0)


def _t(seed, shape, dtype=F64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _dense(module, seed):
    """``module`` in float64 with every parameter drawn from N(0, 1) (same values on every rank)."""
    module = module.double()
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_t(seed + i, p.shape))
    return module


def _in_out(module):
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return module.in_features, module.out_features


def _gathered_grads(layer, group):
    """``{name: dense gradient}``: sharded gradients gathered (a collective), replicated ones as is."""
    out = {}
    for name, p in layer.named_parameters():
        spec = shard_spec_of(p)
        out[name] = spec.gather(p.grad, group) if spec is not None else p.grad
    return out


def _assert_exact_shards(layer, dense, rank):
    for name, p in layer.named_parameters():
        spec, source = shard_spec_of(p), getattr(dense, name)
        expected = spec.slice_dense(source.detach(), rank) if spec is not None else source.detach()
        torch.testing.assert_close(p.detach(), expected, **EXACT, msg=lambda m: f"shard of {name}: {m}")


def _assert_same_grads(layer_grads, dense):
    for name, grad in layer_grads.items():
        ref = getattr(dense, name).grad
        torch.testing.assert_close(grad, ref, **TOL, msg=lambda m: f"gradient of {name}: {m}")


# ---------------------------------------------------------------------------------------------
# Multi-rank checks. Each issues the same collectives on every rank whatever the values and
# asserts only after its last collective, so a failing check cannot desynchronise the next one.

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _column_case(c, dense, *, gather=False, parts=None, padded=None, seed=0):
    in_f, out_f = _in_out(dense)
    layer = ColumnParallelLinear.from_dense(dense, c.group, gather_output=gather, partition_sizes=parts,
                                            padded_out_features=padded)
    x = _t(seed + 50, (2, 3, in_f))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    gd = _t(seed + 60, yd.shape)
    yd.backward(gd)
    out_spec = ShardSpec(2, tuple(parts or (out_f,)), c.world, padded)
    with comm.count_collectives() as fwd:
        yp = layer(xp)
    with comm.count_collectives() as bwd:
        yp.backward(gd if gather else out_spec.slice_dense(gd, c.rank))
    gathered_out = yp.detach() if gather else out_spec.gather(yp.detach(), c.group)
    grads = _gathered_grads(layer, c.group)
    # --- asserts only from here on
    _assert_exact_shards(layer, dense, c.rank)
    local = layer.out_features_per_partition
    assert local == out_spec.local_size
    if gather:
        assert yp.shape == yd.shape, "a gathered output has the dense width, padding stripped"
        torch.testing.assert_close(yp, yd, **TOL)
    else:
        assert yp.shape == (2, 3, local)
        torch.testing.assert_close(yp, out_spec.slice_dense(yd.detach(), c.rank), **TOL)
    torch.testing.assert_close(gathered_out, yd, **TOL)
    torch.testing.assert_close(xp.grad, xd.grad, **TOL, msg=lambda m: f"input gradient: {m}")
    _assert_same_grads(grads, dense)
    assert dict(fwd) == ({"all_gather": 1, "all_gather_numel": 6 * local} if gather else {}), dict(fwd)
    assert dict(bwd) == {"all_reduce": 1, "all_reduce_numel": x.numel()}, dict(bwd)
    return layer, yp


@_check
def column_linear(c):
    _column_case(c, _dense(nn.Linear(6, 8), 0), gather=False, seed=1)


@_check
def column_linear_gather_output(c):
    _column_case(c, _dense(nn.Linear(6, 8), 0), gather=True, seed=2)


@_check
def column_conv1d_gpt2_qkv(c):
    # GPT-2 c_attn: Conv1D(nf=3*8, nx=8), weight [8, 24] = [Q | K | V]; rank r holds [Q_r | K_r | V_r].
    layer, _ = _column_case(c, _dense(Conv1D(24, 8), 10), parts=[8, 8, 8], seed=3)
    assert layer.weight.shape == (8, 12) and shard_spec_of(layer.weight).dim == 1


@_check
def column_linear_gqa_unequal_parts(c):
    # Grouped-query attention packed as [Q | K | V] with widths 16, 8, 8 (4 query heads, 2 kv heads of 4).
    layer, _ = _column_case(c, _dense(nn.Linear(6, 32), 20), parts=[16, 8, 8], seed=4)
    assert layer.weight.shape == (16, 6)


@_check
def column_linear_padded_gather_output(c):
    # A vocabulary of 7 over 2 ranks, padded to 8: the gathered output has 7 columns.
    layer, _ = _column_case(c, _dense(nn.Linear(6, 7), 30), gather=True, padded=8, seed=5)
    if c.rank == 1:
        assert torch.equal(layer.weight[3], torch.zeros(6, dtype=F64)) and layer.bias[3] == 0, "padding is zero"
        assert torch.equal(layer.weight.grad[3], torch.zeros(6, dtype=F64)), "no gradient into the padding"


@_check
def column_conv1d_padded_local_output(c):
    layer, yp = _column_case(c, _dense(Conv1D(7, 6), 40), gather=False, padded=8, seed=6)
    assert layer.weight.shape == (6, 4)
    if c.rank == 1:
        torch.testing.assert_close(yp[..., 3], torch.zeros(2, 3, dtype=F64), **EXACT,
                                   msg=lambda m: f"the padding column of the local output: {m}")


def _row_case(c, dense, *, parallel_input, seed):
    in_f, out_f = _in_out(dense)
    layer = RowParallelLinear.from_dense(dense, c.group, input_is_parallel=parallel_input)
    in_spec = ShardSpec(2, (in_f,), c.world)
    x = _t(seed + 50, (2, 3, in_f))
    xd = x.clone().requires_grad_()
    xp = (in_spec.slice_dense(x, c.rank) if parallel_input else x.clone()).requires_grad_()
    yd = dense(xd)
    gd = _t(seed + 60, yd.shape)  # the output is replicated: the same upstream gradient on every rank
    yd.backward(gd)
    with comm.count_collectives() as fwd:
        yp = layer(xp)
    with comm.count_collectives() as bwd:
        yp.backward(gd)
    grads = _gathered_grads(layer, c.group)
    # --- asserts only from here on
    _assert_exact_shards(layer, dense, c.rank)
    torch.testing.assert_close(yp, yd, **TOL)
    expected_xgrad = in_spec.slice_dense(xd.grad, c.rank) if parallel_input else xd.grad
    torch.testing.assert_close(xp.grad, expected_xgrad, **TOL, msg=lambda m: f"input gradient: {m}")
    _assert_same_grads(grads, dense)
    assert dict(fwd) == {"all_reduce": 1, "all_reduce_numel": yd.numel()}, dict(fwd)
    local_in = 2 * 3 * (in_f // c.world)
    assert dict(bwd) == ({} if parallel_input else {"all_gather": 1, "all_gather_numel": local_in}), dict(bwd)
    return layer


@_check
def row_linear_parallel_input(c):
    _row_case(c, _dense(nn.Linear(8, 5), 50), parallel_input=True, seed=7)


@_check
def row_linear_replicated_input(c):
    _row_case(c, _dense(nn.Linear(8, 5), 60), parallel_input=False, seed=8)


@_check
def row_conv1d_gpt2_proj(c):
    layer = _row_case(c, _dense(Conv1D(5, 8), 70), parallel_input=True, seed=9)
    assert layer.weight.shape == (4, 5) and shard_spec_of(layer.weight).dim == 0


@_check
def row_bias_added_once(c):
    dense = _dense(nn.Linear(8, 5), 80)
    layer = RowParallelLinear.from_dense(dense, c.group)
    y = layer(torch.zeros(2, 4, dtype=F64))
    torch.testing.assert_close(y, dense.bias.detach().expand(2, 5), **EXACT,
                               msg=lambda m: f"a zero input must give the bias once: {m}")
    assert shard_spec_of(layer.bias) is None, "the row-parallel bias is replicated"


def _embedding_case(c, padding_idx, seed):
    dense = _dense(nn.Embedding(7, 4, padding_idx=padding_idx), seed)
    layer = VocabParallelEmbedding.from_dense(dense, c.group, padded_num_embeddings=8)
    ids = torch.tensor([[0, 3, 4, 6, padding_idx, 2], [padding_idx, 1, 5, 3, 3, 6]])
    yd = dense(ids)
    gd = _t(seed + 60, yd.shape)
    yd.backward(gd)
    with comm.count_collectives() as fwd:
        yp = layer(ids)
    with comm.count_collectives() as bwd:
        yp.backward(gd)
    grads = _gathered_grads(layer, c.group)
    # --- asserts only from here on
    _assert_exact_shards(layer, dense, c.rank)
    assert layer.weight.shape == (4, 4)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (4 * c.rank, 4 * c.rank + 4)
    owner = padding_idx // 4
    assert layer._local_padding_idx == (padding_idx - 4 * c.rank if c.rank == owner else None)
    if c.rank == 1:
        assert torch.equal(layer.weight[3].detach(), torch.zeros(4, dtype=F64)), "padded row 7 is zero"
        assert torch.equal(layer.weight.grad[3], torch.zeros(4, dtype=F64)), "no gradient into padding"
    torch.testing.assert_close(yp, yd, **TOL)
    _assert_same_grads(grads, dense)
    assert torch.equal(grads["weight"][padding_idx], torch.zeros(4, dtype=F64)), "no gradient into padding_idx"
    # the output's all-reduce, and before it the check that every rank holds the same ids (4 values; the
    # bounds flag rides on it)
    assert dict(fwd) == {"all_reduce": 2, "all_reduce_numel": yd.numel() + 5}, dict(fwd)
    assert dict(bwd) == {}, dict(bwd)


@_check
def embedding_padding_idx_on_rank0(c):
    _embedding_case(c, padding_idx=1, seed=90)


@_check
def embedding_padding_idx_on_rank1(c):
    _embedding_case(c, padding_idx=5, seed=100)


@_check
def embedding_out_of_range_ids(c):
    dense = _dense(nn.Embedding(7, 4), 110)
    layer = VocabParallelEmbedding.from_dense(dense, c.group, padded_num_embeddings=8)
    raised, counts = [], []
    for bad in ([[0, 7]], [[-1, 2]], [[3, 100]]):  # 7 is a padding row of rank 1: still out of range
        with comm.count_collectives() as counted:
            try:
                layer(torch.tensor(bad))
                raised.append(None)
            except IndexError as e:
                raised.append(str(e))
        counts.append(dict(counted))
    ok = layer(torch.tensor([[0, 6]]))  # the ranks are still in step after the errors
    assert all(r is not None and "ids must be in [0, 7)" in r for r in raised), raised
    assert "this rank: min 0, max 7" in raised[0] and "this rank: min -1" in raised[1], raised
    # called directly (not through a model whose call checked the ids), the layer first checks that every
    # rank holds the same ids, with the bounds riding on it (5 values): the error comes on every rank,
    # before the output's all-reduce
    assert counts == [{"all_reduce": 1, "all_reduce_numel": 5}] * 3, f"only the ids check before the error: {counts}"
    torch.testing.assert_close(ok, dense(torch.tensor([[0, 6]])), **TOL)


@_check
def constructor_errors(c):
    cases = [
        (lambda: ColumnParallelLinear(6, 7, tp_group=c.group), "not divisible by tp_size = 2"),
        (lambda: ColumnParallelLinear(6, 12, tp_group=c.group, partition_sizes=[6, 3, 3]), "not divisible"),
        (lambda: ColumnParallelLinear(6, 12, tp_group=c.group, partition_sizes=[4, 4]), "do not add up"),
        (lambda: ColumnParallelLinear(6, 12, tp_group=c.group, partition_sizes=[4, 4, 4], gather_output=True),
         "cannot gather its output"),
        (lambda: ColumnParallelLinear(6, 7, tp_group=c.group, padded_out_features=9), "multiple of 2"),
        (lambda: RowParallelLinear(5, 4, tp_group=c.group), "in_features = 5 is not divisible by tp_size = 2"),
        (lambda: VocabParallelEmbedding(7, 4, tp_group=c.group), "multiple of 2"),
        (lambda: ColumnParallelLinear(6, 8, tp_group=c.group, weight_layout="conv2d"), "weight_layout"),
    ]
    missed = []
    for make, needle in cases:
        try:
            make()
            missed.append(f"no error, expected {needle!r}")
        except ValueError as e:
            if needle not in str(e):
                missed.append(f"{e!r} does not say {needle!r}")
    assert not missed, missed


@_check
def from_dense_keeps_flags_dtype_and_specs(c):
    dense = nn.Linear(6, 8)  # float32
    dense.bias.requires_grad_(False)
    col = ColumnParallelLinear.from_dense(dense, c.group)
    row = RowParallelLinear.from_dense(nn.Linear(8, 6, bias=False), c.group)
    meta = ColumnParallelLinear.from_dense(Conv1D(24, 8).to("meta"), c.group, partition_sizes=[8, 8, 8])
    assert col.weight.dtype == col.bias.dtype == torch.float32
    assert col.weight.requires_grad and not col.bias.requires_grad, "requires_grad is copied per parameter"
    assert shard_spec_of(col.weight) == ShardSpec(0, (8,), 2) and shard_spec_of(col.bias) == ShardSpec(0, (8,), 2)
    assert shard_spec_of(row.weight) == ShardSpec(1, (8,), 2) and row.bias is None
    assert (col.tp_size, col.tp_rank) == (2, c.rank)
    assert meta.weight.device.type == "meta" and meta.weight.shape == (8, 12)
    assert shard_spec_of(meta.weight) == ShardSpec(1, (8, 8, 8), 2)
    with torch.no_grad():
        col.weight.add_(1)
    assert not torch.equal(col.weight, ShardSpec(0, (8,), 2).slice_dense(dense.weight, c.rank)), \
        "the shard is a copy: changing it leaves the dense module alone"


@_check
def column_linear_mqa_replicated_parts(c):
    """Multi-query ``[Q | K | V]`` with K and V kept whole: each rank gets its query heads' share
    of the K/V output gradient (here: rank 0 all of it minus a noise term, rank 1 the noise), and
    the layer sums the K/V weight and bias gradients over the group; Q stays split."""
    dense = _dense(nn.Linear(6, 16), 7)
    parts = (8, 4, 4)
    layer = ColumnParallelLinear.from_dense(dense, c.group, partition_sizes=list(parts), replicated_parts=(1, 2))
    x = _t(71, (2, 3, 6))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    gd = _t(72, yd.shape)
    yd.backward(gd)
    spec = ShardSpec(2, parts, c.world, None, (1, 2))
    local_grad = spec.slice_dense(gd, c.rank)
    noise = _t(73, (2, 3, 8))
    local_grad[..., 4:] = gd[..., 8:] - noise if c.rank == 0 else noise  # the K/V partial sums add up to gd
    with comm.count_collectives() as fwd:
        yp = layer(xp)
    with comm.count_collectives() as bwd:
        yp.backward(local_grad)
    grads = _gathered_grads(layer, c.group)
    # --- asserts only from here on
    _assert_exact_shards(layer, dense, c.rank)
    assert layer.out_features_per_partition == 4 + 4 + 4 and spec.local_size == 12
    torch.testing.assert_close(yp, spec.slice_dense(yd.detach(), c.rank), **TOL)
    torch.testing.assert_close(xp.grad, xd.grad, **TOL, msg=lambda m: f"input gradient: {m}")
    _assert_same_grads(grads, dense)
    assert dict(fwd) == {}, dict(fwd)
    # the input gradient, then one all-reduce of the K/V rows of weight (8 x 6) and bias (8)
    assert dict(bwd) == {"all_reduce": 2, "all_reduce_numel": x.numel() + 8 * 6 + 8}, dict(bwd)


@_check
def column_linear_overlapped_backward_equals_the_plain_region_operator(c):
    """The overlapped backward (async input-gradient all-reduce during the weight-gradient matmul)
    gives bitwise the gradients of ``copy_to_tp_region`` + matmul, with the same one all-reduce."""
    results = []
    for overlap in (True, False):
        for make in (lambda: nn.Linear(6, 8), lambda: Conv1D(8, 6)):
            dense = _dense(make(), 100)
            layer = ColumnParallelLinear.from_dense(dense, c.group, overlap_grad_reduce=overlap)
            x = _t(101, (2, 3, 6)).requires_grad_()
            with comm.count_collectives() as bwd:
                layer(x).backward(_t(102, (2, 3, 4)))
            results.append((x.grad, layer.weight.grad, layer.bias.grad, dict(bwd)))
    for (a, b) in zip(results[:2], results[2:]):
        for ga, gb in zip(a[:3], b[:3]):
            torch.testing.assert_close(ga, gb, **EXACT)
        assert a[3] == b[3] == {"all_reduce": 1, "all_reduce_numel": 36}, (a[3], b[3])


def _dense_shared_input_grads(denses, x, gouts, used):
    """Dense reference: the gradient of ``x`` and of each layer's weight for the loss
    ``sum_i (layer_i(x) * gouts[i]).sum()`` over the layers in ``used``."""
    xd = x.clone().requires_grad_()
    for d in denses:
        d.zero_grad()
    sum((d(xd) * g).sum() for i, (d, g) in enumerate(zip(denses, gouts)) if i in used).backward()
    return xd.grad, [d.weight.grad for d in denses]


@_check
def column_linears_sharing_an_input_all_reduce_its_gradient_once(c):
    """Layers that read the same activation (Llama's q/k/v, gate/up) share one region entry
    (``ColumnParallelInput``): one all-reduce of the input gradient in backward, not one each,
    with every gradient equal to dense's; a consumer whose output is left out of the loss, a
    ``torch.autograd.grad`` pass that stops at the weights (leaving a partial sum behind), a
    retained graph run twice and a layer reading another tensor all stay exact."""
    from tpify.layers import ColumnParallelInput

    from tpify.context import TPContext

    denses = [_dense(nn.Linear(6, 8), 110 + 10 * i) for i in range(3)]
    shared = ColumnParallelInput()
    context = TPContext(c.group, region_input=shared)  # what surgery gives the layers of one model
    layers = [ColumnParallelLinear.from_dense(d, c.group, context=context) for d in denses]
    x = _t(150, (2, 3, 6))
    gouts = [_t(151 + i, (2, 3, 8)) for i in range(3)]

    def parallel(used, twice=False, weights_first=False):
        xp = x.clone().requires_grad_()
        for layer in layers:
            layer.zero_grad()
        shared.clear()
        outs = [layer(xp) for layer in layers]
        local = [g[..., c.rank * 4:(c.rank + 1) * 4] for g in gouts]
        loss = sum((o * g).sum() for i, (o, g) in enumerate(zip(outs, local)) if i in used)
        if weights_first:  # reaches every consumer, not the entry: leaves a partial sum behind
            torch.autograd.grad(loss, [layer.weight for layer in layers], retain_graph=True)
        with comm.count_collectives() as bwd:
            loss.backward(retain_graph=twice)
            if twice:
                loss.backward()
        weights = [None if layer.weight.grad is None  # the same layers have gradients on every rank
                   else shard_spec_of(layer.weight).gather(layer.weight.grad, c.group) for layer in layers]
        return xp.grad, weights, dict(bwd)

    results = {"all": parallel({0, 1, 2}), "one left out": parallel({0, 2}), "twice": parallel({0, 1, 2}, True),
               "after a weights-only pass": parallel({0, 1, 2}, weights_first=True)}
    # a copy of a layer holding a cached entry (a non-leaf tensor) copies no autograd state
    shared.clear()
    layers[0](x.clone().requires_grad_())
    clone = copy.deepcopy(layers[0], {id(c.group): c.group})  # (a ProcessGroup cannot be copied)
    clone_is_empty = clone.region_input._cached is None and shared._cached is not None
    # a layer reading another tensor gets its own entry
    y = _t(160, (2, 3, 6)).requires_grad_()
    shared.clear()
    with comm.count_collectives() as two:
        (layers[0](x.clone().requires_grad_()).sum() + layers[1](y).sum()).backward()
    # --- asserts only from here on
    for name, (xg, wgs, counted) in results.items():
        used = {0, 2} if name == "one left out" else {0, 1, 2}
        ref_x, ref_w = _dense_shared_input_grads(denses, x, gouts, used)
        scale = 2 if name == "twice" else 1
        torch.testing.assert_close(xg, scale * ref_x, **TOL, msg=lambda m: f"{name}: input gradient: {m}")
        for i in range(3):
            expected = scale * ref_w[i] if i in used else None
            if expected is None:
                assert wgs[i] is None, name
            else:
                torch.testing.assert_close(wgs[i], expected, **TOL, msg=lambda m: f"{name}: weight {i}: {m}")
        # one all-reduce of the 36-value input gradient (+ gathering nothing: counted before)
        assert counted == {"all_reduce": scale, "all_reduce_numel": 36 * scale}, (name, counted)
    assert dict(two) == {"all_reduce": 2, "all_reduce_numel": 72}, dict(two)
    assert clone_is_empty


@_check
def column_linears_sharing_a_sequence_parallel_gather_reduce_scatter_once(c):
    """Sequence parallelism: the all-gather of the tokens ``(B, T/p, H) -> (B, T, H)`` is a region
    entry (``ColumnParallelInput.gather``); the layers reading the gathered tensor share it, and
    their summed input gradient is reduce-scattered back to this rank's tokens once (started by
    the last of them, overlapped with its weight gradient), equal to dense's; a consumer whose
    output is left out of the loss, and one that does not share (``overlap_grad_reduce=False``:
    its partial gradient reaches the entry through autograd, reduce-scattered on its own), stay
    exact."""
    from tpify.layers import ColumnParallelInput

    from tpify.context import TPContext

    denses = [_dense(nn.Linear(6, 8), 170 + 10 * i) for i in range(3)]
    shared = ColumnParallelInput()
    context = TPContext(c.group, region_input=shared)
    x = _t(200, (2, 4, 6))  # (B, T, H): rank r holds tokens [2r, 2r + 2)
    gouts = [_t(201 + i, (2, 4, 8)) for i in range(3)]

    def parallel(used, plain=()):
        xp = x[:, c.rank * 2:(c.rank + 1) * 2].clone().requires_grad_()
        layers = [ColumnParallelLinear.from_dense(d, c.group, context=context, sequence_parallel=True,
                                                  overlap_grad_reduce=i not in plain) for i, d in enumerate(denses)]
        shared.clear()
        with comm.count_collectives() as fwd:
            gathered = shared.gather(xp, c.group)
        outs = [layer(gathered) for layer in layers]
        consumers = shared.lookup(gathered)[1].consumers
        local = [g[..., c.rank * 4:(c.rank + 1) * 4] for g in gouts]
        loss = sum((o * g).sum() for i, (o, g) in enumerate(zip(outs, local)) if i in used)
        with comm.count_collectives() as bwd:
            loss.backward()
        weights = [None if layer.weight.grad is None
                   else shard_spec_of(layer.weight).gather(layer.weight.grad, c.group) for layer in layers]
        return xp.grad, weights, dict(fwd), dict(bwd), consumers, tuple(gathered.shape), gathered.is_contiguous()

    results = {"all": (parallel({0, 1, 2}), {0, 1, 2}, 1, 3),
               "one left out": (parallel({0, 2}), {0, 2}, 1, 3),
               "one not sharing": (parallel({0, 1, 2}, plain=(1,)), {0, 1, 2}, 2, 2)}
    # --- asserts only from here on
    for name, ((xg, wgs, fwd, bwd, consumers, shape, contiguous), used, scatters, sharing) in results.items():
        ref_x, ref_w = _dense_shared_input_grads(denses, x, gouts, used)
        ref_x = ref_x[:, c.rank * 2:(c.rank + 1) * 2]  # this rank's tokens
        torch.testing.assert_close(xg, ref_x, **TOL, msg=lambda m: f"{name}: input gradient: {m}")
        for i in range(3):
            if i not in used:
                assert wgs[i] is None, name
            else:
                torch.testing.assert_close(wgs[i], ref_w[i], **TOL, msg=lambda m: f"{name}: weight {i}: {m}")
        assert (shape, contiguous, consumers) == ((2, 4, 6), True, sharing), (name, shape, contiguous, consumers)
        assert fwd == {"all_gather": 1, "all_gather_numel": 24}, (name, fwd)
        # the shared sum reduce-scattered once (48 values in, 24 out per rank); a non-sharing reader once more;
        # the sharing readers saved this rank's tokens, gathered again once (24 values), as Megatron does
        assert bwd == {"reduce_scatter": scatters, "reduce_scatter_numel": 48 * scatters, "all_gather": 1,
                       "all_gather_numel": 24}, (name, bwd)


@_check
def column_embedding_splits_heads(c):
    """``embedding_colwise``: T5's relative attention bias, columns = heads; no communication."""
    dense = _dense(nn.Embedding(10, 4), 80)
    layer = ColumnParallelEmbedding.from_dense(dense, c.group)
    ids = torch.tensor([[0, 3, 9], [2, 2, 5]])
    yd = dense(ids)
    gd = _t(81, yd.shape)
    yd.backward(gd)
    with comm.count_collectives() as counted:
        yp = layer(ids)
        yp.backward(gd[..., c.rank * 2:(c.rank + 1) * 2])
    grads = _gathered_grads(layer, c.group)
    _assert_exact_shards(layer, dense, c.rank)
    torch.testing.assert_close(yp, yd.detach()[..., c.rank * 2:(c.rank + 1) * 2], **EXACT)
    _assert_same_grads(grads, dense)
    assert dict(counted) == {}, dict(counted)


@_check
def vocab_embedding_output_scale(c):
    """A scaled embedding (Gemma's: lookup times sqrt(hidden), the scale cast to the weight's
    dtype first) as ``output_scale``; one all-reduce forward as without it."""
    dense = _dense(nn.Embedding(7, 4), 90)
    scale = 4 ** 0.5
    layer = VocabParallelEmbedding.from_dense(dense, c.group, padded_num_embeddings=8, output_scale=scale)
    ids = torch.tensor([[0, 6, 3], [5, 1, 4]])
    with comm.count_collectives() as counted:
        yp = layer(ids)
    torch.testing.assert_close(yp, dense(ids).detach() * scale, **EXACT)
    assert dict(counted)["all_reduce"] == 2  # the ids check (called directly) and the output's, as without it


def _uneven_mlp_case(c, column, row, seed):
    """A column layer, GELU, a row layer, their width ``n`` split unevenly (torch.chunk's rule:
    rank r holds chunk_range(n, 2, r)): output, input gradient, every weight gradient against
    the dense pair; one all-reduce forward and one backward, as for an even split; the gradient
    gather sends the same number of values from every rank (the shards padded)."""
    col = ColumnParallelLinear.from_dense(column, c.group, uneven=True)
    rowp = RowParallelLinear.from_dense(row, c.group, uneven=True)
    in_f, n = _in_out(column)
    x = _t(seed, (2, 3, in_f))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = row(torch.nn.functional.gelu(column(xd)))
    gd = _t(seed + 1, yd.shape)
    yd.backward(gd)
    with comm.count_collectives() as fwd:
        yp = rowp(torch.nn.functional.gelu(col(xp)))
    with comm.count_collectives() as bwd:
        yp.backward(gd)
    with comm.count_collectives() as gathers:
        grads = {**{f"col.{k}": v for k, v in _gathered_grads(col, c.group).items()},
                 **{f"row.{k}": v for k, v in _gathered_grads(rowp, c.group).items()}}
    # --- asserts only from here on
    a, b = chunk_range(n, c.world, c.rank)
    assert (col.out_features_per_partition, rowp.in_features_per_partition) == (b - a, b - a)
    _assert_exact_shards(col, column, c.rank)
    _assert_exact_shards(rowp, row, c.rank)
    torch.testing.assert_close(yp, yd, **TOL)
    torch.testing.assert_close(xp.grad, xd.grad, **TOL, msg=lambda m: f"input gradient: {m}")
    for name, grad in grads.items():
        ref = getattr(column if name.startswith("col.") else row, name.split(".", 1)[1]).grad
        torch.testing.assert_close(grad, ref, **TOL, msg=lambda m: f"gradient of {name}: {m}")
    assert dict(fwd) == {"all_reduce": 1, "all_reduce_numel": yd.numel()}, dict(fwd)
    assert dict(bwd) == {"all_reduce": 1, "all_reduce_numel": x.numel()}, dict(bwd)
    chunk = -(-n // c.world)  # every rank sends ceil(n / p) rows of each gathered gradient
    assert dict(gathers)["all_gather_numel"] == chunk * (in_f + 1 + row.weight.numel() // n), dict(gathers)
    return col, rowp


@_check
def uneven_linear_mlp_of_5(c):
    col, _ = _uneven_mlp_case(c, _dense(nn.Linear(6, 5), 130), _dense(nn.Linear(5, 4), 131), 132)
    assert col.weight.shape == ((3, 6), (2, 6))[c.rank]


@_check
def uneven_conv1d_mlp_of_5(c):
    col, row = _uneven_mlp_case(c, _dense(Conv1D(5, 6), 140), _dense(Conv1D(4, 5), 141), 142)
    assert (col.weight.shape, row.weight.shape) == (((6, 3), (3, 4)), ((6, 2), (2, 4)))[c.rank]


@_check
def uneven_rank_holding_nothing(c):
    """A width of 1 over 2 ranks: rank 1 holds no feature (empty shards), and still takes part."""
    col, _ = _uneven_mlp_case(c, _dense(nn.Linear(6, 1), 150), _dense(nn.Linear(1, 4), 151), 152)
    assert col.weight.shape == ((1, 6), (0, 6))[c.rank]


@_check
def uneven_layers_refuse_what_needs_equal_chunks(c):
    """Gathering an uneven output (at construction, and per call before any collective) and
    scattering a replicated input into an uneven row layer are refused on every rank."""
    cases = [
        (lambda: ColumnParallelLinear(6, 5, tp_group=c.group, uneven=True, gather_output=True),
         "an uneven ColumnParallelLinear (5 output features over tp_size = 2: [3, 2] per rank) cannot gather"),
        (lambda: RowParallelLinear(5, 4, tp_group=c.group, uneven=True, input_is_parallel=False),
         "takes its input already split (input_is_parallel=True)"),
        (lambda: ColumnParallelLinear(6, 5, tp_group=c.group, uneven=True, device="meta")(
            torch.zeros(2, 6, device="meta"), runtime_gather_output=True), "cannot gather its output"),
    ]
    missed = []
    with comm.count_collectives() as counted:
        for make, needle in cases:
            try:
                make()
                missed.append(f"no error, expected {needle!r}")
            except ValueError as e:
                if needle not in str(e):
                    missed.append(f"{e!r} does not say {needle!r}")
    assert not missed, missed
    assert dict(counted) == {}, dict(counted)


def _body(rank, world):
    c = SimpleNamespace(rank=rank, world=world, group=dist.new_group(list(range(world))))
    return tputil.run_checks(_CHECKS, c)


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, WORLD, timeout=120)


_ok = tputil.assert_checks_ok


def test_column_parallel_linear_matches_dense_with_local_and_gathered_output(tp2):
    _ok(tp2, "column_linear", "column_linear_gather_output")


def test_column_parallel_conv1d_splits_gpt2_qkv_per_part(tp2):
    _ok(tp2, "column_conv1d_gpt2_qkv")


def test_column_parallel_linear_splits_unequal_gqa_parts(tp2):
    _ok(tp2, "column_linear_gqa_unequal_parts")


def test_column_parallel_padded_output_is_stripped_when_gathered_and_zero_locally(tp2):
    _ok(tp2, "column_linear_padded_gather_output", "column_conv1d_padded_local_output")


def test_row_parallel_linear_matches_dense_with_parallel_and_replicated_input(tp2):
    _ok(tp2, "row_linear_parallel_input", "row_linear_replicated_input", "row_conv1d_gpt2_proj")


def test_row_parallel_bias_is_replicated_and_added_once(tp2):
    _ok(tp2, "row_bias_added_once")


def test_vocab_parallel_embedding_matches_dense_with_padding_idx_on_either_rank(tp2):
    _ok(tp2, "embedding_padding_idx_on_rank0", "embedding_padding_idx_on_rank1")


def test_vocab_parallel_embedding_raises_index_error_before_any_collective(tp2):
    _ok(tp2, "embedding_out_of_range_ids")


def test_column_parallel_replicated_parts_sum_their_gradients(tp2):
    _ok(tp2, "column_linear_mqa_replicated_parts")


def test_column_parallel_overlapped_backward(tp2):
    _ok(tp2, "column_linear_overlapped_backward_equals_the_plain_region_operator")


def test_column_parallel_layers_sharing_an_input_all_reduce_its_gradient_once(tp2):
    _ok(tp2, "column_linears_sharing_an_input_all_reduce_its_gradient_once")


def test_column_parallel_layers_sharing_a_sequence_parallel_gather_reduce_scatter_once(tp2):
    _ok(tp2, "column_linears_sharing_a_sequence_parallel_gather_reduce_scatter_once")


def test_column_parallel_embedding_and_scaled_vocab_embedding(tp2):
    _ok(tp2, "column_embedding_splits_heads", "vocab_embedding_output_scale")


def test_constructors_reject_unsplittable_sizes(tp2):
    _ok(tp2, "constructor_errors")


def test_from_dense_copies_requires_grad_dtype_and_attaches_specs(tp2):
    _ok(tp2, "from_dense_keeps_flags_dtype_and_specs")


def test_uneven_column_and_row_layers_match_the_dense_mlp(tp2):
    _ok(tp2, "uneven_linear_mlp_of_5", "uneven_conv1d_mlp_of_5")


def test_uneven_split_with_a_rank_holding_nothing_matches_dense(tp2):
    _ok(tp2, "uneven_rank_holding_nothing")


def test_uneven_layers_refuse_to_gather_or_scatter(tp2):
    _ok(tp2, "uneven_layers_refuse_what_needs_equal_chunks")


def test_every_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_CHECKS)] * WORLD


# ---------------------------------------------------------------------------------------------
# In-process, one rank, no process group.

@pytest.mark.parametrize("make", [lambda: nn.Linear(6, 8), lambda: Conv1D(8, 6)], ids=["linear", "conv1d"])
def test_one_rank_layers_are_the_dense_module(make):
    dense = _dense(make(), 120)
    x = _t(121, (2, 3, 6))
    for layer in (ColumnParallelLinear.from_dense(dense, None), ColumnParallelLinear.from_dense(dense, None,
                  gather_output=True), RowParallelLinear.from_dense(dense, None, input_is_parallel=False)):
        assert layer.tp_size == 1
        torch.testing.assert_close(layer(x), dense(x), **ONE_ROUNDING)
    emb = _dense(nn.Embedding(7, 4, padding_idx=2), 122)
    ids = torch.tensor([[0, 2, 6]])
    torch.testing.assert_close(VocabParallelEmbedding.from_dense(emb, None)(ids), emb(ids), **EXACT)


def test_from_dense_rejects_other_modules_and_unsupported_embedding_options():
    with pytest.raises(TypeError, match="expected nn.Linear or transformers Conv1D, got Embedding"):
        ColumnParallelLinear.from_dense(nn.Embedding(4, 2), None)
    with pytest.raises(TypeError, match="expected nn.Embedding, got Linear"):
        VocabParallelEmbedding.from_dense(nn.Linear(4, 2), None)
    for kwargs in (dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)):
        with pytest.raises(NotImplementedError):
            VocabParallelEmbedding.from_dense(nn.Embedding(4, 2, **kwargs), None)


def test_deepcopy_of_a_parallel_layer_keeps_its_shard_specs():
    layer = ColumnParallelLinear.from_dense(nn.Linear(6, 8), None, partition_sizes=[4, 2, 2])
    clone = copy.deepcopy(layer)
    assert shard_spec_of(clone.weight) == shard_spec_of(layer.weight) == ShardSpec(0, (4, 2, 2), 1)
    assert shard_spec_of(clone.bias) == shard_spec_of(layer.bias)
