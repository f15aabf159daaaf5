"""tpify.hooks, one hook module at a time, on small hand-built modules (no Hugging Face model).

One spawned job of 2 gloo ranks runs every check (``_CHECKS``); each test reads its checks'
outcomes from the module-scoped fixture. Every check builds its dense single-process reference
on the same rank from one seed (float64) and compares:

* ``dropout``: outside a sharded region the tracker holds the shared stream, inside (after a
  region start, before a region end) the per-rank TP stream in training and the shared one in
  eval; the draws are those of generators seeded ``seed`` and ``seed + TP_SEED_OFFSET + rank``,
  equal across ranks outside the region and different inside;
* ``head_inputs``: per-head tensors are sliced to this rank's heads (heads in dim 1, and
  batch-major ``B * n_heads`` in dim 0), a dimension of 1 is left alone, positional and keyword
  arguments alike, the gradient of a sliced tensor is every head's; a missing argument and a
  size that is no multiple of the head count are refused;
* ``region_grads``: a replicated parameter used inside a region (a per-head norm between a
  column- and a row-parallel layer) or on this rank's tokens (sequence parallelism) gets its
  gradient summed over the group; one used outside does not; collectives counted;
* ``sequence_parallel``: split, gather and exit on a toy two-layer stack: output, input gradient
  and every parameter's gradient equal the dense stack's; ``CallState.sequence_active`` is set
  during the call and reset after; row-parallel layers get ``scatter_output`` from
  ``ScatterOutput``; a ``T`` the group does not divide raises with gradients and runs without
  sequence parallelism under ``no_grad``;
* ``lm_loss``: a toy LM whose head is ``ColumnParallelLinear(gather_output=True)`` over a padded
  vocabulary: the ``labels=`` loss (keyword or positional, with ``num_items_in_batch``) equals
  dense cross-entropy with HF's causal semantics, with its gradients; ``KeepLogitsSharded`` passes
  ``runtime_gather_output=False`` only during such a call, to a ``copy.deepcopy`` of the head too;
  a declared ``[loss] terms`` term is added, an undeclared ``*_loss`` output refused;
* ``guards``: ``BatchCheck`` refuses other ids, shapes or keyword tensors on the two ranks, on
  every rank, before any other collective (counted): other shapes at once, other values at the
  model's next call (read one call late, without a host sync); ``refuse_fused_lm_head`` refuses before any
  collective; ``refuse_foreign_ddp`` refuses a DDP over the world around a toy tp model and
  accepts one over its DP group.

Tolerance: ``atol=rtol=1e-12`` for computed values (outputs, losses, gradients): the parallel
computations differ from the dense ones only in how sums are split over the ranks (float64
values of order 1 move by a few ulps, ~1e-16); a real error (a missing or doubled all-reduce, a
wrong slice) is of order 1e-1. Slices, copies and random draws are compared bitwise.
"""

import copy
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import ModelOutput

import tputil
from tpify import comm
from tpify.context import CallState, TPContext, mode_arguments
from tpify.grad_sums import SummedGrads
from tpify.hooks import dropout, guards, head_inputs, lm_loss, region_grads
from tpify.hooks.lm_loss import KeepLogitsSharded
from tpify.hooks.sequence_parallel import ScatterOutput, SequenceParallel
from tpify.info import TPInfo, TPUsageError
from tpify.layers import ColumnParallelInput, ColumnParallelLinear, RowParallelLinear
from tpify.random import TP_SEED_OFFSET, RNGStreamTracker
from tpify.sharding import ShardSpec, shard_spec_of

WORLD = 2
F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
EXACT = dict(atol=0, rtol=0)


#: The layout of a toy model no style installs hooks on (what region_grads reads of a layout).
NO_STYLES = SimpleNamespace(modules={})


def _watcher(handles):
    """The :class:`region_grads.ReplicatedInRegion` among ``region_grads.install``'s handles."""
    return next(h for h in handles if isinstance(h, region_grads.ReplicatedInRegion))


def _t(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _dense(module, seed):
    """``module`` in float64, every parameter drawn from N(0, 1) (the same on every rank)."""
    module = module.double()
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_t(seed + i, p.shape))
    return module


def _ranks(c, x):
    """``x`` of every rank, in rank order (one all-gather)."""
    return comm.all_gather_dim(x.detach().unsqueeze(0).contiguous(), 0, c.group).unbind(0)


def _tracker(c, seed):
    tracker = RNGStreamTracker()
    tracker.seed, tracker.tp_rank = seed, c.rank
    return tracker


