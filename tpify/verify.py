"""Prove a recipe exact: a tensor-parallel model against its dense twin in float64 (``tpify verify``).

A recipe is exact when the parallel model computes what the dense model computes, up to the
order of floating-point sums. This module checks it on a small random model of the family, on
CPU ranks over gloo, for every head class the family defines:

* :func:`small_config`: a tiny config of the family (2 layers, 4 heads, hidden 32, vocabulary
  101, ...) from a full one, through the config's standard attribute names;
* :func:`check_build_size`: what a config would build, counted on the meta device, refused
  above :data:`MAX_SMALL_ELEMENTS` (2M parameter and buffer elements) before anything is built;
* :func:`check_case`: run on every rank of an initialised process group, one head class at one
  tp size: a seeded dense float64 reference against ``tpify.parallelize`` of a deep copy
  (outputs with a left-padding mask, the ``labels=`` loss, every gathered gradient, greedy
  ``generate``, a ``save_pretrained`` / ``from_pretrained`` round trip); returns :class:`Row`\\ s;
* :func:`verify` / :func:`verify_many`: launch the ranks themselves (one spawned job per tp size,
  every head class and every target in it) and return a :class:`VerifyReport`;
* :func:`dense_named`: the dense value of every parameter or gradient of a parallelized model,
  gathered (the tests use it too).

Tolerance (:data:`ATOL`, :data:`RTOL`): ``|parallel - dense| <= 1e-10 + 1e-9 |dense|`` in
float64. Both sides run the same operations on the same values; only the order of summation
differs (a matmul's dot products split over ranks and summed by the all-reduce, the
vocab-parallel loss's sums), which moves results by a few ulps (about 1e-16 relative, at most
~1e-13 after accumulating over a 2-layer model). An error of the recipe (a wrong shard, a head
count not divided, a missing gradient all-reduce) gives differences of 1e-3 and more, so the
margin separates the two by many orders of magnitude. Greedy token ids must be identical.

The dense reference is chosen before anything is compared (:func:`_dense_reference`), and each
choice other than float64 with a left-padded batch is stated in a ``dense reference: ...`` row:
fused MoE experts run with transformers' eager implementation (its ``grouped_mm`` kernel refuses
float64; the eager loop computes the same function); the padded row moves to the right when the
float64 model is NaN with it on the left (gemma2 and vaultgemma: a fully masked query row meets
transformers' float32 softmax; bloom: its ALiBi bias added to the float64 minimum); a family
whose own kernels still refuse float64 runs in float32, with :func:`float32_tolerance`
(``64 (layers + 1) eps32``, normwise; every such row's tolerance says ``float32``). A dense
model that is not finite on any of these inputs gives a failed ``dense reference not finite``
row: nothing was compared, and the parallel model is not at fault
(:meth:`VerifyReport.dense_failures`).

Bounds: a config verify makes small is built on the meta device first and refused above
:data:`MAX_SMALL_ELEMENTS` (:func:`check_build_size`), and each launched rank's address space is
limited to :data:`RANK_MEMORY_LIMIT_GIB` (a forward that allocates far more than expected fails
its step with a memory error row instead of exhausting the machine).

The method checked is Megatron-LM's (Shoeybi et al., arXiv:1909.08053, section 3); the recipe
format is docs/recipes.md.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import math
import os
import re
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ATOL", "RTOL", "FLOAT32_ATOL", "FLOAT32_RTOL", "float32_tolerance", "MAX_SMALL_ELEMENTS",
           "RANK_MEMORY_LIMIT_GIB", "Row", "VerifyReport", "Target", "ShrinkError", "DenseNotFinite", "small_config",
           "check_build_size", "family_head_classes", "check_case", "verify", "verify_many", "dense_named",
           "float64_loss_function", "compare"]

ATOL = 1e-10
RTOL = 1e-9
TOLERANCE = f"atol={ATOL:g}, rtol={RTOL:g}"
# Where a family's kernels refuse float64 (see the module docstring and float32_tolerance).
_FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23, about 1.19e-7


def float32_tolerance(layers: int) -> tuple[float, float, str]:
    """``(atol, rtol, in words)`` of the float32 comparisons of a model with ``layers`` layers.

    ``atol = rtol = 64 (layers + 1) eps32``, normwise (:func:`compare`: ``|a - e| <= atol +
    rtol max|e|``): each layer adds a few roundings at the residual stream's magnitude (the
    order of the partial sums of a split matmul and of the all-reduce), so the error grows with
    the depth (plus one for the embedding and the head). About 2.3e-5 for the 2-layer small
    configs. Measured with every shipped family, gemma2 and olmoe forced to float32 (every head
    class, outputs, loss, gradients): the largest error is 1.9e-6 of max|e| (16 ulps), 0.04 of
    this tolerance, at tp 2 and at tp 4. A wrong shard, a head count not divided or a missing
    all-reduce is off by 1e-3 of max|e| and more, 40 times the tolerance and more.
    """
    t = 64 * (max(layers, 1) + 1) * _FLOAT32_EPS
    return t, t, f"float32 normwise atol={t:.2g}, rtol={t:.2g}"


FLOAT32_ATOL, FLOAT32_RTOL, FLOAT32_TOLERANCE = float32_tolerance(2)  # the small configs' 2 layers
# Each rank's address-space limit (RLIMIT_AS) in a verify job: a rank of the largest small case
# peaks near 1 GiB of address space (torch, transformers, gloo and two copies of the model).
RANK_MEMORY_LIMIT_GIB = 4.0

# The shape of the inputs every case feeds: batch, tokens, choices (multiple choice), decoder tokens.
_B, _T, _C, _TD = 2, 10, 2, 6
_NEW_TOKENS = 5
_PAD = 3  # the second row is padded by this many tokens (on the left unless the dense model needs otherwise)


class ShrinkError(ValueError):
    """A family's config cannot be made small by :func:`small_config` (names the attributes)."""


@dataclass(frozen=True)
class Row:
    """One comparison of one head class at one tp size.

    Attributes:
        target: what was verified (a ``model_type``, a directory, or a label).
        head: the head class name (``GPT2LMHeadModel``), or ``"-"`` for the whole target.
        tp: the tp size.
        check: what was compared (``forward logits``, ``labels= loss``, ``gradients (29 tensors)``,
            ``generate``, ``save/load logits``, ...), or the step that raised.
        max_diff: the largest ``|parallel - dense|`` (for ``generate``: the number of differing
            token ids), or None when nothing was compared (an error).
        tolerance: the criterion, in words.
        passed: whether the criterion held.
        message: why it failed (the worst tensors, or the exception), empty when it passed.
    """

    target: str
    head: str
    tp: int
    check: str
    max_diff: float | None
    tolerance: str
    passed: bool
    message: str = ""


@dataclass
class VerifyReport:
    """What :func:`verify` / :func:`verify_many` found.

    Attributes:
        rows: every :class:`Row`, in the order the cases ran (tp size, target, head class).
        seconds: wall time of the whole verification (spawning the ranks included).
        case_seconds: ``(target, head, tp) -> seconds`` one case took on rank 0.
        job_seconds: ``tp -> seconds`` of each spawned job (start-up of the ranks included).
    """

    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    case_seconds: dict[tuple[str, str, int], float] = field(default_factory=dict)
    job_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when there is at least one row and every row passed."""
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[Row]:
        """The rows that failed."""
        return [r for r in self.rows if not r.passed]

    def dense_failures(self) -> list[Row]:
        """The failed rows of the dense reference itself (``dense reference not finite``, or
        ``dense reference: raised``): nothing was compared in those cases, and the parallel
        model is not at fault."""
        return [r for r in self.failures() if r.check.startswith(DENSE_REFERENCE)]

    def target_seconds(self) -> dict[tuple[str, int], float]:
        """``(target, tp) -> seconds`` summed over the target's cases (rank 0, without start-up)."""
        out: dict[tuple[str, int], float] = {}
        for (target, _, tp), s in self.case_seconds.items():
            out[(target, tp)] = out.get((target, tp), 0.0) + s
        return out

    def format_table(self, failures_only: bool = False) -> str:
        """A plain-text table: target, head class, tp, check, max |difference|, tolerance, result."""
        rows = self.failures() if failures_only else self.rows
        header = ("target", "head class", "tp", "check", "max |diff|", "tolerance", "result")
        body = [(r.target, r.head, str(r.tp), r.check, "-" if r.max_diff is None else f"{r.max_diff:.2e}",
                 r.tolerance, "pass" if r.passed else "FAIL") for r in rows]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        for r, b in zip(rows, body):
            lines.append("  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip())
            if r.message:
                lines.extend("      " + m for m in r.message.splitlines()[:12])
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Gathering and comparing.

def dense_named(model: torch.nn.Module, attr: str | None = None) -> dict[str, torch.Tensor | None]:
    """``{fqn: dense tensor}`` of every parameter of ``model`` (``attr="grad"``: their gradients).

    Sharded parameters (those carrying a :class:`~tpify.sharding.ShardSpec`) are all-gathered
    over the model's TP group with :meth:`ShardSpec.gather` (vocabulary padding stripped, packed
    parts re-packed), so the result has the dense model's names and shapes; replicated ones are
    returned as they are. Tied parameters appear under every name (``remove_duplicate=False``).
    A missing gradient is ``None``. The group is ``model.tp_info.tp_group``; a module without
    ``tp_info`` (a parallel layer built by hand) gathers over the default group.

    Communication: one all-gather over the TP group per sharded parameter (every rank of the TP
    group must call it, in the same order); none on a dense model.
    """
    from .sharding import shard_spec_of

    info = getattr(model, "tp_info", None)
    group = info.tp_group if info is not None else None
    out: dict[str, torch.Tensor | None] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        value = param if attr is None else getattr(param, attr)
        spec = shard_spec_of(param)
        if value is not None and spec is not None:
            value = spec.gather(value.detach(), group)
        out[fqn] = None if value is None else value.detach()
    return out


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL,
            normwise: bool = False) -> tuple[float, bool, str]:
    """``(max |actual - expected|, within tolerance, why not)`` of two tensors.

    The criterion is :func:`torch.testing.assert_close`'s: ``|a - e| <= atol + rtol |e|`` for
    every element; with ``normwise`` (the float32 comparisons) ``|a - e| <= atol + rtol max|e|``,
    the error of each element measured against the tensor's largest value (an element that is
    a sum of cancelling terms, such as most elements of a gradient, carries the rounding error
    of its terms, not of its own small value). A NaN in the dense reference fails (NaN equal to
    NaN would compare nothing there; the inputs must be chosen so that the dense model is
    finite). Different shapes fail
    (max difference ``inf``).
    """
    if actual.shape != expected.shape:
        return math.inf, False, f"shape {tuple(actual.shape)} != dense {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    if bool(torch.isnan(e).any()):
        return math.inf, False, (f"the dense reference has {int(torch.isnan(e).sum())} NaN elements: nothing to "
                                 f"compare there (choose inputs on which the dense model is finite)")
    both_nan = torch.isnan(a) & torch.isnan(e)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - e).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = e.abs().nan_to_num(0.0)
    if normwise:
        scale = scale.max() if scale.numel() else scale
    bad = diff > atol + rtol * scale
    if not bool(bad.any()):
        return worst, True, ""
    return worst, False, f"{int(bad.sum())} of {bad.numel()} elements outside tolerance"


