"""The named steps every vocab-parallel loss and statistic is built from (:mod:`tpify.loss`).

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3, "output embedding"): the LM head's
logits stay split over the vocabulary, shape ``(B, T, V/p)`` per rank, and the softmax and what
is computed from it come from the shards with two all-reduces of ``B*T``-sized vectors instead of
gathering ``B*T*V`` logits on every rank. The hook that makes ``model(input_ids,
labels=labels).loss`` of a parallelized model use it is :mod:`tpify.hooks.lm_loss`.

Every function is built from the same named steps, each written once (as Megatron's
``cross_entropy.py`` is cut into static steps shared by its fused and unfused paths):

| step                    | what                                                            | collective          |
| ----------------------- | --------------------------------------------------------------- | ------------------- |
| ``_columns``            | this rank's columns of the vocabulary, how many are real        | none                |
| ``_local_logits``       | the shard in the compute dtype, ``/ temperature``, padding -inf | none                |
| ``_agreed_max``         | the row maxima ``m``; the input checks ride on it               | one all-reduce, max |
| ``_target_logit``       | ``z[target] - m`` on the rank owning the target, 0 elsewhere    | none                |
| ``_exp_sum_``           | ``exp(z - m)`` in place, and its row sums                       | none                |
| ``_summed``             | sums over the group                                             | one all-reduce, sum |
| ``_softmax_statistics`` | the four above for one block of rows                            | the two above       |
| ``_cross_entropy``, ``_cross_entropy_grad_`` | the loss and its gradient from the statistics | none        |

The argument checks (``_check_*``), the reduction (``_reduce``, :func:`mean_or_nan`) and
:func:`_outside_graph` (the graph break under ``torch.compile``) live here too. More: docs/loss.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import comm

_REDUCTIONS = ("none", "sum", "mean")
#: What a model may do to its LM head's output before the softmax, in the order it does it:
#: ``("multiply", s)``: ``z * s``; ``("divide", d)``: ``z / d``; ``("softcap", c)``:
#: ``c * tanh(z / c)`` (Gemma 2's ``final_logit_softcapping``).
LOGIT_OPS = ("multiply", "divide", "softcap")
_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# The named steps.

class _Columns(NamedTuple):
    """This rank's columns of the padded vocabulary, ``[start, start + width)``; the first
    ``real`` of them are below the true vocabulary ``vocab`` (the padding is the vocabulary's tail)."""

    start: int
    width: int
    real: int
    vocab: int


def _columns(width: int, group: dist.ProcessGroup | None, vocab_size: int | None) -> _Columns:
    """Step 0: which columns this rank holds (rank ``r``: ``[r*width, (r+1)*width)``)."""
    start = comm.group_rank(group) * width
    vocab = width * comm.group_size(group) if vocab_size is None else vocab_size
    return _Columns(start, width, max(0, min(width, vocab - start)), vocab)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Where the softmax is computed: float32 for half-precision inputs, float64 for float64."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def _local_logits(logits: torch.Tensor, cols: _Columns, inv_temperature: float = 1.0) -> tuple[torch.Tensor, bool]:
    """Step 0: the shard in the compute dtype, times ``1/temperature``, its padded columns -inf.

    Returns ``(z, own)``: ``own`` says ``z`` is a new buffer the caller may overwrite (a cast,
    scaled or masked copy), not the caller's logits."""
    dtype = _compute_dtype(logits.dtype)
    own = dtype != logits.dtype
    z = logits.to(dtype)
    if inv_temperature != 1.0:
        z = z.mul_(inv_temperature) if own else z * inv_temperature
        own = True
    if cols.real < cols.width:  # padded columns (global index >= V) never count
        if not own:
            z, own = z.clone(), True
        z[..., cols.real:] = _NEG_INF
    return z, own


class _InputChecks:
    """What every rank of the group must hold alike, checked on values that ride on the first
    all-reduce (max) at no extra collective: shards of the same width (max and -min) and, with
    targets, no target outside ``[0, V)`` on any rank and the same targets (max and -min of a
    checksum). A rank alone with bad or different targets would otherwise raise alone, or train
    on a mismatched batch; shards of different widths would place the vocabulary wrongly."""

    def __init__(self, what: str, cols: _Columns, target: torch.Tensor | None = None,
                 bad_targets: torch.Tensor | None = None, ignore_index: int | None = None, defer=None):
        self.what, self.cols, self.target, self.bad, self.ignore_index = what, cols, target, bad_targets, ignore_index
        self.defer = defer  # a model call's comm.DeferredChecks: raised at its next call, no host sync

    def values(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The values to all-reduce (max): 2, or 5 with targets."""
        width = torch.full((), float(self.cols.width), dtype=dtype, device=device)  # a fill: no copy from the host
        values = [width, -width]
        if self.target is not None:
            checksum = comm.checksum(self.target).to(dtype)  # < 2**24: exact in float32
            values += [self.bad.to(dtype), checksum, -checksum]
        return torch.stack(values)

    def raise_if_failed(self, got: torch.Tensor) -> None:
        """Raise, on every rank alike, what the all-reduced values say (with ``defer``: at the
        model's next call)."""
        comm.raise_unless(got[0] == -got[1], ValueError,
                          f"{self.what}: the ranks of the TP group hold logits shards of different widths (this "
                          f"rank: {self.cols.width} columns); every rank must hold V_padded / tp_size columns of the "
                          f"same padded vocabulary", defer=self.defer)
        if self.target is None:
            return
        comm.raise_unless(got[2] <= 0, ValueError,
                          f"{self.what}: a rank of the TP group holds targets outside [0, {self.cols.vocab}) that are "
                          f"not ignore_index = {self.ignore_index}; fix the labels or set ignore_index",
                          detail=((self.bad,), lambda bad: "this rank holds them" if bad else "another rank holds them"),
                          defer=self.defer)
        comm.raise_unless(got[3] == -got[4], ValueError,
                          f"{self.what}: the ranks of the TP group hold different targets; every rank of a TP group "
                          f"must see the same batch (split data over DP replicas only)", defer=self.defer)


def _agreed_max(maxes: list[torch.Tensor], group: dist.ProcessGroup | None,
                checks: _InputChecks | None = None) -> list[torch.Tensor]:
    """Step 1: the maximum over the group of each tensor of ``maxes`` (row maxima ``(N...)``, one
    dtype), in one all-reduce (max) that also carries ``checks`` (raised on every rank alike).
    No gradient flows through a maximum subtracted from logits: it cancels in the softmax."""
    if comm.group_size(group) == 1:  # the arguments were checked before (one rank: nothing to agree on)
        return maxes
    parts = [m.reshape(-1) for m in maxes]
    if checks is not None:
        parts.append(checks.values(maxes[0].dtype, maxes[0].device))
    packed = torch.cat(parts)
    comm.all_reduce(packed, group, op="max")
    if checks is not None:
        checks.raise_if_failed(packed[packed.numel() - parts[-1].numel():])
    out, at = [], 0
    for m in maxes:
        out.append(packed[at:at + m.numel()].view_as(m))
        at += m.numel()
    return out


def _local_targets(target: torch.Tensor, cols: _Columns, ignore_index: int):
    """``(ignored, owned, local)``: targets equal to ``ignore_index``; targets in this rank's
    columns; their index in the shard (0 where not owned)."""
    ignored = target == ignore_index
    owned = (target >= cols.start) & (target < cols.start + cols.width) & ~ignored
    local = (target - cols.start).masked_fill(~owned, 0)
    return ignored, owned, local


def _target_logit(z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Step 2: ``z[target] - m`` on the rank that owns the target, 0 elsewhere (summed over the
    ranks in step 4, which makes it the target logit on every rank)."""
    return (z.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m).masked_fill(~owned, 0.0)


def _exp_sum_(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: ``exp(z - m)`` in place of ``z - m`` (one buffer: every new buffer of that size
    costs a pass over memory and, on a CPU, its page faults), and its row sums. ``exp(-inf) = 0``
    on padded columns."""
    exp_z = shifted.exp_()
    return exp_z, exp_z.sum(dim=-1)


def _summed(values: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Step 4: the sums over the group of several ``(N...)`` tensors, in one all-reduce."""
    packed = torch.stack(values)
    comm.all_reduce(packed, group)
    return packed.unbind(0)


class _Stats(NamedTuple):
    """The softmax statistics of a block of rows: ``m`` (row max), ``exp_z = exp(z - m)`` (this
    rank's columns), ``sum_exp = S``, ``z_t = z[target] - m``, and with label smoothing ``sum_z =
    sum_{v < V} (z_v - m)``, each summed over the group."""

    m: torch.Tensor
    exp_z: torch.Tensor
    sum_exp: torch.Tensor
    z_t: torch.Tensor
    sum_z: torch.Tensor | None


def _softmax_statistics(z: torch.Tensor, own: bool, cols: _Columns, local: torch.Tensor, owned: torch.Tensor,
                        smoothing: bool, group: dist.ProcessGroup | None,
                        checks: _InputChecks | None) -> _Stats:
    """Steps 1-4 for one block of rows ``z (N..., V/p)``: two all-reduces, the max (with
    ``checks``) of ``N`` values and the sums of ``2N`` (``3N`` with ``smoothing``). ``z`` is
    overwritten when ``own``."""
    (m,) = _agreed_max([z.amax(dim=-1)], group, checks)
    z_t = _target_logit(z, local, owned, m)
    shifted = z.sub_(m.unsqueeze(-1)) if own else z - m.unsqueeze(-1)
    sums = [z_t]
    if smoothing:
        sums.append(shifted[..., :cols.real].sum(dim=-1))
    exp_z, sum_exp = _exp_sum_(shifted)
    sums.append(sum_exp)
    sums = _summed(sums, group)
    return _Stats(m, exp_z, sums[-1], sums[0], sums[1] if smoothing else None)


def _cross_entropy(stats: _Stats, eps: float, cols: _Columns, ignored: torch.Tensor) -> torch.Tensor:
    """``log S - z_t``; with label smoothing ``eps``: ``(1-eps)(log S - z_t) + eps(log S - mean_{v<V} z_v)``
    (the mean over the true ``V``); 0 on ignored rows."""
    log_s = stats.sum_exp.log()
    loss = log_s - stats.z_t
    if eps > 0:
        loss = (1.0 - eps) * loss + eps * (log_s - stats.sum_z / cols.vocab)
    return loss.masked_fill(ignored, 0.0)


def _cross_entropy_grad_(exp_z: torch.Tensor, sum_exp: torch.Tensor, g: torch.Tensor, local: torch.Tensor,
                         owned: torch.Tensor, eps: float, cols: _Columns) -> torch.Tensor:
    """``dL/dz = (exp(z - m)/S - (1-eps) onehot_local(target) - eps/V) * g`` in place of ``exp_z``
    (``g``: the loss's gradient per row, 0 on ignored rows); padded columns get 0."""
    grad = exp_z.mul_((g / sum_exp).unsqueeze(-1))  # the 1/S and g scale the buffer in one pass
    grad.scatter_add_(-1, local.unsqueeze(-1), (owned.to(grad.dtype) * g * -(1.0 - eps)).unsqueeze(-1))
    if eps > 0:
        grad.sub_((g * (eps / cols.vocab)).unsqueeze(-1))
        if cols.real < cols.width:
            grad[..., cols.real:] = 0.0  # padded columns are not in the vocabulary
    return grad


# ---------------------------------------------------------------------------------------------
# Argument checks, before any collective.

def _check_vocab(what: str, width: int, group, vocab_size: int | None) -> int:
    """The true vocabulary ``V``; raises when ``vocab_size`` does not fit the shards."""
    tp_size = comm.group_size(group)
    padded_vocab = width * tp_size
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"{what}: vocab_size = {vocab_size} does not fit shards of {width} columns over {tp_size} "
                         f"ranks (padded vocabulary {padded_vocab}); pass the true vocabulary size, at most "
                         f"{padded_vocab}")
    return padded_vocab if vocab_size is None else vocab_size


def _check_target(what: str, leading: torch.Size, target: torch.Tensor, vocab: int, ignore_index: int,
                  group, input_name: str = "logits", defer=None) -> torch.Tensor:
    """Shapes and dtype of ``target``; returns the 0-dim bool "a target outside ``[0, V)`` that is
    not ``ignore_index``" (raised here with one rank, else carried by the first all-reduce; with
    ``defer``, a model call's :class:`~tpify.comm.DeferredChecks`, raised at its next call)."""
    if leading != target.shape:
        raise ValueError(f"{what}: {input_name} {tuple(leading)} + (...,) and target {tuple(target.shape)} disagree; "
                         f"{input_name} must be target.shape + (last dim,)")
    if target.is_floating_point():
        raise ValueError(f"{what}: target must hold integer class ids, got {target.dtype} (probability targets are "
                         f"not supported)")
    outside = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    bad_targets = outside.any()  # 0-dim bool; at tp > 1 it rides on the first all-reduce
    if comm.group_size(group) == 1:
        message = (f"{what}: targets outside [0, {vocab}) that are not ignore_index = {ignore_index}; fix the "
                   f"labels or set ignore_index")
        if defer is None or torch.compiler.is_compiling():
            comm.raise_unless(~bad_targets, ValueError, message, detail=lambda: f"targets {target[outside][:5].tolist()}")
        else:  # no boolean indexing (a host sync): the first bad target, read at the next call
            first = (target.reshape(-1).index_select(0, outside.reshape(-1).to(torch.uint8).argmax().reshape(1))
                     .reshape(()) if target.numel() else bad_targets)  # a tensor index: no host read
            comm.raise_unless(~bad_targets, ValueError, message, detail=((first,), lambda t: f"the first: {t}"),
                              defer=defer)
    return bad_targets


def _check_loss_args(what: str, reduction: str, label_smoothing: float) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{what}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{what}: label_smoothing must be in [0, 1], got {label_smoothing}")


def _inverse_temperature(what: str, temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"{what}: temperature must be positive, got {temperature}")
    return 1.0 / float(temperature)


def _reduce(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return mean_or_nan(loss.sum(), (target != ignore_index).sum())


def mean_or_nan(total: torch.Tensor, count) -> torch.Tensor:
    """``total / count``, NaN when ``count == 0`` (as ``F.cross_entropy``) but with a zero gradient;
    ``count`` a tensor (moved to ``total``'s device without blocking) or a Python number.

    ``0 / 0`` would also be NaN forward, but its gradient is NaN too, and one batch whose labels
    are all ignored (or a one-token causal sequence) would then poison the weights at the next
    optimizer step; HF's dense model gets zero gradients there.
    """
    if not isinstance(count, torch.Tensor):  # a Python number: no tensor copied from the host
        return total / count if count > 0 else total * 0.0 + float("nan")
    count = count.to(total.device, non_blocking=True)
    mean = total / count.clamp(min=1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))


@torch.compiler.disable
def _outside_graph(function, *args):
    """``function.apply(*args)`` run eagerly under ``torch.compile``: a graph break around the
    vocab-parallel statistics. Inductor (torch 2.13, CPU) miscompiled the shard's target logit at
    tp > 1 (the loss of targets owned by other ranks than 0 came out wrong by up to 2.3 nats while
    eager was exact; tests/distributed/test_compile.py), so these autograd Functions stay out of
    compiled graphs until that is understood; the rest of the model compiles."""
    return function.apply(*args)
