"""A toy style added the way the styles say a style is added: one class, registered, and one line
of transformers' style table (tpify.hf_plan.HF_STYLES). Used by tests/unit/test_style_life_cycle.py
(the recipe, the HF import, the layout and the build, in one process) and
tests/distributed/test_toy_style.py (end to end at tp = 2 against dense).

``rowwise_split_input``: a row-parallel layer whose input is whole, scattered by the layer itself
(transformers' ``rowwise_split_input``, ``RowwiseParallel(input_layouts=Replicate())``, which tpify
imports as ``replicate`` otherwise): ``Y = reduce(scatter(X)_r A_r) + b`` (Megatron-LM,
arXiv:1909.08053, section 3, with ``input_is_parallel=False``).
"""

from __future__ import annotations

from contextlib import contextmanager

from tpify.hf_modules import dense_dims
from tpify.layers import RowParallelLinear
from tpify.sharding import row_spec
from tpify.styles import Style, register, unregister

NAME = "rowwise_split_input"


class RowwiseSplitInput(Style):
    """``rowwise_split_input``: :class:`RowParallelLinear` with ``input_is_parallel=False``.

    Shapes: input ``(B, T, in_features)`` whole on every rank; output ``(B, T, out_features)``.
    Communication: forward one all-reduce of the output; backward one all-gather of the input's
    gradient (the scatter's). Raises (plan errors): in_features that ``tp_size`` does not divide.
    """

    name = NAME
    kind = "linear"
    sequence_parallel = False
    sequence_parallel_refusal = "a toy style of the tests"
    hf_note = "HF {hf_style}: input whole, scattered by the layer, output all-reduced (a toy style)"

    def _sizes(self, ctx, fqn, module, rule, entry):
        in_f, _, _ = dense_dims(module)
        ctx.need_divisible(f"{fqn}.in_features ({type(module).__name__}, {self.name})", in_f)
        return True

    def param_specs(self, module, entry, tp_size):
        in_f, _, layout = dense_dims(module)
        return {"weight": row_spec(in_f, tp_size, layout), "bias": None}

    def build(self, module, entry, ctx):
        return RowParallelLinear.from_dense(module, ctx.group, input_is_parallel=False, context=ctx)

    def explain(self, entry, param=None, source=""):
        if param == "bias":
            return "bias of a row layer: whole on every rank, added once after the all-reduce"
        return super().explain(entry, param, source)


@contextmanager
def registered():
    """The toy style registered and standing for transformers' ``rowwise_split_input`` (the one
    table line); both undone on exit, so that other tests see the registry as shipped."""
    from tpify.hf_plan import HF_STYLES

    style = RowwiseSplitInput()
    register(style)
    before = HF_STYLES[NAME]
    HF_STYLES[NAME] = style  # the one line a new style adds to tpify.hf_plan.HF_STYLES
    try:
        yield style
    finally:
        HF_STYLES[NAME] = before
        unregister(NAME)
