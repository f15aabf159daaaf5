"""tpify.from_pretrained / save_pretrained across gloo ranks: sharded reads, round trips, resharding.

References and tolerances:
* Tiny GPT-2 (tied head, vocab 50257: padded at tp=4) and BERT checkpoints are saved by
  transformers' own ``save_pretrained`` in float64, so the loaded model is compared with the dense
  float64 model at ``atol=1e-10, rtol=1e-9``: the only difference is the order of floating-point
  sums (partial matmuls summed by the all-reduce), a few ulps; a wrong slice gives O(1e-2).
* Weights are compared bitwise (``torch.equal``) with ``ShardSpec.slice_dense`` of the dense
  tensor: loading must not change one bit.
* Real MiniLM in float32: ``atol=1e-5`` on hidden states of magnitude ~1 after 6 layers; the
  float32 reassociation of the reduced sums moves them by ~1e-6 (measured 1.3e-6 at tp=1 already
  from parallelize itself), an error in a slice moves them by >1e-2.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import (BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM)

import tputil

pytestmark = pytest.mark.slow  # real models / long end-to-end runs: not in the quick subset

TOL = dict(atol=1e-10, rtol=1e-9)


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=50257, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).double().eval()


def _bert():
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=30522, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg).double().eval()


class _CountingSlice:
    def __init__(self, inner, log, key):
        self.inner, self.log, self.key = inner, log, key

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        out = self.inner[index]
        self.log[self.key] = self.log.get(self.key, 0) + out.numel()
        return out


class _CountingHandle:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def metadata(self):
        return self.inner.metadata()

    def get_slice(self, key):
        return _CountingSlice(self.inner.get_slice(key), self.log, key)


def _check_load(rank, world, ckpt, dense, tp, ids):
    """Load ``ckpt`` at ``tp``; outputs equal dense; every local tensor is the exact slice."""
    import tpify
    from tpify.io import reader
    from tpify.sharding import shard_spec_of

    log = {}
    real = reader.safe_open
    reader.safe_open = lambda *a, **k: _CountingHandle(real(*a, **k), log)
    try:
        model = tpify.from_pretrained(ckpt, tp_size=tp)
    finally:
        reader.safe_open = real
    info = model.tp_info
    out, ref = model(ids).logits, dense(ids).logits
    torch.testing.assert_close(out, ref, **TOL)
    dense_params = dict(dense.named_parameters(remove_duplicate=False))
    read_expected = 0
    for fqn, p in model.named_parameters(remove_duplicate=False):
        spec = shard_spec_of(p)
        want = spec.slice_dense(dense_params[fqn].detach(), info.tp_rank) if spec else dense_params[fqn]
        assert torch.equal(p.detach(), want), f"{fqn} at tp={tp} rank {info.tp_rank} is not the exact slice"
    for p in model.parameters():  # each tensor once (ties deduplicated)
        spec = shard_spec_of(p)
        read_expected += (p.numel() if spec is None else
                          p.numel() // spec.local_size * sum(b - a for a, b in spec.ranges(info.tp_rank)))
    # Every element requested from the files is one this rank keeps: nothing else is read.
    assert sum(log.values()) == read_expected, (sum(log.values()), read_expected)
    return model


def _body_load(rank, world, ckpts, out_dir):
    import tpify

    gpt2, bert = _gpt2(), _bert()
    g = torch.Generator().manual_seed(1)
    ids_g = torch.randint(0, 50257, (2, 9), generator=g)
    ids_b = torch.randint(0, 30522, (2, 9), generator=g)
    for tp in (1, 2, 4):
        m = _check_load(rank, world, ckpts["gpt2"], gpt2, tp, ids_g)
        assert m.lm_head.weight is m.transformer.wte.weight, "tied weights must stay one Parameter"
        if tp == 4:
            assert m.transformer.wte.weight.shape[0] == 50260 // 4, "vocab padded to a multiple of 4"
            tpify.save_pretrained(m, os.path.join(out_dir, "gpt2_tp4"))
        if tp == 2:
            tpify.save_pretrained(m, os.path.join(out_dir, "gpt2_tp2"), max_shard_size="300KB")
        _check_load(rank, world, ckpts["bert"], bert, tp, ids_b)
        b = _check_load(rank, world, ckpts["bert_sharded"], bert, tp, ids_b)
        if tp == 2:
            tpify.save_pretrained(b, os.path.join(out_dir, "bert_tp2"))
    # Resharding: saved at tp=4, loaded at tp=2 (and tp=1).
    for tp in (2, 1):
        _check_load(rank, world, os.path.join(out_dir, "gpt2_tp4"), gpt2, tp, ids_g)
    # Real MiniLM at tp=2 (world 4: two DP replicas of a 2-way TP group).
    minilm = tpify.from_pretrained(tputil.minilm_dir(), tp_size=2)
    ref = BertModel.from_pretrained(tputil.minilm_dir()).eval()
    ids = torch.randint(1000, 30000, (2, 11), generator=g)
    torch.testing.assert_close(minilm(ids).last_hidden_state, ref(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
    for name, buf in ref.named_buffers():
        assert torch.equal(minilm.get_buffer(name), buf), name
    _minilm_tp3(rank, world)
    return True


def _minilm_tp3(rank, world):
    """Real MiniLM at tp=3 on ranks 0-2 of the world of 4, through an explicit tp_group (and
    dp_group=None: rank 3 does something else, there is no data parallelism to infer)."""
    import torch.distributed as dist

    import tpify

    group = dist.new_group([0, 1, 2])  # collective over the world: every rank calls it
    if rank == 3:
        return True
    model = tpify.from_pretrained(tputil.minilm_dir(), tp_group=group, dp_group=None)
    ref = BertModel.from_pretrained(tputil.minilm_dir()).eval()
    ids = torch.randint(1000, 30000, (2, 11), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(ids).last_hidden_state, ref(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
    assert model.embeddings.word_embeddings.weight.shape[0] == 30522 // 3
    return True


def _body_all(rank, world, ckpts, out_dir, cases, good):
    """One spawn for every check (spawning ranks costs tens of seconds on a loaded machine)."""
    return {"load": _body_load(rank, world, ckpts, out_dir), "bad": _body_bad(rank, world, cases, good)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Make the checkpoints, run ``_body_all`` on 4 gloo ranks once, return paths and outcomes."""
    tmp_path = tmp_path_factory.mktemp("loading")
    ckpts = {"gpt2": str(tmp_path / "gpt2"), "bert": str(tmp_path / "bert"),
             "bert_sharded": str(tmp_path / "bert_sharded")}
    _gpt2().save_pretrained(ckpts["gpt2"])
    _bert().save_pretrained(ckpts["bert"])
    _bert().save_pretrained(ckpts["bert_sharded"], max_shard_size="200KB")
    assert (tmp_path / "bert_sharded" / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    out.mkdir()
    cases, good, before = _bad_cases(tmp_path / "bad")
    outcomes = tputil.spawn(_body_all, 4, ckpts, str(out), cases, good, expect_errors=True)
    return dict(tmp=tmp_path, out=out, outcomes=outcomes, before=before, good=good)


def test_load_save_reshard(results):
    """tp=1,2,4 loads of GPT-2/BERT (single file and index) equal dense and read only their slices;
    tp=2 saves load in plain transformers bitwise; tp=4 save loads at tp=2; MiniLM at tp=2, 3."""
    for status, value in results["outcomes"]:
        assert status == "ok", value
    out = results["out"]
    # Round trip tp=2 -> save_pretrained -> plain transformers: every tensor bitwise equal.
    for name, cls, ref in (("gpt2_tp2", GPT2LMHeadModel, _gpt2()), ("bert_tp2", BertForMaskedLM, _bert())):
        assert not [p for p in os.listdir(out) if p.startswith(".")], "temp dirs left behind"
        loaded = cls.from_pretrained(out / name)
        assert loaded.dtype == torch.float64
        ref_sd, sd = ref.state_dict(), loaded.state_dict()
        assert ref_sd.keys() == sd.keys()
        for k, v in ref_sd.items():
            assert torch.equal(sd[k], v), f"{name}: {k} changed in the round trip"
    index = json.loads((out / "gpt2_tp2" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"], "the tied copy is saved once, as transformers 5 does"
    with safe_open(str(out / "gpt2_tp4" / "model.safetensors"), "pt") as f:
        assert f.get_slice("transformer.wte.weight").get_shape() == [50257, 32], "padding stripped on save"


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error on every rank, before any collective; no hang.
# ---------------------------------------------------------------------------------------------

def _body_bad(rank, world, cases, good):
    import tpify
    from tpify.io import save

    messages = {}
    for name, path in cases.items():
        try:
            tpify.from_pretrained(path, tp_size=2)  # world 4: tp=2, dp=2
            messages[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            messages[name] = f"{type(e).__name__}: {e}"
    # The group is still healthy (no rank is stuck in a collective): a good load works.
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = tpify.from_pretrained(good["unexpected"], tp_size=2)
    messages["unexpected"] = " | ".join(str(x.message) for x in w if "not used" in str(x.message))
    # A failure on the writing rank raises on every rank, and leaves the old checkpoint intact.
    if rank == 0:
        def broken(*a, **k):
            raise OSError("disk full (simulated)")
        save.save_file = broken
    try:
        tpify.save_pretrained(model, good["existing"])
        messages["save"] = "no error"
    except Exception as e:  # noqa: BLE001
        messages["save"] = f"{type(e).__name__}: {e}"
    return messages


def _bad_cases(tmp_path):
    from safetensors.torch import load_file, save_file

    tmp_path.mkdir()
    src = tmp_path / "src"
    _bert().float().save_pretrained(src)
    state = load_file(src / "model.safetensors")
    cfg = (src / "config.json").read_text()

    def make(name, tensors=None, raw=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg)
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        else:
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)

    missing = dict(state)
    del missing["bert.encoder.layer.1.output.dense.weight"]
    wrong = dict(state)
    wrong["bert.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(65, 32)
    extra = dict(state)
    extra["bert.encoder.layer.0.surprise"] = torch.zeros(3)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    raw = (src / "model.safetensors").read_bytes()
    cases = {"missing": make("missing", missing), "wrong_shape": make("wrong", wrong),
             "no_config": str(no_config), "truncated": make("truncated", raw=raw[: len(raw) // 2])}
    good = {"unexpected": make("unexpected", extra), "existing": str(src)}
    return cases, good, raw


def test_bad_inputs_every_rank(results):
    """Each bad input raises a clear error on all 4 ranks (tp=2, dp=2), before any collective:
    the group stays usable afterwards; a write failure on rank 0 raises on every rank."""
    for rank, (status, value) in enumerate(results["outcomes"]):
        assert status == "ok", value
        msgs = value["bad"]
        assert "CheckpointError" in msgs["missing"], msgs["missing"]
        assert "missing tensor bert.encoder.layer.1.output.dense.weight (shape [32, 64])" in msgs["missing"]
        assert "has shape [65, 32]" in msgs["wrong_shape"] and "needs [64, 32]" in msgs["wrong_shape"]
        assert msgs["no_config"].startswith("FileNotFoundError") and "no config.json" in msgs["no_config"]
        assert "truncated" in msgs["truncated"] and "model.safetensors" in msgs["truncated"], msgs["truncated"]
        assert "bert.encoder.layer.0.surprise" in msgs["unexpected"], msgs["unexpected"]
        want = "OSError: disk full" if rank == 0 else "RuntimeError: tpify: saving failed on rank(s) [0]"
        assert msgs["save"].startswith(want), msgs["save"]
    src = results["good"]["existing"]
    assert open(os.path.join(src, "model.safetensors"), "rb").read() == results["before"], \
        "a failed save touched the old checkpoint"
    assert not [p for p in os.listdir(results["tmp"] / "bad") if p.startswith(".")], "temp dir left behind"


def _body_strided(rank, world, path):
    """Load a float64 Llama whose row-parallel shards are above the 1 MiB view threshold, so
    ``o_proj``/``down_proj`` are strided views of the file: logits, the loss and the gradients
    equal dense; a save gathers them back to the file's bytes."""
    import tpify
    from tpify.sharding import shard_spec_of

    dense = LlamaForCausalLM.from_pretrained(path, dtype=torch.float64)
    model = tpify.from_pretrained(path, tp_size=world)
    strided = sorted(n for n, p in model.named_parameters() if not p.is_contiguous())
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_d = tputil.ref_lm_loss(dense(ids).logits, ids, causal=True)
    loss_d.backward()
    model.train()
    loss_p = model(ids, labels=ids).loss
    loss_p.backward()
    grads = {n: shard_spec_of(p).gather(p.grad, None) for n, p in model.named_parameters() if n in strided}
    out = os.path.join(os.path.dirname(path), "resaved")
    tpify.save_pretrained(model, out)
    if rank == 0:
        from safetensors.torch import load_file

        saved = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                saved.update(load_file(os.path.join(out, f)))
        for n, p in dense.named_parameters():
            assert torch.equal(saved[n], p.detach()), f"{n} changed through a strided load and save"
    torch.testing.assert_close(loss_p, loss_d, **TOL)
    for n, g in grads.items():
        torch.testing.assert_close(g, dense.get_parameter(n).grad, **TOL, msg=lambda m: f"gradient of {n}: {m}")
    return strided


def test_strided_views_train_and_save_exactly(tmp_path):
    """Row-parallel shards above 1 MiB are strided views (not contiguous) on both ranks, and
    behave as the dense weights do: forward, backward, save."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                      intermediate_size=1024, vocab_size=1000, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).double().save_pretrained(tmp_path / "llama")
    strided = tputil.spawn(_body_strided, 2, str(tmp_path / "llama"))
    expected = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("mlp.down_proj", "self_attn.o_proj")]
    assert strided == [expected, expected], strided
