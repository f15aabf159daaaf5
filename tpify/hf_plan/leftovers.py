"""What transformers' plans leave out, completed by the import (:func:`tpify.hf_plan.import_hf_plan`).

A tied LM head follows its embedding; a parameter holding all heads that the plan leaves whole
is refused; every layer the plan does not name is kept whole (task heads optional), and so are
bare parameters of 2 or more dimensions outside any layer; the head counts (``divisible``), the
K/V rules' ``kv_heads``, the attributes the attention forwards read (``divide``). Pure; each step
reads and extends an :class:`~tpify.hf_plan.state.HFImport`. docs/families.md.
"""

from __future__ import annotations

import re

from torch import nn

from ..hf_modules import forward_source, head_dims, module_kind
from ..recipe import RecipeError, _compile_glob
from ..styles import STYLES
from .state import HFImport, out_features, wildcard

__all__ = ["TASK_HEADS", "tie_heads", "check_per_head_params", "fill", "bare_parameters", "head_count_rules",
           "forward_reads"]

# Small task heads of the head classes, kept whole (optional: a head class may lack them).
TASK_HEADS = ("score", "qa_outputs", "classifier")
_KV_HEADS = "num_key_value_heads"
_KV_GROUPS = "num_key_value_groups"  # query heads per KV head, read by transformers' attention functions
_DIVIDE_NAME = re.compile(r"(head|hidden_size|embed_dim|split_size|inner_dim)", re.I)
_NOT_DIVIDE_NAME = re.compile(r"(head_dim|head_size|group|per_head)", re.I)


def tie_heads(imp: HFImport) -> None:
    """A head tied to an embedding gets the style that shards the tied weight alike (the
    embedding style's ``tied_head``: ``colwise_rep`` with ``embedding_rowwise``, ``replicate`` with
    ``replicate``); a rule for that head is replaced.

    Raises:
        RecipeError: the head's rule also covers other modules.
    """
    weights: dict[int, list[str]] = {}
    for rel, module in imp.modules.items():
        w = getattr(module, "weight", None)
        if isinstance(w, nn.Parameter):
            weights.setdefault(id(w), []).append(rel)
    for holders in weights.values():
        embeds = [h for h in holders if imp.kind(h) == "embedding"]
        heads = [h for h in holders if imp.kind(h) == "linear"]
        if not embeds or not heads:
            continue
        estyle = imp.styles.get(embeds[0], imp.whole)
        want = STYLES[estyle.tied_head] if estyle.tied_head else None
        for h in heads:
            if want is None or imp.styles.get(h) is want:
                continue
            for item in list(imp.rules):
                match = item[0]["match"]
                if h in (match if isinstance(match, list) else [match]) or (
                        isinstance(match, str) and _compile_glob(match).match(h)):
                    if match not in (h, [h], wildcard(h)):
                        raise RecipeError(f"cannot import the tensor-parallel plan of {type(imp.model).__name__}: "
                                          f"{h} is tied to {embeds[0]} ({estyle.name}) and needs style "
                                          f"{want.name!r}, but the rule {match!r} also covers other modules")
                    imp.rules.remove(item)
            note = (f"tied to {embeds[0]} ({estyle.name}): " +
                    ("vocabulary-parallel LM head, logits gathered" if want.lm_head else "a full copy"))
            imp.add_rule(wildcard(h), [h], want.name, note, optional=True)


def check_per_head_params(imp: HFImport) -> None:
    """Refuse a parameter holding all heads inside an attention module whose projections split heads
    (the module's own and its parts', those the imported rules split with the heads excepted). A
    matrix whose last dimension is the hidden size (a projection of the whole hidden states written
    as a bare parameter, glm5_next's indexer gate) reads the replicated input, not the heads.

    Raises:
        RecipeError: such a parameter, naming it, why, and what to write instead.
    """
    heads, hd = imp.heads, imp.head_dim
    if not heads or not hd:
        return
    split = {(n, leaf) for owner, leaves in imp.split_per_head.items() for n in imp.modules if wildcard(n) == owner
             for leaf in leaves}
    widths = {n * hd for n in heads.values()}
    hidden = imp.config_int("hidden_size")
    for parent, rel, module in imp.attention_parts():
        own = getattr(imp.modules.get(parent), "head_dim", None)  # gemma4's full-attention layers: twice the config's
        for pname, param in module.named_parameters(recurse=False):
            if (rel, pname) in split:
                continue
            shape = tuple(param.shape)
            if isinstance(own, int) and shape == (own,) and own not in heads.values():
                continue  # one value per dim of a head, shared by every head (a q_norm / k_norm)
            per_head = any(shape[i] in heads.values() and shape[i + 1] == hd for i in range(len(shape) - 1))
            # (head_dim,) is one head's width, not all heads', even when a count is 1 (one KV head)
            per_head = per_head or bool(head_dims(shape, set(heads.values()), own if isinstance(own, int) else hd))
            read = shape[:-1] if len(shape) >= 2 and shape[-1] == hidden else shape  # (k, hidden): reads x
            if not (per_head or any(s in widths and s != hd for s in read)):
                continue
            what = ("Split it with the heads (style 'per_head') or keep the attention whole (replicate its "
                    "projections) in a recipe")
            if len(shape) == 1 and shape[0] in widths and hasattr(module, "normalized_shape") or (
                    len(shape) == 1 and shape[0] in widths and re.search(r"Norm", type(module).__name__)):
                what = (f"{type(module).__name__} normalises over the full projection width {shape[0]} (every "
                        f"head at once: its statistics mix all heads), so a rank holding some of the heads cannot "
                        f"compute it; unlike a norm per head (a weight (heads, head_dim) normalising each head), it "
                        f"cannot be split with the heads. Keep the attention whole in a recipe: replicate "
                        f"{parent.rpartition('.')[0] and wildcard(parent) or parent} (its projections and norms), "
                        f"and split the MLP colwise / rowwise")
            raise imp.error(f"{rel}.{pname} has shape {shape}: it holds values for all heads (or the full "
                            f"projection width), but HF's plan splits the heads of {parent}'s projections and "
                            f"does not split it (it would stay whole, which is not the dense model). {what}")


