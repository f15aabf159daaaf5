"""QLoRA under tensor parallelism equals transformers' + PEFT's dense QLoRA (bitsandbytes NF4/FP4, tp = 2).

The reference is transformers' own 4-bit loading (``from_pretrained(..., quantization_config=
BitsAndBytesConfig(load_in_4bit=True, ...))``, bitsandbytes' ``Linear4bit`` on CPU) with PEFT's
LoRA on it; the tpify side is ``tpify.from_pretrained`` / ``tpify.parallelize`` with the same
config and ``tpify.integrations.get_peft_model``. For Llama (grouped-query attention) and GPT-2
(``Conv1D``, packed ``c_attn``), float32 weights, float32 compute:

* every quantized layer: this rank's 4-bit codes and absmax equal the dense quantized weight's
  restricted to the shard, bit for bit, and so does the dequantized shard (``torch.equal``);
* Llama saved 4-bit by transformers and read back by ``tpify.from_pretrained`` (each rank reads only
  its blocks): the same bitwise checks, and logits equal to the quantize-on-load model's exactly;
* logits: atol 2e-5, rtol 1e-5 (the same dequantized weights; float32 matmuls of a shard and
  the row-parallel all-reduce sum in another order, ~1e-6 relative on values of order 1);
* 3 AdamW steps of LoRA (lr 1e-2): loss each step atol 1e-5, rtol 1e-5; every adapter gradient,
  gathered, atol 1e-5, rtol 1e-4 (float32 order again; the gradients are ~1e-2..1); the adapters
  after the steps atol 1e-4 (Adam divides by sqrt(v) + eps, amplifying float32 noise near 0);
* 3 AdamW steps through ``TPTrainer`` against transformers' ``Trainer`` on the dense 4-bit model
  (its own test): logged losses and grad norms atol 1e-6, rtol 1e-5;
* Llama at tp 4 over 2 KV heads (slow): the checks above;
* bitsandbytes 8-bit (``load_in_8bit=True``), Llama and GPT-2 at tp 2, Llama at tp 4: codes and row
  absmax bitwise, logits and one LoRA step as above (:func:`_check_int8`);
* Llama with gradient checkpointing on both sides: the gradients of one more step, as above;
* refusals, raised on every rank: merging an adapter, ``tpify.save_pretrained``, ``TPTrainer`` and
  ``TPAccelerator`` without adapters (full fine-tuning), DoRA, FSDP2 (``shard_data_parallel``).
"""

import tempfile
import warnings

import pytest
import torch
from transformers import BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import tputil

pytest.importorskip("bitsandbytes")

LOGITS = dict(atol=2e-5, rtol=1e-5)
LOSS = dict(atol=1e-5, rtol=1e-5)
GRAD = dict(atol=1e-5, rtol=1e-4)
ADAPTER = dict(atol=1e-4, rtol=1e-4)


def llama_config(hidden=128):
    return LlamaConfig(num_hidden_layers=2, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=2 * hidden, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def gpt2_config():
    return GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=128, resid_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                      embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)


FAMILIES = {
    "llama": (LlamaForCausalLM, llama_config, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], "nf4"),
    "gpt2": (GPT2LMHeadModel, gpt2_config, ["c_attn", "c_proj", "c_fc"], "fp4"),
    # tp 4 over 2 KV heads: K/V rows replicated on pairs of ranks; o_proj 256 / 4 = 64 columns per rank
    "llama_tp4": (LlamaForCausalLM, lambda: llama_config(256), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"], "nf4"),
}


def bnb_config(quant_type):
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32)


def _elements(spec, in_f, out_f, rank, is_row):
    """Indices, in the flattened dense ``[out, in]`` weight, of this rank's shard, in its order."""
    idx = torch.arange(in_f * out_f).view(out_f, in_f)
    pieces = [idx[:, a:b] if is_row else idx[a:b] for a, b in spec.ranges(rank)]
    return torch.cat(pieces, dim=1 if is_row else 0).reshape(-1)


