"""The ``experts`` style: fused MoE experts (transformers' ``*Experts``), their parameters split.

Tensor-parallel experts (Megatron-LM's TP experts; Shazeer et al., arXiv:1701.06538, for the
layer): each parameter of the rule's ``params`` is split along its ``dim`` (``gate_up_proj (E, 2I,
H)`` by each of its 2 packed parts, ``down_proj (E, H, I)`` by its input), so rank ``r`` holds
every expert's intermediate columns ``[r I/p, (r+1) I/p)`` (torch.chunk's rule where ``p`` does not
divide ``I``) and the module's output is a partial sum, all-reduced by its hooks
(:mod:`tpify.styles.experts_hooks`). With ``ep_size = tp_size`` (expert parallelism) every parameter
is split along dim 0 instead (whole experts per rank) and the hooks exchange the tokens.
docs/recipes.md, "Fused experts", has the keys and what is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ..hf_modules import config_get
from ..sharding import ShardSpec
from .base import AFTER_SUM, PARAMS_ONLY, RuleError, config_ref_or_int, slice_params
from .experts_hooks import ExpertParallelDispatch, TensorParallelExperts
from .params import ParamsStyle, read_split_params

__all__ = ["Experts", "ExpertsOptions"]

#: transformers' experts interface (integrations/moe.py): the packed gate/up parameters, the
#: dimension of ``I`` in each parameter (by ``is_transposed``), and the bias added after ``down_proj``.
_GATE_UP = ("gate_up_proj", "gate_up_proj_bias")
_INTERMEDIATE_DIM = {"gate_up_proj": {False: 1, True: 2}, "gate_up_proj_bias": {False: 1, True: 1},
                     "up_proj": {False: 1, True: 2}, "up_proj_bias": {False: 1, True: 1},
                     "down_proj": {False: 2, True: 1}}
_DOWN_BIAS = "down_proj_bias"
#: The arguments of transformers' experts forward, in order, and other names of them (gpt-oss's).
_EXPERTS_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
_EXPERTS_ALIASES = {"router_indices": "top_k_index", "routing_weights": "top_k_weights"}
_IDENTITY_FROM = ("'identity_from' (the first expert index of the zero-computation identity experts, a config "
                  "attribute name or a non-negative integer) is for style 'experts' only")
# transformers' styles on a fused experts parameter -> packed: colwise splits the output features
# (dim -2 of a 3-D weight (E, out, in), dim -1 of a bias (E, out)), rowwise the input.
_HF_PARAM_STYLES = {"colwise": False, "packed_colwise": True, "rowwise": False, "packed_rowwise": True}
_HF_IDENTITY = ("zero-computation experts (an identity expert inside the experts module, longcat_flash) give every "
                "rank the whole input inside the experts' partial sum, which HF pre-divides by tp_size; tpify has no "
                "such style. Keep the MoE block whole (replicate its experts) in a recipe")


@dataclass(frozen=True)
class ExpertsOptions:
    """``experts``' keys: ``params`` ``((name, dim, parts), ...)`` and ``identity_from`` (a config
    attribute or a number: the first expert index of the zero-computation identity experts)."""

    params: tuple[tuple[str, int, int], ...]
    identity_from: str | int | None = None
    CONFIG_REFS = ("identity_from",)


class Experts(ParamsStyle):
    """``experts``: a module holding fused expert weights, its named parameters split.

    The module must compute a sum over the split dimension (what ``tpify verify`` proves). Refused
    (plan errors), as it would count ``p`` times or see a partial sum: a parameter the rule does not
    name, a child with parameters (a norm after each expert), ``has_post_expert_norm``; transformers'
    interface flags (``is_concatenated``, ``is_transposed``, ``has_bias``) checked against the split:
    concatenated ``[gate | up]`` in 2 parts, interleaved pairs (gpt-oss) in ONE part, each parameter
    along its intermediate dimension, ``down_proj_bias`` ``{ after_sum = true }`` (counted once).
    Under expert parallelism: ``num_experts`` not dim 0 of every split parameter, another forward
    signature, identity experts.
    Communication (its hooks): :class:`~tpify.styles.experts_hooks.TensorParallelExperts` /
    :class:`~tpify.styles.experts_hooks.ExpertParallelDispatch`.
    """

    name = "experts"
    moe = True
    KEYS = {"params": PARAMS_ONLY, "identity_from": _IDENTITY_FROM}
    Options = ExpertsOptions
    split_note = "; output all-reduced"

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        params = read_split_params(raw.get("params"), self.name, where, after_sum=True)
        identity = raw.get("identity_from")
        if identity is not None and not config_ref_or_int(identity, 0):
            raise RuleError(f"{where}: {_IDENTITY_FROM}")
        return ExpertsOptions(params, identity)

    def _check_module(self, ctx, fqn, module, rule, entry):
        cls = type(module).__name__
        named = self._named(ctx, fqn, module, rule, "a module holding fused expert weights")
        if named is None:
            return False
        own, problems = named
        params, identity_from = rule.options.params, rule.options.identity_from
        names = [name for name, _, _ in params]
        extra = sorted(set(own) - set(names))
        if extra:
            problems.append(f"it holds parameters {extra} that the rule does not split: the experts' output is "
                            f"summed over the ranks, so a parameter each rank would apply whole (a bias added after "
                            f"down_proj) would count tp_size times")
        children = sorted(n for n, c in module.named_children() if any(True for _ in c.parameters()))
        if children:
            problems.append(f"its children {children} hold parameters (a norm after each expert would see a partial "
                            f"sum)")
        flags = {"has_post_expert_norm": True, "_is_expert_parallel": True}
        problems += [f"{flag} = {value} (transformers' experts interface)" for flag, value in flags.items()
                     if getattr(module, flag, not value) is value]
        problems += _interface_problems(module, own, params, ctx.ep_size > 1)
        if ctx.ep_size > 1:
            problems += _expert_parallel_problems(module, own, names)
        identity = config_get(ctx.config, identity_from) if isinstance(identity_from, str) else identity_from
        if identity_from is not None and (not isinstance(identity, int) or isinstance(identity, bool)
                                          or identity < 0):
            problems.append(f"identity_from = {identity_from!r} is {identity!r}, not a non-negative integer (the "
                            f"first expert index of the identity experts)")
        elif identity_from is not None and ctx.ep_size > 1:
            problems.append("identity experts (identity_from) with expert parallelism: a token routed to one has no "
                            "rank to travel to (not supported: use tensor-parallel experts)")
        if problems:
            ctx.errors.append(f"{fqn} ({cls}): style 'experts' ({rule.describe()}) cannot split it: "
                              + "; ".join(problems) + ". tpify splits only what it understands: give the module "
                              "style 'replicate' to keep it whole")
            return False
        entry.params, entry.expert_parallel = params, ctx.ep_size > 1
        entry.identity_experts = identity if identity_from is not None else None
        return True

    def _sizes(self, ctx, fqn, module, rule, entry):
        if entry.expert_parallel:
            ctx.need_divisible(f"{fqn}.num_experts ({type(module).__name__}, experts, ep_size)", module.num_experts)
            return True
        ok = True
        for name, dim, parts in entry.params:
            if dim == AFTER_SUM:
                continue
            size = getattr(module, name).shape[dim]
            if name in _GATE_UP and getattr(module, "is_concatenated", True) is False:
                # interleaved [g0, u0, g1, u1, ...]: each rank's contiguous slice must hold whole (g, u) pairs,
                # as many on every rank (torch.chunk's rule over 2I columns could cut a pair: never uneven)
                ctx.need_divisible(f"{fqn}.{name} dimension {dim} (interleaved gate/up pairs, never split unevenly)",
                                   size // 2)
                continue
            if size % parts:
                ctx.errors.append(f"{fqn}.{name}: dimension {dim} of size {size} cannot hold {parts} equal parts")
                ok = False
                continue
            ctx.split_size(fqn, f"{fqn}.{name} dimension {dim}" + (f" (each of {parts} parts)" if parts > 1 else ""),
                           size // parts, entry)
        return ok

    def param_specs(self, module, entry, tp_size):
        specs = {}
        for name, dim, parts in entry.params:
            shape = getattr(module, name).shape
            if entry.expert_parallel:
                specs[name] = ShardSpec(0, (shape[0],), tp_size)
            elif dim == AFTER_SUM:
                specs[name] = None  # replicated, counted once after the sum (TensorParallelExperts)
            else:
                specs[name] = ShardSpec(dim, (shape[dim] // parts,) * parts, tp_size, uneven=entry.uneven)
        return specs

    def build(self, module, entry, ctx):
        """``module`` itself, each split parameter replaced by this rank's slice (carrying its spec);
        with expert parallelism its ``num_experts`` divided. Works on the meta device."""
        slice_params(module, entry.specs, ctx.rank)
        if entry.expert_parallel:
            module.num_experts //= ctx.size
        return module

    def install(self, module, entry, ctx):
        """The pre-hook / hook pair around the module's forward: the tokens exchanged (expert
        parallelism) or the inputs copied into the region and the partial output all-reduced."""
        if ctx.size == 1:
            return []
        if entry.expert_parallel:
            hooks = ExpertParallelDispatch(ctx.group, module.num_experts)
            pre, post = hooks.dispatch, hooks.combine
        else:
            hooks = TensorParallelExperts(ctx.group, ctx.state,
                                          tuple(n for n, dim, _ in entry.params if dim == AFTER_SUM),
                                          entry.identity_experts)
            pre, post = hooks.enter, hooks.leave
        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True)]

    def explain(self, entry, param=None, source=""):
        if param is None and entry.expert_parallel:
            return "whole experts per rank (dim 0), tokens exchanged"
        return super().explain(entry, param, source)

    # -- transformers' plans: moe_tp_experts (and all_reduce on 3-D parameters, moe_identity_expert)
    def from_hf(self, imp, entry):
        """HF's experts module (``moe_tp_experts``; ``all_reduce`` on a module whose 3-D parameters
        the plan splits: inkling's shared experts) -> one ``experts`` rule made by
        :meth:`complete_hf`; ``moe_identity_expert`` inside it -> its ``identity_from``.
        Raises (``imp.error``): the entry on a layer, identity experts elsewhere, ``all_reduce``
        on anything else."""
        found = imp.scratch.setdefault(self.name, {"params": {}, "identity": {}})
        parent = entry.key.rpartition(".")[0]
        if entry.hf_style == "moe_identity_expert":
            if imp.plan.get(parent) != "moe_tp_experts":
                raise imp.error(f"{entry.where}: {_HF_IDENTITY}")
            found["identity"][parent] = entry.key  # counted once after the experts' sum
            return
        if entry.hf_style == "all_reduce":
            if imp.kinds(entry) != {None} or not any(
                    k.rpartition(".")[0] == entry.key and k in imp.param_keys and len(imp.param_keys[k][1]) == 3
                    for k in imp.plan):
                raise imp.error(f"{entry.where}: an all-reduce of a module's partial output (shared MoE experts) has "
                                f"no tpify style")
        elif imp.kinds(entry) != {None}:
            first = entry.names[0]
            raise imp.error(f"HF rule {entry.key!r} = 'moe_tp_experts' (module {first}, a "
                            f"{type(imp.modules[first]).__name__}): it applies to a module holding fused 3-D expert "
                            f"parameters, not to a layer")
        found["params"].setdefault(entry.key, {})

    def hf_param(self, imp, owner, leaf, hf_style, shape):
        owner_style = imp.plan.get(owner)
        if hf_style not in _HF_PARAM_STYLES or not (owner_style == "moe_tp_experts" and len(shape) in (2, 3)
                                                    or owner_style == "all_reduce" and len(shape) == 3):
            return False
        found = imp.scratch.setdefault(self.name, {"params": {}, "identity": {}})
        found["params"].setdefault(owner, {})[leaf] = hf_style  # one 'experts' rule per module: complete_hf
        return True

    def complete_hf(self, imp):
        """One ``experts`` rule per experts module, then the modules beside each holding bare
        parameters and no rule (the router, ``weight (E, H)``) kept whole."""
        found = imp.scratch.get(self.name, {"params": {}, "identity": {}})
        for key, hf_params in found["params"].items():
            params, note = _hf_experts_params(imp, key, hf_params)
            extra = {}
            if key in found["identity"]:
                extra["identity_from"] = _hf_identity_from(imp, key, found["identity"][key])
                note += (f"; zero-computation identity experts from index {extra['identity_from']} on, counted once "
                         f"after the sum")
            imp.add_rule(key, imp.by_key[key], self.name, note, params=params, **extra)
        for key in found["params"]:  # after every experts rule: shared experts beside routed ones are no router
            routers: dict[str, list[str]] = {}
            for name in imp.by_key[key]:
                parent = name.rpartition(".")[0]
                for rel, module in imp.modules.items():
                    if (rel.rpartition(".")[0] == parent and rel != name and rel not in imp.styles
                            and imp.kind(rel) is None and any(True for _ in module.parameters(recurse=False))):
                        routers.setdefault(imp.wildcard(rel), []).append(rel)
            for rkey, rels in routers.items():
                imp.replicate(rkey, rels, "beside the experts (a router): a full copy")


def _hf_experts_params(imp, key: str, hf_params: dict) -> tuple[dict, str]:
    """The ``params`` of the experts rule for HF's experts module ``key`` whose own parameters the
    plan splits (``hf_params``: leaf -> HF style), and the rule's note: each along its intermediate
    dimension, from transformers' interface flags where the module has them (``is_transposed``,
    ``is_concatenated``), else from HF's style (colwise: output features, rowwise: input;
    ``packed_*``: 2 parts); the biases the plan leaves out split with their weight, or kept whole
    and counted once (``down_proj_bias``: after_sum).

    Raises:
        RecipeError: the plan splits none of the module's parameters (each rank would add a copy).
    """
    names = imp.by_key[key]
    module = imp.modules[names[0]]
    own = dict(module.named_parameters(recurse=False))
    if not hf_params:
        raise imp.error(f"HF rule {key!r} = 'moe_tp_experts' (module {names[0]}, a {type(module).__name__}) sums the "
                        f"experts' outputs over the ranks, but the plan splits none of its parameters {sorted(own)} "
                        f"(each rank would add a whole copy)")
    transposed = getattr(module, "is_transposed", None)
    concatenated = getattr(module, "is_concatenated", None)
    params: dict[str, dict] = {}
    for leaf, hf_style in hf_params.items():
        ndim = own[leaf].dim() if leaf in own else 3
        column = hf_style.endswith("colwise")
        dim = (ndim - 2 if column else ndim - 1) if ndim == 3 else 1
        if isinstance(transposed, bool) and leaf in ("gate_up_proj", "up_proj", "down_proj") and ndim == 3:
            dim = {("down_proj", False): 2, ("down_proj", True): 1}.get((leaf, transposed), 2 if transposed else 1)
        parts = 2 if _HF_PARAM_STYLES[hf_style] else 1
        if leaf == "gate_up_proj" and isinstance(concatenated, bool):
            parts = 2 if concatenated else 1
        params[leaf] = {"dim": dim, **({"parts": parts} if parts > 1 else {})}
    for leaf, weight in (("gate_up_proj_bias", "gate_up_proj"), ("up_proj_bias", "up_proj")):
        if leaf in own and leaf not in params and weight in params:
            params[leaf] = {"dim": 1, **({"parts": params[weight]["parts"]} if "parts" in params[weight] else {})}
    if _DOWN_BIAS in own and _DOWN_BIAS not in params:
        params[_DOWN_BIAS] = {"after_sum": True}
    note = (f"HF {imp.plan.get(key, 'moe_tp_experts')} with {hf_params} ({type(module).__name__}, is_transposed = "
            f"{transposed}, is_concatenated = {concatenated}): every expert's intermediate dimension split, output "
            f"all-reduced")
    return params, note


def _hf_identity_from(imp, key: str, rule: str) -> str | int:
    """``identity_from`` of experts module ``key`` holding HF's ``moe_identity_expert`` (``rule``):
    the routed experts' count, ``n_routed_experts`` when it equals ``down_proj``'s dim 0.

    Raises:
        RecipeError: the module holds no 3-D ``down_proj`` to count its routed experts by.
    """
    names = imp.by_key[key]
    down = getattr(imp.modules[names[0]], "down_proj", None)
    if not isinstance(down, nn.Parameter) or down.dim() != 3:
        raise imp.error(f"HF rule {rule!r} = 'moe_identity_expert': {_HF_IDENTITY}; tpify counts identity experts "
                        f"once after the sum from the routed experts' count, which needs a 3-D down_proj (one per "
                        f"routed expert) on {names[0]}")
    return "n_routed_experts" if imp.config_int("n_routed_experts") == down.shape[0] else int(down.shape[0])


def _interface_problems(module: nn.Module, own: dict, params, expert_parallel: bool) -> list[str]:
    """What would split a transformers experts module wrong, from its interface flags and names:
    ``[gate | up]`` concatenated split as 2 parts, interleaved as one contiguous range, each
    parameter along its intermediate dimension, ``down_proj_bias`` kept whole (``after_sum``)."""
    problems = []
    transposed = getattr(module, "is_transposed", None)
    concatenated = getattr(module, "is_concatenated", None)
    for name, dim, parts in params:
        if dim == AFTER_SUM:
            if name != _DOWN_BIAS or getattr(module, "has_bias", False) is not True:
                problems.append(f"{name}: after_sum is for transformers' {_DOWN_BIAS} (has_bias = True), the bias "
                                f"added to each expert's output")
            continue
        if expert_parallel:
            continue
        if name == _DOWN_BIAS:
            problems.append(f"{name} is added to each expert's output after down_proj: split, it would be added "
                            f"tp_size times; give it after_sum = true")
        if name in _GATE_UP and concatenated is True and parts != 2:
            problems.append(f"{name} holds [gate | up] concatenated (is_concatenated = True): split it as parts = 2")
        if name in _GATE_UP and concatenated is False and parts != 1:
            problems.append(f"{name} holds gate and up interleaved [g0, u0, g1, u1, ...] (is_concatenated = "
                            f"False): two contiguous parts would cut it wrong; split it as one part (each rank a "
                            f"contiguous range of whole (gate, up) pairs)")
        want = _INTERMEDIATE_DIM.get(name, {}).get(transposed) if isinstance(transposed, bool) else None
        if want is not None and dim != want:
            problems.append(f"{name} has its intermediate dimension at dim {want} (is_transposed = {transposed}), "
                            f"not {dim}")
    named = {name for name, _, _ in params}
    if (not expert_parallel and getattr(module, "has_bias", False) is True and _DOWN_BIAS in own
            and _DOWN_BIAS not in named):
        problems.append(f"has_bias = True: name {_DOWN_BIAS} in params with after_sum = true")
    return problems


def _expert_parallel_problems(module, own, names) -> list[str]:
    """What expert parallelism needs of the module: ``num_experts`` = dim 0 of every split
    parameter, and transformers' experts signature ``(hidden_states, top_k_index, top_k_weights)``."""
    problems = []
    experts = getattr(module, "num_experts", None)
    sizes = {name: tuple(own[name].shape)[0] for name in names if name in own}
    if not isinstance(experts, int) or isinstance(experts, bool) or any(s != experts for s in sizes.values()):
        problems.append(f"expert parallelism splits dim 0 of {sorted(sizes)} (sizes {sorted(set(sizes.values()))}) "
                        f"as the experts, but its num_experts is {experts!r}")
    try:
        signature = list(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        signature = []
    if [_EXPERTS_ALIASES.get(name, name) for name in signature] != list(_EXPERTS_ARGUMENTS):
        problems.append(f"expert parallelism exchanges the arguments {list(_EXPERTS_ARGUMENTS)} of its forward, "
                        f"which takes {signature}")
    return problems
