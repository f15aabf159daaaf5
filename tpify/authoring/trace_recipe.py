"""A draft recipe from a data-flow trace (:func:`draft_from_trace`), for families without a plan.

One forward of a small random instance of the family's LM head class (else its base model) is
traced (:func:`tpify.authoring.tracer.trace_flows`). Megatron-LM's pairing (Shoeybi et al.,
arXiv:1909.08053, section 3) follows: a linear layer whose features reach only other linear
layers' inputs, through shard-local ops, is column-parallel (``packed_colwise`` when its output
is split into parts first) and its consumers row-parallel; an embedding whose columns reach the
heads that way (T5's relative attention bias) ``embedding_colwise``; the input token embedding
(and every module tied to it) ``embedding_rowwise``; the LM head (the model's output embeddings)
``colwise_rep``; everything else ``replicate``. Head counts become ``divisible``; sizes passed
as numbers become ``divide`` / ``divide_config`` (:mod:`tpify.authoring.trace_sizes`). A
``Linear``/``Embedding`` subclass that overrides ``forward`` is split only when its forward
equals the plain layer's (or, for an embedding, a constant attribute times it) on a random
input, declared in ``[subclasses]``.

What the trace cannot see at all (code paths the small config does not take: cross-attention,
other attention implementations, the KV cache) is listed for review.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..hf_modules import base_model_and_prefix, overrides_forward, relative_name
from ..hf_modules import module_kind as layer_kind
from ..hf_plan import HEAD_COUNT_ATTRS, TASK_HEADS, forward_reads, head_counts, wildcard
from ..styles import STYLES
from .draft_types import LM_TASKS, Draft, DraftError, build_head_class, recipe_data
from .small import ShrinkError, small_config
from .trace_sizes import resolve_literals, second_trace
from .tracer import FlowTrace, trace_flows

__all__ = ["draft_from_trace"]


@dataclass
class _Traced:
    """One traced forward, and the names its modules are written with in rules.

    Attributes:
        config: the family's config (full size); ``small``: the small config that was traced.
        classes: task -> head class (every head class the draft covers); ``task``/``cls``: the
            one traced (an LM head class, else the base model, else the first).
        model: the traced model; ``trace``: what :func:`trace_flows` found.
        base, prefix: the base model and its attribute name (``prefix`` "" for a base model).
        modules: FQN -> module, the head class's root left out when it has a base model.
        rel: FQN -> name relative to the base model (what rules match).
        hd: the head size, when the config gives it.
    """

    config: object
    small: object
    classes: dict
    task: str
    cls: type
    model: nn.Module
    trace: FlowTrace
    base: nn.Module
    prefix: str
    modules: dict
    rel: dict
    hd: int | None


def _trace(config, classes: dict[str, type]) -> _Traced:
    """Trace one forward of the LM head class (else the base model) on the family's small config,
    eager attention (explicit matmul / softmax ops for the tracer).

    Raises:
        DraftError: the config cannot be made small, or the forward fails.
    """
    try:
        small = small_config(config, (2,))
    except ShrinkError as e:
        raise DraftError(f"cannot trace model_type {config.model_type!r}: {e}") from e
    small._attn_implementation = "eager"  # explicit matmul / softmax ops for the tracer
    task = next((t for t in LM_TASKS if t in classes), None) or ("base" if "base" in classes
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
    return _Traced(config, small, classes, task, cls, model, trace, base, prefix, modules, rel, hd)


def draft_from_trace(config, classes: dict[str, type]) -> Draft:
    """A draft recipe for ``classes`` (task -> head class of ``config``'s family) from one traced
    forward (see the module docstring); every rule has a note saying what it is based on.

    Raises:
        DraftError: the config cannot be made small, or the traced forward fails.
    """
    t = _trace(config, classes)
    # The sizes of split dimensions passed as numbers, confirmed by a second trace with other
    # head counts (trace_sizes).
    literal_divides, literal_problems, literal_notes = resolve_literals(t.trace, second_trace(config, t.cls),
                                                                        t.modules, t.small)
    styles, rejected = _pair_layers(t, literal_problems)
    review: list[str] = []
    subclasses: dict[str, dict] = {}
    _embedding_styles(t, styles, subclasses)
    _linear_subclass_styles(t, styles, subclasses)
    if subclasses:
        review.append(f"[subclasses] {sorted(subclasses)}: their forward matched the plain layer's (or a constant "
                      f"times it) on a random input; check their code")
    divisible = _divisible(t, styles)
    divides, divide_config = _divides(t, styles, literal_divides)
    review.extend(line for line in literal_notes if line not in review)
    rules, notes = _style_rules(t, styles)
    _divide_rules(t, divides, rules, notes)
    for q, why in rejected.items():
        if q not in styles:
            review.append(f"{t.rel[q]} kept whole (replicate): {why}")
    _replicate_the_rest(t, rules, notes, review)
    data = recipe_data(config, f"DRAFT from a data-flow trace of {t.cls.__name__}",
                       sorted(divisible, key=lambda n: (HEAD_COUNT_ATTRS + (n,)).index(n)), sorted(divide_config),
                       rules, classes, subclasses)
    review.append(f"traced one forward of {t.cls.__name__} with the small config (eager attention, no cache, "
                  f"{t.small.num_attention_heads} heads); code paths that config does not take (cross-attention, "
                  f"other attention implementations, options) were not seen: check their sizes and rules")
    review.append("divide / divide_config were found by value in the forward source of the module that passed "
                  "a size; check them, and attributes read by helpers outside forward")
    return Draft(data, notes, review, "trace", config.model_type, [c.__name__ for c in classes.values()])


# ---------------------------------------------------------------------------------------------
# Column- and row-parallel pairs.

def _pair_layers(t: _Traced, literal_problems: dict[str, list[str]]
                 ) -> tuple[dict[str, tuple[str, str, dict]], dict[str, str]]:
    """``(styles, rejected)``: FQN -> ``(style, note, extra rule keys)`` of every layer in a
    column/row-parallel pair; producer FQN -> why its component was kept whole.

    Producers and consumers connected through the trace form a component (:func:`_component`);
    a component is split only when nothing in it stands against it (:func:`_component_problems`).
    """
    styles: dict[str, tuple[str, str, dict]] = {}
    rejected: dict[str, str] = {}
    for p in t.trace.order:
        if p in styles or p in rejected or p not in t.trace.consumers:
            continue
        prods, cons = _component(p, t.trace.consumers)
        problems, packed = _component_problems(t, prods, cons, styles, literal_problems)
        if problems:
            for q in prods:
                rejected.setdefault(q, "; ".join(problems))
            continue
        _pair_styles(t, prods, cons, packed, styles)
    return styles, rejected


def _component(start: str, consumers: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """``(producers, consumers)`` connected to producer ``start`` (a consumer reached by two
    producers joins them)."""
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



def _component_problems(t: _Traced, prods: set[str], cons: set[str], styles: dict,
                        literal_problems: dict[str, list[str]]) -> tuple[list[str], dict]:
    """``(problems, packed)``: why the component cannot be split (empty when it can), and
    producer -> :func:`_packed_parts` (None when not packed)."""
    trace, rel, modules = t.trace, t.rel, t.modules
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
            packed[q] = _packed_parts(trace, q, t.small, t.hd)
        except ValueError as e:
            problems.append(f"{rel[q]}: {e}")
    return problems, packed


def _pair_styles(t: _Traced, prods: set[str], cons: set[str], packed: dict, styles: dict) -> None:
    """The styles of a component that can be split: its producers column-parallel (an embedding
    ``embedding_colwise``, a packed output ``packed_colwise``), its consumers ``rowwise``."""
    rel, modules = t.rel, t.modules
    cons_names = ", ".join(sorted({wildcard(rel[c]) for c in cons}))
    prod_names = ", ".join(sorted({wildcard(rel[q]) for q in prods}))
    for q in prods:
        heads = sorted(t.trace.heads.get(q, ()))
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


# ---------------------------------------------------------------------------------------------
# Embeddings, the LM head, subclasses of the plain layers.

def _embedding_styles(t: _Traced, styles: dict, subclasses: dict) -> None:
    """The input token embedding (and every module holding its weight) ``embedding_rowwise``, or
    ``replicate`` when it cannot be split; the LM head ``colwise_rep``, or ``replicate`` when it is
    tied to a replicated embedding. A scaled embedding subclass is declared in ``subclasses``."""
    model, modules = t.model, t.modules
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        outp = model.get_output_embeddings() if t.task in LM_TASKS else None
    except Exception:  # noqa: BLE001
        outp = None
    emb_weight = getattr(inp, "weight", None) if layer_kind(inp) == "embedding" else None
    emb_style = None
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
            if tied and STYLES[emb_style[0]].copies_whole:
                styles[fqn] = ("replicate", "the LM head, tied to a replicated embedding: a full copy", {})
            else:
                styles[fqn] = ("colwise_rep", f"the LM head (get_output_embeddings"
                                              f"{', tied to the token embedding' if tied else ''}): "
                                              f"vocabulary-parallel, logits gathered", {})


def _linear_subclass_styles(t: _Traced, styles: dict, subclasses: dict) -> None:
    """Linear subclasses that override forward: split only when it computes the plain layer
    (declared in ``subclasses``), else kept whole."""
    for fqn, (style, note, extra) in list(styles.items()):
        m = t.modules[fqn]
        if STYLES[style].copies_whole or layer_kind(m) != "linear" or not overrides_forward(m):
            continue
        forward = _subclass_forward(m)
        if forward == {"forward": "plain"}:
            subclasses[type(m).__name__] = forward
        else:
            styles[fqn] = ("replicate", f"{type(m).__name__} overrides forward with something else than x W^T + b: "
                                        f"kept whole (was {style}: {note})", {})


def _subclass_forward(module: nn.Module):
    """What a shardable layer's forward computes, tested on a random input (float64 copy):
    ``"plain-class"`` (the class does not override forward), ``{"forward": "plain"}`` (an
    override equal to the plain layer), ``{"forward": "scaled", "scale": attr}`` (an embedding
    whose output is the lookup times the float attribute ``attr``), else None."""
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


# ---------------------------------------------------------------------------------------------
# Head counts and per-rank sizes.

def _divisible(t: _Traced, styles: dict) -> list[str]:
    """The config head counts that a column-parallel layer's output was split into (unsorted)."""
    counts = head_counts(t.small)
    divisible: list[str] = []
    for q, (style, _, _) in styles.items():
        if STYLES[style].column:  # a column-parallel layer whose output stays split
            for h in t.trace.heads.get(q, ()):
                for name, v in counts.items():
                    if v == h and name not in divisible:
                        divisible.append(name)
    return divisible


def _divides(t: _Traced, styles: dict, literal_divides: dict) -> tuple[dict[str, list[str]], list[str]]:
    """``(FQN -> attributes to divide, config values to divide)``: the sources of the literal
    sizes of split producers, then the head counts and widths the attention modules' forward
    reads (:func:`tpify.hf_plan.forward_reads`)."""
    rel, modules = t.rel, t.modules
    divides: dict[str, list[str]] = {}
    divide_config: list[str] = []
    sharded = {q for q, (s, _, _) in styles.items() if STYLES[s].column}
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
    attention = sorted({rel[a] for a in t.trace.attention if a in rel and any(
        rel[q].startswith(rel[a] + ".") for q in sharded)})
    rel_modules = {rel[f]: m for f, m in modules.items()}
    counts = head_counts(t.small)
    widths = {v * t.hd for v in counts.values()} if t.hd else set()
    more, more_cfg = forward_reads(rel_modules, attention, t.small, counts, widths)
    for r, attrs in more.items():
        full = next(f for f in modules if rel[f] == r)
        for a in attrs:
            if a not in divides.setdefault(full, []):
                divides[full].append(a)
    for c in more_cfg:
        if c not in divide_config:
            divide_config.append(c)
    return divides, divide_config


# ---------------------------------------------------------------------------------------------
# Rules.

def _style_rules(t: _Traced, styles: dict) -> tuple[list[dict], list[str]]:
    """One rule per (glob, style, extra keys), in module order, with its note; head-class modules
    and the LM head optional (other head classes lack them)."""
    rules: list[dict] = []
    notes: list[str] = []
    grouped: dict[tuple, list[str]] = {}
    for fqn in t.modules:
        if fqn in styles:
            style, note, extra = styles[fqn]
            key = (wildcard(t.rel[fqn]), style, repr(sorted(extra.items())))
            if key not in grouped:
                grouped[key] = []
                rule = {"match": wildcard(t.rel[fqn]), "style": style, **extra}
                head_level = t.prefix and not fqn.startswith(t.prefix + ".") and t.base is not t.model
                if head_level or STYLES[style].lm_head:  # other head classes lack the LM head
                    rule["optional"] = True
                rules.append(rule)
                notes.append(note)
            grouped[key].append(fqn)
    return rules, notes


def _divide_rules(t: _Traced, divides: dict[str, list[str]], rules: list[dict], notes: list[str]) -> None:
    """One ``divide`` rule per glob (layers share their class)."""
    by_glob: dict[str, tuple[list[str], str]] = {}
    for fqn, attrs in divides.items():
        names, cname = by_glob.setdefault(wildcard(t.rel[fqn]), ([], type(t.modules[fqn]).__name__))
        names.extend(a for a in attrs if a not in names)
    for glob, (attrs, cname) in by_glob.items():
        rules.append({"match": glob, "divide": sorted(attrs)})
        notes.append(f"traced: {cname}.forward uses these per-head sizes (dense sizes passed to views / splits of "
                     f"the split dimension, or head counts, found by value in its forward source)")


def _replicate_the_rest(t: _Traced, rules: list[dict], notes: list[str], review: list[str]) -> None:
    """``replicate`` for every other linear / embedding layer of every head class (built on the
    meta device), optional outside the base model; the task heads of other head classes too."""
    covered_rel = {r["match"] for r in rules if "style" in r}
    fill: dict[str, tuple[str, bool]] = {}
    for c in t.classes.values():
        try:
            m = build_head_class(c, t.small, meta=True)
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