def float64_loss_function(loss_type: str):
    """Hugging Face's loss for ``loss_type`` computed in the logits' dtype, or None if HF's own does.

    HF's ``ForCausalLM`` (also ``ForConditionalGeneration``), ``ForMaskedLM`` and
    ``ForTokenClassification`` losses upcast with ``logits.float()``: float32 even for a float64
    model, which would cap every float64 comparison at float32 precision (~1e-8). The returned
    function has the same signature and semantics (causal: labels shifted by one, or
    ``shift_labels``; ``ignore_index``; mean, or sum / ``num_items_in_batch``) without the upcast.
    Set it as ``model.loss_function = float64_loss_function(model.loss_type)``.
    """
    import torch.nn.functional as F

    def _ce(logits, target, num_items_in_batch, ignore_index):
        red = "mean" if num_items_in_batch is None else "sum"
        loss = F.cross_entropy(logits, target.to(logits.device), ignore_index=ignore_index, reduction=red)
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    if loss_type in ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM"):
        causal = loss_type != "ForMaskedLM"

        def lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                    **kwargs):
            if causal:
                target = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            else:
                target = labels
            return _ce(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), num_items_in_batch, ignore_index)
        return lm_loss
    if loss_type == "ForTokenClassification":
        def token_loss(logits, labels, config, num_items_in_batch=None, ignore_index=-100, **kwargs):
            return _ce(logits.reshape(-1, config.num_labels), labels.reshape(-1), num_items_in_batch, ignore_index)
        return token_loss
    return None


def _use_float64_loss(model) -> None:
    """Give ``model`` HF's loss in float64 where HF's own would upcast to float32 only."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    loss_type = getattr(model, "loss_type", None)
    if loss_type not in LOSS_MAPPING:
        loss_type = "ForCausalLM"  # what PreTrainedModel.loss_function falls back to
    fn = float64_loss_function(loss_type)
    if fn is not None:
        model.loss_function = fn


# ---------------------------------------------------------------------------------------------
# Small configs.

# Standard attribute names (config.attribute_map maps family names such as n_embd / n_head onto
# them), with the family-specific names that have no standard counterpart.
_LAYER_NAMES = ("num_hidden_layers", "num_decoder_layers", "num_encoder_layers", "encoder_layers", "decoder_layers")
_HEAD_NAMES = ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "ffn_dim", "encoder_ffn_dim",
                       "decoder_ffn_dim", "hidden_dim", "dff", "moe_intermediate_size",
                       "shared_expert_intermediate_size")  # hidden_dim: distilbert's FFN width, dff: ctrl's
_POSITION_NAMES = ("max_position_embeddings", "n_ctx", "max_seq_len", "seq_length")
_HEAD_DIM = 8
SMALL_LAYERS, SMALL_VOCAB, SMALL_POSITIONS = 2, 101, 64
# The most parameter and buffer elements a model verify builds from a small config may have
# (check_build_size): 2M elements, 16 MB per float64 copy. Every family verify supports today is
# below 75k (ultrabert's masked LM 71k, t5 42k); a config attribute left at full size (a vision
# tower's projector, a 10240-row position table) gives millions.
MAX_SMALL_ELEMENTS = 2_000_000
_MAX_SMALL_LAYERS = 120  # nn.Linear / Conv1D / nn.Embedding modules of a small model


def _lcm(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _is_dropout(key: str) -> bool:
    k = key.lower()
    return "dropout" in k or k.endswith("pdrop") or k.endswith("drop_rate") or k.endswith("drop_prob") \
        or k in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "drop_path_rate")


def _small_token_ids(d: dict, vocab: int) -> None:
    """Special token ids below ``vocab``: the family's own when small, else pad 0, bos 1, eos 2, ..."""
    keys = [k for k in d if k.endswith("_token_id")]
    used = set()
    for k in keys:
        vals = d[k] if isinstance(d[k], list) else [d[k]]
        used.update(v for v in vals if isinstance(v, int) and 0 <= v < vocab)

    def fresh(preferred: int) -> int:
        v = preferred
        while v in used:
            v += 1
        used.add(v)
        return v

    preferred = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    for k in sorted(keys, key=lambda k: (k not in preferred, k)):
        value = d[k]
        if isinstance(value, list):
            d[k] = [v if isinstance(v, int) and 0 <= v < vocab else fresh(preferred.get(k, 3)) for v in value]
        elif isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < vocab:
            d[k] = d.get("pad_token_id") if k == "decoder_start_token_id" and d.get("pad_token_id") is not None \
                else fresh(preferred.get(k, 3))
        elif value is None and k == "pad_token_id":
            d[k] = fresh(0)


def small_config(config, tp_sizes: Sequence[int] = (2,)):
    """A tiny config of ``config``'s family for random-weight checks at every size in ``tp_sizes``.

    From a full config (``tpify.cli.target.resolve_config``), through the config's standard
    attribute names (``config.attribute_map`` maps ``n_embd``/``n_head``/``d_model``/``d_kv``...
    onto ``hidden_size``/``num_attention_heads``/``head_dim``), a new config of the same class:

    * 2 layers (also ``num_decoder_layers``, encoder/decoder layer counts);
    * heads: the smallest multiple of lcm(tp sizes) that is at least 4 (4 at tp 2 and 4, 8 at 8);
      head dim 8, so hidden = 8 * heads (32 with 4 heads); ``head_dim`` / ``d_kv`` set to match;
    * KV heads (``num_key_value_heads``, falcon's ``num_kv_heads``, ...), where the config has
      them: lcm(tp sizes) when that is fewer than the heads (grouped-query attention is then
      exercised), else the heads; a config with 1 KV head (multi-query) keeps 1;
    * MLP width (``intermediate_size``, ``n_inner``, ``d_ff``, ``ffn_hidden_size``, distilbert's
      ``hidden_dim``): the smallest
      multiple of lcm(tp sizes) that is at least 48;
    * vocabulary 101 (odd, so vocabulary padding is exercised at every tp size > 1); max
      positions 64; every dropout 0; special token ids below the vocabulary (pad/bos/eos 0/1/2
      unless the family's own are small already); ``layer_types`` cut to the 2 layers;
      ``num_labels`` 3.

    Then the result is checked: the standard sizes read back, and the family's base model built
    on the meta device has no parameter dimension above ``4 * max(hidden, MLP width) + 8``, at
    most 2M parameters and 120 linear/embedding layers.

    Raises:
        ShrinkError: the config class rejects the small values, lacks a head-count attribute, or
            the model built from the result is still large (the message names its largest
            parameters: attributes this function does not know; pass a directory holding a small
            ``config.json`` instead).
    """
    tp = _lcm(tp_sizes)
    heads = tp * math.ceil(4 / tp)
    hidden = heads * _HEAD_DIM
    kv = tp if tp < heads else heads
    inter = tp * math.ceil(48 / tp)
    cls = type(config)
    amap = dict(getattr(config, "attribute_map", {}) or {})
    d = config.to_dict()
    d.pop("_name_or_path", None)

    def key(name: str) -> str:
        return amap.get(name, name)

    def set_if_present(names, value) -> list[str]:
        done = []
        for name in names:
            k = key(name)
            if k in d and k not in done:
                d[k] = value
                done.append(k)
        return done

    if not set_if_present(_HEAD_NAMES, heads):
        raise ShrinkError(f"cannot shrink {cls.__name__} (model_type {config.model_type!r}): it has none of the "
                          f"head-count attributes {list(_HEAD_NAMES)} (nor an attribute_map onto them); pass a "
                          f"directory holding a small config.json instead")
    set_if_present(("hidden_size", "d_model", "n_embd", "n_embed", "word_embed_proj_dim"), hidden)
    set_if_present(_LAYER_NAMES + ("num_layers", "n_layer"), SMALL_LAYERS)
    set_if_present(("head_dim",), _HEAD_DIM)
    for name in _KV_NAMES:
        k = key(name)
        if k in d and d[k] != 1:  # multi-query (one KV head) stays multi-query
            d[k] = kv
    set_if_present(_INTERMEDIATE_NAMES, inter)
    set_if_present(("vocab_size",), SMALL_VOCAB)
    set_if_present(_POSITION_NAMES, SMALL_POSITIONS)
    for k, v in list(d.items()):
        if _is_dropout(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            d[k] = 0.0
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:SMALL_LAYERS]
    if isinstance(d.get("attention_types"), list):  # gpt_neo: [[kinds, repeat], ...] expands to one kind per layer
        try:
            per_layer = [kind for kinds, repeat in d["attention_types"] for _ in range(repeat) for kind in kinds]
            d["attention_types"] = [[per_layer[:SMALL_LAYERS], 1]]
            d.pop("attention_layers", None)
        except (TypeError, ValueError):
            pass
    if isinstance(d.get("rotary_dim"), int) and d["rotary_dim"]:  # gptj, codegen: rotary part of a head
        full = d["rotary_dim"] >= config.hidden_size // max(1, config.num_attention_heads)
        d["rotary_dim"] = _HEAD_DIM if full else _HEAD_DIM // 2
    _small_token_ids(d, SMALL_VOCAB)
    for k in ("architectures", "id2label", "label2id", "num_labels"):
        d.pop(k, None)
    try:
        small = cls.from_dict(d)
        small.num_labels = 3
        if getattr(small, "is_encoder_decoder", False) and getattr(small, "decoder_start_token_id", None) is None:
            small.decoder_start_token_id = small.pad_token_id  # T5's convention; its default config lacks it
    except Exception as e:  # noqa: BLE001 - any validation error of the config class
        raise ShrinkError(f"cannot shrink {cls.__name__} (model_type {config.model_type!r}): the config class "
                          f"rejects the small values: {type(e).__name__}: {e}") from e
    _check_small(small, heads, hidden, 4 * max(hidden, inter) + 8)
    return small


