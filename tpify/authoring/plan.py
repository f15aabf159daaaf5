"""``tpify plan``'s report: what a recipe does to a model, without running it (:func:`plan_report`).

The coverage report a recipe author reads: no process group, no weights. The model is built on
the meta device (accelerate's ``init_empty_weights``) from the target's config
(:func:`tpify.authoring.target.resolve_config`), the recipe is matched to it with
:func:`tpify.layout.build_layout`, and for every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding``
the report gives the rule that covers it, its style and each parameter's dense and per-rank
shape. Per-rank shapes come from the layout's specs, which the styles give each parameter
(:mod:`tpify.styles`) and the layers attach (Megatron-LM, arXiv:1909.08053, section 3), so the
arithmetic is the library's. Then: parameter memory per rank against the
dense model (replicated parameters counted in full on every rank, tied parameters once), the
attributes and config values divided per rank, the rules that took no part, what stays
replicated and why, the LM head and the loss kind.

:func:`plan_report` returns the report as JSON-able data; :func:`tpify.authoring.plan_text.render_text`
renders it as plain-text tables; ``tpify plan --json`` prints the data itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..api import resolve_recipe
from ..hf_modules import config_get, relative_fqn
from ..styles import STYLES
from ..layout import build_layout
from ..recipe import Rule, RuleIndex
from .target import HEAD_TASKS, family_head_classes, head_classes, resolve_config

__all__ = ["PlanReportError", "plan_report", "rank_shapes"]


class PlanReportError(ValueError):
    """The plan cannot be reported exactly: an unknown head class, a style or layout field this
    command does not know how to size (never guessed), tied parameters sized differently."""


def _dtype_of(config):
    """The parameter dtype the report counts bytes in: the config's floating dtype, else float32."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype, "the config's dtype"
    return torch.float32, "the config sets no dtype"


def _head_class(config, head_class: str | None):
    """The class to build: ``head_class`` as a task of ``HEAD_TASKS`` or a transformers class name;
    by default the family's masked LM, else its causal LM, else its seq2seq LM, else its base model,
    else (a part of a composite, a vision tower: ``Qwen2VisionTransformerPretrainedModel``) the
    first class :func:`~tpify.authoring.target.family_head_classes` builds from the config."""
    import transformers

    found = head_classes(config.model_type)
    if head_class is None:
        # An encoder family (bert, roberta) also defines a causal LM (BertLMHeadModel), but its
        # masked LM is the head it is pretrained with; decoder families have no masked LM.
        for task in ("masked-lm", "causal-lm", "seq2seq-lm", "base"):
            if task in found:
                return found[task]
        others = family_head_classes(config)
        if others:
            return next(iter(others.values()))
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
    """``cls`` built from ``config`` on the meta device, tied as ``from_pretrained`` leaves it.

    Parameters are made on the CPU and moved to meta as they are registered (buffers stay real:
    a scaled embedding's factor is read); a parameter too large to be allocated at all, even
    untouched (DeepSeek-V3's fused experts, 30 GB each in float32, where the system refuses
    the allocation), makes the model be built again with everything on meta."""
    from accelerate import init_empty_weights

    try:
        with init_empty_weights(include_buffers=False):
            model = cls._from_config(config, dtype=dtype)  # attention implementation picked as from_pretrained does
    except RuntimeError as e:
        if "allocate" not in str(e):
            raise
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    return model.eval()


def rank_shapes(module, entry, tp_size: int,
                tp_rank: int = 0) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """Per parameter of one layout entry: ``(dense shape, rank tp_rank's shape, sharded)``.

    ``module`` is the dense ``nn.Linear``, transformers ``Conv1D``, ``nn.Embedding`` or module
    whose parameters a style splits (fused experts), real or on meta; ``entry`` its
    :class:`tpify.styles.ModuleLayout`. The per-rank shape is
    ``ShardSpec.local_shape`` of the spec the style gives that parameter (the layout's
    ``entry.specs``, the spec the layer attaches; :meth:`tpify.styles.Style.param_specs` when the
    entry was made by hand): padding rows of a vocabulary included. Where the split is uneven
    (``entry.uneven``) the shape depends on the rank: rank 0 (the default) holds the most.

    Raises:
        PlanReportError: a style tpify does not know, a style on a module of the wrong kind, or a
            sharded module with parameters besides those the style splits, so that a new layout
            feature is never reported with a wrong number.
    """
    params = {name: p for name, p in module.named_parameters(recurse=False)}
    dense = {name: tuple(p.shape) for name, p in params.items()}
    if entry.style not in STYLES:
        raise PlanReportError(f"plan does not know style {entry.style!r} ({entry.fqn}, rule #{entry.rule}): "
                              f"tpify.styles has no such style; extend it before trusting a report")
    style = STYLES[entry.style]
    if not style.shards:
        return {name: (shape, shape, False) for name, shape in dense.items()}
    if not style.accepts(module):
        raise PlanReportError(f"{entry.fqn} is a {type(module).__name__}; plan does not know style {entry.style!r} "
                              f"on it")
    specs = entry.specs or style.param_specs(module, entry, tp_size)
    extra = sorted(set(params) - set(specs))
    if extra:
        raise PlanReportError(f"{entry.fqn} ({type(module).__name__}, style {entry.style!r}) holds parameters {extra} "
                              f"besides {sorted(specs)}; plan does not know how they are split")
    out = {}
    for name, shape in dense.items():
        spec = specs.get(name)
        out[name] = (shape, spec.local_shape(shape, tp_rank), True) if spec is not None else (shape, shape, False)
    return out


