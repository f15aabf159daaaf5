"""The dtypes tensor parallelism's gradient and output reductions run in, against dense references
under the same precision (tp = 2, one spawned job of 2 gloo ranks, ``tputil.run_checks``).

What is reduced in which dtype is read from :func:`tpify.comm.count_collectives` with
``by_dtype=True`` (elements per dtype they travel in), for a tiny Llama (hidden 32, 2 layers, an
untied head; ``B*T = 2*12`` tokens; the K/V heads are not replicated at tp 2, so a step's
backward all-reduces are exactly the shared column-parallel entries: attention's and the MLP's
per layer and the head's, ``5 * B*T*H`` values):

* bf16 autocast over float32 weights: the input-gradient all-reduces in bfloat16 (Megatron-LM's
  dtype: the matmul's), with the overlapped entries and with the plain ``copy_to_tp_region`` path
  (``overlap_grad_reduce=False``, the one ``torch.compile`` takes); ``grad_reduce_dtype=torch.float32``
  reduces them in float32; a float64 model with that floor stays float64 and exact; a bad value
  raises. The chunked loss (``lm_loss_chunk``) reduces its hidden states' gradient in bfloat16 too.
* PEFT LoRA on a bfloat16 base with PEFT's float32 adapters (no autocast): the row bases' partial
  outputs summed in bfloat16 and the adapters' ``h = A x`` in float32 (two collectives), the
  column bases' ``dX`` in bfloat16 and ``dh`` in float32; under autocast over a float32 base,
  everything in bfloat16, one collective per adapted layer.
* On the CPU an overlapped step never looks at ``CUDA_DEVICE_MAX_CONNECTIONS`` (no warning, the
  context's check not even marked).

Tolerances. The dense references run under the same autocast (or in the same bfloat16), so every
matmul sees the same bfloat16 operands; tensor parallelism then adds the rounding of each rank's
partial product and of their sum (dense: one rounding of the whole sum), a few bfloat16 ulps
(2^-8 = 3.9e-3 relative) per reduced value, which the backward carries through the layers. Loss
and gradients are compared norm-wise, ``||tp - dense|| <= tol * ||dense||``: ``tol`` 2e-2 for the
model under autocast (measured at most 8.7e-3), 1e-1 with LoRA (measured 5.6e-2: the query
adapters' gradients pass through the backward of a bfloat16 attention softmax, which loses most
digits on a model this small). Each run is repeated with ``grad_reduce_dtype=torch.float32``: the
bfloat16 reductions' worst error must stay within 1.5x of that run's (measured: 7.7e-3 against
7.5e-3, LoRA 5.0e-2 against 5.4e-2 and 5.6e-2 against 5.6e-2), so what the tolerance absorbs is
bfloat16 compute, not the reductions. float64: ``tputil.F64``. Slow: one spawn of about 20 s.
"""

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch

import tputil
from test_llama import llama_config

pytestmark = pytest.mark.slow

WORLD = 2
B, T, H = 2, 12, 32
BTH = B * T * H
LAYERS = 2
AUTOCAST_TOL = 2e-2  # module doc
BF16_TOL = 1e-1

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _llama(dtype=torch.float32):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(tie=False)).to(dtype)


def _ids():
    return torch.randint(3, 101, (B, T), generator=torch.Generator().manual_seed(1))


def _close(got, want, tol, what):
    err, scale = float((got.double() - want.double()).norm()), float(want.double().norm())
    assert err <= tol * scale, f"{what}: ||diff|| = {err:.3g} > {tol:g} * {scale:.3g}"
    return err / max(scale, 1e-30)


def _step(model, ids, autocast: bool):
    """(loss, forward counts, backward counts) of one ``labels=`` step, counted by dtype."""
    import tpify

    with tpify.comm.count_collectives(by_dtype=True) as fwd:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
    with tpify.comm.count_collectives(by_dtype=True) as bwd:
        loss.backward()
    return loss, fwd, bwd


