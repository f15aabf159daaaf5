"""The vocab-parallel log-probs, entropy, KL, top-1 and the chunked linear cross-entropy, and the
chunked LM-head loss (``parallelize(..., lm_loss_chunk=c)``), against single-process dense
references, at tp = 2.

One spawned job of 2 gloo ranks runs every check of ``_CHECKS`` (``tputil.run_checks``); each
test asserts its checks' outcomes. Every check builds its dense float64 reference from one seed
on every rank and compares values and every gradient:

* functions on a logits shard (a vocabulary of 37, padded to 38, and of 40): ``log_softmax`` +
  ``gather``, the entropy ``-sum p log p``, ``KL(p || q)`` (both inputs' gradients, and a frozen
  reference), ``argmax == target`` with ties across the ranks' boundary; each counted (2
  all-reduces, 1 for top-1);
* the chunked linear cross-entropy from hidden states and the head's weight and bias shards,
  for every reduction, ``ignore_index``, label smoothing and softcapping, with 2 all-reduces per
  chunk and 1 in backward (the hidden states' gradient); bfloat16 against the unchunked head and
  loss in bfloat16; differing targets raise on both ranks;
* ``lm_loss_chunk`` on a tiny Llama (untied head) and GPT-2 (tied head, Conv1D blocks): loss and
  every gradient equal the dense model's, ``.logits`` is None, calls without labels unchanged;
  Gemma 2's logit softcapping (``[loss] logits``) in both the plain and the chunked path; a model
  that post-processes its logits by what the recipe does not declare is refused on both paths;
  LoRA on the LM head works with the plain path and is refused with the chunked one; PEFT's
  ``modules_to_save`` copy of the head is the one the chunked loss reads.

Tolerances (float64): ``atol=1e-12, rtol=1e-10`` for the functions (only the summation order
differs, ~1e-16 relative), ``atol=1e-10, rtol=1e-9`` for whole models (as test_loss.py). bfloat16
chunked against unchunked: the chunk's logits are the same bf16 matmul, the softmax runs in
float32 on both sides, so the loss agrees to 1e-6; the gradients differ where a sum is split
(the weight gradient accumulates chunk by chunk in float32, the unchunked one is one bf16 matmul
rounded once), so they are compared at one bf16 rounding (``rtol=1.6e-2``, ``atol=1e-3``).
Slow: one spawn of about 25 s.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tputil

pytestmark = pytest.mark.slow

F64 = dict(atol=1e-12, rtol=1e-10)
MODEL = dict(atol=1e-10, rtol=1e-9)
WORLD = 2

LLAMA_RULES = [
    {"match": "embed_tokens", "style": "embedding_rowwise"},
    {"match": ["layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj",
               "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"], "style": "colwise"},
    {"match": ["layers.*.self_attn.o_proj", "layers.*.mlp.down_proj"], "style": "rowwise"},
    {"match": "lm_head", "style": "colwise_rep"},
]
GEMMA2_RECIPE = {  # gemma.toml's rules; Gemma 2 scales its embedding and softcaps its logits
    "model_type": "gemma2", "divisible": ["num_attention_heads", "num_key_value_heads"],
    "subclasses": {"Gemma2TextScaledWordEmbedding": {"forward": "scaled", "scale": "embed_scale"}},
    "loss": {"causal": ["Gemma2ForCausalLM"], "logits": [{"softcap": "final_logit_softcapping"}]},
    "rule": LLAMA_RULES,
}

_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


def _shard(full, rank, dim=-1):
    """This rank's slice of ``full`` along ``dim``, padded with zeros to a multiple of WORLD."""
    full = full.movedim(dim, -1)
    pad = -(-full.shape[-1] // WORLD) * WORLD - full.shape[-1]
    return F.pad(full, (0, pad)).chunk(WORLD, dim=-1)[rank].movedim(-1, dim).clone()


def _case(seed, V, shape=(2, 6)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, V, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, V, shape, generator=g)
    target[1, ::2] = -100
    weights = torch.rand(shape, generator=g, dtype=torch.float64)  # a per-token upstream gradient
    return logits, target, weights


# ---- functions on a logits shard ------------------------------------------------------------

def _shard_equals_dense(c, fn, full, ref_in, ref, w, all_reduce_numel):
    """``fn`` on this rank's shard of ``full`` against the dense ``ref`` (already backpropagated
    with the per-token weights ``w`` into ``ref_in``): the value, the shard's gradient, and 2
    all-reduces of ``all_reduce_numel`` values."""
    from tpify.comm import count_collectives

    local = _shard(full, c.rank).requires_grad_()
    with count_collectives() as counts:
        out = fn(local)
    (out * w).sum().backward()
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(local.grad, _shard(ref_in.grad, c.rank), **F64)
    assert dict(counts) == {"all_reduce": 2, "all_reduce_numel": all_reduce_numel}, dict(counts)


@_check
def log_probs_equal_dense_log_softmax_gather(c):
    from tpify.loss import vocab_parallel_log_probs

    for V in (37, 40):
        full, target, w = _case(1, V)
        for temperature in (1.0, 0.7):
            ref_in = full.clone().requires_grad_()
            ref = F.log_softmax(ref_in / temperature, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            ref = ref.masked_fill(target == -100, 0.0)
            (ref * w).sum().backward()
            _shard_equals_dense(c, lambda local: vocab_parallel_log_probs(local, target, vocab_size=V,
                                                                          temperature=temperature),
                                full, ref_in, ref, w, (12 + 5) + 2 * 12)


@_check
def entropy_equals_dense_minus_sum_p_log_p(c):
    from tpify.loss import vocab_parallel_entropy

    for V in (37, 40):
        full, _, w = _case(2, V)
        ref_in = full.clone().requires_grad_()
        log_p = F.log_softmax(ref_in / 0.7, -1)
        ref = -(log_p.exp() * log_p).sum(-1)
        (ref * w).sum().backward()
        _shard_equals_dense(c, lambda local: vocab_parallel_entropy(local, vocab_size=V, temperature=0.7),
                            full, ref_in, ref, w, (12 + 2) + 2 * 12)


@_check
def kl_equals_dense_kl_div_with_both_gradients_and_a_frozen_reference(c):
    from tpify.comm import count_collectives
    from tpify.loss import vocab_parallel_kl

    for V in (37, 40):
        full_p, _, w = _case(3, V)
        full_q, _, _ = _case(4, V)
        ref_p, ref_q = full_p.clone().requires_grad_(), full_q.clone().requires_grad_()
        log_p, log_q = F.log_softmax(ref_p, -1), F.log_softmax(ref_q, -1)
        ref = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # KL(p || q)
        (ref * w).sum().backward()
        p, q = _shard(full_p, c.rank).requires_grad_(), _shard(full_q, c.rank).requires_grad_()
        with count_collectives() as counts:
            out = vocab_parallel_kl(p, q, vocab_size=V)
        (out * w).sum().backward()
        torch.testing.assert_close(out, ref, **F64)
        torch.testing.assert_close(p.grad, _shard(ref_p.grad, c.rank), **F64)
        torch.testing.assert_close(q.grad, _shard(ref_q.grad, c.rank), **F64)
        assert dict(counts) == {"all_reduce": 2, "all_reduce_numel": (2 * 12 + 2) + 3 * 12}, dict(counts)
        frozen = _shard(full_p, c.rank).requires_grad_()
        (vocab_parallel_kl(frozen, _shard(full_q, c.rank), vocab_size=V) * w).sum().backward()
        torch.testing.assert_close(frozen.grad, p.grad, **F64)


@_check
def is_top1_equals_argmax_with_ties_across_the_ranks(c):
    from tpify.comm import count_collectives
    from tpify.loss import vocab_parallel_is_top1

    V = 37  # rank 0 holds columns 0..18, rank 1 holds 19..36 (and the padded 37)
    full, target, _ = _case(5, V)
    top = full.amax(-1) + 1
    full[0, 0, 3] = full[0, 0, 30] = top[0, 0]  # a tie across ranks: argmax is 3
    target[0, 0] = 30
    full[0, 1, 20] = full[0, 1, 25] = top[0, 1]  # a tie on rank 1: argmax is 20
    target[0, 1] = 20
    target[0, 2] = int(full[0, 2].argmax())
    target[0, 3] = 36
    full[0, 3, 36] = top[0, 3]
    ref = (full.argmax(-1) == target) & (target != -100)
    with count_collectives() as counts:
        out = vocab_parallel_is_top1(_shard(full, c.rank), target, vocab_size=V)
    assert torch.equal(out, ref), (out, ref)
    assert ref[0, 1] and ref[0, 2] and ref[0, 3] and not ref[0, 0]
    assert dict(counts) == {"all_reduce": 1, "all_reduce_numel": 3 * 12 + 5}, dict(counts)


# ---- the chunked linear cross-entropy -------------------------------------------------------

@_check
def linear_cross_entropy_equals_dense_for_every_reduction_smoothing_and_softcap(c):
    from tpify.comm import count_collectives
    from tpify.loss import vocab_parallel_linear_cross_entropy

    H, V = 8, 37
    g = torch.Generator().manual_seed(6)
    _, target, _ = _case(7, V)
    for reduction in ("none", "sum", "mean"):
        for eps in (0.0, 0.15):
            for cap in (None, 2.0):
                x = torch.randn(2, 6, H, generator=g, dtype=torch.float64)
                weight = torch.randn(V, H, generator=g, dtype=torch.float64)
                bias = torch.randn(V, generator=g, dtype=torch.float64)
                rx, rw, rb = (t.clone().requires_grad_() for t in (x, weight, bias))
                logits = F.linear(rx, rw, rb)
                logits = cap * torch.tanh(logits / cap) if cap else logits
                ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), label_smoothing=eps,
                                      reduction=reduction)
                ref = ref.view(2, 6) if reduction == "none" else ref
                w = torch.rand(ref.shape, generator=g, dtype=torch.float64)
                (ref * w).sum().backward()
                lx, lw, lb = x.clone().requires_grad_(), _shard(weight, c.rank, 0).requires_grad_(), \
                    _shard(bias, c.rank).requires_grad_()
                with count_collectives() as fwd:
                    out = vocab_parallel_linear_cross_entropy(lx, lw, target, bias=lb, label_smoothing=eps,
                                                              reduction=reduction, vocab_size=V, chunk_size=5,
                                                              softcap=cap)
                with count_collectives() as bwd:
                    (out * w).sum().backward()
                case = f"{reduction} eps={eps} softcap={cap}"
                torch.testing.assert_close(out, ref, **F64, msg=lambda m: f"{case}: {m}")
                torch.testing.assert_close(lx.grad, rx.grad, **F64, msg=lambda m: f"{case} hidden: {m}")
                torch.testing.assert_close(lw.grad, _shard(rw.grad, c.rank, 0), **F64, msg=lambda m: f"{case} W: {m}")
                torch.testing.assert_close(lb.grad, _shard(rb.grad, c.rank), **F64, msg=lambda m: f"{case} b: {m}")
                # 12 tokens in chunks of 5: 3 chunks, 2 all-reduces each (max + 5 checks once; sums),
                # the values of the unchunked loss; backward: the hidden states' gradient only
                sums = 3 if eps > 0 else 2
                assert dict(fwd) == {"all_reduce": 6, "all_reduce_numel": 12 + 5 + sums * 12}, (case, dict(fwd))
                assert dict(bwd) == {"all_reduce": 1, "all_reduce_numel": 12 * H}, (case, dict(bwd))


