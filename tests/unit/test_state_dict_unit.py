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
