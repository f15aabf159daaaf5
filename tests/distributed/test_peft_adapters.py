"""PEFT beyond plain LoRA on a tensor-parallel model equals dense PEFT (tp = 2, float64).

On GPT-2 (Conv1D layers, packed ``c_attn``, a tied LM head over a vocabulary of 50257 that
tp = 2 pads) and Llama (grouped-query attention, untied head), through
``tpify.integrations.get_peft_model`` / ``load_peft_adapter`` against ``peft`` on the dense model
from the same random state:

* ``target_modules="all-linear"`` and a regular expression adapt exactly the modules dense PEFT
  adapts (the LM head left out, as PEFT leaves it out);
* ``modules_to_save=["lm_head", <the embedding>]``: the trainable copies stay vocabulary-parallel,
  train as dense (loss and every gradient, 2 AdamW steps), are saved dense (gathered, unpadded:
  plain PEFT loads them with the dense logits) and load back sliced;
* a dense adapter directory loads onto the tensor-parallel model (``load_peft_adapter``, then a
  second one with PEFT's own ``load_adapter``, switched with ``set_adapter``) with the dense
  logits; plain ``PeftModel.from_pretrained`` on it fails with PEFT's "not supported", an adapter
  tensor of a wrong shape with TPUsageError;
* DoRA (``use_dora=True``; the magnitude's gradient included; with dropout drawing, the base
  output recomputed on the dropped input), with sequence parallelism too (Llama), and
  ``lora_bias=True``: loss and every gradient as dense, merged weights as dense, saved dense;
* bfloat16 adapters, which PEFT upcasts to float32 by new parameters, keep their split (saved
  dense, loaded sliced);
* what is not supported (LoRA variants other than DoRA, whole-weight initialisations, DoRA on
  the padded head, ``low_cpu_mem_usage``) is refused by name.

Tolerances: losses, logits and gradients ``atol=1e-10, rtol=1e-9`` (float64, only the order of
sums differs: each rank's partial sums, the row-parallel weight norm summed from per-rank
squares); weights after 2 AdamW steps ``atol=1e-8, rtol=1e-6`` (Adam turns ~1e-16 gradient noise
near eps into ~1e-9, see test_dp_tp_training.py). One spawned job of 2 ranks runs every check.
"""

import copy
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

import tputil
from test_core_equivalence import gpt2_config
from test_llama import llama_config

pytestmark = pytest.mark.slow

EXACT = dict(atol=1e-10, rtol=1e-9)
WEIGHTS = dict(atol=1e-8, rtol=1e-6)
FAMILIES = {"gpt2": (GPT2LMHeadModel, gpt2_config), "llama": (LlamaForCausalLM, lambda: llama_config(tie=False))}
REGEX = {"gpt2": r".*\.(c_fc|c_proj)", "llama": r".*\.(q_proj|down_proj)"}

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _lora(**kw):
    import peft

    kw.setdefault("target_modules", "all-linear")
    return peft.LoraConfig(r=4, lora_alpha=8, **kw)


