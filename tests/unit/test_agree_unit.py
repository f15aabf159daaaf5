"""tpify.agree in one process: the digests the agreement compares, its timeouts, and the
"did every rank succeed" protocols without torch.distributed.

What it proves:

* ``digest`` is a stable 12-hex-digit digest of the JSON form, independent of key order;
* ``agreement_timeout`` and ``agreement_notice`` read positive seconds from the environment
  (``inf`` included) and refuse zero, negatives, NaN and words, naming the variable;
* without a process group: ``agree`` returns ``[share]`` or re-raises this rank's error;
  ``on_writing_rank`` yields ``True`` (this process writes) and re-raises the block's own error;
  ``step_outcome`` reports this rank's outcome alone.
"""

import pytest
import torch
import torch.distributed as dist

from tpify import agree


def test_digest_is_stable_short_hex_and_ignores_key_order():
    d = agree.digest({"tp": 2, "dtype": "float32", "parts": [1, 2]})
    assert len(d) == 12 and int(d, 16) >= 0
    assert d == agree.digest({"parts": [1, 2], "dtype": "float32", "tp": 2}), "key order must not matter"
    assert d == "a235c593c439", "the digest must not change between processes or versions of Python"
    assert agree.digest({"tp": 4, "dtype": "float32", "parts": [1, 2]}) != d
    assert agree.digest({"tp": 2, "dtype": "float32", "parts": [2, 1]}) != d
    # Values JSON cannot encode are digested through str(): a dtype is its name.
    assert agree.digest({"dtype": torch.float32}) == agree.digest({"dtype": "torch.float32"})


def test_agreement_timeout_and_notice_read_positive_seconds_from_the_environment(monkeypatch):
    monkeypatch.delenv(agree.AGREEMENT_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(agree.AGREEMENT_NOTICE_ENV, raising=False)
    assert (agree.agreement_timeout(), agree.agreement_notice()) == (300.0, 30.0)
    monkeypatch.setenv(agree.AGREEMENT_NOTICE_ENV, "2.5")
    monkeypatch.setenv(agree.AGREEMENT_TIMEOUT_ENV, "inf")  # wait without limit
    assert (agree.agreement_timeout(), agree.agreement_notice()) == (float("inf"), 2.5)
    for bad in ("0", "-1", "nan", "soon"):
        monkeypatch.setenv(agree.AGREEMENT_NOTICE_ENV, bad)
        with pytest.raises(ValueError, match=f"TPIFY_AGREEMENT_NOTICE='{bad}' (must be a positive|is not a) number"):
            agree.agreement_notice()


def test_without_process_group_each_protocol_is_this_ranks_outcome():
    assert not dist.is_initialized(), "these checks need a process without torch.distributed"
    assert agree.agree("a call", {"tp": 2}, share=[0, 1]) == [[0, 1]]
    assert agree.agree("a call", {"tp": 2}) is None
    with pytest.raises(KeyError, match="mine"):
        agree.agree("a call", {}, KeyError("mine"))
    with agree.on_writing_rank("writing a file") as writing:
        assert writing is True
    with pytest.raises(OSError, match="disk full"):
        with agree.on_writing_rank("writing a file", torch.device("cpu")):
            raise OSError("disk full")
    ok = agree.step_outcome(True)
    assert (ok.failed, ok.errors, ok.ranks) == ((), frozenset(), 1)
    bad = agree.step_outcome(False, "ValueError: too wide", "ValueError")
    assert (bad.failed, bad.errors, bad.describe()) == (((0, "ValueError: too wide"),), frozenset({"ValueError"}),
                                                        "every rank: ValueError: too wide")
