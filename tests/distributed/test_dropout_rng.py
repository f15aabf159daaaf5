"""Dropout under TP: replicated activations bitwise equal on every TP rank, sharded attention
dropout masks distinct per TP rank, and runs reproducible with tpify.manual_seed.

Exactness: bitwise equality (``torch.equal``) across ranks is the claim for the replicated
activations; every rank computes them from the same all-reduced values with the same masks.
"""

import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import tputil


def _gather_ranks(x: torch.Tensor, group) -> list[torch.Tensor]:
    from tpify import comm

    with torch.no_grad():  # on the device the collectives take (NCCL: the GPU, also for CPU generator states)
        both = comm.all_gather_last_dim(tputil.to_device(x.detach()).unsqueeze(-1).contiguous(), group)
    return list(both.unbind(-1))


def _run(model, ids, **kw):
    import tpify

    tpify.manual_seed(123)
    return model(ids, output_hidden_states=True, **kw)


def _dropout_body(rank, world):
    import tpify
    from tpify.random import get_rng_tracker

    ids = tputil.to_device(torch.randint(0, 500, (2, 10), generator=torch.Generator().manual_seed(1)))
    gpt2 = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=500, resid_pdrop=0.1,
                      embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                      attn_implementation="eager")
    bert = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                      vocab_size=500, max_position_embeddings=32, hidden_dropout_prob=0.1,
                      attention_probs_dropout_prob=0.1, attn_implementation="eager")
    report = {}
    for name, cls, config in (("gpt2", GPT2LMHeadModel, gpt2), ("bert", BertModel, bert)):
        torch.manual_seed(0)
        model = tpify.parallelize(tputil.to_device(cls(config).double()), tp_size=world).train()
        group = model.tp_info.tp_group
        out = _run(model, ids, output_attentions=True)
        final = out.logits if name == "gpt2" else out.last_hidden_state
        # Replicated activations: bitwise equal on every TP rank.
        for i, h in enumerate([*out.hidden_states, final]):
            a, b = _gather_ranks(h, group)
            assert torch.equal(a, b), f"{name}: replicated activation {i} differs across TP ranks"
        # Dropout really acted on the replicated stream: eval gives other values.
        model.eval()
        with torch.no_grad():
            assert not torch.equal(model(ids).logits if name == "gpt2" else model(ids).last_hidden_state,
                                   final.detach())
        model.train()
        # Sharded attention dropout: masks (zeros among causal-allowed positions) differ per rank.
        probs = out.attentions[0]  # (B, heads/p, T, T), after dropout
        allowed = torch.ones(10, 10, dtype=torch.bool, device=probs.device)
        if name == "gpt2":
            allowed = torch.tril(allowed)
        mask = ((probs == 0) & allowed).double()
        assert mask.sum() > 0, f"{name}: no attention dropout happened"
        m0, m1 = _gather_ranks(mask, group)
        assert not torch.equal(m0, m1), f"{name}: attention dropout masks equal on both TP ranks"
        # TP stream states differ across ranks; after forward the default stream is active.
        tracker = get_rng_tracker(model)
        assert tracker.current == "default"
        s0, s1 = _gather_ranks(tracker.tp_state().double(), group)
        assert not torch.equal(s0, s1)
        d0, d1 = _gather_ranks(torch.get_rng_state().double(), group)
        assert torch.equal(d0, d1), "default stream must be identical on every TP rank"
        if ids.is_cuda:  # the generator the CUDA masks came from: the same checks
            where = str(ids.device)
            s0, s1 = _gather_ranks(tracker.tp_state(where).double(), group)
            assert not torch.equal(s0, s1), "the CUDA TP stream must differ across TP ranks"
            d0, d1 = _gather_ranks(torch.cuda.get_rng_state(ids.device).double(), group)
            assert torch.equal(d0, d1), "the CUDA default stream must be identical on every TP rank"
        # Reproducible: the same seed gives the same activations and the same loss gradients.
        again = _run(model, ids, output_attentions=True)
        final2 = again.logits if name == "gpt2" else again.last_hidden_state
        assert torch.equal(final2, final) and torch.equal(again.attentions[0], probs)
        report[name] = float(mask.mean())
    return report


def test_dropout_streams_gpt2_bert_tp2():
    """GPT-2 (attn/resid/embd dropout 0.1) and BERT (0.1) in train mode at tp=2."""
    results = tputil.spawn(_dropout_body, 2)
    print("fraction of dropped attention probabilities per rank:", results)


def _two_models_body(rank, world):
    import torch.distributed as dist

    import tpify
    from tpify.random import get_rng_tracker

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    a = tpify.parallelize(tputil.to_device(GPT2LMHeadModel(config)), tp_size=world).train()
    other = dist.new_group(list(range(world)))  # a second group over the same ranks
    b = tpify.parallelize(tputil.to_device(GPT2LMHeadModel(config)), tp_group=other).train()
    ta, tb = get_rng_tracker(a), get_rng_tracker(b)
    assert ta is not tb and a.tp_info.tp_group is not b.tp_info.tp_group
    ids = tputil.to_device(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    a(ids)
    before = ta.tp_state().clone()
    b(ids)
    b(ids)  # b's sharded draws advance b's TP stream only
    assert torch.equal(ta.tp_state(), before), "running model b moved model a's TP stream"
    assert not torch.equal(tb.tp_state(), before)
    # Each model's run is reproducible on its own, whatever the other did in between.
    tpify.manual_seed(5)
    first = a(ids).logits
    tpify.manual_seed(5)
    b(ids)
    tpify.manual_seed(5)
    again = a(ids).logits
    assert torch.equal(first, again)
    return True


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_two_models_in_different_groups_keep_independent_dropout_streams():
    assert all(tputil.spawn(_two_models_body, 2))