def _check_bitwise(par, ref, rank):
    import bitsandbytes.functional as bnbf

    from tpify.quantized import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

    refs = dict(ref.named_modules())
    n = 0
    for fqn, m in par.named_modules():
        if not isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)):
            continue
        dense = refs[fqn]
        assert type(dense).__name__ == "Linear4bit", (fqn, type(dense))
        qs = dense.weight.quant_state
        out_f, in_f = qs.shape
        el = _elements(m.weight_shard_spec, in_f, out_f, rank, isinstance(m, QuantizedRowParallelLinear))
        assert el.numel() % 64 == 0
        dense_bytes = dense.weight.data.view(-1)
        byte_idx = el.view(-1, 2)[:, 0] // 2  # two codes per byte, pairs aligned (blocks of 64)
        assert torch.equal(m.weight_codes.view(-1), dense_bytes[byte_idx]), fqn
        assert torch.equal(m.weight_absmax, qs.absmax[el.view(-1, 64)[:, 0] // 64]), fqn
        deq = bnbf.dequantize_4bit(dense.weight.data, qs).reshape(-1)[el].view(m.quant_shape)
        local = m.weight if m.weight_layout == "linear" else m.weight.t()
        assert torch.equal(local, deq), fqn
        n += 1
    return n


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


def _check_family(family, rank, tmp, tp=2):
    import peft
    import torch.distributed as dist

    import tpify
    from tpify.integrations import get_peft_model

    cls, config_fn, targets, quant_type = FAMILIES[family]
    torch.manual_seed(0)
    dense = cls(config_fn())
    path = f"{tmp}/{family}"
    if rank == 0:
        dense.save_pretrained(path)
    dist.barrier()
    ref = cls.from_pretrained(path, quantization_config=bnb_config(quant_type), dtype=torch.float32, device_map="cpu")
    if family.startswith("llama"):  # the loading path: slices read, then quantized
        par = tpify.from_pretrained(path, tp_size=tp, quantization_config=bnb_config(quant_type), dtype=torch.float32)
    else:  # the in-memory path
        loaded = cls.from_pretrained(path, dtype=torch.float32)  # the same config on every rank (rank 0 saved it)
        par = tpify.parallelize(loaded, tp_size=tp, quantization_config=bnb_config(quant_type))
    n_quantized = _check_bitwise(par, ref, rank)
    pre = None
    if family.startswith("llama"):  # a checkpoint saved 4-bit by transformers, read by slices as stored
        if rank == 0:
            ref.save_pretrained(f"{path}-4bit")
        dist.barrier()
        pre = tpify.from_pretrained(f"{path}-4bit", tp_size=tp)
        assert _check_bitwise(pre, ref, rank) == n_quantized
    assert n_quantized == (4 * 2 if family == "gpt2" else 7 * 2), n_quantized

    vocab = dense.config.vocab_size
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    # train mode on the reference: in eval mode bitsandbytes' Linear4bit on a CPU with AVX512-BF16 repacks
    # its weight and computes in bfloat16 (an inference kernel); tpify's layers compute in the compute dtype
    ref.train(), par.train()  # dropout is 0 in both configs
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, **LOGITS)
        if pre is not None:
            pre.train()
            torch.testing.assert_close(pre(ids).logits, par(ids).logits, atol=0, rtol=0)

    lora_cfg = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")  # noqa: E731
    torch.manual_seed(1)
    dense_lora = peft.get_peft_model(ref, lora_cfg())
    torch.manual_seed(1)
    lora = get_peft_model(par, lora_cfg())
    lora.train(), dense_lora.train()
    opt_d = torch.optim.AdamW([p for p in dense_lora.parameters() if p.requires_grad], lr=1e-2)
    opt_p = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(3):
        ids = torch.randint(3, vocab, (2, 12), generator=g)
        loss_d = tputil.ref_lm_loss(dense_lora(ids).logits, ids, causal=True)
        loss_d.backward()
        loss_p = lora(ids, labels=ids).loss
        loss_p.backward()
        torch.testing.assert_close(loss_p, loss_d, **LOSS, msg=f"{family} loss, step {step}")
        worst["loss"] = max(worst["loss"], (loss_p - loss_d).abs().item())
        grads_d = {n: p.grad for n, p in dense_lora.named_parameters() if p.requires_grad}
        grads_p = _gathered(lora, "grad")
        assert set(grads_d) == set(grads_p) and grads_d, set(grads_d) ^ set(grads_p)
        assert all("lora_" in n for n in grads_p), "only adapters train"
        for n, gr in grads_d.items():
            torch.testing.assert_close(grads_p[n], gr, **GRAD, msg=lambda m: f"{family} grad {n}, step {step}: {m}")
            worst["grad"] = max(worst["grad"], (grads_p[n] - gr).abs().max().item())
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    if family == "llama":  # gradient checkpointing (prepare_model_for_kbit_training's), on both sides
        for m in (dense_lora, lora):
            m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert m.base_model.model.model.gradient_checkpointing
        ids = torch.randint(3, vocab, (2, 12), generator=g)
        tputil.ref_lm_loss(dense_lora(ids).logits, ids, causal=True).backward()
        lora(ids, labels=ids).loss.backward()
        grads_p = _gathered(lora, "grad")
        for n, p in dense_lora.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads_p[n], p.grad, **GRAD, msg=lambda m: f"checkpointed grad {n}: {m}")
        opt_d.zero_grad(), opt_p.zero_grad()
    final = _gathered(lora)
    for n, w in {n: p for n, p in dense_lora.named_parameters() if p.requires_grad}.items():
        torch.testing.assert_close(final[n], w.detach(), **ADAPTER, msg=lambda m: f"{family} {n}: {m}")
    w_abs = max((final[n] - p.detach()).abs().max().item()
                for n, p in dense_lora.named_parameters() if p.requires_grad)
    if rank == 0:
        print(f"measured QLoRA {family} ({quant_type}) tp={tp}: {n_quantized // 2} quantized layers per decoder layer bitwise "
              f"equal; loss max abs diff {worst['loss']:.1e}, LoRA grads {worst['grad']:.1e}, adapters after 3 "
              f"AdamW steps {w_abs:.1e}", flush=True)

    # refusals, on every rank
    with pytest.raises(NotImplementedError, match="merging a LoRA adapter on a quantized"):
        lora.merge_and_unload()
    with pytest.raises(NotImplementedError, match="tpify.save_pretrained on a quantized"):
        tpify.save_pretrained(par, f"{tmp}/{family}-merged")
    lora.save_pretrained(f"{tmp}/{family}-adapter")  # the adapter is standard: plain PEFT loads it on the dense base
    return lora


