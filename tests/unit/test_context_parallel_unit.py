"""Context parallelism's pure parts, in one process: the load-balanced layout, ``split_batch`` (the
label shift before the split, padding, what it refuses), the attention mask of a split sequence
against transformers' own mask of the whole one, and the mesh's size check. The model-level
equivalence with the dense model is tests/distributed/test_context_parallel.py's."""

import pytest
import torch

from tpify.context_parallel import load_balanced_index, sequence_order, split_batch
from tpify.hooks.context_parallel import ContextParallelCall
from tpify.mesh import _check_sizes


def test_each_rank_holds_a_front_and_a_back_chunk():
    assert load_balanced_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        order = sequence_order(32, cp)
        assert sorted(order.tolist()) == list(range(32))  # every token on exactly one rank
        # causal work per rank: sum over its queries of the keys each sees (q + 1): the same on every rank
        work = {sum(int(q) + 1 for q in load_balanced_index(32, cp, r)) for r in range(cp)}
        assert len(work) == 1, work
    with pytest.raises(ValueError, match="2 x cp_size = 4 equal chunks"):
        load_balanced_index(14, 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_labels_are_shifted_over_the_whole_sequence_before_the_split(cp):
    """Each rank's target of token t is the label of token t + 1 of the whole sequence: at the end of
    a chunk, that token is on another rank. Shifting after the split (HF's shift inside forward on
    each rank's tokens) gives -100 or the first token of the rank's other chunk there instead."""
    T = 8 * cp
    labels = torch.arange(100, 100 + 2 * T).view(2, T)
    labels[1, 5] = -100
    c = T // (2 * cp)
    for rank in range(cp):
        out = split_batch({"input_ids": labels - 100, "labels": labels}, cp_size=cp, cp_rank=rank)
        index = load_balanced_index(T, cp, rank)
        want = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:][:, index]
        assert torch.equal(out["shift_labels"], want)
        assert out["labels"] is out["shift_labels"]
        assert torch.equal(out["position_ids"], index[None])
        assert torch.equal(out["input_ids"], labels[:, index] - 100)
        # the last token of each chunk predicts the first of the next chunk, held by another rank (or nothing)
        for end in (c - 1, 2 * c - 1):
            g = int(index[end])
            assert out["shift_labels"][0, end] == (labels[0, g + 1] if g + 1 < T else -100)
        naive = torch.nn.functional.pad(labels[:, index], (0, 1), value=-100)[:, 1:]  # shift after the split
        assert not torch.equal(naive, out["shift_labels"])


def test_a_short_sequence_is_padded_at_the_end_and_its_padding_ignored():
    ids = torch.arange(1, 14).view(1, 13)
    parts = [split_batch({"input_ids": ids, "labels": ids}, cp_size=2, cp_rank=r, pad_token_id=0) for r in range(2)]
    index = torch.cat([load_balanced_index(16, 2, r) for r in range(2)])
    ids_all = torch.cat([p["input_ids"] for p in parts], 1)[0, torch.argsort(index)]
    target = torch.cat([p["shift_labels"] for p in parts], 1)[0, torch.argsort(index)]
    pos = torch.cat([p["position_ids"] for p in parts], 1)[0, torch.argsort(index)]
    assert ids_all.tolist() == list(range(1, 14)) + [0, 0, 0]
    assert target.tolist() == list(range(2, 14)) + [-100] * 4
    assert pos.tolist() == list(range(16))


def test_split_batch_refuses_what_it_cannot_split():
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="pads some sequences"):
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        split_batch({"input_ids": ids, "attention_mask": mask}, cp_size=2, cp_rank=0)
    assert "attention_mask" not in split_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                               cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"no rule to split \['token_type_ids'\]"):
        split_batch({"input_ids": ids, "token_type_ids": ids}, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="has shape"):
        split_batch({"input_ids": ids, "labels": ids[:, :6]}, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="not both"):
        split_batch({"input_ids": ids})
    kept = split_batch({"input_ids": ids, "num_items_in_batch": torch.tensor(7), "return_dict": True},
                       cp_size=2, cp_rank=1)
    assert int(kept["num_items_in_batch"]) == 7 and kept["return_dict"] is True


def _dense_mask(position_ids, sliding_window):
    """transformers' own boolean mask of the whole sequence (SDPA, no cache), ``(B, T, T)``."""
    from transformers import MistralConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = MistralConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, sliding_window=sliding_window)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(position_ids.shape[0], position_ids.shape[1], 8)
    make = create_causal_mask if sliding_window is None else create_sliding_window_causal_mask
    mask = make(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=position_ids,
                allow_is_causal_skip=False)
    return mask[:, 0]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_the_split_mask_is_transformers_mask_of_the_whole_sequence(cp, window):
    T = 16
    packed = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
    positions = torch.stack([packed, torch.arange(T) + 3])  # row 1: one document that does not start at 0
    dense = _dense_mask(positions, window)
    order = sequence_order(T, cp)
    gathered = positions[:, order]  # what the all-gather of every rank's position ids gives
    for rank in range(cp):
        call, ok = ContextParallelCall.from_positions(None, cp, rank, gathered)
        assert bool(ok)
        q = load_balanced_index(T, cp, rank)
        assert torch.equal(call.mask(window)[:, 0], dense[:, q][:, :, order]), (cp, window, rank)
    local = torch.cat([torch.arange(T // cp)] * cp)[None]  # positions counted from 0 on each rank
    assert not bool(ContextParallelCall.from_positions(None, cp, 0, local)[1])


def test_the_mesh_sizes_must_divide_the_world():
    _check_sizes(2, 1, 8, 2)
    with pytest.raises(ValueError, match="dp_replicate 1 x cp_size 3 x tp_size 2 = 6 does not divide the world size 8"):
        _check_sizes(2, 1, 8, 3)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        _check_sizes(2, 1, 8, 0)


def test_split_batch_tells_the_model_when_every_row_is_one_document():
    """Positions made by split_batch (no ``position_ids`` given) are one document per row, known on
    the host: the ring attention then needs no device read; packed positions carry no such flag."""
    from tpify.context_parallel import ONE_DOCUMENT_KWARG
    from tpify.hooks import cp_ring
    from tpify.hooks.context_parallel import ContextParallelCall

    ids = torch.arange(16).view(2, 8)
    plain = split_batch({"input_ids": ids}, cp_size=2, cp_rank=0)
    assert plain[ONE_DOCUMENT_KWARG] is True
    packed = split_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)},
                         cp_size=2, cp_rank=0)
    assert ONE_DOCUMENT_KWARG not in packed
    call = ContextParallelCall(None, 2, None, None, None, None)
    call.one_document = True  # the hook sets it from the flag; doc_k is never read then
    assert cp_ring._one_document(call) is True
