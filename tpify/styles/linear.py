"""The linear styles: ``colwise``, ``packed_colwise``, ``colwise_rep`` and ``rowwise``.

Megatron-LM (arXiv:1909.08053, section 3): column-parallel ``Y = X [A_1 ... A_p]`` (output
features split, output left sharded), row-parallel ``Y = reduce(X_r A_r) + b`` (input features
split, one all-reduce forward, the bias added once after it). ``nn.Linear`` weights are
``[out, in]``, transformers ``Conv1D`` weights ``[in, out]``; the specs say which dimension splits
(:mod:`tpify.sharding`). docs/recipes.md has every key with an example.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..hf_modules import config_get, dense_dims, module_kind
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..sharding import column_specs, pad_vocab_size, row_spec
from .base import KV_HEADS_ONLY, RuleError, Style, config_ref_or_int

__all__ = ["Colwise", "PackedColwise", "ColwiseRep", "Rowwise", "PackedOptions", "packed_part_sizes"]


class Colwise(Style):
    """``colwise``: :class:`ColumnParallelLinear`, the output features split, output left sharded.

    With the rule's ``kv_heads`` (a K/V projection): split by KV heads when ``tp_size`` divides
    them, else each KV head held by the ``tp_size / kv_heads`` ranks whose query heads read it.
    Raises (plan errors): out_features ``tp_size`` does not divide where the layer holds heads.
    """

    name = "colwise"
    kind = "linear"
    region = "start"
    KEYS = {"kv_heads": KV_HEADS_ONLY}
    hf_note = "HF {hf_style}: output features split"

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        if "kv_heads" in raw and not config_ref_or_int(raw["kv_heads"], 1):
            raise RuleError(f"{where}: {KV_HEADS_ONLY}")
        return self.Options()

    def head_owner(self, fqn, module, rule, widths):
        if module_kind(module) != "linear":
            return None
        _, out_f, _ = dense_dims(module)
        return fqn.rpartition(".")[0] if self._by_heads(rule) or out_f in widths else None

    def _by_heads(self, rule) -> bool:
        """The rule says the layer's width is heads (KV heads, parts weighed by head counts)."""
        return rule.kv_heads is not None

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        if rule.kv_heads is not None:  # K/V projections: KV heads split, or each held by a group of ranks
            kv = ctx.kv_heads(rule, fqn)
            shards = None if kv is None else ctx.kv_placement(f"{fqn} ({type(module).__name__}, colwise, kv_heads = "
                                                           f"{rule.kv_heads})", kv)
            if kv is None or shards is False:  # the error is recorded (the layout is refused); the module is
                entry.replicated_parts = (0,)  # covered, with specs that hold (whole on every rank)
                return True
            if shards is not None:
                entry.replicated_parts, entry.replica_shards = (0,), shards
                return True
        ctx.split_size(fqn, f"{fqn}.out_features ({type(module).__name__}, colwise)", out_f, entry)
        return True

    def param_specs(self, module, entry, tp_size):
        _, out_f, layout = dense_dims(module)
        weight, bias = column_specs(out_f, tp_size, layout, entry.partition_sizes, entry.padded_size,
                                    entry.replicated_parts, entry.replica_shards, entry.uneven)
        return {"weight": weight, "bias": bias if module.bias is not None else None}

    def build(self, module, entry, ctx):
        return ColumnParallelLinear.from_dense(
            module, ctx.group, gather_output=self.lm_head, partition_sizes=entry.partition_sizes,
            padded_out_features=entry.padded_size, replicated_parts=entry.replicated_parts,
            replica_shards=entry.replica_shards, sequence_parallel=entry.sequence_parallel, uneven=entry.uneven,
            context=ctx)


@dataclass(frozen=True)
class PackedOptions:
    """``packed_colwise``'s keys: ``parts`` (a count of equal parts, or the config attributes /
    integers weighing them) and ``replicated_parts`` (part indices split by KV heads)."""

    parts: int | tuple[str | int, ...]
    replicated_parts: tuple[int, ...] = ()
    CONFIG_REFS = ("parts",)