def _check_small(config, heads: int, hidden: int, max_dim: int) -> None:
    """Raise :class:`ShrinkError` unless ``config`` builds a small model with ``heads`` heads whose
    parameters have no dimension above ``max_dim`` (a size attribute left at its full value).

    The model checked is the family's base class, else (a family without one in transformers'
    auto mapping, such as ``llama4_vision_model``) its first head class; built on the meta device.
    """
    name = type(config).__name__
    got = {n: getattr(config, n, None) for n in ("num_attention_heads", "hidden_size", "num_hidden_layers",
                                                 "vocab_size")}
    want = {"num_attention_heads": heads, "hidden_size": hidden, "num_hidden_layers": SMALL_LAYERS,
            "vocab_size": SMALL_VOCAB}
    wrong = {n: v for n, v in got.items() if v is not None and v != want[n]}
    if wrong:
        raise ShrinkError(f"cannot shrink {name}: after setting them, config values read back as {wrong} "
                          f"(wanted {({n: want[n] for n in wrong})})")
    base = _base_class(config) or next(iter(family_head_classes(config).values()), None)
    if base is None:
        return
    try:
        with torch.device("meta"):
            model = base(copy.deepcopy(config))  # some constructors change their config (T5ForTokenClassification)
    except Exception as e:  # noqa: BLE001
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} cannot be built from the small config: "
                          f"{type(e).__name__}: {e}") from e
    params = sorted(((p.numel(), n, tuple(p.shape)) for n, p in model.named_parameters()), reverse=True)
    layers = sum(1 for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
                 or type(m).__name__ == "Conv1D")
    wide = [(n, s) for _, n, s in params if s and max(s) > max_dim]
    if wide:
        shown = ", ".join(f"{n} {s}" for n, s in wide[:4])
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} from the small config has parameters wider than "
                          f"{max_dim} ({shown}{' ...' if len(wide) > 4 else ''}){_attributes_note(config, wide)}. "
                          f"Pass a directory holding a small config.json")
    try:
        _check_model_size(model, config, MAX_SMALL_ELEMENTS, base)
    except ShrinkError as e:
        raise ShrinkError(f"cannot shrink {name}: {e}") from None
    if layers > _MAX_SMALL_LAYERS:
        largest = ", ".join(f"{n} {s}" for _, n, s in params[:3])
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} from the small config still has {layers} "
                          f"linear/embedding layers (at most {_MAX_SMALL_LAYERS}; largest: {largest}); its config "
                          f"has size attributes tpify.verify.small_config does not know. Pass a directory holding a "
                          f"small config.json")


def _attributes_note(config, named_shapes) -> str:
    """``"; config attributes ... with these sizes: a = 4096, ..."``: the integer config attributes
    (sub-configs included) equal to a dimension of ``named_shapes`` (``[(name, shape)]``) above
    128, larger than any size :func:`small_config` sets; or a sentence saying there is none."""
    dims = {d for _, shape in named_shapes for d in shape if d > 128}  # above every small size
    found: dict[str, int] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, int) and not isinstance(v, bool) and v in dims:
                found[f"{prefix}{k}"] = v
    try:
        walk(config.to_dict(), "")
    except Exception:  # noqa: BLE001 - a config that cannot serialise itself: no names
        return ""
    if not found:
        return ("; no config attribute has these sizes (derived from several; tpify.verify.small_config does not "
                "know them)")
    return ("; config attributes tpify.verify.small_config does not shrink, with these sizes: "
            + ", ".join(f"{k} = {v}" for k, v in sorted(found.items())[:8]))


def _check_model_size(model: torch.nn.Module, config, limit: int, cls: type | None = None) -> int:
    """The number of elements of ``model``'s parameters and buffers (each tensor once); raise
    :class:`ShrinkError` when it is above ``limit``, naming the family, the class, the largest
    tensors and the config attributes of their sizes (:func:`_attributes_note`). ``model`` is
    usually built on the meta device, so nothing is allocated."""
    tensors = dict(model.named_buffers())
    tensors.update(model.named_parameters())
    total = sum(t.numel() for t in tensors.values())
    if total > limit:
        largest = sorted(((t.numel(), n, tuple(t.shape)) for n, t in tensors.items()), reverse=True)[:4]
        shown = ", ".join(f"{n} {s}" for _, n, s in largest)
        cls_name = (cls or type(model)).__name__
        raise ShrinkError(f"model_type {config.model_type!r}: {cls_name} built from the config verify would use has "
                          f"{total:,} parameter and buffer elements, above verify's limit of {limit:,} "
                          f"(largest: {shown}){_attributes_note(config, [(n, s) for _, n, s in largest])}. Pass a "
                          f"directory holding a small config.json, or raise the limit (max_elements=, "
                          f"--max-elements)")
    return total


def check_build_size(config, classes: Iterable[type], max_elements: int | None = None) -> dict[str, int]:
    """``{class name: elements}`` of each class built from ``config`` on the meta device (nothing is
    allocated; each from a copy of ``config``, which some constructors change), parameters and
    buffers counted once each.

    Verify builds each head class several times per rank (the float64 reference, the parallel
    copy, gradients, the save/load models), so a config it was given to make small must really
    be small before anything is built for real. ``max_elements`` defaults to
    :data:`MAX_SMALL_ELEMENTS` (2M elements: 16 MB per float64 copy; every family verify
    supports today is below 75k, t5 and ultrabert the largest).

    Raises:
        ShrinkError: a class is above the limit (the message names the family, the class, the
            largest tensors and the config attributes of their sizes), or cannot be built from
            the config at all.
    """
    limit = MAX_SMALL_ELEMENTS if max_elements is None else max_elements
    sizes = {}
    for cls in classes:
        try:
            with torch.device("meta"):
                model = cls(copy.deepcopy(config))
        except Exception as e:  # noqa: BLE001 - any error of the family's constructor
            raise ShrinkError(f"model_type {config.model_type!r}: {cls.__name__} cannot be built from the config "
                              f"verify would use: {type(e).__name__}: {e}") from e
        sizes[cls.__name__] = _check_model_size(model, config, limit, cls)
    return sizes


def _base_class(config):
    import transformers
    from transformers.models.auto import modeling_auto

    name = modeling_auto.MODEL_MAPPING_NAMES.get(config.model_type)
    if isinstance(name, (tuple, list)):
        name = name[0]
    return getattr(transformers, name, None) if name else None


# ---------------------------------------------------------------------------------------------
# Head classes and their inputs.

_EXTRA_TASKS = (("DoubleHeadsModel", "double-heads"), ("ForMultipleChoice", "multiple-choice"),
                ("ForNextSentencePrediction", "next-sentence"), ("ForPreTraining", "pretraining"),
                ("EncoderModel", "encoder"))
GENERATIVE_TASKS = ("causal-lm", "seq2seq-lm")


