"""``[[include]]``: other recipes applied to sub-modules of a composite model, one flat recipe.

A vision-language model's recipe includes its language model's and its vision tower's recipes
(docs/recipes.md, "Composite models"): :func:`compose` prefixes their globs with the sub-module
and reads their config attributes from the sub-config (``text_config.num_attention_heads``).
"""

from __future__ import annotations

import dataclasses

from .hf_modules import base_model_and_prefix, config_get, config_has
from .recipe import Recipe, RecipeError, load_recipe
from .styles.base import config_reads, with_config_prefix

__all__ = ["compose"]


def compose(recipe: Recipe, model) -> Recipe:
    """``recipe`` with its ``[[include]]`` tables applied: one flat recipe for ``model``. Local.

    Each include applies another recipe to the sub-module at ``prefix``: its globs prefixed, the
    config attributes it reads turned into dotted paths into its sub-config, its ``[subclasses]``,
    renames and ``[sequence_parallel]`` table taken, its ``[loss]`` not. The recipe's own rules come
    first, then each include's. The rules: docs/recipes.md, "Composing recipes: [[include]]".

    Raises:
        RecipeError: a sub-config or sub-module the model lacks, no recipe for the part's
            model_type (named, with the shipped ones), a config attribute the included recipe reads
            that the sub-config lacks (each named, with its rule), two ``[sequence_parallel]``
            tables, or one ``[subclasses]`` entry given two ways.
    """
    if not recipe.includes:
        return recipe
    config = getattr(model, "config", None)
    base, _ = base_model_and_prefix(model)
    rules = list(recipe.rules)
    subclasses, renames = dict(recipe.subclasses), list(recipe.renames)
    divisible, divide_config = list(recipe.divisible), list(recipe.divide_config)
    sp = recipe.sequence_parallel
    for number, inc in enumerate(recipe.includes):
        where = f"recipe {recipe.source}: [[include]] #{number} (prefix = {inc.prefix!r}, config = {inc.config!r})"
        sub = config_get(config, inc.config)
        if sub is None or isinstance(sub, (bool, int, float, str, list, tuple, dict)):
            raise RecipeError(f"{where}: {type(config).__name__} holds no sub-config at {inc.config!r} ({sub!r}); "
                              f"name the attribute that holds the part's config (text_config, vision_config)")
        try:
            module = base.get_submodule(inc.prefix)
        except AttributeError:
            raise RecipeError(f"{where}: {type(model).__name__} has no module {inc.prefix!r} (relative to its base "
                              f"model {type(base).__name__}); its children are "
                              f"{[n for n, _ in base.named_children()]}") from None
        name = inc.recipe or getattr(sub, "model_type", None)
        if not name:
            raise RecipeError(f"{where}: the sub-config {type(sub).__name__} has no model_type; give recipe = ...")
        try:
            inner = compose(load_recipe(name), module)
        except RecipeError as e:
            raise RecipeError(f"{where}: the part {type(module).__name__} ({inc.config}.model_type = "
                              f"{getattr(sub, 'model_type', None)!r}) cannot be planned: {e} For a part: a recipe file "
                              f"named after its model_type in a recipes folder, or recipe = ... in this [[include]]"
                              ) from None
        _check_sub_config(inner, sub, where)
        inner_prefix = base_model_and_prefix(module)[1]
        prefix = f"{inc.prefix}.{inner_prefix}" if inner_prefix else inc.prefix

        def at(name: str, path: str = inc.config) -> str:
            return f"{path}.{name}"

        for r in inner.rules:
            rules.append(dataclasses.replace(
                r, index=len(rules), patterns=tuple(f"{prefix}.{p}" for p in r.patterns),
                when=tuple((at(k), v) for k, v in r.when), head_inputs=tuple((a, d, at(h)) for a, d, h in r.head_inputs),
                kv_heads=at(r.kv_heads) if isinstance(r.kv_heads, str) else r.kv_heads,
                options=None if r.options is None else with_config_prefix(r.options, at),
                origin=f"{inner.source} at {prefix}" + (f" ({r.origin})" if r.origin else "")))
        divisible += [at(n) for n in inner.divisible]
        divide_config += [at(n) for n in inner.divide_config]
        renames += [r for r in inner.renames if r not in renames]
        for cls_name, entry in inner.subclasses.items():
            if subclasses.setdefault(cls_name, entry) != entry:
                raise RecipeError(f"{where}: [subclasses] {cls_name} is {entry} in {inner.source} but "
                                  f"{subclasses[cls_name]} elsewhere")
        if inner.sequence_parallel is not None:
            if sp is not None:
                raise RecipeError(f"{where}: {inner.source} has a [sequence_parallel] table, and so has another part; "
                                  f"one stretch of split tokens per model")
            isp = inner.sequence_parallel
            sp = {"split": f"{prefix}.{isp['split']}", "gather": [f"{prefix}.{g}" for g in isp["gather"]],
                  "exit": f"{prefix}.{isp['exit']}", "scope": f"{prefix}.{isp['scope']}" if "scope" in isp else prefix}
    return Recipe(recipe.model_type, rules, tuple(divisible), recipe.source, recipe.description, tuple(divide_config),
                  recipe.loss, recipe.ignores_num_items, recipe.loss_terms, recipe.logit_ops, tuple(renames),
                  subclasses, sp, pipeline=recipe.pipeline)


def _check_sub_config(recipe: Recipe, sub, where: str) -> None:
    """Every config attribute ``recipe``'s rules read holds on ``sub`` (``when`` keys aside: a
    condition on a missing attribute is simply false), else a RecipeError naming each."""
    reads = [(n, "divisible") for n in recipe.divisible] + [(n, "divide_config") for n in recipe.divide_config]
    for r in recipe.rules:
        if isinstance(r.kv_heads, str):
            reads.append((r.kv_heads, f"kv_heads of {r.describe()}"))
        if r.options is not None:
            reads += [(name, f"{key} of {r.describe()}") for name, key in config_reads(r.options)]
        reads += [(h, f"head_inputs of {r.describe()}") for _, _, h in r.head_inputs]
    missing = [f"{name} ({what})" for name, what in reads if not config_has(sub, name)]
    if missing:
        raise RecipeError(f"{where}: recipe {recipe.source} reads config attributes that the sub-config "
                          f"{type(sub).__name__} (model_type {getattr(sub, 'model_type', None)!r}) does not have: "
                          f"{missing}. Include a recipe written for this part's family (recipe = ...), or write one "
                          f"(docs/recipes.md)")
