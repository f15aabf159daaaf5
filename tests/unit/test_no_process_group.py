"""``tpify.parallelize(model)`` in a process without ``torch.distributed`` runs at tp 1 and says so,
once per process (a ``logging`` warning of ``tpify.mesh``): the usual cause is a script started
with ``python`` instead of ``torchrun``. ``tp_size=1`` says that one process is meant: nothing
is logged."""

import logging

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import tpify
from tpify import mesh


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                      eos_token_id=0))


def test_parallelize_without_a_process_group_says_so_once(monkeypatch, caplog):
    assert not dist.is_initialized()
    monkeypatch.setattr(mesh, "_said_no_process_group", [])  # a fresh process
    caplog.set_level(logging.WARNING, logger="tpify")
    tpify.parallelize(_gpt2(), tp_size=1)
    assert not caplog.records, "tp_size=1 asked for: nothing to say"
    model = tpify.parallelize(_gpt2())
    assert model.tp_info.tp_size == 1
    tpify.parallelize(_gpt2())
    said = [r for r in caplog.records if r.name == "tpify.mesh"]
    assert [r.getMessage() for r in said] == [mesh.NO_PROCESS_GROUP], "once per process"
    assert said[0].levelno == logging.WARNING
    assert "torchrun --nproc-per-node" in said[0].getMessage() and "tp_size=1" in said[0].getMessage()
