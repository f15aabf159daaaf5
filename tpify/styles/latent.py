"""The ``latent`` style: a low-rank down projection of multi-head latent attention, whole on every rank.

DeepSeek-V2 (arXiv:2405.04434, section 2.1) compresses the keys and values of all heads into one
latent ``c = x W_DKV`` of ``kv_lora_rank`` features (and the queries into one of ``q_lora_rank``),
then up-projects it per head (``kv_b_proj``, ``q_b_proj``: ``colwise`` by heads); a decoupled
rotary key ``k_pe`` of ``qk_rope_head_dim`` features, the last outputs of the same ``nn.Linear``
(``kv_a_proj_with_mqa``), is shared by every head. Megatron-LM keeps such down projections whole
(``linear_q_down_proj``, ``linear_kv_down_proj``): small, and read by every head.

Gradients: the up projections' region entry (Megatron's ``f``) sums the latent's gradient over the
ranks; the rotary key reaches the heads without one, so :class:`LatentProjection` sums the gradient
of the last ``shared`` output features (one all-reduce of ``B*T*shared`` values in backward), as
transformers' ``mla_kv_a_proj`` does. It also ends the sharded region before the module (which reads
the replicated hidden states after the query's column layer ran), so that it and its norm are not
taken for replicated modules inside a region (tpify.hooks.region_grads: their gradients summed twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from ..hf_modules import config_get, dense_dims
from .base import RuleError, Style, config_ref_or_int

__all__ = ["Latent", "LatentOptions", "LatentProjection"]

_SHARED_ONLY = ("'shared' (the trailing output features every head reads, a config attribute name or a non-negative "
                "integer) is for style 'latent' only")


@dataclass(frozen=True)
class LatentOptions:
    """``latent``'s key: ``shared``, the trailing output features every head reads directly (the
    rotary key: a config attribute or a number), None: 0."""

    shared: str | int | None = None
    CONFIG_REFS = ("shared",)


class LatentProjection(comm.SharesProcessGroups):
    """The pre-hook / hook pair of one ``latent`` module (see the module docstring).

    Shapes: input ``(B, T, H)``, replicated; output ``(B, T, rank + shared)``, replicated, returned
    unchanged (a view carrying the gradient rule).
    Communication: forward none; backward one all-reduce (sum) of the gradient of the last
    ``shared`` output features, ``B*T*shared`` values (none when ``shared`` is 0).
    Raises:
        TypeError: the module returned something other than one tensor of at least ``shared``
            features (its output could not be split as the recipe says).
    """

    def __init__(self, tracker, group, shared: int, fqn: str):
        self.tracker, self.group, self.shared, self.fqn = tracker, group, shared, fqn

    def enter(self, module, args):
        """The hidden states it reads are replicated: any sharded region ends here."""
        if self.tracker is not None:
            self.tracker.leave_region(module, args)
        return None

    def leave(self, module, args, output):
        """The last ``shared`` features' gradient summed over the ranks (identity forward)."""
        if not self.shared or not torch.is_grad_enabled():
            return None
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[-1] < self.shared:
            raise TypeError(f"tpify: {self.fqn} (style 'latent', shared = {self.shared}) returned "
                            f"{type(output).__name__}{tuple(getattr(output, 'shape', ()))}, not one tensor whose last "
                            f"dimension holds the {self.shared} shared features")
        if not output.requires_grad:
            return None
        width = output.shape[-1]
        return comm.sum_grad_ranges([output], [(output.dim() - 1, [(width - self.shared, width)])], self.group)[0]


class Latent(Style):
    """``latent``: a full copy on every rank (nothing split; its hooks make the gradients whole).

    Errors (plan errors): ``shared`` not a non-negative integer below the output features.
    """

    name = "latent"
    kind = "linear"
    sequence_parallel = False
    sequence_parallel_refusal = ("the latent would be computed from T/p tokens and gathered by the up projections; "
                                 "not supported yet")
    KEYS = {"shared": _SHARED_ONLY}
    Options = LatentOptions

    @property
    def shards(self) -> bool:
        """A full copy: nothing is split (the hooks make its gradients whole)."""
        return False

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        shared = raw.get("shared")
        if shared is not None and not config_ref_or_int(shared, 0):
            raise RuleError(f"{where}: {_SHARED_ONLY}")
        return LatentOptions(shared)

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        given = rule.options.shared
        shared = given if not isinstance(given, str) else config_get(ctx.config, given)
        if shared is None and given is None:
            shared = 0
        if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < out_f:
            ctx.errors.append(f"{fqn} ({type(module).__name__}, latent): {rule.describe()} gives shared = "
                              f"{given!r} = {shared!r}, not an integer in [0, {out_f}) (its output features)")
            return False
        entry.shared_features = shared
        return True

    def install(self, module, entry, ctx):
        """The region ends before the module; the shared features' gradient is summed after it.
        Installed before tpify.hooks.region_grads (whose pre-hook on it must see the region ended)."""
        if ctx.size == 1:
            return []
        hooks = LatentProjection(ctx.rng, ctx.group, entry.shared_features, entry.fqn)
        return [module.register_forward_pre_hook(hooks.enter), module.register_forward_hook(hooks.leave)]

    def explain(self, entry, param=None, source=""):
        if param is None:
            return ""
        shared = (f"; the gradient of its last {entry.shared_features} output features (read by every head) summed"
                  if entry.shared_features else "")
        return f"style latent: a low-rank latent every head reads, a full copy on every rank{shared}"

    # -- transformers' plans: mla_kv_a_proj ----------------------------------------------------
    def from_hf(self, imp, entry):
        """HF's ``mla_kv_a_proj`` (MlaKvAProjParallel: whole, the rope part's gradient all-reduced)."""
        rope = getattr(imp.config, "qk_rope_head_dim", None)
        if imp.kinds(entry) != {"linear"} or not isinstance(rope, int) or isinstance(rope, bool):
            raise imp.error(f"{entry.where}: mla_kv_a_proj applies to an nn.Linear whose last config."
                            f"qk_rope_head_dim output features are the rotary key (here {rope!r})")
        imp.add_rule(entry.key, entry.names, self.name, "HF mla_kv_a_proj: the KV latent and rotary key, whole on every "
                                                        "rank; the rotary key's gradient summed over the ranks",
                     shared="qk_rope_head_dim")
        imp.heads_divisible = True  # its up projections are split by whole heads

    def complete_hf(self, imp):
        """Beside the imported latents: the rotary key's norms HF marks ``replicated_with_grad_allreduce``
        (:func:`_rotary_key_norms`) and the query latent HF's plan leaves out (:func:`_query_latents`)."""
        if not any(s is self for s in imp.styles.values()):
            return
        if imp.by_construction:
            _rotary_key_norms(self, imp)
        _query_latents(self, imp)