def _body(rank, world):
    import peft
    import torch.distributed as dist
    from transformers import TrainingArguments

    import tpify
    from tpify.integrations import TPAccelerator, TPTrainer, get_peft_model
    from tpify.info import TPUsageError

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)
        for family in ("llama", "gpt2"):
            _check_family(family, rank, tmp[0])
        # full fine-tuning of a quantized base (no adapters): refused by TPTrainer
        torch.manual_seed(0)
        q = tpify.parallelize(LlamaForCausalLM(llama_config()), tp_size=2, quantization_config=bnb_config("nf4"))
        args = TrainingArguments(output_dir=f"{tmp[0]}/out", report_to=[], use_cpu=True)
        with pytest.raises(TPUsageError, match="full fine-tuning of a quantized base"):
            TPTrainer(model=q, args=args)
        with pytest.raises(NotImplementedError, match="use_dora=True"):
            get_peft_model(q, peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
        with pytest.raises(TPUsageError, match="TPAccelerator.prepare: full fine-tuning of a quantized base"):
            TPAccelerator(cpu=True).prepare(q)
        with pytest.raises(TPUsageError, match=r"shard_data_parallel \(FSDP2\) over a quantized"):
            tpify.shard_data_parallel(q)
        dist.barrier()
    return "ok"


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_qlora_tensor_parallel_matches_dense_qlora():
    assert tputil.spawn(_body, 2, timeout=300) == ["ok"] * 2


def _body_tp4(rank, world):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)
        _check_family("llama_tp4", rank, tmp[0], tp=4)
        _check_int8(f"{tmp[0]}/llama_tp4", LlamaForCausalLM, FAMILIES["llama"][2], rank, 4, 14)
        dist.barrier()
    return "ok"