def _raised(fn):
    """The exception ``fn()`` raised, or None: checks assert after their last collective."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to be asserted on
        return e
    return None


def _grads(module, group):
    """``{name: dense gradient}``: sharded gradients gathered (a collective), replicated ones as they are."""
    out = {}
    for name, p in module.named_parameters():
        spec = shard_spec_of(p)
        out[name] = spec.gather(p.grad, group) if spec is not None else p.grad
    return out


def _assert_same_grads(grads, dense):
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    assert set(grads) == set(dense_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], **TOL, msg=lambda m: f"gradient of {name}: {m}")


# ---------------------------------------------------------------------------------------------
# Checks. Each issues the same collectives on every rank whatever the values and asserts only
# after its last collective, so a failing check cannot desynchronise the next one.

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


# ---- dropout ------------------------------------------------------------------------------

class _Draw(nn.Module):
    """Where a dropout would be: records the tracker's stream and region flag, draws 3 numbers
    from the global generator."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker, self.seen = tracker, []
        self.attention_dropout = 0.1  # a dropout probability tpify finds (as HF attention modules keep theirs)

    def forward(self, x):
        self.seen.append((self.tracker.current, self.tracker.in_region, torch.rand(3, dtype=F64)))
        return x


class _DropoutToy(nn.Module):
    """before -> up (a region starts after it) -> inside -> down (a region ends before it) -> after."""

    def __init__(self, tracker):
        super().__init__()
        self.before, self.up, self.inside = _Draw(tracker), nn.Linear(4, 8), _Draw(tracker)
        self.down, self.after = nn.Linear(8, 4), _Draw(tracker)

    def forward(self, x):
        return self.after(self.down(self.inside(self.up(self.before(x)))))


@_check
def dropout_streams_inside_and_outside_a_region(c):
    saved = torch.get_rng_state()
    seed = 1234
    tracker = _tracker(c, seed)
    model = _DropoutToy(tracker).double()
    handles = dropout.install(model, SimpleNamespace(region_starts=("up",), region_ends=("down",)),
                              TPContext(c.group, rng=tracker))
    torch.manual_seed(seed)
    x = torch.zeros(2, 4, dtype=F64)
    model.train()
    model(x)
    model(x)
    after_train = (tracker.current, tracker.in_region)
    model.eval()
    model(x)
    after_eval = (tracker.current, tracker.in_region)
    draws = {name: torch.stack([d for _, _, d in getattr(model, name).seen]) for name in ("before", "inside", "after")}
    across = {name: _ranks(c, d) for name, d in draws.items()}
    for h in handles:
        h.remove()
    torch.set_rng_state(saved)
    # --- asserts only from here on
    # the dense reference: the shared stream from `seed`, the TP stream from seed + offset + rank;
    # calls 1 and 2 in training (inside: TP), call 3 in eval (nothing switches: inside draws shared)
    shared, tp = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + TP_SEED_OFFSET + c.rank)
    expected = {"before": [], "inside": [], "after": []}
    for call in range(3):
        expected["before"].append(torch.rand(3, generator=shared, dtype=F64))
        expected["inside"].append(torch.rand(3, generator=tp if call < 2 else shared, dtype=F64))
        expected["after"].append(torch.rand(3, generator=shared, dtype=F64))
    for name in draws:
        torch.testing.assert_close(draws[name], torch.stack(expected[name]), **EXACT, msg=lambda m: f"{name}: {m}")
    assert [s[:2] for s in model.before.seen] == [("default", False)] * 3
    assert [s[:2] for s in model.inside.seen] == [("tp", True), ("tp", True), ("default", True)]
    assert [s[:2] for s in model.after.seen] == [("default", False)] * 3
    assert after_train == after_eval == ("default", False), "the shared stream outside the model"
    for name in ("before", "after"):
        assert torch.equal(*across[name]), f"{name}: the shared stream draws alike on every rank"
    assert not torch.equal(across["inside"][0][:2], across["inside"][1][:2]), "the TP stream differs per rank"
    assert torch.equal(across["inside"][0][2], across["inside"][1][2]), "in eval the region draws shared"


# ---- head_inputs --------------------------------------------------------------------------

class _Heads(nn.Module):
    def forward(self, hidden, alibi=None, mask=None):
        return hidden, alibi, mask


class _HeadsToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Heads()

    def forward(self, *args, **kwargs):
        return self.attn(*args, **kwargs)


