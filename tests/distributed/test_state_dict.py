"""``model.state_dict()`` / ``model.load_state_dict(...)`` on a parallelized model (tpify/hooks/state_dict.py).

One spawned job of 2 gloo ranks (tp 2) runs every check (``tputil.run_checks``), each on two
float64 families: GPT-2 (Conv1D weights, the packed ``c_attn`` ``[Q | K | V]``, a tied head, a
61-token vocabulary padded to 62) and a Llama (2 KV heads, an untied head, a 101-token vocabulary
padded to 112 by ``pad_vocab_multiple=8``, an MLP of 37 split unevenly: 19 + 18), their constant tensors perturbed (so replicated
LayerNorms differ between seeds):

* rank 0's ``state_dict()`` saved and loaded on every rank is refused on every rank (rank 1:
  ``TPUsageError`` naming the tensors, rank 0's tag and the fix; rank 0: ``AgreementError`` naming
  rank 1), before anything is copied (every parameter and the loss bitwise as before);
* a dense state dict (the dense model's own, and ``tpify.dense_state_dict``) loads sliced: every
  local tensor bitwise ``ShardSpec.slice_dense`` of the dense one, logits and loss equal to the
  dense model's within ``atol=1e-10, rtol=1e-9`` (float64, summation order only);
* each rank's own ``state_dict()`` (through ``torch.save`` / ``torch.load``) round-trips bitwise
  into a model from another seed; a copy without the tag (a dict comprehension) is refused;
* ``strict=False`` loads the dense tensors present; ``assign=True`` puts the slices in place with
  their ShardSpecs and keeps the tied head one parameter; a tensor of neither shape is refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tputil

# about 20 s (one spawn of 2 ranks, 2 families); the quick subset has tests/unit/test_state_dict_unit.py
pytestmark = pytest.mark.slow

F64 = dict(atol=1e-10, rtol=1e-9)  # float64, the same sums in another order


def _gpt2(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=61, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).double()


def _llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False)).double()


FAMILIES = {"gpt2": (_gpt2, 1, 62), "llama": (_llama, 8, 112)}  # build, pad_vocab_multiple, padded vocabulary


def _dense(family, seed=0):
    from tpify.authoring.reference import float64_loss_function, perturb_constants

    model = FAMILIES[family][0](seed).eval()
    perturb_constants(model, seed)
    model.loss_function = float64_loss_function("ForCausalLM")
    return model


def _par(family, seed=0):
    import tpify

    return tpify.parallelize(_dense(family, seed), tp_size=2, pad_vocab_multiple=FAMILIES[family][1])


def _ids(family):
    vocab = {"gpt2": 61, "llama": 101}[family]
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(5))


def _loss(model, ids):
    with torch.no_grad():
        return model(ids, labels=ids).loss


def _local(model):
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _assert_slices_of(c, par, dense, what):
    """Every local tensor of ``par`` is bitwise its ShardSpec's slice of ``dense``'s (replicated: equal)."""
    from tpify.sharding import shard_spec_of

    want = dict(dense.named_parameters(remove_duplicate=False))
    for name, p in par.named_parameters(remove_duplicate=False):
        spec = shard_spec_of(p)
        expected = spec.slice_dense(want[name].detach(), c.rank) if spec is not None else want[name].detach()
        assert torch.equal(p.detach(), expected), f"{what}: {name} on rank {c.rank} is not its exact slice"


def _assert_computes_dense(par, dense, family, what):
    ids = _ids(family)
    with torch.no_grad():
        torch.testing.assert_close(par(ids).logits, dense(ids).logits, **F64, msg=lambda m: f"{what}, logits: {m}")
    torch.testing.assert_close(_loss(par, ids), _loss(dense, ids), **F64, msg=lambda m: f"{what}, loss: {m}")


_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


@_check
def rank0_state_dict_is_refused_on_every_rank(c):
    """The issue's script: rank 0 saves ``model.state_dict()``, every rank loads it."""
    from tpify import AgreementError, TPUsageError

    for family in FAMILIES:
        par = _par(family)
        ids = _ids(family)
        before, loss = _local(par), _loss(par, ids)
        file = c.tmp / f"{family}-rank0.pt"
        if c.rank == 0:
            torch.save(par.state_dict(), file)
        dist.barrier()
        expected = (AgreementError, "failed on rank\\(s\\) \\[1\\]") if c.rank == 0 else (
            TPUsageError, "are the shards of TP rank 0 of tp_size 2 \\(global rank 0")
        with pytest.raises(expected[0], match=expected[1]) as refused:
            par.load_state_dict(torch.load(file))
        message = str(refused.value)
        for part in ("tpify.save_pretrained", "tpify.dense_state_dict", "tpify.sharded_state_dict",
                     "Nothing was loaded"):
            assert part in message, f"{family}: the refusal does not name {part!r}: {message}"
        name = "transformer.h.0.attn.c_attn.weight" if family == "gpt2" else "model.layers.0.self_attn.q_proj.weight"
        assert name in message, message  # which tensor
        after = _local(par)
        assert all(torch.equal(after[n], t) for n, t in before.items()), f"{family}: something was copied"
        assert torch.equal(_loss(par, ids), loss)
        c.measured[f"{family}: loss before / after the refused load"] = (float(loss), float(_loss(par, ids)))
        dist.barrier()


