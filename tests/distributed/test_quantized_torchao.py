"""torchao int8 weight-only under tensor parallelism equals transformers' dense torchao model (+ PEFT), tp = 2.

The reference is transformers' own torchao loading (``from_pretrained(..., quantization_config=
TorchAoConfig(Int8WeightOnlyConfig()))``: every ``nn.Linear`` weight but the LM head an
``Int8Tensor``) with PEFT's LoRA on it (PEFT's torchao LoRA layer); the tpify side is
``tpify.from_pretrained`` (Llama, grouped-query attention) or ``tpify.parallelize`` (GPT-2) with the
same config and ``tpify.integrations.get_peft_model``. Float32 weights and compute:

* every quantized layer: this rank's int8 codes equal the dense codes restricted to the shard,
  its scales the dense scales (its rows; whole on a row-parallel layer), and the dequantized shard
  the dense dequantized slice, bit for bit (``torch.equal``); Llama: 7 layers per decoder layer;
  GPT-2: none (transformers' torchao quantizer converts ``nn.Linear`` only, not ``Conv1D``; tpify alike);
* logits: atol 2e-5, rtol 1e-5 (the same int8 weights; the row-parallel product is scaled per
  rank before the all-reduce and summed in another order, ~1e-6 relative on values of order 1);
* 3 AdamW steps of LoRA (r = 4, lr 1e-2) on Llama: loss atol 1e-5; every adapter gradient,
  gathered, atol 1e-5, rtol 1e-4; the adapters after the steps atol 1e-4 (as the 4-bit test:
  float32 order, Adam's division near 0);
* refusals on every rank: merging the adapter, ``tpify.save_pretrained``;
* Llama at tp 4 over 2 KV heads (K/V replicated on pairs of ranks; slow, 4 ranks): the Llama checks.
"""

import tempfile
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tputil

pytest.importorskip("torchao")