class PackedColwise(Colwise):
    """``packed_colwise``: column-parallel, each packed part (GPT-2's ``[Q | K | V]``, grouped-query
    parts of unequal widths) split separately, so rank ``r`` holds ``[Q_r | K_r | V_r]``.

    ``replicated_parts`` (the K/V parts, of ``kv_heads`` heads, 1 by default: multi-query) split
    by KV heads when ``tp_size`` divides them, else each KV head held by ``tp_size / kv_heads``
    ranks. Equal parts (``parts = <n>``, nothing replicated) may split unevenly where the planner
    finds no heads; parts weighed by head counts never are.
    Raises (plan errors): a weight that is not a positive integer, or that the owning module
    contradicts (falcon's ``num_kv_heads``); out_features not a multiple of the weights' sum.
    """

    name = "packed_colwise"
    packed = True
    KEYS = {"parts": "'parts' is only for style 'packed_colwise'",
            "replicated_parts": "'replicated_parts' is for style 'packed_colwise': a list of distinct part indices "
                                "naming some, not all, of its parts",
            "kv_heads": KV_HEADS_ONLY}
    Options = PackedOptions
    hf_note = "HF {hf_style} (PackedColwiseParallel, split_factor 2): two equal packed parts, each split"

    def read_rule(self, raw, where):
        self.refuse_foreign(raw, where)
        parts = raw.get("parts")
        if parts is None:
            raise RuleError(f"{where}: style 'packed_colwise' needs 'parts'")
        ok = (isinstance(parts, int) and not isinstance(parts, bool) and parts >= 2) or (
            isinstance(parts, list) and len(parts) >= 2 and all(config_ref_or_int(p, 1) for p in parts))
        if not ok:
            raise RuleError(f"{where}: 'parts' must be an integer >= 2 (equal parts) or a list of >= 2 weights, each "
                            f"a config attribute name or a positive integer")
        parts = parts if isinstance(parts, int) else tuple(parts)
        count = parts if isinstance(parts, int) else len(parts)
        replicated = raw.get("replicated_parts", [])
        if replicated and (not isinstance(replicated, list)
                           or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count
                                      for i in replicated)
                           or len(set(replicated)) != len(replicated) or len(replicated) >= count):
            raise RuleError(f"{where}: 'replicated_parts' is for style 'packed_colwise': a list of distinct part "
                            f"indices (0-based, below {count}) naming some, not all, of the parts")
        if "kv_heads" in raw and (not replicated or not config_ref_or_int(raw["kv_heads"], 1)):
            raise RuleError(f"{where}: {KV_HEADS_ONLY}")
        return PackedOptions(parts, tuple(replicated))

    def _by_heads(self, rule):
        options = rule.options
        return rule.kv_heads is not None or bool(options.replicated_parts) or not isinstance(options.parts, int)

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        owner = ctx.model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else None
        if ctx.packed_sizes is not None:
            sizes = ctx.packed_sizes(rule, out_f, owner, fqn)
        else:
            sizes = packed_part_sizes(rule, out_f, ctx.config, owner, fqn, ctx.errors)
        if sizes is None:
            return False
        entry.partition_sizes = sizes
        replicated = rule.options.replicated_parts
        if replicated:
            kv = 1 if rule.kv_heads is None else ctx.kv_heads(rule, fqn)
            shards = None if kv is None else ctx.kv_placement(
                f"{fqn} ({type(module).__name__}, packed_colwise, parts {list(replicated)} of kv_heads = "
                f"{1 if rule.kv_heads is None else rule.kv_heads})", kv)
            if kv is None or shards is False:  # the error is recorded (the layout is refused); the module is
                entry.replicated_parts = replicated  # covered, with specs that hold
            elif shards is not None:
                entry.replicated_parts, entry.replica_shards = replicated, shards
        equal = isinstance(rule.options.parts, int) and not entry.replicated_parts and rule.kv_heads is None
        for i, size in enumerate(sizes):
            if i in entry.replicated_parts:
                continue
            what = f"{fqn} packed part {i} of out_features"
            if equal:
                ctx.split_size(fqn, what, size, entry)
            else:  # parts weighed by head counts: whole heads per rank
                ctx.need_divisible(what, size)
        return True

    def from_hf(self, imp, entry):
        if imp.kinds(entry) != {"linear"}:
            raise imp.error(f"{entry.where}: HF packs MoE expert weights here (fused 3-D parameters); {imp.moe_hint}")
        super().from_hf(imp, entry)

    def hf_options(self, imp, entry):
        return {"parts": 2}  # HF's PackedColwiseParallel: split_factor 2, [gate | up]