def _compare(par, ref, ids, autocast: bool, tol: float, what: str) -> tuple:
    """One step of both; loss and every gathered gradient norm-wise within ``tol``; the counts."""
    loss_ref = _step(ref, ids, autocast)[0]
    loss, fwd, bwd = _step(par, ids, autocast)
    worst = _close(loss, loss_ref, tol, f"{what}: loss")
    want, got = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
    assert set(got) == set(want), set(got) ^ set(want)
    worst_name = "loss"
    for name, g in want.items():
        if g is None:  # frozen (LoRA's base)
            assert got[name] is None, f"{what}: {name} got a gradient"
            continue
        err = _close(got[name], g, tol, f"{what}: grad {name}")
        worst, worst_name = max((worst, worst_name), (err, name))
    par.zero_grad()
    ref.zero_grad()
    return fwd, bwd, (worst, worst_name)


def _no_worse(worst, floor32, what):
    """The bfloat16 reductions' worst error is not above 1.5x that of float32 reductions of the same run."""
    assert worst[0] <= 1.5 * floor32[0], f"{what}: bfloat16 reductions {worst} vs float32 reductions {floor32}"
    return f"{worst[0]:.2e} ({worst[1]}); float32 reductions {floor32[0]:.2e}"


def _overlap_off(model):
    import tpify

    for m in model.modules():
        if isinstance(m, tpify.layers.ColumnParallelLinear):
            m.overlap_grad_reduce = False


@_check
def autocast_input_gradients_are_all_reduced_in_bfloat16(c):
    import tpify

    ref = _llama()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD)
    par32 = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, grad_reduce_dtype=torch.float32)
    _, bwd, worst = _compare(par, ref, _ids(), True, AUTOCAST_TOL, "autocast")
    _, bwd32, worst32 = _compare(par32, ref, _ids(), True, AUTOCAST_TOL, "autocast, grad_reduce_dtype=float32")
    # attention's and the MLP's entries per layer, the head's: all in bfloat16, none in float32 (the option: float32)
    assert bwd["all_reduce"] == bwd32["all_reduce"] == 2 * LAYERS + 1, dict(bwd)
    assert bwd["all_reduce_numel:bfloat16"] == (2 * LAYERS + 1) * BTH and bwd["all_reduce_numel:float32"] == 0, \
        dict(bwd)
    assert bwd32["all_reduce_numel:float32"] == (2 * LAYERS + 1) * BTH and bwd32["all_reduce_numel:bfloat16"] == 0, \
        dict(bwd32)
    print(f"measured rank {c.rank}: autocast tp=2 vs dense autocast, worst relative norm "
          f"{_no_worse(worst, worst32, 'autocast')}", flush=True)

    # the plain region operator (overlap off; what torch.compile runs): one all-reduce per layer, same dtypes
    _overlap_off(par), _overlap_off(par32)
    _, bwd, worst = _compare(par, ref, _ids(), True, AUTOCAST_TOL, "autocast, copy_to_tp_region")
    _, bwd32, worst32 = _compare(par32, ref, _ids(), True, AUTOCAST_TOL, "autocast, float32, copy_to_tp_region")
    assert bwd["all_reduce"] == 5 * LAYERS + 1, dict(bwd)  # q, k, v, gate, up, and the head
    assert bwd["all_reduce_numel:bfloat16"] == (5 * LAYERS + 1) * BTH and bwd["all_reduce_numel:float32"] == 0, \
        dict(bwd)
    assert bwd32["all_reduce_numel:float32"] == (5 * LAYERS + 1) * BTH and bwd32["all_reduce_numel:bfloat16"] == 0, \
        dict(bwd32)
    _no_worse(worst, worst32, "autocast, copy_to_tp_region")


@_check
def a_float64_model_stays_float64_under_a_float32_floor_and_bad_floors_raise(c):
    import tpify

    ref64 = _llama(torch.float64)
    ref64.loss_function = tputil.float64_loss_function(causal=True)  # HF's upcasts to float32 only
    par64 = tpify.parallelize(copy.deepcopy(ref64), tp_size=WORLD, grad_reduce_dtype=torch.float32)
    with tpify.comm.count_collectives(by_dtype=True) as counted:
        tputil.assert_lm_matches_dense(par64, ref64, _ids(), "float64 with a float32 floor")
    assert counted["all_reduce_numel:float32"] == 0, dict(counted)
    for bad in ("float32", torch.int64):
        with pytest.raises(ValueError, match="grad_reduce_dtype must be None .* or a floating torch.dtype"):
            tpify.parallelize(copy.deepcopy(ref64), tp_size=WORLD, grad_reduce_dtype=bad)