def family_head_classes(config) -> dict[str, type]:
    """Every head class of ``config``'s family: task -> class.

    The standard tasks of :func:`tpify.cli.target.head_classes` (base, causal-lm, masked-lm,
    seq2seq-lm, sequence/token classification, question answering), then the other public
    ``PreTrainedModel`` classes of the family's modeling module, named by task
    (``GPT2DoubleHeadsModel``: ``double-heads``, ``BertForMultipleChoice``: ``multiple-choice``,
    ``BertForNextSentencePrediction``, ``BertForPreTraining``, ``T5EncoderModel``: ``encoder``;
    others: ``other:<ClassName>``). A class of the module built from another config class is
    not the family's (``modeling_llama4`` defines ``Llama4ForConditionalGeneration`` for
    ``Llama4Config`` beside ``Llama4VisionModel`` for ``Llama4VisionConfig``; built from the
    vision config it would take the full-size default text config) and is left out.
    """
    import importlib

    from transformers import PreTrainedModel

    from .cli.target import head_classes

    found = dict(head_classes(config.model_type))
    seen = set(found.values())
    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return found
    for name in getattr(module, "__all__", []):
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)) or cls in seen \
                or name.endswith("PreTrainedModel"):
            continue
        config_class = getattr(cls, "config_class", None)
        if isinstance(config_class, type) and not isinstance(config, config_class):
            continue
        task = next((t for suffix, t in _EXTRA_TASKS if name.endswith(suffix)), f"other:{name}")
        found.setdefault(task, cls)
        seen.add(cls)
    return found


def _select_heads(config, requested) -> list[tuple[str, type]]:
    """``[(task, class)]`` for the requested head classes (names, task names or classes; None: all)."""
    available = family_head_classes(config)
    if not requested:
        return list(available.items())
    by_name = {cls.__name__: (task, cls) for task, cls in available.items()}
    out = []
    for item in requested:
        if isinstance(item, type):
            task = next((t for t, c in available.items() if c is item), None)
            out.append((task or _task_of(item), item))
        elif item in available:
            out.append((item, available[item]))
        elif item in by_name:
            out.append(by_name[item])
        else:
            raise ValueError(f"{item!r} is not a head class of model_type {config.model_type!r}; its head classes "
                             f"(class name or task): {[f'{c.__name__} ({t})' for t, c in available.items()]}")
    return out


def _task_of(cls: type) -> str:
    """The task of a head class, from the family's classes or its name."""
    config_class = getattr(cls, "config_class", None)
    model_type = getattr(config_class, "model_type", None)
    if model_type:
        try:
            for task, c in family_head_classes(config_class()).items():
                if c is cls:
                    return task
        except Exception:  # noqa: BLE001 - fall back to the name
            pass
    name = cls.__name__
    for suffix, task in (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                         ("ForConditionalGeneration", "seq2seq-lm"),
                         ("ForSequenceClassification", "sequence-classification"),
                         ("ForTokenClassification", "token-classification"),
                         ("ForQuestionAnswering", "question-answering")) + _EXTRA_TASKS:
        if name.endswith(suffix):
            return task
    return "base" if name.endswith("Model") else f"other:{name}"


def _case_config(config, task: str, model_type: str):
    """The config one case builds its model from: pad id set, encoder families as decoders for causal LM."""
    config = copy.deepcopy(config)
    if getattr(config, "pad_token_id", None) is None:
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = eos if isinstance(eos, int) else 0
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id  # T5's convention
    if task == "question-answering":
        config.num_labels = 2  # start and end logits
    if task == "causal-lm" and getattr(config, "is_decoder", None) is False:
        from .cli.target import head_classes

        if "masked-lm" in head_classes(model_type):  # BertLMHeadModel, RobertaForCausalLM: HF says is_decoder=True
            config.is_decoder = True
    return config


def _accepts(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.forward).parameters


def _make_inputs(task: str, cls: type, config, tokens: int = _T, padding: str = "left"
                 ) -> tuple[dict, dict, dict | None]:
    """``(inputs, labels, generate kwargs or None)`` for one case, the same on every rank.

    ``inputs`` (no labels): ``input_ids`` ``(B, T)`` = (2, ``tokens``; 10 by default) of ordinary
    tokens, the second row padded by 3 pad tokens and ``attention_mask`` 0 there (``padding``:
    ``"left"``, ``"right"``, or ``"none"``: no pad token, the mask all ones; see
    :func:`_dense_reference` for why the side can change); ``(B, C, T)`` for multiple choice;
    ``decoder_input_ids`` ``(B, 6)`` for the base and LM classes of encoder-decoders.
    ``labels``: what the head's loss takes, ``-100`` at some positions (and at padding).
    """
    g = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    pad = config.pad_token_id
    specials = [v for k, v in config.to_dict().items()
                if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 64]
    low = min(max(specials, default=-1) + 1, vocab - 1)
    shape = (_B, _C, tokens) if task in ("multiple-choice", "double-heads") else (_B, tokens)
    ids = torch.randint(low, vocab, shape, generator=g)
    mask = torch.ones_like(ids)
    if padding != "none":
        padded = slice(None, _PAD) if padding == "left" else slice(-_PAD, None)
        mask[1, ..., padded] = 0
        ids[1, ..., padded] = pad
    encdec = bool(getattr(config, "is_encoder_decoder", False))
    eos = config.eos_token_id if isinstance(getattr(config, "eos_token_id", None), int) else None
    if encdec and eos is not None:
        ids[..., -1] = eos  # encoder-decoder classifiers pool at the (single) eos token
    inputs = {"input_ids": ids}
    if _accepts(cls, "attention_mask"):
        inputs["attention_mask"] = mask
    dec_labels = torch.randint(low, vocab, (_B, _TD), generator=g)
    dec_labels[0, -2:] = -100
    if encdec and _accepts(cls, "decoder_input_ids") and task in ("base", "seq2seq-lm"):
        start = getattr(config, "decoder_start_token_id", None)
        start = pad if start is None else start
        dec = torch.cat([torch.full((_B, 1), start), dec_labels[:, :-1]], dim=1)
        inputs["decoder_input_ids"] = dec.masked_fill(dec == -100, pad)
    token_labels = ids.clone()
    token_labels[0, ..., :2] = -100
    token_labels[mask == 0] = -100
    num_labels = getattr(config, "num_labels", 2)
    labels: dict = {}
    if task in ("causal-lm", "masked-lm"):
        labels = {"labels": token_labels}
    elif task == "seq2seq-lm":
        labels = {"labels": dec_labels}
    elif task == "sequence-classification":
        labels = {"labels": torch.randint(0, num_labels, (_B,), generator=g)}
    elif task == "token-classification":
        tl = torch.randint(0, num_labels, (_B, tokens), generator=g)
        tl[mask == 0] = -100
        labels = {"labels": tl}
    elif task == "question-answering":
        labels = {"start_positions": torch.tensor([1, 5]), "end_positions": torch.tensor([4, 8])}
    elif task == "multiple-choice":
        labels = {"labels": torch.tensor([1, 0])}
    elif task == "next-sentence":
        labels = {"labels": torch.tensor([0, 1])}
    elif task == "pretraining":
        labels = {"labels": token_labels, "next_sentence_label": torch.tensor([1, 0])}
    elif task == "double-heads":
        labels = {"labels": token_labels, "mc_labels": torch.tensor([1, 0])}
        inputs["mc_token_ids"] = torch.full((_B, _C), tokens - 1)
    labels = {k: v for k, v in labels.items() if _accepts(cls, k)}
    gen = None
    if task in GENERATIVE_TASKS:
        gen = dict(input_ids=ids, max_new_tokens=_NEW_TOKENS, do_sample=False, num_beams=1, pad_token_id=pad)
        if "attention_mask" in inputs:
            gen["attention_mask"] = mask
    return inputs, labels, gen


def _float_outputs(out) -> dict[str, torch.Tensor]:
    """The floating tensors of a model output, by field name (caches and tuples left out)."""
    items = out.items() if hasattr(out, "items") else enumerate(out)
    return {str(k): v for k, v in items if torch.is_tensor(v) and v.is_floating_point()}


def _synthetic_loss(out) -> torch.Tensor:
    """``sum_k (output_k * W_k).sum()`` with fixed random ``W_k``: a scalar whose gradient reaches
    every parameter that any output depends on (for classes without labels)."""
    g = torch.Generator().manual_seed(3)
    total = None
    for name, value in sorted(_float_outputs(out).items()):
        if name.endswith("loss"):
            continue
        w = torch.randn(value.shape, generator=g, dtype=value.dtype)
        term = (value * w).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model returned no floating output to take gradients from")
    return total


def _case_loss(model, inputs: dict, labels: dict) -> torch.Tensor:
    """The scalar a case differentiates: the model's loss with ``labels``, or, for a class without
    labels, a fixed random projection of its outputs (:func:`_synthetic_loss`)."""
    if labels:
        return _loss_of(model(**inputs, **labels))
    return _synthetic_loss(model(**inputs))


def _loss_of(out) -> torch.Tensor:
    losses = [v for k, v in _float_outputs(out).items() if k.endswith("loss") and v.dim() == 0]
    if not losses:
        raise ValueError("the model returned no loss although labels were given")
    return sum(losses)


# ---------------------------------------------------------------------------------------------
# The dense reference: its kernels, its dtype, inputs on which it is finite.

class DenseNotFinite(RuntimeError):
    """The dense reference gives NaN or infinity on every input verify tries: nothing to compare."""


