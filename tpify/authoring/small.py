"""Small configs of a family (:func:`small_config`): a tiny config of the family (2 layers, 4 heads,
hidden 32, vocabulary 101, ...) from a full one, through the config's standard attribute names,
checked small. What each size becomes: docs/recipes.md, "Small configs". The bounds on what
verify builds: :mod:`tpify.authoring.build_size` (re-exported here).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .build_size import (MAX_SMALL_ELEMENTS, RANK_MEMORY_LIMIT_GIB, ShrinkError, _attributes_note,
                         _check_model_size, check_build_size)
from .small_layers import MAX_LAYERS, cut_layers, keep_layers, per_layer_entries
from .small_rope import rescale_mrope
from .target import family_head_classes

__all__ = ["ShrinkError", "small_config", "check_build_size", "MAX_SMALL_ELEMENTS", "RANK_MEMORY_LIMIT_GIB",
           "SMALL_LAYERS", "SMALL_VOCAB", "SMALL_POSITIONS"]

# Standard attribute names (config.attribute_map maps family names such as n_embd / n_head onto
# them), with the family-specific names that have no standard counterpart.
_LAYER_NAMES = ("num_hidden_layers", "num_decoder_layers", "num_encoder_layers", "encoder_layers", "decoder_layers")
_HEAD_NAMES = ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_NAMES = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_INTERMEDIATE_NAMES = ("intermediate_size", "n_inner", "d_ff", "ffn_hidden_size", "ffn_dim", "encoder_ffn_dim",
                       "decoder_ffn_dim", "hidden_dim", "dff", "moe_intermediate_size",
                       "shared_expert_intermediate_size")  # hidden_dim: distilbert's FFN width, dff: ctrl's
_POSITION_NAMES = ("max_position_embeddings", "n_ctx", "max_seq_len", "seq_length")
# Every other MLP / expert width (MoE experts, shared experts, dense layers of a sparse model).
_WIDTH_NAME = re.compile(r"intermediate|ffn_hidden|ffn_dim|expert_dim|moe_hidden|expert_ffn|share_expert_dim")
# a mixture of experts' expert count, and the experts each token is routed to
_EXPERT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                 "n_experts")
_TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts")
_HEAD_DIM = 8
SMALL_LAYERS, SMALL_VOCAB, SMALL_POSITIONS = 2, 101, 64
_RANK = 16  # the low ranks of multi-head latent attention (q_lora_rank, kv_lora_rank, o_lora_rank)


def _at_most(n: int):
    return lambda sizes, old: min(old, n)


def _fixed(n: int):
    return lambda sizes, old: n


def _positive(n: int):
    """``n`` for a positive value; 0 (a part left out, glm5's NoPE layers) stays 0."""
    return lambda sizes, old: n if old > 0 else old


# Family sizes that have no standard name: key -> its small value (a function of the small sizes
# and the old value), wherever a config dict holds it as an integer.
_FAMILY_SIZES = {
    # multi-head latent attention (DeepSeek-V2/V3 and their kin): low ranks, per-head sizes
    **{k: _at_most(_RANK) for k in ("q_lora_rank", "kv_lora_rank", "o_lora_rank")},
    **{k: _positive(_HEAD_DIM) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")},
    "qk_head_dim": _positive(2 * _HEAD_DIM),
    # mixture of experts (the counts: _set_experts): groups of one, one shared expert
    **{k: _at_most(1) for k in ("n_group", "topk_group", "num_expert_group", "n_shared_experts",
                                "num_shared_experts", "moe_num_shared_experts")},
    "zero_expert_num": _at_most(2),
    # linear attention, state-space layers, sparse-attention indexers: head sizes and counts
    **{k: _fixed(_HEAD_DIM) for k in ("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                                      "index_head_dim", "swa_head_dim", "global_head_dim")},
    "linear_num_key_heads": lambda sizes, old: min(old, sizes.kv_heads),
    "linear_num_value_heads": lambda sizes, old: min(old, sizes.heads),
    **{k: lambda sizes, old: min(old, sizes.heads) for k in ("mamba_n_heads", "mamba_num_heads", "index_n_heads",
                                                             "linear_num_heads", "swa_num_attention_heads")},
    "swa_num_key_value_heads": lambda sizes, old: min(old, sizes.kv_heads),
    "mamba_head_dim": _fixed(_HEAD_DIM),
    **{k: _at_most(_HEAD_DIM) for k in ("mamba_d_state", "ssm_state_size", "state_size")},
    **{k: _at_most(1) for k in ("mamba_n_groups", "n_groups")},
    **{k: _at_most(16) for k in ("mamba_chunk_size", "chunk_size")},
    # per-layer inputs (gemma3n), scaled embeddings (minicpm3), codebooks
    "vocab_size_per_layer_input": _fixed(SMALL_VOCAB),
    "hidden_size_per_layer_input": _at_most(_HEAD_DIM),
    "dim_model_base": lambda sizes, old: sizes.hidden,
    "codebook_size": _at_most(8),
    "embedding_dim": lambda sizes, old: min(old, sizes.hidden),
    "embed_dim": lambda sizes, old: min(old, sizes.hidden),  # Qwen2-VL's vision tower width
    "embedding_rank": _at_most(_RANK),
    "loop_gate_rank": _at_most(_HEAD_DIM),  # inkling2_loop's loop gates
    # the vocabulary the LM head predicts when the embedding's is padded (inkling2: 200058 of 201024)
    "unpadded_vocab_size": _fixed(SMALL_VOCAB),
    # lfm2's MLP width rounded up to a multiple of this (256: a 48-wide small MLP would become 256)
    "block_multiple_of": _at_most(16),
    "hc_lowrank": _at_most(_HEAD_DIM),
    # relative-position extents (inkling: a table as wide as the window)
    "rel_extent": _at_most(16),
    "bias_max_distance": _at_most(8),
    "sliding_window_size": _at_most(8),
    # vision and audio towers of a composite model: a few patches of a few pixels, narrow stages
    "patch_size": _at_most(2),
    "mm_tokens_per_image": _at_most(4),  # Gemma 3's pooled image tokens: 2 x 2 of the small tower's 4 x 4 patches
    **{k: _at_most(8) for k in ("image_size", "crop_size", "nemo_conv_channels")},
    **{k: _at_most(4) for k in ("pos_emb_height", "pos_emb_width")},
    "position_embedding_size": _at_most(16),
    "num_blocks": _at_most(SMALL_LAYERS),
    # the layer structure: a dense first layer then sparse ones, short periods, no KV sharing
    **{k: _at_most(1) for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index",
                                "attn_layer_offset", "expert_layer_offset", "num_layers_per_stack",
                                "n_layers_per_attn_res_block", "L_cycles")},
    **{k: _at_most(2) for k in ("global_attn_every_n_layers", "no_rope_layer_interval", "attn_layer_period",
                                "expert_layer_period", "layer_group_size")},
    "moe_layer_end_index": lambda sizes, old: old if old < 0 else MAX_LAYERS - 1,
    "num_kv_shared_layers": _fixed(0),
}


class _PerLayer(tuple):
    """A per-layer pattern in :data:`_DEFAULT_GAPS`: repeated to the config's layer count."""


class _Replace(tuple):
    """A per-layer pattern in :data:`_DEFAULT_GAPS` that replaces the default's value (one the
    model cannot run with), repeated to the config's layer count."""


# What transformers' default config of a family leaves out (None, or a value its modeling code
# assumes without the config saying it) although its model reads it: the default config alone
# cannot build the model. The small config supplies it (a mapping is merged into the config's;
# only missing or None values are set), before the sizes are made small.
_DEFAULT_GAPS = {
    # Lfm2MoeDecoderLayer reads config.layer_types[i]; the default leaves it None
    "lfm2_moe": {"layer_types": _PerLayer(("conv", "full_attention"))},
    # DeepseekOcr2TextDecoderLayer reads config.mlp_layer_types[i]; the experts per token are None
    "deepseek_ocr2_text": {"mlp_layer_types": _PerLayer(("dense", "sparse")), "num_experts_per_tok": 2,
                           "n_group": 1, "topk_group": 1},
    # the router needs the expert counts, None by default
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48},
    # the rotary embedding reads rope_parameters[layer type] (and the code's mrope_section default)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [24, 20, 20]}}},
    # the indexed-attention layers of the default layer_types need the indexer's sizes (QSA)
    # the default layer_types are all linear (mamba) layers, and the forward asks the cache for
    # the length of an attention layer's
    "granitemoehybrid": {"layer_types": _Replace(("linear_attention", "full_attention"))},
    # sliding-attention layers in the default layer_types, no sliding_window
    "step3p5": {"sliding_window": SMALL_POSITIONS},
    # Qwen3OmniMoeTalkerModel reads config.shared_expert_intermediate_size, which only the composite
    # talker config sets on its text config
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": 48},
    # the encoder / decoder of T5Gemma and T5Gemma2 read config.dropout_rate, which only the
    # composite config sets on them
    **{t: {"dropout_rate": 0.0} for t in ("t5_gemma_module", "t5gemma2_decoder", "t5gemma2_text")},
    # the default layer_types are all linear (mamba) layers (attn_layer_indices None), and the forward
    # asks the cache for the length of an attention layer's: transformers' own dense BambaModel raises
    # ValueError (get_seq_length on LinearAttention layers only); one attention layer, as in the
    # released Bamba checkpoints
    "bamba": {"attn_layer_indices": [1]},
    # the default layer_types are all attention; LFM2's checkpoints interleave short-convolution
    # layers (a depthwise Conv1d), which the small model then shows too
    "lfm2": {"layer_types": _Replace(("conv", "full_attention"))},
    # HunYuanVLTextRotaryEmbedding reads rope_parameters["mrope_section"] (len(None) fails: the dense
    # model raises TypeError in transformers itself); the default has none. Four equal sections
    # (position, width, height, image index: the 4-axis layout the config documents)
    "hunyuan_vl_text": {"rope_parameters": {"mrope_section": [16, 16, 16, 16]}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
}


def _fill_gaps(d: dict, gaps: dict, layers: int | None) -> None:
    """Merge ``gaps`` (:data:`_DEFAULT_GAPS`) into the config dict ``d``: missing or None values
    set, mappings merged, per-layer patterns repeated to ``layers``."""
    for key, value in gaps.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _fill_gaps(d[key], value, layers)
        elif d.get(key) is None or isinstance(value, _Replace) or (isinstance(value, dict) and
                                                                    not isinstance(d.get(key), dict)):
            if isinstance(value, (_PerLayer, _Replace)):
                value = [value[i % len(value)] for i in range(layers or len(value))]
            d[key] = copy.deepcopy(value)
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


def _small_token_ids(d: dict, vocab: int, used: set[int] | None = None) -> None:
    """Special token ids below ``vocab``: the family's own when small, else pad 0, bos 1, eos 2, ...;
    ``used``: the ids other parts of a composite config took (updated)."""
    keys = [k for k in d if k.endswith(("_token_id", "_token_index"))]  # LLaVA stores image_token_id as image_token_index
    used = set() if used is None else used
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

    A new config of the same class: 2 layers (up to 4 to show every kind of a per-layer list),
    heads the smallest multiple of lcm(tp sizes) >= 4, head dim 8, MLP width a multiple >= 48,
    vocabulary 101, 64 positions, dropout 0; each sub-config of a composite likewise. Checked:
    the sizes read back, and the base model built on the meta device is small. Every size it
    sets: docs/recipes.md, "Small configs".

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
    subs = _sub_configs(config, d)
    if not _set_present(dict(d), amap, _HEAD_NAMES, sizes.heads) and not any(
            _has_heads(d[k], sub_amap) for k, sub_amap in subs.items()):
        raise ShrinkError(f"cannot shrink {type(config).__name__} (model_type {config.model_type!r}): it has none of "
                          f"the head-count attributes {list(_HEAD_NAMES)} (nor an attribute_map onto them), nor a "
                          f"sub-config with one; pass a directory holding a small config.json instead")
    used: set[int] = set()
    for key, sub_amap in subs.items():
        _shrink_dict(d[key], sub_amap, sizes, config)
        _small_token_ids(d[key], SMALL_VOCAB, used)
    _shrink_dict(d, amap, sizes, config)
    _small_token_ids(d, SMALL_VOCAB, used)
    small = _from_small_dict(config, d, sizes)
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
    """Set ``value`` at each of ``names`` (through the config's ``attribute_map``) that ``d`` holds
    (a list of integers: each element); the keys set."""
    done = []
    for name in names:
        k = amap.get(name, name)
        if k in d and k not in done:
            d[k] = _like(d[k], value)
            done.append(k)
    return done


def _like(old, value):
    """``value``, or a list of ``value`` as long as ``old`` where ``old`` is a list of numbers
    (gemma3n's per-layer ``intermediate_size``)."""
    if isinstance(old, list) and old and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in old):
        return [value] * len(old)
    return value


def _has_heads(d: dict, amap: dict) -> bool:
    return any(amap.get(n, n) in d for n in _HEAD_NAMES)


def _sub_configs(config, d: dict) -> dict[str, dict]:
    """``{key: attribute_map}`` of ``config``'s sub-configs held in ``d`` (``text_config``,
    ``vision_config``, ``audio_config``, ...; ``config.sub_configs`` names them)."""
    out = {}
    for key, cls in (getattr(config, "sub_configs", None) or {}).items():
        if isinstance(d.get(key), dict):
            out[key] = dict(getattr(cls, "attribute_map", {}) or {})
    return out


def _layer_count(d: dict, amap: dict) -> int | None:
    """The layer count ``d`` states (the first of the layer-count names it holds)."""
    for name in _LAYER_NAMES + ("num_layers", "n_layer"):
        value = d.get(amap.get(name, name))
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _shrink_dict(d: dict, amap: dict, sizes: _SmallSizes, config) -> None:
    """Make one config dict (the config's own, or a sub-config's) small, in place."""
    _unpair_blocks(d, amap)
    layers = _layer_count(d, amap)
    _fill_gaps(d, _DEFAULT_GAPS.get(d.get("model_type"), {}), layers)
    entries = per_layer_entries(d, layers) if layers else {}
    full = dict(d)
    _set_sizes(d, amap, sizes)
    _set_family_sizes(d, sizes)
    _set_experts(d, amap, sizes.experts)
    _mla_head_dim(d, full, d, amap)
    if layers and layers > SMALL_LAYERS:
        keep = keep_layers(entries, layers, SMALL_LAYERS, d)
        layer_keys = [amap.get(n, n) for n in _LAYER_NAMES + ("num_layers", "n_layer")]
        cut_layers(d, layers, keep, layer_keys)
    _fit_sections(d, amap)
    for key in entries:  # per-layer overrides: the same sizes, a head dim kept in proportion
        if isinstance(d.get(key), dict):
            for override in d[key].values():
                if isinstance(override, dict):
                    full_override = dict(override)
                    _shrink_override(override, amap, sizes, full.get(amap.get("head_dim", "head_dim")))
                    _mla_head_dim(override, {**full, **full_override}, {**d, **override}, amap)
    _cut_per_layer_lists(d, config)
    rescale_mrope(d, _HEAD_DIM)
    if isinstance(d.get("num_layers_per_stack"), int) and isinstance(d.get("H_cycles"), int):
        # hrm_text: num_hidden_layers counts every pass, per stack x H cycles x (L cycles + 1)
        d["num_hidden_layers"] = d["num_layers_per_stack"] * d["H_cycles"] * (d.get("L_cycles", 1) + 1)


def _unpair_blocks(d: dict, amap: dict) -> None:
    """A config dict that lists each layer as two blocks, ``(attention kind, "mlp")`` (dory's
    ``to_dict``: as its released ``config.json`` files do, with every layer count doubled), made one
    entry per layer, the form its ``__post_init__`` turns it into: a cut of the paired list would
    keep unpaired blocks and disagree with the halved counts."""
    kinds = d.get("layer_types")
    if not (isinstance(kinds, list) and len(kinds) % 2 == 0 and kinds and all(k == "mlp" for k in kinds[1::2])
            and "mlp" not in kinds[::2]):
        return
    d["layer_types"] = kinds[::2]
    for key in [amap.get(n, n) for n in _LAYER_NAMES] + ["n_input_layers", "n_recurrent_layers", "n_output_layers"]:
        if isinstance(d.get(key), int) and not isinstance(d[key], bool):
            d[key] //= 2


def _fit_sections(d: dict, amap: dict) -> None:
    """Sections of the layers that must fit the small layer count, set after the layers are cut.

    * dory: ``n_input_layers + n_recurrent_layers + n_output_layers`` must equal the layer count
      (its validator): one input layer, one output layer where there are 3 or more, the others
      recurrent (looped at most twice);
    * inkling2_loop: the looped layers ``[loop_layer_index_start, loop_layer_index_end)`` must lie
      in the model, after its first layer: every layer but the first, run at most twice.
    """
    layers = _layer_count(d, amap)
    if not isinstance(layers, int):
        return
    sections = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
    if all(isinstance(d.get(k), int) for k in sections) and layers >= 2:
        d.update(n_input_layers=1, n_recurrent_layers=layers - 1 - min(1, layers - 2), n_output_layers=min(1, layers - 2))
        if isinstance(d.get("n_recurrent_loops"), int):
            d["n_recurrent_loops"] = min(d["n_recurrent_loops"], 2)
    if isinstance(d.get("loop_layer_index_start"), int) and isinstance(d.get("loop_layer_index_end"), int) \
            and layers >= 2:
        d.update(loop_layer_index_start=1, loop_layer_index_end=layers)
        if isinstance(d.get("loop_num_passes"), int):
            d["loop_num_passes"] = min(d["loop_num_passes"], 2)


def _set_sizes(d: dict, amap: dict, sizes: _SmallSizes) -> None:
    """Hidden size, layers, head dim, KV heads, MLP width, vocabulary, positions; every dropout 0."""
    _set_present(d, amap, ("hidden_size", "d_model", "n_embd", "n_embed", "word_embed_proj_dim"), sizes.hidden)
    _set_present(d, amap, _LAYER_NAMES + ("num_layers", "n_layer"), SMALL_LAYERS)
    _set_present(d, amap, _HEAD_NAMES + ("num_attention_heads_per_layer",), sizes.heads)
    _set_present(d, amap, ("head_dim",), _HEAD_DIM)
    mla = isinstance(d.get("kv_lora_rank"), int)  # latent attention expands its KV to every head
    for name in _KV_NAMES:
        k = amap.get(name, name)
        if k in d and d[k] != 1:  # multi-query (one KV head) stays multi-query
            d[k] = _like(d[k], sizes.heads if mla else sizes.kv_heads)
    _set_present(d, amap, _INTERMEDIATE_NAMES, sizes.intermediate)
    for k, v in list(d.items()):  # every other MLP / expert width
        if _WIDTH_NAME.search(k) and isinstance(v, int) and not isinstance(v, bool) and v > sizes.intermediate:
            d[k] = sizes.intermediate
    _set_present(d, amap, ("vocab_size",), SMALL_VOCAB)
    _set_present(d, amap, _POSITION_NAMES, SMALL_POSITIONS)
    for k, v in list(d.items()):
        if _is_dropout(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            d[k] = 0.0


def _set_family_sizes(d: dict, sizes: _SmallSizes) -> None:
    """The sizes of :data:`_FAMILY_SIZES` that ``d`` holds as integers (None and "auto" stay),
    then the sizes a family derives from others (``mamba_d_head``, ``mamba_dt_rank``)."""
    for key, small in _FAMILY_SIZES.items():
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            d[key] = small(sizes, value)
    for key in ("projector_input_dim", "projector_output_dim", "vision_output_dim", "out_hidden_size",
                "projector_hidden_size", "adapter_in_dim", "adapter_out_dim", "text_hidden_size",
                "ext_pw_out_channel", "depthwise_separable_out_channel"):
        if isinstance(d.get(key), int):  # the widths that connect a composite model's parts
            d[key] = sizes.hidden
    ratio = d.get("pixel_shuffle_ratio")
    if isinstance(ratio, float) and 0 < ratio < 1 and isinstance(d.get("intermediate_size"), int):
        # Llama 4's vision adapter takes the pixel-shuffled patches, hidden / ratio^2 wide, into a
        # Linear of intermediate_size inputs (1408 / 0.5^2 = 5632 at full size)
        d["intermediate_size"] = round(sizes.hidden / ratio ** 2)
    heads, expand = d.get("mamba_n_heads"), d.get("mamba_expand")
    if isinstance(d.get("mamba_d_head"), int) and isinstance(heads, int) and isinstance(expand, int):
        d["mamba_d_head"] = expand * sizes.hidden // heads
    if isinstance(d.get("mamba_d_ssm"), int) and isinstance(d.get("mamba_d_head"), int) and isinstance(heads, int):
        d["mamba_d_ssm"] = d["mamba_d_head"] * heads  # falcon_h1: its validator wants d_head * n_heads = d_ssm
    if isinstance(d.get("mamba_dt_rank"), int):
        d["mamba_dt_rank"] = math.ceil(sizes.hidden / 16)  # transformers' "auto"
    widths = d.get("hidden_sizes")  # the stages of a convolutional tower (muse_spark's audio), widest = hidden
    if isinstance(widths, list) and widths and all(isinstance(w, int) and w > 0 for w in widths):
        d["hidden_sizes"] = [max(1, w * sizes.hidden // max(widths)) for w in widths]
        if isinstance(d.get("depths"), list):
            d["depths"] = [1 for _ in d["depths"]]


def _mla_head_dim(target: dict, full: dict, small: dict, amap: dict) -> None:
    """Where the family's head dim is multi-head latent attention's ``qk_nope_head_dim +
    qk_rope_head_dim`` (``full``: the values before shrinking, a layer's overrides merged in;
    dots3's sliding layers), the small head dim is the small sum, set in ``target``."""
    key = amap.get("head_dim", "head_dim")
    nope, rope, head = full.get("qk_nope_head_dim"), full.get("qk_rope_head_dim"), full.get(key)
    if isinstance(nope, int) and isinstance(rope, int) and nope > 0 and head == nope + rope:
        target[key] = small["qk_nope_head_dim"] + small["qk_rope_head_dim"]


def _shrink_override(override: dict, amap: dict, sizes: _SmallSizes, full_head) -> None:
    """A layer's overrides (``per_layer_config``) made small: a head dim in proportion to the
    family's own ``full_head`` (gemma4's full-attention layers: 512 against 256 -> 16 against 8),
    the other sizes as everywhere."""
    head = override.get("head_dim")
    _set_sizes(override, amap, sizes)
    _set_family_sizes(override, sizes)
    if isinstance(head, int) and isinstance(full_head, int) and full_head and head % full_head == 0:
        override["head_dim"] = _HEAD_DIM * head // full_head


def _config_int(config, name: str) -> int | None:
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - per-layer configs raise on some global attributes
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _set_experts(d: dict, amap: dict, experts: int) -> None:
    """Fewer experts where the config has more than ``experts`` (a family's default has up to 256:
    the eager loop over them dominates a small model's time), each token routed to at most half."""
    keys = {amap.get(name, name) for name in _EXPERT_NAMES} & set(d)
    counts = [d[k] for k in keys if isinstance(d[k], int) and not isinstance(d[k], bool)]
    if not counts or max(counts) <= experts:
        return
    for k in keys:
        d[k] = experts
    for name in _TOP_K_NAMES:
        top_k = d.get(name)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > experts // 2:
            d[name] = max(1, experts // 2)


def _cut_per_layer_lists(d: dict, config) -> None:
    """gpt_neo's attention kinds cut to :data:`SMALL_LAYERS`; the rotary part of a head scaled to the small head."""
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


def _from_small_dict(config, d: dict, sizes: _SmallSizes):
    """A config of ``config``'s class from the small values ``d``, with 3 labels (and T5's decoder start).

    A config class that refuses grouped-query attention (its message names the KV heads) gets
    as many KV heads as heads, once.

    Raises:
        ShrinkError: the config class rejects the values.
    """
    cls = type(config)
    for k in ("architectures", "id2label", "label2id", "num_labels"):
        d.pop(k, None)
    try:
        try:
            small = cls.from_dict(copy.deepcopy(d))
        except Exception as e:  # noqa: BLE001 - retried once without grouped-query attention
            if not re.search(r"num_key_value_heads|grouped-query|kv_heads", str(e)):
                raise
            for part in [d] + [o for v in d.values() if isinstance(v, dict) for o in v.values() if isinstance(o, dict)]:
                for name in _KV_NAMES:  # the config's own, and each layer's override
                    if part.get(name) == sizes.kv_heads:
                        part[name] = sizes.heads
            small = cls.from_dict(copy.deepcopy(d))
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
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    got = {n: _config_int(text, n) for n in ("num_attention_heads", "hidden_size", "vocab_size")}
    want = {"num_attention_heads": heads, "hidden_size": hidden, "vocab_size": SMALL_VOCAB}
    wrong = {n: v for n, v in got.items() if v is not None and v != want[n]}
    layers = _config_int(text, "num_hidden_layers")
    if layers is not None and not 1 <= layers <= 2 * MAX_LAYERS:  # longcat_flash: 2 sub-layers per layer
        wrong["num_hidden_layers"] = layers
        want["num_hidden_layers"] = f"{SMALL_LAYERS} to {2 * MAX_LAYERS}"
    if wrong:
        raise ShrinkError(f"cannot shrink {name}: after setting them, config values read back as {wrong} "
                          f"(wanted {({n: want[n] for n in wrong})})")
    heads = family_head_classes(config)
    base = heads.get("base") or next(iter(heads.values()), None)
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
