"""transformers' plans tpify refuses to import: families whose plan verify found not exact
(docs/families.md), and HF styles with no tpify counterpart."""

from __future__ import annotations

__all__ = ["REFUSED_FAMILIES", "UNSUPPORTED"]

# HF styles tpify cannot express, and why (the message of the RecipeError).
UNSUPPORTED = {
    "sequence_parallel": "sequence parallelism (activations split along tokens) is not implemented in tpify",
    "packed_rowwise": "a row-parallel layer over packed input parts has no tpify style",
    "embedding_colwise": ("HF's embedding_colwise gathers the hidden dimension after the lookup; tpify's "
                          "embedding_colwise keeps the columns (heads) sharded, a different computation"),
}


# Families whose imported plan would not compute the dense model, found by verifying every
# family transformers can split (benchmarks/sweep_verify.py, docs/families.md): model_type ->
# (config -> the reason, or None where this config is not affected). Refused before anything
# else is read, with the fix.
REFUSED_FAMILIES = {
    "gemma3n_text": lambda config: (
        "its MLPs with activation sparsity (activation_sparsity_pattern > 0: Gemma3nTextMLP._gaussian_topk) take "
        "the mean and standard deviation of gate_proj's output over the full intermediate width, which HF's plan "
        "splits (colwise gate_proj): each rank would keep a different top of its own half. tpify ships a recipe "
        "that keeps the MLPs whole (recipes/gemma3n_text.toml): parallelize(model) uses it"
        if any(v for v in (getattr(config, "activation_sparsity_pattern", None) or []) if v) else None),
    "doge": lambda config: (
        "its attention mixes the heads outside the split projections: dt_proj reads the values of ALL KV heads "
        "(input num_key_value_heads * head_dim) to give one value per KV head, which scales the per-KV-head "
        "parameter DogeAttention.A (num_key_value_heads,) into a dynamic mask repeated over each KV head's query "
        "heads; split by heads, a rank would need every rank's values (HF's plan, rowwise dt_proj, gives every "
        "rank all KV heads' mask against its own query heads: a shape error). Keep the attention whole in a "
        "recipe ([[rule]] match = \"layers.*.self_attn\", style = \"replicate\": q_proj, k_proj, v_proj, dt_proj, "
        "o_proj and A), the rest split as HF's plan does (tpify draft doge starts one); then prove it with tpify "
        "verify"),
    "neomme": lambda config: (
        "its exclusive self-attention holds a parameter per head outside any linear layer "
        "(NeoMMEExclusiveSelfAttention.alpha, shape (num_attention_heads,)) and its value embeddings "
        "(model.value_embeddings, num_key_value_heads * head_dim columns) are added to the split value states, "
        "while HF's plan splits the heads and leaves both whole. tpify ships a recipe that splits them with the "
        "heads (recipes/neomme.toml): parallelize(model) uses it"),
    "embedding_gemma2_text": lambda config: _single_kv_head_layers(config),
}


def _single_kv_head_layers(config) -> str | None:
    """Why embedding_gemma2_text's plan is refused (its layers of one KV head), with the recipe to write."""
    single = [i for i, c in enumerate(_layer_configs(config)) if getattr(c, "num_key_value_heads", None) == 1]
    if not single:
        return None
    shown = ", ".join(f'"layers.{i}.self_attn"' for i in single[:4]) + (", ..." if len(single) > 4 else "")
    return (f"its per_layer_config gives layers {single} a single KV head (num_key_value_heads = 1: its "
            f"full-attention layers), which HF's plan splits over the ranks (colwise k_proj, v_proj matched by "
            f"layers.*) although one head cannot be split. Write a recipe (tpify draft {config.model_type} starts "
            f"one) whose attention rules list the other layers by index, and keep these layers' attention whole "
            f"([[rule]] match = [{shown}], style = \"replicate\"), the MLPs split as HF's plan does; then prove it "
            f"with tpify verify")


def _layer_configs(config) -> list:
    """The per-layer configs of a heterogeneous config (``config.per_layer_config``), else none."""
    try:
        layers = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
        return list(layers) if layers is not None else []
    except Exception:  # noqa: BLE001 - a config that cannot enumerate its layers: nothing to check
        return []