@_check
def head_inputs_sliced_to_this_ranks_heads(c):
    B, n, T = 2, 4, 3
    mine = slice(2 * c.rank, 2 * c.rank + 2)  # heads r*n/p .. (r+1)*n/p - 1
    model = _HeadsToy()
    layout = SimpleNamespace(head_inputs={"attn": (("alibi", 0, n), ("mask", -3, n))})  # mask (B, n, T, T): dim 1
    handles = head_inputs.install(model, layout, TPContext(c.group))
    hidden = _t(0, (B, T, 8))
    alibi = _t(1, (B * n, 1, T)).requires_grad_()  # batch-major, heads fastest (bloom)
    mask, broadcast = _t(2, (B, n, T, T)), _t(3, (B, 1, T, T))
    weight = _t(4, (B * n, 1, T))
    with comm.count_collectives() as fwd:
        h1, a1, m1 = model(hidden, alibi, mask=mask)  # alibi positional, mask by keyword
        h2, a2, m2 = model(hidden=hidden, alibi=alibi.detach(), mask=broadcast)
    with comm.count_collectives() as bwd:
        (a1 * weight.view(B, n, 1, T)[:, mine].reshape(B * 2, 1, T)).sum().backward()
    missing = _raised(lambda: model(hidden, mask=mask))
    wrong = _raised(lambda: model(hidden, alibi=_t(5, (6, 1, T)), mask=mask))
    for h in handles:
        h.remove()
    # --- asserts only from here on
    torch.testing.assert_close(a1, alibi.detach().view(B, n, 1, T)[:, mine].reshape(B * 2, 1, T), **EXACT)
    torch.testing.assert_close(m1, mask[:, mine], **EXACT)
    torch.testing.assert_close(a2, a1.detach(), **EXACT)
    assert h1 is hidden and h2 is hidden, "other arguments are left alone"
    assert m2 is broadcast, "a dimension of 1 is broadcast over the heads: left alone"
    # d/d alibi of sum over ranks of (alibi_r * w_r) = w: every head's gradient, on every rank
    torch.testing.assert_close(alibi.grad, weight, **TOL)
    assert dict(fwd) == {}, dict(fwd)
    assert dict(bwd) == {"all_gather": 1, "all_gather_numel": B * 2 * T}, dict(bwd)
    assert isinstance(missing, ValueError) and str(missing).startswith(
        "tpify: attn (_Heads) was called without argument 'alibi', which the recipe's head_inputs slices per rank")
    assert isinstance(wrong, ValueError) and "argument 'alibi' of shape (6, 1, 3); the recipe's head_inputs says " \
        "dimension 0 holds 4 heads (fastest), but 6 is neither 1 nor a multiple of 4" in str(wrong), wrong


# ---- region_grads -------------------------------------------------------------------------

class _QKNormToy(nn.Module):
    """pre_norm (replicated, outside) -> up (column) -> head_norm per head of 2 (replicated,
    inside the region: phi's q_layernorm) -> down (row)."""

    def __init__(self, up, down):
        super().__init__()
        self.pre_norm, self.up, self.head_norm, self.down = nn.LayerNorm(4), up, nn.LayerNorm(2), down

    def forward(self, x):
        h = self.up(self.pre_norm(x))  # (B, T, 8 / p)
        h = self.head_norm(h.unflatten(-1, (-1, 2))).flatten(-2)  # (B, T, heads / p, 2)
        return self.down(h)


@_check
def region_grads_sums_gradients_of_replicated_params_used_inside_a_region(c):
    dense = _dense(_QKNormToy(nn.Linear(4, 8), nn.Linear(8, 4)), 10)
    tracker, state = _tracker(c, 0), CallState()
    ctx = TPContext(c.group, region_input=ColumnParallelInput(), rng=tracker, state=state)
    par = copy.deepcopy(dense)
    par.up = ColumnParallelLinear.from_dense(dense.up, c.group, context=ctx)
    par.down = RowParallelLinear.from_dense(dense.down, c.group, context=ctx)
    handles = dropout.install(par, SimpleNamespace(region_starts=("up",), region_ends=("down",)), ctx)
    handles += region_grads.install(par, NO_STYLES, ctx)
    watcher = _watcher(handles)
    x, g = _t(20, (2, 3, 4)), _t(21, (2, 3, 4))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense(xd).backward(g)
    with comm.count_collectives() as fwd:
        yp = par(xp)
    with comm.count_collectives() as bwd:
        yp.backward(g)
    hooks_after_one = len(handles)
    grads = _grads(par, c.group)
    par.zero_grad()
    par(xp.detach()).backward(g)  # a second call adds no second gradient hook
    second = _grads(par, c.group)
    for h in handles:
        h.remove()
    # --- asserts only from here on
    assert watcher.found == ["head_norm"], watcher.found
    torch.testing.assert_close(yp, dense(x), **TOL)
    torch.testing.assert_close(xp.grad, xd.grad, **TOL)
    _assert_same_grads(grads, dense)  # head_norm summed; pre_norm and down.bias as they are (not doubled)
    _assert_same_grads(second, dense)
    assert len(handles) == hooks_after_one
    assert dict(fwd) == {"all_reduce": 1, "all_reduce_numel": 24}, dict(fwd)  # the row layer's output
    # the column layer's input gradient (B*T*4), and head_norm's weight and bias (2 + 2) in one all-reduce
    # (tpify.grad_sums: the replicated parameters' gradients summed together once per backward pass)
    assert dict(bwd) == {"all_reduce": 2, "all_reduce_numel": 24 + 4}, dict(bwd)


class _SplitTokensToy(nn.Module):
    """split_norm runs on this rank's tokens while the call splits them (CallState.sequence_active),
    full_norm on every token after."""

    def __init__(self, state, rank):
        super().__init__()
        self.split_norm, self.full_norm, self.state, self.rank = nn.LayerNorm(4), nn.LayerNorm(4), state, rank

    def forward(self, x):
        self.state.sequence_active = True
        part = self.split_norm(x.chunk(WORLD, dim=1)[self.rank])
        self.state.sequence_active = False
        return part, self.full_norm(x)


