"""Ulysses attention over the CP group: all-to-all from a sequence split to a head split and back.

DeepSpeed-Ulysses (Jacobs et al., arXiv:2309.14509): each rank holds ``T / cp`` tokens of all
its heads; one all-to-all per tensor gives it the whole sequence of ``n / cp`` heads, it runs the
dense attention on them (the mask from global positions), and one all-to-all gives the output
back as ``T / cp`` tokens of every head. Under TP the heads are this TP rank's: ``n / tp / cp``.
How and when: docs/context-parallelism.md, "Ulysses".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..info import TPUsageError

__all__ = ["ulysses_attention", "check_heads", "kv_repeat"]


def check_heads(heads: int, kv_heads: int, cp_size: int, where: str) -> None:
    """Whether Ulysses can split ``heads`` query heads (``kv_heads`` K/V heads, per TP rank) over
    ``cp_size`` ranks. Local, the same on every rank.

    Raises:
        TPUsageError: ``heads`` not divisible by ``cp_size`` (naming the numbers and the fix).
    """
    if heads % cp_size or heads % kv_heads:
        raise TPUsageError(f"{where}: cp_attention='alltoall' splits the attention heads over the CP group, but "
                           f"{heads} query heads per TP rank ({kv_heads} K/V heads) do not divide by cp_size "
                           f"{cp_size}; use cp_attention='ring' or 'allgather', or a cp_size that divides {heads}")


def kv_repeat(heads: int, kv_heads: int, cp_size: int) -> int:
    """How many times each K/V head is repeated before the all-to-all: the least ``f`` with
    ``kv_heads * f`` divisible by ``cp_size`` (it divides the group size ``heads / kv_heads`` when
    ``cp_size`` divides ``heads``), so that each rank gets whole query-head groups with their K/V."""
    return cp_size // math.gcd(kv_heads, cp_size)


def _attend(query, key, value, mask, scale):
    """Dense attention of ``(B, n', T, d)`` queries over ``(B, n'_kv, T, d)`` keys under ``mask``."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


#: The most mask elements (``B' * rows * T``) one chunk of query rows builds: the ``T`` gathered
#: queries are attended in chunks of rows, each under its own activation recomputation, so the
#: mask never exists for the whole ``T x T`` (16 MiB as booleans, 64 MiB in the float32 form
#: ``scaled_dot_product_attention`` turns a boolean mask into: 2k rows at ``T = 8192``).
MASK_BYTES = 1 << 24


def _rows(call, rows: slice, key, value, window, scale, query):
    """The attention of the gathered queries ``rows`` (rank order) over every gathered key."""
    mask = call.rows_mask(rows, window)  # (B', 1, rows, T)
    return _attend(query, key, value, mask, scale)


def _core(query, key, value, call, window, scale):
    """``(B, n', T, d_v)``: the gathered queries in chunks of rows (:data:`MASK_BYTES`), each
    recomputed in backward when gradients are on (its mask is then built again, never kept)."""
    total, lead = query.shape[2], call.doc_k.shape[0]
    step = max(1, MASK_BYTES // max(1, lead * total))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outs = []
    for start in range(0, total, step):
        rows = slice(start, min(start + step, total))
        if grad:
            outs.append(checkpoint(_rows, call, rows, key, value, window, scale, query[:, :, rows],
                                   use_reentrant=False))
        else:
            outs.append(_rows(call, rows, key, value, window, scale, query[:, :, rows]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call, window: int | None,
                      scale: float) -> torch.Tensor:
    """This rank's queries over the whole sequence by the Ulysses all-to-all: ``(B, n, T/cp, d_v)``.

    Shapes: ``query`` ``(B, n, T/cp, d)``, ``key`` ``(B, n_kv, T/cp, d)``, ``value`` ``(B, n_kv,
    T/cp, d_v)`` (this rank's tokens); after the all-to-alls ``(B, n/cp, T, d)`` and ``(B,
    n_kv f / cp, T, d)`` (K/V heads repeated ``f`` times when ``cp`` does not divide ``n_kv``,
    :func:`kv_repeat`). The attention over the ``T`` gathered tokens (rank order) runs with the
    call's mask (causal, window, documents, :meth:`~tpify.hooks.context_parallel.ContextParallelCall.rows_mask`)
    through ``scaled_dot_product_attention``, in chunks of query rows whose mask holds at most
    :data:`MASK_BYTES`, each under activation recomputation (no mask is kept for backward; the
    attention forward runs twice). Kept for backward: the head-split ``q``, ``k``, ``v`` (the
    size of the local ones) and the output.

    Communication: forward three all-to-alls, of ``q``, of ``[K | V]`` (``f`` times repeated) and
    of the output (``B * T/cp * n * d`` values each for ``q`` and the output); backward the reverse
    of each.

    Raises:
        TPUsageError: the heads do not divide by ``cp`` (:func:`check_heads`).
    """
    heads, kv_heads, size = query.shape[1], key.shape[1], call.size
    check_heads(heads, kv_heads, size, "ulysses_attention")
    f = kv_repeat(heads, kv_heads, size)
    d = key.shape[-1]
    kv = torch.cat([key, value], dim=-1)
    if f > 1:
        kv = kv.repeat_interleave(f, dim=1)
    q = comm.all_to_all_dims(query, 1, 2, call.group)  # (B, n/cp, T, d), tokens in rank order
    kv = comm.all_to_all_dims(kv, 1, 2, call.group)  # (B, n_kv f/cp, T, d + d_v)
    k, v = kv[..., :d], kv[..., d:]
    out = _core(q, k, v, call, window, scale)
    return comm.all_to_all_dims(out, 2, 1, call.group)  # (B, n, T/cp, d_v)
