"""Sequence parallelism (Korthikanti et al., arXiv:2205.05198), float64 against the dense model.

``parallelize(model, sequence_parallel=True)`` on Llama (grouped-query, untied head) and GPT-2
(Conv1D, tied head), at tp = 2 (at tp = 4 their outputs, loss and every gradient with
sequence parallelism are in tpify verify's tp = 4 job, tests/distributed/test_verify.py):

* logits with a padding mask, the ``labels=`` loss, every gathered gradient (the LayerNorm
  weights and row-parallel biases, which see ``T/p`` tokens per rank, included) equal dense;
  tolerance ``atol=1e-10, rtol=1e-9`` (float64, only the order of sums differs);
* the collectives of one step, counted: per layer two all-gathers (attention and MLP inputs) and
  two reduce-scatters (their row-parallel outputs) forward, the reverse backward, each moving
  ``B*T*H/p`` values per rank (the all-reduce they replace moves twice that: the same bytes in
  all), plus one all-gather at the final norm forward and one at the split backward, and in
  backward the attention's and the MLP's input tokens all-gathered again for their column
  layers' weight gradients (they save ``(B, T/p, H)``, as Megatron's layers do); the only
  all-reduces left are the embedding's, the loss's 2, the LM head's input gradient and one of
  every LayerNorm weight and row-parallel bias gradient together (small: ``H`` values each);
* the column layers save this rank's ``(B, T/p, H)`` tokens, not the gathered input: a decoder
  layer saves ``2 x (B*T*H - B*T/p*H)`` values fewer;
* the LayerNorms inside the split stretch see ``(B, T/p, H)``: activation memory ``1/p``; they
  and the column-parallel layers after each all-gather (``(B, T, H)``) get contiguous inputs,
  and those layers share the gather's reduce-scatter (the overlapped matmul in each);
* greedy ``generate`` (one token at a time: runs without sequence parallelism) equals dense;
  a training forward whose ``T`` is not divisible by ``tp_size`` raises on every rank; a recipe
  without ``[sequence_parallel]`` is a PlanError;
* with LoRA on every parallel linear layer (against dense PEFT) and with gradient checkpointing:
  loss and every gradient equal dense; with dropout, checkpointing is bitwise the run without it.
"""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tputil
from tpify.authoring.reference import perturb_constants

TOL = dict(atol=1e-10, rtol=1e-9)
B, T, H, L = 2, 8, 32, 2


