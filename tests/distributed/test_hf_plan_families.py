"""transformers' own TP plans (tpify/hf_plan/) and ``tpify draft`` recipes, proved exact at tp = 2.

ONE spawned job (tests/tputil.spawn, 2 gloo ranks) runs :func:`tpify.authoring.checks.check_case` for:

* six decoder families that ship no tpify recipe but have a ``base_model_tp_plan``, each through
  ``tpify.parallelize(model)`` with no recipe argument, so the import path of ``tpify/api.py`` is
  what runs (and its one-line notice is checked): qwen3 (tied embeddings, per-head ``q_norm`` /
  ``k_norm`` found by construction), olmo2 (HF gathers q/k/v: replicated attention, split MLP),
  granite (embedding / residual / attention / logits multipliers), starcoder2 (biases, ``c_fc`` /
  ``c_proj``), cohere (tied, ``logit_scale``), glm (packed ``gate_up_proj`` gathered by HF:
  replicated); plus qwen3's sequence classification head (``score`` replicated);
* draft recipes written by ``tpify draft`` (TOML, read back from the file): gpt2 (no HF plan:
  traced; packed ``c_attn``, ``divide = ["split_size"]``), llama (from the HF plan), stablelm
  (no HF plan: traced; ``divide = ["num_heads", "num_key_value_heads"]``), opt (traced), and glm
  traced on purpose (the trace splits the packed ``gate_up_proj`` as ``packed_colwise``, parts 2,
  which HF's plan keeps gathered).

Negative control in the same job: glm's imported recipe with HF's ``colwise_gather_output`` /
``rowwise_split_input`` read as plain ``colwise`` / ``rowwise`` (what a naive import would do)
passes validation but splits the packed ``[gate | up]`` contiguously (rank 0 holds all of gate):
its logits must FAIL, silently wrong numbers caught. This is why the import maps them to
``replicate``.

MoE experts imported (a second spawned job, its own fixture): HF's ``moe_tp_experts`` module with
its ``packed_colwise`` / ``rowwise`` (or, transposed, ``packed_rowwise`` / ``colwise``) parameter
rules becomes one ``experts`` rule, through ``tpify.parallelize(model)`` with no recipe:
granitemoe (concatenated ``[gate | up]`` (E, 2I, H), parts 2, router ``block_sparse_moe.router``
replicated), glm4_moe (shared experts column / row as HF marks them, dense first layer), llama4_text
(transposed experts (E, H, 2I): ``gate_up_proj`` split along dim 2, ``down_proj`` along dim 1;
a shared expert). Every case's loss includes the router aux loss (``output_router_logits``) where
the config declares one.

What newer plans hold that the import now expresses (a third spawned job, ``FEATURE_CASES``, each
family used only while its plan has the property): a linear attention HF keeps whole with its
conv1d (qwen3_5_text), per-head q/k norms split with the heads (cohere, ``use_qk_norm``), identity
experts counted once (longcat_flash), shared experts HF all-reduces (inkling_text), a rotary-key
norm beside latent attention whose gradient is summed (dots3_note_text), a row layer without a
split input kept whole (glm5_next_text); with negative controls (identity experts counted on
every rank, the rotary-key norm's gradient left partial) that must fail. Refusals kept by name
(pure, no spawn): doge and embedding_gemma2_text, whose plans are not the dense model.

Each case compares, against the dense float64 model: every output with a left-padding mask,
the ``labels=`` loss, every gathered gradient, greedy ``generate`` (identical token ids), and a
save / sharded-load round trip. Tolerance ``atol=1e-10, rtol=1e-9`` (tpify.authoring.compare.ATOL/RTOL): in
float64 only the order of the sums differs (~1e-16 relative, <= ~1e-13 over 2 layers); a wrong
shard or a size not divided gives errors >= 1e-3 or a shape error.
"""

import warnings

import pytest

import tputil

# One spawned job proving six families and five drafts (about 40 s): the full suite's.
pytestmark = pytest.mark.slow

