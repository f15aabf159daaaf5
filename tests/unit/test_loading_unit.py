"""Single-process checks of tpify.api's loading and saving and tpify.io: key mapping, dtype, buffers, atomic save.

Everything here runs at tp=1 without torch.distributed; the sharded paths are covered by
tests/distributed/test_loading.py. Comparisons are bitwise (``torch.equal``): loading and saving
move bytes, they compute nothing.
"""

import hashlib
import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification, BertModel

import tpify


def _bert_base(tmp_path: Path, vocab_size: int = 100) -> tuple[BertModel, Path]:
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                     vocab_size=vocab_size, max_position_embeddings=32)
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
    half = tpify.from_pretrained(path, dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(half.state_dict()[k], v.to(torch.bfloat16)), k
    # A base checkpoint in a head class: prefix added, the head initialised (replicated), warned.
    import pytest

    with pytest.warns(UserWarning, match="newly initialized"):
        head = tpify.from_pretrained(path, model_class=BertForSequenceClassification)
    assert torch.equal(head.bert.embeddings.word_embeddings.weight, model.embeddings.word_embeddings.weight)
    assert not head.classifier.weight.is_meta


def test_bfloat16_model_saves_config_dtype_bfloat16(tmp_path):
    """A float32 checkpoint loaded with dtype=torch.bfloat16, or a parallelized model converted with
    .to(torch.bfloat16): save_pretrained writes bfloat16 tensors and ``"dtype": "bfloat16"`` in
    config.json (as transformers' own save_pretrained), so plain transformers reloads it in
    bfloat16 (it used to say float32: a reload at twice the memory), bitwise the saved tensors."""
    import json

    from transformers import AutoModel

    model, path = _bert_base(tmp_path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    loaded = tpify.from_pretrained(path, dtype=torch.bfloat16)
    assert loaded.config.dtype == torch.bfloat16  # as transformers' from_pretrained records it
    converted = tpify.parallelize(BertModel(model.config).eval(), tp_size=1).to(torch.bfloat16)
    converted.load_state_dict(model.state_dict())
    for name, tp_model in (("loaded", loaded), ("converted", converted)):
        tpify.save_pretrained(tp_model, tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == "bfloat16", name
        back = AutoModel.from_pretrained(tmp_path / name)
        assert back.dtype == torch.bfloat16, name
        for k, v in model.state_dict().items():
            want = v.to(torch.bfloat16) if v.is_floating_point() else v
            assert torch.equal(back.state_dict()[k], want), (name, k)
    assert converted.config.dtype in ("float32", torch.float32)  # the save writes the dtype, the model's config is as it was


def test_from_pretrained_takes_dtype_and_torch_dtype_is_deprecated(tmp_path):
    """``dtype=`` (transformers 5's name) loads in that dtype; ``torch_dtype=`` still does, with a
    FutureWarning at the caller's line; both given is a ValueError naming both."""
    import warnings

    _, path = _bert_base(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert tpify.from_pretrained(path, dtype=torch.bfloat16).embeddings.word_embeddings.weight.dtype == torch.bfloat16
        assert tpify.from_pretrained(path, dtype="float64").pooler.dense.weight.dtype == torch.float64
    with pytest.warns(FutureWarning, match="torch_dtype is deprecated, use dtype=") as seen:
        old = tpify.from_pretrained(path, torch_dtype=torch.bfloat16)
    assert old.pooler.dense.weight.dtype == torch.bfloat16
    assert [w.filename for w in seen if w.category is FutureWarning] == [__file__]
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 and torch_dtype=torch.float16 both given"):
        tpify.from_pretrained(path, dtype=torch.bfloat16, torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype='int8' is not a floating dtype"):
        tpify.from_pretrained(path, dtype="int8")


_INTERRUPTED = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import BertConfig, BertModel
    import tpify
    from tpify.io import save
    real = save.save_file
    def slow(*a, **k):
        real(*a, **k)
        print("wrote", flush=True)
        time.sleep(30)  # the parent kills us here, mid-save
    save.save_file = slow
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


def test_save_keeps_files_it_does_not_own(tmp_path):
    """Saving into a model directory replaces the weights and config only: the tokenizer, notes,
    logs and Trainer checkpoints stay; weight shards of an earlier save that the new one does not
    write are removed; a symlinked target stays a symlink. Also what HF's own
    ``model.save_pretrained`` does on a parallelized model (it is tpify's save)."""
    model, path = _bert_base(tmp_path)
    (path / "tokenizer.json").write_text("{}")
    (path / "NOTES.txt").write_text("keep me")
    (path / "logs").mkdir()
    (path / "logs" / "run.txt").write_text("log")
    (path / "checkpoint-2").mkdir()
    (path / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    par = tpify.from_pretrained(path)
    with torch.no_grad():
        par.embeddings.word_embeddings.weight.add_(1.0)
    par.save_pretrained(path)  # HF's method on a parallelized model: tpify's dense save
    assert (path / "NOTES.txt").read_text() == "keep me" and (path / "tokenizer.json").exists()
    assert (path / "logs" / "run.txt").exists() and (path / "checkpoint-2").is_dir()
    assert not (path / "model-00001-of-00002.safetensors").exists(), "stale shard of an older save"
    again = BertModel.from_pretrained(path)
    assert torch.equal(again.embeddings.word_embeddings.weight, par.embeddings.word_embeddings.weight)
    link = tmp_path / "link"
    link.symlink_to(path, target_is_directory=True)
    tpify.save_pretrained(par, link, max_shard_size="4KB")
    assert link.is_symlink() and (path / "model.safetensors.index.json").exists()
    assert not (path / "model.safetensors").exists(), "the single-file weights of the previous save"
    assert (path / "NOTES.txt").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p], "nothing left beside"


def test_unclear_arguments_are_named():
    """tp_size=True, an index whose weight_map is null, torch_dtype="float33" / "int8": each
    error names the argument or the file and the fix."""
    import json

    import pytest

    with pytest.raises((ValueError, tpify.PlanError), match="tp_size must be a positive integer, got True"):
        tpify.parallelize(BertModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                               intermediate_size=32, vocab_size=100)), tp_size=True)
    from tpify.io.files import Snapshot as _Snapshot, _weight_files
    from tpify.meta_model import resolve_dtype as _resolve_dtype

    for bad in ("float33", "int8"):
        with pytest.raises(ValueError, match=f"torch_dtype='{bad}' is not a floating dtype"):
            _resolve_dtype(None, torch.float32, bad)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors.index.json").write_text(json.dumps({"weight_map": None}))
        with pytest.raises(tpify.CheckpointError, match="'weight_map' must map tensor names to file names"):
            _weight_files(_Snapshot(Path(d)))


def test_tp_model_hf_methods():
    """resize_token_embeddings after parallelize raises before changing anything; state_dict
    returns the (here tp=1, full) shards; save_pretrained(state_dict=...) is refused."""
    import pytest

    from tpify.integrations import TPUsageError

    model = tpify.parallelize(BertModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                   intermediate_size=32, vocab_size=100)), tp_size=1)
    with pytest.raises(TPUsageError, match="resize the dense model first|Resize the dense model first"):
        model.resize_token_embeddings(120)
    assert model.embeddings.word_embeddings.num_embeddings == 100
    with pytest.raises(TPUsageError, match="state_dict="):
        model.save_pretrained("/nonexistent", state_dict={})


_RESAVER = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import BertConfig, BertModel
    import tpify
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                         vocab_size=500, max_position_embeddings=32)
        models.append(tpify.parallelize(BertModel(cfg), tp_size=1))
    end = time.time() + float(sys.argv[2])
    i = 0
    print("ready", flush=True)
    while True:  # at least one save
        tpify.save_pretrained(models[i % 2], sys.argv[1], max_shard_size="20KB")
        i += 1
        if time.time() >= end:
            break
    print(i, flush=True)
