"""``tpify draft``: a draft recipe for a model family, to review and then prove exact.

Two sources, tried in this order (``method="auto"``):

1. **transformers' own TP plan** (``config.base_model_tp_plan`` and the head classes'
   ``_tp_plan``), imported by :mod:`tpify.hf_plan` for every head class of the family and merged
   into one recipe (head-class rules optional).
2. **A data-flow trace** of one forward of a small random instance (:func:`trace_flows`), for
   families without a plan. Every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` gets forward
   hooks, and a ``torch.overrides.TorchFunctionMode`` follows each linear layer's output features
   through the ops between layers: which tensor dimensions hold them (most significant first),
   how views split them into heads and merge them back, which packed parts (``split``, slicing)
   are taken, and whether any op would compute something different if each rank held only a
   contiguous block of the features (a reduction over them, a ``LayerNorm`` over the full width,
   a product with a tensor that is whole along them, a contraction over them). Megatron-LM's
   pairing (Shoeybi et al., arXiv:1909.08053, section 3) follows: a linear layer whose features
   reach only other linear layers' inputs, through such shard-local ops, is column-parallel
   (``packed_colwise`` when its output is split into parts first) and its consumers
   row-parallel; an embedding whose columns reach the heads that way (T5's relative attention
   bias) ``embedding_colwise``; the input token embedding (and every module tied to it)
   ``embedding_rowwise``; the LM head (the model's output embeddings) ``colwise_rep``; everything
   else ``replicate``. Head counts become ``divisible``. Sizes of a split dimension passed to
   views, splits and slices as numbers become ``divide`` (module attributes) or
   ``divide_config`` (config values): found by value in the ``forward`` source of the module
   that passed them (one size, or a sum of two: phi3's ``query_pos + num_key_value_heads *
   head_dim``), then confirmed by a second trace with other head counts (6 instead of 4); a size
   that does not follow (a constant, such as codegen's ``mp_num = 4``) keeps its layer whole. A
   ``Linear``/``Embedding`` subclass that overrides ``forward`` is split only when its forward
   equals the plain layer's (or, for an embedding, a constant attribute times it) on a random
   input, declared in ``[subclasses]``.

What the trace does not see is never split: an op it does not know marks the features it
carries as not splittable, so an unknown op costs memory, not correctness. What it cannot see
at all (code paths the small config does not take: cross-attention, other attention
implementations, the KV cache) is listed for review.

The draft is a starting point, never trusted as is: every rule carries a comment saying what it
is based on, and the file ends with what to review. ``tpify verify`` (or the test pattern of
``tests/distributed``) proves a recipe exact against the dense model.

:func:`draft` returns a :class:`Draft` (``draft.toml()``, ``draft.recipe()``); the command is
``tpify draft MODEL_TYPE_OR_DIR [--out FILE] [--head-class ...] [--method ...]``
(:mod:`tpify.cli.draft`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .hf_plan import (HEAD_COUNT_ATTRS, TASK_HEADS, base_model_and_prefix, forward_reads, has_hf_plan, head_counts,
                      import_hf_plan, layer_kind, overrides_forward, relative_name, wildcard)
from .recipe import Recipe, RecipeError, loss_terms_of

__all__ = ["DraftError", "Draft", "draft", "trace_flows", "FlowTrace", "to_toml"]

_LM_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")


class DraftError(ValueError):
    """No draft can be made: the target has no head class to build, its forward cannot run on a
    small random instance, or the requested method does not apply (the message says why)."""


@dataclass
class Draft:
    """A draft recipe and why each rule is there.

    Attributes:
        data: the recipe mapping (what the TOML file parses to).
        notes: one comment per rule of ``data["rule"]``.
        review: what the author must check (written at the end of the file).
        method: ``"hf-plan"`` or ``"trace"``.
        model_type: the family.
        head_classes: the head classes the draft was made from.
    """

    data: dict
    notes: list[str]
    review: list[str]
    method: str
    model_type: str
    head_classes: list[str] = field(default_factory=list)

    def recipe(self) -> Recipe:
        """The draft as a :class:`~tpify.recipe.Recipe` (validated)."""
        return Recipe.from_dict(self.data, f"draft recipe for {self.model_type} ({self.method})")

    def toml(self) -> str:
        """The draft as a commented TOML file (``tomllib`` reads it back to :attr:`data`)."""
        how = ("imported from transformers' own tensor-parallel plan (tpify.hf_plan)" if self.method == "hf-plan"
               else "from a data-flow trace of one forward of a small random model (tpify.draft.trace_flows)")
        header = [f"DRAFT tpify recipe for model_type {self.model_type!r}, {how}.",
                  f"Head classes looked at: {', '.join(self.head_classes)}.",
                  "Review every rule (the comment above it says what it is based on), then prove it exact:",
                  f"  tpify verify {self.model_type} --recipe THIS_FILE --tp 2   (float64 against the dense model)",
                  "Recipe keys: docs/recipes.md."]
        return to_toml(self.data, self.notes, header, self.review)


# ---------------------------------------------------------------------------------------------
# TOML output (tomllib reads; nothing in the standard library writes).

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _comment(text: str, width: int = 100) -> list[str]:
    lines = []
    for para in text.splitlines() or [""]:
        words, line = para.split(" "), "#"
        for w in words:
            if len(line) + 1 + len(w) > width and line != "#":
                lines.append(line)
                line = "#  "
            line += " " + w
        lines.append(line)
    return lines


def to_toml(data: dict, notes: list[str] | None = None, header: list[str] | None = None,
            review: list[str] | None = None) -> str:
    """A recipe mapping as TOML text: top-level keys, ``[loss]``/``[checkpoint]`` tables, then one
    ``[[rule]]`` per rule, each after its note as a comment; ``header`` and ``review`` lines as
    comments at the top and the end. ``tomllib.loads`` of the result equals ``data``."""
    out: list[str] = []
    for line in header or []:
        out += _comment(line)
    out.append("")
    for key, value in data.items():
        if key in ("rule",) or isinstance(value, dict):
            continue
        out.append(f"{key} = {_toml_value(value)}")
    for key, value in data.items():
        if isinstance(value, dict):
            out += ["", f"[{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    for i, rule in enumerate(data.get("rule", [])):
        out.append("")
        if notes and i < len(notes) and notes[i]:
            out += _comment(notes[i])
        out.append("[[rule]]")
        out += [f"{k} = {_toml_value(v)}" for k, v in rule.items()]
    if review:
        out += ["", "# ---- to review " + "-" * 80]
        for line in review:
            out += _comment("- " + line)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Building the family's head classes.

def _select_heads(config, head_class: list[str] | None) -> dict[str, type]:
    """The head classes to look at: every head class of the family (the standard tasks of
    :func:`tpify.cli.target.head_classes`, then the family's other public model classes such as
    ``GPT2DoubleHeadsModel``, as :func:`tpify.verify.family_head_classes` lists them), or those named."""
    from .cli.target import HEAD_TASKS
    from .verify import family_head_classes

    found = {t: c for t, c in family_head_classes(config).items()
             if getattr(c, "config_class", None) is None or isinstance(config, c.config_class)}
    if not head_class:
        return found
    by_name = {c.__name__: (t, c) for t, c in found.items()}
    out = {}
    for item in head_class:
        if item in found:
            out[item] = found[item]
        elif item in by_name:
            out[by_name[item][0]] = by_name[item][1]
        else:
            import transformers

            cls = getattr(transformers, item, None)
            if not isinstance(cls, type) or item in HEAD_TASKS:
                raise DraftError(f"--head-class {item!r} is neither a task ({', '.join(HEAD_TASKS)}) nor a head class "
                                 f"of model_type {config.model_type!r} ({', '.join(by_name)})")
            out[f"other:{item}"] = cls
    return out


def _build(cls: type, config, meta: bool) -> nn.Module:
    import copy

    config = copy.deepcopy(config)
    if cls.__name__.endswith("ForQuestionAnswering"):
        config.num_labels = 2  # start and end logits (some families check it)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def _loss_table(classes: dict[str, type], config=None) -> dict:
    loss: dict = {}
    for task, cls in classes.items():
        kind = {"causal-lm": "causal", "masked-lm": "masked", "seq2seq-lm": "seq2seq"}.get(task)
        if kind:
            loss.setdefault(kind, []).append(cls.__name__)
    terms = loss_terms_of(config) if loss and config is not None else []
    if terms:  # a mixture of experts: HF adds router_aux_loss_coef * aux_loss to the LM loss
        loss["terms"] = terms
    return loss


def draft(target: str, head_class: list[str] | None = None, method: str = "auto") -> Draft:
    """A draft recipe for ``target`` (a ``model_type`` or a directory with a ``config.json``).

    ``method``: ``"auto"`` (the HF plan when the family has one, else a trace), ``"hf-plan"`` or
    ``"trace"``. ``head_class``: tasks (``causal-lm``) or class names to build (default: every
    head class :func:`tpify.cli.target.head_classes` lists). Nothing is downloaded; the trace
    runs one forward of a small random model (:func:`tpify.verify.small_config`) on the CPU.

    Raises:
        tpify.cli.target.TargetError: the target is not a model_type nor a config directory.
        DraftError: no head class, an unknown ``--head-class``, ``hf-plan`` for a family without
            one, a config that cannot be made small, a forward that fails on the small model.
        RecipeError: the HF plan holds a style tpify cannot express (``auto`` then traces).
    """
    from .cli.target import resolve_config

    if method not in ("auto", "hf-plan", "trace"):
        raise DraftError(f"method must be 'auto', 'hf-plan' or 'trace', not {method!r}")
    config = resolve_config(str(target))
    classes = _select_heads(config, head_class)
    if not classes:
        raise DraftError(f"transformers defines no model class for model_type {config.model_type!r}")
    d = None
    if method in ("auto", "hf-plan"):
        first = _build(next(iter(classes.values())), config, meta=True)
        if has_hf_plan(first):
            try:
                d = _draft_from_hf_plan(config, classes)
            except RecipeError as e:
                if method == "hf-plan":
                    raise
                d = _draft_from_trace(config, classes)
                d.review.insert(0, f"transformers' plan could not be imported ({e}); traced instead")
        elif method == "hf-plan":
            raise DraftError(f"transformers defines no tensor-parallel plan for model_type {config.model_type!r}; "
                             f"use method 'trace'")
    if d is None:
        d = _draft_from_trace(config, classes)
    _check_layouts(d, config, classes)
    return d


def _check_layouts(d: Draft, config, classes: dict[str, type]) -> None:
    """Build the draft's layout at tp = 2 for every head class (meta device, the family's small
    config when it has one); each failure becomes a review line (the draft is still written)."""
    from .layout import PlanError, build_layout

    try:
        from .verify import small_config

        config = small_config(config, (2,))
    except Exception:  # noqa: BLE001 - the full config on the meta device then
        pass
    recipe = d.recipe()
    for cls in classes.values():
        try:
            build_layout(_build(cls, config, meta=True), recipe, 2)
        except PlanError as e:
            d.review.insert(0, f"the draft does not fit {cls.__name__} at tp = 2: {e}")
        except Exception as e:  # noqa: BLE001 - a class that cannot be built on meta is reported, not fatal
            d.review.append(f"{cls.__name__} could not be checked on the meta device ({type(e).__name__}: {e})")


def _draft_from_hf_plan(config, classes: dict[str, type]) -> Draft:
    """Merge the imported plan of every head class: base rules once, head rules optional."""
    rules: list[dict] = []
    notes: list[str] = []
    review: list[str] = []
    seen: dict[str, int] = {}
    top: dict = {}
    divide_config: list[str] = []
    hf_count = 0
    for task, cls in classes.items():
        imported = import_hf_plan(_build(cls, config, meta=True))
        hf_count = max(hf_count, len(imported.hf_rules))
        for key in ("divisible",):
            for name in imported.data.get(key, []):
                top.setdefault(key, [])
                if name not in top[key]:
                    top[key].append(name)
        for name in imported.data.get("divide_config", []):
            if name not in divide_config:
                divide_config.append(name)
        for rule, note in zip(imported.data["rule"], imported.notes):
            key = repr(rule["match"])
            if rule["match"] == list(TASK_HEADS) or (isinstance(rule["match"], list)
                                                     and set(rule["match"]) <= set(TASK_HEADS)):
                continue  # the task heads rule is written once, at the end
            if key in seen:
                old = rules[seen[key]]
                if {k: v for k, v in old.items() if k != "optional"} != {k: v for k, v in rule.items()
                                                                          if k != "optional"}:
                    review.append(f"{rule['match']}: {cls.__name__} gives {rule} but another head class gave {old}; "
                                  f"the first is kept")
                continue
            seen[key] = len(rules)
            rules.append(dict(rule))
            notes.append(note + (f" [{cls.__name__}]" if rule.get("optional") else ""))
        for line in imported.review:
            if line not in review:
                review.append(line)
    covered = {n for r in rules for n in (r["match"] if isinstance(r["match"], list) else [r["match"]])}
    heads = [t for t in TASK_HEADS if t not in covered]
    if heads:
        rules.append({"match": heads, "style": "replicate", "optional": True})
        notes.append("small task heads of the head classes: a full copy on every rank (optional)")
    data: dict = {"model_type": config.model_type,
                  "description": f"DRAFT imported from transformers' tensor-parallel plan ({hf_count} HF rules)",
                  "divisible": top.get("divisible", [])}
    if divide_config:
        data["divide_config"] = divide_config
    loss = _loss_table(classes, config)
    if loss:
        data["loss"] = loss
    data["rule"] = rules
    if any("gathers this layer's output" in n or "rowwise_split_input" in n for n in notes):
        review.append("replicate rules for layers HF's plan gathers (colwise_gather_output / rowwise_split_input) "
                      "are exact but keep the layer whole; a packed layer can be split with packed_colwise (parts "
                      "per packed tensor) + rowwise on its consumer: compare `tpify draft --method trace`")
    review.append("divide / divide_config: HF plans say nothing of head counts; the import looked for integer "
                  "attributes and config head counts read in the attention modules' forward; check the forward of "
                  "each attention class for sizes it reads (views with -1 need nothing)")
    return Draft(data, notes, review, "hf-plan", config.model_type, [c.__name__ for c in classes.values()])


# ---------------------------------------------------------------------------------------------
# The data-flow trace.

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


def _inputs(model: nn.Module, config) -> dict:
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
    inputs = inputs if inputs is not None else _inputs(model, model.config)
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


def _component(start: str, consumers: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    producers_of: dict[str, set[str]] = {}
    for p, cs in consumers.items():
        for c in cs:
            producers_of.setdefault(c, set()).add(p)
    prods, cons, todo = {start}, set(), [start]
    while todo:
        p = todo.pop()
        for c in consumers.get(p, ()):
            if c not in cons:
                cons.add(c)
                for q in producers_of.get(c, ()):
                    if q not in prods:
                        prods.add(q)
                        todo.append(q)
    return prods, cons


def _packed_parts(trace: FlowTrace, p: str, config, hd: int | None) -> tuple[object, str] | None:
    """``(parts, note)`` for a producer split into packed parts, or None when it is not packed.

    Raises ValueError (the reason) when the parts do not tile the output."""
    parts = sorted(trace.parts.get(p, ()))
    if not parts:
        return None
    width = trace.widths.get(p)
    pos = 0
    for lo, hi in parts:
        if lo != pos:
            raise ValueError(f"the parts taken from it {parts} do not tile its {width} output features")
        pos = hi
    if pos != width:
        raise ValueError(f"the parts taken from it {parts} do not tile its {width} output features")
    sizes = [hi - lo for lo, hi in parts]
    if len(set(sizes)) == 1:
        return len(sizes), f"{len(sizes)} equal parts of {sizes[0]}"
    counts = head_counts(config)
    names = []
    for s in sizes:
        match = [n for n, v in counts.items() if hd and v * hd == s]
        if len(match) != 1:
            return sizes, f"parts of sizes {sizes} (review: no config head count gives them; literal weights)"
        names.append(match[0])
    return names, f"parts of sizes {sizes} = {names} x head_dim {hd}"


def _draft_from_trace(config, classes: dict[str, type]) -> Draft:
    from .verify import ShrinkError, small_config

    try:
        small = small_config(config, (2,))
    except ShrinkError as e:
        raise DraftError(f"cannot trace model_type {config.model_type!r}: {e}") from e
    small._attn_implementation = "eager"  # explicit matmul / softmax ops for the tracer
    task = next((t for t in _LM_TASKS if t in classes), None) or ("base" if "base" in classes
                                                                  else next(iter(classes)))
    cls = classes[task]
    torch.manual_seed(0)
    model = cls(small).float().eval()
    trace = trace_flows(model)
    base, prefix = base_model_and_prefix(model)
    modules = {}
    for fqn, m in model.named_modules():
        if not fqn and base is not model:
            continue
        modules[fqn] = m
    rel = {fqn: relative_name(fqn, prefix)[0] for fqn in modules}
    hd = small.head_dim if isinstance(getattr(small, "head_dim", None), int) else None
    if hd is None:
        counts = head_counts(small)
        hidden = getattr(small, "hidden_size", None)
        n = counts.get("num_attention_heads")
        hd = hidden // n if isinstance(hidden, int) and n else None

    # The sizes of split dimensions passed as numbers: each must come from an attribute or config
    # value that tpify can divide. A second trace with other head counts (6 heads instead of 4)
    # confirms it: the number must follow that value (a constant such as codegen's mp_num = 4,
    # equal to the head count in the first trace only by chance, does not).
    other = _second_trace(config, cls)
    literal_divides, literal_problems, literal_notes = _resolve_literals(trace, other, modules, rel, small)

    styles: dict[str, tuple[str, str, dict]] = {}  # fqn -> (style, note, extra keys)
    rejected: dict[str, str] = {}
    for p in trace.order:
        if p in styles or p in rejected or p not in trace.consumers:
            continue
        prods, cons = _component(p, trace.consumers)
        problems = []
        for q in sorted(prods):
            if q in trace.bad:
                problems.append(f"{rel[q]}: " + "; ".join(trace.bad[q][:3]))
            if q in literal_problems:
                problems.append(f"{rel[q]}: " + "; ".join(literal_problems[q][:2]))
            if q in trace.escaped:
                problems.append(f"{rel[q]}: its features reach the model's output")
            if q in styles or q in cons:
                problems.append(f"{rel[q]} is already {styles.get(q, ('a consumer',))[0]}")
            if layer_kind(modules[q]) == "embedding" and (modules[q].max_norm is not None or modules[q].sparse):
                problems.append(f"{rel[q]} is an embedding with max_norm / sparse")
        for c in sorted(cons):
            if c in styles:
                problems.append(f"{rel[c]} is already {styles[c][0]}")
            if layer_kind(modules[c]) != "linear":
                problems.append(f"{rel[c]} is not a linear layer")
        packed = {}
        for q in sorted(prods):
            try:
                packed[q] = _packed_parts(trace, q, small, hd)
            except ValueError as e:
                problems.append(f"{rel[q]}: {e}")
        if problems:
            for q in prods:
                rejected.setdefault(q, "; ".join(problems))
            continue
        cons_names = ", ".join(sorted({wildcard(rel[c]) for c in cons}))
        prod_names = ", ".join(sorted({wildcard(rel[q]) for q in prods}))
        for q in prods:
            heads = sorted(trace.heads.get(q, ()))
            how = (f"split into {heads} heads" if heads else
                   "the heads" if layer_kind(modules[q]) == "embedding" else "elementwise")
            if layer_kind(modules[q]) == "embedding":
                styles[q] = ("embedding_colwise", f"traced: its columns are {how} (a per-head table), read only "
                                                  f"with the heads of {cons_names}", {})
            elif packed[q] is not None:
                parts, pnote = packed[q]
                styles[q] = ("packed_colwise", f"traced: output packed in {pnote}, each part {how}, read only by "
                                               f"{cons_names}", {"parts": parts})
            else:
                styles[q] = ("colwise", f"traced: output {how}, read only by {cons_names}", {})
        for c in cons:
            styles[c] = ("rowwise", f"traced: input is the split output of {prod_names}", {})

    # Embeddings and the LM head (and every module holding their tied weights).
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        outp = model.get_output_embeddings() if task in _LM_TASKS else None
    except Exception:  # noqa: BLE001
        outp = None
    review: list[str] = []
    subclasses: dict[str, dict] = {}
    emb_weight = getattr(inp, "weight", None) if layer_kind(inp) == "embedding" else None
    if emb_weight is not None:
        forward = _subclass_forward(inp)
        if inp.max_norm is not None or inp.scale_grad_by_freq or inp.sparse or forward is None:
            why = ("overrides forward with something else than a (scaled) lookup" if forward is None
                   else "uses max_norm / sparse")
            emb_style = ("replicate", f"the token embedding, but {type(inp).__name__} {why}: kept whole", {})
        else:
            emb_style = ("embedding_rowwise", "the input token embedding (get_input_embeddings): vocabulary rows split",
                         {})
            if forward != "plain-class":
                subclasses[type(inp).__name__] = forward
        for fqn, m in modules.items():
            if layer_kind(m) == "embedding" and m.weight is emb_weight:
                styles[fqn] = emb_style
    for fqn, m in modules.items():
        if outp is not None and m is outp and layer_kind(m) == "linear":
            tied = emb_weight is not None and getattr(m, "weight", None) is emb_weight
            if tied and emb_style[0] == "replicate":
                styles[fqn] = ("replicate", "the LM head, tied to a replicated embedding: a full copy", {})
            else:
                styles[fqn] = ("colwise_rep", f"the LM head (get_output_embeddings"
                                              f"{', tied to the token embedding' if tied else ''}): "
                                              f"vocabulary-parallel, logits gathered", {})
    # Linear subclasses that override forward: split only when it computes the plain layer.
    for fqn, (style, note, extra) in list(styles.items()):
        m = modules[fqn]
        if style == "replicate" or layer_kind(m) != "linear" or not overrides_forward(m):
            continue
        forward = _subclass_forward(m)
        if forward == {"forward": "plain"}:
            subclasses[type(m).__name__] = forward
        else:
            styles[fqn] = ("replicate", f"{type(m).__name__} overrides forward with something else than x W^T + b: "
                                        f"kept whole (was {style}: {note})", {})
    if subclasses:
        review.append(f"[subclasses] {sorted(subclasses)}: their forward matched the plain layer's (or a constant "
                      f"times it) on a random input; check their code")

    # Heads, per-rank sizes.
    counts = head_counts(small)
    divisible: list[str] = []
    for q, (style, _, _) in styles.items():
        if style in ("colwise", "packed_colwise"):
            for h in trace.heads.get(q, ()):
                for name, v in counts.items():
                    if v == h and name not in divisible:
                        divisible.append(name)
    divides: dict[str, list[str]] = {}
    divide_config: list[str] = []
    sharded = {q for q, (s, _, _) in styles.items() if s in ("colwise", "packed_colwise")}
    for producer, found in literal_divides.items():
        if producer not in sharded:
            continue
        for where, kind, name in found:
            if kind == "attr":
                lst = divides.setdefault(where, [])
                if name not in lst:
                    lst.append(name)
            elif name not in divide_config:
                divide_config.append(name)
    review.extend(line for line in literal_notes if line not in review)
    attention = sorted({rel[a] for a in trace.attention if a in rel and any(
        rel[q].startswith(rel[a] + ".") for q in sharded)})
    rel_modules = {rel[f]: m for f, m in modules.items()}
    widths = {v * hd for v in counts.values()} if hd else set()
    more, more_cfg = forward_reads(rel_modules, attention, small, counts, widths)
    for r, attrs in more.items():
        full = next(f for f in modules if rel[f] == r)
        for a in attrs:
            if a not in divides.setdefault(full, []):
                divides[full].append(a)
    for c in more_cfg:
        if c not in divide_config:
            divide_config.append(c)

    rules: list[dict] = []
    notes: list[str] = []
    grouped: dict[tuple, list[str]] = {}
    for fqn in modules:
        if fqn in styles:
            style, note, extra = styles[fqn]
            key = (wildcard(rel[fqn]), style, repr(sorted(extra.items())))
            if key not in grouped:
                grouped[key] = []
                rule = {"match": wildcard(rel[fqn]), "style": style, **extra}
                head_level = prefix and not fqn.startswith(prefix + ".") and base is not model
                if head_level or style == "colwise_rep":  # other head classes lack the LM head
                    rule["optional"] = True
                rules.append(rule)
                notes.append(note)
            grouped[key].append(fqn)
    by_glob: dict[str, tuple[list[str], str]] = {}
    for fqn, attrs in divides.items():
        names, cname = by_glob.setdefault(wildcard(rel[fqn]), ([], type(modules[fqn]).__name__))
        names.extend(a for a in attrs if a not in names)
    for glob, (attrs, cname) in by_glob.items():
        rules.append({"match": glob, "divide": sorted(attrs)})
        notes.append(f"traced: {cname}.forward uses these per-head sizes (dense sizes passed to views / splits of "
                     f"the split dimension, or head counts, found by value in its forward source)")
    for q, why in rejected.items():
        if q not in styles:
            review.append(f"{rel[q]} kept whole (replicate): {why}")
    # Everything else: replicate (all head classes of the family, built on the meta device).
    covered_rel = {r["match"] for r in rules if "style" in r}
    fill: dict[str, tuple[str, bool]] = {}
    for t, c in classes.items():
        try:
            m = _build(c, small, meta=True)
        except Exception as e:  # noqa: BLE001
            review.append(f"{c.__name__} could not be built on the meta device ({type(e).__name__}: {e}); its modules "
                          f"are not covered")
            continue
        b, pre = base_model_and_prefix(m)
        for f, mod in m.named_modules():
            if not f and b is not m:
                continue
            if layer_kind(mod) is None:
                continue
            r, inside = relative_name(f, pre)
            w = wildcard(r)
            if w in covered_rel or w in fill:
                continue
            fill[w] = (c.__name__, inside)
    task_heads = [h for h in TASK_HEADS if h not in fill and h not in covered_rel]
    for w, (cname, inside) in fill.items():
        rule = {"match": w, "style": "replicate"}
        if not inside or w.split(".")[0] in TASK_HEADS:
            rule["optional"] = True
        rules.append(rule)
        notes.append(f"traced: no split found for it ({cname}): a full copy on every rank")
    if task_heads:
        rules.append({"match": task_heads, "style": "replicate", "optional": True})
        notes.append("small task heads of other head classes: a full copy (optional)")
    divisible = sorted(divisible, key=lambda n: (HEAD_COUNT_ATTRS + (n,)).index(n))
    data: dict = {"model_type": config.model_type,
                  "description": f"DRAFT from a data-flow trace of {cls.__name__}",
                  "divisible": divisible}
    if divide_config:
        data["divide_config"] = sorted(divide_config)
    if subclasses:
        data["subclasses"] = subclasses
    loss = _loss_table(classes, config)
    if loss:
        data["loss"] = loss
    data["rule"] = rules
    review.append(f"traced one forward of {cls.__name__} with the small config (eager attention, no cache, "
                  f"{small.num_attention_heads} heads); code paths that config does not take (cross-attention, "
                  f"other attention implementations, options) were not seen: check their sizes and rules")
    review.append("divide / divide_config were found by value in the forward source of the module that passed "
                  "a size; check them, and attributes read by helpers outside forward")
    return Draft(data, notes, review, "trace", config.model_type, [c.__name__ for c in classes.values()])


def _second_trace(config, cls):
    """The trace of ``cls`` on the family's small config made for tp 3 (6 heads, 3 KV heads,
    hidden 48; else for tp 8: 8 heads), to tell sizes that follow the head count from constants;
    ``(model, trace)``, or None if neither runs."""
    from .verify import small_config

    for tp in (3, 8):  # 6 heads / 3 KV heads, else 8 heads (families whose code needs a multiple of 4)
        try:
            small = small_config(config, (tp,))
            small._attn_implementation = "eager"
            torch.manual_seed(0)
            model = cls(small).float().eval()
            return model, trace_flows(model)
        except Exception:  # noqa: BLE001 - the confirmation is then missing, and said so
            continue
    return None


def _resolve_literals(trace: FlowTrace, other, modules: dict, rel: dict, small):
    """Where each size passed as a number comes from, confirmed by the second trace.

    Returns ``(found, problems, notes)``: producer -> ``[(module FQN, "attr" | "config", name)]``
    to divide; producer -> reasons it cannot be split; review lines."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    problems: dict[str, list[str]] = {}
    notes: list[str] = []
    other_model, other_trace = other if other is not None else (None, None)
    seen: dict[tuple, int] = {}
    other_values: dict[tuple, list[int]] = {}
    if other_trace is not None:
        for producer, where, op, value in other_trace.literals:
            other_values.setdefault((producer, where, op), []).append(value)
    done = set()
    for producer, where, op, value in trace.literals:
        key = (producer, where, op)
        i = seen.get(key, 0)
        seen[key] = i + 1
        if (key, value) in done:
            continue
        done.add((key, value))
        module = modules.get(where) if where else None
        cname = type(module).__name__ if module is not None else "the model"
        source = _literal_source(module, small, value)
        twin = other_values.get(key, [])
        v2 = twin[i] if i < len(twin) else None
        names = " + ".join(f"{n}{' * head_dim' if f != 1 else ''}" for _, n, f in source) if source else ""
        if other_trace is None:
            if source is None:
                problems.setdefault(producer, []).append(f"{cname} passes the size {value} to {op}, from no "
                                                         f"attribute or config value its forward reads")
            else:
                found.setdefault(producer, []).extend((where, k, n) for k, n, _ in source)
                notes.append(f"{cname}: {names} divided because {op} is passed {value}; not confirmed by a second "
                             f"trace (none could run)")
            continue
        if source is not None:
            m2 = other_model.get_submodule(where) if where else None
            expect = 0
            for kind, name, f in source:
                owner = m2 if kind == "attr" else other_model.config
                v = getattr(owner, name, None)
                f2 = 1 if f == 1 else getattr(m2, "head_dim", None)
                if not isinstance(v, int) or not isinstance(f2, int):
                    expect = None
                    break
                expect += v * f2
            if expect is not None and expect == v2:
                found.setdefault(producer, []).extend((where, k, n) for k, n, _ in source)
                continue
            problems.setdefault(producer, []).append(
                f"{cname} passes the size {value} to {op}; it equals {names} here, but with other head counts it "
                f"is {v2} while that is {expect} (a constant?)")
            continue
        if v2 == value:
            problems.setdefault(producer, []).append(f"{cname} passes the constant size {value} of the split "
                                                     f"dimension to {op} (the same with other head counts)")
        else:
            problems.setdefault(producer, []).append(f"{cname} passes the size {value} of the split dimension to "
                                                     f"{op} ({v2} with other head counts) from no attribute or "
                                                     f"config value its forward reads")
    return found, problems, notes


