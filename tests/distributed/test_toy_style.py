"""A style added as one class plus one line of transformers' style table works end to end at tp = 2.

The toy style of tests/toy_style.py (``rowwise_split_input``: a row-parallel layer that scatters
its whole input itself) is registered and put in ``tpify.hf_plan.HF_STYLES`` for transformers'
``rowwise_split_input``; a small Llama whose plan gathers q/k/v inside the block (HF's
``colwise_gather_output``: imported as ``replicate``) and marks ``o_proj`` ``rowwise_split_input``
is imported, parallelized with that recipe and compared with the dense model: logits, the
``labels=`` loss and every gathered gradient. Its ``o_proj`` is the toy's layer, and it adds
exactly one all-reduce of ``B*T*H`` values per layer to the forward of the same recipe without it
(``o_proj`` whole). ONE spawned job of 2 gloo ranks (the spawn costs seconds).

Tolerance: ``atol=1e-10, rtol=1e-9`` in float64 (tputil.F64): the two computations differ only in
the order of sums (a few ulps); a wrong split (the scatter or the all-reduce missing) is of order 1e-1.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tputil

pytestmark = pytest.mark.slow  # the quick suite is at its time limit; tests/unit/test_style_life_cycle.py has the rest

HF_PLAN = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
           "model.layers.*.self_attn.q_proj": "colwise_gather_output",
           "model.layers.*.self_attn.k_proj": "colwise_gather_output",
           "model.layers.*.self_attn.v_proj": "colwise_gather_output",
           "model.layers.*.self_attn.o_proj": "rowwise_split_input",
           "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
           "model.layers.*.mlp.down_proj": "rowwise"}
LAYERS, B, T, H = 2, 2, 12, 32


def _parallel(ref, world):
    """A copy of ``ref`` parallelized with its imported plan (the toy style's, if registered)."""
    import tpify
    from tpify.hf_plan import import_hf_plan

    model = copy.deepcopy(ref)
    model._tp_plan = dict(HF_PLAN)
    return tpify.parallelize(model, recipe=import_hf_plan(model).recipe(), tp_size=world)


def _forward_collectives(par, ids) -> dict:
    from tpify import comm

    with torch.no_grad(), comm.count_collectives() as counts:
        par(ids)
    return dict(counts)


def _toy_body(rank, world):
    import toy_style
    from tpify.authoring.reference import perturb_constants
    from tpify.layers import RowParallelLinear

    config = LlamaConfig(vocab_size=101, hidden_size=H, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    ref = tputil.to_device(LlamaForCausalLM(config).double())
    perturb_constants(ref)  # unit norms: seeded noise
    ref.loss_function = tputil.float64_loss_function(causal=True)  # HF's own loss upcasts to float32 only
    ids = tputil.to_device(torch.randint(3, 101, (B, T), generator=torch.Generator().manual_seed(1)))
    with toy_style.registered():
        par = _parallel(ref, world)
        layers = [layer.self_attn.o_proj for layer in par.model.layers]
        assert all(isinstance(o, RowParallelLinear) and o.input_is_parallel is False for o in layers), layers
        assert layers[0].weight.shape == (H, H // world)
        with_toy = _forward_collectives(par, ids)
        tputil.assert_lm_matches_dense(par, ref, ids, "toy style rowwise_split_input")
    without = _forward_collectives(_parallel(ref, world), ids)  # o_proj whole: the same recipe without the toy
    return with_toy, without


def test_a_toy_style_added_as_one_class_and_one_table_line_matches_dense_tp2():
    results = tputil.spawn(_toy_body, 2)
    for with_toy, without in results:
        assert with_toy["all_reduce"] - without["all_reduce"] == LAYERS, (with_toy, without)
        assert with_toy["all_reduce_numel"] - without["all_reduce_numel"] == LAYERS * B * T * H, (with_toy, without)
