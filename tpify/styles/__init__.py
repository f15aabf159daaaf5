"""The recipe styles, one object each, owning their whole life cycle (docs/recipes.md lists them).

A recipe names a style per module; the :class:`Style` of that name reads the rule's keys
(:meth:`~Style.read_rule`), checks the module and gives each parameter's spec (:meth:`~Style.plan`,
:meth:`~Style.param_specs`), builds the parallel module (:meth:`~Style.build`), installs its module
hooks (:meth:`~Style.install`), says what ``tpify plan`` prints (:meth:`~Style.explain`) and makes
rules of transformers' plan entries (:meth:`~Style.from_hf`). Nothing else interprets a style's name.
Adding a style is one class and :func:`register` (plus, where transformers has the same style, one
line in :data:`tpify.hf_plan.HF_STYLES`).

One module per family: :mod:`~tpify.styles.base` (what every style is, the registry),
:mod:`~tpify.styles.linear`, :mod:`~tpify.styles.embedding`, :mod:`~tpify.styles.experts`
(+ :mod:`~tpify.styles.experts_hooks`), :mod:`~tpify.styles.latent`, :mod:`~tpify.styles.per_head`,
:mod:`~tpify.styles.replicate`. Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3).
"""

from __future__ import annotations

from .base import (AFTER_SUM, STYLES, WHOLE, ModuleLayout, NoOptions, PlanContext, RuleError, Style, register,
                   style_of, unregister)
from .embedding import EmbeddingColwise, EmbeddingRowwise
from .experts import Experts
from .latent import Latent
from .linear import Colwise, ColwiseRep, PackedColwise, Rowwise
from .per_head import PerHead
from .replicate import Replicate, ReplicateSumGrads

__all__ = ["Style", "ModuleLayout", "PlanContext", "NoOptions", "RuleError", "STYLES", "style_of", "register",
           "unregister", "AFTER_SUM", "WHOLE"]

for _style in (Colwise, PackedColwise, ColwiseRep, Rowwise, EmbeddingRowwise, EmbeddingColwise, Experts, Latent,
               PerHead, Replicate, ReplicateSumGrads):
    register(_style)
del _style