# A kernel's refusal of float64, as torch and transformers word it: grouped_mm's "Expected mat_a
# to be Float32, BFloat16 or Float16 matrix, got Double", "... not implemented for 'Double'",
# "expected scalar type Float but found Double", "Input type (double) and bias type (float) ...".
_FLOAT64_REFUSAL = re.compile(r"\b(double|float64)\b", re.IGNORECASE)
_PADDINGS = {"left": "left padding", "right": "right padding", "none": "no padding"}  # in the order tried
DENSE_REFERENCE = "dense reference"  # the check names of the reference's own rows start with it


@dataclass
class _Reference:
    """The dense reference of one case and the choices made for it (the same on every rank).

    Attributes:
        model: the dense model, ``eval()``, its loss in its own dtype.
        dtype: ``torch.float64``, or ``torch.float32`` where its kernels refuse float64.
        padding: the side of the padded row (``"left"``, ``"right"``, ``"none"``).
        eager_experts: whether fused MoE experts were switched to their eager implementation.
        notes: why each choice differs from float64 with a left-padded row, and the kernel
            switches made (empty when none).
        layers: the model's depth (:func:`_depth`), for the float32 tolerance.
    """

    model: torch.nn.Module
    dtype: torch.dtype
    padding: str
    eager_experts: bool
    notes: list[str]
    layers: int

    @property
    def tolerance(self) -> tuple[float, float, str]:
        """``(atol, rtol, in words)`` of the comparisons: :data:`ATOL`/:data:`RTOL` in float64,
        :func:`float32_tolerance` of the model's depth in float32 (normwise)."""
        if self.dtype == torch.float64:
            return ATOL, RTOL, TOLERANCE
        return float32_tolerance(self.layers)

    def summary(self) -> str:
        """The check name of the row stating the choices (``dense reference: float32, ...``)."""
        parts = ["float64" if self.dtype == torch.float64 else "float32"]
        parts.append({"left": "left-padded batch", "right": "right-padded batch", "none": "no padding"}[self.padding])
        if self.eager_experts:
            parts.append("eager experts")
        return f"{DENSE_REFERENCE}: " + ", ".join(parts)


def _refuses_float64(error: BaseException) -> bool:
    """Whether ``error`` is a kernel refusing float64 (a dtype error naming Double / float64).

    Only errors of the dense reference's own forward or backward are read this way (in
    :func:`_dense_reference`, before anything is compared), so a float64 error of the parallel
    model is never mistaken for one.
    """
    return isinstance(error, (RuntimeError, NotImplementedError, TypeError, ValueError)) \
        and bool(_FLOAT64_REFUSAL.search(str(error)))


def _use_eager_experts(model: torch.nn.Module) -> bool:
    """Switch ``model``'s fused MoE experts to transformers' eager implementation; True if it has any.

    transformers 5 runs fused experts (classes decorated ``@use_experts_implementation``, whose
    instances carry ``has_gate`` and ``is_transposed``: qwen2_moe, mixtral, olmoe, ...) with
    ``grouped_mm`` by default, whose kernel accepts float32, bfloat16 and float16 only.
    ``experts_implementation="eager"`` is the family's own loop over the experts: the same
    function (each token's experts, weighted by the router) in any dtype, so the reference stays
    float64. A model without such experts is left as it is.
    """
    has_experts = any(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())
    if not has_experts or not hasattr(model, "set_experts_implementation"):
        return False
    if any(v not in (None, "eager") for v in model.get_experts_implementation().values()):
        model.set_experts_implementation("eager")
    return True


def _not_finite(model, inputs: dict, labels: dict) -> list[str]:
    """What is not finite in one forward and backward of ``model`` (outputs, loss, gradients)."""
    out = model(**inputs, **labels) if labels else model(**inputs)
    problems = [f"{name} ({int((~torch.isfinite(v)).sum())} of {v.numel()})"
                for name, v in _float_outputs(out).items() if not bool(torch.isfinite(v).all())]
    loss = _loss_of(out) if labels else _synthetic_loss(out)
    if not problems and not bool(torch.isfinite(loss).all()):
        problems.append("the loss")
    if not problems and loss.requires_grad:
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            more = " ..." if len(bad) > 3 else ""
            problems.append(f"gradients of {len(bad)} parameters ({', '.join(bad[:3])}{more})")
    model.zero_grad(set_to_none=True)
    return problems


def _dense_reference(cls: type, config, task: str, seed: int = 0, dtype: torch.dtype | None = None) -> _Reference:
    """The dense reference of one case: float64 where its kernels allow, inputs where it is finite.

    1. ``torch.manual_seed(seed); cls(config).eval()``; fused MoE experts switched to their eager
       implementation (:func:`_use_eager_experts`: ``grouped_mm`` refuses float64).
    2. For dtype float64, then float32: one forward and backward (the case's loss) on the
       batch of :func:`_make_inputs` with its padded row on the left, else on the right, else
       no padding, until outputs, loss and every gradient are finite. Left first: it is what
       generation uses. A fully masked query row (a left pad token under causal attention) is
       finite in most families, but not in every float64 one: transformers' eager attention
       adds the mask's minimum (``torch.finfo(float64).min`` = -1.8e308) to the scores and then
       takes ``softmax(..., dtype=torch.float32)``, and -1.8e308 is -inf in float32, so that row
       is all -inf and its softmax NaN (gemma2, eager by default for its logit soft-capping);
       BLOOM adds its ALiBi bias to that minimum. The NaN is the float64 reference's alone
       (in float32 the minimum stays finite), and the pad row's NaN values then reach every
       row through the next layer's ``0 * NaN``. Right padding keeps every query row attending
       to a real token.
    3. Float32 only when the float64 forward or backward raises a kernel's refusal of float64
       (:func:`_refuses_float64`); comparisons then use :func:`float32_tolerance` of the depth.

    ``dtype`` forces one dtype (no fallback). Every choice that is not float64 with left padding
    is stated in ``notes``.

    Raises:
        DenseNotFinite: no padding gives finite values (names what is NaN / infinite for each).
        Exception: anything else the dense model raises (it is not the parallel model's fault).
    """
    torch.manual_seed(seed)
    base = cls(config).eval()
    eager = _use_eager_experts(base)
    notes = []
    if eager:
        notes.append("fused MoE experts run with experts_implementation='eager' (the family's loop over experts, "
                     "the same function; transformers' default grouped_mm kernel refuses float64)")
    dtypes = [dtype] if dtype is not None else [torch.float64, torch.float32]
    for dt in dtypes:
        model = copy.deepcopy(base).to(dt)
        _use_float64_loss(model)
        tried = []
        try:
            for padding in _PADDINGS:
                inputs, labels, _ = _make_inputs(task, cls, config, padding=padding)
                problems = _not_finite(model, inputs, labels)
                if not problems:
                    if tried:
                        notes.append(f"{_PADDINGS[padding]}: the dense {_dtype_name(dt)} model is not finite with "
                                     + "; ".join(tried))
                    return _Reference(model, dt, padding, eager, notes, _depth(config))
                tried.append(f"{_PADDINGS[padding]} ({', '.join(problems)})")
        except Exception as e:  # noqa: BLE001 - a refusal of float64 switches dtype, anything else propagates
            if dt == torch.float64 and len(dtypes) > 1 and _refuses_float64(e):
                notes.append(f"float32: the dense model's kernels refuse float64 ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); tolerance {float32_tolerance(_depth(config))[2]}")
                continue
            raise
        raise DenseNotFinite(f"dense reference not finite: the {_dtype_name(dt)} dense model gives NaN or infinity "
                             f"with every input verify tries: {'; '.join(tried)}; nothing was compared")
    raise AssertionError("unreachable")  # the last dtype returns or raises


def _depth(config) -> int:
    """The number of layers of ``config`` (an encoder-decoder's encoder and decoder together), at least 1."""
    def first(names) -> int:
        values = (_config_value(config, n) for n in names)
        return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), 0)

    layers = first(("num_hidden_layers", "num_layers", "n_layer", "num_encoder_layers", "encoder_layers"))
    if getattr(config, "is_encoder_decoder", False):
        layers = first(("num_encoder_layers", "encoder_layers", "num_layers", "num_hidden_layers")) \
            + first(("num_decoder_layers", "decoder_layers"))
    return max(layers, 1)


