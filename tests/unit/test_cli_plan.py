"""``tpify plan``: the coverage report of a recipe, computed on a meta model without ranks.

Every expected number below is worked out by hand from the GPT-2 architecture (Conv1D weights
are ``[in, out]``; ``c_attn`` packs ``[Q | K | V]``) and the Megatron split of each style, never
read back from the code under test. The figures are integers (shapes, bytes), so they are
compared exactly.
"""

import json

import pytest
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from tpify import cli
from tpify.authoring.plan import PlanReportError, plan_report, rank_shapes
from tpify.layout import ModuleLayout, PlanError

# The small GPT-2: n_layer = 2, n_embd = E = 64, n_head = 4, vocab V = 101 (odd: padded to 102 at
# tp = 2), n_positions = P = 32, inner MLP width 4E = 256. float32: 4 bytes a parameter.
SMALL = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)
E, V, P, TP = 64, 101, 32, 2

# (dense shape, per-rank shape) of every parameter of the shardable modules of one block.
BLOCK = {
    "attn.c_attn": {"weight": ([E, 3 * E], [E, 3 * E // TP]),  # [64, 192] -> [64, 96]: Q_r|K_r|V_r, 32 each
                    "bias": ([3 * E], [3 * E // TP])},  # [192] -> [96]
    "attn.c_proj": {"weight": ([E, E], [E // TP, E]),  # rowwise Conv1D: input rows split, [32, 64]
                    "bias": ([E], [E])},  # whole, added after the all-reduce
    "mlp.c_fc": {"weight": ([E, 4 * E], [E, 4 * E // TP]),  # colwise Conv1D: [64, 256] -> [64, 128]
                 "bias": ([4 * E], [4 * E // TP])},
    "mlp.c_proj": {"weight": ([4 * E, E], [4 * E // TP, E]),  # rowwise: [256, 64] -> [128, 64]
                   "bias": ([E], [E])},
}
STYLES = {"attn.c_attn": "packed_colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}

# Parameters per block, dense: ln_1 2E + c_attn (3E*E + 3E) + c_proj (E*E + E) + ln_2 2E
#   + c_fc (4E*E + 4E) + c_proj (4E*E + E) = 128 + 12480 + 4160 + 128 + 16640 + 16448 = 49984
# per rank: 128 + (6144 + 96) + (2048 + 64) + 128 + (8192 + 128) + (8192 + 64) = 25184
DENSE_BLOCK = 2 * E + (3 * E * E + 3 * E) + (E * E + E) + 2 * E + (4 * E * E + 4 * E) + (4 * E * E + E)
RANK_BLOCK = 2 * E + (3 * E * E // TP + 3 * E // TP) + (E * E // TP + E) + 2 * E \
    + (4 * E * E // TP + 4 * E // TP) + (4 * E * E // TP + E)
# Whole model: wte V*E (lm_head is the same tensor, counted once) + wpe P*E + 2 blocks + ln_f 2E.
# dense: 6464 + 2048 + 2 * 49984 + 128 = 108608 parameters = 434432 bytes
# rank:  (102/2)*64 = 3264 + 2048 + 2 * 25184 + 128 = 55808 parameters = 223232 bytes
DENSE_PARAMS = V * E + P * E + 2 * DENSE_BLOCK + 2 * E
RANK_PARAMS = (102 // TP) * E + P * E + 2 * RANK_BLOCK + 2 * E


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("small_gpt2")
    GPT2Config(**SMALL).save_pretrained(path)
    return path


def _plan(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["plan", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_small_gpt2_shapes_and_bytes_by_hand(small_dir, capsys):
    rc, out, _ = _plan(capsys, small_dir, "--tp", TP, "--json")
    assert rc == 0
    report = json.loads(out)
    assert (report["head_class"], report["tp_size"], report["dtype"]) == ("GPT2LMHeadModel", 2, "float32")
    assert (DENSE_BLOCK, RANK_BLOCK, DENSE_PARAMS, RANK_PARAMS) == (49984, 25184, 108608, 55808)

    expected = {"transformer.wte": ("embedding_rowwise", 0, {"weight": ([V, E], [51, E])}),  # 102 / 2 rows
                "transformer.wpe": ("replicate", 1, {"weight": ([P, E], [P, E])}),
                "lm_head": ("colwise_rep", 11, {"weight": ([V, E], [51, E])})}
    rules = {"attn.c_attn": 2, "attn.c_proj": 3, "mlp.c_fc": 9, "mlp.c_proj": 10}  # recipes/gpt2.toml order
    for i in range(2):
        for name, params in BLOCK.items():
            expected[f"transformer.h.{i}.{name}"] = (STYLES[name], rules[name], params)
    got = {m["fqn"]: (m["style"], m["rule"], {p["name"]: (p["dense_shape"], p["rank_shape"]) for p in m["params"]})
           for m in report["modules"]}
    assert got == expected
    by_fqn = {m["fqn"]: m for m in report["modules"]}
    assert by_fqn["transformer.wte"]["padded_size"] == 102 and by_fqn["lm_head"]["padded_size"] == 102
    assert by_fqn["transformer.h.0.attn.c_attn"]["partition_sizes"] == [E, E, E]
    assert by_fqn["lm_head"]["params"][0]["tied_to"] == ["transformer.wte.weight"]
    assert by_fqn["lm_head"]["params"][0]["counted_as"] == "transformer.wte.weight"

    mem = report["memory"]
    assert (mem["dense_params"], mem["rank_params"]) == (DENSE_PARAMS, RANK_PARAMS)
    assert (mem["dense_bytes"], mem["rank_bytes"]) == (434432, 223232) == (4 * DENSE_PARAMS, 4 * RANK_PARAMS)
    # Replicated on every rank: wpe P*E + 2 blocks * (ln_1 + ln_2 + two rowwise biases = 6E) + ln_f 2E
    #   = 2048 + 768 + 128 = 2944 parameters = 11776 bytes
    assert mem["replicated_bytes"] == 4 * (P * E + 2 * 6 * E + 2 * E) == 11776
    assert mem["ratio"] == pytest.approx(223232 / 434432, rel=1e-12)

    replicated = {r["param"]: r["reason"] for r in report["replicated"]}
    assert set(replicated) == ({"transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
                               | {f"transformer.h.{i}.{n}" for i in range(2)
                                  for n in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                                            "attn.c_proj.bias", "mlp.c_proj.bias")})
    assert "rule #1" in replicated["transformer.wpe.weight"]
    assert "rowwise" in replicated["transformer.h.0.attn.c_proj.bias"]
    assert "LayerNorm" in replicated["transformer.h.1.ln_2.weight"]

    assert sorted((d["fqn"], d["attr"], d["dense"], d["per_rank"]) for d in report["divides"]) == sorted(
        (f"transformer.h.{i}.attn", a, v, v // 2) for i in range(2) for a, v in (("num_heads", 4), ("split_size", E)))
    assert report["config_divides"] == [] and report["divisible"] == [{"name": "n_head", "value": 4}]
    # The optional cross-attention rules (#5-#8) and task heads (#12) match nothing in GPT2LMHeadModel.
    assert [u["index"] for u in report["unused_rules"]] == [5, 6, 7, 8, 12]
    assert (report["lm_head"], report["loss_kind"], report["honours_num_items"]) == ("lm_head", "causal", True)


def test_text_mentions_every_module(small_dir, capsys):
    rc, out, _ = _plan(capsys, small_dir, "--tp", TP)
    assert rc == 0
    dense = GPT2LMHeadModel(GPT2Config(**SMALL))  # the module list, independently of the meta model
    shardable = [n for n, m in dense.named_modules()
                 if isinstance(m, (nn.Linear, nn.Embedding)) or type(m).__name__ == "Conv1D"]
    assert len(shardable) == 11
    for fqn in shardable:
        assert f"  {fqn} " in out, fqn
    for layer_norm in ("transformer.h.*.ln_1.weight", "transformer.h.*.ln_2.bias", "transformer.ln_f.weight"):
        assert layer_norm in out
    assert "[51, 64]" in out and "vocab 101 padded to 102" in out
    assert "223,232 B" in out and "434,432 B" in out and "0.5138 x dense" in out
    assert "LM head: lm_head" in out and "loss: causal" in out
    assert "transformer.h.*.attn.num_heads: 4 -> 2  (x2)" in out


def test_base_model_has_no_lm_head(small_dir, capsys):
    rc, out, _ = _plan(capsys, small_dir, "--tp", TP, "--head-class", "base", "--json")
    report = json.loads(out)
    assert rc == 0 and report["head_class"] == "GPT2Model"
    assert (report["lm_head"], report["loss_kind"]) == (None, None)
    # GPT2Model: the LM head's bytes are gone, wte's stay: 108608 - 0 (lm_head tied) = same total.
    assert report["memory"]["dense_bytes"] == 434432 and report["memory"]["rank_bytes"] == 223232
    assert [u["index"] for u in report["unused_rules"]] == [5, 6, 7, 8, 11, 12]  # lm_head rule unused too


def test_recipe_and_plan_errors_exit_1(small_dir, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('model_type = "gpt2"\n[[rule]]\nmatch = "wte"\nstyle = "sideways"\n')
    rc, out, err = _plan(capsys, small_dir, "--tp", TP, "--recipe", bad)
    assert rc == 1 and out == ""
    assert "RecipeError" in err and "unknown style 'sideways'" in err and "bad.toml" in err

    rc, out, err = _plan(capsys, small_dir, "--tp", 3)  # n_head = 4
    assert rc == 1 and out == ""
    assert "PlanError" in err and "config.n_head (GPT2LMHeadModel) = 4 is not divisible by tp_size = 3" in err
    assert "tp sizes that would work for this model: [1, 2, 4]" in err

    rc, _, err = _plan(capsys, small_dir, "--tp", TP, "--head-class", "masked-lm")
    assert rc == 1 and "has no 'masked-lm' head class" in err


def test_default_gpt2_is_close_to_half(capsys):
    """GPT-2 124M (the default GPT2Config: V = 50257, P = 1024, E = 768, 12 layers) at tp = 2.

    dense: wte 50257*768 = 38,597,376 + wpe 786,432 + 12 * 7,087,872 + ln_f 1,536
        = 124,439,808 parameters = 497,759,232 bytes (lm_head is wte, counted once)
    per block, per rank: ln_1/ln_2 3,072 + c_attn 768*1152 + 1152 = 885,888 + c_proj 384*768 + 768
        = 295,680 + c_fc 768*1536 + 1536 = 1,181,184 + c_proj 1536*768 + 768 = 1,180,416 = 3,546,240
    per rank: wte (50258/2 = 25129)*768 = 19,299,072 + 786,432 + 12 * 3,546,240 + 1,536
        = 62,641,920 parameters = 250,567,680 bytes = 0.50339 x dense
    """
    block_dense = 2 * 1536 + (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    block_rank = 2 * 1536 + (768 * 1152 + 1152) + (384 * 768 + 768) + (768 * 1536 + 1536) + (1536 * 768 + 768)
    assert (block_dense, block_rank) == (7_087_872, 3_546_240)
    dense = 50257 * 768 + 1024 * 768 + 12 * block_dense + 1536
    rank = 25129 * 768 + 1024 * 768 + 12 * block_rank + 1536
    assert (dense, rank) == (124_439_808, 62_641_920)

    report = plan_report("gpt2", 2)
    assert report["head_class"] == "GPT2LMHeadModel"
    mem = report["memory"]
    assert (mem["dense_bytes"], mem["rank_bytes"]) == (4 * dense, 4 * rank) == (497_759_232, 250_567_680)
    assert round(mem["ratio"], 5) == 0.50339


def test_rank_shapes_styles():
    emb = nn.Embedding(10, 8, device="meta")
    # embedding_colwise: [num_embeddings, embedding_dim] -> [10, 8 / 2]
    assert rank_shapes(emb, ModuleLayout("t", "embedding_colwise", 0), 2) == {"weight": ((10, 8), (10, 4), True)}
    # embedding_rowwise padded: 10 rows -> 12 at tp = 4 -> 3 rows each
    assert rank_shapes(emb, ModuleLayout("t", "embedding_rowwise", 0, padded_size=12), 4)["weight"][1] == (3, 8)
    lin = nn.Linear(6, 12, device="meta")  # weight [out, in] = [12, 6]
    assert rank_shapes(lin, ModuleLayout("l", "colwise", 0), 3) == {"weight": ((12, 6), (4, 6), True),
                                                                    "bias": ((12,), (4,), True)}
    assert rank_shapes(lin, ModuleLayout("l", "rowwise", 0), 3) == {"weight": ((12, 6), (12, 2), True),
                                                                    "bias": ((12,), (12,), False)}
    # packed [8 | 2 | 2] at tp = 2: [4 | 1 | 1] = 6 rows
    assert rank_shapes(lin, ModuleLayout("l", "packed_colwise", 0, partition_sizes=[8, 2, 2]), 2)["weight"][1] == (6, 6)
    with pytest.raises(PlanReportError, match="plan does not know style 'diagonal'"):
        rank_shapes(lin, ModuleLayout("l", "diagonal", 0), 2)
    with pytest.raises(PlanReportError, match="plan does not know style 'embedding_colwise' on it"):
        rank_shapes(lin, ModuleLayout("l", "embedding_colwise", 0), 2)


def test_rank_shapes_replicated_parts():
    """Multi-query [Q | K | V] = [8 | 2 | 2] with K, V whole at tp = 2: [4 | 2 | 2] = 8 rows."""
    entry = ModuleLayout("l", "packed_colwise", 0, partition_sizes=[8, 2, 2])
    if not hasattr(entry, "replicated_parts"):
        pytest.skip("this tpify's layout has no replicated_parts")
    entry.replicated_parts = (1, 2)
    lin = nn.Linear(6, 12, device="meta")
    assert rank_shapes(lin, entry, 2) == {"weight": ((12, 6), (8, 6), True), "bias": ((12,), (8,), True)}


@pytest.mark.slow  # the default Qwen2-VL tower on the meta device: 3.4 s
def test_a_tower_without_a_standard_head_class_is_planned_with_its_own_class():
    """qwen2_vl_vision has no base / LM head class in transformers' auto classes; the plan takes
    the class the family builds from that config (Qwen2VisionTransformerPretrainedModel), as
    ``tpify verify`` does, instead of asking for ``--head-class``."""
    report = plan_report("qwen2_vl_vision", 2)
    assert report["head_class"] == "Qwen2VisionTransformerPretrainedModel"
    assert 0.50 < report["memory"]["ratio"] < 0.51


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """The small GPT-2 with n_embd = 128: row-parallel ``c_proj`` keeps 64 input rows per rank at tp 2,
    a whole quantization block (at n_embd = 64 its 32 rows would cut one)."""
    path = tmp_path_factory.mktemp("wide_gpt2")
    GPT2Config(**{**SMALL, "n_embd": 128}).save_pretrained(path)
    return path


def test_plan_quantize_bytes_by_hand(wide_dir, capsys):
    """``tpify plan --quantize nf4`` on the small GPT-2 (n_embd W = 128) at tp 2: per rank, every
    quantized layer's 4-bit codes (half a byte an element), absmax (4 bytes per block of 64) and code
    table (16 float32), what stays float32 (the plan's per-rank bytes less the quantized weights), and
    LoRA r = 8 (``A`` replicated, ``B`` split on the column-parallel ``c_attn`` / ``c_fc``; ``A`` split,
    ``B`` replicated on the row-parallel ``c_proj``s). The real shards give the same bytes at tp 2:
    tests/distributed/test_quantized.py."""
    pytest.importorskip("bitsandbytes")
    W = 128
    report = plan_report(str(wide_dir), TP, quantize="nf4", lora_r=8)
    q = report["quantized"]
    # per block, rank numel of the quantized weights: c_attn W*3W/2, c_proj W*W/2, c_fc W*4W/2, mlp.c_proj 4W*W/2
    numel = 2 * (3 * W * W + W * W + 4 * W * W + 4 * W * W) // TP
    assert q["rank"]["codes"] == numel // 2 and q["rank"]["absmax"] == numel // 64 * 4
    assert q["rank"]["code_table"] == 8 * 16 * 4 and len(q["layers"]) == 8
    assert q["rank"]["kept_bytes"] == report["memory"]["rank_bytes"] - numel * 4
    r = 8
    lora = 2 * (r * W + 3 * W // TP * r + r * W // TP + W * r + r * W + 4 * W // TP * r + r * 4 * W // TP + W * r)
    assert q["rank"]["lora_bytes"] == lora * 4 and q["quantized_ratio"] == pytest.approx(0.5, abs=2e-3)  # + a code table per rank
    with pytest.raises(PlanError, match=r"c_proj \(row-parallel"):
        plan_report(str(wide_dir), 4, quantize="nf4")  # c_proj: 128 / 4 = 32 input rows per rank, half a block
    assert cli.main(["plan", str(wide_dir), "--tp", "2", "--quantize", "nf4"]) == 0
    text = capsys.readouterr().out
    assert "QLoRA base per rank (nf4, blocks of 64; 8 quantized layers; rank 0):" in text
    assert f"codes {numel // 2:,} B" in text