@pytest.mark.slow
def test_qlora_tp4_with_replicated_kv_heads_matches_dense_qlora():
    """Llama at tp 4 over 2 KV heads (K/V shards replicated on pairs of ranks), the same checks."""
    assert tputil.spawn(_body_tp4, 4, timeout=400) == ["ok"] * 4


class _Data(torch.utils.data.Dataset):
    """16 Llama sequences of 12 tokens, about 30% of the labels -100."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 101, (16, 12), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.rand(16, 12, generator=g) < 0.3] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _trainer_args(out):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=3, gradient_accumulation_steps=2, learning_rate=1e-3,
                             logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                             save_strategy="no", max_grad_norm=1.0)


def _lora_all():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=FAMILIES["llama"][2], init_lora_weights="gaussian")


def _log(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _trainer_body(rank, world, path):
    import tpify
    from tpify.integrations import TPTrainer, get_peft_model

    warnings.filterwarnings("ignore")
    tputil.torchrun_env(rank, world)  # Trainer and accelerate read the world from it
    model = tpify.from_pretrained(path, tp_size=2, quantization_config=bnb_config("nf4"), dtype=torch.float32)
    torch.manual_seed(1)
    model = get_peft_model(model, _lora_all())
    trainer = TPTrainer(model=model, args=_trainer_args(f"{path}/tp-{rank}"), train_dataset=_Data())
    trainer.train()
    return _log(trainer)


@pytest.mark.slow  # in the full suite; the quick subset stays under 3 minutes
def test_qlora_through_tptrainer_matches_transformers_trainer(tmp_path):
    """3 AdamW steps of QLoRA (clipped at 1.0) through TPTrainer at tp 2 against transformers'
    Trainer on the dense 4-bit model with PEFT's LoRA: losses and grad norms rtol 1e-5 (float32)."""
    import peft
    from transformers import Trainer

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=bnb_config("nf4"), dtype=torch.float32,
                                               device_map="cpu")
        torch.manual_seed(1)
        ref = peft.get_peft_model(ref, _lora_all())
        trainer = Trainer(model=ref, args=_trainer_args(str(tmp_path / "dense")), train_dataset=_Data())
        trainer.train()
    want = _log(trainer)
    got = tputil.spawn(_trainer_body, 2, str(tmp_path), timeout=300)
    assert len(want) == 3
    for log in got:
        torch.testing.assert_close(torch.tensor(log, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-6, rtol=1e-5)
    print(f"measured QLoRA TPTrainer tp=2 vs Trainer: {got[0]} vs {want}")


def _real_bytes(model):
    """This rank's bytes of a quantized model with LoRA: the 4-bit shards (codes + absmax + code
    tables), the frozen parameters kept in their dtype, the LoRA parameters."""
    from tpify.quantized import quantized_bytes

    sizes = quantized_bytes(model)
    return {"quantized_bytes": sizes["quantized"], "kept_bytes": sizes["frozen"], "lora_bytes": sizes["trainable"]}


def _plan_body(rank, world, tmp):
    import peft

    import tpify
    from tpify.authoring.plan import plan_report
    from tpify.integrations import get_peft_model

    warnings.filterwarnings("ignore")
    out = {}
    for family, quant in (("llama", "nf4"), ("gpt2", "fp4")):
        cls, make_config, targets, _ = FAMILIES[family]
        torch.manual_seed(0)
        par = tpify.parallelize(cls(make_config()), tp_size=world, quantization_config=bnb_config(quant))
        lora = get_peft_model(par, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        real = _real_bytes(lora)
        plan = plan_report(f"{tmp}/{family}", world, quantize=quant, lora_r=8)["quantized"]["rank"]
        assert {k: plan[k] for k in real} == real, (family, rank, real, plan)
        out[family] = real
    return out


@pytest.mark.slow  # a spawn of 2 ranks; the arithmetic itself is checked by hand in tests/unit/test_cli_plan.py
def test_plan_quantized_bytes_equal_the_real_shards_at_tp2(tmp_path):
    """``tpify plan --quantize`` (on the meta device, no ranks) gives, per rank, exactly the bytes of
    the real quantized model at tp 2: the 4-bit codes, absmax and code tables of every shard, the
    parameters kept unquantized, and the LoRA factors (r = 8 on every quantized layer); Llama (GQA,
    NF4) and GPT-2 (packed ``c_attn``, ``Conv1D``, FP4). Integers: compared exactly."""
    for family in ("llama", "gpt2"):
        FAMILIES[family][1]().save_pretrained(tmp_path / family)
    got = tputil.spawn(_plan_body, 2, str(tmp_path), timeout=300)
    assert got[0] == got[1]  # even splits: every rank the same


def _check_dequantized(par, ref, rank):
    """Every quantized layer's dequantized shard equals the dense (double-)quantized weight,
    dequantized by bitsandbytes, restricted to the shard: bitwise. Returns the count."""
    import bitsandbytes.functional as bnbf

    from tpify.quantized import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

    refs, n = dict(ref.named_modules()), 0
    for fqn, m in par.named_modules():
        if not isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)):
            continue
        qs = refs[fqn].weight.quant_state
        assert qs.nested, fqn
        out_f, in_f = qs.shape
        el = _elements(m.weight_shard_spec, in_f, out_f, rank, isinstance(m, QuantizedRowParallelLinear))
        deq = bnbf.dequantize_4bit(refs[fqn].weight.data, qs).reshape(-1)[el].view(m.quant_shape)
        local = m.weight if m.weight_layout == "linear" else m.weight.t()
        assert torch.equal(local, deq), fqn
        n += 1
    return n


