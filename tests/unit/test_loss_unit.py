"""vocab_parallel_cross_entropy in one process (tp_size = 1) against F.cross_entropy.

With one rank every collective is the identity, so this checks the arithmetic (max shift,
target logit, padding mask, label smoothing, reductions, backward) in isolation. float64,
tolerance 1e-12: the two computations differ only in summation order.
"""

import pytest
import torch
import torch.nn.functional as F

from tpify import vocab_parallel_cross_entropy

TOL = dict(atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_matches_f_cross_entropy_with_padding(reduction, eps):
    g = torch.Generator().manual_seed(0)
    V, Vp = 13, 16  # three padded columns, as the head of a padded vocabulary gives
    full = torch.randn(3, 5, Vp, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (3, 5), generator=g)
    target[0, :2] = -100
    ref_in = full[..., :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), label_smoothing=eps,
                          reduction=reduction).reshape(() if reduction != "none" else (3, 5))
    x = full.clone().requires_grad_()
    out = vocab_parallel_cross_entropy(x, target, label_smoothing=eps, reduction=reduction, vocab_size=V)
    torch.testing.assert_close(out, ref, **TOL)
    w = torch.rand_like(out)
    (ref * w).sum().backward()
    (out * w).sum().backward()
    torch.testing.assert_close(x.grad[..., :V], ref_in.grad, **TOL)
    assert torch.all(x.grad[..., V:] == 0), "padded columns get no gradient"
    assert torch.all(x.grad[0, :2] == 0), "ignored tokens get no gradient"


def test_bad_input_raises():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_cross_entropy(x, torch.tensor([[0, 1, 2, 9], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(x, torch.zeros(2, 4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(x, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_cross_entropy(x, torch.zeros(2, 4, dtype=torch.long), vocab_size=9)


def test_tp1_model_loss_and_logits():
    """parallelize at tp_size=1 (no torch.distributed): labels= goes through the hook and
    equals HF's own loss; without labels the logits are unchanged."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=101, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    ref = GPT2LMHeadModel(cfg).eval()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=1)
    ids = torch.randint(0, 101, (2, 7))
    a, b = ref(ids, labels=ids), par(ids, labels=ids)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-6)  # both float32
    torch.testing.assert_close(b.logits, a.logits)
    torch.testing.assert_close(par(ids).logits, ref(ids).logits)
    t_a, t_b = ref(ids, labels=ids, return_dict=False), par(ids, labels=ids, return_dict=False)
    torch.testing.assert_close(t_b[0], t_a[0], atol=1e-6, rtol=1e-6)


def test_positional_labels_and_shift_labels_tp1():
    """``labels`` passed by position (HF's signature) and ``shift_labels`` follow HF's semantics."""
    import inspect

    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify
    import tputil

    torch.manual_seed(0)
    model = tpify.parallelize(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                                          n_positions=16)).double().eval())
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    params = list(inspect.signature(GPT2LMHeadModel.forward).parameters)[1:]
    args = [None] * (params.index("labels") + 1)
    args[0], args[-1] = ids, ids
    by_position = model(*args).loss
    by_keyword = model(ids, labels=ids).loss
    logits = model(ids).logits
    torch.testing.assert_close(by_position, by_keyword, atol=0, rtol=0)
    torch.testing.assert_close(by_keyword, tputil.ref_lm_loss(logits, ids, causal=True), atol=1e-12, rtol=1e-12)
    shift = ids.roll(-2, dims=1)  # any target tensor: used as is, not shifted again
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), shift.reshape(-1))
    torch.testing.assert_close(model(ids, labels=ids, shift_labels=shift).loss, expected, atol=1e-12, rtol=1e-12)


def test_log_probs_entropy_kl_top1_and_the_chunked_linear_loss_equal_dense_tp1():
    """The new functions' arithmetic in one process (every collective the identity), float64,
    padded vocabulary, against dense torch: ``log_softmax`` + ``gather`` (temperature 0.5), the
    entropy, ``KL(p || q)``, ``argmax == target``, and the chunked linear cross-entropy with
    softcapping and label smoothing, values and every gradient (tolerance 1e-12: summation order
    only). The tp = 2 proofs, with collectives counted, are tests/distributed/test_loss_functions.py."""
    from tpify.loss import (vocab_parallel_entropy, vocab_parallel_is_top1, vocab_parallel_kl,
                            vocab_parallel_linear_cross_entropy, vocab_parallel_log_probs)

    g = torch.Generator().manual_seed(1)
    V, Vp, H = 13, 16, 6
    full = torch.randn(3, 5, Vp, generator=g, dtype=torch.float64) * 3
    other = torch.randn(3, 5, Vp, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, V, (3, 5), generator=g)
    target[0, :2] = -100
    w = torch.rand(3, 5, generator=g, dtype=torch.float64)

    def grads(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        (out * w).sum().backward()
        return out, [t.grad for t in leaves]

    log_p = lambda z: F.log_softmax(z[..., :V] / 0.5, -1)  # noqa: E731
    cases = {
        "log_probs": (lambda z: vocab_parallel_log_probs(z, target, vocab_size=V, temperature=0.5),
                      lambda z: log_p(z).gather(-1, target.clamp(min=0)[..., None])[..., 0].masked_fill(target < 0, 0),
                      (full,)),
        "entropy": (lambda z: vocab_parallel_entropy(z, vocab_size=V, temperature=0.5),
                    lambda z: -(log_p(z).exp() * log_p(z)).sum(-1), (full,)),
        "kl": (lambda p, q: vocab_parallel_kl(p, q, vocab_size=V, temperature=0.5),
               lambda p, q: (log_p(p).exp() * (log_p(p) - log_p(q))).sum(-1), (full, other)),
    }
    for name, (ours, dense, inputs) in cases.items():
        out, got = grads(ours, *inputs)
        ref, want = grads(dense, *inputs)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"{name}: {m}")
        for a, b in zip(got, want):
            torch.testing.assert_close(a[..., :V], b[..., :V], **TOL, msg=lambda m: f"{name} grad: {m}")
            assert torch.all(a[..., V:] == 0), f"{name}: padded columns get no gradient"
    assert torch.equal(vocab_parallel_is_top1(full, target, vocab_size=V),
                       (full[..., :V].argmax(-1) == target) & (target >= 0))

    x = torch.randn(3, 5, H, generator=g, dtype=torch.float64)
    weight = torch.cat([torch.randn(V, H, generator=g, dtype=torch.float64), torch.zeros(Vp - V, H,
                                                                                          dtype=torch.float64)])
    bias = torch.cat([torch.randn(V, generator=g, dtype=torch.float64), torch.zeros(Vp - V, dtype=torch.float64)])
    for reduction in ("none", "mean"):
        out, got = grads(lambda x_, w_, b_: vocab_parallel_linear_cross_entropy(
            x_, w_, target, bias=b_, reduction=reduction, label_smoothing=0.1, vocab_size=V, chunk_size=4, softcap=2.0),
            x, weight, bias)
        ref, want = grads(lambda x_, w_, b_: F.cross_entropy(
            (2.0 * torch.tanh(F.linear(x_, w_, b_) / 2.0))[..., :V].reshape(-1, V), target.reshape(-1),
            reduction=reduction, label_smoothing=0.1).reshape(out.shape), x, weight, bias)
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"linear {reduction}: {m}")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"linear {reduction} grad: {m}")