@_check
def dense_state_dict_loads_sliced(c):
    """The dense model's own state dict, and tpify.dense_state_dict of a parallel model, load into a
    parallel model from another seed as each rank's exact slices; it then computes the dense model."""
    import tpify

    for family in FAMILIES:
        dense = _dense(family)
        par = _par(family, seed=3)
        result = par.load_state_dict(dense.state_dict())
        assert not result.missing_keys and not result.unexpected_keys, result
        _assert_slices_of(c, par, dense, f"{family}, the dense model's state dict")
        _assert_computes_dense(par, dense, family, f"{family}, the dense model's state dict")
        table, padded = par.get_output_embeddings().weight, FAMILIES[family][2]
        assert table.shape[0] == padded // 2, table.shape  # this rank's rows of the padded table
        if c.rank == 1:  # the padding rows, all on the last rank, are zeros
            padding = table[-(padded - dense.config.vocab_size):]
            assert torch.equal(padding, torch.zeros_like(padding))
        gathered = tpify.dense_state_dict(_par(family))
        other = _par(family, seed=4)
        other.load_state_dict(gathered, strict=family != "gpt2")  # GPT-2's tied lm_head.weight is left out
        _assert_slices_of(c, other, dense, f"{family}, tpify.dense_state_dict")


@_check
def own_state_dict_round_trips_and_an_untagged_copy_is_refused(c):
    from tpify import AgreementError, TPUsageError

    for family in FAMILIES:
        par = _par(family)
        file = c.tmp / f"{family}-rank{c.rank}.pt"
        torch.save(par.state_dict(), file)
        other = _par(family, seed=3)
        other.load_state_dict(torch.load(file))  # weights_only=True keeps the tag
        want = _local(par)
        assert all(torch.equal(p.detach(), want[n]) for n, p in other.named_parameters(remove_duplicate=False))
        untagged = {k: v.clone() for k, v in par.state_dict().items()}  # a plain dict: no _metadata
        with pytest.raises((TPUsageError, AgreementError), match="does not say which rank wrote them") as refused:
            _par(family, seed=3).load_state_dict(untagged)
        assert isinstance(refused.value, TPUsageError)  # every rank finds it itself


@_check
def strict_false_assign_true_and_a_wrong_shape(c):
    from tpify import TPUsageError
    from tpify.sharding import shard_spec_of

    for family in FAMILIES:
        dense = _dense(family)
        par = _par(family, seed=3)
        mlp = "transformer.h.1.mlp.c_fc.weight" if family == "gpt2" else "model.layers.1.mlp.up_proj.weight"
        untouched = _local(par)
        result = par.load_state_dict({mlp: dense.state_dict()[mlp]}, strict=False)
        assert mlp not in result.missing_keys and len(result.missing_keys) > 10
        for name, p in par.named_parameters(remove_duplicate=False):
            if name == mlp:
                assert torch.equal(p.detach(), shard_spec_of(p).slice_dense(dense.get_parameter(mlp).detach(), c.rank))
            else:
                assert torch.equal(p.detach(), untouched[name]), name
        specs = {n: shard_spec_of(p) for n, p in par.named_parameters(remove_duplicate=False)}
        par.load_state_dict(dense.state_dict(), assign=True)
        assert {n: shard_spec_of(p) for n, p in par.named_parameters(remove_duplicate=False)} == specs
        if family == "gpt2":
            assert par.lm_head.weight is par.transformer.wte.weight, "the tied head stays one parameter"
        assert par.tp_info.foreign_shards == []
        _assert_slices_of(c, par, dense, f"{family}, assign=True")
        _assert_computes_dense(par, dense, family, f"{family}, assign=True")
        wrong = {mlp: torch.zeros(5, 3, dtype=torch.float64)}
        with pytest.raises(TPUsageError, match=f"{mlp}: shape \\[5, 3\\], expected the dense"):
            par.load_state_dict(wrong, strict=False)


def _body(rank, world, tmp):
    from types import SimpleNamespace

    c = SimpleNamespace(rank=rank, world=world, tmp=Path(tmp), measured={})
    return tputil.run_checks(_CHECKS, c), c.measured


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return tputil.spawn(_body, 2, str(tmp_path_factory.mktemp("state-dict")), timeout=300)


@pytest.mark.parametrize("name", sorted(_CHECKS))
def test_state_dict(job, name):
    tputil.assert_checks_ok([checks for checks, _ in job], name)
    for label, figures in job[0][1].items():
        print(f"measured {label}: {figures}")
