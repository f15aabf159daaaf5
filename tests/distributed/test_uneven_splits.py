"""Uneven splits: an intermediate size tp_size does not divide, split by torch.chunk's rule, is exact.

transformers' model testers build tiny models with ``intermediate_size = 37``. tpify splits such a
dimension as DTensor's ``Shard`` does (``ceil(n / p)`` per rank, the last ranks fewer: 37 at
tp 2 is 19 + 18, at tp 4 10 + 10 + 10 + 7; docs/mechanics.md, "Uneven splits"), wherever the
planner finds no attention head in it. One spawned job of 4 gloo ranks runs every check
(``tputil.run_checks``), each test asserting one:

* Llama (``nn.Linear``, gate/up/down; 2 KV heads; also with sequence parallelism), GPT-2
  (``Conv1D``; ``n_inner = 37``) and
  Mixtral (fused experts, intermediate 37, the aux loss) at tp 2 (dp 2 x tp 2) and tp 4; Qwen3-MoE
  at tp 4 with ``moe_intermediate_size = 6`` (2 + 2 + 2 + 0: rank 3 holds no expert column) and a
  dense MLP of 37: logits, the ``labels=`` loss and every gathered gradient against the dense
  float64 model, the global gradient norm (``tpify.training.grad_norm``) against the dense one,
  the replicas identical (``check_replicas``);
* ``tpify.save_pretrained`` at tp 2 and tp 4: the parent loads the files with plain transformers
  and compares every tensor bitwise with the dense model's;
* ``tpify.from_pretrained`` at tp 2 and tp 4 from a dense save (transformers' for Llama, tpify's
  one-process save for Mixtral's fused experts): each parameter bitwise ``ShardSpec.slice_dense``
  of the dense one, the logits the dense model's;
* a DCP checkpoint (``tpify.checkpoint``) saved after 2 AdamW steps (global-norm clipping) at
  dp 2 x tp 2, resumed at tp 4 and (in the parent, one process) at tp 1, trained 2 more steps:
  the weights of the uninterrupted dense run;
* LoRA (``tpify.integrations.get_peft_model``) on q/gate/up/down at tp 2 and tp 4: every adapter
  gradient (``lora_B`` of gate/up and ``lora_A`` of down split unevenly like their base) against
  dense PEFT's.

Tolerances. Forward and gradients: :data:`tputil.F64` (``atol=1e-10, rtol=1e-9``): in float64
both sides compute the same sums in another order (the row-parallel partial products added by
the all-reduce), a few ulps (measured: at most ~1e-15, listed by ``test_measured_differences``);
a column on the wrong rank, a lost or doubled chunk gives errors of the order of the values
(1e-2 and more). Weights after AdamW steps: ``atol=1e-8, rtol=1e-6``, for the reason
tests/distributed/test_dp_tp_training.py gives (Adam's ``m / (sqrt(v) + eps)`` turns ~1e-16
gradient noise of rows with tiny gradients into up to ~1e-9). Saving and loading move bytes:
bitwise. The refusals (heads tp does not divide, interleaved gate/up pairs) are asserted without
ranks in tests/unit/test_uneven_unit.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tputil

pytestmark = pytest.mark.slow

F64 = tputil.F64
WEIGHTS = dict(atol=1e-8, rtol=1e-6)  # after AdamW steps
VOCAB = 61
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _dense_ref(model, causal=True):
    """``model`` with HF's loss in float64 and its constant tensors (unit norms, zero biases) given
    seeded noise (as tpify verify does), so that a norm or bias on the wrong rank shows."""
    from tpify.authoring.reference import float64_loss_function, perturb_constants

    model.loss_function = float64_loss_function("ForCausalLM")
    perturb_constants(model)
    return model


def llama(seed=0):
    """Llama with intermediate_size 37: 4 query heads, 2 KV heads (held by groups of 2 at tp 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return _dense_ref(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)).double())


def gpt2(seed=0):
    """GPT-2 (Conv1D, packed c_attn) with an MLP of 37 (n_inner)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return _dense_ref(GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_inner=37, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double())


def mixtral(seed=0):
    """Mixtral with fused experts of intermediate size 37 (4 experts, top 2), the aux loss on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return _dense_ref(MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.1, experts_implementation="eager")).double())