def _subclass_forward(module: nn.Module):
    """What a shardable layer's forward computes, tested on a random input (float64 copy):
    ``"plain-class"`` (the class does not override forward), ``{"forward": "plain"}`` (an
    override equal to the plain layer), ``{"forward": "scaled", "scale": attr}`` (an embedding
    whose output is the lookup times the float attribute ``attr``), else None."""
    import copy

    import torch.nn.functional as F

    if not overrides_forward(module):
        return "plain-class"
    try:
        m = copy.deepcopy(module).double()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            if isinstance(m, nn.Embedding):
                ids = torch.randint(0, m.num_embeddings, (2, 5), generator=g)
                got, want = m(ids), F.embedding(ids, m.weight, m.padding_idx)
            else:
                x = torch.randn(2, 3, m.in_features, generator=g, dtype=torch.float64)
                got, want = m(x), F.linear(x, m.weight, m.bias)
    except Exception:  # noqa: BLE001 - a forward that does not take a plain input is not plain
        return None
    if got.shape != want.shape:
        return None
    if torch.allclose(got, want, rtol=1e-12, atol=1e-12):
        return {"forward": "plain"}
    if isinstance(m, nn.Embedding):
        nz = want.abs() > 1e-6
        if nz.any():
            ratio = float((got[nz] / want[nz]).mean())
            if torch.allclose(got, want * ratio, rtol=1e-9, atol=1e-12):
                # Prefer the module's own one-element buffer (the value its forward multiplies by, in
                # the buffer's dtype) over a Python float holding the same number.
                for name, v in module.named_buffers(recurse=False):
                    if v.numel() == 1 and v.is_floating_point() and math.isclose(float(v), ratio, rel_tol=1e-6):
                        return {"forward": "scaled", "scale": name}
                for name, v in vars(module).items():
                    if isinstance(v, float) and math.isclose(v, ratio, rel_tol=1e-6):
                        return {"forward": "scaled", "scale": name}
    return None


