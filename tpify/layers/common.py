"""What every tensor-parallel layer shares: the two weight layouts (``"linear"``: ``[out, in]``;
``"conv1d"``: ``[in, out]``) and their matmul, autocast's dtype for it, shard parameters (new or
copied from a dense module through their :class:`~tpify.sharding.ShardSpec`) and the context.
No collective.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..context import TPContext
from ..sharding import ShardSpec, shard_spec_of

_LAYOUTS = ("linear", "conv1d")


def _weight_shape(in_features: int, out_features: int, layout: str) -> tuple[int, int]:
    if layout not in _LAYOUTS:
        raise ValueError(f"weight_layout must be one of {_LAYOUTS}, got {layout!r}")
    return (out_features, in_features) if layout == "linear" else (in_features, out_features)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``(..., n) -> (N, n)``, the leading dimensions flattened; also for ``n = 0`` (the shard of a
    rank that holds no feature of an uneven split), where ``reshape(-1, 0)`` is ambiguous."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    if layout == "linear":
        return F.linear(x, weight, bias)
    # Same kernel as transformers' Conv1D: addmm on the flattened tokens.
    out_shape = x.shape[:-1] + (weight.shape[1],)
    x2 = _tokens(x)
    y = torch.addmm(bias, x2, weight) if bias is not None else x2 @ weight
    return y.view(out_shape)


def _autocast_inputs(x: torch.Tensor, *tensors: torch.Tensor | None) -> tuple:
    """``(x, *tensors)`` cast to the autocast dtype of ``x``'s device when autocast is on there
    (what ``torch.amp.custom_fwd(cast_inputs=...)`` does), unchanged otherwise.

    A custom autograd Function runs its backward outside autocast: a forward that let autocast
    cast the matmul's operands but saved the originals would meet a ``bfloat16`` gradient and
    ``float32`` weights there. Casting once in forward and saving the cast operands makes the
    backward run the matmuls in the dtype the forward used, as autocast does for ``F.linear``
    (the gradients reach the ``float32`` parameters cast back by autograd, as through
    autocast's own cast nodes), and saves the half-size copies, as autocast does.
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() else t

    return (cast(x), *(cast(t) for t in tensors))


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in: autocast's on ``x``'s device when it is on there
    (``bfloat16`` over ``float32`` activations), else ``x``'s."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _new_param(shape, spec: ShardSpec | None, device, dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    if spec is not None:
        param.tp_shard_spec = spec
    return param


def _copy_shards(layer: nn.Module, dense: nn.Module, tp_rank: int) -> nn.Module:
    """Fill ``layer``'s parameters from the dense module's, slicing those with a ShardSpec."""
    with torch.no_grad():
        for name, param in layer.named_parameters(recurse=False):
            source = getattr(dense, name)
            spec = shard_spec_of(param)
            value = spec.slice_dense(source, tp_rank) if spec is not None else source.detach().clone()
            new = nn.Parameter(value, requires_grad=source.requires_grad)
            if spec is not None:
                new.tp_shard_spec = spec
            setattr(layer, name, new)
    return layer


def _resolve_context(layer: nn.Module, tp_group, context: TPContext | None) -> None:
    """Set ``layer.ctx`` (the model's :class:`~tpify.context.TPContext`, or one of its own for a
    layer built alone) and its ``tp_group``/``tp_size``/``tp_rank``, resolved once."""
    layer.ctx = context if context is not None else TPContext(tp_group)
    layer.tp_group, layer.tp_size, layer.tp_rank = layer.ctx.group, layer.ctx.size, layer.ctx.rank