def _rule_dict(rule) -> dict:
    return {"index": rule.index, "match": list(rule.patterns), "style": rule.style, "divide": list(rule.divide),
            "optional": rule.optional, "when": dict(rule.when)}


def _matching_pattern(rule, rel: str) -> str | None:
    """The first glob of ``rule`` that matches ``rel`` (a name relative to the base model)."""
    return next((p for p in rule.patterns if Rule(rule.index, (p,)).matches(rel)), None)


def _match_origin(model, rule, fqn: str) -> tuple[str | None, str | None]:
    """``(glob, container)``: the glob of ``rule`` that covers module ``fqn``, and the replicated
    container it lies in when the glob matches that container rather than the module (None)."""
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


def _rule_source(model, layout, fqn: str) -> str:
    """Where module ``fqn``'s entry comes from, as the plan says it: ``from rule #i (match 'p')``,
    or ``inside container C, replicated by rule #i (match 'p')`` (the glob matched an enclosing
    module)."""
    rule = layout.recipe.rules[layout.modules[fqn].rule]
    pattern, container = _match_origin(model, rule, fqn)
    if container is not None:
        return f"inside container {container}, replicated by rule #{rule.index} (match {pattern!r})"
    return f"from rule #{rule.index} (match {pattern!r})"


def _rule_uses(model, layout) -> list[dict]:
    """Rules that took part in nothing: inactive (``when``), warned (``layout.unmatched_rules``)
    or optional and unmatched (a head this class lacks)."""
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



