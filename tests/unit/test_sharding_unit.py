"""tpify.sharding in one process: ShardSpec, divide, pad_vocab_size, valid_tp_sizes, shard_spec_of.

What it proves, for tp sizes 1, 2 and 4 and without starting any rank:

* ``ShardSpec.ranges`` of all ranks tile the dense dimension exactly once (plain, packed
  ``[Q | K | V]`` of equal and unequal widths, padded vocabularies, a rank that holds only padding);
* ``slice_dense`` gives rank ``r`` exactly those ranges (packed: ``[Q_r | K_r | V_r]``), zero
  padding rows, a new tensor (never a view of the dense one), for dims 0 and 1;
* ``gather`` reassembles the dense, unpacked, unpadded tensor from every rank's shard. The
  all-gather itself is replaced by an in-process stand-in that concatenates the shards of all
  simulated ranks along the last dim in rank order (its real behaviour at tp=2 is proven in
  test_comm_unit.py, and ``gather`` over a real group in test_layers_unit.py);
* ``read`` (the loader's path) returns the same bytes as ``slice_dense`` from a safetensors file,
  converts the dtype, zero-fills padding, and requests from the file only this rank's ranges, in
  blocks of at most ``block_bytes``;
* the constructor, ``local_shape``, ``divide``, ``pad_vocab_size`` and ``valid_tp_sizes`` validate
  and compute what their docstrings say;
* uneven splits (``uneven=True``): each part's ranges are ``torch.chunk``'s pieces (the last ranks
  fewer, or none), the local size depends on the rank (``local_size`` refuses to answer),
  ``slice_dense``/``read``/``gather`` round-trip bitwise, the gather sending every rank's shard
  padded to the largest (equal sizes, as NCCL needs) and stripping it; LoRA factors follow.

Tolerance: none; every comparison is bitwise (``torch.equal``), since slicing, padding, reading
and gathering move values and compute nothing.
"""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tpify import comm
from tpify.sharding import (ShardSpec, chunk_range, column_specs, divide, lora_factor_spec, pad_vocab_size, row_spec,
                            shard_spec_of, valid_tp_sizes)


def _dense(shape, dtype=torch.float64):
    """A tensor whose every value is distinct (its flat index + 1), so any misplaced value shows."""
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=dtype).reshape(shape)


# (spec, dense shape) pairs covering the layouts the layers create.
SPECS = [
    (ShardSpec(0, (8,), 2), (8, 3)),                       # column-parallel nn.Linear weight
    (ShardSpec(1, (6,), 2), (5, 6)),                       # row-parallel nn.Linear / column Conv1D
    (ShardSpec(1, (4, 4, 4), 2), (3, 12)),                 # GPT-2 c_attn Conv1D [Q | K | V]
    (ShardSpec(0, (16, 8, 8), 2), (32, 5)),                # GQA q/k/v of unequal widths
    (ShardSpec(0, (16, 8, 8), 4), (32, 5)),
    (ShardSpec(0, (7,), 2, padded_size=8), (7, 3)),        # padded vocab, padding on the last rank
    (ShardSpec(0, (5,), 4, padded_size=8), (5, 2)),        # rank 3 holds padding only
    (ShardSpec(0, (7,), 2, padded_size=8), (7,)),          # a padded bias (1-D)
    (ShardSpec(0, (6,), 1), (6, 2)),                       # tp = 1: the whole tensor
    (ShardSpec(0, (16, 4, 4), 2, replicated=(1, 2)), (24, 3)),  # multi-query [Q | K | V], K and V whole
    (ShardSpec(1, (8, 2, 2), 4, replicated=(1, 2)), (3, 12)),   # the same, Conv1D layout, tp = 4
]
IDS = [f"dim{s.dim}-parts{'x'.join(map(str, s.parts))}-tp{s.tp_size}-pad{s.padded_size}-{len(sh)}d"
       + (f"-rep{'x'.join(map(str, s.replicated))}" if s.replicated else "") for s, sh in SPECS]


