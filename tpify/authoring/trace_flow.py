"""What the data-flow tracer (:mod:`tpify.authoring.tracer`) tags tensors with and what it finds.

* ``_Flow``: where one producer's output features sit in a tensor (the tag the tracer moves);
* :class:`FlowTrace`: what one traced forward found;
* the op tables: which torch functions are elementwise, reductions, views, splits, products,
  or carry no values of their inputs; ``_view_blocks``: how a view maps dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FlowTrace"]


@dataclass(frozen=True)
class _Flow:
    """Where one producer's output features sit in a tensor.

    ``fdims``: the tensor dimensions holding them, most significant first (``fdims[0]`` is the
    one a contiguous split over ranks divides); ``offset``/``width``: the slice of the producer's
    features this tensor holds (a packed part), in the producer's own units.
    """

    producer: str
    fdims: tuple[int, ...]
    offset: int
    width: int
    part: bool = False


_ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "log1p",
    "tanh", "sigmoid", "relu", "relu6", "gelu", "silu", "softplus", "erf", "mish", "leaky_relu", "elu", "selu", "celu",
    "hardtanh", "hardswish", "hardsigmoid", "clamp", "clip", "clamp_min", "clamp_max", "abs", "sin", "cos", "square",
    "reciprocal", "sign", "minimum", "maximum", "lerp", "addcmul", "addcdiv", "nan_to_num", "dropout", "to", "type",
    "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "detach", "masked_fill", "where",
    "requires_grad_", "glu_not", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__neg__", "__pow__", "__rpow__",
    "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_", "fill_", "zero_", "rsub", "float_power",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "isnan", "isinf", "__and__",
    "__or__", "__invert__", "bitwise_not", "tanh_", "sigmoid_", "exp_", "relu_", "silu_", "gelu_", "__getstate__",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "clamp_min_", "clamp_max_",
}
_REDUCE = {"sum", "mean", "var", "std", "amax", "amin", "max", "min", "norm", "logsumexp", "prod", "argmax", "argmin",
           "any", "all", "var_mean", "std_mean", "count_nonzero", "vector_norm", "nansum", "nanmean", "median"}
_ALONG = {"softmax", "log_softmax", "_softmax", "cumsum", "cumprod", "logcumsumexp", "sort", "argsort", "flip", "roll",
          "normalize"}
_VIEW = {"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "_unsafe_view"}
_PERMUTE = {"transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis"}
_SPLIT = {"split", "chunk", "tensor_split", "split_with_sizes", "unbind"}
_MATMUL = {"matmul", "bmm", "__matmul__", "__rmatmul__"}
# Ops whose result holds no values of their tensor inputs (only their shape / dtype / device).
_CONSTANT = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "zeros_like", "ones_like", "empty_like",
             "full_like", "rand_like", "randn_like", "randint_like"}
_IGNORED = _CONSTANT | {"__get__", "size", "dim", "numel", "__len__", "item", "tolist", "is_floating_point", "data_ptr",
            "element_size", "stride", "storage_offset", "is_contiguous", "__bool__", "__format__", "__repr__",
            "__hash__", "get_device", "__index__", "__int__", "__float__", "_set_grad_enabled"}


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _flows(t) -> tuple[_Flow, ...]:
    return getattr(t, "_tpify_flows", ()) if isinstance(t, torch.Tensor) else ()


def _set(t, flows) -> None:
    if isinstance(t, torch.Tensor):
        uniq = tuple(dict.fromkeys(flows))
        try:
            t._tpify_flows = uniq
        except (AttributeError, RuntimeError):
            pass


def _view_blocks(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Group dims of a view/reshape ``src -> dst`` into blocks of equal size products (row-major)."""
    blocks = []
    i = j = 0
    n, m = len(src), len(dst)
    while i < n or j < m:
        bi, bj, pi, pj = [], [], 1, 1
        if i < n:
            pi *= src[i]
            bi.append(i)
            i += 1
        if j < m:
            pj *= dst[j]
            bj.append(j)
            j += 1
        while pi != pj:
            if pi < pj and i < n:
                pi *= src[i]
                bi.append(i)
                i += 1
            elif pj < pi and j < m:
                pj *= dst[j]
                bj.append(j)
                j += 1
            else:
                return None
        blocks.append((bi, bj))
    return blocks


class FlowTrace:
    """What one traced forward found (see :func:`trace_flows`).

    Attributes:
        order: shardable module FQNs in the order of their first call.
        consumers: producer FQN -> the linear layers whose inputs its features reach.
        bad: producer FQN -> why a contiguous split of its features would not be exact.
        parts: producer FQN -> the ``(start, stop)`` feature slices taken from it (packed parts).
        heads: producer FQN -> sizes its features were split into as the outer dimension.
        literals: ``(producer, module FQN, op, value)``: sizes of the split dimension passed to
            views / splits / slices as numbers (dense sizes a rank must divide).
        escaped: producers whose features reach the model's output.
        attention: modules whose forward split some producer's features into heads.
        widths: producer FQN -> the width of its output features.
    """

    def __init__(self):
        self.order: list[str] = []
        self.consumers: dict[str, set[str]] = {}
        self.bad: dict[str, list[str]] = {}
        self.parts: dict[str, set[tuple[int, int]]] = {}
        self.heads: dict[str, set[int]] = {}
        self.literals: list[tuple[str, str, str, int]] = []
        self.escaped: set[str] = set()
        self.attention: set[str] = set()
        self.widths: dict[str, int] = {}
