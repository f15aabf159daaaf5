"""Which layers a small config keeps, and every per-layer value of the config cut to them.

A family's config may describe its layers one by one: ``layer_types`` (sliding / full / linear
attention), ``mlp_layer_types`` (dense / sparse), ``layers_block_type``, per-layer numbers
(``intermediate_size`` as a list, ``no_rope_layers``, ``activation_sparsity_pattern``), a
sparse ``per_layer_config`` mapping of layer index -> overrides, and lists of layer indices
(``kv_source_layers``, ``mlp_only_layers``). Cutting each list to its first two entries would
drop a kind of layer (a hybrid model's one attention layer in four, the sparse layers after a
dense first layer) or disagree between lists; the config classes of transformers 5 refuse
lengths that differ from ``num_hidden_layers``.

:func:`keep_layers` picks a few layer indices (at most :data:`MAX_LAYERS`, at least the
requested count) that together show every kind of layer each per-layer list names;
:func:`cut_layers` then rewrites every per-layer value of a config dict for those layers, the
same indices in every list, and the layer count.
"""

from __future__ import annotations

import json
from typing import Sequence

__all__ = ["MAX_LAYERS", "per_layer_entries", "keep_layers", "cut_layers"]

# The most layers a small config keeps (when the per-layer lists name more kinds than the
# requested count can show).
MAX_LAYERS = 4
# Values that are layer indices, remapped to the kept layers: one index per layer (the layer whose
# KV cache a layer reads; its sources are kept too), and sets of layer indices (those not kept
# are dropped).
_SOURCE_PER_LAYER = ("kv_source_layers",)


def _is_layer_set(key: str, value, layers: int) -> bool:
    """A list of distinct layer indices named ``*_layers`` (``mlp_only_layers``, llama4's
    ``moe_layers``), ``*_idxs`` (lfm2's ``full_attn_idxs``) or ``*_indices`` (bamba's
    ``attn_layer_indices``), not one value per layer (``no_rope_layers`` holds 0 / 1 per layer)."""
    return key.endswith(("_layers", "_idxs", "_indices")) and key not in _SOURCE_PER_LAYER and isinstance(value, list) \
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value) \
        and len(set(value)) == len(value) and (len(value) != layers or value == list(range(layers)))
# Keys whose list value never describes layers, whatever its length.
_NOT_PER_LAYER = ("architectures", "id2label", "label2id", "mrope_section", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                  "forced_decoder_ids", "L_bp_cycles")


def _signature(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _is_layer_key(key) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def per_layer_entries(d: dict, layers: int) -> dict[str, list]:
    """``{key: one value per layer}`` of the per-layer entries of the config dict ``d`` with
    ``layers`` layers: lists (and strings) of that length, and mappings keyed by layer index
    (``per_layer_config``: the override of a layer, None where it has none). Lists of layer
    indices (``kv_source_layers``; sets of layer indices such as ``mlp_only_layers``), token ids and the keys of ``_NOT_PER_LAYER`` are not
    per-layer values."""
    out: dict[str, list] = {}
    if layers <= 1:
        return out
    for key, value in d.items():
        if key in _NOT_PER_LAYER or key in _SOURCE_PER_LAYER or "token" in key or _is_layer_set(key, value, layers):
            continue
        if isinstance(value, (list, str)) and len(value) == layers and not isinstance(value, str):
            out[key] = list(value)
        elif isinstance(value, dict) and value and all(_is_layer_key(k) and isinstance(v, (dict, type(None)))
                                                       for k, v in value.items()):
            by_index = {int(k): v for k, v in value.items()}
            if max(by_index) < layers:
                out[key] = [by_index.get(i) for i in range(layers)]
    return out


def keep_layers(entries: dict[str, list], layers: int, want: int, d: dict | None = None) -> list[int]:
    """The layer indices a small config keeps, ascending.

    Greedy cover: each step adds the layer that shows the most (entry, value) pairs not yet
    shown (the earliest on a tie), until every value of every entry is shown or
    :data:`MAX_LAYERS` are kept; then the earliest other layers up to ``want``. The layers that
    ``d``'s ``kv_source_layers`` names as sources of kept layers are kept too.
    """
    uncovered = {(k, _signature(v)) for k, values in entries.items() for v in values}
    keep: list[int] = []
    while uncovered and len(keep) < MAX_LAYERS:
        gains = [(len({(k, _signature(values[i])) for k, values in entries.items()} & uncovered), -i)
                 for i in range(layers)]
        gain, neg = max(gains)
        if gain == 0:
            break
        keep.append(-neg)
        uncovered -= {(k, _signature(values[-neg])) for k, values in entries.items()}
    for i in range(layers):
        if len(keep) >= min(want, layers):
            break
        if i not in keep:
            keep.append(i)
    sources = (d or {}).get("kv_source_layers")
    if isinstance(sources, list) and len(sources) == layers:
        keep += [sources[i] for i in keep if isinstance(sources[i], int) and sources[i] not in keep]
    return sorted(set(keep))


def cut_layers(d: dict, layers: int, keep: Sequence[int], layer_keys: Sequence[str]) -> None:
    """Rewrite ``d`` (a config dict with ``layers`` layers) for the layers ``keep``: every
    per-layer entry (:func:`per_layer_entries`) to those layers, in order (a mapping keyed by
    layer index re-keyed by the new positions, its empty entries left out), the layer indices of
    ``kv_source_layers`` and of the sets of layer indices remapped, and each of ``layer_keys`` (the layer counts)
    set to ``len(keep)``."""
    entries = per_layer_entries(d, layers)
    sets = [key for key, value in d.items() if _is_layer_set(key, value, layers)]
    new_index = {old: new for new, old in enumerate(keep)}
    for key, values in entries.items():
        if isinstance(d[key], dict):
            d[key] = {new: values[old] for old, new in new_index.items() if values[old] is not None}
        else:
            d[key] = [values[old] for old in keep]
    for key in _SOURCE_PER_LAYER:
        value = d.get(key)
        if isinstance(value, list) and len(value) == layers:
            d[key] = [new_index[value[old]] for old in keep]
    for key in sets:
        d[key] = [new_index[v] for v in d[key] if v in new_index]
    for key in layer_keys:
        if key in d:
            d[key] = len(keep)