def _expected_shard(spec, full, rank):
    """Rank ``rank``'s shard, written out from the definition (independent of ranges())."""
    idx = []
    if spec.padded_size is None:
        offset = 0
        for i, size in enumerate(spec.parts):
            if i in spec.replicated:  # kept whole on every rank
                idx += range(offset, offset + size)
            else:
                chunk = size // spec.tp_size
                idx += range(offset + rank * chunk, offset + (rank + 1) * chunk)
            offset += size
    else:
        chunk = spec.padded_size // spec.tp_size
        idx += [i for i in range(rank * chunk, (rank + 1) * chunk) if i < spec.parts[0]]
    moved = full.movedim(spec.dim, 0)
    rows = moved[idx] if idx else moved[:0]
    pad = spec.local_size - len(idx)
    if pad:
        rows = torch.cat([rows, torch.zeros((pad,) + tuple(moved.shape[1:]), dtype=full.dtype)])
    return rows.movedim(0, spec.dim)


@pytest.mark.parametrize("spec,shape", SPECS, ids=IDS)
def test_ranges_of_all_ranks_tile_the_dense_dimension_once(spec, shape):
    covered = []
    for rank in range(spec.tp_size):
        ranges = spec.ranges(rank)
        assert all(0 <= a < b <= spec.global_size for a, b in ranges), ranges
        held = sum(b - a for a, b in ranges)
        assert held <= spec.local_size
        if spec.padded_size is None:
            assert held == spec.local_size, "an unpadded shard has no padding rows"
        covered += [i for a, b in ranges for i in range(a, b)]
    replicated = [i for a, b in spec.ranges(0) for i in range(a, b)
                  if any(sum(spec.parts[:j]) <= i < sum(spec.parts[:j + 1]) for j in spec.replicated)]
    split = sorted(i for i in covered if i not in replicated)
    assert split == sorted(set(range(spec.global_size)) - set(replicated)), "every split index on exactly one rank"
    assert sorted(i for i in covered if i in replicated) == sorted(replicated * spec.tp_size), \
        "every index of a replicated part on every rank"


@pytest.mark.parametrize("spec,shape", SPECS, ids=IDS)
def test_slice_dense_gives_each_rank_its_parts_and_zero_padding(spec, shape):
    full = _dense(shape)
    for rank in range(spec.tp_size):
        shard = spec.slice_dense(full, rank)
        assert tuple(shard.shape) == spec.local_shape(full.shape)
        assert shard.is_contiguous()
        assert torch.equal(shard, _expected_shard(spec, full, rank)), f"rank {rank}"


def test_slice_dense_packs_each_part_separately_for_gpt2_qkv():
    # c_attn of GPT-2 with hidden 4: Conv1D weight [4, 12] = [Q | K | V] along dim 1.
    q, k, v = _dense((4, 4)), _dense((4, 4)) + 100, _dense((4, 4)) + 200
    full = torch.cat([q, k, v], dim=1)
    spec = ShardSpec(1, (4, 4, 4), 2)
    assert torch.equal(spec.slice_dense(full, 0), torch.cat([q[:, :2], k[:, :2], v[:, :2]], dim=1))
    assert torch.equal(spec.slice_dense(full, 1), torch.cat([q[:, 2:], k[:, 2:], v[:, 2:]], dim=1))


def test_slice_dense_returns_a_new_tensor_not_a_view():
    for spec, shape in [(ShardSpec(0, (4,), 1), (4, 2)), (ShardSpec(0, (4,), 2), (4, 2)),
                        (ShardSpec(0, (4, 2), 2), (6, 2))]:
        full = _dense(shape)
        before = full.clone()
        spec.slice_dense(full, 0).fill_(-1)
        assert torch.equal(full, before), f"{spec}: writing the shard changed the dense tensor"


def test_slice_dense_keeps_dtype_and_meta_device():
    spec = ShardSpec(0, (7,), 2, padded_size=8)
    assert spec.slice_dense(_dense((7, 3), torch.bfloat16), 1).dtype == torch.bfloat16
    meta = spec.slice_dense(torch.empty(7, 3, device="meta"), 1)
    assert meta.device.type == "meta" and tuple(meta.shape) == (4, 3)


