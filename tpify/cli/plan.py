"""``tpify plan MODEL_TYPE_OR_DIR --tp N``: what a recipe does to a model, without running it.

The coverage report a recipe author reads: no process group, no weights. The model is built on
the meta device (accelerate's ``init_empty_weights``) from the target's config
(:func:`tpify.cli.target.resolve_config`), the recipe is matched to it with
:func:`tpify.layout.build_layout`, and for every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding``
the report gives the rule that covers it, its style and each parameter's dense and per-rank
shape. Per-rank shapes come from :class:`tpify.sharding.ShardSpec`, built for each style exactly
as :mod:`tpify.layers` builds the parallel layer's specs (Megatron-LM, arXiv:1909.08053,
section 3), so the arithmetic is the library's. Then: parameter memory per rank against the
dense model (replicated parameters counted in full on every rank, tied parameters once), the
attributes and config values divided per rank, the rules that took no part, what stays
replicated and why, the LM head and the loss kind.

:func:`plan_report` returns the report as JSON-able data; :func:`render_text` renders it as
plain-text tables; ``tpify plan --json`` prints the data itself.
"""

from __future__ import annotations

import json
import math
import sys

__all__ = ["PlanReportError", "plan_report", "render_text", "rank_shapes", "add_parser"]


class PlanReportError(ValueError):
    """The plan cannot be reported exactly: an unknown head class, a style or layout field this
    command does not know how to size (never guessed), tied parameters sized differently."""


def _dtype_of(config):
    """The parameter dtype the report counts bytes in: the config's floating dtype, else float32."""
    import torch

    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype, "the config's dtype"
    return torch.float32, "the config sets no dtype"


def _head_class(config, head_class: str | None):
    """The class to build: ``head_class`` as a task of ``HEAD_TASKS`` or a transformers class name;
    by default the family's masked LM, else its causal LM, else its seq2seq LM, else its base model."""
    import transformers

    from .target import HEAD_TASKS, head_classes

    found = head_classes(config.model_type)
    if head_class is None:
        # An encoder family (bert, roberta) also defines a causal LM (BertLMHeadModel), but its
        # masked LM is the head it is pretrained with; decoder families have no masked LM.
        for task in ("masked-lm", "causal-lm", "seq2seq-lm", "base"):
            if task in found:
                return found[task]
        raise PlanReportError(f"transformers defines no base model or LM head for model_type "
                              f"{config.model_type!r}; pass --head-class with a class name")
    if head_class in HEAD_TASKS:
        if head_class not in found:
            raise PlanReportError(f"model_type {config.model_type!r} has no {head_class!r} head class in the installed "
                                  f"transformers; its heads: {{{', '.join(f'{t}: {c.__name__}' for t, c in found.items())}}}")
        return found[head_class]
    cls = getattr(transformers, head_class, None)
    if not isinstance(cls, type) or not hasattr(cls, "_from_config"):
        raise PlanReportError(f"--head-class {head_class!r} is neither a task ({', '.join(HEAD_TASKS)}) nor a model "
                              f"class of the installed transformers")
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and not isinstance(config, config_class):
        raise PlanReportError(f"--head-class {head_class} takes a {config_class.__name__}, but the target's config is a "
                              f"{type(config).__name__} (model_type {config.model_type!r}); heads of this family: "
                              f"{', '.join(c.__name__ for c in found.values())}")
    return cls