@_check
def linear_cross_entropy_in_bf16_equals_the_unchunked_head_and_loss(c):
    from tpify import vocab_parallel_cross_entropy
    from tpify.comm import copy_to_tp_region
    from tpify.loss import vocab_parallel_linear_cross_entropy

    g = torch.Generator().manual_seed(8)
    H, V = 16, 40
    x = torch.randn(4, 8, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) * 0.5).bfloat16()
    target = torch.randint(0, V, (4, 8), generator=g)
    ref_x, ref_w = x.clone().requires_grad_(), _shard(weight, c.rank, 0).requires_grad_()
    head_input = copy_to_tp_region(ref_x, None)  # as a ColumnParallelLinear head's input: dX summed in backward
    ref = vocab_parallel_cross_entropy(F.linear(head_input, ref_w), target, vocab_size=V)  # the head, then the loss
    ref.backward()
    lx, lw = x.clone().requires_grad_(), _shard(weight, c.rank, 0).requires_grad_()
    out = vocab_parallel_linear_cross_entropy(lx, lw, target, vocab_size=V, chunk_size=7)
    out.backward()
    assert lx.grad.dtype == lw.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lx.grad, ref_x.grad, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(lw.grad, ref_w.grad, rtol=1.6e-2, atol=1e-3)


@_check
def differing_targets_raise_on_every_rank_for_every_function(c):
    from tpify.loss import vocab_parallel_is_top1, vocab_parallel_linear_cross_entropy, vocab_parallel_log_probs

    full, target, _ = _case(9, 40)
    target = target.clone()
    target[0, 0] = c.rank  # the ranks disagree on one target
    local = _shard(full, c.rank)
    calls = {"log_probs": lambda: vocab_parallel_log_probs(local, target),
             "is_top1": lambda: vocab_parallel_is_top1(local, target),
             "linear": lambda: vocab_parallel_linear_cross_entropy(torch.ones(2, 6, 4, dtype=torch.float64),
                                                                   torch.ones(20, 4, dtype=torch.float64), target,
                                                                   chunk_size=5)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="the ranks of the TP group hold different targets"):
            call()


