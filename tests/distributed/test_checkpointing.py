"""Gradient checkpointing with dropout: the gradients of the run without checkpointing.

GPT-2, BERT and Llama with every dropout at 0.1, train mode, tp = 2, float64. The same model
with ``gradient_checkpointing_enable()`` (HF's API; tpify makes it non-reentrant with a
``context_fn`` that restores the dropout streams for the recomputed forward) and without, from
the same ``tpify.manual_seed``: the loss must be bitwise equal and every gradient equal within
``CKPT_TOL`` (float64). Bitwise gradients are not a property of torch itself: HF's dense GPT-2
with dropout 0.1, with and without its own checkpointing, one process, differs by up to 1.1e-16
in float64 on an AMD EPYC with torch 2.13 (the recomputed backward sums in another order). A
wrong dropout mask moves a gradient by about 1e-2, so 1e-13 keeps every tooth. A negative control runs HF's own checkpointing (no tpify
context) and must differ: the recomputed attention-dropout masks come from an advanced TP
stream, which is the silent error this guards against.
"""

import pytest
import copy

import torch
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

import tputil
from test_core_equivalence import bert_config, gpt2_config
from test_llama import llama_config


#: float64: 1e3 times the rounding HF's own checkpointing shows, 1e10 below what one wrong mask gives.
CKPT_TOL = dict(atol=1e-13, rtol=0)


def _configs():
    g = gpt2_config()
    g.resid_pdrop = g.embd_pdrop = g.attn_pdrop = 0.1
    b = bert_config()
    b.hidden_dropout_prob = b.attention_probs_dropout_prob = 0.1
    ll = llama_config(tie=False)
    ll.attention_dropout = 0.1
    return {"gpt2": (GPT2LMHeadModel, g), "bert": (BertForMaskedLM, b), "llama": (LlamaForCausalLM, ll)}


def _step(model, ids):
    import tpify

    tpify.manual_seed(11)
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _body(rank, world):
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    import tpify

    report = {}
    for family, (cls, config) in _configs().items():
        torch.manual_seed(0)
        dense = cls(config).double()
        plain = tpify.parallelize(copy.deepcopy(dense), tp_size=2).train()
        ckpt = tpify.parallelize(dense, tp_size=2).train()
        ckpt.gradient_checkpointing_enable()
        assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
        loss_a, grads_a = _step(plain, ids)
        loss_b, grads_b = _step(ckpt, ids)
        assert torch.equal(loss_a, loss_b), family
        assert grads_a.keys() == grads_b.keys() and grads_a
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], **CKPT_TOL, msg=lambda m: f"{family} {name}: {m}")
        # Negative control: HF's checkpointing without tpify's context.
        for m in ckpt.modules():
            if getattr(m, "gradient_checkpointing", False):
                m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        _, grads_c = _step(ckpt, ids)
        report[family] = max((grads_a[n] - grads_c[n]).abs().max().item() for n in grads_a)
        assert report[family] > 1e-6, f"{family}: the control did not differ; the test has no teeth"
    return report


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_gradient_checkpointing_with_dropout_gives_the_gradients_without_it():
    for report in tputil.spawn(_body, 2, timeout=240):
        print(f"measured: without tpify's context the gradients would differ by up to {report}")


def test_checkpointing_enabled_before_parallelize_is_refused():
    import pytest

    import tpify
    from tpify.integrations import TPUsageError

    model = GPT2LMHeadModel(gpt2_config())
    model.gradient_checkpointing_enable()
    with pytest.raises(TPUsageError, match="enable it after tpify.parallelize"):
        tpify.parallelize(model, tp_size=1)
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D", "nothing changed"
