"""Single-process checks of tpify.loading: key mapping, dtype, buffers, atomic save.

Everything here runs at tp=1 without torch.distributed; the sharded paths are covered by
tests/distributed/test_loading.py. Comparisons are bitwise (``torch.equal``): loading and saving
move bytes, they compute nothing.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification, BertModel

import tpify


def _bert_base(tmp_path: Path) -> tuple[BertModel, Path]:
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                     vocab_size=100, max_position_embeddings=32)
    model = BertModel(cfg).eval()
    path = tmp_path / "base"
    model.save_pretrained(path)
    return model, path


def test_legacy_names_prefix_dtype_buffers(tmp_path):
    """Legacy LayerNorm.gamma/beta keys and an added ``bert.`` prefix load as transformers maps them;
    torch_dtype converts; non-persistent buffers equal those transformers builds."""
    model, path = _bert_base(tmp_path)
    state = load_file(path / "model.safetensors")
    legacy = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text((path / "config.json").read_text())
    save_file(legacy, str(tmp_path / "legacy" / "model.safetensors"), metadata={"format": "pt"})
    loaded = tpify.from_pretrained(tmp_path / "legacy")  # prefix stripped, gamma/beta renamed
    assert type(loaded) is BertModel
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ref = BertModel.from_pretrained(path).eval()
    for name, buf in ref.named_buffers():
        assert torch.equal(loaded.get_buffer(name), buf), name
    half = tpify.from_pretrained(path, torch_dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(half.state_dict()[k], v.to(torch.bfloat16)), k
    # A base checkpoint in a head class: prefix added, the head initialised (replicated), warned.
    import pytest

    with pytest.warns(UserWarning, match="newly initialized"):
        head = tpify.from_pretrained(path, model_class=BertForSequenceClassification)
    assert torch.equal(head.bert.embeddings.word_embeddings.weight, model.embeddings.word_embeddings.weight)
    assert not head.classifier.weight.is_meta


_INTERRUPTED = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import BertConfig, BertModel
    import tpify
    from tpify import loading
    real = loading.save_file
    def slow(*a, **k):
        real(*a, **k)
        print("wrote", flush=True)
        time.sleep(30)  # the parent kills us here, mid-save
    loading.save_file = slow
    torch.manual_seed(1)
    cfg = BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                     vocab_size=100, max_position_embeddings=32)
    model = tpify.parallelize(BertModel(cfg), tp_size=1)
    tpify.save_pretrained(model, sys.argv[1], max_shard_size="4KB")
""")


def test_interrupted_save_keeps_previous(tmp_path):
    """SIGKILL during save_pretrained: the previous checkpoint at the target is untouched and loads."""
    model, path = _bert_base(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    script = tmp_path / "save.py"
    script.write_text(_INTERRUPTED)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"wrote", "the save never started writing"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p for p in os.listdir(tmp_path) if p.startswith(".base.tmp-")], "the partial save lives beside"
    again = BertModel.from_pretrained(path)
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
