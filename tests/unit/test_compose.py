"""Composed recipes (``[[include]]``, tpify/recipe.py ``compose``): one process, meta models.

A vision-language recipe applies the language model's recipe and the vision tower's to their
sub-modules, each reading its own sub-config (``text_config``, ``vision_config``); what does not
fit is refused by name before anything is built or communicated. The numbers (outputs, loss,
gradients, generate, save/load against dense) are proved in
tests/distributed/test_vision_language.py.
"""

import pytest
import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaModel

import tpify
from tpify.layout import build_layout
from tpify.recipe import RecipeError, load_recipe


def _llava(vision: str = "clip_vision_model", text: str = "llama", **vision_extra):
    """A tiny LLaVA on the meta device (nothing allocated)."""
    config = LlavaConfig(
        text_config=dict(model_type=text, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
        vision_config=dict(model_type=vision, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, image_size=16, patch_size=4, **vision_extra),
        image_token_id=100)
    with torch.device("meta"):
        return LlavaForConditionalGeneration(config)


def test_a_composed_recipe_whose_sub_config_lacks_an_attribute_raises_recipe_error():
    """Quick smoke check of composition: llava's layout at tp 4 reads every count from the part's
    sub-config (dotted paths), and an included recipe written for another family (gpt2's, which
    reads n_head) on the LLaMA text_config is a RecipeError naming the attribute and the part."""
    model = _llava()
    layout = build_layout(model, load_recipe("llava"), 4)
    assert set(layout.recipe.divisible) == {"text_config.num_attention_heads", "vision_config.num_attention_heads"}
    # text_config's 2 KV heads at tp 4: each held by 2 ranks, read from the sub-config
    assert layout.modules["model.language_model.layers.0.self_attn.k_proj"].replica_shards == 2
    assert layout.kv_divides == {"model.language_model.layers.0.self_attn": (("num_key_value_groups", 2),)}
    assert layout.modules["model.vision_tower.encoder.layers.0.mlp.fc1"].style == "colwise"
    assert layout.modules["model.multi_modal_projector.linear_2"].style == "rowwise"
    assert layout.lm_head == "lm_head" and layout.loss_kind == "causal"

    wrong = {"model_type": "llava", "include": [{"prefix": "language_model", "config": "text_config", "recipe": "gpt2"},
                                                {"prefix": "vision_tower", "config": "vision_config"}],
             "rule": [{"match": "multi_modal_projector", "style": "replicate"}]}
    with pytest.raises(RecipeError, match=r"\[\[include\]\] #0 \(prefix = 'language_model', config = 'text_config'\).*"
                                          r"LlamaConfig \(model_type 'llama'\) does not have: \['n_head \(divisible\)'"):
        build_layout(model, load_recipe(wrong), 2)


@pytest.mark.slow
def test_parts_without_a_recipe_or_sub_config_are_refused_by_name():
    """At parallelize (tp 1, no process group needed for planning): a LLaVA whose vision tower
    has no tpify recipe (Pixtral) is refused naming the part, its model_type and the fix; an
    include naming a sub-config or a sub-module the model lacks is refused naming both; two
    [sequence_parallel] tables in one composition are refused."""
    with pytest.raises(RecipeError, match=r"the part PixtralVisionModel \(vision_config.model_type = 'pixtral'\) "
                                          r"cannot be planned: no tpify recipe for model_type 'pixtral'"):
        tpify.parallelize(_llava("pixtral", head_dim=8), tp_size=1)
    model = _llava()
    base = {"model_type": "llava", "rule": [{"match": "**", "style": "replicate"}]}
    with pytest.raises(RecipeError, match=r"LlavaConfig holds no sub-config at 'audio_config'"):
        build_layout(model, load_recipe({**base, "include": [{"prefix": "language_model", "config": "audio_config"}]}),
                     1)
    with pytest.raises(RecipeError, match=r"has no module 'audio_tower'.*'vision_tower'"):
        build_layout(model, load_recipe({**base, "include": [{"prefix": "audio_tower", "config": "text_config"}]}), 1)
    twice = {"model_type": "llava", "sequence_parallel": {"split": "a", "gather": ["b"], "exit": "c"},
             "include": [{"prefix": "language_model", "config": "text_config"}]}
    with pytest.raises(RecipeError, match=r"one stretch of split tokens per model"):
        build_layout(model, load_recipe(twice), 1)


@pytest.mark.slow
def test_sequence_parallelism_is_scoped_to_the_language_model():
    """The included [sequence_parallel] table is prefixed and scoped to the language model: the
    tower's and the projector's column/row-parallel layers (outside every gathered module, before
    the split) are accepted and built without sequence parallelism; the bare LlavaModel plans the
    same rules by names relative to it; a SigLIP tower's pooling head stays replicated."""
    for model in (_llava(), _llava("siglip_vision_model")):
        layout = build_layout(model, load_recipe("llava"), 2, sequence_parallel=True)
        assert layout.sequence_parallel == {"split": "model.language_model.layers.0", "exit": "model.language_model.norm",
                                            "gather": ["model.language_model.layers.0.self_attn",
                                                       "model.language_model.layers.0.mlp"],
                                            "moe_blocks": {}}
        assert not layout.modules["model.vision_tower.encoder.layers.0.self_attn.out_proj"].sequence_parallel
        assert not layout.modules["model.multi_modal_projector.linear_1"].sequence_parallel
        assert layout.modules["model.language_model.layers.0.mlp.down_proj"].sequence_parallel
    assert layout.modules["model.vision_tower.head.mlp.fc1"].style == "replicate"
    with torch.device("meta"):
        bare = LlavaModel(_llava().config)
    layout = build_layout(bare, load_recipe("llava"), 2)
    assert layout.lm_head is None and "language_model.embed_tokens" in layout.modules


@pytest.mark.slow
def test_a_legacy_layout_llava_checkpoint_loads_through_transformers_renamings(tmp_path):
    """LLaVA checkpoints on the Hub keep the pre-5 layout (``language_model.model.*``,
    ``language_model.lm_head``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*`` at the
    top), which transformers renames on load (its checkpoint conversion mapping): tpify's
    from_pretrained finds every tensor through the same renamings, bitwise the weights
    transformers loads (tp 1; the per-rank slicing of the matched keys is every family's)."""
    import re

    from safetensors.torch import load_file, save_file

    config = _llava().config
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    legacy = {}
    for key, value in load_file(tmp_path / "model.safetensors").items():
        for old, new in ((r"^model\.language_model\.", "language_model.model."), (r"^lm_head", "language_model.lm_head"),
                         (r"^model\.vision_tower\.", "vision_tower.vision_model."), (r"^model\.", "")):
            key = re.sub(old, new, key)
        legacy[key] = value
    assert "language_model.model.layers.0.mlp.up_proj.weight" in legacy
    save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})
    want = LlavaForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    got = tpify.from_pretrained(tmp_path, tp_size=1).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