def _containers(imp: HFImport) -> list[str]:
    """Modules that are no layer and that a rule keeps whole with everything inside."""
    return [c for c, s in imp.styles.items() if s.copies_whole and imp.kind(c) is None]


def fill(imp: HFImport) -> None:
    """``replicate`` for every layer the plan leaves out (a task head's rule optional), and an
    optional rule for the task heads of other head classes (``score``, ``qa_outputs``, ...)."""
    covered, containers = set(imp.styles), _containers(imp)
    found: dict[str, tuple[list[str], bool]] = {}
    for rel, module in imp.modules.items():
        if module_kind(module) is None or rel in covered or any(rel.startswith(c + ".") for c in containers):
            continue
        key = wildcard(rel)
        names, _ = found.get(key, ([], True))
        found[key] = (names + [rel], imp.inside[rel])
    task_heads = [t for t in TASK_HEADS if t not in found and t not in covered]
    for key, (names, in_base) in found.items():
        head = key.split(".")[0] in TASK_HEADS or not in_base
        imp.replicate(key, names, "not in HF's plan: a full copy" + (" (task head)" if head else ""),
                      **({"optional": True} if head else {}))
    if task_heads:
        imp.rules.append(({"match": task_heads, "style": imp.whole.name, "optional": True},
                          "task heads of other head classes: a full copy (optional)"))


def bare_parameters(imp: HFImport) -> None:
    """A ``replicate`` rule for each module holding parameters of 2 or more dimensions outside any
    layer (a convolution, a position table, a hyper-connection's mixing matrix) that HF's plan
    does not name: HF keeps them whole, and so does the import, on purpose and with the reason in
    the note, where the planner would refuse them as uncovered (:func:`tpify.planner.coverage_threshold`).
    Whole as a container when no layer inside is split, else only its own parameters (``params``).

    Left to the planner's coverage check: fused experts (``*Experts``) other than those whose every
    output passes a norm of its own (``has_post_expert_norm``: kept whole, as in HF), and the parts
    of a head-split attention (:func:`check_per_head_params`). One-dimensional parameters stay as
    they were."""
    attention = imp.head_split_attention()
    containers = _containers(imp)
    split = [r for r, s in imp.styles.items() if not s.copies_whole]
    found: dict[tuple, list[str]] = {}
    for rel, module in imp.modules.items():
        if module_kind(module) is not None or rel in imp.styles or any(rel.startswith(c + ".") for c in containers):
            continue
        own = sorted(n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2)
        if not own or any(rel == a or rel.startswith(a + ".") for a in attention):
            continue
        cls = type(module).__name__
        if "Expert" in cls:
            if getattr(module, "has_post_expert_norm", False) is not True:
                continue
            note = (f"fused experts HF's plan leaves whole ({cls}, has_post_expert_norm): each expert's output passes "
                    f"its own norm, which a split along the intermediate dimension would feed a partial sum; a full "
                    f"copy on every rank, as in HF (no memory saved on the experts)")
        else:
            note = (f"{cls} holds {own}, parameters outside any layer that HF's plan does not name: HF keeps them "
                    f"whole on every rank; a full copy")
        inner = [r for r in split if r.startswith(rel + ".") or (not rel and r)]
        whole = tuple(own) if inner else ()  # split layers inside: only its own parameters stay whole
        found.setdefault((wildcard(rel), whole, note), []).append(rel)
    for (key, whole, note), names in found.items():
        imp.replicate(key, names, note, **({"params": list(whole)} if whole else {}))


