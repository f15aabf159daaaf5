"""Random state for dropout under tensor parallelism: a default stream and a per-TP-rank stream.

Megatron-LM (arXiv:1909.08053, section 3; ``megatron/core/tensor_parallel/random.py``): dropout
on replicated activations draws from the default stream (the global generator, the same on every
TP rank); dropout on sharded activations (this rank's heads) from the TP stream, seeded with
``seed + TP_SEED_OFFSET + tp_rank``. :func:`tpify.hooks.dropout.install` switches streams after
each ``ColumnParallelLinear`` with ``gather_output=False`` and before the next
``RowParallelLinear``, on each model's own :class:`RNGStreamTracker` (the CPU generator and every
CUDA device seen). What depends on ``tp_size``, and gradient checkpointing: docs/random-state.md.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["TP_SEED_OFFSET", "RNGStreamTracker", "get_rng_tracker", "manual_seed", "new_tracker", "devices_of"]

TP_SEED_OFFSET = 2718  # as Megatron's model_parallel_cuda_manual_seed: seed + 2718 + tp_rank

DEFAULT, TP = "default", "tp"


class RNGStreamTracker:
    """Two named streams (``"default"`` and ``"tp"``) multiplexed onto PyTorch's global generators.

    Attributes:
        current: the stream the global generators now hold.
        seed: the seed the TP stream derives from (set by :func:`manual_seed` or at
            ``parallelize`` time from ``torch.initial_seed()``).
        tp_rank: this process's rank in its TP group.
    """

    def __init__(self):
        self.current = DEFAULT
        self.seed: int | None = None
        self.tp_rank = 0
        self._states: dict[tuple[str, str], torch.Tensor] = {}  # (stream, device) -> saved state
        self._devices: set[str] = set()  # the CUDA devices switched with the CPU: every one seen
        self.in_region = False  # between a column-parallel layer's output and the next row-parallel input
        # the region hooks switch streams (the model may draw dropout); False: they only keep in_region
        # (tpify.hooks.dropout: every dropout probability of the model is 0)
        self.active = True
        # sequence parallelism split the tokens in this call (its hooks set it): a region ending at a
        # row-parallel layer whose output is split again stays on the TP stream (leave_region_to_split)
        self.tokens_split = False

    def reset(self, seed: int | None = None, tp_rank: int | None = None):
        """Forget the saved states; the TP stream restarts from ``seed + offset + tp_rank``."""
        self.switch(DEFAULT, ())  # make the global generator hold the default stream
        self._states.clear()
        self.current = DEFAULT
        if seed is not None:
            self.seed = int(seed)
        if tp_rank is not None:
            self.tp_rank = int(tp_rank)

    def _tp_seed(self) -> int:
        seed = torch.initial_seed() if self.seed is None else self.seed
        return (seed + TP_SEED_OFFSET + self.tp_rank) % (2 ** 63)

    def _fresh_tp_state(self, device: str) -> torch.Tensor:
        if device == "cpu":
            return torch.Generator().manual_seed(self._tp_seed()).get_state()
        saved = self._get(device)
        self._seed(device, self._tp_seed())
        state = self._get(device)
        self._set(device, saved)
        return state

    @staticmethod
    def _seed(device: str, seed: int):
        with torch.cuda.device(torch.device(device).index):
            torch.cuda.manual_seed(seed)

    @staticmethod
    def _get(device: str) -> torch.Tensor:
        return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(torch.device(device).index)

    @staticmethod
    def _set(device: str, state: torch.Tensor):
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, torch.device(device).index)

    def _swap(self, device: str, leaving: str, stream: str):
        """Save ``device``'s generator as ``leaving``'s state and load ``stream``'s (the TP stream
        created from its seed the first time; the default stream, never saved, stays as it is)."""
        self._states[(leaving, device)] = self._get(device)
        state = self._states.pop((stream, device), None)
        if state is None and stream == TP:
            state = self._fresh_tp_state(device)
        if state is not None:
            self._set(device, state)

    def _adopt(self, cuda_devices):
        """Add CUDA devices not seen before; each is brought onto the current stream (its
        generator holds the default stream: the tracker never touched it)."""
        for device in cuda_devices:
            if device == "cpu" or device in self._devices:
                continue
            self._devices.add(device)
            if self.current != DEFAULT:
                self._swap(device, DEFAULT, self.current)

    def switch(self, stream: str, cuda_devices=()):
        """Make the global generators (CPU, ``cuda_devices`` and every CUDA device seen before)
        hold ``stream``; idempotent.

        The state of the stream being left is saved, the other's restored (or created: the TP
        stream from ``seed + TP_SEED_OFFSET + tp_rank``, the default stream from the global
        generator as it is). A device named for the first time is brought onto the current
        stream first, even when the tracker is on ``stream`` already.

        Under ``torch.compile``: a switch that has nothing to do (the tracker on ``stream``
        already) is traced; one that swaps generator states is one graph break (inductor draws a
        graph's random seeds from the global generator when the graph starts, so the draws after
        a switch must be another graph).
        """
        new = [d for d in cuda_devices if d != "cpu" and d not in self._devices]
        if stream == self.current and (not new or self.current == DEFAULT):
            self._devices.update(new)  # a device first seen on the default stream: its generator holds it
            return
        self._switch_now(stream, tuple(cuda_devices))

    @torch.compiler.disable
    def _switch_now(self, stream: str, cuda_devices: tuple):
        """:meth:`switch`'s generator swaps, run eagerly (one graph break under ``torch.compile``)."""
        self._adopt(cuda_devices)
        if stream == self.current:
            return
        for device in ("cpu", *sorted(self._devices)):
            self._swap(device, self.current, stream)
        self.current = stream

    def tp_state(self, device: str = "cpu") -> torch.Tensor:
        """The TP stream's state for ``device`` (a copy), without switching."""
        if self.current == TP:
            return self._get(device)
        state = self._states.get((TP, device))
        return state.clone() if state is not None else self._fresh_tp_state(device)

    def cuda_devices(self) -> tuple[str, ...]:
        """CUDA devices whose generators the tracker switches (every one seen), in a stable order."""
        return tuple(sorted(self._devices | {d for (_, d) in self._states if d != "cpu"}))

    def state_dict(self) -> dict:
        """Both streams' generator states (CPU and the CUDA devices in use), for an exact resume."""
        devices = ("cpu", *self.cuda_devices())
        return {"seed": self.seed, "tp_rank": self.tp_rank, "current": self.current,
                "saved": {f"{stream}|{device}": t.clone() for (stream, device), t in self._states.items()},
                "global": {device: self._get(device) for device in devices}}

    def snapshot(self) -> tuple[str, dict, bool]:
        """The tracker's own state (current stream, saved states of the others, whether the tokens
        are split), copied; the global generators are not included (torch.utils.checkpoint saves
        and restores them)."""
        return self.current, {k: t.clone() for k, t in self._states.items()}, self.tokens_split

    def restore(self, snapshot: tuple[str, dict, bool]) -> None:
        """Go back to a :meth:`snapshot` (the global generators are left as they are)."""
        self.current, states, self.tokens_split = snapshot
        self._states = {k: t.clone() for k, t in states.items()}

    def __deepcopy__(self, memo):
        """A copy (of a copied model) is a live tracker too: :func:`manual_seed` reseeds it."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: ({key: t.clone() for key, t in v.items()} if k == "_states" else
                                 set(v) if k == "_devices" else v) for k, v in self.__dict__.items()})
        _LIVE.add(new)
        return new

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (same devices), global generators included."""
        self.seed, self.tp_rank, self.current = state["seed"], state["tp_rank"], state["current"]
        self._states = {tuple(key.split("|")): t.clone() for key, t in state["saved"].items()}
        self._devices = {device for device in state["global"] if device != "cpu"}
        for device, t in state["global"].items():
            self._set(device, t)


    # ---- the hooks and contexts, bound to this tracker ----------------------------------------

    def enter_region(self, module, args, output):
        """Forward hook after a column-parallel layer: the TP stream (in training only: in eval
        nothing draws, and switching back is then free; and only while :attr:`active`), on the
        devices of its weight and output."""
        self.in_region = True
        if module.training and self.active:
            self.switch(TP, devices_of(module, output))

    def leave_region(self, module, args):
        """Forward pre-hook before a row-parallel layer: the default stream."""
        self.in_region = False
        self.switch(DEFAULT, devices_of(module, args))

    def leave_region_to_split(self, module, args):
        """Forward pre-hook before a row-parallel layer whose output sequence parallelism
        reduce-scatters along the tokens: the region ends, and while the tokens are split
        (:attr:`tokens_split`) the stream stays the TP one (the layer draws nothing, and the split
        tokens after it draw from the TP stream: switching to the default stream and back would
        change no draw, and costs two graph breaks under ``torch.compile``); else the default
        stream, as :meth:`leave_region`."""
        self.in_region = False
        if not self.tokens_split:
            self.switch(DEFAULT, devices_of(module, args))

    def at_root(self, module, *args):
        """Forward pre- and post-hook of the root model: the default stream outside the model."""
        self.in_region = False
        self.tokens_split = False
        self.switch(DEFAULT, self.cuda_devices())

    @contextmanager
    def on(self, stream: str):
        """Run a block on ``stream`` (``"tp"``: draws distinct per TP rank; ``"default"``: the same
        on every rank), then return to the previous one."""
        previous = self.current
        self.switch(stream, self.cuda_devices())
        try:
            yield
        finally:
            self.switch(previous, self.cuda_devices())

    def tp_rng(self):
        """Run a block on the TP stream (draws distinct per TP rank): :meth:`on` ``("tp")``."""
        return self.on(TP)

    def checkpoint_context_fn(self, *others):
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

        Activation recomputation runs a segment's forward again during backward. torch restores
        the global generators to their state at the segment's start (``preserve_rng_state``), but
        the TP stream's state lives in the tracker and has advanced: the recomputed
        attention-dropout masks would differ from the forward's and the gradients would be
        silently wrong. As Megatron's ``CheckpointFunction`` restores its RNG tracker, the forward
        context records the tracker at the segment's start and the recompute context puts it back
        for the recomputation (then restores the live one), so gradients are bitwise those of the
        run without checkpointing. ``others``: more objects with ``snapshot()``/``restore()``
        treated alike (the model's :class:`~tpify.context.CallState`: whether the tokens were
        split in the call being recomputed). Installed by :func:`tpify.parallelize` through the
        model's ``gradient_checkpointing_enable`` (:mod:`tpify.hf_methods`).
        """
        saved: dict = {}
        stateful = (self, *others)
        return _AtForward(stateful, saved), _AtRecompute(stateful, saved)


# Trackers of the live parallelized models, so that manual_seed reseeds every one of them.
_LIVE: "weakref.WeakSet[RNGStreamTracker]" = weakref.WeakSet()


def get_rng_tracker(model: nn.Module) -> RNGStreamTracker:
    """The :class:`RNGStreamTracker` of a parallelized model (``model.tp_info.rng``).

    Raises:
        ValueError: the model was not parallelized by tpify.
    """
    from .info import get_tp_info

    return get_tp_info(model).rng


def manual_seed(seed: int, tp_rank: int | None = None):
    """Seed the default stream (``torch.manual_seed(seed)``, CPU and every CUDA device) and the TP
    stream of every live parallelized model (from ``seed + TP_SEED_OFFSET + tp_rank``; ``tp_rank``
    defaults to each model's own rank).

    Call it with the same ``seed`` on every rank. Calling it before ``parallelize`` is fine: a
    model parallelized later derives its TP stream from ``torch.initial_seed()``, which is then
    ``seed``.
    """
    for tracker in list(_LIVE):  # first: a reset puts each tracker's default stream back in the generator
        tracker.reset(seed, tp_rank)
    torch.manual_seed(seed)


class _AtForward:
    """Forward context of :meth:`RNGStreamTracker.checkpoint_context_fn`: the states at segment start."""

    def __init__(self, stateful: tuple, saved: dict):
        self.stateful, self.saved = stateful, saved

    def __enter__(self):
        self.saved["states"] = [obj.snapshot() for obj in self.stateful]
        return self

    def __exit__(self, *exc):
        return False


class _AtRecompute:
    """Recompute context of :meth:`RNGStreamTracker.checkpoint_context_fn`: the states as they were
    at segment start, for the recomputation only."""

    def __init__(self, stateful: tuple, saved: dict):
        self.stateful, self.saved = stateful, saved

    def __enter__(self):
        self.live = [obj.snapshot() for obj in self.stateful]
        for obj, state in zip(self.stateful, self.saved["states"]):
            obj.restore(state)
        return self

    def __exit__(self, *exc):
        for obj, state in zip(self.stateful, self.live):
            obj.restore(state)
        return False


def devices_of(module: nn.Module, *values) -> tuple[str, ...]:
    """The CUDA devices (``"cuda:0"``) of a module's ``weight`` and of the tensors in ``values``
    (tensors, and tuples, lists and dict values of them: a hook's inputs and outputs), each once,
    or ``()`` on the CPU: the generators a stream switch there must swap besides the CPU's. A
    module without a weight of its own (a decoder block) is known by the tensors it is called with."""
    found = []
    weight = getattr(module, "weight", None)
    for value in (weight, *values):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and item.device.type == "cuda":
                device = str(item.device)
                if device not in found:
                    found.append(device)
    return tuple(found)


def new_tracker(tp_rank: int) -> RNGStreamTracker:
    """A parallelized model's dropout-stream tracker: the TP stream derives from
    ``torch.initial_seed()`` and ``tp_rank``; :func:`manual_seed` reseeds it."""
    tracker = RNGStreamTracker()
    tracker.seed, tracker.tp_rank = torch.initial_seed(), int(tp_rank)
    _LIVE.add(tracker)
    return tracker