def _fake_all_gather(tensor, group):
    """Stand-in for comm.all_gather_last_dim: ``group`` is (every rank's shard, spec.dim)."""
    shards, dim = group
    return torch.cat([s.movedim(dim, -1) for s in shards], dim=-1)


@pytest.mark.parametrize("spec,shape", SPECS, ids=IDS)
def test_gather_restores_the_dense_tensor_from_every_rank_shard(spec, shape, monkeypatch):
    monkeypatch.setattr(comm, "all_gather_last_dim", _fake_all_gather)
    full = _dense(shape)
    shards = [spec.slice_dense(full, r) for r in range(spec.tp_size)]
    for rank in range(spec.tp_size):
        out = spec.gather(shards[rank], (shards, spec.dim))
        assert torch.equal(out, full), f"rank {rank}"
        assert out.is_contiguous()


def test_gather_with_one_rank_and_no_process_group_is_the_identity():
    full = _dense((6, 4))
    for spec in (ShardSpec(0, (6,), 1), ShardSpec(1, (1, 3), 1)):
        assert torch.equal(spec.gather(spec.slice_dense(full, 0), None), full)


def test_local_shape_sizes_and_ranges_of_known_layouts():
    assert ShardSpec(0, (8,), 2).local_shape((8, 3)) == (4, 3)
    assert ShardSpec(1, (16, 8, 8), 4).local_shape(torch.Size([5, 32])) == (5, 8)
    padded = ShardSpec(0, (50257,), 2, padded_size=50258)
    assert (padded.global_size, padded.local_size) == (50257, 25129)
    assert padded.local_shape((50257, 32)) == (25129, 32)
    assert padded.ranges(0) == [(0, 25129)] and padded.ranges(1) == [(25129, 50257)]
    assert ShardSpec(0, (5,), 4, padded_size=8).ranges(3) == [], "a rank of padding only reads nothing"
    packed = ShardSpec(0, (16, 8, 8), 2)
    assert packed.ranges(1) == [(8, 16), (20, 24), (28, 32)]