""")


@pytest.mark.slow  # about 8 s of concurrent saves; the kill-at-every-step test (test_save_swap.py) is quick
def test_load_during_concurrent_resaves_sees_one_checkpoint(tmp_path):
    """A process re-saves two different models into one directory (many shard files) as fast as
    it can while this one loads it again and again: every load holds one model whole, never a mix
    of the two (each file of a save carries its save id and the load keeps every file open from
    its headers to its last slice), and the target is never missing."""
    from transformers import BertConfig

    path = tmp_path / "ckpt"
    script = tmp_path / "resave.py"
    script.write_text(_RESAVER)
    refs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                         vocab_size=500, max_position_embeddings=32)
        refs.append({k: v for k, v in BertModel(cfg).state_dict().items()})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    subprocess.run([sys.executable, str(script), str(path), "0"], check=True, env=env, capture_output=True)
    proc = subprocess.Popen([sys.executable, str(script), str(path), "20"], stdout=subprocess.PIPE, env=env)
    loads, seen = 0, set()
    try:
        assert proc.stdout.readline().strip() == b"ready"
        while proc.poll() is None and loads < 30:
            assert path.is_dir(), "the target went missing during a save"
            model = tpify.from_pretrained(path)
            state = model.state_dict()
            which = [i for i, ref in enumerate(refs) if all(torch.equal(state[k], v) for k, v in ref.items())]
            assert len(which) == 1, "a load mixed tensors of two saves"
            seen.add(which[0])
            loads += 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert loads >= 5 and seen == {0, 1}, (loads, seen)
    print(f"measured: {loads} loads during concurrent re-saves, models seen {sorted(seen)}")


# ---- zero-copy views of the checkpoint's mapping (tpify/io/reader.py, _Reader)

def test_views_are_private_and_outlive_a_resave(tmp_path):
    """Shards loaded as views of the file's mapping (the 20000 x 16 float32 embedding, 1.2 MiB, is
    above the 1 MiB view threshold): writing them leaves the file unchanged
    (copy-on-write); a save over the directory (os.replace) leaves the loaded values unchanged;
    each shard's storage is its own bytes only; disable_mmap=True loads the same bits."""
    model, path = _bert_base(tmp_path, vocab_size=20000)
    file = path / "model.safetensors"
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    loaded = tpify.from_pretrained(path)
    copied = tpify.from_pretrained(path, disable_mmap=True)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v) and torch.equal(copied.state_dict()[k], v), k
    for p in loaded.parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    weight = loaded.embeddings.word_embeddings.weight
    buf = io.BytesIO()
    torch.save(weight.detach(), buf)
    assert buf.tell() < weight.numel() * weight.element_size() + 4096, "torch.save writes the shard only"
    with torch.no_grad():
        weight.add_(1.0)
    assert hashlib.sha256(file.read_bytes()).hexdigest() == digest, "a write reached the file"
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    torch.manual_seed(5)
    other = tpify.parallelize(BertModel(model.config).eval(), tp_size=1)
    tpify.save_pretrained(other, path)  # replaces model.safetensors (a new file, os.replace)
    assert hashlib.sha256(file.read_bytes()).hexdigest() != digest
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed when the file was replaced"


