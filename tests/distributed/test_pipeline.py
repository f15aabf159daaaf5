"""Pipeline stages (``tpify.pipeline``) against the single-process dense model, float64.

One spawned job of 4 gloo ranks runs every check (spawning costs seconds): GPT-2 (tied head,
learned positions) and Llama (untied, GQA) at pp 2 x FSDP2 dp_shard 2 (GPipe, 1F1B; ranks 0-1
hold stage 0, ranks 2-3 stage 1, each parameter split over the two), pp 4 (1F1B), pp 2 with two
virtual stages per rank x FSDP2 dp_shard 2 (interleaved 1F1B); GPT-2 at pp 2 x dp_replicate 2
with torch's composable ``replicate`` (DDP's semantics), Llama at pp 2 x HSDP (2 x 1), and Llama
at pp 2 x tp 2 (1F1B); with data-parallel replicas each takes its half of the global batch (the
dense model sees the whole); each the loss and every gradient of the first step, then 3 AdamW
steps with clipping, and the tied embedding's gradient equal on the first and last stage (both
compared with the dense one); the zero-bubble schedules (their backward split into input and
weight passes): GPT-2 at pp 2 x tp 2 (InterleavedZeroBubble), Llama at pp 2 x FSDP2 and GPT-2 at
pp 2 x tp 2 with the chunked loss (ZBVZeroBubble, stages in a V: GPT-2's tied embedding and head on
one rank), Llama + LoRA and GPT-2 with gradient checkpointing at pp 2 x tp 2 (DualPipeV); under FSDP2, HSDP and ``replicate`` the dense save
(``tpify.pipeline.save_pretrained``) loaded by plain transformers equals the dense model after the
3 steps. Tolerance: float64 sums in another order (~1e-16); tputil.F64
(atol 1e-10) leaves room for the 3 AdamW steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests import tputil

pytestmark = pytest.mark.slow

B, T, M = 8, 6, 4


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=4, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      use_sliding_window=True, sliding_window=3, max_window_layers=2, tie_word_embeddings=False,
                      layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])
    return Qwen2ForCausalLM(cfg)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                        experts_implementation="eager")
    return MixtralForCausalLM(cfg)


LORA = dict(r=4, lora_alpha=8, init_lora_weights="gaussian",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _dense_loss(ref, ids, labels):
    logits = ref(input_ids=ids).logits  # (B, T, V) float64; HF's own loss would compute in float32
    target = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _batch(vocab, seed, rows=B):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored targets: the count is the whole batch's
    labels[5, 2] = -100
    labels[rows - 1, 1:] = -100  # the replicas' halves hold different counts
    return ids, labels


def _full(t):
    """A tensor whole: a DTensor (FSDP2's, sharded over dp_shard; replicate's) gathered, a plain one as it is."""
    from tpify.sharding import is_dtensor

    return t.full_tensor() if t is not None and is_dtensor(t) else t


def _case(make, mesh_args, schedule, n_virtual, tp, checkpointing=False, lora=False, chunk=None, dp=None,
          save_root=None):
    import peft

    import tpify
    import tpify.pipeline as pp
    from torch.distributed.tensor import Replicate, Shard
    from tpify.integrations import get_peft_model
    from tpify.mesh import dp_mesh

    torch.manual_seed(0)
    ref = make().double()
    mesh = tpify.init_mesh(tp, **mesh_args, device_type="cpu")
    model = copy.deepcopy(ref)
    if tp > 1:
        model = tpify.parallelize(model, mesh=mesh)
    if checkpointing:  # HF's, inside each decoder layer (tpify's own method on a parallel model)
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:  # the adapters alike on both (one seed); the stages cut from the HF model PEFT adapted in place
        torch.manual_seed(1)
        ref = peft.get_peft_model(ref, peft.LoraConfig(**LORA)).base_model.model
        torch.manual_seed(1)
        model = (get_peft_model(model, peft.LoraConfig(**LORA)) if tp > 1 else
                 peft.get_peft_model(model, peft.LoraConfig(**LORA))).base_model.model
    sched = pp.pipeline(model, mesh, schedule=schedule, n_microbatches=M, n_virtual=n_virtual, lm_loss_chunk=chunk,
                        data_parallel=dp)
    del model
    stages = pp.stages_of(sched)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    trained = [p for p in pp.parameters(sched) if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    vocab = ref.config.vocab_size
    what = (f"{type(ref).__name__} {mesh_args} tp {tp}{f' {dp}' if dp else ''} {schedule} x{n_virtual}"
            f"{' checkpointing' * checkpointing}"
            f"{' LoRA' * lora}{f' lm_loss_chunk {chunk}' if chunk else ''}")
    worst = [0.0]

    def close(got, want, msg):
        torch.testing.assert_close(got, want, **tputil.F64, msg=msg)
        worst[0] = max(worst[0], float((got.detach() - want.detach()).abs().max()))
    replicas, replica = dp_mesh(mesh).size(), dp_mesh(mesh).get_local_rank()
    if replicas > 1:  # the engine's DTensors: FSDP2 splits each parameter over dp_shard, replicate keeps it whole
        placements = {s.placements for st in stages for s in st.parameters()}
        assert placements == ({(Shard(0),)} if dp == "fsdp" and "dp_replicate" not in mesh_args else
                              {(Replicate(), Shard(0))} if dp == "fsdp" else {(Replicate(),)}), (what, placements)
    for it in range(3):
        ids, labels = _batch(vocab, it, B * replicas)  # the global batch; each dp replica its B rows
        want = _dense_loss(ref, ids, labels)
        want.backward()
        ids, labels = ids[replica * B:(replica + 1) * B], labels[replica * B:(replica + 1) * B]
        loss = pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
        if last:
            close(loss, want.detach(), f"{what}: loss, step {it}")
        if it == 0:  # every gradient, before clipping
            ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
            for stage in stages:
                named = tputil.dense_named(stage.model, "grad") if tp > 1 else \
                    {n: _full(p.grad) for n, p in stage.model.named_parameters()}
                assert named, what
                assert any(g is not None for g in named.values()), what
                for n, g in named.items():
                    if ref_grads[n] is None:
                        assert g is None, f"{what}: {n} has a gradient, the dense one none"
                        continue
                    close(g, ref_grads[n], f"{what}: grad {n}")
        want_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
        norm = pp.clip_grad_norm_(sched, 0.05)
        close(norm, want_norm, f"{what}: norm, step {it}")
        ref_opt.step(); ref_opt.zero_grad()
        opt.step(); opt.zero_grad()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    if save_root is not None:  # the dense save under the engine (gathered over dp): plain transformers loads it
        from transformers import AutoModelForCausalLM

        saved = f"{save_root}/{type(ref).__name__}-{dp}-{'-'.join(f'{k}{v}' for k, v in mesh_args.items())}-{schedule}"
        pp.save_pretrained(sched, saved)
        back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64)
        for n, p in back.named_parameters(remove_duplicate=False):
            close(p, ref_params[n], f"{what}: saved {n}")
    for stage in stages:
        named = tputil.dense_named(stage.model) if tp > 1 else \
            {n: _full(p) for n, p in stage.model.named_parameters()}
        for n, p in named.items():
            close(p, ref_params[n], f"{what}: {n} after 3 AdamW steps")
    return what, worst[0]


def _job(rank, world, root):
    import tpify
    import tpify.pipeline as pp

    done = []
    for make in (_gpt2, _llama):  # pp 2 x dp_shard 2 (FSDP2): ranks 0-1 stage 0 (dp_shard 0, 1), ranks 2-3 stage 1
        done.append(_case(make, {"pp_size": 2}, "GPipe", 1, 1, dp="fsdp", save_root=root))
        done.append(_case(make, {"pp_size": 2}, "1F1B", 1, 1, dp="fsdp"))
        done.append(_case(make, {"pp_size": 4}, "1F1B", 1, 1))
        done.append(_case(make, {"pp_size": 2}, "Interleaved1F1B", 2, 1, dp="fsdp", save_root=root))
    # DDP's semantics (torch's composable replicate); HSDP (2 x 1)
    done.append(_case(_gpt2, {"pp_size": 2, "dp_replicate": 2}, "1F1B", 1, 1, dp="replicate", save_root=root))
    done.append(_case(_llama, {"pp_size": 2, "dp_replicate": 2}, "GPipe", 1, 1, dp="fsdp", save_root=root))
    done.append(_case(_llama, {"pp_size": 2}, "1F1B", 1, 2))
    done.append(_case(_gpt2, {"pp_size": 2}, "GPipe", 1, 2))
    done.append(_case(_qwen2, {"pp_size": 4}, "1F1B", 1, 1))  # sliding and full layers: the stage's layer_types
    done.append(_case(_qwen2, {"pp_size": 2}, "Interleaved1F1B", 2, 2))
    done.append(_case(_llama, {"pp_size": 2}, "1F1B", 1, 2, checkpointing=True))
    done.append(_case(_llama, {"pp_size": 2}, "1F1B", 1, 1, lora=True, dp="fsdp"))
    done.append(_case(_llama, {"pp_size": 2}, "GPipe", 1, 2, lora=True))
    done.append(_case(_mixtral, {"pp_size": 2}, "1F1B", 1, 2))
    done.append(_case(_gpt2, {"pp_size": 2}, "1F1B", 1, 2, chunk=5))  # the tied head's weight from the loss
    done.append(_case(_llama, {"pp_size": 4}, "GPipe", 1, 1, chunk="auto"))
    # the split backward (input, then weight gradients) of the zero-bubble schedules; the V placement (rank r holds
    # stages r and 2 pp - 1 - r: GPT-2's tied embedding and head on one rank, one parameter)
    done.append(_case(_gpt2, {"pp_size": 2}, "InterleavedZeroBubble", 2, 2))
    done.append(_case(_llama, {"pp_size": 2}, "ZBVZeroBubble", 2, 1, dp="fsdp"))
    done.append(_case(_gpt2, {"pp_size": 2}, "ZBVZeroBubble", 2, 2, chunk=5))
    done.append(_case(_llama, {"pp_size": 2}, "DualPipeV", 2, 2, lora=True))
    done.append(_case(_gpt2, {"pp_size": 2}, "DualPipeV", 2, 2, checkpointing=True))  # MoE: fused experts tensor-parallel in each stage
    with pytest.raises(pp.PipelineError, match="output_router_logits"):  # the aux loss is not built: refused
        m = _mixtral()
        m.config.output_router_logits = True
        pp.pipeline(m, tpify.init_mesh(1, pp_size=2, device_type="cpu"), n_microbatches=M)
    done.append(_refusals())
    return done


def _refusals():
    """Bad input raises on every rank (PipelineError where it is wrong, StepInputsError, a PipelineError and an
    AgreementError, naming it elsewhere); TP ranks given different batches, and ids out of range, raise at the
    next step on every rank; a steady-state step makes no host sync of its own and no store exchange."""
    import tpify
    import tpify.pipeline as pp
    from tpify import AgreementError

    with pytest.raises(pp.PipelineError, match=r"no data-parallel engine.*data_parallel='fsdp'.*shard_stages.*"
                                               r"data_parallel='replicate'.*replicate_stages"):
        pp.pipeline(_llama(), tpify.init_mesh(1, pp_size=2, device_type="cpu"), n_microbatches=M)  # dp_shard 2
    with pytest.raises(pp.PipelineError, match=r"V placement puts on the same rank.*use a loop schedule"):
        pp.pipeline(_gpt2(), tpify.init_mesh(1, pp_size=2, device_type="cpu"), schedule="DualPipeV", n_microbatches=M,
                    data_parallel="fsdp")  # the tied parameter would be wrapped by two stages' engines
    info = pp.split_model(_llama().double(), tpify.init_mesh(1, pp_size=2, device_type="cpu"))
    with pytest.raises(pp.PipelineError, match="no data-parallel engine"):  # the split, then no engine
        pp.build_schedule(info, "GPipe", M)
    with pytest.raises(pp.PipelineError, match="data_parallel='ddp'"):
        pp.pipeline(_llama(), tpify.init_mesh(1, pp_size=2, device_type="cpu"), n_microbatches=M, data_parallel="ddp")
    mesh = tpify.init_mesh(1, pp_size=4, device_type="cpu")
    torch.manual_seed(0)
    model = _llama().double()
    with pytest.raises(pp.PipelineError, match="8 pipeline stages but the model has 4 layers"):
        pp.pipeline(model, mesh, schedule="Interleaved1F1B", n_microbatches=4)
    with pytest.raises(pp.PipelineError, match="at least as many microbatches as stages"):
        pp.pipeline(model, mesh, schedule="1F1B", n_microbatches=2)
    with pytest.raises(pp.PipelineError, match=r"no pipeline plan.*\[pipeline\]"):
        pp.pipeline(_gpt2(), mesh, recipe={"model_type": "gpt2", "rule": [{"match": "wte", "style": "replicate"}]})
    sched = pp.pipeline(model, mesh, schedule="GPipe", n_microbatches=4)
    first = pp.stages_of(sched)[0].is_first
    last = pp.stages_of(sched)[0].is_last
    ids, labels = _batch(64, 0)
    with pytest.raises((pp.PipelineError, AgreementError), match="given on a rank that holds no first stage"):
        pp.step(sched, input_ids=ids, labels=labels if last else None)  # input_ids on every rank
    with pytest.raises(pp.PipelineError, match="multiple of n_microbatches = 4") if first or last else \
            pytest.raises(AgreementError, match="multiple of n_microbatches"):
        pp.step(sched, input_ids=ids[:6] if first else None, labels=labels[:6] if last else None)
    with pytest.raises(pp.PipelineError, match="attention_mask / position_ids are not taken"):
        pp.step(sched, input_ids=ids if first else None, labels=labels if last else None,
                attention_mask=torch.ones_like(ids))
    loss = pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)  # still usable
    assert (loss is not None) == last
    with pytest.raises(pp.PipelineError, match=r"different shapes on the first and last stage.*T from 5 to 6"):
        pp.step(sched, input_ids=ids if first else None, labels=labels[:, :5] if last else None)  # found everywhere
    _steady_state(sched, first, last, ids, labels)
    mesh = tpify.init_mesh(2, pp_size=2, device_type="cpu")
    sched = pp.pipeline(tpify.parallelize(_llama().double(), mesh=mesh), mesh, schedule="GPipe", n_microbatches=4)
    first, last = pp.stages_of(sched)[0].is_first, pp.stages_of(sched)[0].is_last
    other = (ids + mesh["tp"].get_local_rank()) % 64  # the TP ranks of the first stage given different ids
    pp.step(sched, input_ids=other if first else None, labels=labels if last else None)  # the mix: found next step
    with pytest.raises(pp.PipelineError, match=r"group\(s\) \[\[0, 1\]\] were given different input_ids or "
                                               r"labels at the previous step"):
        pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
    other = (labels + mesh["tp"].get_local_rank()) % 64  # the last stage's TP ranks given different labels
    pp.step(sched, input_ids=ids if first else None, labels=other if last else None)
    with pytest.raises(pp.PipelineError, match=r"group\(s\) \[\[2, 3\]\] were given different"):
        pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
    bad = ids.clone()
    bad[0, 0] = 64  # out of the vocabulary: embedded as zeros by every rank, raised at the next step everywhere
    pp.step(sched, input_ids=bad if first else None, labels=labels if last else None)
    from tpify.pipeline.schedule import StepInputsError

    with pytest.raises(IndexError if first else StepInputsError, match=r"out of range"):
        pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
    _steady_state(sched, first, last, ids, labels)  # tp 2: the checksums kept and compared, still no sync
    return "refusals"


def _steady_state(sched, first, last, ids, labels):
    """A steady-state ``pp.step`` makes the host syncs of torch's ``schedule.step`` alone on the same
    batch (the baseline, measured here: tpify's checks add none) and touches the store never (no
    agreement: the store's exchange is counted)."""
    import sys

    import torch.nn.functional as F

    import tpify.agree
    import tpify.pipeline as pp
    from tpify.syncs import count_host_syncs

    schedule_module = sys.modules["tpify.pipeline.schedule"]
    exchanges, real = [], tpify.agree._exchange

    def counted(*args, **kwargs):
        exchanges.append(args[0])
        return real(*args, **kwargs)

    pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)  # warm-up
    tpify.agree._exchange = counted
    try:
        with count_host_syncs() as ours:
            for _ in range(2):
                pp.step(sched, input_ids=ids if first else None, labels=labels if last else None)
    finally:
        tpify.agree._exchange = real
    assert exchanges == [], exchanges  # no store traffic per step
    assert schedule_module.agree is tpify.agree.agree
    target = F.pad(labels[:, 1:], (0, 1), value=-100) if last else None
    kwargs = {"num_items": (target != -100).sum()} if last else None
    check = sched.tpify_step_check
    with count_host_syncs() as torch_alone:  # the baseline: torch's schedule alone, same stages and batch
        for _ in range(2):
            check.begin(ids if first else None, 4)  # the embedding's record of compared ids, as in pp.step
            try:
                sched.step(*((ids,) if first else ()), target=target, losses=[] if last else None,
                           return_outputs=False, loss_kwargs=kwargs)
            finally:
                check.end()
    # what is left is the stages' own: transformers' create_causal_mask (find_packed_sequence_indices reads
    # one value per microbatch and stage); tpify's step adds none
    assert ours["total"] == torch_alone["total"] == ours["aten::_local_scalar_dense"], (dict(ours), dict(torch_alone))
    assert ours["total"] <= 2 * 4 * len(pp.stages_of(sched)), dict(ours)
    for p in pp.parameters(sched):
        p.grad = None


def test_pipeline_matches_dense(tmp_path):
    results = tputil.spawn(_job, 4, str(tmp_path), timeout=900)
    assert all(len(r) == 26 for r in results)
    cases = [c for c in results[0] if isinstance(c, tuple)]
    for i, (what, _) in enumerate(cases):  # the largest |difference| over the ranks (docs/pipeline-parallelism.md)
        print(f"{what}: {max(r[i][1] for r in results):.1e}")