def _config_value(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - some configs raise on attributes they define per layer
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# One case, on every rank.

class _CaseFailed(Exception):
    """A step failed on some rank: every rank stops the case at the same point.

    ``errors`` holds the exception classes the failed ranks raised (by name)."""

    def __init__(self, message: str, errors: frozenset[str] = frozenset()):
        super().__init__(message)
        self.errors = errors


def _agree_step(ok: bool, message: str, error: str = "") -> None:
    """Every rank learns whether any rank failed the step; raise :class:`_CaseFailed` if one did.

    ``error``: the class name of this rank's exception. One ``all_gather_object`` over the
    default group (never used by the case itself, so a case group left in a broken state cannot
    hang it).
    """
    from . import comm

    outcomes = comm.all_gather_objects((ok, message, error))
    failed = [(r, m) for r, (o, m, _) in enumerate(outcomes) if not o]
    errors = frozenset(e for o, _, e in outcomes if not o)
    if failed:
        if len(failed) == len(outcomes) and len({m for _, m in failed}) == 1:
            raise _CaseFailed(f"every rank: {failed[0][1]}", errors)
        raise _CaseFailed("; ".join(f"rank {r}: {m}" for r, m in failed), errors)


def _error_message(error: BaseException) -> str:
    """``"Type: message"``, with a hint when it is a memory error (verify's per-rank limit)."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error) \
            or "Cannot allocate memory" in str(error):
        text += (" (out of memory: each verify rank's address space is limited by memory_limit_gib / --memory-limit, "
                 f"default {RANK_MEMORY_LIMIT_GIB:g} GiB; raise it, or verify a smaller config)")
    return text


def _merge_rows(per_rank: list[list[Row]]) -> list[Row]:
    """Rank 0's rows, each failed where any rank failed it, with the largest difference of all."""
    merged: dict[str, Row] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            old = merged.get(row.check)
            if old is None:
                merged[row.check] = row
                continue
            diffs = [d for d in (old.max_diff, row.max_diff) if d is not None]
            message = old.message
            if not row.passed and row.message and row.message not in message:
                message = (message + "\n" if message else "") + f"rank {rank}: {row.message}"
            merged[row.check] = Row(old.target, old.head, old.tp, old.check, max(diffs) if diffs else None,
                                    old.tolerance, old.passed and row.passed, message)
    return list(merged.values())


def check_case(cls: type, config, tp_size: int, *, recipe=None, workdir: str | os.PathLike | None = None,
               target: str | None = None, task: str | None = None, seed: int = 0,
               group_timeout_s: float = 120.0, dtype: torch.dtype | None = None) -> list[Row]:
    """Check one head class at one tp size against the dense model; run on every rank.

    Must be called on every rank of an initialised process group of exactly ``tp_size`` ranks
    (gloo on CPU), with the same arguments. Steps, each a :class:`Row` (or several):

    1. ``dense reference``: ``torch.manual_seed(seed)``; ``ref = cls(config).double().eval()``,
       the dense float64 reference, and its batch (:func:`_dense_reference`: fused MoE experts
       run eagerly; the padded row moves from the left to the right, or the padding goes, when
       the dense model is not finite with it; float32 when its kernels refuse float64; ``dtype``
       forces one dtype, with no fallback). When no batch gives finite values the case ends with
       a failed ``dense reference not finite`` row: nothing is compared, and it is not the
       parallel model's fault. A choice other than float64 with left padding is stated in a
       passing ``dense reference: ...`` row (its message says why).
       ``par = tpify.parallelize(copy.deepcopy(ref), tp_group=G, recipe=recipe)`` on a process
       group ``G`` made for this case. Where HF's loss would upcast to float32 only (causal /
       masked LM, token classification), both models get it in float64
       (:func:`float64_loss_function`).
    2. ``forward <field>``: every floating output (``logits``, ``last_hidden_state``,
       ``start_logits``...) of a batch ``(B, T) = (2, 10)`` whose second row is padded
       (``attention_mask`` 0 on 3 tokens; on the left unless step 1 chose otherwise).
    3. ``labels= loss``: the loss with the head's labels (``-100`` at some positions); classes
       without labels (base models) take a fixed random projection of their outputs instead.
    4. ``gradients (N tensors)``: every parameter's gradient after ``backward``, sharded ones
       gathered (:func:`dense_named`); a gradient on one side only fails.
    5. ``sequence parallel: ...``, where the recipe has a ``[sequence_parallel]`` table: steps
       2 to 4 again with ``parallelize(..., sequence_parallel=True)`` on a batch of ``T`` = 10
       rounded up to a multiple of ``tp_size`` tokens, against a fresh copy of the reference.
    6. ``generate``: greedy ``generate()`` (5 new tokens, KV cache, the padded batch) for causal
       and seq2seq LMs: identical token ids.
    7. ``save``/``save/load``: ``tpify.save_pretrained`` to ``workdir``; the checkpoint read by
       plain transformers (``cls.from_pretrained(dtype=float64)``; the reference's dtype) holds
       the dense weights bit for bit; ``tpify.from_pretrained(tp_size=..., torch_dtype="float64")`` of it gives the
       outputs that transformers' own dense load of it gives (the loaded model is compared with
       what a user of the checkpoint gets from transformers, buffers computed at load time
       included); and for each ``divide_config`` value, the saved ``config.json`` holds the
       dense value while the parallel config holds ``dense / tp_size``. ``workdir`` (the same
       path on every rank) holds the checkpoint; default a new temporary directory, left in place.

    Tolerance: :data:`ATOL`, :data:`RTOL` (see the module docstring: in float64 only the order
    of summation differs); in float32 :func:`float32_tolerance` of the depth, normwise, and
    every row's tolerance says ``float32``. A step that raises on any rank (``PlanError``,
    ``RecipeError``, a shape error in a forward, anything) ends the case on every rank with a
    failed row carrying the message; nothing propagates. The ranks' rows are merged: a check fails if it failed on
    any rank.

    Communication: besides the model's own, one ``all_gather_object`` over the default group
    per step (so every rank stops at the same step), one process group created per case
    (``dist.new_group``, timeout ``group_timeout_s``, destroyed at the end).

    Raises:
        ValueError: the default group does not have exactly ``tp_size`` ranks (before anything).
    """
    from . import comm

    if not dist.is_initialized() or dist.get_world_size() != tp_size:
        raise ValueError(f"tpify.verify.check_case needs an initialised process group of exactly tp_size = {tp_size} "
                         f"ranks; this one has {dist.get_world_size() if dist.is_initialized() else 0}")
    model_type = config.model_type
    task = task or _task_of(cls)
    label = target or model_type
    head = cls.__name__
    rows: list[Row] = []
    tol = {"atol": ATOL, "rtol": RTOL, "text": TOLERANCE, "normwise": False}  # the reference's, once built

    def row(check, diff, ok, message="", tolerance=None):
        rows.append(Row(label, head, tp_size, check, diff, tol["text"] if tolerance is None else tolerance, ok,
                        message))

    def compare_tol(a, b):
        return compare(a, b, tol["atol"], tol["rtol"], normwise=tol["normwise"])

    def compare_outputs(prefix, got, want):
        got_f, want_f = _float_outputs(got), _float_outputs(want)
        for name, expected in want_f.items():
            if name.endswith("loss"):
                continue
            if name not in got_f:
                row(f"{prefix} {name}", None, False, "missing from the parallel model's output")
                continue
            diff, ok, why = compare_tol(got_f[name], expected)
            row(f"{prefix} {name}", diff, ok, why)

    if workdir is None:
        workdir = comm.all_gather_objects(tempfile.mkdtemp(prefix="tpify-verify-") if dist.get_rank() == 0
                                          else None)[0]
    save_dir = Path(workdir) / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{label}-{head}-tp{tp_size}")
    step = "setup"
    group = None
    try:
        import tpify

        group = dist.new_group(list(range(tp_size)), timeout=datetime.timedelta(seconds=group_timeout_s))
        config = _case_config(config, task, model_type)

        def run(name, fn):
            nonlocal step
            step = name
            error, value = None, None
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - reported as a failed row on every rank
                error = e
            _agree_step(error is None, "" if error is None else _error_message(error),
                        "" if error is None else type(error).__name__)
            return value

        state: dict = {}

        def reference():
            state["chosen"] = chosen = _dense_reference(cls, config, task, seed, dtype)
            state["inputs"], state["labels"], state["gen"] = _make_inputs(task, cls, config, padding=chosen.padding)

        run(DENSE_REFERENCE, reference)
        chosen = state["chosen"]
        ref = chosen.model
        tol.update(zip(("atol", "rtol", "text"), chosen.tolerance), normwise=chosen.dtype != torch.float64)
        if chosen.notes:
            row(chosen.summary(), None, True, "\n".join(chosen.notes), "-")

        def build():
            state["par"] = tpify.parallelize(copy.deepcopy(ref), tp_group=group, recipe=recipe)

        run("parallelize", build)
        par, inputs, labels, gen = (state[k] for k in ("par", "inputs", "labels", "gen"))

        def forward():
            out_ref, out_par = ref(**inputs), par(**inputs)
            compare_outputs("forward", out_par, out_ref)
            state["out_ref"] = out_ref

        run("forward", forward)

        def loss():
            loss_ref, loss_par = _case_loss(ref, inputs, labels), _case_loss(par, inputs, labels)
            diff, ok, why = compare_tol(loss_par, loss_ref)
            row(f"labels= loss ({', '.join(labels)})" if labels else "outputs x fixed weights (no labels)", diff, ok,
                why)
            state["losses"] = (loss_ref, loss_par)

        run("loss", loss)

        def compare_gradients(check, par_model, ref_model):
            ref_g, par_g = dense_named(ref_model, "grad"), dense_named(par_model, "grad")
            problems, worst = [], 0.0
            if ref_g.keys() != par_g.keys():
                problems.append(f"parameter names differ: dense only {sorted(set(ref_g) - set(par_g))[:5]}, "
                                f"parallel only {sorted(set(par_g) - set(ref_g))[:5]}")
            for name in ref_g.keys() & par_g.keys():
                a, b = par_g[name], ref_g[name]
                if (a is None) != (b is None):
                    problems.append(f"{name}: gradient on the {'dense' if a is None else 'parallel'} side only")
                    continue
                if a is None:
                    continue
                diff, ok, why = compare_tol(a, b)
                worst = max(worst, diff)
                if not ok:
                    problems.append(f"{name}: max |diff| {diff:.3g} ({why})")
            n = sum(1 for g in ref_g.values() if g is not None)
            row(f"{check} ({n} tensors)", worst, not problems,
                "\n".join(sorted(problems)[:8]) + (f"\n... {len(problems) - 8} more" if len(problems) > 8 else ""))

        def gradients():
            loss_ref, loss_par = state["losses"]
            loss_ref.backward()
            loss_par.backward()
            compare_gradients("gradients", par, ref)

        run("gradients", gradients)

        def sequence_parallel():
            # the recipe's [sequence_parallel] regions: outputs, loss and every gradient again, with
            # sequence_parallel=True, on a batch whose length tp_size divides
            if par.tp_info.layout.recipe.sequence_parallel is None:
                return
            tokens = tp_size * -(-_T // tp_size)
            sp_inputs, sp_labels, _ = _make_inputs(task, cls, config, tokens, chosen.padding)
            dense = copy.deepcopy(ref)
            dense.zero_grad(set_to_none=True)
            sp = tpify.parallelize(copy.deepcopy(dense), tp_group=group, recipe=recipe, sequence_parallel=True)
            with torch.no_grad():
                compare_outputs("sequence parallel: forward", sp(**sp_inputs), dense(**sp_inputs))
            # (a forward of its own: with labels the LM heads keep their logits vocab-sharded)
            loss_dense, loss_sp = _case_loss(dense, sp_inputs, sp_labels), _case_loss(sp, sp_inputs, sp_labels)
            diff, ok, why = compare_tol(loss_sp, loss_dense)
            row(f"sequence parallel: loss (T = {tokens})", diff, ok, why)
            loss_dense.backward()
            loss_sp.backward()
            compare_gradients("sequence parallel: gradients", sp, dense)

        run("sequence parallel", sequence_parallel)

        def generate():
            if gen is None:
                return
            with torch.no_grad():
                a, b = par.generate(**gen), ref.generate(**gen)
            if a.shape != b.shape:
                row("generate (greedy token ids)", math.inf, False, f"shape {tuple(a.shape)} != dense {tuple(b.shape)}",
                    "identical")
            else:
                n = int((a != b).sum())
                row("generate (greedy token ids)", float(n), n == 0,
                    "" if n == 0 else f"parallel {a.tolist()} != dense {b.tolist()}", "identical")

        run("generate", generate)

        def save_load():
            tpify.save_pretrained(par, save_dir)
            # The saved checkpoint, read by plain transformers, holds the dense model's weights.
            dense_back = cls.from_pretrained(save_dir, dtype=chosen.dtype).eval()
            if chosen.eager_experts:
                _use_eager_experts(dense_back)
            want, got = dense_named(ref), dense_named(dense_back)
            wrong = sorted(n for n in want.keys() | got.keys()
                           if n not in want or n not in got or not torch.equal(want[n], got[n]))
            worst = max((float((want[n] - got[n]).abs().max()) if n in want and n in got and
                         want[n].shape == got[n].shape else math.inf for n in wrong), default=0.0)
            row(f"save: checkpoint weights ({len(want)} tensors, read by transformers)", worst,
                not wrong, f"differ: {wrong[:8]}" if wrong else "", "bitwise")
            # tpify's sharded load of it computes what transformers' dense load of it computes (buffers
            # made at load time included, such as GPT-J's rotary table).
            back = tpify.from_pretrained(save_dir, tp_size=tp_size, tp_group=group, torch_dtype=chosen.dtype,
                                         model_class=cls, recipe=recipe).eval()
            if chosen.eager_experts:
                _use_eager_experts(back)
            with torch.no_grad():
                compare_outputs("save/load", back(**inputs), dense_back(**inputs))
            config_divides = par.tp_info.layout.config_divides
            if config_divides:
                from transformers import AutoConfig

                saved = AutoConfig.from_pretrained(save_dir)
                wrong = [f"{n}: saved {getattr(saved, n, None)}, parallel {getattr(par.config, n, None)}, "
                         f"dense {v}" for n, v in config_divides.items()
                         if getattr(saved, n, None) != v or getattr(par.config, n, None) != v // tp_size]
                row(f"save: divide_config {sorted(config_divides)} dense in config.json, / tp on the model", 0.0,
                    not wrong, "\n".join(wrong), "exact")

        run("save/load", save_load)
    except _CaseFailed as e:
        not_finite = step == DENSE_REFERENCE and e.errors == {DenseNotFinite.__name__}
        row(f"{DENSE_REFERENCE} not finite" if not_finite else f"{step}: raised", None, False, str(e), "-")
    except Exception as e:  # noqa: BLE001 - a failure outside a step (group creation): this rank's own
        row(f"{step}: raised", None, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}", "-")
    finally:
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a broken group is abandoned
                pass
    return _merge_rows(comm.all_gather_objects(rows))


# ---------------------------------------------------------------------------------------------
# Launching the ranks.

@dataclass
class Target:
    """One thing to verify in :func:`verify_many`.

    Attributes:
        target: a ``model_type`` (``"gpt2"``) or a directory holding a ``config.json``.
        recipe: a recipe name, ``.toml`` path, mapping or Recipe; None: the target's model_type.
        head_classes: class names, task names (``causal-lm``) or classes; None: every head class.
        label: the name rows carry (default ``target``).
        shrink: make the config small (:func:`small_config`); None: for a model_type yes, for a
            directory no (its config is used as it is).
        config: a config to use instead of resolving ``target`` (shrunk only if ``shrink``).
        max_elements: the most parameter and buffer elements a head class built from the config
            may have (:func:`check_build_size`, on the meta device, before any rank starts);
            None: :data:`MAX_SMALL_ELEMENTS` when the config is made small, no bound otherwise.
    """

    target: str
    recipe: object = None
    head_classes: Sequence | None = None
    label: str | None = None
    shrink: bool | None = None
    config: object = None
    max_elements: int | None = None


@dataclass
class _Case:
    label: str
    cls: type
    task: str
    config: object
    recipe: object


def _recipe_for(recipe, config):
    """The recipe to verify: the given one, else the shipped one of ``config.model_type``, else None
    (a family with an HF TP plan and no shipped recipe: ``parallelize`` imports the plan, which is
    then what is verified). Raises RecipeError when none exists, before any rank starts."""
    from .recipe import available_recipes, load_recipe

    if recipe is None and config.model_type not in available_recipes():
        if not getattr(config, "base_model_tp_plan", None):
            from .recipe import RecipeError

            raise RecipeError(f"no tpify recipe for model_type {config.model_type!r} and transformers defines no "
                              f"tensor-parallel plan for it; pass --recipe FILE (tpify draft writes a draft)")
        return None
    return load_recipe(recipe if recipe is not None else config.model_type)


def _plan_cases(spec: Target, tp: int) -> tuple[list[_Case], list[Row]]:
    """The cases of one target at one tp size, and a failed row for each thing that cannot run.

    Before any rank starts: the config is resolved and shrunk, the recipe found, the head classes
    selected; a head class whose ``forward`` takes no ``input_ids`` (a vision tower fed
    ``pixel_values``) gets a failed ``setup`` row (verify feeds token ids only); the others are
    built on the meta device and refused when larger than the bound (:func:`check_build_size`:
    ``spec.max_elements``, default :data:`MAX_SMALL_ELEMENTS` for a config made small, none for
    a config used as it is). A target that fails any of this is one failed ``setup`` row.
    """
    from .cli.target import resolve_config

    label = spec.label or str(spec.target)
    try:
        config = spec.config if spec.config is not None else resolve_config(str(spec.target))
        shrink = spec.shrink if spec.shrink is not None else (spec.config is None and not Path(str(spec.target)).is_dir())
        if shrink:
            config = small_config(config, (tp,))
        recipe = _recipe_for(spec.recipe, config)
        heads = _select_heads(config, spec.head_classes)
        fed, unfed = _fed_heads(heads)
        limit = spec.max_elements if spec.max_elements is not None else (MAX_SMALL_ELEMENTS if shrink else None)
        if limit is not None:
            for task, cls in fed:
                check_build_size(_case_config(config, task, config.model_type), [cls], limit)
    except Exception as e:  # noqa: BLE001 - one target's problem is one failed row
        return [], [Row(label, "-", tp, "setup", None, "-", False, f"{type(e).__name__}: {e}")]
    failed = [Row(label, cls.__name__, tp, "setup", None, "-", False, _unfed_message(cls)) for _, cls in unfed]
    return [_Case(label, cls, task, config, recipe) for task, cls in fed], failed


def _fed_heads(heads: list[tuple[str, type]]) -> tuple[list[tuple[str, type]], list[tuple[str, type]]]:
    """``(heads whose forward takes input_ids, the others)``: verify feeds token ids only."""
    fed = [(t, c) for t, c in heads if _accepts(c, "input_ids")]
    return fed, [(t, c) for t, c in heads if (t, c) not in fed]


def _unfed_message(cls: type) -> str:
    params = [p for p in inspect.signature(cls.forward).parameters if p != "self"][:4]
    return (f"not verified: tpify verify feeds token ids (input_ids) and {cls.__name__}.forward takes none "
            f"({', '.join(params)}, ...)")


def _free_store():
    """A TCPStore served by this process on a free localhost port (the ranks connect to it)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=600))


def _rank_entry(payload_path: str, rank: int) -> None:
    """Body of one launched rank (``python -c``): join the group, run every case, post rank 0's rows.

    Results go to the parent's TCPStore: ``case/<i>`` (pickled rows and seconds, rank 0),
    ``done/<rank>``, or ``error/<rank>`` with the traceback.
    """
    import pickle
    import warnings

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    job = pickle.loads(Path(payload_path).read_bytes())
    _limit_memory(job.get("memory_limit_gib"))
    world, cases = job["world"], job["cases"]
    store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=datetime.timedelta(seconds=600))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("group/", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=job["group_timeout_s"]))
        for i, case in enumerate(cases):
            start = time.perf_counter()
            rows = check_case(case.cls, case.config, world, recipe=case.recipe, workdir=job["workdir"],
                              target=case.label, task=case.task, group_timeout_s=job["group_timeout_s"])
            if rank == 0:
                store.set(f"case/{i}", pickle.dumps((rows, time.perf_counter() - start)))
        store.set(f"done/{rank}", "1")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _limit_memory(gib: float | None) -> None:
    """Limit this process's address space to ``gib`` GiB (``RLIMIT_AS``; never above the hard
    limit; a platform without it, or one that refuses, is left as it is)."""
    if not gib:
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = int(gib * 2**30)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        if soft == resource.RLIM_INFINITY or want < soft:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def _run_job(cases: list[_Case], tp: int, timeout_s: float, group_timeout_s: float, progress=None,
             memory_limit_gib: float | None = None) -> tuple[list[list[Row] | None], list[float], str]:
    """Launch ``tp`` ranks that run ``cases``; ``(rows per case or None, seconds per case, error)``.

    The ranks are ``python -c`` subprocesses (never a re-import of the caller's main module, so
    a script without an ``if __name__ == "__main__"`` guard works), with this process's
    ``sys.path``, ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``, its address space limited to
    ``memory_limit_gib`` (None: unlimited); each rank's output goes to a log whose tail is
    reported if the rank fails.
    """
    import pickle
    import subprocess
    import sys

    store = _free_store()
    rows: list[list[Row] | None] = [None] * len(cases)
    seconds = [0.0] * len(cases)
    with tempfile.TemporaryDirectory(prefix="tpify-verify-") as workdir:
        payload = Path(workdir) / "job.pkl"
        payload.write_bytes(pickle.dumps({"world": tp, "cases": cases, "port": store.port, "workdir": workdir,
                                          "group_timeout_s": group_timeout_s, "memory_limit_gib": memory_limit_gib}))
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = "import sys; from tpify.verify import _rank_entry; _rank_entry(sys.argv[1], int(sys.argv[2]))"
        logs = [Path(workdir) / f"rank{r}.log" for r in range(tp)]
        procs = []
        for r in range(tp):
            with open(logs[r], "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-c", code, str(payload), str(r)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        finished: dict[int, str] = {}

        def collect():
            for i in range(len(cases)):
                if rows[i] is None and store.check([f"case/{i}"]):
                    rows[i], seconds[i] = pickle.loads(store.get(f"case/{i}"))
                    if progress is not None:
                        progress(cases[i], rows[i], seconds[i])
            for r in range(tp):
                if r not in finished:
                    if store.check([f"error/{r}"]):
                        finished[r] = store.get(f"error/{r}").decode(errors="replace")
                    elif store.check([f"done/{r}"]):
                        finished[r] = ""

        while time.monotonic() < deadline:
            collect()
            if len(finished) == tp or all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        collect()
        errors = [f"rank {r}: {m}" for r, m in sorted(finished.items()) if m]
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        missing = [r for r in range(tp) if r not in finished]
        if missing:
            alive = time.monotonic() >= deadline
            errors.append(f"rank(s) {missing} " + (f"did not finish within {timeout_s:.0f} s (killed)" if alive else
                                                  f"exited with codes {[procs[r].returncode for r in missing]} "
                                                  f"before finishing"))
            for r in missing:
                tail = logs[r].read_text(errors="replace")[-1500:].strip()
                if tail:
                    errors.append(f"rank {r} output (tail):\n{tail}")
    return rows, seconds, "\n".join(errors)


def verify_many(targets: Sequence[Target | str], tp_sizes: Sequence[int] = (2,), *, timeout_s: float = 1800.0,
                group_timeout_s: float = 120.0, progress=None,
                memory_limit_gib: float | None = RANK_MEMORY_LIMIT_GIB) -> VerifyReport:
    """Verify several targets, every head class of each, in one spawned job per tp size.

    Each job starts ``tp`` ranks (``torch.multiprocessing`` spawn; gloo over localhost,
    ``GLOO_SOCKET_IFNAME=lo``, rendezvous at a ``TCPStore`` on a free port served by this
    process; one thread per rank) that run :func:`check_case` for every (target, head class)
    in turn; rank 0's rows come back as each case ends. Jobs run one after another. A target
    whose config cannot be resolved or shrunk, whose recipe is missing or malformed, or whose
    head class is unknown gives a failed ``setup`` row (no ranks are spawned for it); a job that
    crashes or passes ``timeout_s`` gives a failed ``job`` row for each case that did not report.

    Args:
        targets: :class:`Target`\\ s, or strings (a model_type or a directory: every head class).
        tp_sizes: the tp sizes; the small config is made per tp size (:func:`small_config`).
        timeout_s: the deadline of one job.
        group_timeout_s: the gloo timeout of each case's collectives (a case stuck in a
            collective fails after this long).
        progress: ``progress(case, rows, seconds)`` called in this process as each case reports.
        memory_limit_gib: each rank's address-space limit (``RLIMIT_AS``, where the platform
            enforces it; default :data:`RANK_MEMORY_LIMIT_GIB`), so that a model or a forward
            larger than expected fails its step with a memory error row instead of exhausting
            the machine; None: no limit.
    """
    start = time.perf_counter()
    report = VerifyReport()
    specs = [t if isinstance(t, Target) else Target(t) for t in targets]
    for tp in tp_sizes:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tpify.verify: tp sizes must be positive integers, got {tp!r}")
        cases: list[_Case] = []
        for spec in specs:
            planned, failed = _plan_cases(spec, tp)
            cases.extend(planned)
            report.rows.extend(failed)
        if not cases:
            continue
        job_start = time.perf_counter()
        rows, seconds, error = _run_job(cases, tp, timeout_s, group_timeout_s, progress, memory_limit_gib)
        report.job_seconds[tp] = time.perf_counter() - job_start
        for case, case_rows, secs in zip(cases, rows, seconds):
            if case_rows is None:
                report.rows.append(Row(case.label, case.cls.__name__, tp, "job", None, "-", False,
                                       error or "the ranks ended without reporting this case"))
            else:
                report.rows.extend(case_rows)
                report.case_seconds[(case.label, case.cls.__name__, tp)] = secs
    report.seconds = time.perf_counter() - start
    return report


def verify(target: str, recipe=None, tp_sizes: Sequence[int] = (2,), head_classes: Sequence | None = None, *,
           shrink: bool | None = None, timeout_s: float = 1800.0, progress=None, max_elements: int | None = None,
           memory_limit_gib: float | None = RANK_MEMORY_LIMIT_GIB) -> VerifyReport:
    """Verify one recipe on one target: every head class (or ``head_classes``) at every tp size.

    ``target`` is a ``model_type`` (the family's default config, made small by
    :func:`small_config`) or a directory holding a ``config.json`` (used as it is unless
    ``shrink=True``; random weights, the checkpoint's are not read). ``recipe`` defaults to the
    shipped recipe of the config's ``model_type``. One spawned job per tp size runs every head
    class (:func:`verify_many`); rank 0's :class:`Row`\\ s are returned in a
    :class:`VerifyReport` (``report.ok``, ``report.format_table()``). ``max_elements`` bounds
    what is built (:func:`check_build_size`; default :data:`MAX_SMALL_ELEMENTS` for a config
    made small, none for one used as it is), ``memory_limit_gib`` each rank's address space
    (:func:`verify_many`).

    Raises:
        tpify.cli.target.TargetError: the target is neither a model_type nor a config directory.
        RecipeError: the recipe is missing or malformed.
        ShrinkError: the family's config cannot be made small, or a head class built from it
            would have more than ``max_elements`` parameter and buffer elements (checked on the
            meta device, nothing is built).
        ValueError: a head class that is not the family's, or none that takes token ids; a tp
            size that is not a positive integer.
    """
    from .cli.target import resolve_config

    config = resolve_config(str(target))  # errors about the target itself are raised, not reported
    do_shrink = shrink if shrink is not None else not Path(str(target)).is_dir()
    small = small_config(config, tuple(tp_sizes)) if do_shrink else config
    _recipe_for(recipe, config)
    fed, unfed = _fed_heads(_select_heads(small, head_classes))
    if not fed:
        raise ValueError("; ".join(_unfed_message(cls) for _, cls in unfed))
    limit = max_elements if max_elements is not None else (MAX_SMALL_ELEMENTS if do_shrink else None)
    if limit is not None:
        for task, cls in fed:
            check_build_size(_case_config(small, task, small.model_type), [cls], limit)
    return verify_many([Target(str(target), recipe, head_classes, shrink=do_shrink, max_elements=max_elements)],
                       tp_sizes, timeout_s=timeout_s, progress=progress, memory_limit_gib=memory_limit_gib)
