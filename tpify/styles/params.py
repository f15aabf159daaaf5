"""What the parameter styles share (``experts``, ``per_head``): a rule's ``params`` table, read
and checked against a module that is no layer. docs/recipes.md, "Fused experts" and "Per-head
parameters"."""

from __future__ import annotations

from ..hf_modules import SHARDABLE_TYPES, module_kind
from .base import AFTER_SUM, RuleError, Style

__all__ = ["ParamsStyle", "read_split_params"]

_PARAM_KEYS = {"dim", "parts"}


def read_split_params(raw, style: str, where: str, after_sum: bool) -> tuple[tuple[str, int, int], ...]:
    """A rule's ``params`` table: ``{ name = { dim = d, parts = n } }`` -> ``((name, d, n), ...)``
    sorted by name (``parts`` 1 when not given); with ``after_sum`` (``experts``), ``{ after_sum =
    true }`` -> ``(name, AFTER_SUM, 1)``: a bias added to each expert's output, kept whole and
    counted once. Raises :class:`RuleError` when it is missing or malformed."""
    if raw is None:
        example = ("params = { gate_up_proj = { dim = 1, parts = 2 }, down_proj = { dim = 2 } }" if after_sum else
                   "params = { sinks = { dim = 0 } }")
        what = ("the parameters it splits and how" if after_sum else
                "the parameters holding one value per head and their head dimension")
        raise RuleError(f"{where}: style {style!r} needs 'params', {what}: {example}")

    def split(spec) -> bool:
        return (set(spec) <= _PARAM_KEYS and "dim" in spec
                and all(isinstance(v, int) and not isinstance(v, bool) for v in spec.values())
                and spec["dim"] >= 0 and spec.get("parts", 1) >= 1)

    ok = isinstance(raw, dict) and raw and all(
        isinstance(name, str) and name and "." not in name and isinstance(spec, dict) and spec
        and (split(spec) or (after_sum and spec == {"after_sum": True})) for name, spec in raw.items())
    if not ok:
        raise RuleError(f"{where}: 'params' must be a table of parameter name = {{ dim = the dimension split over the "
                        f"ranks (an integer >= 0), parts = the number of equal packed parts along it, each split alike "
                        f"(optional, an integer >= 1) }}" + (", or { after_sum = true } (a bias added to each "
                                                              "expert's output: kept whole, counted once after the sum "
                                                              "over the ranks)" if after_sum else ""))
    return tuple(sorted((name, AFTER_SUM, 1) if "after_sum" in spec else (name, spec["dim"], spec.get("parts", 1))
                        for name, spec in raw.items()))


class ParamsStyle(Style):
    """A style splitting named parameters (the rule's ``params``) of a module no layer style knows."""

    kind = "params"
    split_note = ""  # what explain adds after the parameters' splits

    def accepts(self, module):
        return module_kind(module) is None

    def _named(self, ctx, fqn, module, rule, holds: str) -> tuple[dict, list[str]] | None:
        """``(the module's own parameters, problems with the rule's params)``: a parameter it lacks,
        a dimension it lacks; None after recording an error when the module is a layer."""
        if not self.accepts(module):
            ctx.errors.append(f"{fqn} is a {type(module).__name__}; style {self.name!r} ({rule.describe()}) splits "
                              f"the named parameters of {holds}, not an {SHARDABLE_TYPES} layer")
            return None
        own = dict(module.named_parameters(recurse=False))
        params = rule.options.params
        problems = [f"it holds no parameter {name!r}" for name, _, _ in params if name not in own]
        problems += [f"{name} has {own[name].dim()} dimensions, so it has no dimension {dim}"
                     for name, dim, _ in params if name in own and own[name].dim() <= dim]
        return own, problems

    def explain(self, entry, param=None, source=""):
        if param is not None or not entry.params:
            return super().explain(entry, param, source)
        return "; ".join(f"{name} whole, counted once after the sum" if dim < 0 else
                         f"{name} dim {dim}" + (f" in {parts} parts" if parts > 1 else "")
                         for name, dim, parts in entry.params) + self.split_note