def _size_sources(module: nn.Module | None, config) -> list[tuple[str, str, int, int]]:
    """Per-rank-divisible sizes ``module``'s forward reads: ``(kind, name, value, factor)`` for each
    integer attribute it reads as ``self.<name>`` (``"attr"``) and config value (``"config"``),
    with factor 1 and, when the module has a ``head_dim``, factor ``head_dim`` (a head count times
    the head size). Names holding a per-head size (``*dim*``) are left out."""
    if module is None:
        return []
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return []
    hd = getattr(module, "head_dim", None)
    factors = [1] + ([hd] if isinstance(hd, int) and hd > 1 else [])
    out = []
    for kind, names, owner in (("attr", re.findall(r"self\.(\w+)", src), module),
                               ("config", re.findall(r"config\.(\w+)", src), config)):
        for name in dict.fromkeys(names):
            if "dim" in name:
                continue
            try:
                v = getattr(owner, name, None)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                out += [(kind, name, v, f) for f in factors]
    return out


def _literal_source(module: nn.Module | None, config, value: int) -> list[tuple[str, str, int]] | None:
    """Where a dense size passed in ``module``'s forward comes from: ``[(kind, name, factor)]`` for
    one size (``self.<name>``, or ``config.<name>``, times 1 or ``head_dim``) equal to it, else
    two whose sum is (phi3's ``query_pos + num_key_value_heads * head_dim``); None if neither."""
    sources = _size_sources(module, config)
    for kind, name, v, f in sources:
        if v * f == value:
            return [(kind, name, f)]
    for i, (k1, n1, v1, f1) in enumerate(sources):
        for k2, n2, v2, f2 in sources[i + 1:]:
            if n1 != n2 and v1 * f1 + v2 * f2 == value:
                return [(k1, n1, f1), (k2, n2, f2)]
    return None