def _meta_model(config, cls, dtype):
    """``cls`` built from ``config`` on the meta device, tied as ``from_pretrained`` leaves it."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype)  # attention implementation picked as from_pretrained does
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    return model.eval()


def _spec_kwargs(entry) -> dict:
    """``replicated`` for :class:`ShardSpec` when the layout keeps packed parts whole (multi-query
    K/V); an explicit error when the installed ShardSpec cannot express it."""
    from tpify.sharding import ShardSpec

    replicated = tuple(getattr(entry, "replicated_parts", None) or ())
    if not replicated:
        return {}
    if "replicated" not in getattr(ShardSpec, "__dataclass_fields__", {}):
        raise PlanReportError(f"{entry.fqn}: the layout keeps packed parts {list(replicated)} whole, which the installed "
                              f"tpify.sharding.ShardSpec cannot express; plan does not size it")
    return {"replicated": replicated}


def rank_shapes(module, entry, tp_size: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """Per parameter of one layout entry: ``(dense shape, per-rank shape, sharded)``.

    ``module`` is the dense ``nn.Linear``, transformers ``Conv1D`` or ``nn.Embedding`` (real or
    on meta); ``entry`` its :class:`tpify.layout.ModuleLayout`. The per-rank shape is
    ``ShardSpec.local_shape`` of the spec that :mod:`tpify.layers` attaches to that parameter
    (padding rows of a vocabulary included): ``colwise``/``packed_colwise``/``colwise_rep`` split
    the output features (each packed part alike; ``nn.Linear`` weight dim 0, ``Conv1D`` dim 1,
    bias dim 0), ``rowwise`` the input features (weight dim 1 / 0, bias whole),
    ``embedding_rowwise`` the padded vocabulary rows, ``embedding_colwise`` the embedding
    columns, ``replicate`` nothing.

    Raises:
        PlanReportError: a style this function does not know, a style on a module of the wrong
            kind, or a sharded module with parameters besides ``weight`` and ``bias``, so that a
            new layout feature is never reported with a wrong number.
    """
    from torch import nn

    from tpify.sharding import ShardSpec

    params = {name: p for name, p in module.named_parameters(recurse=False)}
    dense = {name: tuple(p.shape) for name, p in params.items()}
    if entry.style == "replicate":
        return {name: (shape, shape, False) for name, shape in dense.items()}
    extra = sorted(set(params) - {"weight", "bias"})
    if extra:
        raise PlanReportError(f"{entry.fqn} ({type(module).__name__}, style {entry.style!r}) holds parameters {extra} "
                              f"besides weight and bias; plan does not know how they are split")
    specs: dict[str, ShardSpec | None] = {}
    embedding = isinstance(module, nn.Embedding)
    conv1d = type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
    linear = isinstance(module, nn.Linear) or conv1d
    wrong_kind = PlanReportError(f"{entry.fqn} is a {type(module).__name__}; plan does not know style "
                                 f"{entry.style!r} on it")
    if entry.style in ("colwise", "packed_colwise", "colwise_rep"):
        if not linear:
            raise wrong_kind
        out_f = module.nf if conv1d else module.out_features
        parts = tuple(entry.partition_sizes) if entry.partition_sizes else (out_f,)
        padded = entry.padded_size if entry.style == "colwise_rep" else None
        extra_kw = _spec_kwargs(entry)
        specs["weight"] = ShardSpec(1 if conv1d else 0, parts, tp_size, padded, **extra_kw)
        specs["bias"] = ShardSpec(0, parts, tp_size, padded, **extra_kw)
    elif entry.style == "rowwise":
        if not linear:
            raise wrong_kind
        in_f = module.nx if conv1d else module.in_features
        specs["weight"] = ShardSpec(0 if conv1d else 1, (in_f,), tp_size)
        specs["bias"] = None  # whole on every rank, added once after the all-reduce
    elif entry.style == "embedding_rowwise":
        if not embedding:
            raise wrong_kind
        specs["weight"] = ShardSpec(0, (module.num_embeddings,), tp_size, entry.padded_size or module.num_embeddings)
    elif entry.style == "embedding_colwise":
        if not embedding:
            raise wrong_kind
        specs["weight"] = ShardSpec(1, (module.embedding_dim,), tp_size)
    else:
        raise PlanReportError(f"plan does not know style {entry.style!r} ({entry.fqn}, rule #{entry.rule}): "
                              f"tpify.cli.plan.rank_shapes has no per-rank shape for it; extend it before trusting "
                              f"a report")
    out = {}
    for name, shape in dense.items():
        spec = specs.get(name)
        out[name] = (shape, spec.local_shape(shape), True) if spec is not None else (shape, shape, False)
    return out


def _rule_dict(rule) -> dict:
    return {"index": rule.index, "match": list(rule.patterns), "style": rule.style, "divide": list(rule.divide),
            "optional": rule.optional, "when": dict(rule.when)}


def _matching_pattern(rule, rel: str) -> str | None:
    """The first glob of ``rule`` that matches ``rel`` (a name relative to the base model)."""
    from tpify.recipe import Rule

    return next((p for p in rule.patterns if Rule(rule.index, (p,)).matches(rel)), None)


def _match_origin(model, rule, fqn: str) -> tuple[str | None, str | None]:
    """``(glob, container)``: the glob of ``rule`` that covers module ``fqn``, and the replicated
    container it lies in when the glob matches that container rather than the module (None)."""
    from tpify.layout import relative_fqn

    pattern = _matching_pattern(rule, relative_fqn(model, fqn))
    if pattern is not None:
        return pattern, None
    base = getattr(model, "base_model", model)
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        container = ".".join(parts[:i])
        if not container and base is not model:
            continue  # the head class's root is never matched
        pattern = _matching_pattern(rule, relative_fqn(model, container))
        if pattern is not None:
            return pattern, container or "<base model>"
    return None, None


def _replicate_reason(model, layout, fqn: str) -> str:
    """Why a ``replicate`` entry is whole: its own rule, or the replicated container it lies in."""
    rule = layout.recipe.rules[layout.modules[fqn].rule]
    pattern, container = _match_origin(model, rule, fqn)
    if container is not None:
        return f"inside container {container}, replicated by rule #{rule.index} (match {pattern!r})"
    return f"style replicate from rule #{rule.index} (match {pattern!r})"


def _rule_uses(model, layout) -> list[dict]:
    """Rules that took part in nothing: inactive (``when``), warned (``layout.unmatched_rules``)
    or optional and unmatched (a head this class lacks)."""
    from tpify.layout import relative_fqn
    from tpify.recipe import RuleIndex

    config = getattr(model, "config", None)
    base = model.base_model if hasattr(model, "base_model") else model
    names = [relative_fqn(model, fqn) for fqn, _ in model.named_modules() if fqn or base is model]
    warned = {r.index for r in layout.unmatched_rules}
    index = RuleIndex(layout.recipe.rules)  # a lookup per module, not every rule against every module
    hit = {rule.index for name in names for rule in index.hits(name)}
    unused = []
    for rule in layout.recipe.rules:
        if not rule.applies(config):
            unused.append({**_rule_dict(rule), "reason": "inactive: its 'when' conditions do not hold for this config"})
        elif rule.index in warned:
            unused.append({**_rule_dict(rule), "reason": "matched no module (parallelize warns)"})
        elif rule.index not in hit:
            unused.append({**_rule_dict(rule), "reason": "optional, matched no module of this head class"})
    return unused


def plan_report(target: str, tp_size: int, recipe=None, head_class: str | None = None) -> dict:
    """The coverage report of ``recipe`` on ``target`` at ``tp_size``, as JSON-able data.

    Args:
        target: a ``model_type`` (its default config) or a local directory with a ``config.json``.
        tp_size: the tensor-parallel size to plan for.
        recipe: a recipe name, ``.toml`` path or mapping (default: ``config.model_type``'s).
        head_class: a task of :data:`tpify.cli.target.HEAD_TASKS` or a transformers class name
            (default: the family's masked LM, else causal LM, else seq2seq LM, else base model).

    Returns:
        ``{"target", "model_type", "head_class", "tp_size", "recipe", "dtype", "modules",
        "memory", "divides", "config_divides", "divisible", "unused_rules", "replicated",
        "lm_head", "loss_kind", "honours_num_items", "head_inputs"}``; shapes are lists in the
        parameter's own layout (``nn.Linear`` ``[out, in]``, ``Conv1D`` ``[in, out]``), bytes in
        the report's dtype. No collective; nothing is downloaded or allocated.

    Raises:
        tpify.cli.target.TargetError: the target is neither a model_type nor a config directory.
        tpify.recipe.RecipeError: no recipe, or a malformed one.
        tpify.layout.PlanError: the recipe does not fit the model at ``tp_size``.
        PlanReportError: an unknown head class, or a layout this command cannot size exactly.
    """
    from tpify.api import resolve_recipe
    from tpify.layout import build_layout, relative_fqn

    from .target import resolve_config

    config = resolve_config(target)
    cls = _head_class(config, head_class)
    dtype, dtype_source = _dtype_of(config)
    model = _meta_model(config, cls, dtype)
    layout = build_layout(model, resolve_recipe(model, recipe), tp_size)  # shipped, given, or HF's plan imported
    recipe_obj = layout.recipe

    # Every holder of every parameter (tied ones appear under several names).
    holders: dict[int, list[tuple[str, str]]] = {}
    unique = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((mname, pname))
            unique[id(param)] = param

    # Per-rank shapes of the shardable modules' parameters, by parameter identity.
    shapes: dict[int, tuple] = {}  # id -> (dense, rank, sharded, fqn.pname that decides it)
    module_rows = []
    for fqn, entry in layout.modules.items():
        module = model.get_submodule(fqn)
        per_param = rank_shapes(module, entry, tp_size)
        rule = recipe_obj.rules[entry.rule]
        rel = relative_fqn(model, fqn)
        origin = _match_origin(model, rule, fqn)
        rows_dim = {"embedding_rowwise": "num_embeddings", "colwise_rep": "nf" if hasattr(module, "nf") else
                    "out_features"}.get(entry.style)
        row = {"fqn": fqn, "relative_fqn": rel, "type": type(module).__name__,
               "rule": entry.rule, "match": list(rule.patterns), "matched_by": origin[0], "container": origin[1],
               "style": entry.style, "partition_sizes": entry.partition_sizes, "padded_size": entry.padded_size,
               "vocab_size": getattr(module, rows_dim) if rows_dim else None,
               "replicated_parts": list(getattr(entry, "replicated_parts", None) or ()) or None,
               "output_scale": getattr(entry, "output_scale", None), "params": []}
        for pname, (dense_shape, rank_shape, sharded) in per_param.items():
            param = getattr(module, pname)
            seen = shapes.get(id(param))
            if seen is not None and seen[1] != rank_shape:
                raise PlanReportError(f"{fqn}.{pname} is tied to {seen[3]}, which is sized {list(seen[1])} per rank, "
                                      f"but style {entry.style!r} sizes it {list(rank_shape)}")
            if seen is None or (sharded and not seen[2]):
                shapes[id(param)] = (dense_shape, rank_shape, sharded, f"{fqn}.{pname}")
            row["params"].append({"name": pname, "dense_shape": list(dense_shape), "rank_shape": list(rank_shape),
                                  "sharded": sharded})
        module_rows.append(row)

    def owner(pid: int) -> str:
        """The name a parameter is counted under: the shardable holder that sizes it, else the first."""
        if pid in shapes:
            return shapes[pid][3]
        m, p = holders[pid][0]
        return f"{m}.{p}" if m else p

    # Memory: every unique parameter once; replicated ones in full on every rank.
    dense_bytes = rank_bytes = sharded_dense = sharded_rank = 0
    dense_numel = rank_numel = 0
    replicated = []
    for pid, param in unique.items():
        size = param.element_size()
        dense_shape, rank_shape, sharded, _ = shapes.get(pid, (tuple(param.shape), tuple(param.shape), False, None))
        dn, rn = math.prod(dense_shape), math.prod(rank_shape)
        dense_numel += dn
        rank_numel += rn
        dense_bytes += dn * size
        rank_bytes += rn * size
        if sharded:
            sharded_dense += dn * size
            sharded_rank += rn * size
            continue
        name = owner(pid)
        mname, _, pname = name.rpartition(".")
        module = model.get_submodule(mname)
        if mname in layout.modules:
            entry = layout.modules[mname]
            reason = ("bias of a rowwise layer: whole on every rank, added once after the all-reduce"
                      if entry.style == "rowwise" and pname == "bias"
                      else _replicate_reason(model, layout, mname) if entry.style == "replicate"
                      else f"not split by style {entry.style!r}")
        else:
            reason = f"not a shardable layer ({type(module).__name__}): a full copy on every rank"
        replicated.append({"param": name, "module_type": type(module).__name__, "shape": list(dense_shape),
                           "bytes": dn * size, "reason": reason,
                           "tied_to": sorted(f"{m}.{p}" for m, p in holders[pid] if f"{m}.{p}" != name)})
    for row in module_rows:  # tied parameters: the other holders, and where the bytes are counted
        module = model.get_submodule(row["fqn"])
        for p in row["params"]:
            full, pid = f"{row['fqn']}.{p['name']}", id(getattr(module, p["name"]))
            p["tied_to"] = sorted(f"{m}.{q}" for m, q in holders[pid] if f"{m}.{q}" != full)
            p["counted_as"] = owner(pid)

    divides = []
    for fqn, attrs in layout.divides.items():
        module = model.get_submodule(fqn)
        for attr in attrs:
            value = getattr(module, attr)
            divides.append({"fqn": fqn, "attr": attr, "dense": value, "per_rank": value // tp_size})
    config_divides = [{"name": n, "dense": v, "per_rank": v // tp_size} for n, v in layout.config_divides.items()]
    divisible = [{"name": n, "value": getattr(config, n)} for n in recipe_obj.divisible if n not in layout.config_divides]

    ratio = rank_bytes / dense_bytes if dense_bytes else 1.0
    head_inputs = getattr(layout, "head_inputs", None)  # module FQN -> ((argument, dim, dense heads), ...)
    return {
        "target": str(target), "model_type": config.model_type, "head_class": cls.__name__,
        "tp_size": tp_size, "recipe": recipe_obj.source, "recipe_model_type": recipe_obj.model_type,
        "dtype": str(dtype).removeprefix("torch."), "dtype_source": dtype_source,
        "modules": module_rows,
        "memory": {"dense_bytes": dense_bytes, "rank_bytes": rank_bytes, "ratio": ratio,
                   "dense_params": dense_numel, "rank_params": rank_numel,
                   "sharded_dense_bytes": sharded_dense, "sharded_rank_bytes": sharded_rank,
                   "replicated_bytes": rank_bytes - sharded_rank},
        "divides": divides, "config_divides": config_divides, "divisible": divisible,
        "unused_rules": _rule_uses(model, layout), "replicated": replicated,
        "lm_head": layout.lm_head, "loss_kind": layout.loss_kind, "honours_num_items": layout.honours_num_items,
        "head_inputs": [{"fqn": fqn, "argument": arg, "dim": dim, "dense_heads": heads, "per_rank": heads // tp_size}
                        for fqn, items in (head_inputs or {}).items() for arg, dim, heads in items],
    }


# ---------------------------------------------------------------------------------------- text


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def _table(rows: list[list[str]], header: list[str], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _pattern(fqn: str) -> str:
    """``transformer.h.3.ln_1.weight`` -> ``transformer.h.*.ln_1.weight`` (layers grouped in text)."""
    return ".".join("*" if seg.isdigit() else seg for seg in fqn.split("."))


def _grouped(items: list[dict], name_key: str, same: tuple[str, ...]) -> list[tuple[str, int, dict]]:
    """Items whose names differ only in layer indices and agree on ``same``, grouped in first-seen
    order: ``(name or pattern, count, first item)``."""
    groups: dict[tuple, list[dict]] = {}
    for item in items:
        key = (_pattern(item[name_key]),) + tuple(repr(item[k]) for k in same)
        groups.setdefault(key, []).append(item)
    return [(members[0][name_key] if len(members) == 1 else key[0], len(members), members[0])
            for key, members in groups.items()]


def _shape(s) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def render_text(report: dict) -> str:
    """The report of :func:`plan_report` as plain-text tables (one line per parameter)."""
    r = report
    mem = r["memory"]
    lines = [f"tpify plan: {r['head_class']} (model_type {r['model_type']!r}, target {r['target']}) at tp_size = "
             f"{r['tp_size']}",
             f"recipe: {r['recipe']}",
             f"dtype: {r['dtype']} ({r['dtype_source']})", ""]
    if r["recipe_model_type"] != r["model_type"]:
        lines.insert(2, f"note: the recipe is written for model_type {r['recipe_model_type']!r}")
    rows = []
    for m in r["modules"]:
        notes = []
        if m["partition_sizes"]:
            notes.append(f"parts {m['partition_sizes']}")
        if m["replicated_parts"]:
            notes.append(f"parts {m['replicated_parts']} whole")
        if m["padded_size"] and m["padded_size"] != m["vocab_size"]:
            notes.append(f"vocab {m['vocab_size']} padded to {m['padded_size']}")
        if m["output_scale"] is not None:
            notes.append(f"output scaled by {m['output_scale']:g}")
        if m["container"]:
            notes.append(f"inside replicated container {m['container']}")
        for i, p in enumerate(m["params"]):
            pnotes = list(notes) if i == 0 else []
            if p["tied_to"]:
                counted = f"{m['fqn']}.{p['name']}" == p["counted_as"]
                where = ("" if counted else " (counted there)" if p["tied_to"] == [p["counted_as"]]
                         else f" (counted as {p['counted_as']})")
                pnotes.append(f"tied to {', '.join(p['tied_to'])}{where}")
            first = i == 0
            rows.append([m["fqn"] if first else "", m["type"] if first else "",
                         f"#{m['rule']} {m['matched_by'] or m['match'][0]}" if first else "",
                         m["style"] if first else "", p["name"], _shape(p["dense_shape"]), _shape(p["rank_shape"]),
                         "; ".join(pnotes)])
    lines.append(f"Shardable modules ({len(r['modules'])}; shapes in each layer's own layout, per rank = every rank):")
    lines += _table(rows, ["module", "type", "rule", "style", "param", "dense shape", "per rank", "notes"])
    lines += ["", f"Parameter memory per rank ({r['dtype']}; tied parameters once, replicated ones in full on "
                  f"every rank):",
              f"  dense:      {_bytes(mem['dense_bytes'])}, {mem['dense_params']:,} parameters",
              f"  per rank:   {_bytes(mem['rank_bytes'])}, {mem['rank_params']:,} parameters = "
              f"{mem['ratio']:.4f} x dense",
              f"    sharded:    {_bytes(mem['sharded_rank_bytes'])} (dense {_bytes(mem['sharded_dense_bytes'])})",
              f"    replicated: {_bytes(mem['replicated_bytes'])}", ""]
    lines.append("Divided per rank:")
    if not (r["divides"] or r["config_divides"]):
        lines.append("  (nothing)")
    for name, count, d in _grouped(r["divides"], "fqn", ("attr", "dense", "per_rank")):
        lines.append(f"  {name}.{d['attr']}: {d['dense']} -> {d['per_rank']}" + (f"  (x{count})" if count > 1 else ""))
    for d in r["config_divides"]:
        lines.append(f"  config.{d['name']}: {d['dense']} -> {d['per_rank']} (written back dense on save)")
    for d in r["divisible"]:
        lines.append(f"  config.{d['name']} = {d['value']}: checked divisible, not changed")
    lines += ["", "Rules that took no part:"]
    if not r["unused_rules"]:
        lines.append("  (none: every rule matched)")
    for u in r["unused_rules"]:
        what = f"style {u['style']}" if u["style"] else f"divide {u['divide']}"
        lines.append(f"  rule #{u['index']} match={u['match']} ({what}): {u['reason']}")
    lines += ["", "Replicated (a full copy on every rank; layers alike grouped, * = layer index):"]
    rep_rows = [[name, str(count), x["module_type"], _shape(x["shape"]), f"{x['bytes'] * count:,}",
                 x["reason"] + (f"; tied to {', '.join(x['tied_to'])}" if x["tied_to"] else "")]
                for name, count, x in _grouped(r["replicated"], "param", ("module_type", "shape", "reason", "tied_to"))]
    lines += (_table(rep_rows, ["parameter", "count", "module type", "shape", "bytes in all", "why"]) if rep_rows
              else ["  (nothing)"])
    lines += [""]
    if r["lm_head"]:
        head = next(m for m in r["modules"] if m["fqn"] == r["lm_head"])
        pad = (f", vocab {head['vocab_size']} padded to {head['padded_size']}"
               if head["padded_size"] and head["padded_size"] != head["vocab_size"] else "")
        lines.append(f"LM head: {r['lm_head']} (colwise_rep{pad}; logits gathered, kept vocab-sharded with labels=)")
        if r["loss_kind"]:
            lines.append(f"loss: {r['loss_kind']} (vocab-parallel cross-entropy with labels=; "
                         f"{'divides' if r['honours_num_items'] else 'ignores'} num_items_in_batch)")
        else:
            lines.append("loss: none (HF's own loss on the gathered logits)")
    else:
        lines.append("LM head: none (no colwise_rep module); loss: HF's own, on gathered outputs")
    if r["head_inputs"]:
        lines += ["", "Forward inputs sliced to this rank's heads (one entry per head, built for all heads):"]
        for name, count, h in _grouped(r["head_inputs"], "fqn", ("argument", "dim", "dense_heads")):
            lines.append(f"  {name}: argument {h['argument']!r}, dim {h['dim']}: {h['dense_heads']} -> "
                         f"{h['per_rank']} heads" + (f"  (x{count})" if count > 1 else ""))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    """Register ``tpify plan`` on the ``tpify`` parser's subparsers (runs in-process, no torchrun)."""
    plan = sub.add_parser("plan", help="report what a recipe does to a model at --tp (meta device, no ranks)",
                          description="What a recipe does to a model at --tp, without running it: per module the "
                                      "rule, style and per-rank shapes; parameter memory per rank; what is divided, "
                                      "unused and replicated; the LM head and loss. Built on the meta device: no "
                                      "process group, no weights.")
    plan.add_argument("target", metavar="MODEL_TYPE_OR_DIR",
                      help="a model_type (its default config) or a local directory with a config.json")
    from .checks import POSITIVE_INT, flag

    plan.add_argument("--tp", type=flag(POSITIVE_INT), required=True, help="tensor-parallel size to plan for")
    plan.add_argument("--recipe", default=None, help="recipe: a .toml file or a shipped recipe's model_type (default: the config's model_type)")
    plan.add_argument("--head-class", default=None,
                      help="head class name or task (causal-lm, masked-lm, base, ...; default: the masked LM, "
                           "else the causal LM, else the seq2seq LM, else the base model)")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    plan.set_defaults(worker=run, in_process=True)


def run(args) -> int:
    """``tpify plan``: print the report; a recipe that does not fit prints the error and returns 1."""
    from tpify.layout import PlanError
    from tpify.recipe import RecipeError

    from .target import TargetError

    try:
        report = plan_report(args.target, args.tp, args.recipe, args.head_class)
    except (PlanError, RecipeError, TargetError, PlanReportError) as e:
        print(f"tpify plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1) if args.json else render_text(report), end="" if not args.json else "\n")
    return 0
