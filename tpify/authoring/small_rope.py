"""Rotary sections of a small config: each ``mrope_section`` rescaled to the small head.

Multimodal rotary embeddings (Qwen2-VL's M-RoPE and its kin) split a head's rotary frequencies
into sections (time, height, width, ...); the small head of :func:`tpify.authoring.small.small_config`
has fewer frequencies, so the sections are apportioned again (:func:`rescale_mrope`).
"""

from __future__ import annotations

import math
import re

__all__ = ["rescale_mrope"]


def rescale_mrope(d: dict, head_dim: int) -> None:
    """Each ``mrope_section`` (in ``rope_parameters`` / ``rope_scaling``, per layer kind too)
    rescaled to the small head: its sections sum to the rotary frequencies of the small head
    (half its rotary dims: ``head_dim * partial_rotary_factor / 2``), in proportion, equal
    sections kept equal (:func:`_apportion`; a section may be 0 when there are fewer
    frequencies than sections: glm4v_moe's 2 over [8, 12, 12]). A
    family whose modeling code supplies the sections when the config has none
    (``config.rope_parameters.get("mrope_section", [16, 24, 24])``: qwen2_vl, glm4v, ernie4_5_vl,
    ...) gets that default, rescaled, written into the small config. A ``partial_rotary_factor``
    that would rotate a number of dims of the small head that is not a multiple of 4 becomes
    0.5 (neomme's two M-RoPE axes take frequencies in pairs)."""
    default = _code_mrope_section(d.get("model_type"))
    if default and isinstance(d.get("rope_parameters"), dict) and not any(
            "mrope_section" in p for p in _rope_dicts(d["rope_parameters"])):
        d["rope_parameters"]["mrope_section"] = list(default)
    for key in ("rope_parameters", "rope_scaling"):
        for params in _rope_dicts(d.get(key)) + [d]:
            factor = params.get("partial_rotary_factor")
            if isinstance(factor, float) and 0 < factor < 0.5 and (factor * head_dim) % 4:
                params["partial_rotary_factor"] = 0.5
            sections = params.get("mrope_section")
            if not (isinstance(sections, list) and sections and all(isinstance(s, int) for s in sections)):
                continue
            rotary = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            params["mrope_section"] = _apportion(sections, round(head_dim * rotary) // 2)


_MROPE_DEFAULT = re.compile(r"""mrope_section["']\s*,\s*\[([\d,\s]+)\]""")


def _code_mrope_section(model_type: str | None) -> tuple[int, ...] | None:
    """The ``mrope_section`` default the family's modeling code reads when its config has none,
    from the module's source (``rope_parameters.get("mrope_section", [16, 24, 24])``), or None."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        module = importlib.import_module(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
        match = _MROPE_DEFAULT.search(inspect.getsource(module))
    except Exception:  # noqa: BLE001 - no modeling module, no source: no default
        return None
    return tuple(int(v) for v in match.group(1).split(",") if v.strip()) if match else None


def _rope_dicts(value) -> list[dict]:
    if not isinstance(value, dict):
        return []
    nested = [v for v in value.values() if isinstance(v, dict)]  # per layer kind (gemma3: sliding / full)
    return [value] + nested


def _apportion(parts: list[int], total: int) -> list[int]:
    """``total`` split in proportion to ``parts``, parts that are equal kept equal (ernie's
    height and width sections), the smallest squared error of the proportions; each part at
    least 1 where ``total`` allows it, else some 0."""
    import itertools

    least = 1 if total >= len(parts) else 0
    best, best_err = None, math.inf
    for cut in itertools.combinations_with_replacement(range(total + 1), len(parts) - 1):
        split = [b - a for a, b in zip((0,) + cut, cut + (total,))]
        if min(split) < least:
            continue
        if any(split[i] != split[j] for i in range(len(parts)) for j in range(i) if parts[i] == parts[j]):
            continue
        err = sum((s / total - p / sum(parts)) ** 2 for s, p in zip(split, parts))
        if err < best_err:
            best, best_err = split, err
    return best or [max(1, total // len(parts))] * len(parts)