# ---- the chunked LM-head loss in a model ----------------------------------------------------

def _models():
    from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    return {
        "llama": (LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                num_key_value_heads=2, intermediate_size=64, vocab_size=999,
                                                max_position_embeddings=64, tie_word_embeddings=False),
                  {"model_type": "llama", "rule": LLAMA_RULES}),
        "gpt2": (GPT2LMHeadModel, GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=1001,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), None),
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                                   vocab_size=999, max_position_embeddings=64,
                                                   final_logit_softcapping=1.5), GEMMA2_RECIPE),
    }


def _dense(name):
    cls, config, recipe = _models()[name]
    torch.manual_seed(0)
    model = cls(config).double()
    if name == "gemma2":
        with torch.no_grad():
            model.lm_head.weight.mul_(30)  # logits far beyond the cap: softcapping changes the loss
    return model, recipe


def _batch(vocab):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _check_lm_loss(name, chunk):
    import tpify

    ref, recipe = _dense(name)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, recipe=recipe, lm_loss_chunk=chunk)
    ids, labels = _batch(ref.config.vocab_size)
    num_items = torch.tensor(7)
    logits = ref(ids).logits
    loss_ref = tputil.ref_lm_loss(logits, labels, True, num_items)
    with tpify.comm.count_collectives() as counts:
        out = par(ids, labels=labels, num_items_in_batch=num_items)
        out.loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(out.loss, loss_ref, **MODEL)
    ref_grads, par_grads = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
    for fqn, grad in ref_grads.items():
        torch.testing.assert_close(par_grads[fqn], grad, **MODEL, msg=lambda m: f"{name} chunk={chunk} {fqn}: {m}")
    assert (out.logits is None) == (chunk is not None), "chunked: no logits exist"
    assert counts["all_gather"] == 0, dict(counts)
    torch.testing.assert_close(par(ids).logits, logits.detach(), **MODEL)  # without labels: unchanged
    return counts, logits