def test_local_shape_rejects_a_tensor_of_the_wrong_size():
    with pytest.raises(ValueError, match="dimension 0 has size 9, expected 8"):
        ShardSpec(0, (8,), 2).local_shape((9, 3))
    with pytest.raises(ValueError, match="expected 8"):
        ShardSpec(0, (8,), 2).slice_dense(torch.zeros(9, 3), 0)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dim=0, parts=(7,), tp_size=2), "not divisible by tp_size = 2"),
    (dict(dim=0, parts=(8, 3), tp_size=2), "not divisible"),
    (dict(dim=0, parts=(4, 4), tp_size=2, padded_size=8), "cannot also be packed"),
    (dict(dim=0, parts=(7,), tp_size=2, padded_size=9), "must be a multiple of 2"),
    (dict(dim=0, parts=(7,), tp_size=2, padded_size=6), ">= 7"),
])
def test_constructor_rejects_unsplittable_layouts(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ShardSpec(**kwargs)


class _RecordingSlice:
    """A safetensors slice that records every index the reader asks for."""

    def __init__(self, inner):
        self.inner, self.requests = inner, []

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.requests.append(index)
        return self.inner[index]


@pytest.mark.parametrize("spec,shape", SPECS, ids=IDS)
def test_read_from_safetensors_equals_slice_dense_and_reads_only_this_rank_ranges(spec, shape, tmp_path):
    full = _dense(shape, torch.float32)
    path = tmp_path / "w.safetensors"
    save_file({"w": full}, str(path))
    row_bytes = 4 * max(1, full.numel() // full.shape[spec.dim])
    with safe_open(str(path), framework="pt") as f:
        for rank in range(spec.tp_size):
            for block_bytes, dtype in [(1 << 24, None), (row_bytes, torch.float64), (2 * row_bytes, None)]:
                sl = _RecordingSlice(f.get_slice("w"))
                out = spec.read(sl, rank, dtype=dtype, block_bytes=block_bytes)
                expected = spec.slice_dense(full, rank).to(dtype or torch.float32)
                assert out.dtype == expected.dtype
                assert torch.equal(out, expected), f"rank {rank}, block_bytes {block_bytes}"
                # Only this rank's ranges, each request at most block_bytes of rows along spec.dim.
                rows_per_block = max(1, block_bytes // row_bytes)
                asked = []
                for index in sl.requests:
                    assert all(s == slice(None) for d, s in enumerate(index) if d != spec.dim)
                    s = index[spec.dim]
                    assert s.stop - s.start <= rows_per_block, (s, block_bytes)
                    asked += range(s.start, s.stop)
                wanted = [i for a, b in spec.ranges(rank) for i in range(a, b)]
                assert asked == wanted, f"rank {rank} read rows {asked}, holds {wanted}"


def test_divide_is_exact_or_raises_naming_the_value():
    assert divide(12, 4) == 3
    assert divide(0, 2) == 0
    with pytest.raises(ValueError, match="in_features = 10 is not divisible by tp_size = 4"):
        divide(10, 4, "in_features")


def test_pad_vocab_size_is_the_least_multiple_of_multiple_times_tp():
    assert pad_vocab_size(50257, 1) == 50257
    assert pad_vocab_size(50257, 2) == 50258
    assert pad_vocab_size(50257, 4) == 50260
    assert pad_vocab_size(50258, 2) == 50258, "already divisible: no padding"
    assert pad_vocab_size(50257, 2, multiple=128) == 50432  # Megatron's 128 * tp
    assert pad_vocab_size(30522, 8, multiple=128) == 30720
    for v in range(1, 40):
        for tp in (1, 2, 3, 4, 8):
            p = pad_vocab_size(v, tp)
            assert p % tp == 0 and v <= p < v + tp, (v, tp, p)


def test_valid_tp_sizes_are_the_common_divisors_up_to_limit():
    assert valid_tp_sizes(12) == [1, 2, 3, 4, 6, 12]
    assert valid_tp_sizes(12, 8) == [1, 2, 4]
    assert valid_tp_sizes(32, 8, 8) == [1, 2, 4, 8]
    assert valid_tp_sizes(7, 5) == [1]
    assert valid_tp_sizes(256) == [1, 2, 4, 8, 16, 32, 64], "capped at limit=64"
    assert valid_tp_sizes(256, limit=16) == [1, 2, 4, 8, 16]
    assert valid_tp_sizes() == [1]


def test_shard_spec_of_reads_the_attribute_or_none():
    spec = ShardSpec(0, (4,), 2)
    p = torch.nn.Parameter(torch.zeros(2, 3))
    assert shard_spec_of(p) is None, "a parameter without a spec is replicated"
    p.tp_shard_spec = spec
    assert shard_spec_of(p) is spec
    assert shard_spec_of(torch.zeros(3)) is None
    with pytest.raises(Exception):  # frozen dataclass: a spec cannot be changed behind a parameter
        spec.tp_size = 4


def test_replicated_parts_are_located_in_the_shard_and_validated():
    spec = ShardSpec(0, (16, 4, 4), 4, replicated=(1, 2))
    assert spec.local_size == 4 + 4 + 4
    assert spec.replicated_local_ranges() == [(4, 8), (8, 12)]
    assert spec.ranges(3) == [(12, 16), (16, 20), (20, 24)]
    assert ShardSpec(0, (8,), 2).replicated_local_ranges() == []
    assert ShardSpec(0, (4, 4), 2, replicated=(0, 1)).ranges(1) == [(0, 4), (4, 8)]  # k_proj alone, 1 KV head
    with pytest.raises(ValueError, match="distinct indices"):
        ShardSpec(0, (4, 4), 2, replicated=(2,))
    ShardSpec(0, (6, 3, 3), 2, replicated=(1, 2))  # a replicated part need not divide by tp
    # 2 KV heads over 4 ranks: rank r holds KV head r // 2 (HF's repeat_kv order), its gradient summed per pair
    grouped = ShardSpec(0, (16, 4, 4), 4, replicated=(1, 2), replica_shards=2)
    assert [grouped.ranges(r)[1] for r in range(4)] == [(16, 18), (16, 18), (18, 20), (18, 20)]
    assert grouped.replica_group_size == 2 and grouped.replicated_local_ranges() == [(4, 6), (6, 8)]
    with pytest.raises(ValueError, match="replica_shards = 3 must divide tp_size = 4"):
        ShardSpec(0, (12,), 4, replicated=(0,), replica_shards=3)


# ---------------------------------------------------------------------------------------------
# Uneven splits (``uneven=True``): torch.chunk's rule, a rank-dependent local size, the gather
# padded to the largest shard (equal sizes per rank, as NCCL's all-gather needs) and stripped.

# (spec, dense shape): an MLP's 37 at tp 2 and 4 (Linear column, Conv1D column / row), packed
# [gate | up] of 37 each at tp 3, fused experts (E, 2I, H) with I = 6 at tp 4 (2, 2, 2, 0: rank 3
# holds nothing), 1 feature at tp 2 (rank 1 holds nothing), and a divisible size (split evenly).
UNEVEN = [
    (ShardSpec(0, (37,), 2, uneven=True), (37, 3)),
    (ShardSpec(1, (37,), 4, uneven=True), (5, 37)),
    (ShardSpec(1, (37, 37), 3, uneven=True), (4, 74)),
    (ShardSpec(1, (6, 6), 4, uneven=True), (3, 12, 2)),
    (ShardSpec(2, (6,), 4, uneven=True), (3, 2, 6)),
    (ShardSpec(0, (1,), 2, uneven=True), (1, 2)),
    (ShardSpec(0, (8,), 2, uneven=True), (8, 3)),
]
UNEVEN_IDS = [f"dim{s.dim}-parts{'x'.join(map(str, s.parts))}-tp{s.tp_size}" for s, _ in UNEVEN]


def _chunks(size, tp):
    """torch.chunk's pieces of ``range(size)`` for ``tp`` ranks (the ranks past the last chunk: empty)."""
    pieces = [c.tolist() for c in torch.arange(size).chunk(tp)] if size else []
    return pieces + [[]] * (tp - len(pieces))


def test_uneven_ranges_are_torch_chunk_pieces_of_each_part():
    for size in range(0, 23):
        for tp in (1, 2, 3, 4, 5, 8):
            spec = ShardSpec(0, (size,), tp, uneven=True)
            for rank, piece in enumerate(_chunks(size, tp)):
                (a, b), = spec.ranges(rank)
                assert list(range(a, b)) == piece, (size, tp, rank)
                assert spec.local_size_of(rank) == len(piece)
                assert chunk_range(size, tp, rank) == (a, b)
    packed = ShardSpec(0, (37, 37), 3, uneven=True)
    assert [packed.ranges(r) for r in range(3)] == [[(0, 13), (37, 50)], [(13, 26), (50, 63)], [(26, 37), (63, 74)]]
    assert packed.local_sizes() == [26, 26, 22]


def test_uneven_local_size_depends_on_the_rank_and_local_size_says_so():
    spec = ShardSpec(0, (37,), 4, uneven=True)
    assert spec.local_sizes() == [10, 10, 10, 7] and not spec.is_uniform
    assert spec.local_shape((37, 5), 3) == (7, 5)
    with pytest.raises(ValueError, match=r"uneven: the ranks hold \[10, 10, 10, 7\]; .*local_size_of\(tp_rank\)"):
        spec.local_size
    with pytest.raises(ValueError, match="local_size_of"):
        spec.local_shape((37, 5))
    even = ShardSpec(0, (8,), 2, uneven=True)  # a divisible size: split as without uneven
    assert even.is_uniform and even.local_size == 4 and even.ranges(1) == ShardSpec(0, (8,), 2).ranges(1)


@pytest.mark.parametrize("spec,shape", UNEVEN, ids=UNEVEN_IDS)
def test_uneven_slice_dense_gives_each_rank_its_chunks(spec, shape):
    full = _dense(shape)
    moved = full.movedim(spec.dim, 0)
    for rank in range(spec.tp_size):
        idx, offset = [], 0
        for size in spec.parts:  # from the definition: torch.chunk of each part, in order
            idx += [offset + i for i in _chunks(size, spec.tp_size)[rank]]
            offset += size
        want = (moved[idx] if idx else moved[:0]).movedim(0, spec.dim)
        shard = spec.slice_dense(full, rank)
        assert tuple(shard.shape) == spec.local_shape(full.shape, rank) and shard.is_contiguous()
        assert torch.equal(shard, want), f"rank {rank}"


def _fake_padded_all_gather(shards, dim, rank):
    """Stand-in for comm.all_gather_last_dim on ``rank``: checks that this rank sends its shard
    padded to the largest (every rank the same size) and returns every rank's, padded alike."""
    width = max(s.shape[dim] for s in shards)

    def padded(s):
        pad = list(s.shape)
        pad[dim] = width - s.shape[dim]
        return torch.cat([s, torch.zeros(pad, dtype=s.dtype)], dim=dim).movedim(dim, -1)

    def gather(tensor, group):
        assert tensor.shape[-1] == width, f"rank {rank} sent {tensor.shape[-1]} values along the split, not {width}"
        assert torch.equal(tensor, padded(shards[rank])), "the shard padded with zeros at its end"
        return torch.cat([padded(s) for s in shards], dim=-1)

    return gather


@pytest.mark.parametrize("spec,shape", UNEVEN, ids=UNEVEN_IDS)
def test_uneven_gather_pads_to_the_largest_shard_and_strips(spec, shape, monkeypatch):
    full = _dense(shape)
    shards = [spec.slice_dense(full, r) for r in range(spec.tp_size)]
    for rank in range(spec.tp_size):
        monkeypatch.setattr(comm, "all_gather_last_dim", _fake_padded_all_gather(shards, spec.dim, rank))
        out = spec.gather(shards[rank], None)
        assert torch.equal(out, full) and out.is_contiguous(), f"rank {rank}"


@pytest.mark.parametrize("spec,shape", UNEVEN, ids=UNEVEN_IDS)
def test_uneven_read_from_safetensors_equals_slice_dense(spec, shape, tmp_path):
    full = _dense(shape, torch.float32)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for rank in range(spec.tp_size):
            sl = _RecordingSlice(f.get_slice("w"))
            out = spec.read(sl, rank, dtype=torch.float64, block_bytes=8)
            assert torch.equal(out, spec.slice_dense(full, rank).double()), f"rank {rank}"
            asked = [i for index in sl.requests for i in range(index[spec.dim].start, index[spec.dim].stop)]
            assert asked == [i for a, b in spec.ranges(rank) for i in range(a, b)], f"rank {rank} read {asked}"


def test_uneven_specs_of_the_layers_and_their_lora_factors():
    weight, bias = column_specs(37, 2, "conv1d", uneven=True)
    assert (weight.dim, bias.dim, weight.uneven, bias.local_sizes()) == (1, 0, True, [19, 18])
    row = row_spec(37, 4, uneven=True)
    assert row.dim == 1 and row.local_sizes() == [10, 10, 10, 7]
    which, spec = lora_factor_spec(row, True, 37)
    assert which == "lora_A" and spec == ShardSpec(1, (37,), 4, uneven=True)
    which, spec = lora_factor_spec(weight, False, 16)
    assert which == "lora_B" and spec == ShardSpec(0, (37,), 2, uneven=True)
    with pytest.raises(ValueError, match="= 37 is not divisible by tp_size = 2"):
        row_spec(37, 2)  # without uneven: refused as before


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dim=0, parts=(7,), tp_size=2, padded_size=8, uneven=True), "cannot also be padded"),
    (dict(dim=0, parts=(8, 3), tp_size=2, replicated=(1,), uneven=True), "hold replicated parts"),
])
def test_uneven_is_neither_padded_nor_replicated(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ShardSpec(**kwargs)
