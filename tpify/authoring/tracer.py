"""A data-flow trace of one forward: where each linear layer's output features go (:func:`trace_flows`).

Every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` gets forward hooks, and a
``torch.overrides.TorchFunctionMode`` (:class:`_Tracer`) follows each linear layer's output
features through the ops between layers: which tensor dimensions hold them (most significant
first), how views split them into heads and merge them back, which packed parts (``split``,
slicing) are taken, and whether any op would compute something different if each rank held only
a contiguous block of the features (a reduction over them, a ``LayerNorm`` over the full width,
a product with a tensor that is whole along them, a contraction over them). Sizes of a split
dimension passed to views, splits and slices as numbers are recorded (``literals``): a rank
would have to divide them.

What the trace does not see is never split: an op it does not know marks the features it
carries as not splittable, so an unknown op costs memory, not correctness.
:mod:`tpify.authoring.trace_recipe` turns a :class:`FlowTrace` into a draft recipe.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..hf_modules import module_kind as layer_kind
from .draft_types import DraftError
from .trace_flow import (_ALONG, _ELEMENTWISE, _IGNORED, _MATMUL, _PERMUTE, _REDUCE, _SPLIT, _VIEW, FlowTrace, _dim, _Flow,
                         _flows, _set, _view_blocks)

__all__ = ["trace_flows", "FlowTrace"]


class _Tracer(TorchFunctionMode):
    """The ``TorchFunctionMode`` that moves :class:`_Flow` tags from inputs to outputs."""

    def __init__(self, trace: FlowTrace):
        super().__init__()
        self.trace = trace
        self.depth = 0  # > 0 inside a shardable layer's own forward
        self.stack: list[str] = []  # FQNs of the modules whose forward is running
        self.read_sizes: dict[tuple[str, str], set[int]] = {}  # (producer, module) -> sizes read off shapes
        self.token_weights: set[int] = set()  # ids of the token embedding's weight (no flows from it)

    # -- bookkeeping
    def bad(self, flow: _Flow, why: str) -> None:
        reasons = self.trace.bad.setdefault(flow.producer, [])
        where = self.stack[-1] if self.stack else "<model>"
        msg = f"{why} (in {where})"
        if msg not in reasons:
            reasons.append(msg)

    def literal(self, flow: _Flow, op: str, value) -> None:
        """Record a dense size of the split dimension passed as a number, unless the same module's
        forward read it (or a divisor of it) from a tensor's shape (it then follows the rank's)."""
        scope = self.stack[-1] if self.stack else ""
        if any(value % s == 0 for s in self.read_sizes.get((flow.producer, scope), ())):
            return
        if isinstance(value, int) and not isinstance(value, bool) and value not in (-1, 0, 1):
            self.trace.literals.append((flow.producer, self.stack[-1] if self.stack else "", op, value))

    def part(self, flow: _Flow, size: int, start: int, stop: int) -> _Flow | None:
        """The flow of ``[start, stop)`` along ``fdims[0]`` (of ``size``): a packed part."""
        if flow.width % size:
            return None
        unit = flow.width // size
        lo, hi = flow.offset + start * unit, flow.offset + stop * unit
        self.trace.parts.setdefault(flow.producer, set()).add((lo, hi))
        return _Flow(flow.producer, flow.fdims, lo, hi - lo, True)

    # -- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth > 0:
            return out
        name = getattr(func, "__name__", str(func))
        if name in ("__get__", "size") and args and _flows(args[0]) and not isinstance(out, torch.Tensor):
            scope = self.stack[-1] if self.stack else ""
            for f in _flows(args[0]):  # .shape / .size(): sizes the forward may pass on (they follow the rank's)
                self.read_sizes.setdefault((f.producer, scope), set()).add(int(args[0].shape[f.fdims[0]]))
        if name == "__get__":  # a property: only the tensor-valued ones that move dimensions matter
            prop = getattr(getattr(func, "__self__", None), "__name__", None)
            if not isinstance(out, torch.Tensor) or prop in ("data",):
                if isinstance(out, torch.Tensor) and args:
                    _set(out, _flows(args[0]))
                return out
            name = {"T": "t", "mT": "transpose", "H": "t", "mH": "transpose"}.get(prop, f"property {prop}")
            if name == "transpose":
                args = (args[0], -2, -1)
        elif name in _IGNORED:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flowed = [t for t in inputs if _flows(t)]
        if not flowed:
            return out
        try:
            self.propagate(name, func, args, kwargs, out, inputs)
        except Exception as e:  # noqa: BLE001 - an op the tracer mis-read: never a silent pass
            for t in flowed:
                for f in _flows(t):
                    self.bad(f, f"the tracer could not follow {name} ({type(e).__name__}: {e})")
        return out

    def propagate(self, name, func, args, kwargs, out, inputs):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in _ELEMENTWISE or (name.endswith("_") and name.rstrip("_") in _ELEMENTWISE):
            return self.elementwise(name, inputs, outs)
        if name in _VIEW:
            return self.view(name, args, kwargs, outs)
        if name in _PERMUTE:
            return self.permute(name, args, kwargs, outs)
        if name in ("unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "repeat"):
            return self.shape_op(name, args, kwargs, outs)
        if name in _SPLIT or name == "narrow" or name == "select":
            return self.split(name, args, kwargs, outs)
        if name == "__getitem__":
            return self.getitem(args, outs)
        if name in ("cat", "concat", "concatenate", "stack"):
            return self.cat(name, args, kwargs, outs)
        if name in _MATMUL:
            return self.matmul(name, args, outs)
        if name == "scaled_dot_product_attention":
            return self.sdpa(args, kwargs, outs)
        if name in _REDUCE or name in _ALONG or name in ("layer_norm", "rms_norm", "repeat_interleave"):
            return self.along(name, args, kwargs, outs)
        for t in inputs:
            for f in _flows(t):
                self.bad(f, f"op {name} is not analysed by the tracer")

    def elementwise(self, name, inputs, outs):
        if not outs:
            return
        shape = outs[0].shape
        nd = len(shape)
        result = []
        for t in inputs:
            off = nd - t.dim()
            for f in _flows(t):
                moved = _Flow(f.producer, tuple(d + off for d in f.fdims), f.offset, f.width, f.part)
                if t.shape[f.fdims[0]] != shape[moved.fdims[0]]:
                    self.bad(f, f"{name} broadcasts the split dimension")
                    continue
                for other in inputs:
                    if other is t:
                        continue
                    pos = moved.fdims[0] - (nd - other.dim())
                    if pos < 0 or other.shape[pos] == 1:
                        continue
                    same = any(g.fdims[0] + nd - other.dim() == moved.fdims[0] for g in _flows(other))
                    if not same and not _flows(other) and bool((other.amax(pos) == other.amin(pos)).all()):
                        same = True  # constant along it (zeros made for all heads): each rank's slice is the same
                    if not same:
                        self.bad(f, f"{name} combines it with a tensor of shape {tuple(other.shape)} that is whole "
                                    f"along the split dimension (a per-feature or per-head tensor, or a residual)")
                result.append(moved)
        for o in outs:
            _set(o, result)

    def view(self, name, args, kwargs, outs):
        src, dst = args[0], outs[0]
        blocks = _view_blocks(tuple(src.shape), tuple(dst.shape))
        requested = None
        if name in ("view", "reshape", "_unsafe_view"):
            shape = args[1:] if len(args) > 1 else (kwargs.get("shape") or kwargs.get("size") or ())
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            requested = tuple(int(s) if not isinstance(s, torch.Tensor) else -1 for s in shape)
        elif name == "unflatten":
            dim = _dim(args[1] if len(args) > 1 else kwargs["dim"], src.dim())
            sizes = args[2] if len(args) > 2 else kwargs["sizes"]
            requested = tuple([-1] * dim + list(sizes) + [-1] * (src.dim() - dim - 1))
        new = []
        for f in _flows(src):
            if blocks is None:
                self.bad(f, f"{name} {tuple(src.shape)} -> {tuple(dst.shape)} could not be mapped")
                continue
            where = {d: k for k, (bi, _) in enumerate(blocks) for d in bi}
            fdims: list[int] = []
            done = set()
            ok = True
            for rank_, d in enumerate(f.fdims):
                k = where[d]
                bi, bj = blocks[k]
                big_in = [x for x in bi if src.shape[x] != 1]
                big_out = [x for x in bj if dst.shape[x] != 1]
                if rank_ == 0:
                    if not big_in or big_in[0] != d or not big_out:
                        self.bad(f, f"{name} {tuple(src.shape)} -> {tuple(dst.shape)} merges the split dimension "
                                    f"under a more significant one")
                        ok = False
                        break
                    if len(big_out) > 1:
                        self.trace.heads.setdefault(f.producer, set()).add(int(dst.shape[big_out[0]]))
                        if self.stack:
                            self.trace.attention.add(self.stack[-1])
                    if requested is not None and len(requested) == dst.dim() and requested[big_out[0]] != -1:
                        self.literal(f, name, requested[big_out[0]])
                if k in done:
                    continue
                done.add(k)
                fdims += big_out
            if ok and fdims:
                new.append(_Flow(f.producer, tuple(fdims), f.offset, f.width, f.part))
        for o in outs:
            _set(o, new)

    def permute(self, name, args, kwargs, outs):
        src, dst = args[0], outs[0]
        nd = src.dim()
        perm = list(range(nd))
        rest = list(args[1:])
        if name in ("transpose", "swapaxes", "swapdims"):
            a = _dim(rest[0] if rest else kwargs.get("dim0"), nd)
            b = _dim(rest[1] if len(rest) > 1 else kwargs.get("dim1"), nd)
            perm[a], perm[b] = perm[b], perm[a]
        elif name == "t":
            perm = perm[::-1]  # t() of a 2-D tensor, .T of any
        elif name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest or kwargs.get("dims")
            perm = [_dim(d, nd) for d in dims]
        else:  # movedim
            s, d = (rest + [None, None])[:2] if rest else (kwargs.get("source"), kwargs.get("destination"))
            s = [s] if isinstance(s, int) else list(s)
            d = [d] if isinstance(d, int) else list(d)
            s, d = [_dim(x, nd) for x in s], [_dim(x, nd) for x in d]
            order = [x for x in range(nd) if x not in s]
            perm = [None] * nd
            for si, di in zip(s, d):
                perm[di] = si
            it = iter(order)
            perm = [p if p is not None else next(it) for p in perm]
        inv = {p: k for k, p in enumerate(perm)}
        new = [_Flow(f.producer, tuple(inv[d] for d in f.fdims), f.offset, f.width, f.part) for f in _flows(src)]
        _set(dst, new)

    def shape_op(self, name, args, kwargs, outs):
        src, dst = args[0], outs[0]
        new = []
        for f in _flows(src):
            if name == "unsqueeze":
                d = _dim(args[1] if len(args) > 1 else kwargs["dim"], src.dim() + 1)
                fd = tuple(x + (x >= d) for x in f.fdims)
            elif name == "squeeze":
                keep = [x for x in range(src.dim()) if x not in self._squeezed(args, kwargs, src)]
                fd = tuple(keep.index(x) for x in f.fdims if x in keep)
            else:  # expand / expand_as / broadcast_to / repeat: leading dims may be added
                off = dst.dim() - src.dim()
                fd = tuple(x + off for x in f.fdims)
                if any(src.shape[x] != dst.shape[x + off] for x in f.fdims):
                    self.bad(f, f"{name} repeats the split features")
                    continue
            if fd:
                new.append(_Flow(f.producer, fd, f.offset, f.width, f.part))
        _set(dst, new)

    @staticmethod
    def _squeezed(args, kwargs, src):
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None:
            return [x for x in range(src.dim()) if src.shape[x] == 1]
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [_dim(d, src.dim()) for d in dims if src.shape[_dim(d, src.dim())] == 1]

    def split(self, name, args, kwargs, outs):
        src = args[0]
        nd = src.dim()
        if name == "select":
            dim = _dim(args[1] if len(args) > 1 else kwargs["dim"], nd)
            index = _dim(args[2] if len(args) > 2 else kwargs["index"], src.shape[dim])
            ranges = [(index, index + 1, True)]
        elif name == "narrow":
            dim = _dim(args[1] if len(args) > 1 else kwargs["dim"], nd)
            start = int(args[2] if len(args) > 2 else kwargs["start"])
            length = int(args[3] if len(args) > 3 else kwargs["length"])
            ranges = [(start, start + length, False)]
        else:
            if name == "unbind":
                dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), nd)
            elif name == "chunk":
                dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), nd)
            else:
                dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), nd)
            ranges, start = [], 0
            for o in outs:
                size = 1 if name == "unbind" else o.shape[dim]
                ranges.append((start, start + size, name == "unbind"))
                start += size
        for o, (lo, hi, drop) in zip(outs, ranges):
            new = []
            for f in _flows(src):
                if dim not in f.fdims:
                    fd = tuple(x - (drop and x > dim) for x in f.fdims)
                    new.append(_Flow(f.producer, fd, f.offset, f.width, f.part))
                    continue
                if dim != f.fdims[0]:
                    if drop:
                        self.bad(f, f"{name} selects within the features")
                        continue
                    new.append(f)  # a slice within a head (rotate_half): per rank the same
                    continue
                if name in ("split", "split_with_sizes", "narrow"):
                    sizes = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
                    for v in (sizes if isinstance(sizes, (list, tuple)) else [sizes]):
                        self.literal(f, name, v if name != "narrow" else hi - lo)
                if f.part:
                    self.bad(f, f"{name} takes a part of a part")
                    continue
                p = self.part(f, src.shape[dim], lo, hi)
                if p is None:
                    self.bad(f, f"{name} cuts the split dimension off head boundaries")
                    continue
                if drop:
                    rest = tuple(x - (x > dim) for x in f.fdims[1:])
                    if not rest:
                        self.bad(f, f"{name} keeps a single feature")
                        continue
                    p = _Flow(p.producer, rest, p.offset, p.width, True)
                new.append(p)
            _set(o, new)

    def getitem(self, args, outs):
        src, index = args[0], args[1]
        dst = outs[0]
        idx = list(index) if isinstance(index, tuple) else [index]
        if any(isinstance(i, torch.Tensor) or isinstance(i, list) for i in idx):
            for f in _flows(src):
                self.bad(f, "advanced indexing of the features")
            return
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        if Ellipsis in idx:
            k = idx.index(Ellipsis)
            idx = idx[:k] + [slice(None)] * (src.dim() - n_real) + idx[k + 1:]
        idx += [slice(None)] * (src.dim() - sum(1 for i in idx if i is not None))
        mapping: dict[int, int | None] = {}
        sel: dict[int, tuple[int, int, bool, object, object]] = {}
        d_in = d_out = 0
        for i in idx:
            if i is None:
                d_out += 1
                continue
            size = src.shape[d_in]
            if isinstance(i, slice):
                start, stop, step = i.indices(size)
                if step != 1:
                    sel[d_in] = (start, stop, False, "step", None)
                elif (start, stop) != (0, size):
                    sel[d_in] = (start, stop, False, i.start, i.stop)
                mapping[d_in] = d_out
                d_out += 1
            else:
                j = int(i) % size
                sel[d_in] = (j, j + 1, True, i, None)
                mapping[d_in] = None
            d_in += 1
        new = []
        for f in _flows(src):
            head = f.fdims[0]
            if head in sel:
                lo, hi, drop, a, b = sel[head]
                if a == "step":
                    self.bad(f, "a strided slice of the split dimension")
                    continue
                for v in (a, b):
                    if isinstance(v, int) and v not in (0,):
                        self.literal(f, "slice", abs(v))
                if f.part:
                    self.bad(f, "a slice of a part")
                    continue
                p = self.part(f, src.shape[head], lo, hi)
                if p is None:
                    self.bad(f, "a slice of the split dimension off head boundaries")
                    continue
                rest = [mapping[x] for x in f.fdims[1:] if mapping.get(x) is not None]
                fd = ([] if drop else [mapping[head]]) + rest
                if not fd:
                    self.bad(f, "indexing keeps a single feature")
                    continue
                new.append(_Flow(f.producer, tuple(fd), p.offset, p.width, True))
                continue
            if any(x in sel and sel[x][2] for x in f.fdims[1:]):
                self.bad(f, "indexing selects within the features")
                continue
            new.append(_Flow(f.producer, tuple(mapping[x] for x in f.fdims), f.offset, f.width, f.part))
        _set(dst, new)

    def cat(self, name, args, kwargs, outs):
        tensors = list(args[0]) if args else list(kwargs.get("tensors"))
        dst = outs[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        new = []
        if name == "stack":
            d = _dim(dim, dst.dim())
            for t in tensors:
                for f in _flows(t):
                    new.append(_Flow(f.producer, tuple(x + (x >= d) for x in f.fdims), f.offset, f.width, f.part))
            _set(dst, new)
            return
        d = _dim(dim, dst.dim())
        for t in tensors:
            for f in _flows(t):
                if d == f.fdims[0]:
                    self.bad(f, f"{name} concatenates along the split dimension")
                    continue
                if d in f.fdims and not all(_flows(x) for x in tensors):
                    self.bad(f, f"{name} concatenates within the features with a tensor that is whole")
                    continue
                new.append(f)
        _set(dst, new)

    def matmul(self, name, args, outs):
        a, b = args[0], args[1]
        if name == "__rmatmul__":
            a, b = b, a
        dst = outs[0]
        if a.dim() < 2 or b.dim() < 2:
            for t in (a, b):
                for f in _flows(t):
                    self.bad(f, f"{name} of a vector")
            return
        nd = dst.dim()
        new = []
        for t, contracted, kept in ((a, a.dim() - 1, a.dim() - 2), (b, b.dim() - 2, b.dim() - 1)):
            other = b if t is a else a
            for f in _flows(t):
                if f.fdims[0] == contracted:
                    self.bad(f, f"{name} contracts over the split dimension")
                    continue
                fd = []
                for x in f.fdims:
                    if x == contracted:
                        continue
                    if x == kept:
                        fd.append(nd - 2 if t is a else nd - 1)
                    else:  # a batch dimension, right-aligned
                        fd.append(x + nd - t.dim())
                head = f.fdims[0]
                if head not in (contracted, kept):
                    pos = head + nd - t.dim()
                    opos = pos - (nd - other.dim())
                    if 0 <= opos < other.dim() - 2 and other.shape[opos] != 1 and not any(
                            g.fdims[0] + nd - other.dim() == pos for g in _flows(other)):
                        self.bad(f, f"{name} with a tensor that is whole along the heads")
                        continue
                new.append(_Flow(f.producer, tuple(fd), f.offset, f.width, f.part))
        _set(dst, new)

    def sdpa(self, args, kwargs, outs):
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dst = outs[0]
        new = []
        for t in (q, k, v):
            for f in _flows(t):
                if f.fdims[0] != t.dim() - 3:
                    self.bad(f, "scaled_dot_product_attention with the split dimension off the heads")
                    continue
                if isinstance(mask, torch.Tensor) and mask.dim() >= 3 and mask.shape[-3] != 1 and not _flows(mask):
                    self.bad(f, f"an attention mask / bias of shape {tuple(mask.shape)} per head (ALiBi?) is whole")
                    continue
                fd = (dst.dim() - 3,) + ((dst.dim() - 1,) if t is not k and t.dim() - 1 in f.fdims else ())
                new.append(_Flow(f.producer, fd, f.offset, f.width, f.part))
        _set(dst, new)

    def along(self, name, args, kwargs, outs):
        src = args[0]
        nd = src.dim()
        if name in ("layer_norm", "rms_norm"):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            dims = list(range(nd - len(shape), nd))
            keepdim = True
        elif name == "repeat_interleave":
            dim = args[2] if len(args) > 2 else kwargs.get("dim")
            for f in _flows(src):
                if dim is None or _dim(dim, nd) != f.fdims[0]:
                    self.bad(f, "repeat_interleave within the features")
                else:
                    _set(outs[0], [f])
            return
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 1 if name == "normalize" else None)
            if dim is None:
                dims = list(range(nd))
            else:
                dims = [_dim(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
            keepdim = name in _ALONG or bool(args[2] if len(args) > 2 and isinstance(args[2], bool)
                                             else kwargs.get("keepdim", False))
        new = []
        for f in _flows(src):
            if f.fdims[0] in dims:
                self.bad(f, f"{name} reduces over the split dimension")
                continue
            if keepdim:
                fd = tuple(x for x in f.fdims if x not in dims or name in _ALONG or name in ("layer_norm", "rms_norm"))
            else:
                fd = tuple(x - sum(1 for d in dims if d < x) for x in f.fdims if x not in dims)
            new.append(_Flow(f.producer, fd, f.offset, f.width, f.part))
        for o in outs:
            if o.dim() == nd or not keepdim:
                _set(o, new)
        if name in ("layer_norm", "rms_norm"):
            for w in args[2:4]:
                if isinstance(w, torch.Tensor):
                    for f in new:
                        if f.fdims[0] in dims:
                            self.bad(f, f"{name} weight spans the split dimension")

    # -- module hooks
    def pre(self, fqn, shardable):
        def hook(module, args, kwargs):
            self.stack.append(fqn)
            if not shardable:
                return
            if self.depth == 0:
                if fqn not in self.trace.order:
                    self.trace.order.append(fqn)
                tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                for i, x in enumerate(tensors):
                    for f in _flows(x):
                        if i > 0:
                            self.bad(f, f"{fqn} takes it as an extra argument")
                        elif f.fdims != (x.dim() - 1,):
                            self.bad(f, f"{fqn} takes it with the split dimension not last (or heads not merged "
                                        f"back)")
                        else:
                            self.trace.consumers.setdefault(f.producer, set()).add(fqn)
            self.depth += 1
        return hook

    def post(self, fqn, shardable, kind):
        def hook(module, args, out):
            self.stack.pop()
            if not shardable:
                return
            self.depth -= 1
            if self.depth == 0 and isinstance(out, torch.Tensor) and (
                    kind == "linear" or (kind == "embedding" and id(module.weight) not in self.token_weights)):
                # A linear layer's output features, or an embedding's columns (T5's per-head
                # relative position bias); never the token embedding's (the residual stream).
                self.trace.widths[fqn] = out.shape[-1]
                _set(out, [_Flow(fqn, (out.dim() - 1,), 0, out.shape[-1])])
        return hook


def _trace_inputs(model: nn.Module, config) -> dict:
    """Token ids ``(2, 10)`` (and a mask, decoder ids ``(2, 6)``, no cache) for the traced forward."""
    vocab = getattr(config, "vocab_size", 101) or 101
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(5, vocab - 1), vocab, (2, 10), generator=g)
    kw = {"input_ids": ids}
    params = inspect.signature(type(model).forward).parameters
    if "attention_mask" in params:
        kw["attention_mask"] = torch.ones_like(ids)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kw["decoder_input_ids"] = ids[:, :6].clone()
    if "use_cache" in params:
        kw["use_cache"] = False
    return kw


def trace_flows(model: nn.Module, inputs: dict | None = None) -> FlowTrace:
    """Trace one forward of ``model`` (float, eval, no grad) and return where each linear layer's
    output features go (:class:`FlowTrace`). The model's modules get temporary hooks, removed after.

    Raises:
        DraftError: the forward raised.
    """
    trace = FlowTrace()
    tracer = _Tracer(trace)
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(getattr(inp, "weight", None), torch.Tensor):
        tracer.token_weights.add(id(inp.weight))
    handles = []
    for fqn, module in model.named_modules():
        kind = layer_kind(module)
        shardable = kind is not None
        handles.append(module.register_forward_pre_hook(tracer.pre(fqn, shardable), with_kwargs=True))
        handles.append(module.register_forward_hook(tracer.post(fqn, shardable, kind)))
    inputs = inputs if inputs is not None else _trace_inputs(model, model.config)
    try:
        with torch.no_grad(), tracer:
            out = model(**inputs)
    except Exception as e:  # noqa: BLE001
        raise DraftError(f"the traced forward of {type(model).__name__} failed: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    for t in tree_flatten(out.to_tuple() if hasattr(out, "to_tuple") else out)[0]:
        for f in _flows(t):
            trace.escaped.add(f.producer)
    return trace