LOGITS = dict(atol=2e-5, rtol=1e-5)
LOSS = dict(atol=1e-5, rtol=1e-5)
GRAD = dict(atol=1e-5, rtol=1e-4)
ADAPTER = dict(atol=1e-4, rtol=1e-4)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config():
    return LlamaConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=160, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def gpt2_config():
    return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def ao_config():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def nf4_llama_config():
    """Every linear weight a multiple of 64 x 256 elements (torchao's NF4 needs it of the dense weight);
    o_proj's row shards (256 x 128 at tp 2, 256 x 64 at tp 4) hold 2 or 1 block scalers per row, so
    every dense scaler block of 256 is cut across ranks; at tp 4 K/V (2 heads) are replicated on pairs."""
    return LlamaConfig(num_hidden_layers=1, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=512, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def nf4_config():
    from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(NF4WeightOnlyConfig())


def _check_nf4_bitwise(par, ref, rank):
    """Each NF4 layer's dequantized shard, codes and dequantized block scalers against the dense
    ``NF4Tensor``'s slice, bitwise; the count."""
    from tpify.quantized_torchao import NF4RowParallelLinear, _NF4

    refs, n = dict(ref.named_modules()), 0
    for fqn, m in par.named_modules():
        if not isinstance(m, _NF4):
            continue
        dense = refs[fqn].weight
        assert type(dense).__name__ == "NF4Tensor", (fqn, type(dense))
        spec, is_row = m.weight_shard_spec, isinstance(m, NF4RowParallelLinear)
        pieces = lambda t: torch.cat([t[:, a:b] if is_row else t[a:b] for a, b in spec.ranges(rank)],  # noqa: E731
                                     dim=1 if is_row else 0)
        assert torch.equal(m.weight, pieces(dense.get_original_weight())), fqn
        local = m.nf4_tensor()
        codes = lambda t: torch.stack([t.quantized_data >> 4, t.quantized_data & 15], -1).reshape(t.shape)  # noqa: E731
        assert torch.equal(codes(local), pieces(codes(dense))), fqn
        deq = lambda t: t.dequantize_scalers(t.quantized_scalers, t.quantization_factor,  # noqa: E731
                                             t.scaler_block_size).reshape(t.shape[0], -1)
        assert torch.equal(deq(local), pieces(deq(dense).repeat_interleave(64, 1))[:, ::64]), fqn
        assert torch.equal(local.scaler_mean, dense.scaler_mean), fqn
        n += 1
    return n


def _check_nf4_llama(rank, tmp, tp, g):
    """torchao NF4 Llama at ``tp``: bitwise shards, logits, loss, LoRA gradients, 3 AdamW steps."""
    import torch.distributed as dist

    import tpify

    path = f"{tmp[0]}/llama_nf4"
    torch.manual_seed(0)
    if rank == 0:
        LlamaForCausalLM(nf4_llama_config()).save_pretrained(path)
    dist.barrier()
    ref = LlamaForCausalLM.from_pretrained(path, quantization_config=nf4_config(), dtype=torch.float32,
                                           device_map="cpu")
    par = tpify.from_pretrained(path, tp_size=tp, quantization_config=nf4_config(), dtype=torch.float32)
    n = _check_nf4_bitwise(par, ref, rank)
    assert n == 7, n
    ids = torch.randint(3, 101, (2, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, **LOGITS)
    worst, w_abs = _lora_three_steps(par, ref, g, "nf4 ", f"{tmp[0]}/merged_nf4")
    if rank == 0:
        print(f"measured torchao nf4 llama tp={tp}: {n} layers bitwise; loss max abs diff "
              f"{worst['loss']:.1e}, LoRA grads {worst['grad']:.1e}, adapters after 3 AdamW steps {w_abs:.1e}",
              flush=True)


def _lora_three_steps(par, ref, g, what: str, save_dir: str):
    """LoRA (r 4 on TARGETS, one seed) on the quantized tpify model ``par`` and on transformers' dense
    quantized ``ref``: 3 AdamW steps, the loss and every gathered LoRA gradient compared at each step
    and the adapters after; then merging and saving the quantized base refused. Returns the largest
    differences ``({"loss", "grad"}, adapters)``. Collective over the TP group."""
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    lora_cfg = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian")  # noqa: E731
    torch.manual_seed(1)
    dense_lora = peft.get_peft_model(ref, lora_cfg())
    torch.manual_seed(1)
    lora = get_peft_model(par, lora_cfg())
    lora.train(), dense_lora.train()
    opt_d = torch.optim.AdamW([p for p in dense_lora.parameters() if p.requires_grad], lr=1e-2)
    opt_p = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(3):
        ids = torch.randint(3, 101, (2, 12), generator=g)
        loss_d = tputil.ref_lm_loss(dense_lora(ids).logits, ids, causal=True)
        loss_d.backward()
        loss_p = lora(ids, labels=ids).loss
        loss_p.backward()
        torch.testing.assert_close(loss_p, loss_d, **LOSS, msg=f"{what}loss, step {step}")
        worst["loss"] = max(worst["loss"], (loss_p - loss_d).abs().item())
        grads_d = {k: p.grad for k, p in dense_lora.named_parameters() if p.requires_grad}
        grads_p = _gathered(lora, "grad")
        assert set(grads_d) == set(grads_p) and grads_d, set(grads_d) ^ set(grads_p)
        for k, gr in grads_d.items():
            torch.testing.assert_close(grads_p[k], gr, **GRAD, msg=lambda m: f"{what}grad {k}, step {step}: {m}")
            worst["grad"] = max(worst["grad"], (grads_p[k] - gr).abs().max().item())
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    final = _gathered(lora)
    w_abs = 0.0
    for k, w in {k: p for k, p in dense_lora.named_parameters() if p.requires_grad}.items():
        torch.testing.assert_close(final[k], w.detach(), **ADAPTER, msg=lambda m: f"{what}{k}: {m}")
        w_abs = max(w_abs, (final[k] - w.detach()).abs().max().item())
    with pytest.raises(NotImplementedError, match="merging a LoRA adapter on a quantized"):
        lora.merge_and_unload()
    with pytest.raises(NotImplementedError, match="tpify.save_pretrained on a quantized"):
        tpify.save_pretrained(par, save_dir)
    return worst, w_abs


def _check_bitwise(par, ref, rank):
    """Each int8 layer's codes, scales and dequantized shard against the dense ``Int8Tensor``'s; the count."""
    from tpify.quantized_torchao import Int8RowParallelLinear, _Int8

    refs, n = dict(ref.named_modules()), 0
    for fqn, m in par.named_modules():
        if not isinstance(m, _Int8):
            continue
        dense = refs[fqn].weight
        assert type(dense).__name__ == "Int8Tensor", (fqn, type(dense))
        spec, is_row = m.weight_shard_spec, isinstance(m, Int8RowParallelLinear)
        pieces = lambda t: torch.cat([t[:, a:b] if is_row else t[a:b] for a, b in spec.ranges(rank)],  # noqa: E731
                                     dim=1 if is_row else 0)
        assert torch.equal(m.weight_qdata, pieces(dense.qdata)), fqn
        assert torch.equal(m.weight_scale, dense.scale if is_row else pieces(dense.scale)), fqn
        assert torch.equal(m.weight, pieces(dense.dequantize())), fqn
        n += 1
    return n


def _gathered(model, attr=None):
    from tpify.sharding import shard_spec_of

    group, out = model.tp_info.tp_group, {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            value, spec = (p if attr is None else getattr(p, attr)), shard_spec_of(p)
            out[name] = (spec.gather(value.detach(), group) if spec is not None else value.detach()).clone()
    return out


def _check_llama(rank, tmp, tp):
    import torch.distributed as dist

    import tpify

    path = f"{tmp[0]}/llama"
    torch.manual_seed(0)
    dense = LlamaForCausalLM(llama_config())
    if rank == 0:
        dense.save_pretrained(path)
    dist.barrier()
    ref = LlamaForCausalLM.from_pretrained(path, quantization_config=ao_config(), dtype=torch.float32,
                                           device_map="cpu")
    par = tpify.from_pretrained(path, tp_size=tp, quantization_config=ao_config(), dtype=torch.float32)
    n = _check_bitwise(par, ref, rank)
    assert n == 7 * 2, n
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 101, (2, 12), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, **LOGITS)

    worst, w_abs = _lora_three_steps(par, ref, g, "", f"{tmp[0]}/merged")
    if rank == 0:
        print(f"measured torchao int8 llama tp={tp}: {n // 2} layers per decoder layer bitwise; loss max abs diff "
              f"{worst['loss']:.1e}, LoRA grads {worst['grad']:.1e}, adapters after 3 AdamW steps {w_abs:.1e}",
              flush=True)
    return g


def _body(rank, world):
    import torch.distributed as dist

    import tpify

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)
        g = _check_llama(rank, tmp, 2)
        _check_nf4_llama(rank, tmp, 2, g)
        # GPT-2: Conv1D layers are not quantized by transformers' torchao quantizer, nor by tpify
        gpath = f"{tmp[0]}/gpt2"
        torch.manual_seed(0)
        if rank == 0:
            GPT2LMHeadModel(gpt2_config()).save_pretrained(gpath)
        dist.barrier()
        gref = GPT2LMHeadModel.from_pretrained(gpath, quantization_config=ao_config(), dtype=torch.float32,
                                               device_map="cpu")
        assert not any(type(p).__name__ == "Int8Tensor" for p in gref.parameters())
        gpar = tpify.parallelize(GPT2LMHeadModel.from_pretrained(gpath, dtype=torch.float32), tp_size=2,
                                 quantization_config=ao_config())
        assert _check_bitwise(gpar, gref, rank) == 0
        ids = torch.randint(3, 128, (2, 12), generator=g)
        gref.eval(), gpar.eval()
        with torch.no_grad():
            torch.testing.assert_close(gpar(ids).logits, gref(ids).logits, **LOGITS)
        dist.barrier()
    return "ok"


@pytest.mark.slow  # a spawn of 2 ranks; the quick subset has the one-process checks (tests/unit/test_quantized_torchao_unit.py)
def test_torchao_int8_tensor_parallel_matches_dense_torchao():
    assert tputil.spawn(_body, 2, timeout=300) == ["ok"] * 2


def _body_tp4(rank, world):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)
        g = _check_llama(rank, tmp, 4)
        _check_nf4_llama(rank, tmp, 4, g)
        dist.barrier()
    return "ok"


@pytest.mark.slow  # 4 ranks on the CPUs
def test_torchao_int8_tp4_with_replicated_kv_heads_matches_dense_torchao():
    """tp 4 over 2 KV heads: K/V rows replicated on pairs of ranks (their codes and scales the dense rows')."""
    assert tputil.spawn(_body_tp4, 4, timeout=400) == ["ok"] * 4
