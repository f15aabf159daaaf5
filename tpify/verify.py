"""Prove a recipe exact: a tensor-parallel model against its dense twin in float64 (``tpify verify``).

A recipe is exact when the parallel model computes what the dense model computes, up to the
order of floating-point sums. This module checks it on a small random model of the family, on
CPU ranks over gloo, for every head class the family defines:

* :func:`small_config`: a tiny config of the family (2 layers, 4 heads, hidden 32, vocabulary
  101, ...) from a full one, through the config's standard attribute names;
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

__all__ = ["ATOL", "RTOL", "Row", "VerifyReport", "Target", "ShrinkError", "small_config", "family_head_classes",
           "check_case", "verify", "verify_many", "dense_named", "float64_loss_function", "compare"]

ATOL = 1e-10
RTOL = 1e-9
TOLERANCE = f"atol={ATOL:g}, rtol={RTOL:g}"

# The shape of the inputs every case feeds: batch, tokens, choices (multiple choice), decoder tokens.
_B, _T, _C, _TD = 2, 10, 2, 6
_NEW_TOKENS = 5
_PAD_LEFT = 3  # the second row is left-padded by this many tokens


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


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL
            ) -> tuple[float, bool, str]:
    """``(max |actual - expected|, within tolerance, why not)`` of two tensors.

    The criterion is :func:`torch.testing.assert_close`'s: ``|a - e| <= atol + rtol |e|`` for
    every element. A NaN in the dense reference fails (NaN equal to NaN would compare nothing
    there; the inputs must be chosen so that the dense model is finite). Different shapes fail
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
    bad = diff > atol + rtol * e.abs().nan_to_num(0.0)
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
_MAX_SMALL_PARAMETERS = 2_000_000
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
    parameters have no dimension above ``max_dim`` (a size attribute left at its full value)."""
    name = type(config).__name__
    got = {n: getattr(config, n, None) for n in ("num_attention_heads", "hidden_size", "num_hidden_layers",
                                                 "vocab_size")}
    want = {"num_attention_heads": heads, "hidden_size": hidden, "num_hidden_layers": SMALL_LAYERS,
            "vocab_size": SMALL_VOCAB}
    wrong = {n: v for n, v in got.items() if v is not None and v != want[n]}
    if wrong:
        raise ShrinkError(f"cannot shrink {name}: after setting them, config values read back as {wrong} "
                          f"(wanted {({n: want[n] for n in wrong})})")
    base = _base_class(config)
    if base is None:
        return
    try:
        with torch.device("meta"):
            model = base(config)
    except Exception as e:  # noqa: BLE001
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} cannot be built from the small config: "
                          f"{type(e).__name__}: {e}") from e
    params = sorted(((p.numel(), n, tuple(p.shape)) for n, p in model.named_parameters()), reverse=True)
    total = sum(p[0] for p in params)
    layers = sum(1 for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
                 or type(m).__name__ == "Conv1D")
    wide = [(n, s) for _, n, s in params if s and max(s) > max_dim]
    if wide:
        shown = ", ".join(f"{n} {s}" for n, s in wide[:4])
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} from the small config has parameters wider than "
                          f"{max_dim} ({shown}{' ...' if len(wide) > 4 else ''}); its config has size attributes "
                          f"tpify.verify.small_config does not know. Pass a directory holding a small config.json")
    if total > _MAX_SMALL_PARAMETERS or layers > _MAX_SMALL_LAYERS:
        largest = ", ".join(f"{n} {s}" for _, n, s in params[:3])
        raise ShrinkError(f"cannot shrink {name}: {base.__name__} from the small config still has {total:,} parameters "
                          f"in {layers} linear/embedding layers (largest: {largest}); its config has size attributes "
                          f"tpify.verify.small_config does not know. Pass a directory holding a small config.json")


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
    others: ``other:<ClassName>``).
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


# Families whose dense float64 model gives NaN on a left-padded row (HF BLOOM: the ALiBi bias added
# to the float64 minimum of a fully masked query row), so the padding goes on the right.
_PAD_RIGHT = {"bloom"}


def _make_inputs(task: str, cls: type, config, tokens: int = _T) -> tuple[dict, dict, dict | None]:
    """``(inputs, labels, generate kwargs or None)`` for one case, the same on every rank.

    ``inputs`` (no labels): ``input_ids`` ``(B, T)`` = (2, ``tokens``; 10 by default) of ordinary
    tokens, the second row left-padded by 3 pad tokens and ``attention_mask`` 0 there;
    ``(B, C, T)`` for multiple choice; ``decoder_input_ids`` ``(B, 6)`` for the base and LM
    classes of encoder-decoders.
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
    padded = slice(-_PAD_LEFT, None) if config.model_type in _PAD_RIGHT else slice(None, _PAD_LEFT)
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
# One case, on every rank.

