"""Bad batches at tp = 2 behave as on the dense model, never silently differently (one spawn).

* A batch whose labels are all ignored, and a one-token causal sequence: the loss is NaN as
  HF's, and every gradient is exactly 0 as HF's (a NaN gradient would poison the weights at the
  next optimizer step).
* Token ids outside ``[0, vocab)`` (too large, negative) raise ``IndexError`` on every rank, as
  the dense ``nn.Embedding`` does, instead of returning the embedding of nothing (through the
  model at its next call: its data checks are read one call late, without a host sync).
* Labels out of range on one rank only, or labels that differ between the TP ranks (a TP rank
  fed another batch): every rank raises ``ValueError``, none is left waiting: from the model's
  input check (``tpify.hooks.guards.BatchCheck``) at the model's next call, from the loss itself
  when ``vocab_parallel_cross_entropy`` is called directly.
* Token ids that differ between the TP ranks (a per-rank sampling seed), or another sequence
  length on one rank: every rank raises ``ValueError`` before any other collective, whether the
  model or its embedding alone is called (other ids through the model: at its next call).
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
        # tp: the ids are checked on the device and raised at the model's next call (no host sync)
        for name, call in (("dense", lambda: dense(x)), ("tp", lambda: (par(x), par(ids)))):
            try:
                call()
                errors[(what, name)] = None
            except IndexError as e:
                errors[(what, name)] = str(e)
    # Targets bad on one rank only, or different on the two ranks: every rank raises (no rank is
    # left waiting in the loss's next all-reduce), through the model and through the loss alone.
    logits = par(ids).logits[..., 50258 // 2 * rank: 50258 // 2 * (rank + 1)].detach()  # this rank's shard
    for what in ("bad on rank 1", "different"):
        labels = ids.clone()
        if rank == 1:
            labels[0, 2] = 50257 if what == "bad on rank 1" else (labels[0, 2] + 1) % 50257
        for how, call in (("tp", lambda: (par(ids, labels=labels), par(ids))),  # raised at the next call
                          ("loss", lambda: tpify.vocab_parallel_cross_entropy(
                              torch.nn.functional.pad(logits, (0, 1)) if rank == 1 else logits, labels,
                              vocab_size=50257))):
            try:
                call()
                errors[(what, how)] = None
            except ValueError as e:
                errors[(what, how)] = str(e)
    # Token ids that differ on one rank, or another sequence length: the model's input check, and the
    # embedding's own when it is called alone.
    embedding = par.get_input_embeddings()
    for what, x in (("other ids", ids if rank == 0 else ids.roll(1, dims=1)), ("other length", ids[:, :8 - rank])):
        for how, call in (("tp", lambda: (par(x), par(ids))), ("embedding", lambda: embedding(x))):
            try:
                call()
                errors[(what, how)] = None
            except ValueError as e:
                errors[(what, how)] = str(e)
    torch.distributed.barrier()  # every rank got here: no rank is left in a collective
    return out, errors


def test_ignored_labels_give_nan_loss_zero_gradients_and_bad_ids_raise():
    for rank, (out, errors) in enumerate(tputil.spawn(_body, 2, timeout=120)):
        where = "this rank" if rank == 1 else "another rank"
        message = errors[("bad on rank 1", "loss")]
        assert message.startswith("vocab_parallel_cross_entropy: a rank of the TP group holds targets outside "
                                  "[0, 50257)") and message.endswith(f"({where} holds them)"), errors
        assert "hold different targets" in errors[("different", "loss")], errors
        for what in ("bad on rank 1", "different", "other ids"):
            assert "the ranks of the TP group were given different input values" in errors[(what, "tp")], errors
        assert "VocabParallelEmbedding: the ranks of the TP group were given different input values" in errors[
            ("other ids", "embedding")], errors
        for how in ("tp", "embedding"):
            assert "given inputs of different names, shapes or dtypes" in errors[("other length", how)], errors
        for what in ("all ignored", "one token"):
            assert out[(what, "dense")][:2] == (True, True), out  # HF: NaN loss, zero gradients
            assert out[(what, "tp")][:2] == (True, True), out
            assert out[(what, "tp")][2] > 0
        for what in ("too large", "negative"):
            assert errors[(what, "dense")] is not None
            assert errors[(what, "tp")] is not None and "ids must be in [0, 50257)" in errors[(what, "tp")], errors
