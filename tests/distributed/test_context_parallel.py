"""Context parallelism (``tpify.init_mesh(tp, cp_size=cp)``), float64 against the dense model.

Each rank holds ``T/cp`` tokens of every sequence (a front and a back chunk), split by
``tpify.context_parallel.split_batch``; attention gathers K/V over the CP group; the loss counts
its targets over the group; the gradients are summed over it. Against a single-process dense
model in float64 (tolerance ``atol=1e-10, rtol=1e-9``: the same sums in another order, ~1e-16):
the logits gathered over the CP group (``gather_sequence``), the ``labels=`` loss and every
gradient.

Quick job (4 gloo ranks): Llama (grouped-query) and Qwen2 (grouped-query, q/k/v biases, a
sliding-window layer after a full one) at cp 2 (dp 2 x cp 2, each replica the same batch) and
cp 2 x tp 2; the collectives of a cp 2 step, counted; what is refused on every rank (labels not
shifted before the split, an attention mask, no position ids, generate, positions counted per rank,
a length that 2 x cp does not divide, cp_size not dividing the world, an unverified model type,
a TPAccelerator ParallelismConfig whose cp_size is not the model's). FSDP2 over dp_shard x cp and the
tools (TPAccelerator, TPTrainer, the TRL refusals): test_context_parallel_tools.py.

Slow job (4 gloo ranks): Llama, Qwen2, Mistral (sliding window) and GPT-2 (learned positions,
Conv1D, tied head) at cp 2, cp 4, cp 2 x tp 2 and cp 2 x tp 2 with sequence parallelism; packed
sequences (position ids that restart, no attention across documents), ``num_items_in_batch``,
a sequence padded by ``split_batch``, gradient checkpointing, the chunked LM loss; DDP over
dp 2 x cp 2 with a different sequence per replica (the gradients of the dense model's loss over
both sequences); 3 AdamW steps of 2 accumulated micro-batches, clipped by
``tpify.training.clip_grad_norm_`` (the norms and the final weights equal dense); LoRA on every
parallel linear layer against dense PEFT (cp 2 x tp 2).
"""

import copy

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import tputil
from tpify.authoring.reference import perturb_constants

TOL = dict(atol=1e-10, rtol=1e-9)
B, T, H, L, V = 2, 16, 32, 2, 101


