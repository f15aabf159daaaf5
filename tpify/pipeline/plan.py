"""Where a model is cut into pipeline stages: the plan (which modules, from the recipe's
``[pipeline]`` table or transformers' ``base_model_pp_plan``) and the layer ranges of the stages.

Pure: no communication, the same result (or the same error) on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..hf_modules import base_model_and_prefix
from ..recipe import Recipe

__all__ = ["PipelinePlan", "PipelineError", "pipeline_plan", "layer_ranges", "stage_indices"]


class PipelineError(ValueError):
    """A model, a mesh or a batch the pipeline cannot take; raised on every rank alike."""


@dataclass(frozen=True)
class PipelinePlan:
    """Where a model is cut (module names relative to the base model, except ``head``).

    ``layers``: the decoder layers' ModuleList, cut between the stages; ``first`` / ``last``: the
    modules of the first / last stage -> what each becomes on the other stages (``absent``,
    ``identity``, ``zero``: :data:`tpify.recipe.PIPELINE_ELSEWHERE`); ``head``: the head class's
    child computing the logits (last stage only); ``source``: where the plan came from.
    """

    layers: str
    first: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    head: str = "lm_head"
    source: str = ""


def _head_name(model: nn.Module, given: str | None) -> str | None:
    """The child of ``model`` holding its output embeddings (``lm_head``), or ``given``."""
    if given is not None:
        return given
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, child in model.named_children():
        if child is out:
            return name
    pp = getattr(type(model), "_pp_plan", None) or {}
    return next(iter(pp), None)


def pipeline_plan(model: nn.Module, recipe: Recipe | None) -> PipelinePlan:
    """The :class:`PipelinePlan` of ``model``: the recipe's ``[pipeline]`` table, else
    transformers' ``config.base_model_pp_plan`` (the entries before the layers belong to the first
    stage and are absent elsewhere, those after to the last and are the identity elsewhere). Pure.

    Raises:
        PipelineError: neither exists (naming the recipe key to add); the plan names modules the
            model lacks; the layers are not a ModuleList; no head (a model without an LM head).
    """
    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    if not _is_causal_lm(model):
        raise PipelineError(f"{type(model).__name__} ({kind}): tpify.pipeline cuts causal language models (a "
                            f"...ForCausalLM class): its loss shifts the labels as a causal LM's does and every stage "
                            f"runs the decoder's causal forward. An encoder (BERT's masked-LM or task heads), an "
                            f"encoder-decoder (T5) or a classification head would get a wrong loss: not built. Use "
                            f"tensor parallelism (and FSDP2 over the data-parallel ranks) for this model")
    table = recipe.pipeline if recipe is not None else None
    if table is not None:
        plan = PipelinePlan(table["layers"], dict(table["first"]), dict(table["last"]), table.get("head"),
                            f"the recipe's [pipeline] table ({recipe.source})")
    else:
        hf = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
        layer_keys = [k for k in hf if isinstance(getattr(_base(model), k, None), nn.ModuleList)]
        if not hf or len(layer_keys) != 1:
            raise PipelineError(
                f"{type(model).__name__} ({kind}): no pipeline plan. Neither the recipe has a [pipeline] table nor "
                f"does transformers' config declare base_model_pp_plan{' with one ModuleList' if hf else ''}; add to "
                f"the recipe: [pipeline] layers = '<the decoder layers ModuleList, e.g. layers>', first = {{ "
                f"embed_tokens = 'absent' }}, last = {{ norm = 'identity' }} (docs/recipes.md, [pipeline])")
        at = list(hf).index(layer_keys[0])
        plan = PipelinePlan(layer_keys[0], {k: "absent" for k in list(hf)[:at]},
                            {k: "identity" for k in list(hf)[at + 1:]}, None,
                            f"transformers' {type(model.config).__name__}.base_model_pp_plan")
    head = _head_name(model, plan.head)
    base = _base(model)
    problems = [n for n in [*plan.first, *plan.last] if not isinstance(getattr(base, n, None), nn.Module)]
    if not isinstance(getattr(base, plan.layers, None), nn.ModuleList):
        problems.append(f"{plan.layers} (not a ModuleList)")
    if head is None or base is model or not isinstance(getattr(model, head, None), nn.Module):
        problems.append(f"the head {head!r} (a causal LM head class, e.g. {kind}ForCausalLM, is needed)")
    if problems:
        raise PipelineError(f"{type(model).__name__}: the pipeline plan from {plan.source} names modules the model "
                            f"lacks: {', '.join(problems)}; fix the recipe's [pipeline] table (docs/recipes.md)")
    return PipelinePlan(plan.layers, plan.first, plan.last, head, plan.source)


def _is_causal_lm(model: nn.Module) -> bool:
    """True for a decoder-only causal LM: one of transformers' causal-LM classes (its auto mapping) or
    a ``...ForCausalLM`` class, and not an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return any(cls.__name__ in names or cls.__name__.endswith("ForCausalLM") for cls in type(model).__mro__)


def _base(model: nn.Module) -> nn.Module:
    """The base model (``model.model``, ``model.transformer``) or ``model`` itself."""
    return base_model_and_prefix(model)[0]


def layer_ranges(n_layers: int, n_stages: int, split_points: list[int] | None = None) -> list[range]:
    """The layers of each stage: ``n_stages`` consecutive ranges covering ``range(n_layers)``.

    Balanced by default (the first ``n_layers % n_stages`` stages hold one layer more); with
    ``split_points`` (``n_stages - 1`` increasing layer indices, each the first layer of the next
    stage) as given. Pure.

    Raises:
        PipelineError: more stages than layers; split points that are not ``n_stages - 1``
            increasing indices in ``1 .. n_layers - 1``.
    """
    if n_stages > n_layers:
        raise PipelineError(f"{n_stages} pipeline stages but the model has {n_layers} layers: each stage needs at least "
                            f"one layer; use pp_size * n_virtual <= {n_layers}")
    if split_points is None:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (s < extra) for s in range(n_stages)]
        starts = [sum(sizes[:s]) for s in range(n_stages)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]
    points = list(split_points)
    ok = (len(points) == n_stages - 1 and all(isinstance(p, int) and not isinstance(p, bool) for p in points)
          and points == sorted(set(points)) and all(0 < p < n_layers for p in points))
    if not ok:
        raise PipelineError(f"split_points {split_points!r}: give {n_stages - 1} increasing layer indices in 1 .. "
                            f"{n_layers - 1} (each the first layer of the next stage) for {n_stages} stages of "
                            f"{n_layers} layers")
    bounds = [0, *points, n_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_indices(pp_rank: int, pp_size: int, n_virtual: int, style: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: ``loop`` (stage ``s`` on rank ``s % pp``:
    interleaved 1F1B, Narayanan et al., arXiv:2104.04473, section 2.2) or ``v`` (two stages per
    rank, ``r`` and ``2 pp - 1 - r``: the V shape of zero-bubble V and DualPipeV, for when those
    schedules are built; :func:`tpify.pipeline.split_model` takes ``loop`` only). Pure."""
    if style == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(n_virtual)]