class _CaseFailed(Exception):
    """A step failed on some rank: every rank stops the case at the same point."""


def _agree_step(ok: bool, message: str) -> None:
    """Every rank learns whether any rank failed the step; raise :class:`_CaseFailed` if one did.

    One ``all_gather_object`` over the default group (never used by the case itself, so a case
    group left in a broken state cannot hang it).
    """
    from . import comm

    outcomes = comm.all_gather_objects((ok, message))
    failed = [(r, m) for r, (o, m) in enumerate(outcomes) if not o]
    if failed:
        if len(failed) == len(outcomes) and len({m for _, m in failed}) == 1:
            raise _CaseFailed(f"every rank: {failed[0][1]}")
        raise _CaseFailed("; ".join(f"rank {r}: {m}" for r, m in failed))


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
               group_timeout_s: float = 120.0) -> list[Row]:
    """Check one head class at one tp size against the dense model; run on every rank.

    Must be called on every rank of an initialised process group of exactly ``tp_size`` ranks
    (gloo on CPU), with the same arguments. Steps, each a :class:`Row` (or several):

    1. ``torch.manual_seed(seed)``; ``ref = cls(config).double().eval()``, the dense float64
       reference; ``par = tpify.parallelize(copy.deepcopy(ref), tp_group=G, recipe=recipe)`` on
       a process group ``G`` made for this case. Where HF's loss would upcast to float32 only
       (causal / masked LM, token classification), both models get it in float64
       (:func:`float64_loss_function`).
    2. ``forward <field>``: every floating output (``logits``, ``last_hidden_state``,
       ``start_logits``...) of a batch ``(B, T) = (2, 10)`` whose second row is left-padded
       (``attention_mask`` 0 on 3 tokens).
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
       plain transformers (``cls.from_pretrained(dtype=float64)``) holds the dense weights bit
       for bit; ``tpify.from_pretrained(tp_size=..., torch_dtype="float64")`` of it gives the
       outputs that transformers' own dense load of it gives (the loaded model is compared with
       what a user of the checkpoint gets from transformers, buffers computed at load time
       included); and for each ``divide_config`` value, the saved ``config.json`` holds the
       dense value while the parallel config holds ``dense / tp_size``. ``workdir`` (the same
       path on every rank) holds the checkpoint; default a new temporary directory, left in place.

    Tolerance: :data:`ATOL`, :data:`RTOL` (see the module docstring: in float64 only the order
    of summation differs). A step that raises on any rank (``PlanError``, ``RecipeError``, a
    shape error in a forward, anything) ends the case on every rank with a failed row carrying
    the message; nothing propagates. The ranks' rows are merged: a check fails if it failed on
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

    def row(check, diff, ok, message="", tolerance=TOLERANCE):
        rows.append(Row(label, head, tp_size, check, diff, tolerance, ok, message))

    def compare_outputs(prefix, got, want):
        got_f, want_f = _float_outputs(got), _float_outputs(want)
        for name, expected in want_f.items():
            if name.endswith("loss"):
                continue
            if name not in got_f:
                row(f"{prefix} {name}", None, False, "missing from the parallel model's output")
                continue
            diff, ok, why = compare(got_f[name], expected)
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
            _agree_step(error is None, "" if error is None else f"{type(error).__name__}: {error}")
            return value

        state: dict = {}

        def build():
            torch.manual_seed(seed)
            ref = cls(config).double().eval()
            _use_float64_loss(ref)
            state["ref"] = ref
            state["par"] = tpify.parallelize(copy.deepcopy(ref), tp_group=group, recipe=recipe)
            state["inputs"], state["labels"], state["gen"] = _make_inputs(task, cls, config)

        run("parallelize", build)
        ref, par, inputs, labels, gen = (state[k] for k in ("ref", "par", "inputs", "labels", "gen"))

        def forward():
            out_ref, out_par = ref(**inputs), par(**inputs)
            compare_outputs("forward", out_par, out_ref)
            state["out_ref"] = out_ref

        run("forward", forward)

        def loss():
            loss_ref, loss_par = _case_loss(ref, inputs, labels), _case_loss(par, inputs, labels)
            diff, ok, why = compare(loss_par, loss_ref)
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
                diff, ok, why = compare(a, b)
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
            sp_inputs, sp_labels, _ = _make_inputs(task, cls, config, tokens)
            dense = copy.deepcopy(ref)
            dense.zero_grad(set_to_none=True)
            sp = tpify.parallelize(copy.deepcopy(dense), tp_group=group, recipe=recipe, sequence_parallel=True)
            with torch.no_grad():
                compare_outputs("sequence parallel: forward", sp(**sp_inputs), dense(**sp_inputs))
            # (a forward of its own: with labels the LM heads keep their logits vocab-sharded)
            loss_dense, loss_sp = _case_loss(dense, sp_inputs, sp_labels), _case_loss(sp, sp_inputs, sp_labels)
            diff, ok, why = compare(loss_sp, loss_dense)
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
            dense_back = cls.from_pretrained(save_dir, dtype=torch.float64).eval()
            want, got = dense_named(ref), dense_named(dense_back)
            wrong = sorted(n for n in want.keys() | got.keys()
                           if n not in want or n not in got or not torch.equal(want[n], got[n]))
            worst = max((float((want[n] - got[n]).abs().max()) if n in want and n in got and
                         want[n].shape == got[n].shape else math.inf for n in wrong), default=0.0)
            row(f"save: checkpoint weights ({len(want)} tensors, read by transformers)", worst,
                not wrong, f"differ: {wrong[:8]}" if wrong else "", "bitwise")
            # tpify's sharded load of it computes what transformers' dense load of it computes (buffers
            # made at load time included, such as GPT-J's rotary table).
            back = tpify.from_pretrained(save_dir, tp_size=tp_size, tp_group=group, torch_dtype="float64",
                                         model_class=cls, recipe=recipe).eval()
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
        row(f"{step}: raised", None, False, str(e), "-")
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
    """

    target: str
    recipe: object = None
    head_classes: Sequence | None = None
    label: str | None = None
    shrink: bool | None = None
    config: object = None


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
    """The cases of one target at one tp size, or a failed row saying why there are none."""
    from .cli.target import resolve_config

    label = spec.label or str(spec.target)
    try:
        config = spec.config if spec.config is not None else resolve_config(str(spec.target))
        shrink = spec.shrink if spec.shrink is not None else (spec.config is None and not Path(str(spec.target)).is_dir())
        if shrink:
            config = small_config(config, (tp,))
        recipe = _recipe_for(spec.recipe, config)
        heads = _select_heads(config, spec.head_classes)
    except Exception as e:  # noqa: BLE001 - one target's problem is one failed row
        return [], [Row(label, "-", tp, "setup", None, "-", False, f"{type(e).__name__}: {e}")]
    return [_Case(label, cls, task, config, recipe) for task, cls in heads], []


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