def _model(name: str):
    common = dict(num_hidden_layers=L, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, vocab_size=V, max_position_embeddings=64)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if name == "qwen2":  # layer 0 full attention, layer 1 a window of 5
        return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1))
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=5))
    return GPT2LMHeadModel(GPT2Config(n_layer=L, n_embd=H, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _reference(name: str):
    torch.manual_seed(0)
    ref = tputil.to_device(_model(name).double())
    perturb_constants(ref)  # zero biases, unit norms: seeded noise, so a bias counted twice shows
    ref.loss_function = tputil.float64_loss_function(causal=True)
    return ref


def _ids(seed: int = 1, tokens: int = T):
    return tputil.to_device(torch.randint(3, V, (B, tokens), generator=torch.Generator().manual_seed(seed)))


def _compare(par, ref, what: str, ids, worst: dict, position_ids=None, num_items=None, pad_token_id=None):
    """Logits (gathered), loss and every gradient of ``par`` on its part of ``ids`` equal ``ref``'s on the whole."""
    from tpify.authoring.compare import dense_named
    from tpify.context_parallel import gather_sequence, split_batch

    batch = {"input_ids": ids, "labels": ids}
    extra = {"use_cache": False}  # with a cache transformers does not look for packed documents
    if position_ids is not None:
        batch["position_ids"] = extra["position_ids"] = position_ids
    if num_items is not None:
        batch["num_items_in_batch"] = extra["num_items_in_batch"] = num_items
    mine = split_batch(batch, par, pad_token_id=pad_token_id)
    if pad_token_id is None:
        with torch.no_grad():
            logits = gather_sequence(par(input_ids=mine["input_ids"], position_ids=mine["position_ids"]).logits, par)
            torch.testing.assert_close(logits, ref(ids, position_ids=position_ids, use_cache=False).logits, **TOL,
                                       msg=lambda m: f"{what}: logits: {m}")
    out_ref = ref(ids, labels=ids, **extra)
    out_ref.loss.backward()
    out = par(**mine)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, **TOL, msg=lambda m: f"{what}: loss: {m}")
    want, got = dense_named(ref, "grad"), dense_named(par, "grad")
    assert set(got) == set(want), set(got) ^ set(want)
    err = 0.0
    for fqn, g in want.items():
        torch.testing.assert_close(got[fqn], g, **TOL, msg=lambda m: f"{what}: grad {fqn}: {m}")
        err = max(err, float((got[fqn] - g).abs().max()))
    worst[what] = max(err, float((out.loss - out_ref.loss).detach().abs()))
    par.zero_grad()
    ref.zero_grad()


def _packed_positions():
    """Row 0: documents of 5, 7 and 4 tokens packed (positions restart at 0); row 1: one document."""
    row0 = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
    return tputil.to_device(torch.stack([row0, torch.arange(T)]))


def _quick(rank, world):
    import tpify
    from tpify import comm
    from tpify.context_parallel import split_batch
    from tpify.info import TPUsageError

    worst = {}
    for tp, cp in ((1, 2), (2, 2)):
        mesh = tpify.init_mesh(tp, cp_size=cp)
        for name in ("llama", "qwen2"):
            ref = _reference(name)
            par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
            assert par.tp_info.cp_size == cp and par.tp_info.tp_size == tp
            _compare(par, ref, f"{name} cp {cp} x tp {tp}", _ids(), worst)
    # the collectives of one step at cp 2 (tp 1): forward, the position ids and per layer [K | V] all-gathered,
    # the loss's one all-reduce of 2 values; backward, per layer [K | V] all-gathered again (the attention is
    # recomputed: only this rank's q, k, v are kept) and one reduce-scatter of [dK | dV], one all-reduce of every
    # gradient (one bucket)
    mesh = tpify.init_mesh(1, cp_size=2)
    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
    mine = split_batch({"input_ids": _ids(), "labels": _ids()}, par)
    with comm.count_collectives() as fwd:
        loss = par(**mine).loss
    with comm.count_collectives() as bwd:
        loss.backward()
    kv = B * 2 * (T // 2) * 2 * (H // 4)  # B * n_kv * T/cp * (d + d_v) per layer
    assert dict(fwd) == {"all_gather": L + 1, "all_gather_numel": L * kv + T // 2, "all_reduce": 1,
                         "all_reduce_numel": 2}, dict(fwd)
    params = sum(p.numel() for p in par.parameters())
    assert dict(bwd) == {"all_gather": L, "all_gather_numel": L * kv, "reduce_scatter": L,
                         "reduce_scatter_numel": 2 * L * kv, "all_reduce": 1, "all_reduce_numel": params}, dict(bwd)
    # what is refused, on every rank alike
    ids = _ids()
    mine = split_batch({"input_ids": ids, "labels": ids}, par)
    local = mine["input_ids"]
    with pytest.raises(TPUsageError, match="without shift_labels"):
        par(input_ids=local, position_ids=mine["position_ids"], labels=mine["labels"])
    with pytest.raises(TPUsageError, match="attention_mask"):
        par(input_ids=local, position_ids=mine["position_ids"], attention_mask=torch.ones_like(local))
    with pytest.raises(TPUsageError, match="no position_ids"):
        par(input_ids=local)
    with pytest.raises(TPUsageError, match="generate under context parallelism"):
        par.generate(local, max_new_tokens=2)
    with pytest.raises(ValueError, match="2 x cp_size = 4 equal chunks"):
        split_batch({"input_ids": ids[:, :14]}, par)
    with torch.no_grad():  # positions counted from 0 on each rank: raised at the next call (no host sync)
        par(input_ids=local, position_ids=torch.arange(T // 2, device=local.device)[None])
    with pytest.raises(ValueError, match="restart at a value other than 0"):
        par(input_ids=local, position_ids=mine["position_ids"])
    with pytest.raises(ValueError, match=r"dp_replicate 1 x cp_size 3 x tp_size 1 = 3 does not divide the world size"):
        tpify.init_mesh(1, cp_size=3)
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=48, vocab_size=V))
    with pytest.raises(TPUsageError, match="model type 'bert' is not verified under context parallelism"):
        tpify.parallelize(bert, mesh=mesh)
    from accelerate import ParallelismConfig

    from tpify.integrations import TPAccelerator

    with pytest.raises(TPUsageError, match="cp_size 4 asked, the model has 2"):  # the tools: test_context_parallel_tools.py
        TPAccelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=4)).prepare(par)
    return worst


def _slow(rank, world):
    import tpify

    worst = {}
    for tp, cp, sp in ((1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)):
        mesh = tpify.init_mesh(tp, cp_size=cp)
        for name in ("llama", "qwen2", "mistral", "gpt2"):
            ref = _reference(name)
            par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, sequence_parallel=sp)
            what = f"{name} cp {cp} x tp {tp}{' sp' if sp else ''}"
            _compare(par, ref, what, _ids(), worst)
            _compare(par, ref, what + " packed", _ids(2), worst, position_ids=_packed_positions())
        _compare(par, ref, f"gpt2 cp {cp} x tp {tp}{' sp' if sp else ''} num_items_in_batch", _ids(3), worst,
                 num_items=23)
        ref, short = _reference("llama"), _ids(4, tokens=T - 3)  # padded to the next multiple of 2 x cp by split_batch
        par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, sequence_parallel=sp)
        _compare(par, ref, f"llama cp {cp} x tp {tp} padded", short, worst, pad_token_id=0)
    mesh = tpify.init_mesh(2, cp_size=2)
    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
    par.gradient_checkpointing_enable()
    par.train()
    ref.train()
    _compare(par, ref, "llama cp 2 x tp 2 gradient checkpointing", _ids(5), worst)
    ref = _reference("mistral")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, lm_loss_chunk=5)
    _compare(par, ref, "mistral cp 2 x tp 2 chunked loss", _ids(6), worst)
    worst.update(_ddp(rank))
    worst.update(_adamw_steps())
    worst.update(_lora())
    return worst


