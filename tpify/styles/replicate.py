"""The whole styles: ``replicate`` (a full copy) and ``replicate_sum_grads`` (a copy whose
gradients are summed over the group). docs/recipes.md, "Keeping modules whole"."""

from __future__ import annotations

from dataclasses import dataclass

from .base import PARAMS_ONLY, WHOLE, ModuleLayout, RuleError, Style

__all__ = ["Replicate", "ReplicateSumGrads", "ReplicateOptions"]


@dataclass(frozen=True)
class ReplicateOptions:
    """``replicate``'s ``params``: ``((name, WHOLE, 1), ...)``, the module's own parameters kept
    whole on purpose (its children keeping their own rules); empty: a container."""

    params: tuple[tuple[str, int, int], ...] = ()
    CONFIG_REFS = ()


#: transformers' styles that mean a full copy, and the note of the rule imported from each.
_HF_NOTES = {"replicate": "HF replicate",
             "rowwise_split_input": "HF {hf}: input whole, each rank multiplies its slice and the results are summed, "
                                    "the dense result; tpify: a full copy (exact)",
             "replicated_with_grad_allreduce": "HF {hf}: a full copy"}
_HF_NOTES["rowwise_rep"] = _HF_NOTES["rowwise_split_input"]


class Replicate(Style):
    """``replicate``: a full copy on every rank (any module; a container's whole contents). With the
    rule's ``params`` (a module that is no layer): only the module's own parameters it names, on
    purpose (a position table held by a vision tower whose layers are split), its children keeping
    their own rules; a name the module does not hold itself is a plan error."""

    name = "replicate"
    copies_whole = True
    tied_head = "replicate"
    KEYS = {"params": PARAMS_ONLY}
    Options = ReplicateOptions
    hf_whole = ("replicate",)  # transformers' names of this style that keep a parameter whole

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        names = raw.get("params")
        if names is None:
            return ReplicateOptions()
        if not (isinstance(names, list) and names and all(isinstance(n, str) and n and "." not in n for n in names)
                and len(set(names)) == len(names)):
            raise RuleError(f"{where}: 'params' of style 'replicate' must be a list of distinct names of the module's "
                            f"own parameters, kept whole on purpose (its children keep their own rules)")
        return ReplicateOptions(tuple((name, WHOLE, 1) for name in sorted(names)))

    def is_container(self, rule):
        return not rule.options.params

    def covers(self, entry, pname):
        return not entry.params or any(name == pname for name, _, _ in entry.params)

    def plan(self, ctx, fqn, module, rule):
        params = rule.options.params
        entry = ModuleLayout(fqn, self.name, rule.index, params=params)
        own = dict(module.named_parameters(recurse=False))
        missing = [name for name, _, _ in params if name not in own]
        if missing:
            ctx.errors.append(f"{fqn} ({type(module).__name__}): {rule.describe()} keeps its parameters {missing} "
                              f"whole, but it holds no such parameter of its own (it holds {sorted(own)})")
            return None
        return entry

    def explain(self, entry, param=None, source=""):
        if param is None:
            if not entry.params:
                return ""
            return (f"its own {', '.join(name for name, _, _ in entry.params)} whole on purpose (replicate params); "
                    f"its layers keep their own rules")
        return source if source.startswith("inside") else f"style replicate {source}"

    def from_hf(self, imp, entry):
        if entry.hf_style != "replicate":  # a row layer of a whole input: HF's result is the dense one
            imp.require_kind(entry, "linear")
        imp.add_rule(entry.key, entry.names, self.name, _HF_NOTES[entry.hf_style].format(hf=entry.hf_style))

    def hf_param(self, imp, owner, leaf, hf_style, shape):
        return hf_style in self.hf_whole


class ReplicateSumGrads(Replicate):
    """``replicate_sum_grads``: a full copy on every rank (a module that is no container of split
    layers: a norm) whose parameters' gradients are partial sums on each rank, summed over the TP
    group in backward (:mod:`tpify.hooks.region_grads`; transformers' ``replicated_with_grad_allreduce``).

    For a module that runs on replicated activations but whose output only this rank's heads read,
    where tpify cannot find it by construction (dots3's ``k_rope_only_layernorm`` of the rotary key
    of multi-head latent attention). Declared on a module whose gradient is already whole it would
    come out ``tp_size`` times too large: ``tpify verify`` checks every gradient.
    Communication: backward, one all-reduce of its parameters' gradients (with the model's others).
    """

    name = "replicate_sum_grads"
    copies_whole = False
    sums_own_grads = True
    tied_head = None
    KEYS = {}
    hf_whole = ("replicated_with_grad_allreduce",)
    sequence_parallel = False
    sequence_parallel_refusal = ("its gradient would be partial over the tokens as well as the heads; not supported "
                                 "yet")

    def is_container(self, rule):
        return False

    def explain(self, entry, param=None, source=""):
        if param is None:
            return ""
        return f"style replicate_sum_grads ({source}): whole, its gradient, partial on each rank, summed over the ranks"

    def from_hf(self, imp, entry):
        """HF's ``replicated_with_grad_allreduce``: on a module that is no layer (a norm inside the
        sharded region) no rule, tpify sums its gradient by construction (reviewed; next to latent
        attention, see :meth:`tpify.styles.latent.Latent.complete_hf`); on a layer a full copy."""
        if imp.kinds(entry) == {None}:
            imp.by_construction.append(entry.key)
            return
        imp.replicate(entry.key, entry.names, _HF_NOTES[entry.hf_style].format(hf=entry.hf_style))