@_check
def region_grads_sums_gradients_of_params_that_see_this_ranks_tokens(c):
    state = CallState()
    dense = _dense(_SplitTokensToy(CallState(), 0), 30)
    par = copy.deepcopy(dense)
    par.state, par.rank = state, c.rank
    handles = region_grads.install(par, NO_STYLES, TPContext(c.group, rng=_tracker(c, 0), state=state))
    watcher = _watcher(handles)
    x, g1, g2 = _t(31, (2, 4, 4)), _t(32, (2, 4, 4)), _t(33, (2, 4, 4))
    (dense.split_norm(x) * g1).sum().add((dense.full_norm(x) * g2).sum()).backward()
    part, full = par(x)
    (part * g1.chunk(WORLD, dim=1)[c.rank]).sum().add((full * g2).sum()).backward()
    grads = _grads(par, c.group)
    for h in handles:
        h.remove()
    # --- asserts only from here on
    assert watcher.found == ["split_norm"], watcher.found
    _assert_same_grads(grads, dense)


# ---- sequence_parallel --------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class _Layer(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(4), _MLP(up, down)

    def forward(self, hidden):
        return hidden + self.mlp(self.ln(hidden))


class _Stack(nn.Module):
    """Two pre-norm residual layers and a final norm: the residual stream of a decoder."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(2))
        self.norm = nn.LayerNorm(4)

    def forward(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


@_check
def sequence_parallel_split_gather_exit_match_dense(c):
    dense = _dense(_Stack(), 40)
    tracker = _tracker(c, 0)
    ctx = TPContext(c.group, region_input=ColumnParallelInput(), rng=tracker, state=CallState())
    par = copy.deepcopy(dense)
    for i in range(2):
        mlp = par.layers[i].mlp
        mlp.up = ColumnParallelLinear.from_dense(dense.layers[i].mlp.up, c.group, sequence_parallel=True, context=ctx)
        mlp.down = RowParallelLinear.from_dense(dense.layers[i].mlp.down, c.group, sequence_parallel=True, context=ctx)
    where = {"split": "layers.0", "gather": ["layers.0.mlp", "layers.1.mlp"], "exit": "norm"}
    handles = [par.register_forward_hook(ctx.region_input.clear)] + SequenceParallel(ctx, where).install(par)
    handles += region_grads.install(par, NO_STYLES, ctx)
    seen_ln, seen_scatter = [], []
    spies = [par.layers[1].ln.register_forward_pre_hook(
                 lambda m, args: seen_ln.append((ctx.state.sequence_active, tuple(args[0].shape)))),
             par.layers[0].mlp.down.register_forward_pre_hook(
                 lambda m, args, kwargs: seen_scatter.append(kwargs.get("scatter_output", "absent")),
                 with_kwargs=True)]
    par.train()
    x, g = _t(41, (2, 4, 4)), _t(42, (2, 4, 4))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(g)
    yp = par(xp)
    after_call = (ctx.state.sequence_active, tracker.current)
    yp.backward(g)
    grads = _grads(par, c.group)
    odd = _t(43, (2, 5, 4))
    refused = _raised(lambda: par(odd.clone().requires_grad_()))
    with torch.no_grad():
        y_odd = par(odd)
        y_odd_dense = dense(odd)
    down = par.layers[0].mlp.down
    scatters = [h for h in mode_arguments(down) if isinstance(h, ScatterOutput)]
    up_modes = mode_arguments(par.layers[0].mlp.up)
    for h in handles + spies:
        h.remove()
    # --- asserts only from here on
    torch.testing.assert_close(yp, yd, **TOL)
    torch.testing.assert_close(xp.grad, xd.grad, **TOL)
    _assert_same_grads(grads, dense)
    assert seen_ln[0] == (True, (2, 2, 4)), "inside the split stretch: active, this rank's T/p tokens"
    assert after_call == (False, "default"), "reset after the call, the shared stream again"
    assert seen_scatter[0] is True, "the row layer reduce-scatters in a split call"
    assert len(scatters) == 1 and scatters[0].state is ctx.state
    assert up_modes == [], "column layers get no scatter_output"
    assert mode_arguments(down) == [], "removed with the handles"
    assert isinstance(refused, ValueError) and str(refused).startswith(
        "tpify sequence parallelism: the sequence length 5 is not divisible by tp_size = 2"), refused
    torch.testing.assert_close(y_odd, y_odd_dense, **TOL)
    assert seen_ln[-1] == (False, (2, 5, 4)), "without gradients: every token, no split"
    assert seen_scatter[-1] is False, "and the row layer all-reduces"


# ---- grad_sums ----------------------------------------------------------------------------

class _CheckpointedStack(_Stack):
    """:class:`_Stack` whose layers run under non-reentrant activation checkpointing when
    ``context_fn`` is set (tpify's: the dropout streams and the call state restored)."""

    context_fn = None

    def forward(self, hidden):
        for layer in self.layers:
            if self.context_fn is None:
                hidden = layer(hidden)
            else:
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=False,
                                                           context_fn=self.context_fn)
        return self.norm(hidden)


