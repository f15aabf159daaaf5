"""Vocab-parallel cross-entropy and the parallel LM-head loss against single-process references.

Function level (tp = 2 and 4): each rank holds a shard of logits padded to a multiple of tp,
compared with ``F.cross_entropy`` on the full (unpadded) logits, values and gradients, for
ignore_index, label smoothing, the three reductions and an uneven vocabulary.
Tolerances: float64 ``atol=1e-12, rtol=1e-10`` (only the summation order differs, ~1e-16
relative); bf16 logits: the loss is compared at ``1e-5`` (both sides compute in float32 from the
same bf16 values) and the bf16 gradient with torch's bf16 defaults (``rtol=1.6e-2``: one bf16
ulp, since both sides round a float32 value computed in a different order).

Model level (tp = 2, GPT-2's 1001 and Llama's 999 vocabularies are padded; float64, dropout 0): GPT-2, BERT and Llama with ``labels=`` equal a dense
float64 reference loss with HF's semantics (shift for causal LMs, -100 ignored, mean or sum /
num_items_in_batch) and every gradient equals dense at ``atol=1e-10, rtol=1e-9`` (see
test_core_equivalence.py for why). The reference loss is computed in float64 by hand because
HF's own causal loss upcasts to float32 ("logits.float()"), which would cap the comparison at
float32 precision; HF's own dense loss is also checked, at float32 tolerance ``1e-6``.
Training: 3 AdamW steps, each step's loss and the final weights equal dense training.
"""

import pytest
import copy

import torch
import torch.nn.functional as F
import tputil

F64 = dict(atol=1e-12, rtol=1e-10)
MODEL_TOL = dict(atol=1e-10, rtol=1e-9)
HF32 = dict(atol=1e-6, rtol=1e-6)

LLAMA_RECIPE = {
    "model_type": "llama",
    "rule": [
        {"match": "embed_tokens", "style": "embedding_rowwise"},
        {"match": ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj",
                   "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"], "style": "colwise"},
        {"match": ["layers.*.self_attn.o_proj", "layers.*.mlp.down_proj"], "style": "rowwise"},
        {"match": "lm_head", "style": "colwise_rep"},
    ],
}


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=1001, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def bert_config():
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                      vocab_size=998, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=999, max_position_embeddings=64, tie_word_embeddings=False)


def _shard(full, rank, world):
    """This rank's columns of ``full`` padded with zeros to a multiple of ``world``."""
    V = full.shape[-1]
    Vp = -(-V // world) * world
    padded = F.pad(full, (0, Vp - V))
    return padded.chunk(world, dim=-1)[rank].clone()


def _check_function(rank, world, dtype):
    from tpify import vocab_parallel_cross_entropy
    from tpify.comm import count_collectives

    g = torch.Generator().manual_seed(0)
    for V in (37, 40):  # uneven (padded) and even vocabularies
        full = torch.randn(2, 6, V, generator=g, dtype=torch.float64) * 3
        full = tputil.to_device(full.to(dtype).to(torch.float64))  # values exactly representable in dtype
        target = torch.randint(0, V, (2, 6), generator=g)
        target[1, ::2] = -100
        target = tputil.to_device(target)
        for reduction in ("none", "sum", "mean"):
            for eps in (0.0, 0.2):
                ref_in = full.clone().requires_grad_()
                ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), label_smoothing=eps,
                                      reduction=reduction)
                ref = ref.reshape(2, 6) if reduction == "none" else ref
                w = tputil.to_device(torch.rand(ref.shape, generator=g, dtype=torch.float64))
                (ref * w).sum().backward()
                local = _shard(full, rank, world).to(dtype).requires_grad_()
                with count_collectives() as counts:
                    out = vocab_parallel_cross_entropy(local, target, label_smoothing=eps, reduction=reduction,
                                                       vocab_size=V)
                # 2 all-reduces: the row maxima (+ 3 target checks + 2 shard-width checks), then z_t and S (+ sum z with eps)
                n = target.numel()
                assert counts["all_reduce"] == 2, dict(counts)
                assert counts["all_reduce_numel"] == (n + 5) + (3 if eps > 0 else 2) * n, dict(counts)
                (out * w.to(out.dtype)).sum().backward()
                ref_grad = _shard(ref_in.grad, rank, world)
                assert local.grad.dtype == dtype
                case = f"V={V} {reduction} eps={eps} {dtype}"
                if dtype == torch.float64:
                    torch.testing.assert_close(out, ref, **F64, msg=lambda m: f"{case}: {m}")
                    torch.testing.assert_close(local.grad, ref_grad, **F64, msg=lambda m: f"{case}: {m}")
                else:
                    assert out.dtype == torch.float32
                    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {m}")
                    torch.testing.assert_close(local.grad, ref_grad.to(dtype), msg=lambda m: f"{case}: {m}")


def _data(config, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 5] = -100
    return tputil.to_device(ids), tputil.to_device(labels)