def _models(world):
    yield "llama", LlamaForCausalLM(LlamaConfig(num_hidden_layers=L, hidden_size=H, num_attention_heads=4,
                                                num_key_value_heads=world, intermediate_size=48, vocab_size=101,
                                                max_position_embeddings=64, pad_token_id=0))
    yield "gpt2", GPT2LMHeadModel(GPT2Config(n_layer=L, n_embd=H, n_head=4, vocab_size=101, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _body(rank, world):
    import tpify
    from tpify import comm
    from tpify.authoring.compare import dense_named

    out = {}
    torch.manual_seed(0)
    for name, model in _models(world):
        ref = tputil.to_device(model.double())  # TPIFY_TEST_DEVICE=cuda: on the rank's GPU
        perturb_constants(ref)  # zero biases, unit norms: seeded noise, so a bias added per rank shows
        ref.loss_function = tputil.float64_loss_function(causal=True)
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=world, sequence_parallel=True)
        ids = tputil.to_device(torch.randint(3, 101, (B, T), generator=torch.Generator().manual_seed(1)))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        torch.testing.assert_close(par(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, **TOL)
        seen = []
        norms = [m for m in par.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]
        hooks = [m.register_forward_pre_hook(lambda m, a: seen.append((tuple(a[0].shape), a[0].is_contiguous())))
                 for m in norms]
        columns = [m for m in par.modules() if type(m).__name__ == "ColumnParallelLinear"
                   and m.sequence_parallel is not None]  # those in the gathered modules
        gathered = []
        hooks += [m.register_forward_pre_hook(lambda m, a: gathered.append((tuple(a[0].shape), a[0].is_contiguous())))
                  for m in columns]
        backward_of = []  # the shared entry's overlapped matmul, not a plain one, in every gathered column layer
        hooks += [m.register_forward_hook(lambda m, a, out: backward_of.append(type(out.grad_fn).__name__))
                  for m in columns]
        loss_ref = ref(ids, attention_mask=mask, labels=ids).loss
        with comm.count_collectives() as fwd:
            loss_par = par(ids, attention_mask=mask, labels=ids).loss
        for h in hooks:
            h.remove()
        torch.testing.assert_close(loss_par, loss_ref, **TOL)
        loss_ref.backward()
        with comm.count_collectives() as bwd:
            loss_par.backward()
        ref_grads, par_grads = dense_named(ref, "grad"), dense_named(par, "grad")
        worst = 0.0
        for fqn, grad in ref_grads.items():
            torch.testing.assert_close(par_grads[fqn], grad, **TOL, msg=lambda m: f"{name} {fqn}: {m}")
            worst = max(worst, float((par_grads[fqn] - grad).abs().max()))
        # 2 per layer + the final one; contiguous, as every collective's result is in HF's (B, T, H) order
        assert seen == [((B, T // world, H), True)] * len(norms), (name, seen)
        assert columns and gathered == [((B, T, H), True)] * len(columns), (name, gathered)
        assert backward_of == ["_ColumnParallelMatmulBackward"] * len(columns), (name, backward_of)
        shard = B * T * H // world
        assert fwd["all_gather"] == 2 * L + 1 and fwd["all_gather_numel"] == (2 * L + 1) * shard, dict(fwd)
        assert fwd["reduce_scatter"] == 2 * L and fwd["reduce_scatter_numel"] == 2 * L * B * T * H, dict(fwd)
        # backward: the reverse of forward's, and the attention's and the MLP's input tokens all-gathered again
        # for their column layers' weight gradients (they saved (B, T/p, H), as Megatron's layers do)
        assert bwd["all_gather"] == 4 * L + 1 and bwd["all_gather_numel"] == (4 * L + 1) * shard, dict(bwd)
        assert bwd["reduce_scatter"] == 2 * L and bwd["reduce_scatter_numel"] == 2 * L * B * T * H, dict(bwd)
        # forward all-reduces: the inputs check (4 values), the embedding's and the loss's 2; backward: the
        # LM head's input gradient (copy), and one for every norm weight/bias and row-parallel bias (partial
        # over T/p tokens) together (tpify.grad_sums; one per parameter before: Megatron sums them in one)
        replicated = sum(p.numel() for m in norms for p in m.parameters()) + sum(
            m.bias.numel() for m in par.modules() if type(m).__name__ == "RowParallelLinear" and m.bias is not None)
        assert fwd["all_reduce"] == 4, dict(fwd)
        assert bwd["all_reduce"] == 2 and bwd["all_reduce_numel"] == B * T * H + replicated, (dict(bwd), replicated)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(par.generate(ids[:1], **kw), ref.generate(ids[:1], **kw)), name
        with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp_size"):
            par(ids[:, :7], labels=ids[:, :7])
        out[name] = worst
    return out


def _run(world):
    results = tputil.spawn(_body, world, timeout=600)
    print(f"measured, tp = {world}: max |gradient - dense| with sequence parallelism:", results[0])


def test_sequence_parallel_matches_dense_tp2():
    _run(2)


def test_a_recipe_without_sequence_parallel_regions_is_refused():
    import tpify
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=48))
    with pytest.raises(tpify.PlanError, match=r"has no \[sequence_parallel\] table"):
        tpify.parallelize(model, tp_size=1, sequence_parallel=True)


def _lora_config(name):
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if name == "llama" else \
        ["c_attn", "c_proj", "c_fc"]
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")


def _with_lora_and_checkpointing_body(rank, world):
    """Sequence parallelism with LoRA, and with gradient checkpointing (each refused before the
    layers took their mode as arguments): loss and every gradient against dense in float64; with
    dropout on, checkpointing gives bitwise the gradients of the same model without it (the
    recomputation restores the dropout streams and whether the tokens were split)."""
    import peft

    import tpify
    from tpify.integrations import get_peft_model
    from tpify.authoring.compare import dense_named

    out = {}
    ids = tputil.to_device(torch.randint(3, 101, (B, T), generator=torch.Generator().manual_seed(1)))
    torch.manual_seed(0)
    for name, model in _models(world):
        ref = tputil.to_device(model.double())
        perturb_constants(ref)
        ref.loss_function = tputil.float64_loss_function(causal=True)
        # LoRA on every parallel linear layer, against dense PEFT
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=world, sequence_parallel=True)
        torch.manual_seed(1)
        lora_ref = peft.get_peft_model(copy.deepcopy(ref), _lora_config(name))
        torch.manual_seed(1)
        lora_par = get_peft_model(par, _lora_config(name))
        loss_ref, loss_par = lora_ref(ids, labels=ids).loss, lora_par(ids, labels=ids).loss
        torch.testing.assert_close(loss_par, loss_ref, **TOL)
        loss_ref.backward()
        loss_par.backward()
        grads_ref, grads_par = dense_named(lora_ref, "grad"), dense_named(lora_par, "grad")
        grads_ref = {n: g for n, g in grads_ref.items() if g is not None}
        assert grads_ref and all("lora_" in n for n in grads_ref), sorted(grads_ref)
        for fqn, grad in grads_ref.items():
            torch.testing.assert_close(grads_par[fqn], grad, **TOL, msg=lambda m: f"{name} LoRA {fqn}: {m}")
        out[f"{name} lora"] = max(float((grads_par[f] - g).abs().max()) for f, g in grads_ref.items())
        # gradient checkpointing, against dense
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=world, sequence_parallel=True)
        par.gradient_checkpointing_enable()
        loss_par = par(ids, labels=ids).loss
        torch.testing.assert_close(loss_par, ref(ids, labels=ids).loss, **TOL)
        ref.zero_grad()
        ref(ids, labels=ids).loss.backward()
        loss_par.backward()
        grads_ref, grads_par = dense_named(ref, "grad"), dense_named(par, "grad")
        for fqn, grad in grads_ref.items():
            torch.testing.assert_close(grads_par[fqn], grad, **TOL, msg=lambda m: f"{name} checkpointed {fqn}: {m}")
        out[f"{name} checkpointing"] = max(float((grads_par[f] - g).abs().max()) for f, g in grads_ref.items())
        # with dropout: checkpointed == not checkpointed, within float64 rounding (test_checkpointing.CKPT_TOL)
        dropped = copy.deepcopy(ref)
        for m in dropped.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.1
        if name == "llama":
            dropped.config.attention_dropout = 0.1
            for m in dropped.modules():
                if hasattr(m, "attention_dropout"):
                    m.attention_dropout = 0.1
        runs = []
        for checkpointing in (False, True):
            run = tpify.parallelize(copy.deepcopy(dropped), tp_size=world, sequence_parallel=True).train()
            if checkpointing:
                run.gradient_checkpointing_enable()
            tpify.manual_seed(7)
            run(ids, labels=ids).loss.backward()
            runs.append(dense_named(run, "grad"))
        for fqn, grad in runs[0].items():
            torch.testing.assert_close(runs[1][fqn], grad, atol=1e-13, rtol=0,
                                       msg=lambda m: f"{name}: checkpointing with dropout changed {fqn}: {m}")
    return out


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_sequence_parallelism_with_lora_and_with_gradient_checkpointing_matches_dense():
    results = tputil.spawn(_with_lora_and_checkpointing_body, 2, timeout=300)
    print("measured, tp = 2: max |gradient - dense| with sequence parallelism and LoRA / checkpointing:", results[0])


def _watch_saved(model, module, found: list) -> list:
    """Hooks that put into ``found`` every tensor autograd saves while ``module`` runs, parameters
    left out; returns their handles."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            found.append(t)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return [module.register_forward_pre_hook(lambda *_: hooks.__enter__()),
            module.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))]


def _saved_activations(model, layer, call):
    """The activations autograd saves while ``layer`` runs inside ``call()`` (parameters left out):
    ``(bytes of their distinct storages, [(shape, storage id)] per tensor saved)``."""
    saved = []
    handles = _watch_saved(model, layer, saved)
    try:
        call()
    finally:
        for h in handles:
            h.remove()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values()), [(tuple(t.shape), t.untyped_storage().data_ptr()) for t in saved]


def _saved_bytes_body(rank, world):
    """One decoder layer's saved activations, Llama and GPT-2 at tp = 2 with sequence parallelism:
    in all, with the column layers' gathered input saved instead, and what each column layer saves."""
    import tpify

    out = {}
    torch.manual_seed(0)
    ids = torch.randint(3, 101, (B, T), generator=torch.Generator().manual_seed(1))
    for name, model in _models(world):
        par = tpify.parallelize(model.double(), tp_size=world, sequence_parallel=True).train()
        layer = par.model.layers[0] if name == "llama" else par.transformer.h[0]
        columns = [m for m in layer.modules() if type(m).__name__ == "ColumnParallelLinear"]
        total, _ = _saved_activations(par, layer, lambda: par(ids, labels=ids).loss)
        records = [[] for _ in columns]  # in a call of their own: saved-tensor hooks do not nest
        handles = [h for m, found in zip(columns, records) for h in _watch_saved(par, m, found)]
        par(ids, labels=ids).loss
        for h in handles:
            h.remove()
        column_saves = [[(tuple(t.shape), t.untyped_storage().data_ptr()) for t in found] for found in records]
        for m in columns:  # the path with no shared region entry saves the gathered input, as every one did before
            m.overlap_grad_reduce = False
        gathered_total, _ = _saved_activations(par, layer, lambda: par(ids, labels=ids).loss)
        out[name] = (total, gathered_total, column_saves, len(columns))
    return out


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_sequence_parallel_column_layers_save_their_tokens_not_the_gathered_input():
    """Under sequence parallelism the column-parallel layers of a gathered module save this rank's
    ``(B, T/p, H)`` tokens for their weight gradients, not the all-gathered ``(B, T, H)`` input
    (Megatron-LM saves the sequence shard and all-gathers it again in backward): every tensor a
    column layer saves besides its weight is of shape ``(B, T/p, H)``, one storage per gathered
    input (q/k/v share one, gate/up another), and one decoder layer saves exactly
    ``2 x (B*T*H - B*T/p*H)`` values fewer than with the gathered input saved (the layers'
    ``overlap_grad_reduce=False`` path, which saves what every column layer saved before):
    ``1/p`` of the gathered input for the two column-layer inputs of a layer."""
    world = 2
    results = tputil.spawn(_saved_bytes_body, world, timeout=300)
    for name, (total, gathered_total, column_saves, n_columns) in results[0].items():
        readers = 5 if name == "llama" else 2  # q, k, v, gate, up; GPT-2's c_attn and c_fc
        assert n_columns == readers, (name, n_columns)
        assert all(len(saves) == 1 and saves[0][0] == (B, T // world, H) for saves in column_saves), \
            (name, column_saves)
        assert len({saves[0][1] for saves in column_saves}) == 2, f"{name}: one storage per gathered input"
        element = torch.finfo(torch.float64).bits // 8
        assert gathered_total - total == 2 * (B * T * H - B * (T // world) * H) * element, \
            (name, total, gathered_total)
        print(f"measured, {name}, tp = {world}, B x T x H = {B} x {T} x {H}, float64: one decoder layer saves "
              f"{total} bytes of activations ({gathered_total} with the gathered input saved)")