def head_count_rules(imp: HFImport) -> tuple[list[str], list[str]]:
    """``(divisible, divide_config)``: the head counts when a column-parallel layer is as wide as a
    head count times the head size (or a style asks, ``imp.heads_divisible``), less the KV heads
    where the K/V rules carry ``kv_heads`` (:func:`_kv_rules`); and a ``divide`` rule for each
    attention module whose forward reads a head count or a split width (:func:`forward_reads`)."""
    hd, heads = imp.head_dim, imp.heads
    widths = {n * hd for n in heads.values()} if hd else set()
    attention = sorted({r.rpartition(".")[0] for r, s in imp.styles.items()
                        if s.column and imp.inside[r] and out_features(imp.modules[r]) in widths})
    divisible = list(heads) if attention else []
    if imp.heads_divisible and "num_attention_heads" in heads and "num_attention_heads" not in divisible:
        divisible.append("num_attention_heads")  # latent attention: its up projections are split by whole heads
    if attention and _kv_rules(imp, attention):
        divisible.remove(_KV_HEADS)  # tp_size divides the KV heads, or each is held by a group of ranks
    divides, divide_config = forward_reads(imp.modules, attention, imp.config, heads, widths)
    for rel, attrs in divides.items():
        imp.rules.append(({"match": wildcard(rel), "divide": attrs},
                          f"{type(imp.modules[rel]).__name__}.forward reads {attrs}: per-rank values"))
    seen: set[str] = set()  # one divide rule per glob (layers share their class)
    for rule, note in list(imp.rules):
        if "divide" in rule and "style" not in rule and isinstance(rule["match"], str):
            if rule["match"] in seen:
                imp.rules.remove((rule, note))
            seen.add(rule["match"])
    return divisible, divide_config


def _plain_column(style) -> bool:
    """A column-parallel layer of one part (``colwise``): its rule takes ``kv_heads`` alone."""
    return style is not None and style.column and not style.packed


def _kv_rules(imp: HFImport, attention: list[str]) -> bool:
    """Mark the K/V projections' rules with ``kv_heads`` (split by KV heads, or each KV head held by
    a group of ranks when tp_size is a multiple of them) and add a ``kv_groups`` rule for each
    attention module holding ``num_key_value_groups``; True when done. Not done (False) when the
    config has no fewer KV heads than heads, or a rule covering a K/V projection covers another
    layer too (then tp_size must divide the KV heads, as before)."""
    kv, n, hd = imp.heads.get(_KV_HEADS), imp.heads.get("num_attention_heads"), imp.head_dim
    if not kv or kv == n:
        return False
    kv_layers = {r for r, s in imp.styles.items()
                 if _plain_column(s) and r.rpartition(".")[0] in attention and out_features(imp.modules[r]) == kv * hd}
    if not kv_layers:
        return False
    marked = []
    for rule, _ in imp.rules:
        if not _plain_column(STYLES.get(rule.get("style"))):
            continue
        covered = {r for r in imp.covered_by(rule) if _plain_column(imp.styles[r])}
        if covered & kv_layers:
            if not covered <= kv_layers:
                return False
            marked.append(rule)
    for rule in marked:
        rule["kv_heads"] = _KV_HEADS
    parents = sorted({wildcard(r.rpartition(".")[0]) for r in kv_layers
                      if isinstance(getattr(imp.modules[r.rpartition(".")[0]], _KV_GROUPS, None), int)})
    for parent in parents:
        imp.rules.append(({"match": parent, "kv_heads": _KV_HEADS, "kv_groups": [_KV_GROUPS]},
                          f"{_KV_GROUPS} (query heads per KV head) divided where each KV head is held by a group of "
                          f"ranks"))
    return True


def forward_reads(modules, attention, config, heads, widths):
    """Attributes of the attention modules (and config head counts) their forward reads that
    hold a head count or a sharded width: ``({module rel: [attrs]}, [config attrs])``.

    ``modules``: name relative to the base model -> module; ``attention``: the names to read;
    ``heads``: :func:`~tpify.hf_plan.head_counts` of ``config``; ``widths``: sharded widths (head
    count x head size).
    """
    targets = set(heads.values()) | widths
    divides: dict[str, list[str]] = {}
    divide_config: list[str] = []
    for rel in attention:
        module = modules.get(rel)
        if module is None:
            continue
        src = forward_source(module)
        used = set(re.findall(r"self\.(\w+)", src))
        attrs = sorted(a for a in used
                       if isinstance(getattr(module, a, None), int) and not isinstance(getattr(module, a), bool)
                       and getattr(module, a) in targets and _DIVIDE_NAME.search(a) and not _NOT_DIVIDE_NAME.search(a))
        if attrs:
            divides[rel] = attrs
        for name in set(re.findall(r"config\.(\w+)", src)):
            if name in heads and name not in divide_config:
                divide_config.append(name)
    return divides, sorted(divide_config)
