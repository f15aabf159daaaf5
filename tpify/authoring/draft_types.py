"""What a draft is: :class:`Draft` (a recipe mapping, a note per rule, what to review), the
:class:`DraftError` of every draft source, and what both sources share (building a head class,
the ``[loss]`` table)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..recipe import Recipe, logit_ops_of, loss_terms_of
from .toml_writer import to_toml

__all__ = ["Draft", "DraftError", "LM_TASKS", "build_head_class", "loss_table", "recipe_data"]

LM_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")


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
               else "from a data-flow trace of one forward of a small random model (tpify.authoring.tracer)")
        header = [f"DRAFT tpify recipe for model_type {self.model_type!r}, {how}.",
                  f"Head classes looked at: {', '.join(self.head_classes)}.",
                  "Review every rule (the comment above it says what it is based on), then prove it exact:",
                  f"  tpify verify {self.model_type} --recipe THIS_FILE --tp 2   (float64 against the dense model)",
                  "Recipe keys: docs/recipes.md."]
        return to_toml(self.data, self.notes, header, self.review)


def build_head_class(cls: type, config, meta: bool) -> nn.Module:
    """``cls(config)`` (on the meta device when ``meta``), from a copy of ``config`` with 2 labels
    for question answering (start and end logits)."""
    config = copy.deepcopy(config)
    if cls.__name__.endswith("ForQuestionAnswering"):
        config.num_labels = 2  # start and end logits (some families check it)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def loss_table(classes: dict[str, type], config=None) -> dict:
    """The recipe's ``[loss]`` table: ``{"causal" | "masked" | "seq2seq": [class names]}`` of the LM
    head classes in ``classes`` (task -> class), with ``terms`` for a mixture of experts and
    ``logits`` for what the model does to its head's output (:func:`tpify.recipe.logit_ops_of`)."""
    loss: dict = {}
    for task, cls in classes.items():
        kind = {"causal-lm": "causal", "masked-lm": "masked", "seq2seq-lm": "seq2seq"}.get(task)
        if kind:
            loss.setdefault(kind, []).append(cls.__name__)
    terms = loss_terms_of(config) if loss and config is not None else []
    if terms:  # a mixture of experts: HF adds router_aux_loss_coef * aux_loss to the LM loss
        loss["terms"] = terms
    ops = logit_ops_of(config) if loss and config is not None else []
    if ops:  # logit scaling or softcapping after the head (Cohere, Granite, Gemma 2)
        loss["logits"] = ops
    return loss



def recipe_data(config, description: str, divisible: list[str], divide_config: list[str], rules: list[dict],
                classes: dict[str, type], subclasses: dict | None = None) -> dict:
    """The recipe mapping of a draft, keys in the order they are written: ``model_type``,
    ``description``, ``divisible``, then ``divide_config``, ``[subclasses]`` and ``[loss]``
    (:func:`loss_table` of ``classes``) when not empty, then the rules."""
    data: dict = {"model_type": config.model_type, "description": description, "divisible": divisible}
    if divide_config:
        data["divide_config"] = divide_config
    if subclasses:
        data["subclasses"] = subclasses
    loss = loss_table(classes, config)
    if loss:
        data["loss"] = loss
    data["rule"] = rules
    return data
