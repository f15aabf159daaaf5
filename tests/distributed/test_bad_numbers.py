"""Numbers out of any sane range are refused on every rank, before any allocation or collective,
with an error naming the argument, the range and the value."""

import pytest
import torch

import tpify
import tputil


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))


@pytest.mark.parametrize("multiple", [2**40, 2**16 + 1, 0, -8, 2.0, True])
def test_pad_vocab_multiple_out_of_range_is_a_plan_error_before_any_allocation(multiple):
    """``pad_vocab_multiple=2**40`` failed in the allocator (a table of 2**40 rows)."""
    with pytest.raises(tpify.PlanError, match=r"pad_vocab_multiple must be an integer from 1 to 65,536 .* got "):
        tpify.parallelize(_gpt2(), tp_size=1, pad_vocab_multiple=multiple)


def _both_ranks(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    import tpify

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    try:
        tpify.parallelize(model, tp_size=world, pad_vocab_multiple=2**40)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.slow  # 2 ranks, about 20 s: the check itself is local (build_layout), the quick test above has it
def test_pad_vocab_multiple_out_of_range_raises_the_same_error_on_every_rank():
    results = tputil.spawn(_both_ranks, 2)
    assert [name for name, _ in results] == ["PlanError", "PlanError"], results
    assert all("got 1,099,511,627,776" in text for _, text in results), results