def _sequence_parallel_stack(c, dense):
    """``dense`` (a :class:`_Stack`) made tensor-parallel with sequence parallelism, as
    ``parallelize`` would: (model, its context, the hook handles)."""
    tracker = _tracker(c, 0)
    ctx = TPContext(c.group, region_input=ColumnParallelInput(), rng=tracker, state=CallState(),
                    summed_grads=SummedGrads(c.group))
    par = copy.deepcopy(dense)
    for i in range(2):
        mlp = par.layers[i].mlp
        mlp.up = ColumnParallelLinear.from_dense(dense.layers[i].mlp.up, c.group, sequence_parallel=True, context=ctx)
        mlp.down = RowParallelLinear.from_dense(dense.layers[i].mlp.down, c.group, sequence_parallel=True, context=ctx)
    where = {"split": "layers.0", "gather": ["layers.0.mlp", "layers.1.mlp"], "exit": "norm"}
    handles = [par.register_forward_hook(ctx.region_input.clear)] + SequenceParallel(ctx, where).install(par)
    handles += region_grads.install(par, NO_STYLES, ctx)
    return par.train(), ctx, handles


@_check
def summed_grads_take_one_all_reduce_per_backward_pass(c):
    """The LayerNorm weights and biases and the row-parallel biases of a sequence-parallel stack
    (each a partial sum over this rank's tokens) are summed in one all-reduce per backward pass:
    with two passes accumulated before reading the gradients (each pass summed once, not lost
    nor doubled), under activation checkpointing, through ``torch.autograd.grad`` (the sums
    returned, one all-reduce per parameter, ``.grad`` untouched); frozen ones are not summed;
    inside a synchronizing DDP (its reducer copies each gradient as it is accumulated) one per
    parameter before accumulation, in its ``no_sync`` passes one in all."""
    dense = _dense(_CheckpointedStack(), 50)
    par, ctx, handles = _sequence_parallel_stack(c, dense)
    replicated = [p for n, p in par.named_parameters() if "ln" in n or n.startswith("norm") or "down.bias" in n]
    dense_replicated = [p for n, p in dense.named_parameters() if "ln" in n or n.startswith("norm") or "down.bias" in n]
    xs, gs = [_t(51 + i, (2, 4, 4)) for i in range(2)], [_t(53 + i, (2, 4, 4)) for i in range(2)]
    out = {}

    def passes(model, runs):
        counts = []
        for x, g in runs:
            with comm.count_collectives() as n:
                model(x).backward(g)
            counts.append(n["all_reduce"])
        return counts

    # two passes accumulated
    for x, g in zip(xs, gs):
        dense(x).backward(g)
    out["accumulated"] = (passes(par, zip(xs, gs)), _grads(par, c.group), {n: p.grad.clone() for n, p in
                                                                           dense.named_parameters()})
    # torch.autograd.grad: the sums returned
    par.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)
    with comm.count_collectives() as n:
        returned = torch.autograd.grad((par(xs[0]) * gs[0]).sum(), replicated)
    out["autograd.grad"] = (n["all_reduce"], returned, torch.autograd.grad((dense(xs[0]) * gs[0]).sum(),
                                                                           dense_replicated),
                            [p.grad for p in par.parameters()])
    # activation checkpointing
    par.context_fn = functools.partial(ctx.rng.checkpoint_context_fn, ctx.state)
    dense(xs[0]).backward(gs[0])
    out["checkpointed"] = (passes(par, [(xs[0], gs[0])]), _grads(par, c.group),
                           {n: p.grad.clone() for n, p in dense.named_parameters()})
    par.context_fn = None
    # frozen: nothing to sum
    par.zero_grad(set_to_none=True)
    for p in replicated:
        p.requires_grad_(False)
    out["frozen"] = passes(par, [(xs[0], gs[0])])
    for p in replicated:
        p.requires_grad_(True)
    # inside a DDP over a group of this rank alone (the model's DP group at dp = 1): synchronizing, per
    # parameter before accumulation; no_sync, batched
    own = [dist.new_group([r]) for r in range(WORLD)][c.rank]
    ddp = torch.nn.parallel.DistributedDataParallel(par, process_group=own)
    par.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)
    with ddp.no_sync():
        unsynced = passes(ddp, [(xs[0], gs[0])])
    synced = passes(ddp, [(xs[1], gs[1])])
    for x, g in zip(xs, gs):
        dense(x).backward(g)
    out["ddp"] = (unsynced + synced, _grads(par, c.group), {n: p.grad.clone() for n, p in dense.named_parameters()})
    del ddp
    for h in handles:
        h.remove()
    # --- asserts only from here on
    assert len(replicated) == 8, "3 LayerNorms' weights and biases, 2 row-parallel biases"
    counts, grads, dense_grads = out["accumulated"]
    assert counts == [1, 1], counts
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], **TOL, msg=lambda m: f"accumulated {name}: {m}")
    count, returned, expected, left = out["autograd.grad"]
    assert count == len(replicated), count
    for got, want in zip(returned, expected):
        torch.testing.assert_close(got, want, **TOL)
    assert all(g is None for g in left), "torch.autograd.grad accumulates nothing"
    counts, grads, dense_grads = out["checkpointed"]
    assert counts == [1], counts
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], **TOL, msg=lambda m: f"checkpointed {name}: {m}")
    assert out["frozen"] == [0], out["frozen"]
    counts, grads, dense_grads = out["ddp"]
    assert counts == [1, len(replicated)], counts
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], **TOL, msg=lambda m: f"DDP {name}: {m}")