def _rotary_key_norms(latent: Latent, imp) -> None:
    """HF's ``replicated_with_grad_allreduce`` next to multi-head latent attention.

    A norm of the rotary key (its weight ``(qk_rope_head_dim,)``: dots3's ``k_rope_only_layernorm``)
    runs between the latent projection, which ends the sharded region, and the heads, which each
    rank holds only some of: its gradient is partial on each rank, so it becomes
    ``replicate_sum_grads``. A norm as wide as a latent (``kv_a_layernorm``) feeds a column-parallel
    up projection that sums its gradient already (HF's all-reduce would count it ``tp_size`` times):
    refused, as is a rotary-key width equal to a latent's. Other such modules stay found by construction.
    """
    rope = imp.config_int("qk_rope_head_dim")
    ranks = {v for v in (imp.config_int("kv_lora_rank"), imp.config_int("q_lora_rank")) if v}
    for key in list(imp.by_construction):
        names = imp.by_key.get(key, [])
        widths = {tuple(p.shape) for n in names for p in imp.modules[n].parameters(recurse=False)}
        if rope and widths == {(rope,)} and rope not in ranks:
            imp.by_construction.remove(key)
            imp.add_rule(key, names, "replicate_sum_grads",
                         f"HF replicated_with_grad_allreduce next to mla_kv_a_proj: it normalises the rotary key "
                         f"(qk_rope_head_dim = {rope} wide), which the latent projection's region end leaves outside "
                         f"the sharded region while only this rank's heads read it: its gradient summed over the ranks")
        elif any(w[-1] in ranks for w in widths if w):
            raise imp.error(f"HF marks {key} replicated_with_grad_allreduce next to multi-head latent attention "
                            f"(mla_kv_a_proj), but its parameters {sorted(widths)} are as wide as a latent "
                            f"({sorted(ranks)}): a latent's norm feeds a column-parallel up projection, whose region "
                            f"entry sums its gradient already (summing it again would count it tp_size times), and a "
                            f"rotary-key norm as wide as a latent cannot be told from it. Give it style "
                            f"'replicate_sum_grads' in a recipe only if only this rank's heads read its output, else "
                            f"'replicate', and prove it with tpify verify")


def _query_latents(latent: Latent, imp) -> None:
    """``latent`` (no shared features) for the query's down projection ``q_a_proj`` beside a latent KV
    projection, where HF's plan leaves it out and the attention holds a column layer reading the same
    hidden states (hy_v4's output gate): that layer starts a sharded region, in which ``q_a_proj``
    and its norm would be taken for replicated modules (their whole gradients summed again)."""
    found: dict[str, list[str]] = {}
    for rel, style in imp.styles.items():
        parent = rel.rpartition(".")[0]
        q_a = f"{parent}.q_a_proj" if parent else "q_a_proj"
        if style is not latent or q_a not in imp.modules or q_a in imp.styles or imp.kind(q_a) != "linear":
            continue
        reads = dense_dims(imp.modules[q_a])[0]
        if any(s.column and not s.packed and r.rpartition(".")[0] == parent
               and dense_dims(imp.modules[r])[0] == reads and r not in (f"{parent}.q_b_proj", f"{parent}.kv_b_proj")
               for r, s in imp.styles.items()):
            found.setdefault(imp.wildcard(q_a), []).append(q_a)
    for key, names in found.items():
        imp.add_rule(key, names, latent.name, "beside mla_kv_a_proj, not in HF's plan: the query latent, whole on "
                                              "every rank; it reads the replicated hidden states, so the sharded "
                                              "region that a column layer reading them too (a gate) may have started "
                                              "ends there")