def packed_part_sizes(rule, out_features: int, config, owner: nn.Module | None, fqn: str,
                      errors: list[str]) -> list[int] | None:
    """Global widths of a ``packed_colwise`` layer's parts: ``out_features`` split in proportion to
    the rule's ``parts`` weights, or None after recording an error.

    A weight named by a config attribute is checked against the attribute of the same name on the
    module that owns the layer (the attention module): HF code views the packed output with the
    module's value, and a config that says otherwise (falcon's ``num_kv_heads`` in multi-query
    mode: 4 in the config, 1 in the module) would mis-split the weight.
    """
    parts = rule.options.parts
    if isinstance(parts, int):
        weights = [1] * parts
    else:
        weights = []
        for name in parts:
            if isinstance(name, int):
                weights.append(name)
                continue
            value = config_get(config, name)
            if not isinstance(value, int):
                errors.append(f"{fqn}: {rule.describe()} weighs its parts by config.{name}, which is {value!r}")
                return None
            used = getattr(owner, name.rpartition(".")[2], None) if owner is not None else None
            if isinstance(used, int) and not isinstance(used, bool) and used != value:
                errors.append(f"{fqn}: {rule.describe()} weighs its parts by config.{name} = {value}, but the module "
                              f"that owns it ({type(owner).__name__}) has {name} = {used}, which its forward uses; "
                              f"weigh the parts by what the module uses (a literal integer, or a 'when' condition "
                              f"for this configuration)")
                return None
            weights.append(value)
    total = sum(weights)
    if out_features % total:
        errors.append(f"{fqn}: out_features = {out_features} cannot be split in parts weighed {weights}")
        return None
    return [out_features // total * w for w in weights]


class ColwiseRep(Colwise):
    """``colwise_rep``: the LM head, column-parallel over the vocabulary, padded when ``p`` does not
    divide it, the logits gathered (padding stripped) or kept sharded for the parallel loss."""

    name = "colwise_rep"
    region = None
    lm_head = True
    vocab_rows = True
    KEYS = {}

    def head_owner(self, fqn, module, rule, widths):
        return None

    def _sizes(self, ctx, fqn, module, rule, entry):
        _, out_f, _ = dense_dims(module)
        if out_f % (ctx.pad_vocab_multiple * ctx.tp_size):
            entry.padded_size = pad_vocab_size(out_f, ctx.tp_size, ctx.pad_vocab_multiple)
        return True

    def from_hf(self, imp, entry):
        """HF's gathered column layer: on a head-class module, the vocabulary-parallel LM head; inside
        the base model a full copy (HF gathers its output, so every rank computes the whole
        activation: exact); a ModuleList of heads (one per code group) each kept whole."""
        modules = [imp.modules[n] for n in entry.names]
        if imp.kinds(entry) == {None} and all(isinstance(m, nn.ModuleList) and len(m)
                                              and all(module_kind(c) == "linear" for c in m) for m in modules):
            imp.replicate(entry.key, entry.names,
                          f"HF {entry.hf_style} on a ModuleList of heads (one Linear per code group, the forward "
                          f"picks one per call: lm_head[generation_steps]); HF gathers their logits, and tpify's "
                          f"vocabulary-parallel LM head is one layer per model: each kept whole (exact; HF's loss on "
                          f"the whole logits)")
            return
        imp.require_kind(entry, "linear")
        if imp.keep_overridden(entry):
            return
        if not all(imp.inside[n] for n in entry.names):
            imp.add_rule(entry.key, entry.names, self.name, f"HF {entry.hf_style} on the head: vocabulary-parallel LM "
                                                             f"head, logits gathered")
        else:
            imp.replicate(entry.key, entry.names,
                          f"HF {entry.hf_style}: HF gathers this layer's output, so every rank computes the full "
                          f"activation; tpify's exact equivalent is a full copy (review: a packed layer could be "
                          f"packed_colwise, with its consumer rowwise)")


class Rowwise(Style):
    """``rowwise``: :class:`RowParallelLinear`, the input features split (the input already
    sharded), the bias replicated and added once after the all-reduce (one all-reduce forward)."""

    name = "rowwise"
    kind = "linear"
    region = "end"
    hf_note = "HF {hf_style}: input features split, output all-reduced"

    def head_owner(self, fqn, module, rule, widths):
        if module_kind(module) != "linear":
            return None
        in_f, _, _ = dense_dims(module)
        return fqn.rpartition(".")[0] if in_f in widths else None

    def _sizes(self, ctx, fqn, module, rule, entry):
        in_f, _, _ = dense_dims(module)
        ctx.split_size(fqn, f"{fqn}.in_features ({type(module).__name__}, rowwise)", in_f, entry)
        return True

    def param_specs(self, module, entry, tp_size):
        in_f, _, layout = dense_dims(module)
        return {"weight": row_spec(in_f, tp_size, layout, entry.uneven), "bias": None}

    def build(self, module, entry, ctx):
        return RowParallelLinear.from_dense(module, ctx.group, input_is_parallel=True,
                                            sequence_parallel=entry.sequence_parallel, uneven=entry.uneven, context=ctx)

    def explain(self, entry, param=None, source=""):
        if param == "bias":
            return "bias of a rowwise layer: whole on every rank, added once after the all-reduce"
        return super().explain(entry, param, source)

    def complete_hf(self, imp):
        """HF's ``rowwise`` on a layer that no split layer beside it feeds becomes ``replicate``.

        HF's ``RowwiseParallel`` shards a whole input itself, so its plan may match a row layer
        whose module splits nothing (glm5_next's linear-attention ``o_proj`` under the latent
        attention's glob); tpify's reads an input already split (``input_is_parallel``). Where the
        layers beside it in its module (above wrappers of that one layer) are all whole, its input
        is whole, and a full copy is exact: the rule is narrowed to the layers with a split input."""
        modules, styles = imp.modules, imp.styles

        def owner(rel: str) -> str:
            parent = rel.rpartition(".")[0]
            while parent and sum(1 for c in modules[parent].children() if any(True for _ in c.parameters())) == 1:
                parent = parent.rpartition(".")[0]
            return parent

        def orphan(rel: str) -> bool:
            """Other layers beside it, none split (a layer alone in its module keeps HF's rowwise)."""
            inside = [o for o in modules if o.startswith(owner(rel) + ".") and o != rel and not rel.startswith(o + ".")
                      and module_kind(modules[o]) == "linear"]
            return bool(inside) and not any(styles[o].column for o in inside if o in styles)

        orphans = [r for r, s in styles.items() if s is self and "." in r and orphan(r)]
        if not orphans:
            return
        for item in list(imp.rules):
            rule, note = item
            if rule.get("style") != self.name:
                continue
            covered = [r for r in imp.covered_by(rule) if styles.get(r) is self]
            lost = [r for r in covered if r in orphans]
            if not lost:
                continue
            kept = [r for r in covered if r not in orphans]
            imp.rules.remove(item)
            if kept:
                imp.add_rule(imp.wildcard(kept[0]), kept, self.name, note,
                             **{k: v for k, v in rule.items() if k not in ("match", "style")})
            for name in lost:
                del styles[name]
            imp.replicate(imp.wildcard(lost[0]), lost,
                          "HF rowwise, but no column-split layer beside it feeds it (HF's row layer shards a whole "
                          "input itself; tpify's reads a split one): its input is whole, so a full copy (exact)")