# ---- lm_loss ------------------------------------------------------------------------------

@dataclass
class _Out(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class _ToyLM(nn.Module):
    """Embedding -> LM head, returning a ModelOutput; with labels it computes HF's causal loss
    itself (dense), as a head class does. ``aux``: also return an ``aux_loss`` (a MoE's)."""

    def __init__(self, embed, head, aux=False):
        super().__init__()
        self.embed, self.lm_head, self.aux = embed, head, aux
        self.config = SimpleNamespace(router_aux_loss_coef=0.25)

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.lm_head(self.embed(input_ids))
        loss = None if labels is None else tputil.ref_lm_loss(logits, labels, True, num_items_in_batch)
        aux = self.embed.weight.square().mean() if self.aux else None
        return _Out(loss=loss, logits=logits, aux_loss=aux)


V, VP = 9, 10  # a vocabulary tp 2 does not divide, padded to 10


def _lm_pair(c, state, aux=False):
    dense = _dense(_ToyLM(nn.Embedding(V, 4), nn.Linear(4, V), aux), 50)
    par = copy.deepcopy(dense)
    ctx = TPContext(c.group, region_input=ColumnParallelInput(), state=state)
    par.lm_head = ColumnParallelLinear.from_dense(dense.lm_head, c.group, gather_output=True, padded_out_features=VP,
                                                  context=ctx)
    return dense, par


def _lm_layout(terms=()):
    return SimpleNamespace(lm_head="lm_head", loss_kind="causal", honours_num_items=True, loss_terms=terms,
                           logit_ops=(), lm_loss_chunk=None)


@_check
def lm_loss_from_vocab_shards_equals_dense_causal_cross_entropy(c):
    state = CallState()
    dense, par = _lm_pair(c, state)
    handles = lm_loss.install(par, _lm_layout(), TPContext(c.group, state=state))
    seen = []
    spy = par.lm_head.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((kwargs.get("runtime_gather_output", "absent"), state.logits_sharded)),
        with_kwargs=True)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(51))
    labels = ids.clone()
    labels[0, 2] = labels[1, 4] = -100
    ref = dense(ids, labels=labels)
    ref.loss.backward()
    with comm.count_collectives() as fwd:
        out = par(ids, labels=labels)
    out.loss.backward()
    grads = _grads(par, c.group)
    after = state.logits_sharded
    with torch.no_grad():
        plain = par(ids)
        positional = par(ids, labels)
        counted = par(ids, labels=labels, num_items_in_batch=7)
        ref_counted = dense(ids, labels=labels, num_items_in_batch=7)
        original = par.lm_head
        par.lm_head = copy.deepcopy(original)  # what PEFT's modules_to_save does to a head
        copied = par(ids, labels=labels)
        copied_plain = par(ids)
        par.lm_head = original
    keep = [h for h in original._forward_pre_hooks.values() if isinstance(h, KeepLogitsSharded)]
    for h in handles + [spy]:
        h.remove()
    # --- asserts only from here on
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    logits_spec = ShardSpec(2, (V,), WORLD, VP)
    assert out.logits.shape == (2, 5, VP // WORLD), "with labels the logits stay split over the vocabulary"
    torch.testing.assert_close(out.logits, logits_spec.slice_dense(ref.logits.detach(), c.rank), **TOL)
    _assert_same_grads(grads, dense)
    assert fwd["all_gather"] == 0, f"no logits gathered: {dict(fwd)}"
    assert plain.loss is None and plain.logits.shape == (2, 5, V), "without labels: gathered, padding stripped"
    torch.testing.assert_close(plain.logits, ref.logits.detach(), **TOL)
    torch.testing.assert_close(positional.loss, ref.loss.detach(), **TOL)
    torch.testing.assert_close(counted.loss, ref_counted.loss, **TOL)
    torch.testing.assert_close(copied.loss, ref.loss.detach(), **TOL)
    assert copied_plain.logits.shape == (2, 5, V)
    # (runtime_gather_output passed, CallState.logits_sharded) seen by the head, call by call:
    # labels, none, positional labels, num_items, the copy with labels, the copy without
    assert seen == [(False, True), ("absent", False), (False, True), (False, True), (False, True),
                    ("absent", False)], seen
    assert after is False, "reset when the call returns"
    assert len(keep) == 1 and keep[0].state is state
    assert copy.deepcopy(keep[0]) is keep[0], "a copy of the head shares the model's decision"


@_check
def lm_loss_adds_declared_terms_and_refuses_undeclared_ones(c):
    results = {}
    for name, terms in (("config", (("aux_loss", "router_aux_loss_coef"),)), ("number", (("aux_loss", 2.0),)),
                        ("undeclared", ())):
        state = CallState()
        dense, par = _lm_pair(c, state, aux=True)
        handles = lm_loss.install(par, _lm_layout(terms), TPContext(c.group, state=state))
        ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(52))
        ref = dense(ids, labels=ids)
        coefficient = 0.25 if name == "config" else 2.0
        with torch.no_grad():
            error = _raised(lambda: results.setdefault(name, par(ids, labels=ids).loss))
            after = par(ids)  # a refused call leaves the next one gathering
        for h in handles:
            h.remove()
        results[name] = (results.get(name), ref.loss.detach() + coefficient * ref.aux_loss.detach(), error,
                         after.logits.shape, state.logits_sharded)
    # --- asserts only from here on
    for name in ("config", "number"):
        loss, expected, error, _, _ = results[name]
        assert error is None, error
        torch.testing.assert_close(loss, expected, **TOL)
    _, _, error, shape, sharded = results["undeclared"]
    assert isinstance(error, TPUsageError) and str(error).startswith(
        "_ToyLM's output holds ['aux_loss'], loss terms HF adds to its labels= loss"), error
    assert shape == (2, 5, V) and sharded is False