@_check
def chunked_loss_reduces_the_hidden_states_gradient_in_bfloat16(c):
    import tpify

    ref = _llama()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, lm_loss_chunk=8)
    _, bwd, worst = _compare(par, ref, _ids(), True, AUTOCAST_TOL, "autocast, chunked loss")
    assert bwd["all_reduce"] == 2 * LAYERS + 1, dict(bwd)  # the head's entry is the chunked loss's copy
    assert bwd["all_reduce_numel:bfloat16"] == (2 * LAYERS + 1) * BTH and bwd["all_reduce_numel:float32"] == 0, \
        dict(bwd)
    print(f"measured rank {c.rank}: autocast tp=2 chunked loss vs dense autocast, worst relative norm "
          f"{worst[0]:.2e} ({worst[1]})", flush=True)


def _lora(dense_base, par_base, autocast_adapter_dtype=True):
    import peft

    from tpify.integrations import get_peft_model

    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    torch.manual_seed(1)
    dense = peft.get_peft_model(dense_base, copy.deepcopy(config), autocast_adapter_dtype=autocast_adapter_dtype)
    torch.manual_seed(1)
    lora = get_peft_model(par_base, copy.deepcopy(config), autocast_adapter_dtype=autocast_adapter_dtype)
    with torch.no_grad():  # B starts at zero: make the adapters matter, the same on both sides
        for (name, p), (name2, q) in zip(sorted(dense.named_parameters()), sorted(lora.named_parameters())):
            if "lora_B" in name:
                assert name == name2, (name, name2)
                full = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype) * 0.1
                p.copy_(full)
                spec = _spec(q)
                q.copy_(spec.slice_dense(full, lora.tp_info.tp_rank) if spec is not None else full)
    return dense, lora


def _spec(p):
    from tpify.sharding import shard_spec_of

    return shard_spec_of(p)


def _lora_pair(dtype, autocast, what, tol):
    """Dense PEFT and tpify LoRA (the same adapters) on the Llama in ``dtype``, tpify's with
    bfloat16-or-matmul-dtype reductions and with float32 ones: (forward counts, backward counts,
    the worst error, that of the float32 reductions)."""
    import tpify

    ref = _llama(dtype)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD)
    par32 = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, grad_reduce_dtype=torch.float32)
    _, lora32 = _lora(copy.deepcopy(ref), par32)
    dense, lora = _lora(ref, par)
    assert {p.dtype for n, p in lora.named_parameters() if "lora_" in n} == {torch.float32}, "PEFT's fp32 adapters"
    fwd, bwd, worst = _compare(lora, dense, _ids(), autocast, tol, what)
    _, _, worst32 = _compare(lora32, dense, _ids(), autocast, tol, what + ", grad_reduce_dtype=float32")
    return fwd, bwd, _no_worse(worst, worst32, what)


@_check
def lora_on_a_bfloat16_base_sums_the_base_in_bfloat16_and_float32_adapters_in_float32(c):
    fwd, bwd, worst = _lora_pair(torch.bfloat16, False, "bf16 base, fp32 LoRA", BF16_TOL)
    r, bt = 4, B * T
    # forward: the batch check (int64), the embedding's and each row base's partial output (o_proj, down_proj)
    # in bfloat16, the row adapters' h in float32 (a second collective each), the loss's statistics in float32
    assert fwd["all_reduce"] == 1 + 1 + 2 * 2 * LAYERS + 2, dict(fwd)
    assert fwd["all_reduce_numel:bfloat16"] == (1 + 2 * LAYERS) * BTH, dict(fwd)
    assert fwd["all_reduce_numel:float32"] == 2 * LAYERS * bt * r + (bt + 5) + 2 * bt, dict(fwd)
    # backward: each column base's dX in bfloat16 and its adapter's dh in float32, the head's entry in bfloat16;
    # layer 0's attention input takes no gradient (the embedding is frozen): its q, k, v reduce dh alone
    assert bwd["all_reduce"] == 5 * LAYERS + (5 * LAYERS - 3) + 1, dict(bwd)
    assert bwd["all_reduce_numel:bfloat16"] == (5 * LAYERS - 3 + 1) * BTH, dict(bwd)
    assert bwd["all_reduce_numel:float32"] == 5 * LAYERS * bt * r, dict(bwd)
    print(f"measured rank {c.rank}: bf16 base + fp32 LoRA tp=2 vs dense PEFT, worst relative norm {worst}",
          flush=True)


