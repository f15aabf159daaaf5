"""Small configs of a family, and the bounds on what verify builds and runs.

* :func:`small_config`: a tiny config of the family (2 layers, 4 heads, hidden 32, vocabulary
  101, ...) from a full one, through the config's standard attribute names, checked small;
* :func:`check_build_size`: what a config would build, counted on the meta device, refused
  above :data:`MAX_SMALL_ELEMENTS` (2M parameter and buffer elements) before anything is built;
* :data:`RANK_MEMORY_LIMIT_GIB`: each verify rank's address-space limit (a forward that
  allocates far more than expected fails its step with a memory error instead of exhausting
  the machine).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .target import family_head_classes, head_classes

__all__ = ["ShrinkError", "small_config", "check_build_size", "MAX_SMALL_ELEMENTS", "RANK_MEMORY_LIMIT_GIB",
           "SMALL_LAYERS", "SMALL_VOCAB", "SMALL_POSITIONS"]

# Each rank's address-space limit (RLIMIT_AS) in a verify job: a rank of the largest small case
# peaks near 1 GiB of address space (torch, transformers, gloo and two copies of the model).
RANK_MEMORY_LIMIT_GIB = 4.0


class ShrinkError(ValueError):
    """A family's config cannot be made small by :func:`small_config` (names the attributes)."""


# Standard attribute names (config.attribute_map maps family names such as n_embd / n_head onto
# them), with the family-specific names that have no standard counterpart.
_LAYER_NAMES = ("num_hidden_layers", "num_decoder_layers", "num_encoder_layers", "encoder_layers", "decoder_layers")
_HEAD_NAMES = ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "ffn_dim", "encoder_ffn_dim",
                       "decoder_ffn_dim", "hidden_dim", "dff", "moe_intermediate_size",
                       "shared_expert_intermediate_size")  # hidden_dim: distilbert's FFN width, dff: ctrl's
_POSITION_NAMES = ("max_position_embeddings", "n_ctx", "max_seq_len", "seq_length")
_EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")  # a mixture of experts' expert count
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

    From a full config (:func:`tpify.authoring.target.resolve_config`), through the config's standard
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
    * a mixture of experts (``num_experts``, ``num_local_experts``, ``n_routed_experts``): the
      smallest multiple of lcm(tp sizes) that is at least 8 experts (whole experts on every rank
      under expert parallelism), where the config has more, each token routed to at most half
      of them (``num_experts_per_tok``);
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
    sizes = _SmallSizes.for_tp(_lcm(tp_sizes))
    d = config.to_dict()
    d.pop("_name_or_path", None)
    amap = dict(getattr(config, "attribute_map", {}) or {})
    if not _set_present(d, amap, _HEAD_NAMES, sizes.heads):
        raise ShrinkError(f"cannot shrink {type(config).__name__} (model_type {config.model_type!r}): it has none of "
                          f"the head-count attributes {list(_HEAD_NAMES)} (nor an attribute_map onto them); pass a "
                          f"directory holding a small config.json instead")
    _set_sizes(d, amap, sizes)
    _set_experts(d, amap, sizes.experts)
    _cut_per_layer_lists(d, config)
    _small_token_ids(d, SMALL_VOCAB)
    small = _from_small_dict(config, d)
    _check_small(small, sizes.heads, sizes.hidden, 4 * max(sizes.hidden, sizes.intermediate) + 8)
    return small


@dataclass(frozen=True)
class _SmallSizes:
    """The sizes :func:`small_config` sets for tp sizes whose lcm is ``tp`` (see its docstring)."""

    heads: int
    hidden: int
    kv_heads: int
    intermediate: int
    experts: int

    @classmethod
    def for_tp(cls, tp: int) -> "_SmallSizes":
        heads = tp * math.ceil(4 / tp)
        return cls(heads, heads * _HEAD_DIM, tp if tp < heads else heads, tp * math.ceil(48 / tp),
                   tp * math.ceil(8 / tp))


def _set_present(d: dict, amap: dict, names, value) -> list[str]:
    """Set ``value`` at each of ``names`` (through the config's ``attribute_map``) that ``d`` holds;
    the keys set."""
    done = []
    for name in names:
        k = amap.get(name, name)
        if k in d and k not in done:
            d[k] = value
            done.append(k)
    return done


def _set_sizes(d: dict, amap: dict, sizes: _SmallSizes) -> None:
    """Hidden size, layers, head dim, KV heads, MLP width, vocabulary, positions; every dropout 0."""
    _set_present(d, amap, ("hidden_size", "d_model", "n_embd", "n_embed", "word_embed_proj_dim"), sizes.hidden)
    _set_present(d, amap, _LAYER_NAMES + ("num_layers", "n_layer"), SMALL_LAYERS)
    _set_present(d, amap, ("head_dim",), _HEAD_DIM)
    for name in _KV_NAMES:
        k = amap.get(name, name)
        if k in d and d[k] != 1:  # multi-query (one KV head) stays multi-query
            d[k] = sizes.kv_heads
    _set_present(d, amap, _INTERMEDIATE_NAMES, sizes.intermediate)
    _set_present(d, amap, ("vocab_size",), SMALL_VOCAB)
    _set_present(d, amap, _POSITION_NAMES, SMALL_POSITIONS)
    for k, v in list(d.items()):
        if _is_dropout(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            d[k] = 0.0


def _set_experts(d: dict, amap: dict, experts: int) -> None:
    """Fewer experts where the config has more than ``experts`` (a family's default has up to 256:
    the eager loop over them dominates a small model's time), each token routed to at most half."""
    keys = {amap.get(name, name) for name in _EXPERT_NAMES} & set(d)
    counts = [d[k] for k in keys if isinstance(d[k], int) and not isinstance(d[k], bool)]
    if not counts or max(counts) <= experts:
        return
    for k in keys:
        d[k] = experts
    top_k = d.get("num_experts_per_tok")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > experts // 2:
        d["num_experts_per_tok"] = max(1, experts // 2)


def _cut_per_layer_lists(d: dict, config) -> None:
    """Per-layer lists cut to :data:`SMALL_LAYERS`; the rotary part of a head scaled to the small head."""
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


def _from_small_dict(config, d: dict):
    """A config of ``config``'s class from the small values ``d``, with 3 labels (and T5's decoder start).

    Raises:
        ShrinkError: the config class rejects the values.
    """
    cls = type(config)
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
    base = head_classes(config.model_type).get("base") or next(iter(family_head_classes(config).values()), None)
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
                          f"has size attributes tpify.authoring.small.small_config does not know. Pass a directory "
                          f"holding a small config.json")


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
        return ("; no config attribute has these sizes (derived from several; tpify.authoring.small.small_config does "
                "not know them)")
    return ("; config attributes tpify.authoring.small.small_config does not shrink, with these sizes: "
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