# ---- guards -------------------------------------------------------------------------------

class _GuardToy(nn.Module):
    """A toy tp model whose forward issues one all-reduce, as a parallel model's first layer would."""

    def __init__(self, group):
        super().__init__()
        self.group, self.lin, self.entered, self.checked = group, nn.Linear(2, 2), 0, []
        self.state = CallState()  # the model's per-call state, shared with its guard

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.entered += 1
        self.checked.append(self.state.checked.holds(input_ids))
        comm.all_reduce(torch.ones(3), self.group)
        return input_ids


@_check
def batch_check_refuses_different_inputs_on_every_rank_before_any_collective(c):
    model = _GuardToy(c.group)
    # a pre-hook registered before the guard that communicates: the guard must run before it
    def communicating_pre_hook(module, args):
        comm.all_reduce(torch.zeros(2), c.group)

    model.register_forward_pre_hook(communicating_pre_hook)
    handles = guards.BatchCheck("_GuardToy", c.group, model.state).install(model)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(60))
    mask = torch.ones(2, 5, dtype=torch.long)
    counts, errors = {}, {}
    cases = {"same": lambda: model(ids, attention_mask=mask),
             "values": lambda: model(ids + c.rank, attention_mask=mask),
             "shapes": lambda: model(ids[:, : 5 - c.rank], attention_mask=mask[:, : 5 - c.rank]),
             "keyword": lambda: model(ids, attention_mask=mask * (1 - c.rank))}
    # Other values are compared at the model's next call (read one call late, no host sync): the
    # bad call runs, and the error, its message and its collectives are those of the next call.
    deferred = ("values", "keyword")
    for name, call in cases.items():
        if name in deferred:
            errors[f"{name} (the call itself)"] = _raised(call)
            call = cases["same"]
        with comm.count_collectives() as n:
            errors[name] = _raised(call)
        counts[name] = dict(n)
    checked_after = model.state.checked.holds(ids)
    for h in handles:
        h.remove()
    # --- asserts only from here on
    assert errors["same"] is None, errors["same"]
    assert counts["same"] == {"all_reduce": 3, "all_reduce_numel": 4 + 2 + 3}, counts["same"]
    assert all(errors[f"{name} (the call itself)"] is None for name in deferred), errors
    assert model.entered == 1 + len(deferred) and model.checked == [True] * model.entered, \
        "the ids were checked for each call that ran"
    assert checked_after is False, "and forgotten after it"
    for name, what in (("values", "different input values"), ("shapes", "inputs of different names, shapes or dtypes"),
                       ("keyword", "different input values")):
        assert isinstance(errors[name], ValueError), (name, errors[name])
        assert str(errors[name]).startswith(f"_GuardToy.forward: the ranks of the TP group were given {what}"), name
        assert counts[name] == {"all_reduce": 1, "all_reduce_numel": 4}, (name, counts[name])
    assert model.entered == 1 + len(deferred), "a refused call never reaches the forward"


def _tp_model(c, lm_head):
    model = _GuardToy(c.group)
    model.tp_info = TPInfo(TPContext(c.group), None, SimpleNamespace(lm_head=lm_head))  # tp_size WORLD, rank c.rank
    return model


