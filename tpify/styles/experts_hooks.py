"""The ``experts`` style's hooks: fused MoE experts split over the TP group, around their own forward.

* :class:`TensorParallelExperts` (``ep_size = 1``): every rank holds every expert's intermediate
  slice; Megatron's ``f`` on the inputs and ``g`` on the output: one all-reduce of ``(N, H)``
  each way per layer (Megatron-LM, arXiv:1909.08053, section 3).
* :class:`ExpertParallelDispatch` (``ep_size = tp_size``): rank ``r`` holds experts
  ``[r E/p, (r+1) E/p)`` whole; its rows of tokens go to the experts' ranks and back by two
  all-to-alls, then the rows are all-gathered (GShard, arXiv:2006.16668).

The router stays replicated (routing and ``aux_loss`` as in the dense model). The maths and the
gradients: docs/recipes.md, "tpify/styles/experts_hooks.py".
"""

from __future__ import annotations

import torch

from .. import comm
from ..syncs import host_sync

__all__ = ["TensorParallelExperts", "ExpertParallelDispatch"]

_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
#: Other names of the same arguments (gpt-oss's experts forward).
_ALIASES = {"router_indices": "top_k_index", "routing_weights": "top_k_weights"}


class TensorParallelExperts(comm.SharesProcessGroups):
    """The pre-hook / hook pair of one tensor-parallel experts module (see the module docstring).

    ``biases``: the module's whole biases added to each expert's output (gpt-oss's
    ``down_proj_bias (E, H)``, the rule's ``after_sum``): each rank's partial output holds
    ``sum_k w_k b[e_k]`` once, so after the all-reduce it is subtracted ``p - 1`` times
    (:meth:`bias_term`), which leaves every value and gradient the dense one.

    Shapes: inputs ``hidden_states (N, H)``, ``top_k_index (N, k)``, ``top_k_weights (N, k)``,
    replicated; output ``(N, H)``, the module's partial sum in, the total out (every rank).
    Communication: forward one all-reduce of ``N * H`` values; backward one all-reduce of the
    floating inputs' gradients together (``N * (H + k)`` values), none when no input needs one.
    Inside a mixture-of-experts block whose tokens sequence parallelism gathered
    (:attr:`~tpify.context.CallState.moe_gathered`): the hidden states' partial gradient is left
    to the gather's reduce-scatter and the output, a partial sum, to the block's reduce-scatter
    (:mod:`tpify.hooks.sequence_parallel`); only the routing weights' gradient is all-reduced
    here (``N * k`` values), since the router's own gradient must be complete on every rank.
    Raises:
        TypeError: the module returned something other than one tensor (it could not be summed);
            with ``biases``, a call without the routing arguments.
    """

    def __init__(self, group, state, biases: tuple[str, ...] = (), identity: int | None = None):
        self.group, self.state = group, state
        self.biases = biases  # whole biases added to each expert's output (down_proj_bias): counted once
        self.identity = identity  # the first index of the identity experts (longcat_flash), or None
        self.pending = None  # the call's (top_k_index, top_k_weights, hidden_states), as given, for the biases

    def __deepcopy__(self, memo):  # a copy of the module runs its own calls
        new = super().__deepcopy__(memo)
        new.pending = None
        return new

    def enter(self, module, args, kwargs):
        """Megatron's ``f`` on every floating input that needs a gradient (one all-reduce in backward).

        The routing weights enter in the hidden states' dtype when it is wider (Mixtral's router
        gives float32 weights to a float64 model): the products ``w * expert(x)`` have that dtype
        anyway, so the forward is unchanged, and each rank's partial gradient of the weights is
        summed before it is rounded to their own dtype, as the dense model rounds the whole one
        (rounded per rank, the float32 gradient of the router would differ by its rounding)."""
        if self.biases or self.identity is not None:
            bound = _bind(args, kwargs)
            self.pending = (bound.get("top_k_index"), bound.get("top_k_weights"), bound.get("hidden_states"))
        if not torch.is_grad_enabled():
            return None
        args, kwargs = _widen_weights(module, args, kwargs)
        places = [("a", i, t) for i, t in enumerate(args)] + [("k", n, t) for n, t in kwargs.items()]
        places = [(where, key, t) for where, key, t in places
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        if self.state.moe_gathered:  # the hidden states' gradient: summed by the sequence gather's reduce-scatter
            places = [(where, key, t) for where, key, t in places if key not in (0, "hidden_states")]
        if not places:
            return None
        copied = comm.copy_many_to_tp_region([t for _, _, t in places], self.group)
        args = list(args)
        for (where, key, _), new in zip(places, copied):
            if where == "a":
                args[key] = new
            else:
                kwargs[key] = new
        return tuple(args), kwargs

    def leave(self, module, args, kwargs, output):
        """Megatron's ``g``: the partial sums of every rank added up (one all-reduce forward); in a
        gathered MoE block the partial sum itself (the block reduce-scatters it)."""
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} (style 'experts') returned a {type(output).__name__}; tpify sums "
                            f"one output tensor over the TP group")
        if self.state.moe_gathered:  # partial sum, reduce-scattered by the block (no after-sum biases: layout)
            return None
        total = comm.reduce_from_tp_region(output, self.group)
        if self.biases or self.identity is not None:
            (index, weights, hidden), self.pending = self.pending, None
            extra = (self.bias_term(module, index, weights, total.dtype) if self.biases else 0) + (
                self.identity_term(module, index, weights, hidden, total.dtype) if self.identity is not None else 0)
            total = total - (comm.group_size(self.group) - 1) * extra
        return total

    def identity_term(self, module, index, weights, hidden, dtype) -> torch.Tensor:
        """``sum_k [e_k >= identity] w_k x`` per token ``(N, H)``: what the zero-computation identity
        experts add (longcat_flash: ``LongcatFlashExperts`` returns the token itself, weighted, for an
        expert index at or above its ``num_routed_experts``). Every rank's partial output holds it
        whole, so the hook subtracts it ``p - 1`` times, from the inputs as given (not the region
        copies), as :meth:`bias_term`: the gradients of ``x`` and ``w`` through it reach each rank once
        and leave, with the copies' ``p`` times summed, the dense ones."""
        if index is None or weights is None or hidden is None:
            raise TypeError(f"{type(module).__name__} (style 'experts', identity experts from index {self.identity}): "
                            f"called without {list(_ARGUMENTS)}, from which tpify counts them once")
        chosen = (weights.to(dtype) * (index >= self.identity).to(dtype)).sum(dim=-1, keepdim=True)  # (N, 1)
        return hidden.to(dtype) * chosen

    def bias_term(self, module, index: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
        """``sum_k w_k b[e_k]`` per token ``(N, H)``: what the module's whole biases add to its
        output. Every rank's partial output holds it once, so the sum over the ranks holds it
        ``p`` times; the hook subtracts it ``p - 1`` times, computed from the routing as given
        (not the region copy: its gradient reaches the routing weights once per rank, which with
        the copy's summed ``p`` times leaves the dense one) and the biases detached (their gradient
        comes whole, on every rank, from the rank's own output)."""
        if index is None or weights is None:
            raise TypeError(f"{type(module).__name__} (style 'experts', biases {list(self.biases)} after the sum): "
                            f"called without {list(_ARGUMENTS[1:])}, from which tpify counts the biases once")
        term = 0
        for name in self.biases:
            bias = getattr(module, name).detach()  # (E, H)
            term = term + (weights.to(dtype).unsqueeze(-1) * bias[index].to(dtype)).sum(dim=1)
        return term


def _bind(args: tuple, kwargs: dict) -> dict:
    """The call's transformers experts arguments by name (positional ones by position, keyword
    ones by their name or an alias of it: gpt-oss's ``router_indices``, ``routing_weights``)."""
    bound = dict(zip(_ARGUMENTS, args))
    bound.update({_ALIASES.get(k, k): v for k, v in kwargs.items() if _ALIASES.get(k, k) in _ARGUMENTS})
    return bound


def _widen_weights(module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``top_k_weights`` cast to ``promote_types(its dtype, hidden_states' dtype)``, for a call with
    transformers' experts arguments; other calls unchanged."""
    bound = _bind(args, kwargs)
    hidden, weights = bound.get("hidden_states"), bound.get("top_k_weights")
    if not (isinstance(hidden, torch.Tensor) and isinstance(weights, torch.Tensor) and hidden.is_floating_point()
            and weights.is_floating_point()):
        return args, kwargs
    wide = torch.promote_types(weights.dtype, hidden.dtype)
    if wide == weights.dtype:
        return args, kwargs
    key = next((k for k in kwargs if _ALIASES.get(k, k) == "top_k_weights"), None)
    if key is not None:
        return args, {**kwargs, key: weights.to(wide)}
    position = _ARGUMENTS.index("top_k_weights")
    return args[:position] + (weights.to(wide),) + args[position + 1:], kwargs


class ExpertParallelDispatch(comm.SharesProcessGroups):
    """The pre-hook / hook pair of one expert-parallel experts module (see the module docstring).

    The pre-hook replaces the call's arguments by this rank's received tokens ``(M, H)``, their
    local expert ids ``(M, 1)`` and unit weights ``(M, 1)``; the module's own forward runs its
    ``E/p`` experts on them (its ``num_experts`` is ``E/p``); the hook sends the results back and
    returns the layer's output ``(N, H)``, replicated. A rank that receives no token runs its
    experts on one zero row (dropped after), so that its experts' gradients exist (zero) and its
    ranks' exchanges stay paired in backward.

    Communication, per call: forward one all-to-all of the ``p x E/p`` counts, two all-to-alls of
    the routed rows (``N k / p`` rows of ``H`` values per rank on average) and one all-gather of
    the output rows; backward two all-to-alls and one all-gather (the rows' gradients). One host
    sync per call, the only one of a training step under expert parallelism: ``all_to_all_single``
    takes the split sizes (how many rows go to and come from each rank) as host integers, so the
    counts are read back after their exchange (both in one copy, marked by
    :func:`tpify.syncs.host_sync`); the rest (counts in a fixed-size buffer, the received ids
    expanded with their known total) reads nothing. A fixed-capacity layout (every rank sending
    ``capacity`` rows to every rank, padded) would need no sync but drop or pad tokens (GShard's
    capacity factor), which changes the result; tpify keeps the exact dense result.
    Raises:
        TypeError: the module returned something other than one tensor.
    """

    def __init__(self, group, local_experts: int):
        self.group = group
        self.local_experts = local_experts
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        self.pending = None  # what the pre-hook of the call in flight leaves its hook

    def __deepcopy__(self, memo):  # a copy of the module runs its own calls
        new = super().__deepcopy__(memo)
        new.pending = None
        return new

    def dispatch(self, module, args, kwargs):
        bound = _bind(args, kwargs)
        rest = {k: v for k, v in kwargs.items() if _ALIASES.get(k, k) not in _ARGUMENTS}
        hidden, index, weights = (bound[name] for name in _ARGUMENTS)  # (N, H), (N, k), (N, k)
        rows, top_k = index.shape
        a, b = comm.row_range(rows, self.size, self.rank)
        mine = comm.scatter_rows(hidden, self.group)  # (N_r, H)
        my_weights = comm.scatter_rows(weights, self.group)  # (N_r, k)
        experts = index[a:b].reshape(-1)  # (N_r k,) global expert ids
        order = torch.argsort(experts, stable=True)  # by expert, so by owner rank
        send = mine[order // top_k]
        # the count per expert in a buffer of fixed size (bincount would read the largest id on the host)
        counts = experts.new_zeros(self.local_experts * self.size).index_add_(0, experts, torch.ones_like(experts))
        counts = counts.view(self.size, self.local_experts)
        received = comm.all_to_all_counts(counts, self.group)  # (p, E/p): row s from rank s
        with host_sync("expert-parallel all-to-all split sizes"):  # all_to_all_single takes them from the host
            sizes = torch.stack([counts.sum(dim=1), received.sum(dim=1)]).tolist()
        send_sizes, recv_sizes = sizes
        tokens = comm.all_to_all_rows(send, send_sizes, recv_sizes, self.group)  # (M, H)
        local_ids = torch.arange(self.local_experts, device=index.device).repeat(self.size)
        local_ids = local_ids.repeat_interleave(received.reshape(-1), output_size=sum(recv_sizes))
        count = tokens.shape[0]
        if count == 0:  # one zero row, connected to the exchange
            tokens, local_ids = tokens.sum(dim=0, keepdim=True), local_ids.new_zeros(1)
        self.pending = (order, send_sizes, recv_sizes, my_weights, rows, top_k, count, hidden.dtype)
        unit = torch.ones((tokens.shape[0], 1), dtype=weights.dtype, device=weights.device)
        return (tokens, local_ids.unsqueeze(-1), unit), rest

    def combine(self, module, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} (style 'experts') returned a {type(output).__name__}; tpify "
                            f"exchanges one output tensor")
        (order, send_sizes, recv_sizes, my_weights, rows, top_k, count, dtype), self.pending = self.pending, None
        back = comm.all_to_all_rows(output[:count], recv_sizes, send_sizes, self.group)  # (N_r k, H), by expert
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_slot = back[inverse].view(-1, top_k, back.shape[-1])  # (N_r, k, H), the call's order
        mine = (per_slot * my_weights.unsqueeze(-1)).sum(dim=1)  # (N_r, H)
        return comm.gather_rows(mine.to(dtype), rows, self.group)