def qwen3_moe(seed=0):
    """Qwen3-MoE with expert intermediate size 6 (2, 2, 2, 0 at tp 4) and a dense MLP of 37 (layer 1)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return _dense_ref(Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, moe_intermediate_size=6, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.1,
        experts_implementation="eager")).double())


def _ids(seed=1, shape=(2, 12)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _max_diff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def _equivalent(c, name, make, tp, aux=False, split=(), **kwargs):
    """Logits, loss (and aux loss), every gradient, the gradient norm against the dense model;
    ``split``: module name suffixes that must be split unevenly (checked on the layout);
    ``kwargs``: to ``parallelize``."""
    import tpify
    from tpify.training import check_replicas, grad_norm

    ref = make()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=tp, **kwargs)
    assert bool(par.tp_info.layout.sequence_parallel) == kwargs.get("sequence_parallel", False)
    uneven = {f for f, m in par.tp_info.layout.modules.items() if m.uneven}
    for suffix in split:
        assert any(f.endswith(suffix) for f in uneven), f"{name}: no uneven module ends with {suffix}: {uneven}"
    ids = _ids()
    with torch.no_grad():
        got, want = par(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, **F64, msg=f"{name} tp {tp}: logits")
    diffs = {"logits": _max_diff(got, want)}
    out_ref = ref(ids, labels=ids)
    out_ref.loss.backward()
    out = par(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, **F64, msg=f"{name} tp {tp}: loss")
    diffs["loss"] = _max_diff(out.loss, out_ref.loss)
    if aux:
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, **F64, msg=f"{name} tp {tp}: aux loss")
    want_g, got_g = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
    assert set(got_g) == set(want_g), set(got_g) ^ set(want_g)
    for key, g in want_g.items():
        torch.testing.assert_close(got_g[key], g, **F64, msg=f"{name} tp {tp}: grad {key}")
    diffs["grads"] = max(_max_diff(got_g[k], g) for k, g in want_g.items())
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])  # tied: once
    torch.testing.assert_close(grad_norm(par), dense_norm, **F64, msg=f"{name} tp {tp}: gradient norm")
    diffs["grad_norm"] = _max_diff(grad_norm(par), dense_norm)
    check_replicas(par)
    c.diffs[f"{name} tp {tp}"] = diffs
    return par


# ------------------------------------------------------------------------------------------------
# The checks, run in one spawned job of 4 ranks (dp 2 x tp 2, then tp 4).

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


@_check
def llama_mlp_of_37_is_exact_at_tp2_and_tp4(c):
    for tp in (2, 4):
        par = _equivalent(c, "llama", llama, tp, split=("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
        sizes = [par.model.layers[0].mlp.down_proj.in_features_per_partition]
        assert sizes == [{2: (19, 18), 4: (10, 10, 10, 7)}[tp][c.rank % tp]], sizes


@_check
def llama_mlp_of_37_is_exact_under_sequence_parallelism(c):
    """The tokens split along T (12 tokens: 6 or 3 per rank) and the MLP's features unevenly:
    the two splits are independent (the MLP's all-reduce becomes a reduce-scatter of (B, T/p, H))."""
    for tp in (2, 4):
        _equivalent(c, "llama sequence parallel", llama, tp, split=("mlp.down_proj",), sequence_parallel=True)


@_check
def gpt2_conv1d_mlp_of_37_is_exact_at_tp2_and_tp4(c):
    for tp in (2, 4):
        par = _equivalent(c, "gpt2", gpt2, tp, split=("mlp.c_fc", "mlp.c_proj"))
        assert par.transformer.h[0].mlp.c_fc.weight.shape == (32, {2: (19, 18), 4: (10, 10, 10, 7)}[tp][c.rank % tp])


@_check
def mixtral_experts_of_37_are_exact_at_tp2_and_tp4(c):
    for tp in (2, 4):
        par = _equivalent(c, "mixtral", mixtral, tp, aux=True, split=("mlp.experts",))
        experts = par.model.layers[0].mlp.experts
        local = {2: (19, 18), 4: (10, 10, 10, 7)}[tp][c.rank % tp]
        assert experts.gate_up_proj.shape == (4, 2 * local, 32) and experts.down_proj.shape == (4, 32, local)


@_check
def qwen3_moe_experts_with_an_empty_rank_are_exact_at_tp4(c):
    par = _equivalent(c, "qwen3_moe", qwen3_moe, 4, aux=True, split=("mlp.experts", "mlp.down_proj"))
    local = (2, 2, 2, 0)[c.rank]
    assert par.model.layers[0].mlp.experts.down_proj.shape == (4, 32, local)


@_check
def save_pretrained_writes_the_dense_tensors(c):
    """Saved at tp 2 (Llama) and tp 4 (GPT-2, Mixtral); the parent compares the files bitwise."""
    import tpify

    for name, make, tp in (("llama", llama, 2), ("gpt2", gpt2, 4), ("mixtral", mixtral, 4)):
        tpify.save_pretrained(tpify.parallelize(make(), tp_size=tp), c.tmp / f"saved_{name}_tp{tp}")


@_check
def from_pretrained_reads_each_rank_chunk(c):
    """The dense transformers saves of the parent, read at tp 2 and 4: each parameter bitwise
    ``slice_dense`` of the dense one (the file read by chunk ranges), logits the dense model's."""
    import tpify
    from tpify.authoring.reference import use_eager_experts
    from tpify.sharding import shard_spec_of

    for name, make in (("llama", llama), ("mixtral", mixtral)):
        dense = make()
        for tp in (2, 4):
            model = tpify.from_pretrained(c.tmp / f"dense_{name}", tp_size=tp, torch_dtype=torch.float64)
            use_eager_experts(model)  # the saved config leaves grouped_mm, which refuses float64
            named = dict(dense.named_parameters())
            uneven = 0
            for key, p in model.named_parameters():
                spec = shard_spec_of(p)
                want = named[key] if spec is None else spec.slice_dense(named[key].detach(), model.tp_info.tp_rank)
                assert torch.equal(p.detach(), want), f"{name} tp {tp}: {key}"
                uneven += spec is not None and not spec.is_uniform
            assert uneven, f"{name} tp {tp}: nothing was split unevenly"
            ids = _ids()
            with torch.no_grad():
                got, want = model(ids).logits, dense(ids).logits
            torch.testing.assert_close(got, want, **F64, msg=f"{name} from_pretrained tp {tp}: logits")
            c.diffs[f"{name} from_pretrained tp {tp}"] = {"logits": _max_diff(got, want)}


def _batch(step):
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(100 + step))
    labels = ids.clone()
    labels[:, :2] = -100  # the same labelled count in every row: the mean of the DP means is the mean
    return ids, labels


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def dense_steps(model, opt, steps):
    """The dense reference's steps: the whole batch, clipping by the norm at 0.5."""
    for step in steps:
        ids, labels = _batch(step)
        model(ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def tp_steps(model, opt, steps):
    """Steps of a parallel model: each DP replica its rows, gradients averaged over DP, clipped
    by the global norm (the uneven shards' squares summed over TP)."""
    import torch.distributed as dist

    import tpify
    from tpify.training import clip_grad_norm_, sync_gradients

    info = tpify.get_tp_info(model)
    dp = dist.get_world_size(info.dp_group) if info.dp_group is not None else 1
    dp_rank = dist.get_rank(info.dp_group) if info.dp_group is not None else 0
    for step in steps:
        ids, labels = _batch(step)
        rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
        model(ids[rows], labels=labels[rows]).loss.backward()
        sync_gradients(model)
        clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()


def reference_weights():
    """The uninterrupted dense run: STEPS_BEFORE + STEPS_AFTER steps on one process."""
    ref = llama()
    opt = _optim(ref)
    dense_steps(ref, opt, range(STEPS_BEFORE + STEPS_AFTER))
    return {k: v.detach() for k, v in ref.state_dict().items()}


def resume(path, tp):
    """Llama from another seed at ``tp``, resumed from ``path``, trained on; its dense weights."""
    import tpify
    from tpify.checkpoint import load_checkpoint

    model = tpify.parallelize(llama(seed=7), tp_size=tp)
    opt = _optim(model)
    load_checkpoint(path, model, [opt])
    tp_steps(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return tpify.dense_state_dict(model)


def assert_weights(got, ref, what):
    for key, value in got.items():
        torch.testing.assert_close(value, ref[key], **WEIGHTS, msg=lambda m: f"{what}: {key}: {m}")
    return max(_max_diff(value, ref[key]) for key, value in got.items())


@_check
def dcp_checkpoint_saved_at_tp2_resumes_at_tp4(c):
    import tpify
    from tpify.checkpoint import save_checkpoint

    ref = reference_weights()
    model = tpify.parallelize(llama(), tp_size=2)
    opt = _optim(model)
    tp_steps(model, opt, range(STEPS_BEFORE))
    save_checkpoint(c.tmp / "ckpt", model, [opt])
    tp_steps(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    c.diffs["dcp uninterrupted tp 2"] = {"weights": assert_weights(tpify.dense_state_dict(model), ref,
                                                                   "uninterrupted tp 2")}
    c.diffs["dcp resumed tp 4"] = {"weights": assert_weights(resume(c.tmp / "ckpt", 4), ref, "resumed at tp 4")}


def _gathered_trainable(model, attr):
    from tpify.sharding import shard_spec_of

    group = model.tp_info.tp_group if hasattr(model, "tp_info") else model.base_model.model.tp_info.tp_group
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            value, spec = getattr(p, attr).detach(), shard_spec_of(p)
            out[name] = spec.gather(value, group) if spec is not None else value
    return out


@_check
def lora_on_uneven_layers_matches_dense_peft(c):
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]

    def lora_config():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")

    for tp in (2, 4):
        base = llama()
        torch.manual_seed(1)
        dense = peft.get_peft_model(copy.deepcopy(base), lora_config())
        torch.manual_seed(1)
        lora = get_peft_model(tpify.parallelize(copy.deepcopy(base), tp_size=tp), lora_config())
        down = lora.base_model.model.model.layers[0].mlp.down_proj
        assert down.lora_A["default"].weight.shape[1] == {2: (19, 18), 4: (10, 10, 10, 7)}[tp][c.rank % tp]
        ids = _ids(3)
        loss_d = dense(ids, labels=ids).loss
        loss_d.backward()
        loss_p = lora(ids, labels=ids).loss
        loss_p.backward()
        torch.testing.assert_close(loss_p, loss_d, **F64, msg=f"LoRA tp {tp}: loss")
        want = {n: p.grad for n, p in dense.named_parameters() if p.requires_grad}
        got = _gathered_trainable(lora, "grad")
        assert set(got) == set(want) and all("lora_" in n for n in got), set(got) ^ set(want)
        for n, g in want.items():
            torch.testing.assert_close(got[n], g, **F64, msg=f"LoRA tp {tp}: grad {n}")
        c.diffs[f"lora tp {tp}"] = {"loss": _max_diff(loss_p, loss_d),
                                    "grads": max(_max_diff(got[n], g) for n, g in want.items())}


class _Context:
    def __init__(self, rank, tmp):
        self.rank, self.tmp, self.diffs = rank, Path(tmp), {}


def _body(rank, world, tmp):
    c = _Context(rank, tmp)
    results = tputil.run_checks(_CHECKS, c)
    return {"results": results, "diffs": c.diffs}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uneven")
    import tpify

    llama().save_pretrained(tmp / "dense_llama")
    # transformers 5 saves Mixtral's experts in the legacy per-expert layout, which tpify does not
    # read; tpify's own dense save (one process) keeps the fused tensors
    tpify.save_pretrained(tpify.parallelize(mixtral(), tp_size=1), tmp / "dense_mixtral")
    return tmp, tputil.spawn(_body, 4, str(tmp), timeout=600)


@pytest.mark.parametrize("name", list(_CHECKS))
def test_uneven_splits(job, name):
    _, results = job
    tputil.assert_checks_ok([r["results"] for r in results], name)


def test_saved_files_load_in_plain_transformers_bitwise(job):
    from transformers import AutoModelForCausalLM

    tmp, results = job
    tputil.assert_checks_ok([r["results"] for r in results], "save_pretrained_writes_the_dense_tensors")
    for name, make, tp in (("llama", llama, 2), ("gpt2", gpt2, 4), ("mixtral", mixtral, 4)):
        loaded = AutoModelForCausalLM.from_pretrained(tmp / f"saved_{name}_tp{tp}", dtype=torch.float64).state_dict()
        dense = make().state_dict()
        assert json.loads((tmp / f"saved_{name}_tp{tp}" / "config.json").read_text())["model_type"] == name
        for key, value in dense.items():
            assert torch.equal(loaded[key], value), f"{name} saved at tp {tp}: {key}"


def test_dcp_checkpoint_saved_at_tp2_resumes_at_tp1_in_one_process(job):
    tmp, results = job
    tputil.assert_checks_ok([r["results"] for r in results], "dcp_checkpoint_saved_at_tp2_resumes_at_tp4")
    diff = assert_weights(resume(tmp / "ckpt", 1), reference_weights(), "resumed at tp 1, one process")
    print(f"dcp resumed tp 1 (one process): weights {diff:.1e}")


def test_measured_differences(job):
    """The largest |difference| against the dense model per check, printed (pytest -s) for the docs."""
    _, results = job
    merged = {}
    for r in results:
        for key, diffs in r["diffs"].items():
            for what, value in diffs.items():
                merged.setdefault(key, {})[what] = max(merged.get(key, {}).get(what, 0.0), value)
    for key, diffs in sorted(merged.items()):
        print(f"{key}: " + ", ".join(f"{w} {v:.1e}" for w, v in diffs.items()))
    assert merged and all(v < 1e-9 for d in merged.values() for w, v in d.items() if w != "weights")
