"""tpify.checkpoint in one process (tp = 1): the quick smoke of the DCP checkpoint and the two
state-dict views. The resharding itself (dp 2 x tp 2 -> tp 4, dp 4 x tp 1, tp 1) is
tests/distributed/test_checkpoint_layouts.py (slow).

A GPT-2 with a fused ``c_attn`` (three parts) and a vocabulary of 61 rows padded to 64
(``pad_vocab_multiple=8``): ``sharded_state_dict`` names the parts and gives the dense, unpadded
shapes; ``dense_state_dict`` equals the dense model's state dict; a checkpoint saved after one
AdamW step and loaded into a model from another seed restores the weights, the optimizer state
and the scheduler bitwise (bytes moved, nothing computed).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
from tpify.checkpoint import load_checkpoint, save_checkpoint


def _model(seed):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=61, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def _train_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=4)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    return opt, sched


def test_checkpoint_round_trip_and_state_dict_views(tmp_path):
    dense = _model(0)
    model = tpify.parallelize(_model(0), tp_size=1, pad_vocab_multiple=8)
    assert model.transformer.wte.weight.shape[0] == 64
    sharded = tpify.sharded_state_dict(model)
    assert sharded["transformer.wte.weight"].shape == (61, 16), "the unpadded rows"
    assert [sharded[f"transformer.h.0.attn.c_attn.weight.part{i}"].shape for i in range(3)] == [(16, 16)] * 3
    assert "transformer.h.0.attn.c_attn.weight" not in sharded
    got = tpify.dense_state_dict(model)
    want = {k: v for k, v in dense.state_dict().items() if k != "lm_head.weight"}  # tied: not saved, as HF
    assert got.keys() <= want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    opt, sched = _train_step(model)
    save_checkpoint(tmp_path / "ckpt", model, [opt], [sched], extra={"step": 1})
    other = tpify.parallelize(_model(5), tp_size=1, pad_vocab_multiple=8)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_sched = torch.optim.lr_scheduler.LinearLR(other_opt, total_iters=4)
    assert load_checkpoint(tmp_path / "ckpt", other, [other_opt], [other_sched]) == {"step": 1}
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        for key, value in opt.state[p].items():
            assert torch.equal(other_opt.state[q][key], value), (name, key)
    assert other_sched.state_dict() == sched.state_dict()
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _fresh(seed):
    model = tpify.parallelize(_model(seed), tp_size=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LinearLR(opt, total_iters=4)


def test_a_truncated_or_missing_distcp_file_is_named_before_anything_is_read(tmp_path):
    """A ``.distcp`` file cut short stopped the load with DCP's ``CheckpointException`` around a
    bare ``EOFError``; now a :class:`CheckpointError` names the file, its size and the size its
    ``.metadata`` needs, and says to resume from an earlier checkpoint; the model is untouched."""
    import pytest

    from tpify.io import CheckpointError

    model = tpify.parallelize(_model(0), tp_size=1)
    opt, sched = _train_step(model)
    save_checkpoint(tmp_path / "ckpt", model, [opt], [sched], extra={"step": 1})
    (shard,) = sorted((tmp_path / "ckpt").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    other, other_opt, other_sched = _fresh(5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated: {size // 2:,} bytes, its \.metadata places "
                                              rf"data up to byte [\d,]+; .*resume from an earlier checkpoint"):
        load_checkpoint(tmp_path / "ckpt", other, [other_opt], [other_sched])
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing"):
        load_checkpoint(tmp_path / "ckpt", other, [other_opt], [other_sched])
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"\x80\x04junk")
    with pytest.raises(CheckpointError, match=r"cannot read .*\.metadata .*resume from an earlier checkpoint"):
        load_checkpoint(tmp_path / "ckpt", other, [other_opt], [other_sched])
