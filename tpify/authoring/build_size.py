"""The bounds on what verify builds and runs.

* :func:`check_build_size`: what a config would build, counted on the meta device, refused
  above :data:`MAX_SMALL_ELEMENTS` (2M parameter and buffer elements) before anything is built;
* :data:`RANK_MEMORY_LIMIT_GIB`: each verify rank's address-space limit (a forward that
  allocates far more than expected fails its step with a memory error instead of exhausting
  the machine).
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch

__all__ = ["ShrinkError", "check_build_size", "MAX_SMALL_ELEMENTS", "RANK_MEMORY_LIMIT_GIB"]

# Each rank's address-space limit (RLIMIT_AS) in a verify job: a rank of the largest small case
# peaks near 1 GiB of address space (torch, transformers, gloo and two copies of the model).
RANK_MEMORY_LIMIT_GIB = 4.0


class ShrinkError(ValueError):
    """A family's config cannot be made small by :func:`tpify.authoring.small.small_config` (names the attributes)."""


# The most parameter and buffer elements a model verify builds from a small config may have
# (check_build_size): 2M elements, 16 MB per float64 copy. Every family verify supports today is
# below 75k (ultrabert's masked LM 71k, t5 42k); a config attribute left at full size (a vision
# tower's projector, a 10240-row position table) gives millions.
MAX_SMALL_ELEMENTS = 2_000_000


def _attributes_note(config, named_shapes) -> str:
    """``"; config attributes ... with these sizes: a = 4096, ..."``: the integer config attributes
    (sub-configs included) equal to a dimension of ``named_shapes`` (``[(name, shape)]``) above
    128, larger than any size :func:`tpify.authoring.small.small_config` sets; or a sentence saying there is none."""
    dims = {d for _, shape in named_shapes for d in shape if d > 128}  # above every small size
    found: dict[str, int] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, int) and not isinstance(v, bool) and v in dims:
                found[f"{prefix}{k}"] = v
    try:
        walk(config.to_dict(), "")
    except Exception:  # noqa: BLE001 - a config that cannot serialise itself: no names
        return ""
    if not found:
        return ("; no config attribute has these sizes (derived from several; tpify.authoring.small.small_config does "
                "not know them)")
    return ("; config attributes tpify.authoring.small.small_config does not shrink, with these sizes: "
            + ", ".join(f"{k} = {v}" for k, v in sorted(found.items())[:8]))


def _check_model_size(model: torch.nn.Module, config, limit: int, cls: type | None = None) -> int:
    """The number of elements of ``model``'s parameters and buffers (each tensor once); raise
    :class:`ShrinkError` when it is above ``limit``, naming the family, the class, the largest
    tensors and the config attributes of their sizes (:func:`_attributes_note`). ``model`` is
    usually built on the meta device, so nothing is allocated."""
    tensors = dict(model.named_buffers())
    tensors.update(model.named_parameters())
    total = sum(t.numel() for t in tensors.values())
    if total > limit:
        largest = sorted(((t.numel(), n, tuple(t.shape)) for n, t in tensors.items()), reverse=True)[:4]
        shown = ", ".join(f"{n} {s}" for _, n, s in largest)
        cls_name = (cls or type(model)).__name__
        raise ShrinkError(f"model_type {config.model_type!r}: {cls_name} built from the config verify would use has "
                          f"{total:,} parameter and buffer elements, above verify's limit of {limit:,} "
                          f"(largest: {shown}){_attributes_note(config, [(n, s) for _, n, s in largest])}. Pass a "
                          f"directory holding a small config.json, or raise the limit (max_elements=, "
                          f"--max-elements)")
    return total


def check_build_size(config, classes: Iterable[type], max_elements: int | None = None) -> dict[str, int]:
    """``{class name: elements}`` of each class built from ``config`` on the meta device (nothing is
    allocated; each from a copy of ``config``, which some constructors change), parameters and
    buffers counted once each.

    Verify builds each head class several times per rank (the float64 reference, the parallel
    copy, gradients, the save/load models), so a config it was given to make small must really
    be small before anything is built for real. ``max_elements`` defaults to
    :data:`MAX_SMALL_ELEMENTS` (2M elements: 16 MB per float64 copy; every family verify
    supports today is below 75k, t5 and ultrabert the largest).

    Raises:
        ShrinkError: a class is above the limit (the message names the family, the class, the
            largest tensors and the config attributes of their sizes), or cannot be built from
            the config at all.
    """
    limit = MAX_SMALL_ELEMENTS if max_elements is None else max_elements
    sizes = {}
    for cls in classes:
        try:
            with torch.device("meta"):
                model = cls(copy.deepcopy(config))
        except Exception as e:  # noqa: BLE001 - any error of the family's constructor
            raise ShrinkError(f"model_type {config.model_type!r}: {cls.__name__} cannot be built from the config "
                              f"verify would use: {type(e).__name__}: {e}") from e
        sizes[cls.__name__] = _check_model_size(model, config, limit, cls)
    return sizes
