"""``state_dict`` / ``load_state_dict`` of a model parallelized at tp = 1 in one process
(tpify/hooks/state_dict.py; the tp > 1 rules: tests/distributed/test_state_dict.py).

At tp 1 a shard is the whole tensor, but a vocabulary padded by ``pad_vocab_multiple`` is not:
the dense Hugging Face state dict must load with the padding rows added (zeros), the model's own
(padded) state dict as it is, tagged or not (one rank: no other rank could have written it).
Comparisons are bitwise: loading moves bytes.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
from tpify.hooks.state_dict import TAG


def _gpt2(seed):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=61, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)).eval()


def test_tp1_padded_model_loads_the_dense_state_dict_and_its_own():
    dense = _gpt2(0)
    par = tpify.parallelize(_gpt2(1), tp_size=1, pad_vocab_multiple=8)
    assert par.transformer.wte.weight.shape == (64, 16)
    par.load_state_dict(dense.state_dict())
    assert torch.equal(par.transformer.wte.weight[:61], dense.transformer.wte.weight)
    assert torch.equal(par.transformer.wte.weight[61:], torch.zeros(3, 16))
    ids = torch.arange(10)[None]
    with torch.no_grad():
        # float32: the head's GEMM over 64 rows, not 61, may sum in another order (a few ulps)
        torch.testing.assert_close(par(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
    own = par.state_dict()
    tag = own._metadata[""][TAG]
    assert (tag["tp_size"], tag["tp_rank"], tag["shards"]["transformer.wte.weight"]["padded_size"]) == (1, 0, 64)
    other = tpify.parallelize(_gpt2(2), tp_size=1, pad_vocab_multiple=8)
    other.load_state_dict(own)
    other.load_state_dict({k: v.clone() for k, v in own.items()})  # untagged, padded: one rank wrote it
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), par.parameters()))


def test_load_check_decides_by_tp_rank_and_shardspec():
    """The decision table of ``CheckShards._check`` on one parameter split in 2 (this is TP rank 0):
    a shard tagged by TP rank 0 under an equal ShardSpec loads as it is, whichever global rank
    wrote it (global rank 2: rank 0's DP replica at dp 2 x tp 2); TP rank 1's, or rank 0's under
    another spec, is refused; an untagged local shard is refused; a dense tensor is sliced; a
    tensor tagged as whole (tp 1) is sliced too. Local: no process group needed."""
    import dataclasses
    from types import SimpleNamespace

    import pytest

    from tpify.hooks.state_dict import CheckShards
    from tpify.info import TPUsageError
    from tpify.sharding import ShardSpec

    spec = ShardSpec(0, (4, 4), 2)  # packed: rank 0 holds rows [0, 2) and [4, 6)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(4, 3))
    module.weight.tp_shard_spec = spec
    info = SimpleNamespace(tp_rank=0, tp_size=2, specs={}, layout=SimpleNamespace(digest=lambda: "abc"))

    def tag(tp_rank, rank, s=spec):
        return {"format": 1, "tp_size": s.tp_size, "tp_rank": tp_rank, "rank": rank, "layout": "abc",
                "shards": {"weight": dataclasses.asdict(s)}}

    local, dense = torch.randn(4, 3), torch.randn(8, 3)
    assert CheckShards._check(module, info, {"weight": local}, "", tag(0, 2)) == {}
    for bad in (tag(1, 1), tag(0, 0, ShardSpec(0, (8,), 2))):
        with pytest.raises(TPUsageError, match=r"are the shards of TP rank \d of tp_size 2"):
            CheckShards._check(module, info, {"weight": local}, "", bad)
    with pytest.raises(TPUsageError, match="does not say which rank wrote them"):
        CheckShards._check(module, info, {"weight": local}, "", None)
    for whole in (None, tag(0, 0, ShardSpec(0, (4, 4), 1))):
        sliced = CheckShards._check(module, info, {"weight": dense}, "", whole)
        assert torch.equal(sliced["weight"], torch.cat([dense[0:2], dense[4:6]]))