def plan_report(target: str, tp_size: int, recipe=None, head_class: str | None = None, ep_size: int = 1,
                quantize: str | None = None, lora_r: int = 8) -> dict:
    """The coverage report of ``recipe`` on ``target`` at ``tp_size``, as JSON-able data.

    Args:
        target: a ``model_type`` (its default config) or a local directory with a ``config.json``.
        tp_size: the tensor-parallel size to plan for.
        recipe: a recipe name, ``.toml`` path or mapping (default: ``config.model_type``'s).
        head_class: a task of :data:`tpify.authoring.target.HEAD_TASKS` or a transformers class
            name (default: the family's masked LM, else causal LM, else seq2seq LM, else base model).
        ep_size: 1, or ``tp_size`` for expert parallelism (:func:`tpify.parallelize`).
        quantize: ``"nf4"`` or ``"fp4"``: also size the QLoRA base (``"quantized"``, :func:`_quantized`),
            with LoRA adapters of rank ``lora_r`` on every quantized layer.

    Returns:
        ``{"target", "model_type", "head_class", "tp_size", "recipe", "dtype", "modules",
        "memory", "divides", "config_divides", "divisible", "unused_rules", "replicated",
        "lm_head", "loss_kind", "honours_num_items", "head_inputs"}`` (and ``"quantized"`` with
        ``quantize``); shapes are lists in the
        parameter's own layout (``nn.Linear`` ``[out, in]``, ``Conv1D`` ``[in, out]``), bytes in
        the report's dtype. No collective; nothing is downloaded or allocated.

    Raises:
        tpify.authoring.target.TargetError: the target is neither a model_type nor a config directory.
        tpify.recipe.RecipeError: no recipe, or a malformed one.
        tpify.layout.PlanError: the recipe does not fit the model at ``tp_size``; with ``quantize``, a
            split that cuts a quantization block (:func:`tpify.quantized.check_layout`).
        ValueError, NotImplementedError, ImportError: ``quantize`` is not nf4/fp4, or bitsandbytes
            is missing (:func:`tpify.quantized.quantization_spec`).
        PlanReportError: an unknown head class, or a layout this command cannot size exactly.
    """
    config = resolve_config(target)
    cls = _head_class(config, head_class)
    dtype, dtype_source = _dtype_of(config)
    model = _meta_model(config, cls, dtype)
    layout = build_layout(model, resolve_recipe(model, recipe), tp_size, ep_size=ep_size)  # shipped, given, or imported
    recipe_obj = layout.recipe
    params = _Params.of(model)
    module_rows = _module_rows(model, layout, tp_size, params)
    memory, replicated = _memory(model, layout, params)
    _tied(model, module_rows, params)
    head_inputs = getattr(layout, "head_inputs", None)  # module FQN -> ((argument, dim, dense heads), ...)
    quantized = {"quantized": _quantized(model, layout, params, memory, quantize, lora_r, dtype)} if quantize else {}
    return {
        "target": str(target), "model_type": config.model_type, "head_class": cls.__name__,
        "tp_size": tp_size, "ep_size": ep_size, "recipe": recipe_obj.source, "recipe_model_type": recipe_obj.model_type,
        "dtype": str(dtype).removeprefix("torch."), "dtype_source": dtype_source,
        "modules": module_rows,
        "memory": memory,
        **_divided(model, layout, config, tp_size),
        "unused_rules": _rule_uses(model, layout), "replicated": replicated,
        "lm_head": layout.lm_head, "loss_kind": layout.loss_kind, "honours_num_items": layout.honours_num_items,
        "head_inputs": [{"fqn": fqn, "argument": arg, "dim": dim, "dense_heads": heads, "per_rank": heads // tp_size}
                        for fqn, items in (head_inputs or {}).items() for arg, dim, heads in items],
        **quantized,
    }


def _quantized(model, layout, params: "_Params", memory: dict, quantize: str, lora_r: int, dtype) -> dict:
    """Rank 0's bytes of a QLoRA base (``tpify.parallelize(..., quantization_config=
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize))``, then LoRA of rank
    ``lora_r`` on every quantized layer): per quantized layer its shard's codes, absmax and code
    table (:func:`tpify.quantized.shard_bytes`, the sizes :func:`tpify.quantized.quantize_` stores);
    what stays in the report's dtype (every parameter but the quantized weights: norms,
    embeddings, the LM head, biases); the LoRA factors (``A`` replicated and ``B`` split on a
    column-parallel base, ``A`` split and ``B`` replicated on a row-parallel one, in the report's
    dtype) and the same figures for the dense (tp 1) quantized model.

    Raises:
        tpify.layout.PlanError: a split that cuts a quantization block, a style without a
            quantized form (:func:`tpify.quantized.check_layout`).
    """
    from transformers import BitsAndBytesConfig

    from ..hf_modules import dense_dims
    from ..quantized import check_layout, quantization_spec, shard_bytes

    qspec = quantization_spec(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantize))
    size = torch.empty((), dtype=dtype).element_size()
    layers, totals, dense_totals = [], dict.fromkeys(("codes", "absmax", "code_table"), 0), dict.fromkeys(
        ("codes", "absmax", "code_table"), 0)
    weights_rank = weights_dense = lora_rank = lora_dense = 0
    for fqn in check_layout(model, layout, qspec):
        module = model.get_submodule(fqn)
        in_f, out_f, _ = dense_dims(module)
        dense_shape, rank_shape, _, _ = params.shapes[id(module.weight)]
        n_rank, n_dense = math.prod(rank_shape), math.prod(dense_shape)
        rank, dense = shard_bytes(n_rank, qspec), shard_bytes(n_dense, qspec)
        for k in totals:
            totals[k] += rank[k]
            dense_totals[k] += dense[k]
        weights_rank += n_rank * size
        weights_dense += n_dense * size
        if layout.modules[fqn].style == "rowwise":  # A: (r, in / tp), B: (out, r)
            lora = lora_r * (n_rank // out_f) + out_f * lora_r
        else:  # A: (r, in), B: (out / tp, r)
            lora = lora_r * in_f + (n_rank // in_f) * lora_r
        lora_rank += lora * size
        lora_dense += lora_r * (in_f + out_f) * size
        layers.append({"fqn": fqn, "rank_shape": list(rank_shape), **rank, "bytes": sum(rank.values())})
    quantized_rank, quantized_dense = sum(totals.values()), sum(dense_totals.values())
    kept_rank, kept_dense = memory["rank_bytes"] - weights_rank, memory["dense_bytes"] - weights_dense
    return {"quant_type": qspec.quant_type, "blocksize": qspec.blocksize, "layers": layers,
            "rank": {**totals, "quantized_bytes": quantized_rank, "kept_bytes": kept_rank,
                     "base_bytes": quantized_rank + kept_rank, "lora_bytes": lora_rank},
            "dense": {**dense_totals, "quantized_bytes": quantized_dense, "kept_bytes": kept_dense,
                      "base_bytes": quantized_dense + kept_dense, "lora_bytes": lora_dense},
            "quantized_ratio": quantized_rank / quantized_dense if quantized_dense else 1.0,
            "lora_r": lora_r, "lora_dtype": str(dtype).removeprefix("torch.")}


@dataclass
class _Params:
    """Every parameter of the model once, by identity (tied ones have several holders).

    Attributes:
        holders: id -> ``(module FQN, parameter name)`` of every module holding it.
        unique: id -> the parameter.
        shapes: id -> ``(dense shape, per-rank shape, sharded, "fqn.pname" that decides it)``, for
            the parameters of shardable modules (filled by :func:`_module_rows`).
    """

    holders: dict[int, list[tuple[str, str]]]
    unique: dict[int, torch.nn.Parameter]
    shapes: dict[int, tuple] = field(default_factory=dict)

    @classmethod
    def of(cls, model) -> "_Params":
        holders: dict[int, list[tuple[str, str]]] = {}
        unique = {}
        for mname, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                holders.setdefault(id(param), []).append((mname, pname))
                unique[id(param)] = param
        return cls(holders, unique)

    def owner(self, pid: int) -> str:
        """The name a parameter is counted under: the shardable holder that sizes it, else the first."""
        if pid in self.shapes:
            return self.shapes[pid][3]
        m, p = self.holders[pid][0]
        return f"{m}.{p}" if m else p


def _module_rows(model, layout, tp_size: int, params: _Params) -> list[dict]:
    """One row per shardable module: rule, style, each parameter's dense and per-rank shape; fills
    ``params.shapes``.

    Raises:
        PlanReportError: a tied parameter sized differently by two of its holders.
    """
    module_rows = []
    for fqn, entry in layout.modules.items():
        module = model.get_submodule(fqn)
        per_param = rank_shapes(module, entry, tp_size)
        rule = layout.recipe.rules[entry.rule]
        origin = _match_origin(model, rule, fqn)
        style = entry.styler
        rows_dim = None if not style.vocab_rows else "num_embeddings" if style.kind == "embedding" else (
            "nf" if hasattr(module, "nf") else "out_features")
        row = {"fqn": fqn, "relative_fqn": relative_fqn(model, fqn), "type": type(module).__name__,
               "rule": entry.rule, "match": list(rule.patterns), "matched_by": origin[0], "container": origin[1],
               "style": entry.style, "partition_sizes": entry.partition_sizes, "padded_size": entry.padded_size,
               "vocab_size": getattr(module, rows_dim) if rows_dim else None,
               "replicated_parts": list(getattr(entry, "replicated_parts", None) or ()) or None,
               "replica_shards": getattr(entry, "replica_shards", 1),
               "output_scale": getattr(entry, "output_scale", None),
               "split_params": [{"name": n, "dim": 0 if entry.expert_parallel else d, "parts": 1 if entry.expert_parallel
                                 else p} for n, d, p in entry.params] or None,
               "expert_parallel": entry.expert_parallel, "uneven": entry.uneven, "note": style.explain(entry),
               "params": []}
        # an uneven split (torch.chunk's rule): each rank's shapes, listed where they differ
        every_rank = [rank_shapes(module, entry, tp_size, r) for r in range(tp_size)] if entry.uneven else None
        for pname, (dense_shape, rank_shape, sharded) in per_param.items():
            param = getattr(module, pname)
            seen = params.shapes.get(id(param))
            if seen is not None and seen[1] != rank_shape:
                raise PlanReportError(f"{fqn}.{pname} is tied to {seen[3]}, which is sized {list(seen[1])} per rank, "
                                      f"but style {entry.style!r} sizes it {list(rank_shape)}")
            if seen is None or (sharded and not seen[2]):
                params.shapes[id(param)] = (dense_shape, rank_shape, sharded, f"{fqn}.{pname}")
            shapes = [list(r[pname][1]) for r in every_rank] if every_rank else None
            row["params"].append({"name": pname, "dense_shape": list(dense_shape), "rank_shape": list(rank_shape),
                                  "sharded": sharded,
                                  "rank_shapes": shapes if shapes and any(s != shapes[0] for s in shapes) else None})
        module_rows.append(row)
    return module_rows


def _memory(model, layout, params: _Params) -> tuple[dict, list[dict]]:
    """``(memory, replicated)``: parameter bytes and counts, dense and per rank (every unique
    parameter once; replicated ones in full on every rank; rank 0's, which holds the most where a
    split is uneven), and one entry per replicated parameter with why it is whole."""
    dense_bytes = rank_bytes = sharded_dense = sharded_rank = 0
    dense_numel = rank_numel = 0
    replicated = []
    for pid, param in params.unique.items():
        size = param.element_size()
        dense_shape, rank_shape, sharded, _ = params.shapes.get(pid, (tuple(param.shape), tuple(param.shape), False,
                                                                      None))
        dn, rn = math.prod(dense_shape), math.prod(rank_shape)
        dense_numel += dn
        rank_numel += rn
        dense_bytes += dn * size
        rank_bytes += rn * size
        if sharded:
            sharded_dense += dn * size
            sharded_rank += rn * size
            continue
        name = params.owner(pid)
        mname, _, pname = name.rpartition(".")
        module = model.get_submodule(mname)
        replicated.append({"param": name, "module_type": type(module).__name__, "shape": list(dense_shape),
                           "bytes": dn * size, "reason": _whole_reason(model, layout, module, mname, pname, dn),
                           "tied_to": sorted(f"{m}.{p}" for m, p in params.holders[pid] if f"{m}.{p}" != name)})
    memory = {"dense_bytes": dense_bytes, "rank_bytes": rank_bytes,
              "ratio": rank_bytes / dense_bytes if dense_bytes else 1.0,
              "dense_params": dense_numel, "rank_params": rank_numel,
              "sharded_dense_bytes": sharded_dense, "sharded_rank_bytes": sharded_rank,
              "replicated_bytes": rank_bytes - sharded_rank}
    return memory, replicated


def _whole_reason(model, layout, module, mname: str, pname: str, numel: int = 0) -> str:
    """Why parameter ``pname`` of module ``mname`` is a full copy on every rank."""
    if mname not in layout.modules:
        container = _container_of(model, layout, mname)
        if container is not None:
            return container
        threshold = getattr(layout, "coverage_threshold", 0)
        below = (f"; below the coverage threshold of {threshold:,} elements, so no rule is needed"
                 if threshold and numel < threshold else "")
        return f"not a shardable layer ({type(module).__name__}): a full copy on every rank{below}"
    entry = layout.modules[mname]
    return entry.styler.explain(entry, pname, _rule_source(model, layout, mname))  # the style says why


def _container_of(model, layout, mname: str) -> str | None:
    """``"style replicate from rule #i (match ...)"`` when a rule keeping modules whole (``replicate``)
    matches module ``mname`` (a module no style splits: a router, a norm) or a module enclosing it;
    else None."""
    config = getattr(model, "config", None)
    rules = [r for r in layout.recipe.rules if r.style is not None and r.styler.copies_whole and r.applies(config)]
    base = getattr(model, "base_model", model)
    parts = mname.split(".") if mname else []
    for i in range(len(parts), -1, -1):
        holder = ".".join(parts[:i])
        if not holder and base is not model:
            continue  # the head class's root is never matched
        rel = relative_fqn(model, holder)
        for rule in rules:
            pattern = _matching_pattern(rule, rel)
            if pattern is not None:
                where = "" if holder == mname else f" (inside {holder or '<base model>'})"
                return f"style {rule.style} from rule #{rule.index} (match {pattern!r}){where}"
    return None


def _tied(model, module_rows: list[dict], params: _Params) -> None:
    """Tied parameters in the module rows: the other holders, and where the bytes are counted."""
    for row in module_rows:
        module = model.get_submodule(row["fqn"])
        for p in row["params"]:
            full, pid = f"{row['fqn']}.{p['name']}", id(getattr(module, p["name"]))
            p["tied_to"] = sorted(f"{m}.{q}" for m, q in params.holders[pid] if f"{m}.{q}" != full)
            p["counted_as"] = params.owner(pid)


def _divided(model, layout, config, tp_size: int) -> dict:
    """``divides`` (module attributes), ``config_divides`` (config values, written back dense on
    save) with their dense and per-rank values, and ``divisible`` (checked, not changed)."""
    divides = []
    for fqn, attrs in layout.divides.items():
        module = model.get_submodule(fqn)
        for attr in attrs:
            value = getattr(module, attr)
            divides.append({"fqn": fqn, "attr": attr, "dense": value, "per_rank": value // tp_size})
    config_divides = [{"name": n, "dense": v, "per_rank": v // tp_size} for n, v in layout.config_divides.items()]
    divisible = [{"name": n, "value": config_get(config, n)} for n in layout.recipe.divisible
                 if n not in layout.config_divides]
    return {"divides": divides, "config_divides": config_divides, "divisible": divisible}