@_check
def lm_loss_chunk_llama_and_gpt2_loss_and_every_gradient_equal_dense(c):
    for name in ("llama", "gpt2"):
        plain, _ = _check_lm_loss(name, None)
        chunked, _ = _check_lm_loss(name, 7)
        # 24 positions in chunks of 7: 4 chunks, 2 all-reduces each instead of the loss's 2, same values
        assert chunked["all_reduce"] == plain["all_reduce"] + 6, (dict(plain), dict(chunked))
        assert chunked["all_reduce_numel"] == plain["all_reduce_numel"], (dict(plain), dict(chunked))
    auto, _ = _check_lm_loss("llama", "auto")  # default_chunk_size: 24 tokens < 256, one chunk
    assert auto["all_reduce"] == plain["all_reduce"], (dict(plain), dict(auto))


@_check
def gemma2_softcapped_loss_equals_dense_on_the_plain_and_the_chunked_path(c):
    _, logits = _check_lm_loss("gemma2", None)
    _check_lm_loss("gemma2", 5)
    assert logits.abs().max() > 1.4, "the logits reach the cap (1.5): softcapping is exercised"


@_check
def undeclared_logit_post_processing_is_refused_on_both_paths(c):
    import tpify
    from tpify import TPUsageError

    ref, _ = _dense("gemma2")
    ids, labels = _batch(ref.config.vocab_size)
    undeclared = {**GEMMA2_RECIPE, "loss": {"causal": ["Gemma2ForCausalLM"]}}
    misdeclared = {**GEMMA2_RECIPE, "loss": {"causal": ["Gemma2ForCausalLM"],
                                             "logits": [{"multiply": "final_logit_softcapping"}]}}
    for recipe, chunk in ((undeclared, None), (undeclared, 5), (misdeclared, 5)):
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, recipe=recipe, lm_loss_chunk=chunk)
        with pytest.raises(TPUsageError, match="returns logits that are not its LM head's output"):
            par(ids, labels=labels)
        assert par(ids).logits.shape[-1] == ref.config.vocab_size, "the next call runs as usual"
    for bad in (0, -3, 2.5, True):
        with pytest.raises(tpify.PlanError, match="lm_loss_chunk must be a positive number"):
            tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, recipe=GEMMA2_RECIPE, lm_loss_chunk=bad)
    from transformers import LlamaModel

    with pytest.raises(tpify.PlanError, match="has no vocab-parallel LM loss"):
        tpify.parallelize(LlamaModel(_models()["llama"][1]), tp_size=WORLD, recipe=_models()["llama"][2],
                          lm_loss_chunk=4)