def _check_int8(path, cls, targets, rank, tp, n_layers):
    """bitsandbytes 8-bit (``load_in_8bit=True``) at ``tp``: every quantized layer's int8 codes and row
    absmax equal transformers' dense ``Int8Params`` (``CB``, ``SCB``) restricted to the shard, bit for
    bit (a row-parallel layer's absmax all-reduced at load); in train mode (bitsandbytes' CPU
    ``MatMul8bitFp`` path: dequantize, float32 matmul) logits, one LoRA step's loss and adapter
    gradients as the 4-bit checks (float32 summation order); in eval mode (``MatMul8bitLt``: activation
    rows quantized over all input features) a row-parallel layer raises, by name, on every rank."""
    import peft

    import tpify
    from tpify.info import TPUsageError
    from tpify.integrations import get_peft_model
    from tpify.quantized_int8 import Int8LtColumnParallelLinear, Int8LtRowParallelLinear

    config = BitsAndBytesConfig(load_in_8bit=True)
    ref = cls.from_pretrained(path, quantization_config=config, dtype=torch.float32, device_map="cpu").train()
    par = tpify.from_pretrained(path, tp_size=tp, quantization_config=config, dtype=torch.float32).train()
    refs, n = dict(ref.named_modules()), 0
    for fqn, m in par.named_modules():
        if not isinstance(m, (Int8LtColumnParallelLinear, Int8LtRowParallelLinear)):
            continue
        dense = refs[fqn]
        assert type(dense).__name__ == "Linear8bitLt", (fqn, type(dense))
        cb, scb = dense.weight.data, (dense.weight.SCB if dense.weight.SCB is not None else dense.state.SCB)
        out_f, in_f = cb.shape
        is_row = isinstance(m, Int8LtRowParallelLinear)
        el = _elements(m.weight_shard_spec, in_f, out_f, rank, is_row)
        shape = (out_f, -1) if is_row else (-1, in_f)
        assert torch.equal(m.weight_CB, cb.reshape(-1)[el].view(shape)), fqn
        rows = el.view(shape)[:, 0] // in_f
        assert torch.equal(m.weight_SCB, scb[rows]), fqn
        n += 1
    assert n == n_layers, n
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, ref(ids).logits, **LOGITS)
    lora_cfg = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")  # noqa: E731
    torch.manual_seed(1)
    dense_lora = peft.get_peft_model(ref, lora_cfg()).train()
    torch.manual_seed(1)
    lora = get_peft_model(par, lora_cfg()).train()
    loss_d = tputil.ref_lm_loss(dense_lora(ids).logits, ids, causal=True)
    loss_d.backward()
    loss_p = lora(ids, labels=ids).loss
    loss_p.backward()
    torch.testing.assert_close(loss_p, loss_d, **LOSS)
    grads_p = _gathered(lora, "grad")
    grads_d = {k: p.grad for k, p in dense_lora.named_parameters() if p.requires_grad}
    assert set(grads_p) == set(grads_d) and grads_d
    for k, gr in grads_d.items():
        torch.testing.assert_close(grads_p[k], gr, **GRAD, msg=lambda msg: f"int8 grad {k}: {msg}")
    if rank == 0:
        print(f"measured int8 {cls.__name__} tp={tp}: {n} layers bitwise; loss diff {(loss_p - loss_d).abs().item():.1e}, LoRA grads "
              f"{max((grads_p[k] - g).abs().max().item() for k, g in grads_d.items()):.1e}", flush=True)
    lora.eval()
    with torch.no_grad(), pytest.raises(TPUsageError, match="MatMul8bitLt path"):
        lora(ids)


