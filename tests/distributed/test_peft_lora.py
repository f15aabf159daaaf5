"""PEFT LoRA on tensor-parallel layers equals PEFT LoRA on the dense model (tp = 2, float64).

For GPT-2 (Conv1D layers, packed ``c_attn``), BERT (with a replicated ``nn.Linear`` adapted by
PEFT's own layer) and Llama (grouped-query attention, gate/up/down): the dense PEFT model and
``tpify.integrations.get_peft_model`` on the parallelized copy, from the same random state,
train 2 AdamW steps on the same batches. Compared:
* losses: atol 1e-10, rtol 1e-9 (float64 summation order);
* every trainable gradient, gathered: atol 1e-10, rtol 1e-9; only adapters train, the same
  parameters on both sides, and the base weights get no gradient;
* the adapters after the steps: atol 1e-8, rtol 1e-6 (Adam amplifies ~1e-16 gradient noise near
  eps, see test_dp_tp_training.py);
* collectives of one training step: the all-reduces of the model without adapters (4L + 4 for
  GPT-2, the analytic minimum, unchanged with adapters) and at most one more per adapted
  column-parallel layer (it all-reduces its dX with its adapter's dh instead of sharing the one
  all-reduce of the layers reading the same activation: BERT's query/key/value), at most
  ``B*T*r`` more values per adapted layer, and no all-gather;
* ``peft_model.save_pretrained`` (collective) writes a standard adapter that plain
  ``peft.PeftModel.from_pretrained`` loads on the dense base, giving the dense PEFT model's
  logits; ``merge_and_unload`` + ``tpify.save_pretrained`` gives a directory plain transformers
  loads, with the dense merged model's logits (atol 1e-10).
"""

import copy
import tempfile

import torch
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

import tputil
from tpify.authoring.reference import perturb_constants
from test_core_equivalence import bert_config, gpt2_config
from test_llama import llama_config

TOL = dict(atol=1e-8, rtol=1e-6)
EXACT = dict(atol=1e-10, rtol=1e-9)

FAMILIES = {
    "gpt2": (GPT2LMHeadModel, gpt2_config, ["c_attn", "c_proj", "c_fc"], True),
    "bert": (BertForMaskedLM, bert_config, ["query", "key", "value", "dense"], False),
    "llama": (LlamaForCausalLM, lambda: llama_config(tie=False),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def _lora(targets):
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")


def _gathered(model, attr=None):
    from tpify.sharding import shard_spec_of

    group = model.tp_info.tp_group
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        value = p if attr is None else getattr(p, attr)
        spec = shard_spec_of(p)
        out[name] = (spec.gather(value.detach(), group) if spec is not None else value.detach()).clone()
    return out


def _check_family(family, rank, tmp):
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    cls, config_fn, targets, causal = FAMILIES[family]
    torch.manual_seed(0)
    base = cls(config_fn()).double()
    perturb_constants(base)  # zero biases, unit norms: seeded noise
    vocab = base.config.vocab_size
    dense_base = copy.deepcopy(base)
    par = tpify.parallelize(copy.deepcopy(base), tp_size=2)

    # Collectives of one plain tensor-parallel step, for comparison.
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    with tpify.comm.count_collectives() as plain:
        par(ids, labels=ids).loss.backward()
    par.zero_grad()

    torch.manual_seed(1)
    dense = peft.get_peft_model(copy.deepcopy(dense_base), _lora(targets))
    torch.manual_seed(1)
    lora = get_peft_model(par, _lora(targets))
    assert any(type(m).__name__ == "LoraTPLinear" for m in lora.modules())
    opt_d = torch.optim.AdamW([p for p in dense.parameters() if p.requires_grad], lr=1e-2)
    opt_p = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for step in range(2):
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        loss_d = tputil.ref_lm_loss(dense(ids).logits, ids, causal=causal)
        loss_d.backward()
        with tpify.comm.count_collectives() as counted:
            loss_p = lora(ids, labels=ids).loss
            loss_p.backward()
        torch.testing.assert_close(loss_p, loss_d, **EXACT, msg=f"{family} loss, step {step}")
        grads_d = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
        grads_p = _gathered(lora, "grad")
        assert set(grads_d) == set(grads_p) and grads_d, set(grads_d) ^ set(grads_p)
        assert all("lora_" in n for n in grads_p), "only adapters train"
        assert all(p.grad is None for n, p in lora.named_parameters() if "lora_" not in n)
        for n, gr in grads_d.items():
            torch.testing.assert_close(grads_p[n], gr, **EXACT, msg=lambda m: f"{family} grad {n}: {m}")
        n_adapted = sum(type(m).__name__ == "LoraTPLinear" for m in lora.modules())
        n_column = sum(type(m).__name__ == "LoraTPLinear" and not m.is_row for m in lora.modules())
        # an adapted column-parallel layer all-reduces its dX with its adapter's dh, so it leaves the
        # one all-reduce that the layers reading the same activation share without adapters
        assert plain["all_reduce"] <= counted["all_reduce"] <= plain["all_reduce"] + n_column, \
            (dict(counted), dict(plain), n_column)
        assert counted["all_gather"] == plain["all_gather"] == 0
        if family == "gpt2":  # one column-parallel layer per activation: no collective added
            assert dict(counted) == dict(plain) | {"all_reduce_numel": counted["all_reduce_numel"]}
            assert counted["all_reduce_numel"] <= plain["all_reduce_numel"] + n_adapted * ids.numel() * 4
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    final = _gathered(lora)
    for n, w in {n: p for n, p in dense.named_parameters() if p.requires_grad}.items():
        torch.testing.assert_close(final[n], w.detach(), **TOL, msg=lambda m: f"{family} {n}: {m}")
    if rank == 0:
        w_abs = max((final[n] - p.detach()).abs().max().item() for n, p in dense.named_parameters() if p.requires_grad)
        print(f"measured LoRA {family} tp=2: adapters after 2 AdamW steps max abs {w_abs:.1e}; collectives per step "
              f"{counted['all_reduce']} all-reduces ({counted['all_reduce_numel']} values; without adapters "
              f"{plain['all_reduce']}, {plain['all_reduce_numel']})", flush=True)

    # The adapter directory is standard: plain peft loads it on the dense base.
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    with torch.no_grad():
        want = dense(ids).logits
    lora.save_pretrained(f"{tmp}/{family}-adapter")  # collective: every rank calls it
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(dense_base), f"{tmp}/{family}-adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, want, **EXACT)
    # Merged, saved with tpify, loaded by plain transformers.
    merged = lora.merge_and_unload()
    assert merged is par
    tpify.save_pretrained(merged, f"{tmp}/{family}-merged")
    plain_model = cls.from_pretrained(f"{tmp}/{family}-merged", dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(plain_model(ids).logits, dense.merge_and_unload()(ids).logits, **EXACT)
        torch.testing.assert_close(merged(ids).logits, want, **EXACT)


def _body(rank, world):
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)  # one directory for both ranks
        for family in FAMILIES:
            _check_family(family, rank, tmp[0])
        dist.barrier()
    return "ok"


def test_lora_on_tensor_parallel_layers_matches_dense_peft():
    assert tputil.spawn(_body, 2, timeout=300) == ["ok"] * 2


def test_parallelizing_a_peft_model_says_to_parallelize_first():
    import peft
    import pytest

    import tpify

    model = peft.get_peft_model(GPT2LMHeadModel(gpt2_config()), _lora(["c_attn"]))
    with pytest.raises(tpify.PlanError, match="Parallelize the base model first"):
        tpify.parallelize(model, tp_size=1)