@_check
def fused_lm_head_is_refused_before_any_collective(c):
    model = _tp_model(c, "lm_head")
    handles = guards.install(model, model.tp_info)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with comm.count_collectives() as n:
        error = _raised(lambda: model(ids, fused_lm_head=True))
    refused_counts = dict(n)
    passed = _raised(lambda: model(ids, fused_lm_head=False))
    no_head = _tp_model(c, None)
    no_head_handles = guards.install(no_head, no_head.tp_info)
    without_vocab_split = _raised(lambda: no_head(ids, fused_lm_head=True))
    for h in handles + no_head_handles:
        h.remove()
    # --- asserts only from here on
    assert isinstance(error, TPUsageError) and str(error).startswith(
        "_GuardToy was called with fused_lm_head=True: TRL's fused LM head"), error
    assert "lm_head.weight directly" in str(error) and "(tp_size = 2)" in str(error)
    assert refused_counts == {}, refused_counts
    assert model.entered == 1 and passed is None
    # 3 state-dict hooks (tag, load check and its assign step) + the inputs check + the fused head + the foreign DDP
    assert len(handles) == 7 and len(no_head_handles) == 6, "no fused-head guard without a vocabulary-split head"
    assert without_vocab_split is None


@_check
def foreign_ddp_over_the_world_is_refused_and_one_over_the_dp_group_is_not(c):
    from torch.nn.parallel import DistributedDataParallel

    model = _tp_model(c, None)  # its TP group is the world: its DP group would be each rank alone
    handles = guards.install(model, model.tp_info)
    ids = torch.zeros(2, 3, dtype=torch.long)
    outside = _raised(lambda: model(ids))
    over_world = DistributedDataParallel(model)
    with torch.no_grad():
        foreign = _raised(lambda: over_world(ids))
    own = DistributedDataParallel(model, process_group=c.alone[c.rank])
    with torch.no_grad():
        fine = _raised(lambda: own(ids))
    for h in handles:
        h.remove()
    # --- asserts only from here on
    assert outside is None and fine is None, (outside, fine)
    assert isinstance(foreign, TPUsageError) and str(foreign).startswith(
        "_GuardToy is tensor-parallel (tp_size = 2) but runs inside a DistributedDataParallel over ranks [0, 1], not "
        "over its DP group (none)"), foreign


# ---------------------------------------------------------------------------------------------

def _body(rank, world):
    group = dist.new_group(list(range(world)))
    alone = [dist.new_group([r]) for r in range(world)]  # each rank's DP group when TP is the world
    c = SimpleNamespace(rank=rank, world=world, group=group, alone=alone)
    return tputil.run_checks(_CHECKS, c)


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, WORLD, timeout=120)


_ok = tputil.assert_checks_ok


def test_dropout_tracker_holds_the_tp_stream_only_inside_a_region_in_training(tp2):
    _ok(tp2, "dropout_streams_inside_and_outside_a_region")


def test_head_inputs_give_each_rank_its_heads_and_refuse_a_missing_argument(tp2):
    _ok(tp2, "head_inputs_sliced_to_this_ranks_heads")


def test_region_grads_sum_only_gradients_of_params_used_inside_a_region(tp2):
    _ok(tp2, "region_grads_sums_gradients_of_replicated_params_used_inside_a_region")


def test_region_grads_sum_gradients_of_params_that_see_split_tokens(tp2):
    _ok(tp2, "region_grads_sums_gradients_of_params_that_see_this_ranks_tokens")


def test_sequence_parallel_hooks_match_dense_and_refuse_an_indivisible_length_with_gradients(tp2):
    _ok(tp2, "sequence_parallel_split_gather_exit_match_dense")


def test_replicated_gradients_are_summed_in_one_all_reduce_per_backward_pass(tp2):
    _ok(tp2, "summed_grads_take_one_all_reduce_per_backward_pass")


def test_lm_loss_equals_dense_causal_cross_entropy_and_keeps_logits_sharded_only_during_the_call(tp2):
    _ok(tp2, "lm_loss_from_vocab_shards_equals_dense_causal_cross_entropy")


def test_lm_loss_adds_declared_terms_and_refuses_undeclared_loss_outputs(tp2):
    _ok(tp2, "lm_loss_adds_declared_terms_and_refuses_undeclared_ones")


def test_batch_check_refuses_different_inputs_before_any_other_collective(tp2):
    _ok(tp2, "batch_check_refuses_different_inputs_on_every_rank_before_any_collective")


def test_fused_lm_head_is_refused_on_a_vocabulary_split_head(tp2):
    _ok(tp2, "fused_lm_head_is_refused_before_any_collective")


def test_foreign_ddp_is_refused(tp2):
    _ok(tp2, "foreign_ddp_over_the_world_is_refused_and_one_over_the_dp_group_is_not")


def test_every_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_CHECKS)] * WORLD