def _lora():
    """LoRA on every parallel linear layer at cp 2 x tp 2, against dense PEFT: the loss and every adapter gradient."""
    import peft

    import tpify
    from tpify.authoring.compare import dense_named
    from tpify.context_parallel import split_batch
    from tpify.integrations import get_peft_model

    config = dict(r=4, lora_alpha=8, init_lora_weights="gaussian",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(2, cp_size=2))
    torch.manual_seed(1)
    lora_ref = peft.get_peft_model(ref, peft.LoraConfig(**config))
    torch.manual_seed(1)
    lora_par = get_peft_model(par, peft.LoraConfig(**config))
    ids = _ids(20)
    loss_ref = lora_ref(ids, labels=ids, use_cache=False).loss
    loss_par = lora_par(**split_batch({"input_ids": ids, "labels": ids}, lora_par)).loss
    torch.testing.assert_close(loss_par, loss_ref, **TOL)
    loss_ref.backward()
    loss_par.backward()
    want = {n: g for n, g in dense_named(lora_ref, "grad").items() if g is not None}
    got = dense_named(lora_par, "grad")
    assert want and all("lora_" in n for n in want), sorted(want)
    for fqn, g in want.items():
        torch.testing.assert_close(got[fqn], g, **TOL, msg=lambda m: f"LoRA cp 2 x tp 2: grad {fqn}: {m}")
    return {"llama LoRA cp 2 x tp 2": max(float((got[f] - g).abs().max()) for f, g in want.items())}


def _adamw_steps():
    """3 AdamW steps of 2 accumulated micro-batches each, clipped at the dense model's norm, cp 2 x tp 2."""
    import tpify
    from tpify.authoring.compare import dense_named
    from tpify.context_parallel import split_batch
    from tpify.training import clip_grad_norm_

    ref = _reference("llama")
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(2, cp_size=2))
    opt_ref, opt_par = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, par))
    norms = []
    for step in range(3):
        for micro in range(2):
            ids = _ids(10 + 2 * step + micro)
            (ref(ids, labels=ids, use_cache=False).loss / 2).backward()
            (par(**split_batch({"input_ids": ids, "labels": ids}, par)).loss / 2).backward()
        norms.append((float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)), float(clip_grad_norm_(par, 1.0))))
        opt_ref.step(), opt_par.step()
        opt_ref.zero_grad(), opt_par.zero_grad()
    for want, got in norms:
        assert abs(want - got) <= 1e-10 * want, norms
    want, got = dense_named(ref), dense_named(par)
    err = 0.0
    for fqn, w in want.items():
        torch.testing.assert_close(got[fqn], w, **TOL, msg=lambda m: f"AdamW steps: weight {fqn}: {m}")
        err = max(err, float((got[fqn] - w).abs().max()))
    return {"llama cp 2 x tp 2, 3 AdamW steps x 2 micro-batches, clipped (weights)": err}


def _ddp(rank):
    """dp 2 x cp 2 under DDP, each replica one sequence: the gradients of the dense mean over both."""
    import tpify
    from tpify.authoring.compare import dense_named
    from tpify.context_parallel import split_batch

    mesh = tpify.init_mesh(1, cp_size=2)  # ranks 0, 1: replica 0; ranks 2, 3: replica 1
    ref = _reference("llama")
    model = tpify.parallelize(copy.deepcopy(ref), mesh=mesh)
    ddp = tpify.replicate_data_parallel(model)
    ids = _ids(7)
    replica = rank // 2
    ref(ids, labels=ids).loss.backward()  # both sequences have T - 1 targets: the dense mean is the replicas' mean
    ddp(**split_batch({"input_ids": ids[replica:replica + 1], "labels": ids[replica:replica + 1]}, model)).loss.backward()
    want, got = dense_named(ref, "grad"), dense_named(model, "grad")
    err = 0.0
    for fqn, g in want.items():
        torch.testing.assert_close(got[fqn], g, **TOL, msg=lambda m: f"DDP dp 2 x cp 2: grad {fqn}: {m}")
        err = max(err, float((got[fqn] - g).abs().max()))
    return {"llama DDP dp 2 x cp 2": err}


def test_context_parallel_matches_dense_quick():
    results = tputil.spawn(_quick, 4, timeout=600)
    print("measured: max |difference from dense| (loss and every gradient):", results[0])


@pytest.mark.slow
def test_context_parallel_matches_dense_every_family_and_layout():
    results = tputil.spawn(_slow, 4, timeout=900)
    print("measured: max |difference from dense| (loss and every gradient):", results[0])
