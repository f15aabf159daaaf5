"""transformers' own tensor-parallel plans, imported as tpify recipes.

transformers declares, for 140+ model types, a tensor-parallel plan: ``config.base_model_tp_plan``
(module globs relative to the base model -> a style name, ``"layers.*.self_attn.q_proj":
"colwise"``), the head classes' ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``) and, added
by ``DistributedMixin.init_parallel_plans``, ``"embed_tokens": "embedding_rowwise"``. A model
instance holds the merged plan as ``model.tp_plan`` (names relative to the model itself). The
styles are registered in ``transformers/distributed/tensor_parallel.py`` (``ALL_PARALLEL_STYLES``).

:func:`recipe_from_hf_plan` maps that plan onto tpify's styles, pure (no collective, works on the
meta device), and completes it with what the HF plan does not say:

============================================  ===================================================
HF style                                      tpify
============================================  ===================================================
``colwise``                                   ``colwise`` (output sharded by heads / features)
``rowwise``                                   ``rowwise`` (input sharded, output all-reduced)
``embedding_rowwise``                         ``embedding_rowwise`` (``replicate`` when the
                                              embedding's class overrides ``forward``)
``colwise_gather_output``, ``colwise_rep``    on a head-class module (the LM head):
                                              ``colwise_rep``; inside the base model:
                                              ``replicate`` (see below)
``rowwise_split_input``, ``rowwise_rep``      ``replicate`` (see below)
``packed_colwise`` on an ``nn.Linear``        ``packed_colwise`` with ``parts = 2`` (HF's
                                              ``PackedColwiseParallel`` splits the output in
                                              ``split_factor = 2`` equal halves: ``[gate|up]``)
``replicate``                                 ``replicate``
``mla_kv_a_proj`` (multi-head latent          ``latent`` with ``shared = "qk_rope_head_dim"``
attention's ``kv_a_proj_with_mqa``)           (whole; the rotary key's gradient summed), and
                                              ``num_attention_heads`` in ``divisible``
``replicated_with_grad_allreduce``            no rule: a replicated norm inside a sharded region;
                                              tpify finds it by construction and all-reduces its
                                              gradient (``tpify.hooks.region_grads.ReplicatedInRegion``);
                                              next to ``mla_kv_a_proj``, a norm of the rotary key:
                                              ``replicate_sum_grads`` (:func:`_rotary_key_norms`)
``moe_tp_experts`` on a fused experts       one ``experts`` rule for the module (below); a
module, with ``packed_colwise`` /           module beside it holding bare parameters (the
``colwise`` / ``rowwise`` /                 router) ``replicate``
``packed_rowwise`` on its 3-D parameters
``all_reduce`` on a module of 3-D           the same ``experts`` rule (inkling's shared
parameters it splits colwise / rowwise      experts: a sum over the split intermediate dim)
``moe_identity_expert`` inside a            the experts rule's ``identity_from`` (the
``moe_tp_experts`` module                   zero-computation experts counted once)
anything else (``sequence_parallel``,         :class:`~tpify.recipe.RecipeError` naming the
``packed_rowwise`` on a layer,                style, the rule and the module
``all_reduce`` elsewhere, a parameter rule
outside ``moe_tp_experts``, ``local_params``
without a per-head parameter,
``embedding_colwise``, other parameter-level
rules)
============================================  ===================================================

What HF's plan leaves out or cannot express, kept whole by a rule with the reason in its note:
parameters of 2 or more dimensions outside any layer (:func:`_bare_parameters`: a convolution,
a position table, hyper-connections; experts with a post-expert norm), ``rowwise`` on a layer no
split layer feeds (:func:`_rowwise_without_split_input`), a ``colwise_gather_output`` ModuleList
of heads, a forward-overriding ``nn.Linear``. Norms of each head (a weight ``(heads, head_dim)``
normalising over ``head_dim``) become ``per_head`` (:func:`_per_head_norms`); ``q_a_proj`` beside a
latent KV projection and a column layer reading the hidden states becomes ``latent``
(:func:`_query_latents`).

Fused MoE experts (HF's ``moe_tp_experts``: each rank runs every expert on its slice of the
intermediate dimension, the module's output all-reduced, its input's gradient summed) become one
``experts`` rule per experts module (tpify.styles ``experts``, tpify.hooks.experts), its
``params`` the parameters HF's plan splits, each along its intermediate dimension: from
transformers' experts interface where the module has it (``is_transposed``: ``gate_up_proj
(E, 2I, H)`` and ``down_proj (E, H, I)`` split along dims 1 and 2, transposed ``(E, H, 2I)`` /
``(E, I, H)`` along 2 and 1; ``is_concatenated``: ``[gate | up]`` as ``parts = 2``, interleaved
pairs as one part), else from HF's style (``colwise``: the output features, ``rowwise``: the
input, ``packed_*``: 2 parts); ``gate_up_proj_bias`` / ``up_proj_bias`` split with their weight,
``down_proj_bias`` kept whole and counted once (``after_sum``). The ``experts`` style then checks
the split against the interface and refuses any parameter the rule leaves out. Shared experts
are the column / row rules HF's plan gives them; the router's aux loss is a ``[loss] terms``
entry (``loss_terms_of``). Zero-computation identity experts (``moe_identity_expert``,
longcat_flash) are the rule's ``identity_from``; HF's ``all_reduce`` on a module of 3-D parameters
(inkling_text's shared experts) an ``experts`` rule of its own.

A gathered column-parallel layer inside the base model (``colwise_gather_output``, e.g. olmo2's
``q_proj``/``k_proj``/``v_proj`` whose ``q_norm`` normalises over all heads, glm's packed
``gate_up_proj``) gives every rank the full activation, and its partner
``rowwise_split_input`` takes a full input; the pair computes the dense function. tpify has no
gathered column-parallel layer inside a block, so both become ``replicate``: the same result
(exact), without the memory saving. A recipe can do better for a packed layer
(``packed_colwise`` + ``rowwise``); ``tpify draft`` writes that suggestion as a comment.

Completed here (HF's plans say nothing of them):

* ``divisible``: the config's head counts (``num_attention_heads``, ``num_key_value_heads``)
  when a column-parallel layer's width is a head count times the head size;
* ``divide`` / ``divide_config``: integer attributes of the attention modules equal to a head
  count or a sharded width that their ``forward`` reads (``self.<attr>``), and head counts the
  forward reads from the config; in transformers 5 most attention modules view with ``-1`` heads
  and need none;
* ``[loss]``: the head class's causal / masked LM loss (from ``model.loss_type``);
* ``replicate`` for every ``nn.Linear``/``Conv1D``/``nn.Embedding`` the plan leaves out
  (position embeddings, task heads), and optional rules for the task heads of other head classes
  (``score``, ``qa_outputs``, ``classifier``), so that the layout covers the whole module tree;
* a tied LM head follows its embedding: ``colwise_rep`` with ``embedding_rowwise``, ``replicate``
  with ``replicate``.

Refused (:class:`~tpify.recipe.RecipeError`): a parameter of a head-split attention module or
of its parts that holds values for all heads and that the plan does not split (a ``(num_heads,)``
gate; a norm over the full projection width, ESM C's ``q_norm``, named as such): HF's plan would
leave it whole, which is not the dense model. And, by name (``_REFUSED_FAMILIES``), the families
whose plan verify found not exact: gemma3n_text (activation sparsity over the split MLP width;
tpify ships a recipe), doge (dt_proj mixes every KV head's values into each head's mask),
neomme (a per-head parameter and value embeddings left whole; tpify ships a recipe),
embedding_gemma2_text (a single KV head on some layers, split).

HF's ``local_params`` on a module with a ``colwise`` rule on its one-dimensional parameter of a
head count (attention sinks, ``(num_attention_heads,)``) becomes a ``per_head`` rule splitting
that parameter with the heads.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from .hf_modules import base_model_and_prefix, dense_dims, head_dims, module_kind, overrides_forward, relative_name
from .recipe import Recipe, RecipeError, _compile_glob, logit_ops_of, loss_terms_of

__all__ = ["hf_tp_plan", "has_hf_plan", "import_hf_plan", "recipe_from_hf_plan", "ImportedPlan",
           "recipe_for_unshipped", "HEAD_COUNT_ATTRS", "TASK_HEADS", "wildcard", "head_counts", "forward_reads"]

# Config attributes holding head counts, in the order they are reported (transformers maps
# family-specific names such as n_head onto them through the config's attribute_map).
HEAD_COUNT_ATTRS = ("num_attention_heads", "num_key_value_heads")
# Small task heads of the head classes, kept whole (optional: a head class may lack them).
TASK_HEADS = ("score", "qa_outputs", "classifier")

# What the import says of fused MoE experts it cannot translate: a recipe rule with style 'experts' can.
_MOE = ("tpify imports fused MoE experts only as HF's moe_tp_experts module with rules on its own 3-D "
        "parameters: write a recipe rule with style 'experts' (docs/recipes.md, as the shipped mixtral, qwen2_moe, "
        "qwen3_moe and olmoe recipes do)")
_IDENTITY = ("zero-computation experts (an identity expert inside the experts module, longcat_flash) give every "
             "rank the whole input inside the experts' partial sum, which HF pre-divides by tp_size; tpify has no "
             "such style. Keep the MoE block whole (replicate its experts) in a recipe")
# HF styles on a fused experts parameter -> (tpify dim counted from the end, packed): colwise splits the
# output features (dim -2 of a 3-D weight (E, out, in), dim -1 of a bias (E, out)), rowwise the input.
_EXPERT_PARAM_STYLES = {"colwise": False, "packed_colwise": True, "rowwise": False, "packed_rowwise": True}

# HF styles tpify cannot express, and why (the message of the RecipeError).
_UNSUPPORTED = {
    "sequence_parallel": "sequence parallelism (activations split along tokens) is not implemented in tpify",
    "moe_identity_expert": _IDENTITY,
    "packed_rowwise": "a row-parallel layer over packed input parts has no tpify style",
    "all_reduce": "an all-reduce of a module's partial output (shared MoE experts) has no tpify style",
    "local_params": "a module run with local shards of bare parameters (attention sinks) has no tpify style",
    "embedding_colwise": ("HF's embedding_colwise gathers the hidden dimension after the lookup; tpify's "
                          "embedding_colwise keeps the columns (heads) sharded, a different computation"),
}


# Families whose imported plan would not compute the dense model, found by verifying every
# family transformers can split (benchmarks/sweep_verify.py, docs/families.md): model_type ->
# (config -> the reason, or None where this config is not affected). Refused before anything
# else is read, with the fix.
_REFUSED_FAMILIES = {
    "gemma3n_text": lambda config: (
        "its MLPs with activation sparsity (activation_sparsity_pattern > 0: Gemma3nTextMLP._gaussian_topk) take "
        "the mean and standard deviation of gate_proj's output over the full intermediate width, which HF's plan "
        "splits (colwise gate_proj): each rank would keep a different top of its own half. tpify ships a recipe "
        "that keeps the MLPs whole (recipes/gemma3n_text.toml): parallelize(model) uses it"
        if any(v for v in (getattr(config, "activation_sparsity_pattern", None) or []) if v) else None),
    "doge": lambda config: (
        "its attention mixes the heads outside the split projections: dt_proj reads the values of ALL KV heads "
        "(input num_key_value_heads * head_dim) to give one value per KV head, which scales the per-KV-head "
        "parameter DogeAttention.A (num_key_value_heads,) into a dynamic mask repeated over each KV head's query "
        "heads; split by heads, a rank would need every rank's values (HF's plan, rowwise dt_proj, gives every "
        "rank all KV heads' mask against its own query heads: a shape error). Keep the attention whole in a "
        "recipe ([[rule]] match = \"layers.*.self_attn\", style = \"replicate\": q_proj, k_proj, v_proj, dt_proj, "
        "o_proj and A), the rest split as HF's plan does (tpify draft doge starts one); then prove it with tpify "
        "verify"),
    "neomme": lambda config: (
        "its exclusive self-attention holds a parameter per head outside any linear layer "
        "(NeoMMEExclusiveSelfAttention.alpha, shape (num_attention_heads,)) and its value embeddings "
        "(model.value_embeddings, num_key_value_heads * head_dim columns) are added to the split value states, "
        "while HF's plan splits the heads and leaves both whole. tpify ships a recipe that splits them with the "
        "heads (recipes/neomme.toml): parallelize(model) uses it"),
    "embedding_gemma2_text": lambda config: _single_kv_head_layers(config),
}


def _single_kv_head_layers(config) -> str | None:
    """Why embedding_gemma2_text's plan is refused (its layers of one KV head), with the recipe to write."""
    single = [i for i, c in enumerate(_layer_configs(config)) if getattr(c, "num_key_value_heads", None) == 1]
    if not single:
        return None
    shown = ", ".join(f'"layers.{i}.self_attn"' for i in single[:4]) + (", ..." if len(single) > 4 else "")
    return (f"its per_layer_config gives layers {single} a single KV head (num_key_value_heads = 1: its "
            f"full-attention layers), which HF's plan splits over the ranks (colwise k_proj, v_proj matched by "
            f"layers.*) although one head cannot be split. Write a recipe (tpify draft {config.model_type} starts "
            f"one) whose attention rules list the other layers by index, and keep these layers' attention whole "
            f"([[rule]] match = [{shown}], style = \"replicate\"), the MLPs split as HF's plan does; then prove it "
            f"with tpify verify")