def _double_quant_body(rank, world, tmp):
    import tpify

    warnings.filterwarnings("ignore")
    _check_int8(f"{tmp}/llama", LlamaForCausalLM, FAMILIES["llama"][2], rank, world, 14)
    _check_int8(f"{tmp}/gpt2", GPT2LMHeadModel, FAMILIES["gpt2"][2], rank, world, 8)
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    for family, quant in (("llama", "nf4"), ("gpt2", "fp4")):
        cls = FAMILIES[family][0]
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_compute_dtype=torch.float32,
                                    bnb_4bit_use_double_quant=True)
        ref = cls.from_pretrained(f"{tmp}/{family}", quantization_config=config, dtype=torch.float32,
                                  device_map="cpu").train()
        models = [tpify.from_pretrained(f"{tmp}/{family}", tp_size=world, quantization_config=config)]
        if family == "llama":  # transformers' saved double-quantized checkpoint, read by slices
            models.append(tpify.from_pretrained(f"{tmp}/{family}-4bit", tp_size=world))
        for par in models:
            assert _check_dequantized(par, ref, rank) == (14 if family == "llama" else 8)
            par.train()
            with torch.no_grad():
                torch.testing.assert_close(par(ids).logits, ref(ids).logits, **LOGITS)
    return "ok"


@pytest.mark.slow
def test_double_quantization_tp2_equals_dense_bitwise(tmp_path):
    """``bnb_4bit_use_double_quant=True`` at tp 2: the dequantized local weight of every layer equals
    transformers' dense double-quantized weight (its absmax quantized again in blocks of 256 with
    the dense mean as offset), dequantized, restricted to the shard, bit for bit: Llama NF4 (hidden
    256: the row-parallel shards' blocks interleave rows, so the 256-blocks of statistics are cut,
    which the ranks' gathered statistics make exact) quantized on load and read from transformers'
    saved 4-bit checkpoint, GPT-2 FP4 (``Conv1D``, packed ``c_attn``). Logits as the other checks
    (atol 2e-5, rtol 1e-5: float32 summation order). In the same spawn, bitsandbytes 8-bit on both
    families (:func:`_check_int8`)."""
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(256)).save_pretrained(tmp_path / "llama")
    GPT2LMHeadModel(gpt2_config()).save_pretrained(tmp_path / "gpt2")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                bnb_4bit_use_double_quant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM.from_pretrained(tmp_path / "llama", quantization_config=config, dtype=torch.float32,
                                         device_map="cpu").save_pretrained(tmp_path / "llama-4bit")
    assert tputil.spawn(_double_quant_body, 2, str(tmp_path), timeout=300) == ["ok"] * 2
