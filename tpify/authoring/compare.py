"""How verify compares: the tolerances, :func:`compare`, and :func:`dense_named` (a parallel
model's parameters or gradients gathered to their dense names and shapes; the tests use it too).

Tolerance (:data:`ATOL`, :data:`RTOL`): ``|parallel - dense| <= 1e-10 + 1e-9 |dense|`` in
float64. Both sides run the same operations on the same values; only the order of summation
differs (a matmul's dot products split over ranks and summed by the all-reduce, the
vocab-parallel loss's sums), which moves results by a few ulps (about 1e-16 relative, at most
~1e-13 after accumulating over a 2-layer model). An error of the recipe (a wrong shard, a head
count not divided, a missing gradient all-reduce) gives differences of 1e-3 and more, so the
margin separates the two by many orders of magnitude. Where a family's kernels refuse float64,
the comparison runs in float32 with :func:`float32_tolerance`, normwise.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ATOL", "RTOL", "TOLERANCE", "FLOAT32_ATOL", "FLOAT32_RTOL", "FLOAT32_TOLERANCE", "float32_tolerance",
           "compare", "dense_named"]

ATOL = 1e-10
RTOL = 1e-9
TOLERANCE = f"atol={ATOL:g}, rtol={RTOL:g}"
# Where a family's kernels refuse float64 (see the module docstring and float32_tolerance).
_FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23, about 1.19e-7


def float32_tolerance(layers: int) -> tuple[float, float, str]:
    """``(atol, rtol, in words)`` of the float32 comparisons of a model with ``layers`` layers.

    ``atol = rtol = 64 (layers + 1) eps32``, normwise (:func:`compare`: ``|a - e| <= atol +
    rtol max|e|``): each layer adds a few roundings at the residual stream's magnitude (the
    order of the partial sums of a split matmul and of the all-reduce), so the error grows with
    the depth (plus one for the embedding and the head). About 2.3e-5 for the 2-layer small
    configs. Measured with every shipped family, gemma2 and olmoe forced to float32 (every head
    class, outputs, loss, gradients): the largest error is 1.9e-6 of max|e| (16 ulps), 0.04 of
    this tolerance, at tp 2 and at tp 4. A wrong shard, a head count not divided or a missing
    all-reduce is off by 1e-3 of max|e| and more, 40 times the tolerance and more.
    """
    t = 64 * (max(layers, 1) + 1) * _FLOAT32_EPS
    return t, t, f"float32 normwise atol={t:.2g}, rtol={t:.2g}"


FLOAT32_ATOL, FLOAT32_RTOL, FLOAT32_TOLERANCE = float32_tolerance(2)  # the small configs' 2 layers


def dense_named(model: torch.nn.Module, attr: str | None = None) -> dict[str, torch.Tensor | None]:
    """``{fqn: dense tensor}`` of every parameter of ``model`` (``attr="grad"``: their gradients).

    Sharded parameters (those carrying a :class:`~tpify.sharding.ShardSpec`) are all-gathered
    over the model's TP group with :meth:`ShardSpec.gather` (vocabulary padding stripped, packed
    parts re-packed), so the result has the dense model's names and shapes; replicated ones are
    returned as they are. Tied parameters appear under every name (``remove_duplicate=False``).
    A missing gradient is ``None``. The group is ``model.tp_info.tp_group``; a module without
    ``tp_info`` (a parallel layer built by hand) gathers over the default group.

    Under FSDP2 (:func:`tpify.shard_data_parallel`) each DTensor is first gathered over the
    data-parallel axes (``full_tensor``), then over TP.

    Communication: one all-gather over the TP group per sharded parameter (every rank of the TP
    group must call it, in the same order); under FSDP2 one over DP per parameter before it;
    none on a dense model.
    """
    from ..info import param_specs, tp_info_of
    from ..sharding import is_dtensor

    info = tp_info_of(model)
    group = info.tp_group if info is not None else None
    specs = param_specs(model)
    out: dict[str, torch.Tensor | None] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        value = param if attr is None else getattr(param, attr)
        if value is not None and is_dtensor(value):
            value = value.detach().full_tensor()
        spec = specs[id(param)]
        if value is not None and spec is not None:
            value = spec.gather(value.detach(), group)
        out[fqn] = None if value is None else value.detach()
    return out


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL,
            normwise: bool = False) -> tuple[float, bool, str]:
    """``(max |actual - expected|, within tolerance, why not)`` of two tensors.

    The criterion is :func:`torch.testing.assert_close`'s: ``|a - e| <= atol + rtol |e|`` for
    every element; with ``normwise`` (the float32 comparisons) ``|a - e| <= atol + rtol max|e|``,
    the error of each element measured against the tensor's largest value (an element that is
    a sum of cancelling terms, such as most elements of a gradient, carries the rounding error
    of its terms, not of its own small value). A NaN in the dense reference fails (NaN equal to
    NaN would compare nothing there; the inputs must be chosen so that the dense model is
    finite). Different shapes fail
    (max difference ``inf``).
    """
    if actual.shape != expected.shape:
        return math.inf, False, f"shape {tuple(actual.shape)} != dense {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    if bool(torch.isnan(e).any()):
        return math.inf, False, (f"the dense reference has {int(torch.isnan(e).sum())} NaN elements: nothing to "
                                 f"compare there (choose inputs on which the dense model is finite)")
    both_nan = torch.isnan(a) & torch.isnan(e)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - e).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = e.abs().nan_to_num(0.0)
    if normwise:
        scale = scale.max() if scale.numel() else scale
    bad = diff > atol + rtol * scale
    if not bool(bad.any()):
        return worst, True, ""
    return worst, False, f"{int(bad.sum())} of {bad.numel()} elements outside tolerance"