def _check_model(cls, config, world, causal, recipe=None, n_layers=2):
    import tpify

    torch.manual_seed(0)
    ref = tputil.to_device(cls(config).double())  # TPIFY_TEST_DEVICE=cuda: on the rank's GPU
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=world, recipe=recipe)
    ids, labels = _data(config, 1)
    num_items = tputil.to_device(torch.tensor(7)) if causal else None
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    hf = ref(ids, labels=labels, **kw).loss  # HF's own (float32 for causal LMs) dense loss
    ref_out = ref(ids)
    loss_ref = tputil.ref_lm_loss(ref_out.logits, labels, causal, num_items)
    with tpify.comm.count_collectives() as counts:
        out = par(ids, labels=labels, **kw)
        out.loss.backward()
    assert counts["all_gather"] == 0, f"{cls.__name__}: logits were gathered: {counts}"
    if causal and cls.__name__ == "GPT2LMHeadModel":
        # docs/mechanics.md budget: 4 per layer + embedding + tied head's copy + 2 for the loss, and the
        # check that every rank of the TP group got the same inputs (4 values, tpify.engine.BatchCheck).
        assert counts["all_reduce"] == 4 * n_layers + 5, counts
    torch.testing.assert_close(out.loss, loss_ref, **MODEL_TOL)
    torch.testing.assert_close(out.loss.float(), hf.float(), **HF32)
    vp = -(-config.vocab_size // world) * world
    assert out.logits.shape == (2, 12, vp // world), "with labels .logits is this rank's vocab shard"
    torch.testing.assert_close(out.logits, _shard(ref_out.logits, world and par.tp_info.tp_rank, world), **MODEL_TOL)
    loss_ref.backward()
    ref_grads, par_grads = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
    for name, grad in ref_grads.items():
        assert par_grads[name] is not None, f"{name} got no gradient"
        torch.testing.assert_close(par_grads[name], grad, **MODEL_TOL, msg=lambda m: f"grad of {name}: {m}")
    # Without labels the logits are gathered again (inference/generate unchanged).
    assert par(ids).logits.shape[-1] == config.vocab_size


def _check_training(cls, config, world, causal):
    import tpify

    torch.manual_seed(0)
    ref = tputil.to_device(cls(config).double())
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=world)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (ref, par)]
    for step in range(3):
        ids, labels = _data(config, 10 + step)
        for o in opts:
            o.zero_grad()
        loss_ref = tputil.ref_lm_loss(ref(ids).logits, labels, causal)
        loss_par = par(ids, labels=labels).loss
        torch.testing.assert_close(loss_par, loss_ref, **MODEL_TOL, msg=lambda m: f"{cls.__name__} step {step}: {m}")
        loss_ref.backward()
        loss_par.backward()
        for o in opts:
            o.step()
    ref_w, par_w = tputil.dense_named(ref), tputil.dense_named(par)
    for name, w in ref_w.items():
        # AdamW divides by sqrt(v): relative errors of 1e-12 in the gradients stay ~1e-10 in the weights.
        torch.testing.assert_close(par_w[name], w, atol=1e-9, rtol=1e-8, msg=lambda m: f"{name} after AdamW: {m}")


def _body_tp2(rank, world):
    # transformers is imported here, not at module level, so the tp=4 ranks (function checks
    # only) start without it.
    from transformers import BertForMaskedLM, GPT2DoubleHeadsModel, GPT2LMHeadModel, LlamaForCausalLM

    import tpify

    _check_function(rank, world, torch.float64)
    _check_function(rank, world, torch.bfloat16)
    _check_model(GPT2LMHeadModel, gpt2_config(), world, causal=True)
    _check_model(BertForMaskedLM, bert_config(), world, causal=False)
    _check_model(LlamaForCausalLM, llama_config(), world, causal=True, recipe=LLAMA_RECIPE)
    _check_training(GPT2LMHeadModel, gpt2_config(), world, causal=True)
    _check_training(BertForMaskedLM, bert_config(), world, causal=False)
    # A head class whose loss is not a plain LM loss keeps HF's own loss on the gathered logits:
    # equal to the dense model's (both compute it with HF's code on the same logits).
    torch.manual_seed(0)
    dh_ref = tputil.to_device(GPT2DoubleHeadsModel(gpt2_config()).double())
    dh = tpify.parallelize(copy.deepcopy(dh_ref))
    ids, labels = _data(gpt2_config(), 3)
    out, ref = dh(ids.unsqueeze(1), labels=labels.unsqueeze(1)), dh_ref(ids.unsqueeze(1), labels=labels.unsqueeze(1))
    torch.testing.assert_close(out.loss, ref.loss, **HF32)
    assert out.logits.shape[-1] == gpt2_config().vocab_size
    return "ok"


def _body_tp4(rank, world):
    _check_function(rank, world, torch.float64)
    _check_function(rank, world, torch.bfloat16)
    return "ok"


def test_loss_tp2():
    assert tputil.spawn(_body_tp2, 2) == ["ok"] * 2


@pytest.mark.slow
def test_loss_tp4():
    assert tputil.spawn(_body_tp4, 4) == ["ok"] * 4