def test_single_range_shards_are_views_strided_ones_too(tmp_path):
    """At tp = 2, rank 1: a split of dimension 0 (column-parallel ``nn.Linear``) is a contiguous
    view, a split of dimension 1 (row-parallel ``nn.Linear``) a strided view of the same mapping,
    each holding exactly its slice, with storage spanning only its own first to last element;
    writes to either stay private; packed parts and padded rows, which are not one range of the
    file, and small tensors are copied (contiguous, own storage)."""
    from tpify.io.files import Snapshot as _Snapshot, _headers
    from tpify.io.reader import _Reader
    from tpify.sharding import ShardSpec

    rows, cols = 512, 1024  # 2 MiB of float32: above the 1 MiB view threshold
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    small = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    save_file({"w": dense, "small": small}, str(tmp_path / "model.safetensors"))
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    snap = _Snapshot(tmp_path)
    headers, _ = _headers(snap, {"w": "model.safetensors", "small": "model.safetensors"})
    reader = _Reader(snap, headers, tp_rank=1)
    col = reader.read("w", ShardSpec(0, (rows,), 2), None)
    row = reader.read("w", ShardSpec(1, (cols,), 2), None)
    packed = reader.read("w", ShardSpec(1, (512, 256, 256), 2), None)
    padded = reader.read("w", ShardSpec(0, (rows,), 2, padded_size=516), None)
    copied = reader.read("small", ShardSpec(1, (16,), 2), None)
    assert torch.equal(col, dense[256:]) and col.is_contiguous()
    assert col.untyped_storage().nbytes() == col.numel() * 4
    assert torch.equal(row, dense[:, 512:]) and row.stride() == (cols, 1) and not row.is_contiguous()
    assert row.untyped_storage().nbytes() == ((rows - 1) * cols + 512) * 4, "from its first element to its last"
    assert row.untyped_storage().data_ptr() == col.untyped_storage().data_ptr() - 256 * cols * 4 + 512 * 4, \
        "the same mapping: no copy"
    assert torch.equal(packed, torch.cat([dense[:, 256:512], dense[:, 640:768], dense[:, 896:]], dim=1))
    assert torch.equal(padded[:254], dense[258:]) and not padded[254:].any()
    assert torch.equal(copied, small[:, 8:])
    for t in (packed, padded, copied):
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * 4
    with torch.no_grad():  # (col and row overlap here, one rank would not hold both)
        row.add_(1.0)  # also writes rank 0's half of the pages it shares: private copies, not the file
        assert torch.equal(row, dense[:, 512:] + 1.0)
        col.mul_(2.0)
    assert torch.equal(col[:, :512], 2.0 * dense[256:, :512])
    assert hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest() == digest
    reader.close()
    snap.close()
