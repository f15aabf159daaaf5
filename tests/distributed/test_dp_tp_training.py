"""DP x TP training equals single-process training: dp=2 x tp=2 on 4 gloo ranks.

The dense reference trains on the full batch of 4 sequences; each DP replica (a TP group of 2
contiguous ranks) trains on its half, gradients are averaged over the DP group
(``tpify.training.sync_gradients``) and clipped by the global norm
(``tpify.training.clip_grad_norm_``, checked against ``torch.nn.utils.clip_grad_norm_`` on the
dense model). Both halves hold the same number of labelled tokens, so the mean of the two
half-batch means is the full-batch mean. 3 AdamW steps in float64, the dense loss
computed in float64 with HF's semantics (``tputil.ref_lm_loss``; HF's own causal loss runs in
float32). Tolerances: loss ``atol=1e-10, rtol=1e-9`` (summation order only); weights
``atol=1e-8, rtol=1e-6``: Adam's update ``lr * m / (sqrt(v) + eps)`` is sensitive to the relative
noise of gradients near eps (embedding rows of ids absent from the batch get only tiny softmax
gradients), which turns ~1e-16 relative gradient noise into up to a few 1e-9 in the weights
(measured: 3 of 1.6M entries of GPT-2's 50257-row embedding off by up to 1.7e-9). A real
error (gradients not averaged over DP, clipping by a per-rank norm) moves weights by ~1e-3. A real error (gradients not
averaged over DP, clipping by a per-rank norm) moves weights by ~1e-3.
"""

import copy

import pytest
import torch
from transformers import BertForMaskedLM, GPT2LMHeadModel

import tputil
from tpify.authoring.reference import perturb_constants
from test_core_equivalence import bert_config, gpt2_config

pytestmark = pytest.mark.slow  # real models / long end-to-end runs: not in the quick subset

TOL = dict(atol=1e-8, rtol=1e-6)


def _train(cls, config, rank):
    import torch.distributed as dist

    import tpify
    from tpify.training import clip_grad_norm_, sync_gradients

    torch.manual_seed(0)
    ref = cls(config).double()
    perturb_constants(ref)  # zero biases, unit norms: seeded noise
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    info = tpify.get_tp_info(par)
    dp_rank = dist.get_rank(info.dp_group)
    assert info.tp_rank == rank % 2 and dp_rank == rank // 2, "TP groups must be contiguous ranks"
    g = torch.Generator().manual_seed(5)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, config.vocab_size, (4, 10), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100  # same count in every half
        loss_ref = tputil.ref_lm_loss(ref(ids).logits, labels, causal=cls is GPT2LMHeadModel)
        loss_ref.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt_ref.step()
        opt_ref.zero_grad()

        half = slice(2 * dp_rank, 2 * dp_rank + 2)
        loss_par = par(ids[half], labels=labels[half]).loss
        loss_par.backward()
        sync_gradients(par)
        norm_par = clip_grad_norm_(par, 0.5)
        opt_par.step()
        opt_par.zero_grad()

        both = [None, None]
        dist.all_gather_object(both, loss_par.item(), group=info.dp_group)
        torch.testing.assert_close(sum(both) / 2, loss_ref.item(), atol=1e-10, rtol=1e-9)
        assert norm_ref > 0.5, "the test must exercise clipping"
        torch.testing.assert_close(norm_par.double(), norm_ref.double(), atol=1e-6, rtol=1e-6)
    ref_w, par_w = tputil.dense_named(ref), tputil.dense_named(par)
    for name, w in ref_w.items():
        torch.testing.assert_close(par_w[name], w, **TOL, msg=lambda m: f"{cls.__name__} {name}: {m}")


def _body(rank, world):
    _train(GPT2LMHeadModel, gpt2_config(), rank)
    _train(BertForMaskedLM, bert_config(), rank)
    return "ok"


def test_dp2_tp2_training_matches_single_process():
    assert tputil.spawn(_body, 4, timeout=300) == ["ok"] * 4
