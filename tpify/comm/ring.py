"""The ring of a group: each rank sends a tensor to the next rank and receives the previous one's.

Ring attention's transport (Liu et al., arXiv:2310.01889; Megatron-LM's context parallelism):
:func:`ring_shift_start` posts one send to rank ``(r + 1) % p`` and one receive from rank
``(r - 1) % p`` of the group as one ``torch.distributed.batch_isend_irecv`` (NCCL groups the two
into one launch); the caller computes while they are in flight and calls
:meth:`RingShift.wait` when it needs the received tensor (no host sync on CUDA: the wait orders
the current stream after the transfer). No autograd rule: ring attention's own
``torch.autograd.Function`` runs the reverse ring in its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .counting import record
from .groups import group_rank, group_size

__all__ = ["RingShift", "ring_shift_start"]


class RingShift:
    """A pending ring shift (:func:`ring_shift_start`); :meth:`wait` returns the tensor received from
    the previous rank. Holds the tensor sent until then (the transfer reads it)."""

    __slots__ = ("_works", "_sent", "_received")

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        self._works, self._sent, self._received = works, sent, received

    def wait(self) -> torch.Tensor:
        """The previous rank's tensor, once its transfer (and this rank's send) completed."""
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._received


def ring_shift_start(tensor: torch.Tensor, group: dist.ProcessGroup | None, tag: int = 0) -> RingShift:
    """Start sending ``tensor`` to the next rank of ``group`` and receiving the previous rank's
    tensor of the same shape and dtype (one ``batch_isend_irecv`` of an isend and an irecv,
    counted as ``send_recv`` of ``tensor.numel()`` values by :func:`~tpify.comm.count_collectives`).

    Every rank of the group must call it in the same order (the ring pairs the i-th shift of each
    rank); ``tag`` tells apart two shifts in flight at once between the same ranks (gloo matches
    by tag; NCCL by issue order, which is the same on every rank). With a one-rank group the
    tensor itself comes back and nothing is issued.
    """
    world = group_size(group)
    if world == 1:
        return RingShift([], tensor, tensor)
    rank = group_rank(group)
    sent = tensor.contiguous()
    received = torch.empty_like(sent)
    record("send_recv", sent)
    ops = [dist.P2POp(dist.isend, sent, group=group, group_peer=(rank + 1) % world, tag=tag),
           dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % world, tag=tag)]
    return RingShift(dist.batch_isend_irecv(ops), sent, received)
