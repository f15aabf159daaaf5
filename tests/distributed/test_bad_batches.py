"""Bad batches at tp = 2 behave as on the dense model, never silently differently (one spawn).

* A batch whose labels are all ignored, and a one-token causal sequence: the loss is NaN as
  HF's, and every gradient is exactly 0 as HF's (a NaN gradient would poison the weights at the
  next optimizer step).
* Token ids outside ``[0, vocab)`` (too large, negative) raise ``IndexError`` on every rank, as
  the dense ``nn.Embedding`` does, instead of returning the embedding of nothing.
* Labels out of range on one rank only, or labels that differ between the TP ranks (a TP rank
  fed another batch): every rank raises ``ValueError`` from the loss, none is left waiting.
"""

import torch
from transformers import GPT2LMHeadModel

import tputil
from test_core_equivalence import gpt2_config


def _body(rank, world):
    import tpify

    torch.manual_seed(0)
    dense = GPT2LMHeadModel(gpt2_config()).double()
    par = tpify.parallelize(GPT2LMHeadModel(gpt2_config()).double(), tp_size=2)
    out = {}
    ids = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(1))
    for what, x, labels in (("all ignored", ids, torch.full_like(ids, -100)), ("one token", ids[:, :1], ids[:, :1])):
        for name, model in (("dense", dense), ("tp", par)):
            model.zero_grad()
            loss = model(x, labels=labels).loss
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out[(what, name)] = (bool(loss.isnan()), all(bool((g == 0).all()) for g in grads), len(grads))
    errors = {}
    for what, bad in (("too large", 50257), ("negative", -1)):
        x = ids.clone()
        x[1, 3] = bad
        for name, model in (("dense", dense), ("tp", par)):
            try:
                model(x)
                errors[(what, name)] = None
            except IndexError as e:
                errors[(what, name)] = str(e)
    # Targets bad on one rank only, or different on the two ranks: every rank raises (no rank is
    # left waiting in the loss's next all-reduce).
    for what in ("bad on rank 1", "different"):
        labels = ids.clone()
        if rank == 1:
            labels[0, 2] = 50257 if what == "bad on rank 1" else (labels[0, 2] + 1) % 50257
        try:
            par(ids, labels=labels)
            errors[(what, "tp")] = None
        except ValueError as e:
            errors[(what, "tp")] = str(e)
    torch.distributed.barrier()  # every rank got here: no rank is left in a collective
    return out, errors


def test_ignored_labels_give_nan_loss_zero_gradients_and_bad_ids_raise():
    for rank, (out, errors) in enumerate(tputil.spawn(_body, 2, timeout=120)):
        where = "this rank" if rank == 1 else "another rank"
        message = errors[("bad on rank 1", "tp")]
        assert message.startswith("vocab_parallel_cross_entropy: a rank of the TP group holds targets outside "
                                  "[0, 50257)") and message.endswith(f"({where} holds them)"), errors
        assert "hold different targets" in errors[("different", "tp")], errors
        for what in ("all ignored", "one token"):
            assert out[(what, "dense")][:2] == (True, True), out  # HF: NaN loss, zero gradients
            assert out[(what, "tp")][:2] == (True, True), out
            assert out[(what, "tp")][2] > 0
        for what in ("too large", "negative"):
            assert errors[(what, "dense")] is not None
            assert errors[(what, "tp")] is not None and "ids must be in [0, 50257)" in errors[(what, "tp")], errors
