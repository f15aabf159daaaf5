"""The layout: everything tpify decides about a model at a tp size, in one validated object.

:func:`build_layout` matches a recipe (``tpify/recipe.py``) to a model's module tree (on meta or
real weights) for ``tp_size``. It is pure and deterministic: the same model, recipe and size give
the same layout (or raise the same :class:`PlanError`) on every rank, and it issues no
collective, so bad input fails on every rank at the same point. Every later stage takes the
layout instead of re-deriving what it needs:

* surgery (:func:`tpify.surgery.apply_layout`): per module the style and per-rank sizes, the
  module attributes and config values to divide;
* sharded loading and saving (:mod:`tpify.api`, :mod:`tpify.io`): which modules are sharded, the checkpoint
  key renames, the config values to write back dense;
* the dropout streams and gradient hooks (:mod:`tpify.hooks`): the
  sharded regions, from the output of each column-parallel layer to the next row-parallel one;
* the parallel loss (:mod:`tpify.loss`): the LM head and the loss kind, from the recipe's
  ``[loss]`` table (or the head class's own ``loss_type``), never from class-name suffixes or
  source text.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) is the method; ``docs/recipes.md`` the
recipe format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .agree import digest
from .compose import compose
from .hf_modules import SHARDABLE_TYPES, is_peft, relative_fqn
from .planner import PlanError, Planner, coverage_threshold
from .recipe import Recipe, Rule
from .sharding import ShardSpec
from .styles import ModuleLayout

__all__ = ["PlanError", "ModuleLayout", "Layout", "build_layout", "coverage_threshold", "relative_fqn",
           "SHARDABLE_TYPES"]


@dataclass
class Layout:
    """The validated outcome of matching a recipe to a model at ``tp_size``.

    Attributes:
        tp_size: ranks the model is split over.
        pad_vocab_multiple: vocabulary-split tables are padded to a multiple of this times ``tp_size``.
        recipe: the recipe it came from.
        model_class: the class name of the model it was built for.
        modules: module FQN -> :class:`ModuleLayout`, for every ``nn.Linear``/``Conv1D``/
            ``nn.Embedding`` (``replicate`` included) and every module a parameter style splits
            (``experts``).
        divides: module FQN -> attribute names divided by ``tp_size`` on each rank (head counts).
        kv_divides: module FQN -> ``(attribute, divisor)`` pairs: query heads per KV head (HF's
            ``num_key_value_groups``) divided by ``tp_size / kv_heads`` where each KV head is held
            by a group of ranks (the recipe's ``kv_groups``); KV head counts (phi3's
            ``num_key_value_heads``, the recipe's ``kv_counts``) divided by ``tp_size``, or by
            ``kv_heads`` where each is held by a group of ranks.
        config_divides: config attribute -> its dense value; divided by ``tp_size`` on the
            parallel model's config (HF code reads some at forward time), written dense on save.
        lm_head: the FQN of the vocabulary-parallel LM head (style ``colwise_rep``), or None.
        loss_kind: ``"causal"``, ``"masked"`` or None (HF's own loss on gathered logits).
        honours_num_items: whether the model's own loss divides by ``num_items_in_batch``.
        loss_terms: ``(output field, coefficient)`` pairs HF adds to the LM loss (a mixture of
            experts' ``router_aux_loss_coef * aux_loss``); the coefficient is a config
            attribute name or a number (the recipe's ``[loss] terms``).
        logit_ops: ``(op, value)`` pairs the model applies to its LM head's output before its
            loss, in order (the recipe's ``[loss] logits``; op in :data:`tpify.loss.LOGIT_OPS`,
            value a config attribute name, read at each call, or a number).
        lm_loss_chunk: with ``parallelize(..., lm_loss_chunk=c)``, the tokens per chunk of the
            chunked LM-head loss, or "auto" (:func:`tpify.loss.default_chunk_size`; the head does not
            run; :mod:`tpify.hooks.lm_loss`); else None.
        renames: checkpoint key suffix renames ``(old, new)``, applied when loading.
        sequence_parallel: with ``sequence_parallel=True``, the FQNs ``{"split": ..., "gather":
            [...], "exit": ..., "moe_blocks": {block: (experts, [routers], ep)}}`` of the recipe's
            ``[sequence_parallel]`` table (``moe_blocks``: the gathered modules holding fused
            experts); else None.
        head_inputs: module FQN -> ``(argument, dim, dense head count)`` for each forward argument
            that holds one entry per attention head (ALiBi biases built by the base model for
            all heads): each rank gets its own heads' slice.
        region_starts: column-parallel layers whose output stays sharded (a sharded region
            begins after each).
        region_ends: row-parallel layers (a sharded region ends before each).
        unmatched_rules: non-optional rules that matched nothing (warned about by surgery).
        ep_size: ``tp_size`` when the ``experts`` modules hold whole experts (expert parallelism
            over the TP group), else 1.
        coverage_threshold: the parameter size (elements) from which a parameter of a module that
            is no ``nn.Linear``/``Conv1D``/``nn.Embedding`` must be covered by a rule
            (:func:`coverage_threshold`).
    """

    tp_size: int
    recipe: Recipe
    model_class: str = ""
    pad_vocab_multiple: int = 1
    modules: dict[str, ModuleLayout] = field(default_factory=dict)
    divides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kv_divides: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    config_divides: dict[str, int] = field(default_factory=dict)
    lm_head: str | None = None
    loss_kind: str | None = None
    honours_num_items: bool = True
    loss_terms: tuple[tuple[str, str | float], ...] = ()
    logit_ops: tuple[tuple[str, str | float], ...] = ()
    lm_loss_chunk: int | str | None = None
    renames: tuple[tuple[str, str], ...] = ()
    head_inputs: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    sequence_parallel: dict | None = None
    region_starts: tuple[str, ...] = ()
    region_ends: tuple[str, ...] = ()
    unmatched_rules: list[Rule] = field(default_factory=list)
    ep_size: int = 1
    coverage_threshold: int = 0

    def sharded(self) -> set[str]:
        """FQNs of the modules that are split (every style but ``replicate``)."""
        return {fqn for fqn, m in self.modules.items() if m.styler.shards}

    def param_specs(self) -> dict[str, "ShardSpec | None"]:
        """Every parameter of the split modules, by FQN, with its :class:`ShardSpec` (``None``:
        replicated), as the styles give them (:attr:`ModuleLayout.specs`)."""
        return {f"{fqn}.{name}": spec for fqn, m in self.modules.items() for name, spec in m.specs.items()}

    def replica_shards(self) -> set[int]:
        """The KV head counts whose heads are each held by a group of ranks (more than one KV
        head, fewer than ``tp_size``): the groups :func:`tpify.mesh.replica_groups` makes."""
        return {m.replica_shards for m in self.modules.values()
                if m.replicated_parts and 1 < m.replica_shards < self.tp_size}

    def digest(self) -> str:
        """A short digest of what decides the per-rank tensors besides ``tp_size`` (which the
        agreement compares on its own, so that a different size is reported as such)."""
        return digest([sorted((f, m.style, m.partition_sizes, m.padded_size, m.replicated_parts, m.replica_shards,
                               m.output_scale,
                               m.params, m.expert_parallel, m.shared_features, m.uneven, m.identity_experts)
                              for f, m in self.modules.items()),
                            sorted((f, list(a)) for f, a in self.divides.items()), sorted(self.config_divides.items()),
                            sorted((f, list(a)) for f, a in self.kv_divides.items()),
                            self.lm_head, self.loss_kind, self.honours_num_items, list(self.loss_terms), list(self.renames),
                            sorted(self.head_inputs.items()), self.sequence_parallel, list(self.logit_ops),
                            self.lm_loss_chunk, self.ep_size])


def build_layout(model: nn.Module, recipe: Recipe, tp_size: int, *, pad_vocab_multiple: int = 1,
                 sequence_parallel: bool = False, lm_loss_chunk: int | str | None = None, ep_size: int = 1) -> Layout:
    """Match ``recipe`` against ``model`` and validate it for ``tp_size``; no collectives.

    Every ``nn.Linear``, ``Conv1D`` and ``nn.Embedding`` must be matched by exactly one rule with a
    style, and every large parameter of another module covered (:func:`coverage_threshold`); sizes
    ``tp_size`` does not divide are split unevenly outside attention heads, refused inside them;
    vocabulary-split tables are padded to a multiple of ``pad_vocab_multiple * tp_size``. The
    rules in full: docs/recipes.md, "tpify.layout.build_layout".

    Raises:
        PlanError: with every problem found, each naming the module and the numbers (uncovered
            modules and parameters, modules two rules claim, a style on the wrong module type,
            counts ``tp_size`` does not divide with the tp sizes that would work, a bad ``ep_size``
            or ``lm_loss_chunk``, ``[loss] logits`` reading a config attribute that is no number).
    """
    _check_arguments(model, tp_size, pad_vocab_multiple, lm_loss_chunk, ep_size)
    recipe = compose(recipe, model)
    layout = Layout(tp_size, recipe, type(model).__name__, pad_vocab_multiple, renames=recipe.renames,
                    ep_size=ep_size, coverage_threshold=coverage_threshold(model))
    planner = Planner(model, recipe, layout)
    planner.config_counts()
    planner.find_heads()
    planner.match_modules()
    planner.per_head_parameters()
    planner.large_parameters()
    planner.finish(sequence_parallel, lm_loss_chunk)
    return planner.result()


# The largest vocabulary padding multiple: padding to a multiple of 65,536 * tp_size rows already adds up to
# that many rows of the embedding and the LM head (Megatron-LM pads to 128); a larger one is a mistake, refused
# before anything is allocated (2**40 failed in the allocator).
MAX_PAD_VOCAB_MULTIPLE = 2**16


def _check_arguments(model: nn.Module, tp_size, pad_vocab_multiple, lm_loss_chunk=None, ep_size=1) -> None:
    """The arguments and the model can be planned at all (before anything is matched)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size not in (1, tp_size):
        raise PlanError(f"ep_size must be 1 (tensor-parallel experts) or tp_size = {tp_size} (expert parallelism over "
                        f"the TP group: whole experts per rank, tokens exchanged with all-to-all), got {ep_size!r}; an "
                        f"expert-parallel group inside or across the data-parallel groups is not supported yet")
    if not isinstance(pad_vocab_multiple, int) or isinstance(pad_vocab_multiple, bool) \
            or not 1 <= pad_vocab_multiple <= MAX_PAD_VOCAB_MULTIPLE:
        got = f"{pad_vocab_multiple:,}" if isinstance(pad_vocab_multiple, int) else repr(pad_vocab_multiple)
        raise PlanError(f"pad_vocab_multiple must be an integer from 1 to {MAX_PAD_VOCAB_MULTIPLE:,} (the vocabulary is "
                        f"padded to a multiple of pad_vocab_multiple * tp_size; Megatron-LM pads to a multiple of "
                        f"128), got {got}")
    if lm_loss_chunk not in (None, "auto") and (not isinstance(lm_loss_chunk, int) or isinstance(lm_loss_chunk, bool)
                                                or lm_loss_chunk < 1):
        raise PlanError(f"lm_loss_chunk must be a positive number of tokens per chunk, 'auto' (the chunk "
                        f"tpify.loss.default_chunk_size picks) or None (the LM-head loss from the whole logits "
                        f"shard), got {lm_loss_chunk!r}")
    peft = [fqn or "<root>" for fqn, m in model.named_modules() if is_peft(m)]
    if peft:
        raise PlanError(f"cannot parallelize {type(model).__name__}: it holds PEFT modules ({peft[:3]}"
                        f"{' ...' if len(peft) > 3 else ''}). Parallelize the base model first, then add the adapters: "
                        f"model = tpify.parallelize(model); model = tpify.integrations.get_peft_model(model, lora_config)")