@_check
def lora_under_autocast_reduces_everything_in_bfloat16_one_collective_per_layer(c):
    fwd, bwd, worst = _lora_pair(torch.float32, True, "autocast LoRA", BF16_TOL)
    r, bt = 4, B * T
    # forward: the batch check, the embedding (float32: autocast leaves lookups alone), each row base's output
    # with its adapter's h in one bfloat16 collective, the loss's statistics
    assert fwd["all_reduce"] == 1 + 1 + 2 * LAYERS + 2, dict(fwd)
    assert fwd["all_reduce_numel:bfloat16"] == 2 * LAYERS * (BTH + bt * r), dict(fwd)
    assert fwd["all_reduce_numel:float32"] == BTH + (bt + 5) + 2 * bt, dict(fwd)
    # backward: each column base's dX (none for layer 0's attention) with its adapter's dh, one bfloat16 collective
    assert bwd["all_reduce"] == 5 * LAYERS + 1, dict(bwd)
    assert bwd["all_reduce_numel:bfloat16"] == (5 * LAYERS - 3 + 1) * BTH + 5 * LAYERS * bt * r, dict(bwd)
    assert bwd["all_reduce_numel:float32"] == 0, dict(bwd)
    print(f"measured rank {c.rank}: autocast LoRA tp=2 vs dense PEFT autocast, worst relative norm {worst}",
          flush=True)


@_check
def an_overlapped_step_on_the_cpu_never_looks_at_cuda_device_max_connections(c):
    import os

    import tpify

    saved = os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    try:
        par = tpify.parallelize(_llama(), tp_size=WORLD)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            par(_ids(), labels=_ids()).loss.backward()
        assert not [w for w in caught if "CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message)], caught
        assert not par.model.layers[0].self_attn.q_proj.ctx.overlap_checked, "a CPU step checks nothing"
    finally:
        if saved is not None:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved


# ---- the job ---------------------------------------------------------------------------------

def _body(rank, world):
    return tputil.run_checks(_CHECKS, SimpleNamespace(rank=rank, world=world))


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, WORLD, timeout=300)


_ok = tputil.assert_checks_ok


def test_autocast_input_gradients_all_reduced_in_bfloat16_overlapped_or_not_float32_on_request(tp2):
    _ok(tp2, "autocast_input_gradients_are_all_reduced_in_bfloat16")


def test_a_float64_model_stays_float64_under_a_float32_floor_and_bad_floors_raise(tp2):
    _ok(tp2, "a_float64_model_stays_float64_under_a_float32_floor_and_bad_floors_raise")


def test_chunked_loss_reduces_the_hidden_states_gradient_in_bfloat16(tp2):
    _ok(tp2, "chunked_loss_reduces_the_hidden_states_gradient_in_bfloat16")


def test_lora_bfloat16_base_in_bfloat16_float32_adapters_in_float32(tp2):
    _ok(tp2, "lora_on_a_bfloat16_base_sums_the_base_in_bfloat16_and_float32_adapters_in_float32")


def test_lora_under_autocast_reduces_in_bfloat16_one_collective_per_layer(tp2):
    _ok(tp2, "lora_under_autocast_reduces_everything_in_bfloat16_one_collective_per_layer")


def test_an_overlapped_cpu_step_never_looks_at_cuda_device_max_connections(tp2):
    _ok(tp2, "an_overlapped_step_on_the_cpu_never_looks_at_cuda_device_max_connections")