def _run_job(cases: list[_Case], tp: int, timeout_s: float, group_timeout_s: float, progress=None
             ) -> tuple[list[list[Row] | None], list[float], str]:
    """Launch ``tp`` ranks that run ``cases``; ``(rows per case or None, seconds per case, error)``.

    The ranks are ``python -c`` subprocesses (never a re-import of the caller's main module, so
    a script without an ``if __name__ == "__main__"`` guard works), with this process's
    ``sys.path``, ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``; each rank's output goes to a
    log whose tail is reported if the rank fails.
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
                                          "group_timeout_s": group_timeout_s}))
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
                group_timeout_s: float = 120.0, progress=None) -> VerifyReport:
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
        rows, seconds, error = _run_job(cases, tp, timeout_s, group_timeout_s, progress)
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
           shrink: bool | None = None, timeout_s: float = 1800.0, progress=None) -> VerifyReport:
    """Verify one recipe on one target: every head class (or ``head_classes``) at every tp size.

    ``target`` is a ``model_type`` (the family's default config, made small by
    :func:`small_config`) or a directory holding a ``config.json`` (used as it is unless
    ``shrink=True``; random weights, the checkpoint's are not read). ``recipe`` defaults to the
    shipped recipe of the config's ``model_type``. One spawned job per tp size runs every head
    class (:func:`verify_many`); rank 0's :class:`Row`\\ s are returned in a
    :class:`VerifyReport` (``report.ok``, ``report.format_table()``).

    Raises:
        tpify.cli.target.TargetError: the target is neither a model_type nor a config directory.
        RecipeError: the recipe is missing or malformed.
        ShrinkError: the family's config cannot be made small.
        ValueError: a head class that is not the family's, a tp size that is not a positive integer.
    """
    from .cli.target import resolve_config

    config = resolve_config(str(target))  # errors about the target itself are raised, not reported
    do_shrink = shrink if shrink is not None else not Path(str(target)).is_dir()
    small = small_config(config, tuple(tp_sizes)) if do_shrink else config
    _recipe_for(recipe, config)
    _select_heads(small, head_classes)
    return verify_many([Target(str(target), recipe, head_classes, shrink=do_shrink)], tp_sizes, timeout_s=timeout_s,
                       progress=progress)