def _layer_configs(config) -> list:
    """The per-layer configs of a heterogeneous config (``config.per_layer_config``), else none."""
    try:
        layers = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
        return list(layers) if layers is not None else []
    except Exception:  # noqa: BLE001 - a config that cannot enumerate its layers: nothing to check
        return []


def wildcard(name: str) -> str:
    """Layer numbers -> ``*``, as transformers' ``replace_layer_number_by_wildcard``:
    ``layers.3.mlp.up_proj`` -> ``layers.*.mlp.up_proj`` (only all-digit dotted segments)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """transformers' merged tensor-parallel plan of ``model``, names relative to its base model.

    Reads the instance's ``model.tp_plan`` (``DistributedMixin.init_parallel_plans`` merges the
    class's ``_tp_plan``, ``config.base_model_tp_plan`` and the base model's implicit
    ``embed_tokens`` rule), else the class and config plans. Keys of the base model lose its
    prefix (``model.layers.*.mlp.up_proj`` -> ``layers.*.mlp.up_proj``); head-class keys
    (``lm_head``) stay. Empty when the family defines no plan.
    """
    _, prefix = base_model_and_prefix(model)
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        config = getattr(model, "config", None)
        plan = dict(getattr(type(model), "_tp_plan", None) or {})
        base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        if base_plan and isinstance(getattr(base_model_and_prefix(model)[0], "embed_tokens", None), nn.Embedding):
            base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
        plan.update({(f"{prefix}.{k}" if prefix else k): v for k, v in base_plan.items()})
    out = {}
    for key, style in dict(plan).items():
        out[relative_name(key, prefix)[0]] = style
    return out


def has_hf_plan(model: nn.Module) -> bool:
    """True when transformers defines a tensor-parallel plan for ``model``'s family
    (``config.base_model_tp_plan`` or the model's merged ``tp_plan``)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "base_model_tp_plan", None)) or bool(hf_tp_plan(model))


def _out_features(module: nn.Module) -> int | None:
    return getattr(module, "out_features", None) or getattr(module, "nf", None)


def _config_int(config, name: str) -> int | None:
    """``config.<name>`` when it is a positive integer, else None (some configs raise on access)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - per-layer configs raise on global access (gemma4's head_dim)
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _head_dim(config) -> int | None:
    hd = _config_int(config, "head_dim")
    if hd:
        return hd
    hidden, heads = _config_int(config, "hidden_size"), _config_int(config, "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads == 0:
        return hidden // heads
    return None


def head_counts(config) -> dict[str, int]:
    """``{config attribute: value}`` of the head counts the config defines (integers only)."""
    out = {}
    for name in HEAD_COUNT_ATTRS:
        value = _config_int(config, name)
        if value:
            out[name] = value
    return out


@dataclass
class ImportedPlan:
    """A recipe imported from an HF plan, as a recipe mapping plus the reasons behind each rule.

    Attributes:
        data: the recipe as the mapping ``Recipe.from_dict`` takes (what a TOML file parses to).
        notes: one line per rule of ``data["rule"]``: what it is based on.
        review: lines for the recipe author (what the import could not check).
        hf_rules: the HF plan entries that were read (``{name: style}``).
        source: the recipe's ``source`` string (says it was imported).
    """

    data: dict
    notes: list[str]
    review: list[str] = field(default_factory=list)
    hf_rules: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def recipe(self) -> Recipe:
        """The :class:`~tpify.recipe.Recipe` (validated by ``Recipe.from_dict``)."""
        return Recipe.from_dict(self.data, self.source)


def _error(model: nn.Module, msg: str) -> RecipeError:
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    return RecipeError(f"cannot import transformers' tensor-parallel plan of {type(model).__name__} "
                       f"(model_type {model_type!r}): {msg}. Write a tpify recipe for it (docs/recipes.md; "
                       f"`tpify draft {model_type}` writes a draft to start from) and pass it as recipe='file.toml'")


def import_hf_plan(model: nn.Module) -> ImportedPlan:
    """Map ``model``'s transformers TP plan to a tpify recipe mapping, with a note per rule.

    Pure: reads module types, shapes, the config and forward source code; no collective, no
    tensor values (works on the meta device). See the module docstring for the style table.

    Raises:
        RecipeError: the model has no HF plan; a style tpify cannot express matches a module
            (sequence parallel, identity experts, ``local_params``, ...; the message names the style,
            the rule and the module); a style on a module of the wrong type; a parameter-level
            rule; a per-head parameter in a head-split attention module.
    """
    plan = hf_tp_plan(model)
    if not plan:
        raise _error(model, "transformers defines no tensor-parallel plan for it (config.base_model_tp_plan "
                            "is empty)")
    config = getattr(model, "config", None)
    refused = _REFUSED_FAMILIES.get(getattr(config, "model_type", None))
    reason = refused(config) if refused is not None else None
    if reason:
        raise _error(model, f"HF's plan is not exact for this family: {reason}")
    base, prefix = base_model_and_prefix(model)
    modules: dict[str, nn.Module] = {}
    inside: dict[str, bool] = {}
    for fqn, module in model.named_modules():
        if not fqn and base is not model:
            continue
        rel, in_base = relative_name(fqn, prefix)
        modules[rel] = module
        inside[rel] = in_base
    by_key: dict[str, list[str]] = {}
    for rel in modules:
        by_key.setdefault(wildcard(rel), []).append(rel)
    param_keys: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rel, m in modules.items():
        for p, param in m.named_parameters(recurse=False):
            param_keys.setdefault(wildcard(f"{rel}.{p}" if rel else p), (f"{rel}.{p}", tuple(param.shape)))

    styles: dict[str, str] = {}  # rel -> tpify style
    rules: list[tuple[dict, str]] = []
    review: list[str] = []
    dropped: list[str] = []
    by_construction: list[str] = []

    def add_rule(key: str, names: list[str], style: str, note: str, **extra):
        regex = _compile_glob(key)
        hits = [r for r in modules if regex.match(r)]
        match = key if sorted(hits) == sorted(names) else sorted(names)  # tpify '*' is any segment, HF's digits
        if not any(inside[n] for n in names):
            extra.setdefault("optional", True)  # a head-class module: other head classes lack it
        rule = {"match": match, "style": style, **extra}
        rules.append((rule, note))
        for n in names:
            styles[n] = style

    per_head: dict[str, list[str]] = {}  # owner key -> its parameters HF splits by heads (attention sinks)
    experts: dict[str, dict[str, str]] = {}  # moe_tp_experts module key -> {its parameter: HF style}
    identity: dict[str, str] = {}  # moe_tp_experts module key -> its moe_identity_expert rule (longcat_flash)
    heads = head_counts(config)
    for key, hf_style in plan.items():
        names = by_key.get(key, [])
        if hf_style == "all_reduce" and names and {module_kind(modules[n]) for n in names} == {None} and any(
                k.rpartition(".")[0] == key and k in param_keys and len(param_keys[k][1]) == 3 for k in plan):
            experts.setdefault(key, {})  # 3-D parameters split, output summed: as moe_tp_experts (inkling's shared)
            continue
        if hf_style == "moe_tp_experts" and names:
            if {module_kind(modules[n]) for n in names} != {None}:
                raise _error(model, f"HF rule {key!r} = 'moe_tp_experts' (module {names[0]}, a "
                                    f"{type(modules[names[0]]).__name__}): it applies to a module holding fused 3-D "
                                    f"expert parameters, not to a layer")
            experts.setdefault(key, {})
            continue
        if not names:
            if key in param_keys:
                if hf_style in ("replicate", "replicated_with_grad_allreduce"):
                    continue
                pname, shape = param_keys[key]
                owner, _, leaf = key.rpartition(".")
                if (plan.get(owner) == "moe_tp_experts" and len(shape) in (2, 3) or plan.get(owner) == "all_reduce"
                        and len(shape) == 3) and hf_style in _EXPERT_PARAM_STYLES:
                    experts.setdefault(owner, {})[leaf] = hf_style  # one 'experts' rule per module, below
                    continue
                if hf_style == "colwise" and len(shape) == 1 and shape[0] in heads.values() and owner in by_key:
                    per_head.setdefault(owner, []).append(leaf)  # one value per head: split with the heads
                    continue
                what = (_MOE if len(shape) == 3
                        else "tpify splits only whole nn.Linear / Conv1D / nn.Embedding modules")
                if plan.get(owner) == "all_reduce":
                    what = (f"HF splits the 3-D parameters of {owner} and sums its output ('all_reduce'), a module "
                            f"outside transformers' experts interface (not 'moe_tp_experts'), whose forward tpify "
                            f"has not proved a sum over the split dimension; keep it whole (replicate) or write an "
                            f"'experts' rule in a recipe and prove it with tpify verify")
                raise _error(model, f"HF rule {key!r} = {hf_style!r} applies to the parameter {pname} of shape "
                                    f"{shape}, not to a module: {what}")
            dropped.append(f"{key} = {hf_style}")
            continue
        kinds = {module_kind(modules[n]) for n in names}
        first = names[0]
        where = f"HF rule {key!r} = {hf_style!r} (module {first}, a {type(modules[first]).__name__})"
        if hf_style == "local_params" and any(k.rpartition(".")[0] == key and v == "colwise" and k in param_keys
                                              for k, v in plan.items()):
            continue  # HF runs the module with its split parameters as local tensors: the per_head rule below
        if hf_style == "moe_identity_expert" and plan.get(key.rpartition(".")[0]) == "moe_tp_experts":
            identity[key.rpartition(".")[0]] = key  # counted once after the experts' sum: the experts rule below
            continue
        if hf_style in _UNSUPPORTED:
            raise _error(model, f"{where}: {_UNSUPPORTED[hf_style]}")
        if hf_style == "packed_colwise" and kinds != {"linear"}:
            raise _error(model, f"{where}: HF packs MoE expert weights here (fused 3-D parameters); {_MOE}")
        if hf_style == "replicated_with_grad_allreduce":
            if kinds == {None}:
                by_construction.append(key)
                continue
            add_rule(key, names, "replicate", f"HF {hf_style}: a full copy")
            continue
        if hf_style == "replicate":
            add_rule(key, names, "replicate", "HF replicate")
            continue
        if hf_style == "mla_kv_a_proj":  # HF's MlaKvAProjParallel: whole, the rope part's gradient all-reduced
            rope = getattr(config, "qk_rope_head_dim", None)
            if kinds != {"linear"} or not isinstance(rope, int) or isinstance(rope, bool):
                raise _error(model, f"{where}: mla_kv_a_proj applies to an nn.Linear whose last config."
                                    f"qk_rope_head_dim output features are the rotary key (here {rope!r})")
            add_rule(key, names, "latent", "HF mla_kv_a_proj: the KV latent and rotary key, whole on every rank; "
                                           "the rotary key's gradient summed over the ranks",
                     shared="qk_rope_head_dim")
            continue
        if hf_style == "embedding_rowwise":
            if kinds != {"embedding"}:
                raise _error(model, f"{where}: embedding_rowwise applies to an nn.Embedding")
            if any(overrides_forward(modules[n]) for n in names):
                add_rule(key, names, "replicate",
                         f"HF embedding_rowwise, but {type(modules[first]).__name__} overrides forward (a scaled "
                         f"embedding?): kept whole; review: declare it in [subclasses] to shard it")
                review.append(f"{key}: {type(modules[first]).__name__} overrides nn.Embedding.forward; replicated")
            else:
                add_rule(key, names, "embedding_rowwise", "HF embedding_rowwise: vocabulary rows split")
            continue
        if (hf_style in ("colwise_gather_output", "colwise_rep") and kinds == {None}
                and all(isinstance(modules[n], nn.ModuleList) and len(modules[n])
                        and all(module_kind(c) == "linear" for c in modules[n]) for n in names)):
            add_rule(key, names, "replicate",
                     f"HF {hf_style} on a ModuleList of heads (one Linear per code group, the forward picks one per "
                     f"call: lm_head[generation_steps]); HF gathers their logits, and tpify's vocabulary-parallel LM "
                     f"head is one layer per model: each kept whole (exact; HF's loss on the whole logits)")
            continue
        if kinds != {"linear"}:
            raise _error(model, f"{where}: the style applies to nn.Linear / Conv1D layers")
        if any(overrides_forward(modules[n]) for n in names) and hf_style in (
                "colwise", "rowwise", "packed_colwise", "colwise_gather_output", "colwise_rep"):
            add_rule(key, names, "replicate",
                     f"HF {hf_style}, but {type(modules[first]).__name__} overrides nn.Linear.forward (dory's LM head "
                     f"scales each logit by a parameter of its own): kept whole; review: declare it in [subclasses] "
                     f"if its forward is plain")
            review.append(f"{key}: {type(modules[first]).__name__} overrides nn.Linear.forward; replicated")
            continue
        if hf_style == "colwise":
            add_rule(key, names, "colwise", "HF colwise: output features split")
        elif hf_style == "rowwise":
            add_rule(key, names, "rowwise", "HF rowwise: input features split, output all-reduced")
        elif hf_style == "packed_colwise":
            add_rule(key, names, "packed_colwise", "HF packed_colwise (PackedColwiseParallel, split_factor 2): "
                                                   "two equal packed parts, each split", parts=2)
        elif hf_style in ("colwise_gather_output", "colwise_rep"):
            if not all(inside[n] for n in names):
                add_rule(key, names, "colwise_rep", f"HF {hf_style} on the head: vocabulary-parallel LM head, "
                                                    f"logits gathered")
            else:
                add_rule(key, names, "replicate",
                         f"HF {hf_style}: HF gathers this layer's output, so every rank computes the full "
                         f"activation; tpify's exact equivalent is a full copy (review: a packed layer could be "
                         f"packed_colwise, with its consumer rowwise)")
        elif hf_style in ("rowwise_split_input", "rowwise_rep"):
            add_rule(key, names, "replicate",
                     f"HF {hf_style}: input whole, each rank multiplies its slice and the results are summed, "
                     f"the dense result; tpify: a full copy (exact)")
        else:
            raise _error(model, f"{where}: unknown HF style {hf_style!r}")

    if by_construction and "latent" in styles.values():
        _rotary_key_norms(model, modules, by_key, by_construction, add_rule)
    _query_latents(modules, styles, add_rule)
    _rowwise_without_split_input(modules, styles, rules, add_rule)
    for key, hf_params in experts.items():
        params, note = _experts_params(model, modules, by_key[key], key, hf_params)
        extra = {"identity_from": _identity_from(model, modules, by_key[key], identity[key])} if key in identity else {}
        add_rule(key, by_key[key], "experts", note + (f"; zero-computation identity experts from index "
                                                      f"{extra['identity_from']} on, counted once after the sum"
                                                      if extra else ""), params=params, **extra)
    for key in experts:  # after every experts rule: shared experts beside routed ones are no router
        _replicate_routers(modules, styles, by_key[key], add_rule)
    norms: dict[str, list[str]] = {}
    _per_head_norms(model, modules, styles, norms)
    for owner, leaves in list(per_head.items()) + list(norms.items()):
        holders = [n for n in by_key[owner] if all(isinstance(getattr(modules[n], leaf, None), nn.Parameter)
                                                    for leaf in leaves)]
        note = (f"HF colwise on {leaves} (one value per head) with local_params: split with the heads"
                if owner in per_head else f"a norm of each head ({type(modules[holders[0]]).__name__}, {leaves} "
                                          f"(heads, head_dim), normalising over head_dim): split with the heads")
        kv = {}  # a norm of the KV heads (cohere's k_norm), fewer than the query heads: split by KV heads
        rows = {getattr(modules[holders[0]], leaf).shape[0] for leaf in leaves}
        if owner in norms and heads.get(_KV_HEADS) in rows and heads.get(_KV_HEADS) != heads.get("num_attention_heads"):
            kv = {"kv_heads": _KV_HEADS}
        add_rule(owner, holders, "per_head", note, params={leaf: {"dim": 0} for leaf in sorted(leaves)}, **kv)
    per_head = {**per_head, **norms}
    _tie_heads(model, modules, styles, rules, add_rule)
    _check_per_head_params(model, modules, styles, per_head)

    # Everything the plan leaves out stays whole; the task heads of other head classes too.
    covered = set(styles)
    fill: dict[str, tuple[list[str], bool]] = {}
    for rel, module in modules.items():
        if module_kind(module) is None or rel in covered:
            continue
        if any(rel.startswith(c + ".") for c, s in styles.items()
               if s == "replicate" and module_kind(modules[c]) is None):
            continue
        key = wildcard(rel)
        names, _ = fill.get(key, ([], True))
        fill[key] = (names + [rel], inside[rel])
    task_heads = [t for t in TASK_HEADS if t not in fill and t not in covered]
    for key, (names, in_base) in fill.items():
        head = key.split(".")[0] in TASK_HEADS or not in_base
        add_rule(key, names, "replicate", "not in HF's plan: a full copy" + (" (task head)" if head else ""),
                 **({"optional": True} if head else {}))
    if task_heads:
        rules.append(({"match": task_heads, "style": "replicate", "optional": True},
                      "task heads of other head classes: a full copy (optional)"))
    _bare_parameters(model, modules, styles, add_rule)

    # Head counts: a column-parallel layer as wide as a head count times the head size splits heads.
    hd = _head_dim(config)
    widths = {n * hd for n in heads.values()} if hd else set()
    attention = sorted({r.rpartition(".")[0] for r, s in styles.items()
                        if s in ("colwise", "packed_colwise") and inside[r] and _out_features(modules[r]) in widths})
    divisible = list(heads) if attention else []
    if "latent" in styles.values() and "num_attention_heads" in heads and "num_attention_heads" not in divisible:
        divisible.append("num_attention_heads")  # latent attention: its up projections are split by whole heads
    if attention and _kv_rules(modules, styles, rules, attention, heads, hd):
        divisible.remove(_KV_HEADS)  # tp_size divides the KV heads, or each is held by a group of ranks
    divides, divide_config = forward_reads(modules, attention, config, heads, widths)
    for rel, attrs in divides.items():
        rules.append(({"match": wildcard(rel), "divide": attrs},
                      f"{type(modules[rel]).__name__}.forward reads {attrs}: per-rank values"))
    _merge_divide_rules(rules)

    data: dict = {"model_type": getattr(config, "model_type", None) or type(model).__name__,
                  "description": f"imported from transformers' tensor-parallel plan of {type(model).__name__} "
                                 f"({len(plan)} HF rules)",
                  "divisible": divisible}
    if divide_config:
        data["divide_config"] = divide_config
    loss = {"ForCausalLM": "causal", "ForMaskedLM": "masked"}.get(getattr(model, "loss_type", None) or "")
    if loss and "colwise_rep" in styles.values():
        data["loss"] = {loss: [type(model).__name__]}
        terms = loss_terms_of(config)
        if terms:
            data["loss"]["terms"] = terms
        ops = logit_ops_of(config)  # what HF does to the head's output before its loss (Cohere, Granite, Gemma 2)
        if ops:
            data["loss"]["logits"] = ops
    data["rule"] = [r for r, _ in rules]
    if dropped:
        review.append(f"HF rules that match nothing in {type(model).__name__} were left out: {dropped}")
    if by_construction:
        review.append(f"HF replicated_with_grad_allreduce on {by_construction}: no rule needed (a replicated "
                      f"module inside a sharded region; tpify all-reduces its gradient by construction)")
    source = (f"transformers' tp_plan of {type(model).__name__} (model_type {data['model_type']!r}), imported by "
              f"tpify.hf_plan")
    return ImportedPlan(data, [n for _, n in rules], review, dict(plan), source)


def _experts_params(model, modules, names, key, hf_params) -> tuple[dict, str]:
    """The ``params`` of the ``experts`` rule for HF's ``moe_tp_experts`` module ``key`` whose own
    3-D parameters HF splits (``hf_params``: leaf -> HF style), and the rule's note.

    Each named parameter is split along its intermediate dimension: from transformers' experts
    interface flags where the module has them (``is_transposed``: ``gate_up_proj (E, 2I, H)`` along
    dim 1, or ``(E, H, 2I)`` along dim 2; ``is_concatenated``: ``[gate | up]`` in 2 parts, or
    interleaved pairs in one), else from HF's style (colwise: the output features, rowwise: the input;
    ``packed_*``: 2 parts). Biases HF's plan does not name: ``gate_up_proj_bias`` / ``up_proj_bias``
    split with their weight along dim 1, ``down_proj_bias`` kept whole and counted once
    (``after_sum``). Any other parameter is left out of the rule, which the ``experts`` style refuses
    by name (a parameter each rank would apply whole to a partial sum). Pure.

    Raises:
        RecipeError: HF's plan marks ``key`` moe_tp_experts but splits none of its parameters.
    """
    module = modules[names[0]]
    own = dict(module.named_parameters(recurse=False))
    hf_tp_plan_style = hf_tp_plan(model).get(key, "moe_tp_experts")
    if not hf_params:
        raise _error(model, f"HF rule {key!r} = 'moe_tp_experts' (module {names[0]}, a {type(module).__name__}) sums "
                            f"the experts' outputs over the ranks, but the plan splits none of its parameters "
                            f"{sorted(own)} (each rank would add a whole copy)")
    transposed = getattr(module, "is_transposed", None)
    concatenated = getattr(module, "is_concatenated", None)
    params: dict[str, dict] = {}
    for leaf, hf_style in hf_params.items():
        packed = _EXPERT_PARAM_STYLES[hf_style]
        ndim = own[leaf].dim() if leaf in own else 3
        column = hf_style.endswith("colwise")
        dim = (ndim - 2 if column else ndim - 1) if ndim == 3 else 1
        if isinstance(transposed, bool) and leaf in ("gate_up_proj", "up_proj", "down_proj") and ndim == 3:
            dim = {("down_proj", False): 2, ("down_proj", True): 1}.get((leaf, transposed), 2 if transposed else 1)
        parts = 2 if packed else 1
        if leaf == "gate_up_proj" and isinstance(concatenated, bool):
            parts = 2 if concatenated else 1
        params[leaf] = {"dim": dim, **({"parts": parts} if parts > 1 else {})}
    for leaf, weight in (("gate_up_proj_bias", "gate_up_proj"), ("up_proj_bias", "up_proj")):
        if leaf in own and leaf not in params and weight in params:
            params[leaf] = {"dim": 1, **({"parts": params[weight]["parts"]} if "parts" in params[weight] else {})}
    if "down_proj_bias" in own and "down_proj_bias" not in params:
        params["down_proj_bias"] = {"after_sum": True}
    note = (f"HF {hf_tp_plan_style} with {hf_params} ({type(module).__name__}, is_transposed = {transposed}, "
            f"is_concatenated = {concatenated}): every expert's intermediate dimension split, output all-reduced")
    return params, note


def _identity_from(model, modules, names, rule: str) -> str | int:
    """The ``identity_from`` of an experts module holding HF's ``moe_identity_expert`` (``rule``):
    the first expert index of its zero-computation experts, the number of routed experts. The config
    attribute ``n_routed_experts`` when it equals the experts' ``down_proj`` dim 0 (each routed expert
    has one), else that number.

    Raises:
        RecipeError: the module holds no 3-D ``down_proj`` to count its routed experts by.
    """
    down = getattr(modules[names[0]], "down_proj", None)
    if not isinstance(down, nn.Parameter) or down.dim() != 3:
        raise _error(model, f"HF rule {rule!r} = 'moe_identity_expert': {_IDENTITY}; tpify counts identity experts "
                            f"once after the sum from the routed experts' count, which needs a 3-D down_proj "
                            f"(one per routed expert) on {names[0]}")
    routed = _config_int(getattr(model, "config", None), "n_routed_experts")
    return "n_routed_experts" if routed == down.shape[0] else int(down.shape[0])


def _replicate_routers(modules, styles, names, add_rule):
    """A full copy of the modules beside an experts module that hold bare parameters and no rule (the
    router, ``MixtralTopKRouter`` ``weight (E, H)``): they read the replicated hidden states."""
    found: dict[str, list[str]] = {}
    for name in names:
        parent = name.rpartition(".")[0]
        for rel, module in modules.items():
            if (rel.rpartition(".")[0] == parent and rel != name and rel not in styles and module_kind(module) is None
                    and any(True for _ in module.parameters(recurse=False))):
                found.setdefault(wildcard(rel), []).append(rel)
    for key, rels in found.items():
        add_rule(key, rels, "replicate", "beside the experts (a router): a full copy")


def _rowwise_without_split_input(modules, styles, rules, add_rule) -> None:
    """HF's ``rowwise`` on a layer that no split layer beside it feeds becomes ``replicate``.

    HF's ``RowwiseParallel`` takes a replicated input and shards it itself, so HF's plan may match
    a row layer whose module splits nothing: glm5_next's ``layers.*.self_attn.o_proj`` covers the
    latent-attention layers (fed by the column-parallel ``kv_b_proj``) and the linear-attention ones,
    whose ``q_proj``/``k_proj``/``v_proj`` the plan leaves whole. tpify's row layer reads an input
    that is already split (Megatron's ``input_is_parallel``): where the layers beside it in its
    module (above wrappers of that one layer) are all whole, its input is whole, and the exact
    equivalent is a full copy. The rule is
    narrowed to the layers with a split input, and a ``replicate`` rule takes the others. Pure."""
    columns = {"colwise", "packed_colwise"}

    def owner(rel: str) -> str:
        """The module a layer belongs to: its parent, above wrappers holding that one layer (gemma4's
        ``o_proj`` wrapping ``o_proj.linear``)."""
        parent = rel.rpartition(".")[0]
        while parent and sum(1 for c in modules[parent].children() if any(True for _ in c.parameters())) == 1:
            parent = parent.rpartition(".")[0]
        return parent

    def orphan(rel: str) -> bool:
        """Other layers beside it, none split: whole layers feed it (a layer alone in its module, BERT's
        ``attention.output.dense``, is fed from elsewhere and keeps HF's rowwise)."""
        inside = [o for o in modules if o.startswith(owner(rel) + ".") and o != rel and not rel.startswith(o + ".")
                  and module_kind(modules[o]) == "linear"]
        return bool(inside) and not any(styles.get(o) in columns for o in inside)

    orphans = [r for r, s in styles.items() if s == "rowwise" and "." in r and orphan(r)]
    if not orphans:
        return
    for entry in list(rules):
        rule, note = entry
        if rule.get("style") != "rowwise":
            continue
        match = rule["match"] if isinstance(rule["match"], list) else [rule["match"]]
        globs = [_compile_glob(p) for p in match]
        covered = [r for r, s in styles.items() if s == "rowwise" and any(g.match(r) for g in globs)]
        lost = [r for r in covered if r in orphans]
        if not lost:
            continue
        kept = [r for r in covered if r not in orphans]
        rules.remove(entry)
        if kept:
            add_rule(wildcard(kept[0]), kept, "rowwise", note,
                     **{k: v for k, v in rule.items() if k not in ("match", "style")})
        for name in lost:
            del styles[name]
        add_rule(wildcard(lost[0]), lost, "replicate",
                 "HF rowwise, but no column-split layer beside it feeds it (HF's row layer shards a whole input "
                 "itself; tpify's reads a split one): its input is whole, so a full copy (exact)")


def _query_latents(modules, styles, add_rule) -> None:
    """``latent`` (no shared features) for the query's down projection ``q_a_proj`` beside a latent
    KV projection, where HF's plan leaves it out and the attention holds a column-parallel layer
    reading the same hidden states (hy_v4's output gate ``gate_proj``, computed before the queries):
    that layer starts a sharded region, and ``q_a_proj`` with its norm, which read the replicated
    hidden states, would be taken for replicated modules inside it (their whole gradients summed
    again). The ``latent`` style ends the region before it, as the shipped recipes give it. Pure."""
    found: dict[str, list[str]] = {}
    for rel, style in styles.items():
        parent = rel.rpartition(".")[0]
        q_a = f"{parent}.q_a_proj" if parent else "q_a_proj"
        if style != "latent" or q_a not in modules or q_a in styles or module_kind(modules[q_a]) != "linear":
            continue
        reads = dense_dims(modules[q_a])[0]
        if any(s == "colwise" and r.rpartition(".")[0] == parent and dense_dims(modules[r])[0] == reads
               and r not in (f"{parent}.q_b_proj", f"{parent}.kv_b_proj") for r, s in styles.items()):
            found.setdefault(wildcard(q_a), []).append(q_a)
    for key, names in found.items():
        add_rule(key, names, "latent", "beside mla_kv_a_proj, not in HF's plan: the query latent, whole on every "
                                       "rank; it reads the replicated hidden states, so the sharded region that a "
                                       "column layer reading them too (a gate) may have started ends there")


def _rotary_key_norms(model, modules, by_key, by_construction: list[str], add_rule) -> None:
    """HF's ``replicated_with_grad_allreduce`` next to multi-head latent attention (``mla_kv_a_proj``).

    A norm of the rotary key (its weight ``(qk_rope_head_dim,)``: dots3's ``k_rope_only_layernorm``)
    runs between the ``latent`` projection, which ends the sharded region before it, and the heads,
    which each rank holds only some of: its gradient is partial on each rank, and tpify cannot find
    it by construction, so it becomes ``replicate_sum_grads`` (summed over the ranks, as HF's
    all-reduce does; its input's gradient is summed by the latent's ``shared`` features). A norm of
    a latent (``kv_lora_rank`` / ``q_lora_rank`` wide: ``kv_a_layernorm``) feeds a column-parallel up
    projection, which sums its gradient already, so HF's all-reduce would count it ``tp_size`` times:
    refused, as is a rotary-key width equal to a latent's (the two cannot be told apart). Any other
    module so marked (a norm inside the sharded region) stays found by construction. Pure."""
    config = getattr(model, "config", None)
    rope = _config_int(config, "qk_rope_head_dim")
    ranks = {v for v in (_config_int(config, "kv_lora_rank"), _config_int(config, "q_lora_rank")) if v}
    for key in list(by_construction):
        names = by_key.get(key, [])
        widths = {tuple(p.shape) for n in names for p in modules[n].parameters(recurse=False)}
        if rope and widths == {(rope,)} and rope not in ranks:
            by_construction.remove(key)
            add_rule(key, names, "replicate_sum_grads",
                     f"HF replicated_with_grad_allreduce next to mla_kv_a_proj: it normalises the rotary key "
                     f"(qk_rope_head_dim = {rope} wide), which the latent projection's region end leaves outside "
                     f"the sharded region while only this rank's heads read it: its gradient summed over the ranks")
        elif any(w[-1] in ranks for w in widths if w):
            raise _error(model, f"HF marks {key} replicated_with_grad_allreduce next to multi-head latent attention "
                                f"(mla_kv_a_proj), but its parameters {sorted(widths)} are as wide as a latent "
                                f"({sorted(ranks)}): a latent's norm feeds a column-parallel up projection, whose "
                                f"region entry sums its gradient already (summing it again would count it tp_size "
                                f"times), and a rotary-key norm as wide as a latent cannot be told from it. Give it "
                                f"style 'replicate_sum_grads' in a recipe only if only this rank's heads read its "
                                f"output, else 'replicate', and prove it with tpify verify")


def _head_split_attention(model, modules, styles) -> set[str]:
    """The attention modules whose projections the imported rules split by heads: the parents of
    the column-parallel layers as wide as a head count times the head size."""
    config = getattr(model, "config", None)
    hd = _head_dim(config)
    widths = {n * hd for n in head_counts(config).values()} if hd else set()
    return {r.rpartition(".")[0] for r, s in styles.items()
            if s in ("colwise", "packed_colwise") and _out_features(modules[r]) in widths}


def _bare_parameters(model, modules, styles, add_rule):
    """A ``replicate`` rule for each module holding parameters of 2 or more dimensions outside any
    layer (a convolution, a position table, a hyper-connection's mixing matrix, an attention of
    torch's own) that HF's plan does not name: HF keeps them whole on every rank, and so does the
    import, on purpose and with the reason in the rule's note (``tpify plan`` lists their bytes),
    where the planner would otherwise refuse them as uncovered (:func:`tpify.layout.coverage_threshold`).
    The module is replicated whole (a container) when no layer inside it is split, else only its own
    parameters are (``params``: llama4's vision tower holds its position table itself).

    Left to the planner's coverage check (refused there, by name, when large): fused experts
    (``*Experts``: the import splits the ones HF marks ``moe_tp_experts``; others it cannot tell
    apart from a forgotten rule), except experts whose every output passes a norm of its own
    (``has_post_expert_norm``: a split along the intermediate dimension would feed it a partial
    sum, so they stay whole, as HF's plan keeps them); and the parts of a head-split attention
    (:func:`_check_per_head_params` refuses what holds all heads; the rest reads whole inputs).
    One-dimensional parameters (norms, biases, per-head scalars) are left as they were."""
    attention = _head_split_attention(model, modules, styles)
    containers = [c for c, s in styles.items() if s == "replicate" and module_kind(modules[c]) is None]
    split = [r for r, s in styles.items() if s != "replicate"]
    found: dict[tuple, list[str]] = {}
    for rel, module in modules.items():
        if module_kind(module) is not None or rel in styles:
            continue
        if any(rel.startswith(c + ".") for c in containers):
            continue
        own = sorted(n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2)
        if not own or any(rel == a or rel.startswith(a + ".") for a in attention):
            continue
        cls = type(module).__name__
        if "Expert" in cls:
            if getattr(module, "has_post_expert_norm", False) is not True:
                continue
            note = (f"fused experts HF's plan leaves whole ({cls}, has_post_expert_norm): each expert's output passes "
                    f"its own norm, which a split along the intermediate dimension would feed a partial sum; a full "
                    f"copy on every rank, as in HF (no memory saved on the experts)")
        else:
            note = (f"{cls} holds {own}, parameters outside any layer that HF's plan does not name: HF keeps them "
                    f"whole on every rank; a full copy")
        inner = [r for r in split if r.startswith(rel + ".") or (not rel and r)]
        whole = tuple(own) if inner else ()  # split layers inside: only its own parameters stay whole
        found.setdefault((wildcard(rel), whole, note), []).append(rel)
    for (key, whole, note), names in found.items():
        add_rule(key, names, "replicate", note, **({"params": list(whole)} if whole else {}))


_KV_HEADS = "num_key_value_heads"
_KV_GROUPS = "num_key_value_groups"  # query heads per KV head, read by transformers' attention functions


def _kv_rules(modules, styles, rules, attention, heads, hd) -> bool:
    """Mark the K/V projections' rules with ``kv_heads`` (split by KV heads, or each KV head held by
    a group of ranks when tp_size is a multiple of them) and add a ``kv_groups`` rule for each
    attention module holding ``num_key_value_groups``; True when done. Not done (False) when the
    config has no fewer KV heads than heads, or a rule covering a K/V projection covers another
    layer too (then tp_size must divide the KV heads, as before)."""
    kv, n = heads.get(_KV_HEADS), heads.get("num_attention_heads")
    if not kv or kv == n:
        return False
    kv_layers = {r for r, s in styles.items()
                 if s == "colwise" and r.rpartition(".")[0] in attention and _out_features(modules[r]) == kv * hd}
    if not kv_layers:
        return False
    marked = []
    for rule, _ in rules:
        if rule.get("style") != "colwise":
            continue
        patterns = rule["match"] if isinstance(rule["match"], list) else [rule["match"]]
        globs = [_compile_glob(p) for p in patterns]
        covered = {r for r, s in styles.items() if s == "colwise" and any(g.match(r) for g in globs)}
        if covered & kv_layers:
            if not covered <= kv_layers:
                return False
            marked.append(rule)
    for rule in marked:
        rule["kv_heads"] = _KV_HEADS
    parents = sorted({wildcard(r.rpartition(".")[0]) for r in kv_layers
                      if isinstance(getattr(modules[r.rpartition(".")[0]], _KV_GROUPS, None), int)})
    for parent in parents:
        rules.append(({"match": parent, "kv_heads": _KV_HEADS, "kv_groups": [_KV_GROUPS]},
                      f"{_KV_GROUPS} (query heads per KV head) divided where each KV head is held by a group of "
                      f"ranks"))
    return True


def _tie_heads(model, modules, styles, rules, add_rule):
    """A head tied to an embedding gets the style that shards the tied weight alike: ``colwise_rep``
    with ``embedding_rowwise``, ``replicate`` with ``replicate`` (a rule for that head is replaced)."""
    weights: dict[int, list[str]] = {}
    for rel, module in modules.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            weights.setdefault(id(w), []).append(rel)
    for holders in weights.values():
        embeds = [h for h in holders if module_kind(modules[h]) == "embedding"]
        heads = [h for h in holders if module_kind(modules[h]) == "linear"]
        if not embeds or not heads:
            continue
        estyle = styles.get(embeds[0], "replicate")
        want = {"embedding_rowwise": "colwise_rep", "replicate": "replicate"}.get(estyle)
        for h in heads:
            if want is None or styles.get(h) == want:
                continue
            for entry in list(rules):
                match = entry[0]["match"]
                if h in (match if isinstance(match, list) else [match]) or (
                        isinstance(match, str) and _compile_glob(match).match(h)):
                    if match not in (h, [h], wildcard(h)):
                        raise RecipeError(f"cannot import the tensor-parallel plan of {type(model).__name__}: "
                                          f"{h} is tied to {embeds[0]} ({estyle}) and needs style {want!r}, but the "
                                          f"rule {match!r} also covers other modules")
                    rules.remove(entry)
            note = (f"tied to {embeds[0]} ({estyle}): " +
                    ("vocabulary-parallel LM head, logits gathered" if want == "colwise_rep" else "a full copy"))
            add_rule(wildcard(h), [h], want, note, optional=True)


def _normalises_last_dim(module: nn.Module) -> bool:
    """Whether a norm module normalises over its input's last dimension only (its ``forward``
    takes the mean over ``-1``: Cohere's ``CohereLayerNorm``), so that a weight ``(heads, head_dim)``
    scales each head's own normalised values; torch's ``nn.LayerNorm`` / ``nn.RMSNorm`` by their
    ``normalized_shape`` (one dimension)."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return isinstance(shape, tuple) and len(shape) == 1
    src = _forward_source(module)
    return bool(re.search(r"\.mean\(\s*(dim\s*=\s*)?-1\s*[,)]", src)) and not re.search(r"\.mean\(\s*(dim\s*=\s*)?\(", src)


def _attention_parts(modules, parents):
    """``(attention module, part name, part)`` for each module inside a head-split attention that
    is no layer (the attention itself included)."""
    for parent in sorted(parents):
        for rel, module in modules.items():
            if (rel == parent or rel.startswith(parent + ".")) and module_kind(module) is None:
                yield parent, rel, module


def _per_head_norms(model, modules, styles, per_head: dict) -> None:
    """Norms inside a head-split attention whose weight holds one row per head, ``(heads, head_dim)``,
    and that normalise each head over its ``head_dim`` only (Cohere's ``q_norm`` / ``k_norm`` with
    ``use_qk_norm``): the weight is split with the heads (added to ``per_head``: a ``per_head`` rule,
    dim 0), so each rank scales its own heads by their own rows; the statistics need nothing (each
    head's are its own). A norm over all heads at once (one weight as wide as every head: ESMC's
    ``q_norm``) cannot be split so: :func:`_check_per_head_params` refuses it."""
    config = getattr(model, "config", None)
    heads, hd = head_counts(config), _head_dim(config)
    if not heads or not hd:
        return
    for parent, rel, module in _attention_parts(modules, _head_split_attention(model, modules, styles)):
        own = dict(module.named_parameters(recurse=False))
        own_hd = getattr(modules.get(parent), "head_dim", None)
        width = own_hd if isinstance(own_hd, int) else hd
        rows = {p.shape[0] for p in own.values()}
        if (rel != parent and own and len(rows) == 1 and all(tuple(p.shape) in {(n, width) for n in heads.values()
                                                                              if n > 1} for p in own.values())
                and _normalises_last_dim(module)):
            leaves = per_head.setdefault(wildcard(rel), [])
            leaves.extend(n for n in sorted(own) if n not in leaves)


def _check_per_head_params(model, modules, styles, per_head=None):
    """Refuse a parameter holding all heads inside an attention module whose projections split heads
    (the module's own parameters and its parts', those a ``per_head`` rule splits excepted). A
    matrix whose last dimension is the hidden size (``(k, hidden)``: a projection of the whole
    hidden states written as a bare parameter, glm5_next's indexer gate) reads the replicated input,
    not the heads: that dimension is not counted as a projection's width."""
    config = getattr(model, "config", None)
    heads = head_counts(config)
    hd = _head_dim(config)
    if not heads or not hd:
        return
    split = {(n, leaf) for owner, leaves in (per_head or {}).items() for n in modules if wildcard(n) == owner
             for leaf in leaves}
    widths = {n * hd for n in heads.values()}
    hidden = _config_int(config, "hidden_size")
    for parent, rel, module in _attention_parts(modules, _head_split_attention(model, modules, styles)):
        # the attention module's own head dim (gemma4's full-attention layers: twice the config's)
        own = getattr(modules.get(parent), "head_dim", None)
        for pname, param in module.named_parameters(recurse=False):
            if (rel, pname) in split:
                continue
            shape = tuple(param.shape)
            if isinstance(own, int) and shape == (own,) and own not in heads.values():
                continue  # one value per dim of a head, shared by every head (a q_norm / k_norm)
            per_head = any(shape[i] in heads.values() and shape[i + 1] == hd for i in range(len(shape) - 1))
            # (head_dim,) is one head's width, not all heads', even when a count is 1 (one KV head):
            # q/k norms over head_dim are the same for every head and stay replicated
            per_head = per_head or bool(head_dims(shape, set(heads.values()), own if isinstance(own, int) else hd))
            read = shape[:-1] if len(shape) >= 2 and shape[-1] == hidden else shape  # (k, hidden): reads x
            if not (per_head or any(s in widths and s != hd for s in read)):
                continue
            what = (f"Split it with the heads (style 'per_head') or keep the attention whole (replicate its "
                    f"projections) in a recipe")
            if len(shape) == 1 and shape[0] in widths and hasattr(module, "normalized_shape") or (
                    len(shape) == 1 and shape[0] in widths and re.search(r"Norm", type(module).__name__)):
                what = (f"{type(module).__name__} normalises over the full projection width {shape[0]} (every "
                        f"head at once: its statistics mix all heads), so a rank holding some of the heads cannot "
                        f"compute it; unlike a norm per head (a weight (heads, head_dim) normalising each head), it "
                        f"cannot be split with the heads. Keep the attention whole in a recipe: replicate "
                        f"{parent.rpartition('.')[0] and wildcard(parent) or parent} (its projections and norms), "
                        f"and split the MLP colwise / rowwise")
            raise _error(model, f"{rel}.{pname} has shape {shape}: it holds values for all heads (or the full "
                                f"projection width), but HF's plan splits the heads of {parent}'s projections and "
                                f"does not split it (it would stay whole, which is not the dense model). {what}")


def _forward_source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


_DIVIDE_NAME = re.compile(r"(head|hidden_size|embed_dim|split_size|inner_dim)", re.I)
_NOT_DIVIDE_NAME = re.compile(r"(head_dim|head_size|group|per_head)", re.I)


def forward_reads(modules, attention, config, heads, widths):
    """Attributes of the attention modules (and config head counts) their forward reads that
    hold a head count or a sharded width: ``({module rel: [attrs]}, [config attrs])``.

    ``modules``: name relative to the base model -> module; ``attention``: the names to read;
    ``heads``: :func:`head_counts` of ``config``; ``widths``: sharded widths (head count x head size).
    """
    targets = set(heads.values()) | widths
    divides: dict[str, list[str]] = {}
    divide_config: list[str] = []
    for rel in attention:
        module = modules.get(rel)
        if module is None:
            continue
        src = _forward_source(module)
        used = set(re.findall(r"self\.(\w+)", src))
        attrs = sorted(a for a in used
                       if isinstance(getattr(module, a, None), int) and not isinstance(getattr(module, a), bool)
                       and getattr(module, a) in targets and _DIVIDE_NAME.search(a) and not _NOT_DIVIDE_NAME.search(a))
        if attrs:
            divides[rel] = attrs
        for name in set(re.findall(r"config\.(\w+)", src)):
            if name in heads and name not in divide_config:
                divide_config.append(name)
    return divides, sorted(divide_config)


def _merge_divide_rules(rules):
    """One divide rule per glob (layers share their class)."""
    seen: dict[str, dict] = {}
    for rule, note in list(rules):
        if "divide" in rule and "style" not in rule and isinstance(rule["match"], str):
            if rule["match"] in seen:
                rules.remove((rule, note))
            else:
                seen[rule["match"]] = rule


def recipe_from_hf_plan(model: nn.Module) -> Recipe:
    """transformers' tensor-parallel plan of ``model`` as a tpify :class:`~tpify.recipe.Recipe`.

    Pure (no collective; works on a meta model). The recipe's ``source`` says it was imported.
    The mapping of HF's styles, and what is added (head counts, per-rank attributes, the loss,
    ``replicate`` for everything else), are in this module's docstring.

    Raises:
        RecipeError: no HF plan, or a style / module tpify cannot express (the message names the
            style, the HF rule and the module).
    """
    return import_hf_plan(model).recipe()


def recipe_for_unshipped(model: nn.Module, model_type: str) -> Recipe:
    """The recipe :func:`tpify.parallelize` uses for a ``model_type`` without a shipped recipe:
    the imported HF plan, with a one-line notice (``warnings.warn``).

    Raises:
        RecipeError: transformers defines no plan for it either (the message lists the shipped
            recipes and says that ``tpify draft`` writes a draft), or the plan cannot be imported.
    """
    from .recipe import available_recipes

    if not has_hf_plan(model):
        raise RecipeError(
            f"no tpify recipe for model_type {model_type!r} and transformers defines no tensor-parallel plan for it "
            f"(config.base_model_tp_plan); shipped recipes: {available_recipes()}. Write one (docs/recipes.md) and "
            f"pass it as parallelize(model, recipe='path/to/file.toml'); `tpify draft {model_type} --out "
            f"{model_type}.toml` (or `tpify draft CHECKPOINT_DIR`) writes a draft from a trace of the model to "
            f"review.")
    recipe = recipe_from_hf_plan(model)
    warnings.warn(f"tpify: no shipped recipe for {model_type}; using transformers' base_model_tp_plan (imported, "
                  f"{len(recipe.rules)} rules)", stacklevel=4)
    return recipe