def _ids(vocab, seed, shape=(2, 8)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _base(family, sequence_parallel=False):
    """``(dense model, its tensor-parallel copy)``, float64, from one seed."""
    import tpify

    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    base = cls(config()).double()
    return base, tpify.parallelize(copy.deepcopy(base), tp_size=2, sequence_parallel=sequence_parallel)


def _pair(family, config_fn, sequence_parallel=False):
    """``(dense base, dense PEFT model, tensor-parallel PEFT model)`` from the same random state."""
    import peft

    from tpify.integrations import get_peft_model

    base, par = _base(family, sequence_parallel)
    torch.manual_seed(1)
    dense = peft.get_peft_model(copy.deepcopy(base), config_fn())
    torch.manual_seed(1)
    return base, dense, get_peft_model(par, config_fn())


def _adapted(model):
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _compare_step(dense, tp, ids, what):
    """One forward/backward of both; loss and every trainable gradient compared; max |grad diff|."""
    loss_d = tputil.ref_lm_loss(dense(ids).logits, ids, causal=True)
    loss_p = tp(ids, labels=ids).loss
    torch.testing.assert_close(loss_p, loss_d, **EXACT, msg=lambda m: f"{what} loss: {m}")
    loss_d.backward()
    loss_p.backward()
    grads_d = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
    trainable = {n for n, p in tp.named_parameters() if p.requires_grad}
    assert set(grads_d) == trainable and grads_d, set(grads_d) ^ trainable
    grads_p = tputil.dense_named(tp, "grad")
    worst = 0.0
    for n, g in grads_d.items():
        assert g is not None and grads_p[n] is not None, f"{what}: no gradient for {n}"
        torch.testing.assert_close(grads_p[n], g, **EXACT, msg=lambda m: f"{what} grad {n}: {m}")
        worst = max(worst, float((grads_p[n] - g).abs().max()))
    return worst


def _train(dense, tp, vocab, what, steps=2):
    """``steps`` AdamW steps of both, each compared (:func:`_compare_step`), then the trained
    parameters; returns ``(max |grad diff|, max |weight diff|)``."""
    opt_d = torch.optim.AdamW([p for p in dense.parameters() if p.requires_grad], lr=1e-2)
    opt_p = torch.optim.AdamW([p for p in tp.parameters() if p.requires_grad], lr=1e-2)
    worst = 0.0
    for step in range(steps):
        worst = max(worst, _compare_step(dense, tp, _ids(vocab, 10 + step), f"{what} step {step}"))
        opt_d.step(), opt_p.step(), opt_d.zero_grad(), opt_p.zero_grad()
    final = tputil.dense_named(tp)
    weights = 0.0
    for n, p in dense.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(final[n], p.detach(), **WEIGHTS, msg=lambda m: f"{what} {n}: {m}")
            weights = max(weights, float((final[n] - p.detach()).abs().max()))
    return worst, weights


def _count(model, vocab):
    """The collectives of one training step of ``model`` (its gradients then cleared)."""
    import tpify

    with tpify.comm.count_collectives() as counted:
        model(_ids(vocab, 30), labels=_ids(vocab, 30)).loss.backward()
    model.zero_grad()
    return dict(counted)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _report(c, text):
    if c.rank == 0:
        print(f"measured tp=2 {text}", flush=True)


@_check
def all_linear_and_regex_targets_adapt_the_dense_modules(c):
    for family in FAMILIES:
        for targets in ("all-linear", "ALL-LINEAR", REGEX[family]):
            _, dense, tp = _pair(family, lambda: _lora(target_modules=targets))
            assert _adapted(tp) == _adapted(dense) and _adapted(dense), (family, targets, _adapted(tp) ^ _adapted(dense))
            assert "lm_head" not in _adapted(tp)
            assert set(tp.peft_config["default"].target_modules) == set(dense.peft_config["default"].target_modules)


@_check
def modules_to_save_trains_saves_dense_and_loads_sliced(c):
    import peft

    from tpify.integrations import load_peft_adapter
    from tpify.integrations.peft import load_adapter_
    from tpify.layers import ColumnParallelLinear

    for family in FAMILIES:
        embedding = "embed_tokens" if family == "llama" else "wte"
        base, dense, tp = _pair(family, lambda: _lora(target_modules=["q_proj", "c_attn"], init_lora_weights=False,
                                                      modules_to_save=["lm_head", embedding]))
        copy_ = tp.base_model.model.lm_head.modules_to_save["default"]
        assert isinstance(copy_, ColumnParallelLinear) and copy_.weight.tp_shard_spec is not None
        vocab = base.config.vocab_size
        grads, weights = _train(dense, tp, vocab, f"{family} modules_to_save")
        ids = _ids(vocab, 20)
        want = _logits(dense, ids)
        torch.testing.assert_close(_logits(tp, ids), want, **EXACT)
        tp.save_pretrained(f"{c.tmp}/{family}-mts")  # collective
        plain = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{c.tmp}/{family}-mts")
        torch.testing.assert_close(_logits(plain, ids), want, **EXACT, msg=lambda m: f"{family} dense load: {m}")
        assert plain.base_model.model.lm_head.modules_to_save["default"].weight.shape == (vocab, 32)
        again = load_peft_adapter(_base(family)[1], f"{c.tmp}/{family}-mts")
        torch.testing.assert_close(_logits(again, ids), want, **EXACT, msg=lambda m: f"{family} sliced load: {m}")
        loaded = again.base_model.model.lm_head.modules_to_save["default"].weight
        assert torch.equal(loaded, copy_.weight.detach()), f"{family}: the copy's slice"
        with torch.no_grad():  # resuming reads the same directory back in place (TPTrainer, tpify finetune)
            for n, p in tp.named_parameters():
                if p.requires_grad:
                    p.zero_()
        load_adapter_(tp, f"{c.tmp}/{family}-mts")
        torch.testing.assert_close(_logits(tp, ids), want, **EXACT, msg=lambda m: f"{family} load_adapter_: {m}")
        _report(c, f"{family} modules_to_save=['lm_head', '{embedding}']: max |grad - dense| {grads:.1e}, weights after 2 AdamW "
                   f"steps {weights:.1e}")


@_check
def dense_adapters_load_switch_and_refuse_a_wrong_shape(c):
    import peft
    from peft.utils import set_peft_model_state_dict

    from tpify.integrations import TPUsageError, load_peft_adapter

    for family in FAMILIES:
        base, par = _base(family)
        vocab = base.config.vocab_size
        dense = copy.deepcopy(base)
        torch.manual_seed(2)
        dense = peft.get_peft_model(dense, _lora(init_lora_weights=False, use_dora=True))
        dense.add_adapter("second", _lora(target_modules=REGEX[family], init_lora_weights=False, lora_bias=True))
        dense.save_pretrained(f"{c.tmp}/{family}-dense") if c.rank == 0 else None
        dist.barrier()
        with pytest.raises(ValueError, match="Target module ColumnParallelLinear.* is not supported"):
            peft.PeftModel.from_pretrained(copy.deepcopy(par), f"{c.tmp}/{family}-dense")
        tp = load_peft_adapter(par, f"{c.tmp}/{family}-dense")
        tp.load_adapter(f"{c.tmp}/{family}-dense/second", "second")
        ids = _ids(vocab, 21)
        for name in ("default", "second", "default"):
            dense.set_adapter(name)
            tp.set_adapter(name)
            torch.testing.assert_close(_logits(tp, ids), _logits(dense, ids), **EXACT, msg=lambda m: f"{name}: {m}")
        assert _adapted(tp) == _adapted(dense)
        wrong = {k: torch.zeros(5, 3, dtype=torch.float64)
                 for k in peft.get_peft_model_state_dict(dense, adapter_name="default") if "lora_A" in k}
        with pytest.raises(TPUsageError, match="expected the dense"):
            set_peft_model_state_dict(tp, wrong, adapter_name="default")


@_check
def dora_trains_merges_and_saves_like_dense_peft(c):
    import peft

    from tpify.integrations import load_peft_adapter

    class Halve(nn.Module):  # a dropout that is not nn.Identity, drawing nothing: DoRA recomputes W x on it
        def forward(self, x):
            return x * 0.5

    for family in FAMILIES:
        base, dense, tp = _pair(family, lambda: _lora(use_dora=True, init_lora_weights=False))
        vocab = base.config.vocab_size
        magnitudes = [n for n, p in tp.named_parameters() if "lora_magnitude_vector" in n]
        assert magnitudes and all(p.requires_grad for n, p in tp.named_parameters() if n in magnitudes)
        if family == "gpt2":  # one column-parallel layer per activation: DoRA adds only the row norms' all-reduces
            plain, counted = _count(_base(family)[1], vocab), _count(tp, vocab)
            rows = sum(type(m).__name__ == "LoraTPLinear" and m.is_row for m in tp.modules())
            assert counted["all_reduce"] == plain["all_reduce"] + rows and not counted.get("all_gather"), (counted, plain)
        grads, weights = _train(dense, tp, vocab, f"{family} DoRA")
        for model in (dense, tp):
            for m in model.modules():
                if hasattr(m, "lora_dropout") and "default" in m.lora_dropout:
                    m.lora_dropout["default"] = Halve()
        dropout = _compare_step(dense.train(), tp.train(), _ids(vocab, 22), f"{family} DoRA with dropout")
        dense.eval(), tp.eval()  # DoRA in eval: no dropout (as PEFT)
        ids = _ids(vocab, 23)
        want = _logits(dense, ids)
        tp.save_pretrained(f"{c.tmp}/{family}-dora")
        plain = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{c.tmp}/{family}-dora")
        torch.testing.assert_close(_logits(plain, ids), want, **EXACT)
        torch.testing.assert_close(_logits(load_peft_adapter(_base(family)[1], f"{c.tmp}/{family}-dora"), ids), want,
                                   **EXACT)
        tp.merge_adapter()
        torch.testing.assert_close(_logits(tp, ids), want, **EXACT, msg=lambda m: f"{family} merged: {m}")
        tp.unmerge_adapter()
        torch.testing.assert_close(_logits(tp, ids), want, **EXACT, msg=lambda m: f"{family} unmerged: {m}")
        merged = tp.merge_and_unload()
        torch.testing.assert_close(_logits(merged, ids), _logits(dense.merge_and_unload(), ids), **EXACT)
        _report(c, f"{family} DoRA (all-linear): max |grad - dense| {grads:.1e} (with dropout {dropout:.1e}), "
                   f"weights after 2 AdamW steps {weights:.1e}")


@_check
def dora_under_sequence_parallelism_matches_dense(c):
    base, dense, tp = _pair("llama", lambda: _lora(use_dora=True, init_lora_weights=False), sequence_parallel=True)
    grads, weights = _train(dense, tp, base.config.vocab_size, "llama DoRA sequence parallel")
    _report(c, f"llama DoRA sequence parallel: max |grad - dense| {grads:.1e}, weights {weights:.1e}")


@_check
def lora_bias_trains_and_merges_like_dense_peft(c):
    import peft

    for family in FAMILIES:
        base, dense, tp = _pair(family, lambda: _lora(lora_bias=True))
        biases = [n for n, p in tp.named_parameters() if "lora_B" in n and n.endswith(".bias")]
        assert biases
        grads, weights = _train(dense, tp, base.config.vocab_size, f"{family} lora_bias")
        ids = _ids(base.config.vocab_size, 24)
        tp.save_pretrained(f"{c.tmp}/{family}-bias")
        plain = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{c.tmp}/{family}-bias")
        torch.testing.assert_close(_logits(plain, ids), _logits(dense, ids), **EXACT)
        if family == "llama":  # no bias on the base layers: PEFT cannot merge lora_bias, nor can tpify
            with pytest.raises(RuntimeError, match="Impossible to merge LoRA with `lora_bias=True`"):
                dense.merge_and_unload()
            with pytest.raises(RuntimeError, match="Impossible to merge LoRA with `lora_bias=True`"):
                tp.merge_and_unload()
        else:
            want = _logits(dense, ids)
            tp.merge_adapter()
            torch.testing.assert_close(_logits(tp, ids), want, **EXACT, msg=lambda m: f"{family} merged: {m}")
            tp.unmerge_adapter()
            torch.testing.assert_close(_logits(tp, ids), want, **EXACT, msg=lambda m: f"{family} unmerged: {m}")
            merged = tp.merge_and_unload()
            torch.testing.assert_close(_logits(merged, ids), _logits(dense.merge_and_unload(), ids), **EXACT)
        _report(c, f"{family} lora_bias: max |grad - dense| {grads:.1e}, weights {weights:.1e}")


@_check
def half_precision_adapters_keep_their_split(c):
    """PEFT upcasts bfloat16 adapters to float32 by new parameters: they keep their ShardSpecs, so
    they are saved dense and load back sliced."""
    import peft
    from safetensors.torch import load_file

    from tpify.integrations import get_peft_model, load_peft_adapter
    from tpify.sharding import shard_spec_of

    def sharded(model):
        return {n for n, p in model.named_parameters() if shard_spec_of(p) is not None and "lora_" in n}

    config = lambda: _lora(use_dora=True, init_lora_weights=False)  # noqa: E731
    _, _, reference = _pair("llama", config)  # float64: no upcast
    base, par = _base("llama")
    torch.manual_seed(1)
    tp = get_peft_model(par.to(torch.bfloat16), config())
    assert sharded(tp) == sharded(reference) and sharded(tp)
    assert all(p.dtype == torch.float32 for n, p in tp.named_parameters() if "lora_" in n)
    tp.save_pretrained(f"{c.tmp}/bf16")
    torch.manual_seed(1)
    dense = peft.get_peft_model(copy.deepcopy(base).to(torch.bfloat16), config())
    saved = load_file(f"{c.tmp}/bf16/adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in peft.get_peft_model_state_dict(dense).items()}
    again = load_peft_adapter(_base("llama")[1].to(torch.bfloat16), f"{c.tmp}/bf16")
    assert sharded(again) == sharded(reference)
    before, after = tputil.dense_named(tp), tputil.dense_named(again)
    assert all(torch.equal(after[n], before[n]) for n in before if "lora_" in n)


@_check
def unsupported_options_are_refused_by_name(c):
    from tpify.integrations import TPUsageError, get_peft_model

    cases = [(dict(init_lora_weights="pissa"), ValueError, "init_lora_weights='pissa'"),
             (dict(alora_invocation_tokens=[5], task_type="CAUSAL_LM"), ValueError, "alora_invocation_tokens"),
             (dict(use_dora=True, target_modules=["lm_head"]), ValueError, "use_dora on a vocabulary-padded layer.*lm_head")]
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            get_peft_model(_base("gpt2")[1], _lora(**kw))
    with pytest.raises(TPUsageError, match="low_cpu_mem_usage"):
        get_peft_model(_base("gpt2")[1], _lora(), low_cpu_mem_usage=True)
    with pytest.raises(TPUsageError, match="trainable_token_indices .*each rank holds only its vocabulary rows"):
        get_peft_model(_base("gpt2")[1], _lora(trainable_token_indices=[1, 2]))


def _body(rank, world, checks):
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # one directory for both ranks
        results = tputil.run_checks(checks, SimpleNamespace(rank=rank, world=world, tmp=shared[0]))
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, 2, _CHECKS, timeout=300)


def test_all_linear_and_regex_targets_adapt_the_modules_dense_peft_adapts(tp2):
    tputil.assert_checks_ok(tp2, "all_linear_and_regex_targets_adapt_the_dense_modules")


def test_modules_to_save_trains_as_dense_saves_dense_and_loads_sliced(tp2):
    tputil.assert_checks_ok(tp2, "modules_to_save_trains_saves_dense_and_loads_sliced")


def test_dense_adapters_load_onto_the_tp_model_and_switch_with_set_adapter(tp2):
    tputil.assert_checks_ok(tp2, "dense_adapters_load_switch_and_refuse_a_wrong_shape")


def test_dora_trains_merges_and_saves_like_dense_peft(tp2):
    tputil.assert_checks_ok(tp2, "dora_trains_merges_and_saves_like_dense_peft")


def test_dora_under_sequence_parallelism_matches_dense(tp2):
    tputil.assert_checks_ok(tp2, "dora_under_sequence_parallelism_matches_dense")


def test_lora_bias_trains_and_merges_like_dense_peft(tp2):
    tputil.assert_checks_ok(tp2, "lora_bias_trains_and_merges_like_dense_peft")


def test_half_precision_adapters_keep_their_tensor_parallel_split(tp2):
    tputil.assert_checks_ok(tp2, "half_precision_adapters_keep_their_split")


def test_unsupported_adapter_options_are_refused_by_name(tp2):
    tputil.assert_checks_ok(tp2, "unsupported_options_are_refused_by_name")


def test_every_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_CHECKS)] * 2