HF_PLAN_CASES = {  # label -> (model_type, task, config changes)
    "qwen3": ("qwen3", "causal-lm", {"tie_word_embeddings": True}),
    "qwen3 seq-cls": ("qwen3", "sequence-classification", {}),
    "olmo2": ("olmo2", "causal-lm", {}),
    "granite": ("granite", "causal-lm", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                         "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    "starcoder2": ("starcoder2", "causal-lm", {}),
    "cohere": ("cohere", "causal-lm", {}),
    "glm": ("glm", "causal-lm", {}),
}
# draft label -> (model_type, method asked, method expected): "auto" picks the HF plan when there is one.
DRAFT_CASES = {"gpt2": ("gpt2", "auto", "trace"), "llama": ("llama", "auto", "hf-plan"),
               "stablelm": ("stablelm", "auto", "trace"), "opt": ("opt", "auto", "trace"),
               "glm traced": ("glm", "trace", "trace")}


def _config(model_type, changes):
    from tpify.authoring.small import small_config
    from tpify.authoring.target import resolve_config

    config = small_config(resolve_config(model_type), (2,))
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def _naive_glm_recipe():
    """glm's imported recipe with HF's gathered pair taken as plain colwise / rowwise."""
    import torch

    from tpify.authoring.target import head_classes
    from tpify.hf_plan import import_hf_plan

    with torch.device("meta"):
        model = head_classes("glm")["causal-lm"](_config("glm", {}))
    data = import_hf_plan(model).data
    for rule in data["rule"]:
        if rule["match"] == "layers.*.mlp.gate_up_proj":
            rule["style"] = "colwise"
        if rule["match"] == "layers.*.mlp.down_proj":
            rule["style"] = "rowwise"
    return data


def _body(rank, world, drafts, workdir):
    from transformers.utils import logging as hf_logging

    import torch

    from tpify.authoring.target import head_classes
    from tpify.hf_plan import recipe_from_hf_plan
    from tpify.recipe import available_recipes
    from tpify.authoring.checks import check_case

    hf_logging.set_verbosity_error()
    out = {}
    for label, (model_type, task, changes) in HF_PLAN_CASES.items():
        cls = head_classes(model_type)[task]
        recipe = None  # parallelize's own choice: the imported plan (no shipped recipe)
        if model_type in available_recipes():  # shipped since: pass the imported plan explicitly
            with torch.device("meta"):
                recipe = recipe_from_hf_plan(cls(_config(model_type, changes)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = check_case(cls, _config(model_type, changes), world, recipe=recipe, workdir=workdir,
                              target=label, task=task)
        notices = sorted({str(w.message) for w in caught if "no shipped recipe" in str(w.message)})
        out[label] = (rows, notices)
    naive = _naive_glm_recipe()
    rows = check_case(head_classes("glm")["causal-lm"], _config("glm", {}), world, recipe=naive, workdir=workdir,
                      target="naive glm", task="causal-lm")
    out["naive glm"] = (rows, [])
    for label, path in drafts.items():
        model_type = DRAFT_CASES[label][0]
        cls = head_classes(model_type)["causal-lm"]
        rows = check_case(cls, _config(model_type, {}), world, recipe=path, workdir=workdir,
                          target=f"draft {label}", task="causal-lm")
        out[f"draft {label}"] = (rows, [])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tpify.authoring.draft import draft

    tmp = tmp_path_factory.mktemp("hf_plan")
    drafts = {}
    for label, (model_type, method, expected) in DRAFT_CASES.items():
        d = draft(model_type, method=method)
        assert d.method == expected, (label, d.method)
        if label == "glm traced":
            gate_up = next(r for r in d.data["rule"] if r["match"] == "layers.*.mlp.gate_up_proj")
            assert (gate_up["style"], gate_up.get("parts")) == ("packed_colwise", 2), gate_up
        path = tmp / f"{label.replace(' ', '_')}.toml"
        path.write_text(d.toml())
        drafts[label] = str(path)
    per_rank = tputil.spawn(_body, 2, drafts, str(tmp / "work"), timeout=900)
    return per_rank[0]


def _assert_rows(label, rows):
    """Every row passed (print the table: the measured differences)."""
    from tpify.authoring.verify_report import VerifyReport

    report = VerifyReport(rows=rows)
    print(report.format_table())
    assert report.ok, f"{label}:\n{report.format_table(failures_only=True)}"


@pytest.mark.parametrize("label", list(HF_PLAN_CASES))
def test_imported_hf_plan_is_exact(results, label):
    rows, notices = results[label]
    _assert_rows(label, rows)
    checks = " | ".join(r.check for r in rows)
    assert "forward" in checks and "gradients" in checks and "labels= loss" in checks, checks
    if HF_PLAN_CASES[label][1] == "causal-lm":
        assert "generate" in checks, checks
    model_type = HF_PLAN_CASES[label][0]
    from tpify.recipe import available_recipes

    if model_type in available_recipes():
        pytest.skip(f"{model_type} ships a recipe now: the imported plan was passed explicitly (checked above)")
    assert any(n.startswith(f"tpify: no shipped recipe for {model_type}; using transformers' base_model_tp_plan "
                            f"(imported, ") for n in notices), notices


@pytest.mark.parametrize("label", list(DRAFT_CASES))
def test_draft_recipe_is_exact(results, label):
    rows, _ = results[f"draft {label}"]
    _assert_rows(f"draft {label}", rows)
    checks = " | ".join(r.check for r in rows)
    assert "generate" in checks and "gradients" in checks, checks


def test_naive_gathered_pair_is_caught(results):
    """HF's gathered packed pair read as plain colwise / rowwise is silently wrong: caught."""
    rows, _ = results["naive glm"]
    logits = next(r for r in rows if r.check == "forward logits")
    print(f"measured: naive glm import, max |logits - dense| = {logits.max_diff:.3g}")
    assert not logits.passed and logits.max_diff > 1e-3, logits


MOE_CASES = {  # label -> (model_type, task, config changes, the experts rule's params expected)
    "granitemoe": ("granitemoe", "causal-lm", {"output_router_logits": True},
                   {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}}),
    "glm4_moe": ("glm4_moe", "causal-lm", {}, {"gate_up_proj": {"dim": 1, "parts": 2}, "down_proj": {"dim": 2}}),
    "llama4_text": ("llama4_text", "causal-lm", {}, {"gate_up_proj": {"dim": 2, "parts": 2}, "down_proj": {"dim": 1}}),
}


def _imported(model_type, changes):
    import torch

    from tpify.authoring.target import head_classes
    from tpify.hf_plan import import_hf_plan

    with torch.device("meta"):
        return import_hf_plan(head_classes(model_type)["causal-lm"](_config(model_type, changes)))


def _moe_body(rank, world, workdir):
    from transformers.utils import logging as hf_logging

    from tpify.authoring.checks import check_case
    from tpify.authoring.target import head_classes

    hf_logging.set_verbosity_error()
    out = {}
    for label, (model_type, task, changes, _) in MOE_CASES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = check_case(head_classes(model_type)[task], _config(model_type, changes), world, workdir=workdir,
                              target=label, task=task)
        out[label] = (rows, sorted({str(w.message) for w in caught if "no shipped recipe" in str(w.message)}))
    return out


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    return tputil.spawn(_moe_body, 2, str(tmp_path_factory.mktemp("hf_moe") / "work"), timeout=600)[0]


@pytest.mark.parametrize("label", list(MOE_CASES))
def test_imported_moe_experts_are_exact(moe_results, label):
    """HF's moe_tp_experts plan imported as one 'experts' rule: outputs, loss, gradients, generate exact."""
    model_type, _, changes, params = MOE_CASES[label]
    experts = [r for r in _imported(model_type, changes).data["rule"] if r.get("style") == "experts"]
    assert [r["params"] for r in experts] == [params], experts
    rows, notices = moe_results[label]
    _assert_rows(label, rows)
    checks = " | ".join(r.check for r in rows)
    assert "gradients" in checks and "labels= loss" in checks and "generate" in checks, checks
    assert any(n.startswith(f"tpify: no shipped recipe for {model_type}; ") for n in notices), notices


def _plan_has(model_type, predicate) -> bool:
    """Whether the installed transformers knows ``model_type`` and its TP plan has the property."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return False
    return bool(predicate(dict(getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None) or {})))


def _styled(plan, style, part=""):
    return any(v == style and part in k for k, v in plan.items())


# What transformers' newer plans hold that the import now expresses (issue 31), each proved exact at
# tp = 2 through tpify.parallelize(model) with no recipe (the import), on the family named, which is
# used only while its plan has the property (else the case is skipped: the tests do not depend on
# which model types transformers gives a plan). label -> (model_type, the plan's property, task,
# config changes, what the imported recipe holds).
FEATURE_CASES = {
    "linear attention whole (conv1d)": (
        "qwen3_5_text", lambda p: _styled(p, "colwise_gather_output", "linear_attn."), "causal-lm", {},
        lambda rules: any(r["match"] == "layers.*.linear_attn.conv1d" and r["style"] == "replicate" for r in rules)),
    "per-head q/k norms": (
        "cohere", lambda p: _styled(p, "colwise", "q_proj"), "causal-lm", {"use_qk_norm": True},
        lambda rules: {r["match"] for r in rules if r.get("style") == "per_head"}
        == {"layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"}),
    "identity experts": (
        "longcat_flash", lambda p: _styled(p, "moe_identity_expert"), "causal-lm", {},
        lambda rules: any(r.get("identity_from") for r in rules)),
    "shared experts all-reduced": (
        "inkling_text", lambda p: _styled(p, "all_reduce"), "causal-lm", {},
        lambda rules: any(r["match"] == "layers.*.mlp.shared_experts" and r["style"] == "experts" for r in rules)),
    "rotary-key norm beside latent attention": (
        "dots3_note_text", lambda p: _styled(p, "mla_kv_a_proj") and _styled(p, "replicated_with_grad_allreduce"),
        "causal-lm", {}, lambda rules: any(r.get("style") == "replicate_sum_grads" for r in rules)),
    "row layer without a split input": (
        "glm5_next_text", lambda p: _styled(p, "mla_kv_a_proj") and _styled(p, "rowwise", "self_attn.o_proj"), "base",
        {}, lambda rules: any(r.get("style") == "replicate" and "o_proj" in str(r["match"]) for r in rules)),
}
# Negative controls (same job): the imported recipe without what the case needs must FAIL.
#   identity experts: the experts rule without identity_from (identity experts counted tp times);
#   rotary-key norm: the norm replicated without summing its gradient (partial per rank).
FEATURE_CONTROLS = {"identity experts": ("forward logits", lambda r: {k: v for k, v in r.items() if k != "identity_from"}),
                    "rotary-key norm beside latent attention": (
                        "gradients", lambda r: {**r, "style": "replicate"} if r.get("style") == "replicate_sum_grads"
                        else r)}


def _feature_body(rank, world, workdir):
    import torch
    from transformers.utils import logging as hf_logging

    from tpify.authoring.checks import check_case
    from tpify.authoring.target import head_classes
    from tpify.hf_plan import import_hf_plan
    from tpify.recipe import Recipe

    hf_logging.set_verbosity_error()
    out = {}
    for label, (model_type, has, task, changes, _) in FEATURE_CASES.items():
        if not _plan_has(model_type, has):
            continue
        cls = head_classes(model_type)[task]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = check_case(cls, _config(model_type, changes), world, workdir=workdir, target=label, task=task)
        out[label] = (rows, sorted({str(w.message) for w in caught if "no shipped recipe" in str(w.message)}))
        if label in FEATURE_CONTROLS:
            with torch.device("meta"):
                imported = import_hf_plan(cls(_config(model_type, changes)))
            data = {**imported.data, "rule": [FEATURE_CONTROLS[label][1](r) for r in imported.data["rule"]]}
            rows = check_case(cls, _config(model_type, changes), world, recipe=Recipe.from_dict(data, "control"),
                              workdir=workdir, target=f"{label} (control)", task=task)
            out[f"{label} (control)"] = (rows, [])
    return out


@pytest.fixture(scope="module")
def feature_results(tmp_path_factory):
    return tputil.spawn(_feature_body, 2, str(tmp_path_factory.mktemp("hf_features") / "work"), timeout=900)[0]


@pytest.mark.parametrize("label", list(FEATURE_CASES))
def test_newer_plan_features_import_exact(feature_results, label):
    """Each of :data:`FEATURE_CASES` through the import: the imported rules hold what the feature
    needs, and every check passes (outputs, loss, gradients, generate, save/load); its negative
    control (:data:`FEATURE_CONTROLS`) fails where the feature is left out."""
    model_type, has, task, changes, holds = FEATURE_CASES[label]
    if not _plan_has(model_type, has):
        pytest.skip(f"the installed transformers gives {model_type} no plan with this property")
    imported = _imported_task(model_type, task, changes)
    assert holds(imported.data["rule"]), imported.data["rule"]
    rows, notices = feature_results[label]
    _assert_rows(label, rows)
    assert any(n.startswith(f"tpify: no shipped recipe for {model_type}; ") for n in notices), notices
    if label in FEATURE_CONTROLS:
        check, _ = FEATURE_CONTROLS[label]
        caught = [r for r in feature_results[f"{label} (control)"][0] if r.check.startswith(check)]
        print(f"measured: {label} left out: {[(r.check, r.max_diff) for r in caught]}")
        assert caught and not all(r.passed for r in caught), caught


def _imported_task(model_type, task, changes):
    import torch

    from tpify.authoring.target import head_classes
    from tpify.hf_plan import import_hf_plan

    with torch.device("meta"):
        return import_hf_plan(head_classes(model_type)[task](_config(model_type, changes)))


@pytest.mark.parametrize("model_type, reason", [("doge", r"dt_proj reads the values of ALL KV heads.*match = "
                                                          r"\"layers.\*.self_attn\", style = \"replicate\""),
                                                ("embedding_gemma2_text", r"a single KV head.*style = \"replicate\"")])
def test_plan_that_is_not_the_dense_model_is_refused_by_name(model_type, reason):
    """The families tpify refuses by name (hf_plan._REFUSED_FAMILIES: HF's plan is not the dense
    model), each message saying what to write instead."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from tpify.authoring.target import family_head_classes
    from tpify.recipe import RecipeError

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"the installed transformers does not know {model_type}")
    import torch

    from tpify.hf_plan import import_hf_plan

    config = _config(model_type, {})
    with torch.device("meta"):
        model = next(iter(family_head_classes(config).values()))(config)
    with pytest.raises(RecipeError, match=reason):
        import_hf_plan(model)