@_check
def lora_on_the_head_runs_plain_and_is_refused_chunked_and_modules_to_save_is_read(c):
    import peft

    import tpify
    from tpify import TPUsageError
    from tpify.integrations import get_peft_model

    ref, recipe = _dense("llama")
    ids, labels = _batch(ref.config.vocab_size)
    lora = dict(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights="gaussian")
    saved = dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
                 init_lora_weights="gaussian")
    for config, chunk in ((lora, None), (lora, 5), (saved, 5)):
        torch.manual_seed(1)
        dense = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(**config))
        par = tpify.parallelize(copy.deepcopy(ref), tp_size=WORLD, recipe=recipe, lm_loss_chunk=chunk)
        torch.manual_seed(1)
        par = get_peft_model(par, peft.LoraConfig(**config))
        if config is lora and chunk is not None:
            with pytest.raises(TPUsageError, match="lm_loss_chunk: the LM head is wrapped by LoraTPLinear"):
                par(ids, labels=labels)
            continue
        if config is saved:  # the trainable copy differs from the original: the loss must read the copy
            head = dense.base_model.model.lm_head.modules_to_save["default"]
            shard = par.base_model.model.lm_head.modules_to_save["default"]
            with torch.no_grad():
                head.weight.add_(0.25)
                shard.weight.add_(0.25)
        loss = par(ids, labels=labels).loss
        torch.testing.assert_close(loss, tputil.ref_lm_loss(dense(ids).logits, labels, True), **MODEL)


# ---- the job ---------------------------------------------------------------------------------

def _body(rank, world):
    return tputil.run_checks(_CHECKS, SimpleNamespace(rank=rank, world=world))


@pytest.fixture(scope="module")
def tp2():
    return tputil.spawn(_body, WORLD, timeout=300)


_ok = tputil.assert_checks_ok


def test_log_probs_equal_dense_log_softmax_gather_with_two_all_reduces(tp2):
    _ok(tp2, "log_probs_equal_dense_log_softmax_gather")


def test_entropy_equals_dense_with_two_all_reduces(tp2):
    _ok(tp2, "entropy_equals_dense_minus_sum_p_log_p")


def test_kl_equals_dense_kl_div_with_both_gradients(tp2):
    _ok(tp2, "kl_equals_dense_kl_div_with_both_gradients_and_a_frozen_reference")


def test_is_top1_equals_argmax_with_ties_across_the_ranks_in_one_all_reduce(tp2):
    _ok(tp2, "is_top1_equals_argmax_with_ties_across_the_ranks")


def test_linear_cross_entropy_equals_dense_with_two_all_reduces_per_chunk(tp2):
    _ok(tp2, "linear_cross_entropy_equals_dense_for_every_reduction_smoothing_and_softcap")


def test_linear_cross_entropy_in_bf16_equals_the_unchunked_head_and_loss(tp2):
    _ok(tp2, "linear_cross_entropy_in_bf16_equals_the_unchunked_head_and_loss")


def test_differing_targets_raise_on_every_rank_for_every_function(tp2):
    _ok(tp2, "differing_targets_raise_on_every_rank_for_every_function")


def test_lm_loss_chunk_llama_and_gpt2_loss_and_every_gradient_equal_dense(tp2):
    _ok(tp2, "lm_loss_chunk_llama_and_gpt2_loss_and_every_gradient_equal_dense")


def test_gemma2_softcapped_loss_equals_dense_plain_and_chunked(tp2):
    _ok(tp2, "gemma2_softcapped_loss_equals_dense_on_the_plain_and_the_chunked_path")


def test_undeclared_logit_post_processing_is_refused_on_both_paths(tp2):
    _ok(tp2, "undeclared_logit_post_processing_is_refused_on_both_paths")


def test_lora_on_the_head_plain_runs_chunked_is_refused_modules_to_save_copy_is_read(tp2):
    _ok(tp2, "lora_on_the_head_runs_plain_and_is_refused_chunked_and_modules_to_save_is_read")


def test_every_check_ran_on_every_rank(tp2):
    assert [sorted(r) for r in tp2] == [sorted(_CHECKS)] * WORLD
