"""transformers' own tensor-parallel plans, imported as tpify recipes.

transformers declares a plan for 140+ model types: ``config.base_model_tp_plan`` (module globs
relative to the base model -> a style name), the head classes' ``_tp_plan``, merged on an instance
as ``model.tp_plan`` (styles registered in ``transformers/distributed/tensor_parallel.py``).
:func:`import_hf_plan` maps each entry through :data:`HF_STYLES` to the tpify style of the same
meaning, which makes the rule (:meth:`tpify.styles.Style.from_hf`: the kind it splits, a layer
whose class overrides ``forward`` kept whole, its own keys); HF styles tpify cannot express are
refused by name (:data:`~tpify.hf_plan.refused.UNSUPPORTED`), and so are the families whose plan is
not the dense model (:data:`~tpify.hf_plan.refused.REFUSED_FAMILIES`). Then each style completes
what its entries imply (:meth:`~tpify.styles.Style.complete_hf`: the experts rules, the routers,
norms per head, ...) and :mod:`~tpify.hf_plan.leftovers` what the plan leaves out (tied heads,
layers and bare parameters kept whole, head counts, per-rank attributes, the loss). Pure: module
types, shapes, the config and forward source code; no collective, no tensor values (meta models
work). docs/recipes.md, "Families without a shipped recipe", lists every case with its reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from ..hf_modules import base_model_and_prefix, relative_name
from ..recipe import Recipe, RecipeError, logit_ops_of, loss_terms_of
from ..styles import STYLES
from . import leftovers
from .leftovers import TASK_HEADS, forward_reads
from .refused import REFUSED_FAMILIES, UNSUPPORTED
from .state import HEAD_COUNT_ATTRS, MOE_HINT, HFImport, head_counts, hf_error, wildcard

__all__ = ["hf_tp_plan", "has_hf_plan", "import_hf_plan", "recipe_from_hf_plan", "ImportedPlan", "HF_STYLES",
           "recipe_for_unshipped", "HEAD_COUNT_ATTRS", "TASK_HEADS", "wildcard", "head_counts", "forward_reads"]

#: transformers' style name -> the tpify style that stands for it. The order is the order in which
#: the styles take a parameter entry (:meth:`~tpify.styles.Style.hf_param`) and complete the
#: import (:meth:`~tpify.styles.Style.complete_hf`).
HF_STYLES = {
    "replicate": STYLES["replicate"],
    "rowwise_split_input": STYLES["replicate"],  # a whole input, each rank's slice summed: the dense result
    "rowwise_rep": STYLES["replicate"],
    "replicated_with_grad_allreduce": STYLES["replicate_sum_grads"],
    "mla_kv_a_proj": STYLES["latent"],
    "colwise": STYLES["colwise"],
    "rowwise": STYLES["rowwise"],
    "packed_colwise": STYLES["packed_colwise"],
    "colwise_gather_output": STYLES["colwise_rep"],
    "colwise_rep": STYLES["colwise_rep"],
    "embedding_rowwise": STYLES["embedding_rowwise"],
    "moe_tp_experts": STYLES["experts"],
    "all_reduce": STYLES["experts"],  # on a module whose 3-D parameters the plan splits (shared experts)
    "moe_identity_expert": STYLES["experts"],
    "local_params": STYLES["per_head"],
}


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
    return {relative_name(key, prefix)[0]: style for key, style in dict(plan).items()}


def has_hf_plan(model: nn.Module) -> bool:
    """True when transformers defines a tensor-parallel plan for ``model``'s family
    (``config.base_model_tp_plan`` or the model's merged ``tp_plan``)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "base_model_tp_plan", None)) or bool(hf_tp_plan(model))


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


def import_hf_plan(model: nn.Module) -> ImportedPlan:
    """Map ``model``'s transformers TP plan to a tpify recipe mapping, with a note per rule.

    Pure: reads module types, shapes, the config and forward source code; no collective, no
    tensor values (works on the meta device). Steps: the plan (:func:`_plan_of`), each entry
    (:func:`_read_entry`), the styles' completions, what the plan leaves out
    (:mod:`~tpify.hf_plan.leftovers`), the recipe mapping (:func:`_recipe_data`).

    Raises:
        RecipeError: the model has no HF plan, or its family's plan is not exact; a style tpify
            cannot express matches a module (the message names the style, the rule and the
            module); a style on a module of the wrong type; a parameter-level rule; a per-head
            parameter in a head-split attention module.
    """
    plan = _plan_of(model)
    imp = HFImport(model, plan, HF_STYLES)
    for key, hf_style in plan.items():
        _read_entry(imp, key, hf_style)
    for style in dict.fromkeys(HF_STYLES.values()):  # the experts rules, per-head rules, latents, ...
        style.complete_hf(imp)
    leftovers.tie_heads(imp)
    leftovers.check_per_head_params(imp)
    leftovers.fill(imp)
    leftovers.bare_parameters(imp)
    divisible, divide_config = leftovers.head_count_rules(imp)
    data = _recipe_data(imp, divisible, divide_config)
    if imp.dropped:
        imp.review.append(f"HF rules that match nothing in {type(model).__name__} were left out: {imp.dropped}")
    if imp.by_construction:
        imp.review.append(f"HF replicated_with_grad_allreduce on {imp.by_construction}: no rule needed (a replicated "
                          f"module inside a sharded region; tpify all-reduces its gradient by construction)")
    source = (f"transformers' tp_plan of {type(model).__name__} (model_type {data['model_type']!r}), imported by "
              f"tpify.hf_plan")
    return ImportedPlan(data, [n for _, n in imp.rules], imp.review, dict(plan), source)


def _plan_of(model: nn.Module) -> dict[str, str]:
    """The model's HF plan, unless it has none or its family's plan is refused by name.

    Raises:
        RecipeError: no plan; a family of :data:`~tpify.hf_plan.refused.REFUSED_FAMILIES`.
    """
    plan = hf_tp_plan(model)
    if not plan:
        raise hf_error(model, "transformers defines no tensor-parallel plan for it (config.base_model_tp_plan "
                              "is empty)")
    config = getattr(model, "config", None)
    refused = REFUSED_FAMILIES.get(getattr(config, "model_type", None))
    reason = refused(config) if refused is not None else None
    if reason:
        raise hf_error(model, f"HF's plan is not exact for this family: {reason}")
    return plan


def _read_entry(imp: HFImport, key: str, hf_style: str) -> None:
    """One entry of the plan: on modules, the style :data:`HF_STYLES` names makes the rule; on a
    parameter, the first style that takes it (:meth:`~tpify.styles.Style.hf_param`); matching
    nothing, it is left out (for review).

    Raises:
        RecipeError: an HF style tpify cannot express, or a parameter entry no style takes.
    """
    names = imp.by_key.get(key, [])
    if names:
        entry = imp.entry(key, hf_style, names)
        style = HF_STYLES.get(hf_style)
        if style is None:
            raise imp.error(f"{entry.where}: {UNSUPPORTED.get(hf_style, f'unknown HF style {hf_style!r}')}")
        style.from_hf(imp, entry)
        return
    if key not in imp.param_keys:
        imp.dropped.append(f"{key} = {hf_style}")
        return
    pname, shape = imp.param_keys[key]
    owner, _, leaf = key.rpartition(".")
    if any(style.hf_param(imp, owner, leaf, hf_style, shape) for style in dict.fromkeys(HF_STYLES.values())):
        return
    what = MOE_HINT if len(shape) == 3 else "tpify splits only whole nn.Linear / Conv1D / nn.Embedding modules"
    if imp.plan.get(owner) == "all_reduce":
        what = (f"HF splits the 3-D parameters of {owner} and sums its output ('all_reduce'), a module outside "
                f"transformers' experts interface (not 'moe_tp_experts'), whose forward tpify has not proved a sum "
                f"over the split dimension; keep it whole (replicate) or write an 'experts' rule in a recipe and "
                f"prove it with tpify verify")
    raise imp.error(f"HF rule {key!r} = {hf_style!r} applies to the parameter {pname} of shape {shape}, not to a "
                    f"module: {what}")


def _recipe_data(imp: HFImport, divisible: list[str], divide_config: list[str]) -> dict:
    """The recipe mapping: model type, description, head counts, the loss of a vocabulary-parallel
    head (HF's ``loss_type``, its aux-loss terms and logit ops), the rules."""
    model, config = imp.model, imp.config
    data: dict = {"model_type": getattr(config, "model_type", None) or type(model).__name__,
                  "description": f"imported from transformers' tensor-parallel plan of {type(model).__name__} "
                                 f"({len(imp.plan)} HF rules)",
                  "divisible": divisible}
    if divide_config:
        data["divide_config"] = divide_config
    loss = {"ForCausalLM": "causal", "ForMaskedLM": "masked"}.get(getattr(model, "loss_type", None) or "")
    if loss and any(style.lm_head for style in imp.styles.values()):
        data["loss"] = {loss: [type(model).__name__]}
        terms = loss_terms_of(config)
        if terms:
            data["loss"]["terms"] = terms
        ops = logit_ops_of(config)  # what HF does to the head's output before its loss (Cohere, Granite, Gemma 2)
        if ops:
            data["loss"]["logits"] = ops
    data["rule"] = [r for r, _ in imp.rules]
    return data


def recipe_from_hf_plan(model: nn.Module) -> Recipe:
    """transformers' tensor-parallel plan of ``model`` as a tpify :class:`~tpify.recipe.Recipe`.

    Pure (no collective; works on a meta model). The recipe's ``source`` says it was imported.

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
    from ..recipe import available_recipes

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
