"""Whether the ranks of a TP group were given the same inputs: :func:`check_same_inputs` (one
small all-reduce), the checksums and layout codes it compares, the messages it raises, and
:class:`CheckedInputs`, the record of what a model's call compared (held by its
:class:`~tpify.context.CallState`).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .collectives import all_reduce
from .deferred import raise_unless
from .groups import group_size

__all__ = ["checksum", "layout_code", "inputs_checksum", "check_same_inputs", "CheckedInputs",
           "different_layouts_message", "different_values_message"]


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An order-sensitive checksum of a tensor's values: a 0-dim int64 in ``[0, 2**24)``, exact
    (floats summed by their bit patterns), so equal tensors give equal checksums on every rank and
    device. One pass on the tensor's device; no communication, no host sync.
    """
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    flat = flat.to(torch.int64).remainder(1000003)
    weights = torch.arange(flat.numel(), device=flat.device) % 9973 + 1
    return ((flat + 101) * weights).sum().remainder(16777213)


def layout_code(named: list[tuple[str, torch.Tensor]]) -> int:
    """A deterministic integer in ``[0, 2**44)`` of the names, shapes and dtypes of ``named``: the
    same on every rank for the same layout (Python's ``hash`` of a string is salted per process),
    from integer arithmetic alone, so that ``torch.compile`` folds it without a graph break."""
    code = 1469598103
    for name, t in named:
        for value in (len(name), *map(ord, name[:32]), t.dim(), *t.shape, t.element_size(), int(t.is_floating_point())):
            code = (code * 1099511627 + int(value) + 7) % 17592186044399  # a prime below 2**44
    return code


def check_same_inputs(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, what: str,
                      flag: torch.Tensor | None = None) -> torch.Tensor | None:
    """Raise, on every rank of ``group``, unless every rank holds the same tensors (names, shapes,
    dtypes and values): the ranks of a TP group must be given one batch, or they train silently
    on a mix (other ids) or mismatch the next collective (other lengths). Run before any other
    collective of the call.

    Method: the :func:`layout_code` and the :func:`inputs_checksum`, each with its negation, in one
    all-reduce (max) of 4 int64 values: all equal exactly when ``max == -max(-x)``. One pass over
    the tensors, one host sync.

    ``flag``: a 0-dim bool tensor of this rank's (a local check that failed, say) that rides
    on the same all-reduce (a 5th value); returned as "true on any rank", so the caller raises
    on every rank. ``None`` when not given (or on a one-rank group: ``flag`` itself).

    Raises:
        ValueError: the ranks hold tensors of other names, shapes or dtypes, or other values;
            every rank raises (under ``torch.compile``: ``RuntimeError``, from
            ``torch._assert_async``).
    """
    if group_size(group) == 1 or not named:
        return flag
    device = named[0][1].device
    layout = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in named)
    # the layout code made on the device by a fill (torch.tensor(code, device=...) would copy from the host)
    code = torch.full((), layout_code(named), dtype=torch.int64, device=device)
    value_code = inputs_checksum(named)
    values = [code, -code, value_code.to(device), -value_code.to(device)]
    if flag is not None:
        values.append(flag.to(device=device, dtype=torch.int64))
    packed = torch.stack(values)
    all_reduce(packed, group, op="max")
    raise_unless(packed[0] == -packed[1], ValueError, different_layouts_message(what, layout))
    raise_unless(packed[2] == -packed[3], ValueError, different_values_message(what, layout))
    return packed[4] > 0 if flag is not None else None


def inputs_checksum(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The checksum of the values of ``named`` (each tensor's :func:`checksum`, weighted by its
    position), a 0-dim int64 tensor on the first one's device; no host sync."""
    return sum((i + 1) * checksum(t) for i, (_, t) in enumerate(named))


def different_layouts_message(what: str, layout: str) -> str:
    """The message of inputs of other names, shapes or dtypes on the ranks of a TP group."""
    return (f"{what}: the ranks of the TP group were given inputs of different names, shapes or dtypes (this "
            f"rank: {layout}). Every rank of a TP group must get the same batch: split the data over DP "
            f"replicas only")


def different_values_message(what: str, layout: str) -> str:
    """The message of other input values (same layout) on the ranks of a TP group."""
    return (f"{what}: the ranks of the TP group were given different input values (same shapes: {layout}). "
            f"Every rank of a TP group must get the same batch: split the data over DP replicas only, and "
            f"seed any sampling identically on the ranks of a TP group")


class CheckedInputs:
    """The inputs that the model call now running compares across the TP group (recorded by
    :class:`~tpify.hooks.guards.BatchCheck` as the call starts, compared at the model's next
    call); one per model, held by its :class:`~tpify.context.CallState`.

    :meth:`holds` answers for that tensor or a view of all of its elements (HF models reshape
    ``input_ids`` before the embedding), unmodified since (views share the version counter).
    Every rank of the group passed the same check of names and shapes, so every rank answers alike.
    """

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: list[tuple[weakref.ref, int]] = []  # (tensor, its version when recorded)

    def remember(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Record the tensors of ``named`` for the call now starting (nothing under ``torch.compile``)."""
        if not torch.compiler.is_compiling():
            self._entries = [(weakref.ref(t), t._version) for _, t in named]

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or the tensor it views whole) was recorded and is unmodified since."""
        for ref, version in self._entries:
            checked = ref()
            if (checked is not None and version == tensor._version and checked.dtype == tensor.dtype
                    and checked.numel() == tensor.numel() and checked.data_ptr() == tensor.data_ptr()
                    and checked.is_contiguous() and tensor.is_contiguous()):
                return True
        return False

    def forget(self, *_hook_args) -> None:
        """End the call (a forward hook that runs even when the forward raises)."""
        self._entries = []
