"""convert_gguf never leaves a half-written directory and refuses to clobber one."""

import pytest

from tpify.cli.demo_models import cache_dir, convert_gguf, smollm2_gguf_path


def test_bad_gguf_leaves_nothing(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)  # a header with nothing behind it
    out = tmp_path / "out" / "model"
    with pytest.raises(Exception):
        convert_gguf(bad, out)
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == [], "the temporary directory must be removed"


def test_missing_and_existing(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_gguf(smollm2_gguf_path(), tmp_path / "out")
    monkeypatch.setenv("TPIFY_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
