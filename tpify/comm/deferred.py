"""Data checks of a model's call read by the host one call later, without a host sync:
:class:`DeferredChecks` (what a call recorded), :class:`HostCopy` (0-dim tensors copied to host
memory without blocking), :func:`raise_unless` (raise now, later, or under ``torch.compile``
in the graph). No communication.
"""

from __future__ import annotations

import torch

__all__ = ["FOUND_LATE", "HostCopy", "DeferredChecks", "raise_unless"]


#: Appended to the message of a check raised at the model's next call (:class:`DeferredChecks`).
FOUND_LATE = ("(found at the model's next call: tpify checks a call's data on the device and reads the result "
              "one call later, so as not to stop the host from queuing work ahead; the step in between used that "
              "call's data)")


class HostCopy:
    """0-dim tensors copied to host memory without blocking, read later (:meth:`values`).

    From an accelerator: one ``torch.stack`` in ``dtype`` copied into page-locked memory
    (``non_blocking``) with an event recorded after it; :meth:`values` waits for that event, not
    for the device's queue, and reads with ``numpy`` (which refuses a device tensor). On a CPU
    the stacked tensor itself.
    """

    def __init__(self, tensors: list[torch.Tensor], dtype: torch.dtype):
        values = [t.detach().reshape(()) for t in tensors]
        device = values[0].device
        packed = torch.stack([v.to(device=device, dtype=dtype) for v in values])
        self.event = None
        if device.type != "cpu":
            try:
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            except RuntimeError:  # no page-locked memory for this device: the copy then blocks
                host = torch.empty(packed.shape, dtype=packed.dtype)
            host.copy_(packed, non_blocking=True)  # queued on the device's current stream
            module = torch.get_device_module(device)  # torch.cuda, ...: its Event and streams
            self.event = module.Event()
            self.event.record(module.current_stream(device))
            packed = host
        self.host = packed

    def values(self) -> list:
        """The values as Python numbers (waits for the copy, not for the device's queue)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().tolist()


class DeferredChecks:
    """Data checks of a model's call computed on the device and raised at the model's next
    call: no host sync in a steady-state step, a failure raised at most one call late.

    During a call, :func:`raise_unless` with ``defer=`` records a 0-dim bool that must be true
    (:meth:`expect`) and :class:`~tpify.hooks.guards.BatchCheck` keeps its inputs' checksum
    (:meth:`keep`); at the call's end (:meth:`submit`, a forward hook that also runs when the call
    raises) they are packed in one int64 vector and copied to the host (:class:`HostCopy`); at the
    next call (:meth:`collect`) the host waits for that copy only and reads it. Every rank raises
    alike: the values checked are ones every rank holds alike (results of an all-reduce, or the
    inputs the guard compares first). Held by the model's :class:`~tpify.context.CallState`.
    """

    def __init__(self):
        self._staged: list[tuple] = []  # (key or None, [tensors], error or note, message, detail)
        self._pending: list[tuple] = []  # per call not yet collected: (HostCopy, entries)

    def expect(self, ok: torch.Tensor, error: type[Exception], message: str, detail=None) -> None:
        """Record that ``ok`` (0-dim bool) must be true, else ``error(message)``; ``detail``: None or
        ``(tensors, format)``, ``format(*values)`` appended to the message (values as Python ints)."""
        tensors, fmt = detail if detail is not None else ((), None)
        self._staged.append((None, [ok, *tensors], error, message, fmt))

    def keep(self, key: str, value: torch.Tensor, note=None) -> None:
        """Record a 0-dim integer ``value`` (and any host ``note``) to read at the next call
        (:meth:`collect`'s ``key``)."""
        self._staged.append((key, [value], note, "", None))

    def submit(self, *_hook_args) -> None:
        """End the call: start the copy of what it recorded to host memory (no wait)."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        self._pending.append((HostCopy([t for entry in staged for t in entry[1]], torch.int64), staged))

    def collect(self) -> tuple[dict[str, tuple[int, object]], list[Exception]]:
        """What the calls since the last collect recorded: the kept values ``{key: (int, note)}``
        (the latest) and the failed checks (errors, in the order recorded, each message followed
        by :data:`FOUND_LATE`); forgotten here."""
        pending, self._pending = self._pending, []
        kept, failed = {}, []
        for copy, staged in pending:
            values, at = copy.values(), 0  # the copy queued one call ago
            for key, tensors, error, message, fmt in staged:
                got, at = values[at: at + len(tensors)], at + len(tensors)
                if key is not None:
                    kept[key] = (got[0], error)  # error: the note, for a kept value
                elif not got[0]:
                    text = message if fmt is None else f"{message} ({fmt(*got[1:])})"
                    failed.append(error(f"{text} {FOUND_LATE}"))
        return kept, failed

    def __deepcopy__(self, memo):  # a copy of the model shares its CallState: never reached; fresh if it is
        return DeferredChecks()


def raise_unless(ok: torch.Tensor, error: type[Exception], message: str, detail=None,
                 defer: DeferredChecks | None = None) -> None:
    """Raise ``error(message)`` unless the 0-dim bool tensor ``ok`` is true.

    For values every rank holds alike, so that every rank raises at the same point. Eagerly: one
    host sync, ``detail()`` appended to the message. With ``defer`` (a call's
    :class:`DeferredChecks`): recorded, raised at the model's next call; ``detail`` is then
    ``(tensors, format)``. Under ``torch.compile``: ``torch._assert_async(ok, message)`` (no
    graph break; raises ``RuntimeError(message)`` when the compiled code runs).
    """
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif defer is not None:
        defer.expect(ok, error, message, detail)
    elif not bool(ok):
        if detail is not None and not callable(detail):
            tensors, fmt = detail
            detail = lambda: fmt(*(int(t) for t in tensors))  # noqa: E731
        raise error(message if detail is None else f"{message} ({detail()})")
