"""Scaling out on torch's engines: DDP, FSDP2 and HSDP over the DP dimension of a tensor-parallel
model, through the library, TPTrainer, TPAccelerator and ``tpify finetune``; two hosts.

One spawned job of 4 gloo ranks runs every check (``tputil.run_checks``). Each composition trains
a float64 Llama (2 layers, hidden 32, 4 heads / 2 KV heads, vocabulary 101, so the vocabulary is
padded at tp 2) for 3 AdamW steps with gradient accumulation 2 and clipping active, against the
dense model in one process on the full batch (each DP replica gets its half, both halves hold the
same number of labelled tokens):

* DDP x TP: dp 2 x tp 2, ``replicate_data_parallel`` (DDP over the DP group, ``no_sync`` on the
  first micro-batch), sequence parallelism on, so LayerNorm gradients come from tpify's gradient
  hooks and must be complete before DDP's reducer reads them;
* FSDP2 x TP: dp_shard 2 x tp 2, ``shard_data_parallel``, sequence parallelism on, tied embedding
  and head (one FSDP unit); then ``generate`` equals the dense model's, the save loads in plain
  transformers, the optimizer state is sharded over dp x tp;
* HSDP x TP: dp_replicate 2 x dp_shard 1 x tp 2 (``parallelize(mesh=init_mesh(2, dp_replicate=2))``,
  the only HSDP with TP that fits 4 ranks: FSDP2's replicate axis all-reduces, its shard axis has
  one rank) and dp_replicate 2 x dp_shard 2 x tp 1 (a real shard axis inside each replica);
* LoRA on FSDP2 x TP (adapters added before sharding), the saved adapter loaded by plain peft,
  ``merge_and_unload`` on the sharded model;
* FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters, fp32 reduction) passed through;
* TPTrainer with ``fsdp="full_shard"`` (FSDP version 2) against plain Trainer on the dense model,
  and its checkpoint resumed bitwise; TPAccelerator with ``ParallelismConfig(dp_shard_size=2,
  tp_size=2)`` and ``accumulate`` against plain Accelerator; ``tpify finetune`` with
  ``dp_shard=2`` against ``dp_shard=1``;
* bad input refused on every rank before any collective;
* ``check_replicas`` under FSDP2 x TP with a drift in one TP group raises on every rank.

Tolerances (float64): losses and gradient norms ``rtol=1e-9`` (summation order only: the
reduce-scatter and all-reduce sum in another order than one process); weights after the Adam
steps ``atol=1e-8, rtol=1e-6`` (Adam's ``m / (sqrt(v) + eps)`` turns ~1e-16 relative gradient
noise near eps into a few 1e-9, tests/distributed/test_dp_tp_training.py); measured maxima are
printed (``-s``) and reported in docs/scaling-out.md. Trainer logs float32 losses: rtol 1e-6.
bf16 parameters: loss ``rtol=2e-2`` (8 significant bits, rounded at other points than the dense
float32 model). ``tpify finetune`` is float32: FSDP2's reduce-scatter and DDP's all-reduce add in
another order, losses ``rtol=1e-5``.

The two-host test starts two ``torchrun --nnodes 2 --nproc-per-node 2`` launches on this machine
(c10d rendezvous on localhost): each node runs one TP group of 2, DDP over the 2 nodes.
"""

import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import tputil

pytestmark = pytest.mark.slow

F64 = dict(atol=0, rtol=1e-9)
WEIGHTS = dict(atol=1e-8, rtol=1e-6)
STEPS, GA, CLIP, LR = 3, 2, 0.3, 1e-2
HERE = Path(__file__).resolve().parent


def _llama(tie=False, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=tie)).to(dtype)


def _reference(tie=False):
    from tpify.authoring.reference import float64_loss_function

    ref = _llama(tie)
    ref.loss_function = float64_loss_function("ForCausalLM")  # HF's own upcasts to float32 only
    return ref


def _ids(step, micro, rows=4):
    return torch.randint(0, 101, (rows, 8), generator=torch.Generator().manual_seed(100 * step + micro))


def _train(c, step_model, tp_model, ref, accumulate, dp=2, clip=CLIP):
    """3 AdamW steps, GA 2, clipping: the dense ``ref`` on each whole micro-batch, each DP replica
    of ``step_model`` on its rows; ``accumulate(last)`` is the context of a micro-batch. Returns
    the largest relative difference of the clipped norms."""
    from tpify.training import clip_grad_norm_

    dp_rank, rows = c.rank // (c.world // dp), 4 // dp
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.AdamW([p for p in step_model.parameters() if p.requires_grad], lr=LR)
    worst = 0.0
    for step in range(STEPS):
        for micro in range(GA):
            ids = _ids(step, micro)
            (ref(ids, labels=ids).loss / GA).backward()
            mine = ids[dp_rank * rows:(dp_rank + 1) * rows]
            with accumulate(micro == GA - 1):
                (step_model(mine, labels=mine).loss / GA).backward()
        norm_ref = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        norm = clip_grad_norm_(tp_model, clip)
        assert norm_ref > clip, "the test must exercise clipping"
        torch.testing.assert_close(norm.double(), norm_ref, **F64, msg=f"gradient norm, step {step}")
        worst = max(worst, abs(float(norm) - float(norm_ref)) / float(norm_ref))
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    return worst


def _fsdp_sync(tp_model):
    """FSDP2's gradient accumulation: no reduce-scatter before the last micro-batch."""
    @contextlib.contextmanager
    def accumulate(last):
        tp_model.set_requires_gradient_sync(last)
        yield
    return accumulate


def _weights_match(c, tp_model, ref, what):
    """Every dense weight of ``tp_model`` (gathered over DP, then TP) against ``ref``; the max abs error."""
    got = tputil.dense_named(tp_model)
    worst = 0.0
    for name, w in ref.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(got[name], w.detach(), **WEIGHTS, msg=lambda m: f"{what} {name}: {m}")
        worst = max(worst, (got[name] - w).abs().max().item())
    return worst


def _measure(c, name, norm_rel, weights_abs):
    c.measured[name] = {"grad-norm rel": norm_rel, "weights max abs": weights_abs}


_CHECKS = {}


def _check(fn):
    _CHECKS[fn.__name__] = fn
    return fn


@_check
def ddp_x_tp_matches_dense(c):
    """DDP over the DP group (dp 2 x tp 2), sequence parallelism on: the LayerNorm gradients are
    summed over TP by tpify's tensor hooks before DDP's reducer (an AccumulateGrad post-hook) reads
    them; ``no_sync`` for the first micro-batch."""
    from torch.nn.parallel import DistributedDataParallel

    import tpify

    ref = _reference()
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2, sequence_parallel=True)
    ddp = tpify.replicate_data_parallel(par)
    assert isinstance(ddp, DistributedDataParallel)
    assert dist.get_process_group_ranks(ddp.process_group) == dist.get_process_group_ranks(par.tp_info.dp_group)
    rel = _train(c, ddp, par, ref, lambda last: contextlib.nullcontext() if last else ddp.no_sync())
    tpify.training.check_replicas(par)
    _measure(c, "DDP x TP (dp 2 x tp 2, SP)", rel, _weights_match(c, par, ref, "DDP x TP"))


@_check
def fsdp2_x_tp_matches_dense_generates_and_saves(c):
    """FSDP2 over dp_shard 2 x tp 2, sequence parallelism on, tied embedding and head."""
    from transformers import LlamaForCausalLM

    import tpify

    ref = _reference(tie=True)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2, sequence_parallel=True)
    tpify.shard_data_parallel(par)
    assert par.model.embed_tokens.weight is par.lm_head.weight, "tied weights stay one parameter"
    rel = _train(c, par, par, ref, _fsdp_sync(par))
    tpify.training.check_replicas(par)
    _measure(c, "FSDP2 x TP (dp_shard 2 x tp 2, SP, tied)", rel, _weights_match(c, par, ref, "FSDP2 x TP"))
    # generate: each DP replica its own prompt, greedy, equal to the dense model's
    par.eval()
    ref.eval()
    prompt = _ids(7, c.rank // 2, rows=1)[:, :4]
    with torch.no_grad():
        assert torch.equal(par.generate(prompt, max_new_tokens=5, do_sample=False),
                           ref.generate(prompt, max_new_tokens=5, do_sample=False))
    with tempfile.TemporaryDirectory() as out:  # gathered over DP, then TP; plain transformers loads it
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        tpify.save_pretrained(par, shared[0])
        loaded = LlamaForCausalLM.from_pretrained(shared[0], dtype=torch.float64)
        for name, w in ref.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], w, **WEIGHTS, msg=lambda m: f"{name}: {m}")
        dist.barrier()
    # The optimizer state follows the parameters: each rank holds 1/4 of every sharded matrix.
    par.train()
    opt = torch.optim.AdamW(par.parameters(), lr=LR)
    ids = _ids(9, 0, rows=2)
    par(ids, labels=ids).loss.backward()
    opt.step()
    q = par.model.layers[0].self_attn.q_proj.weight  # dense (32, 32): TP rows 16, then 8 on each DP rank
    assert opt.state[q]["exp_avg"].to_local().shape == (8, 32), opt.state[q]["exp_avg"].to_local().shape


@_check
def hsdp_x_tp_matches_dense(c):
    """HSDP: dp_replicate 2 x dp_shard 1 x tp 2 from parallelize(mesh=init_mesh(2, dp_replicate=2)),
    and dp_replicate 2 x dp_shard 2 x tp 1; the replica check compares over the replicate axis."""
    import tpify
    from torch.distributed.tensor import Replicate, Shard

    for tp, label in ((2, "HSDP x TP (dp_replicate 2 x dp_shard 1 x tp 2, SP)"),
                      (1, "HSDP (dp_replicate 2 x dp_shard 2 x tp 1)")):
        ref = _reference()
        mesh = tpify.init_mesh(tp, dp_replicate=2)
        par = tpify.parallelize(copy.deepcopy(ref), mesh=mesh, sequence_parallel=tp > 1)
        tpify.shard_data_parallel(par)
        assert par.lm_head.weight.placements == (Replicate(), Shard(0)), par.lm_head.weight.placements
        rel = _train(c, par, par, ref, _fsdp_sync(par), dp=c.world // tp)
        tpify.training.check_replicas(par)
        _measure(c, label, rel, _weights_match(c, par, ref, label))


@_check
def lora_on_fsdp2_x_tp_matches_dense_peft(c):
    """Adapters added by tpify's get_peft_model, then FSDP2: their specs are recorded by name, so
    clipping, saving and merging know their split once they are DTensors."""
    import peft

    import tpify
    from tpify.integrations import get_peft_model

    def config():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                               init_lora_weights="gaussian")

    ref = _reference(tie=True)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, config())
    torch.manual_seed(1)
    par = get_peft_model(par, config())
    tpify.shard_data_parallel(par)
    tp_model = par.base_model.model
    rel = _train(c, par, par, ref, _fsdp_sync(tp_model), clip=0.02)
    with tempfile.TemporaryDirectory() as out:
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        par.save_pretrained(shared[0])  # the dense adapter, gathered over DP then TP
        loaded = peft.PeftModel.from_pretrained(_llama(tie=True), shared[0])
        got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        worst = 0.0
        for name, w in ref.named_parameters():
            if "lora_" in name:
                torch.testing.assert_close(got[name], w.detach(), **WEIGHTS, msg=lambda m: f"{name}: {m}")
                worst = max(worst, (got[name] - w).abs().max().item())
        dist.barrier()
    _measure(c, "LoRA on FSDP2 x TP (adapters)", rel, worst)
    merged = par.merge_and_unload()  # each rank's slice of s B A into its slice of W
    ref_merged = ref.merge_and_unload()
    _weights_match(c, merged, ref_merged, "merged LoRA")


@_check
def fsdp2_mixed_precision_policy_is_passed_through(c):
    """bf16 parameters in the forward, fp32 gradient reduction, fp32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tpify

    ref = _llama(dtype=torch.float32)
    par = tpify.parallelize(copy.deepcopy(ref), tp_size=2)
    tpify.shard_data_parallel(par, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
    seen = []
    handle = par.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.dtype))
    ids = _ids(0, 0)
    loss = par(ids[2 * (c.rank // 2):][:2], labels=ids[2 * (c.rank // 2):][:2]).loss
    loss.backward()
    handle.remove()
    assert seen == [torch.bfloat16], seen
    q = par.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.float32 and q.grad.dtype == torch.float32, (q.dtype, q.grad.dtype)
    everyone = [None] * c.world
    dist.all_gather_object(everyone, float(loss))
    with torch.no_grad():
        dense = (ref(ids[:2], labels=ids[:2]).loss + ref(ids[2:], labels=ids[2:]).loss) / 2
    torch.testing.assert_close((everyone[0] + everyone[2]) / 2, float(dense), rtol=2e-2, atol=0)


@_check
def replica_drift_under_fsdp2_raises_on_every_rank(c):
    """check_replicas at dp_shard 2 x tp 2 under FSDP2 with a replicated weight drifted on rank 1 only:
    TP group [0, 1] finds it; TP group [2, 3] holds the other DP half of that weight, whose copies are
    equal, and FSDP2's DP side compares no slices, so ranks 2 and 3 used to pass and go on into the
    next collective alone. Every rank raises the same error."""
    from tpify import AgreementError
    from tpify.training import check_replicas

    import tpify

    par = tpify.parallelize(_llama(), tp_size=2)
    tpify.shard_data_parallel(par)
    check_replicas(par)
    if c.rank == 1:
        with torch.no_grad():
            par.model.norm.weight.to_local().add_(1e-7)
    drift = r"model\.norm\.weight differs between TP ranks \(ranks \[0\], ranks \[1\]\)"
    with pytest.raises(AgreementError, match=drift):
        check_replicas(par)
    dist.barrier()


def _trainer_args(out, batch, **kw):
    from transformers import TrainingArguments

    kw.setdefault("save_strategy", "no")
    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=GA,
                             max_steps=STEPS + 1, learning_rate=LR, max_grad_norm=CLIP, logging_steps=1,
                             report_to=[], seed=0, use_cpu=True, disable_tqdm=True, **kw)


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=16):
        self.ids = torch.randint(0, 101, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _log(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


@_check
def tptrainer_with_fsdp_runs_and_resumes(c):
    """TPTrainer(fsdp="full_shard", fsdp_config version 2): FSDP2 over the DP group (logs compared
    with plain Trainer in the parent); its checkpoint (the optimizer state in DCP, each rank writing its slices) resumes bitwise."""
    from accelerate.state import AcceleratorState

    import tpify
    from tpify.integrations import TPTrainer

    tputil.torchrun_env(c.rank, c.world)
    fsdp = dict(fsdp="full_shard", fsdp_config={"version": 2})

    def run(resume=None, save=False):
        model = tpify.parallelize(_llama(), tp_size=2)
        trainer = TPTrainer(model=model, args=_trainer_args(c.out + "/trainer", 2, save_strategy="steps" if save
                                                            else "no", save_steps=2, **fsdp), train_dataset=_Data())
        trainer.train(resume_from_checkpoint=resume)
        AcceleratorState._reset_state(True)
        assert any(type(p).__name__ == "DTensor" for p in model.parameters()), "TPTrainer did not shard"
        return _log(trainer), {k: v.clone() for k, v in tputil.dense_named(model).items()}

    log, weights = run(save=True)
    c.results["trainer_fsdp"] = (log, weights)
    ckpt = Path(c.out) / "trainer" / "checkpoint-2" / "tpify_optimizer"
    manifest = json.loads((ckpt / "tpify_layout.json").read_text())
    assert manifest["format"] == 2 and manifest["dp_shard"] == 2, manifest
    assert (ckpt / f"__{c.rank}_0.distcp").is_file(), "every rank writes its part of the optimizer state"
    resumed_log, resumed = run(resume=str(Path(c.out) / "trainer" / "checkpoint-2"))
    assert resumed_log[2:] == log[2:], (resumed_log, log)
    for name, w in weights.items():
        assert torch.equal(resumed[name], w), f"resumed {name} differs"


@_check
def tpaccelerator_with_parallelism_config_shards(c):
    """TPAccelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2)) with
    ``accumulate``: FSDP2 over the DP group (compared with plain Accelerator in the parent)."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState

    import tpify
    from tpify.integrations import TPAccelerator

    tputil.torchrun_env(c.rank, c.world)
    accelerator = TPAccelerator(cpu=True, gradient_accumulation_steps=GA,
                                parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    model = tpify.parallelize(_llama(), tp_size=2)
    c.results["accelerate_fsdp"] = (_accelerate_loop(accelerator, model, 2), None)
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())
    c.results["accelerate_fsdp"] = (c.results["accelerate_fsdp"][0], tputil.dense_named(model))
    AcceleratorState._reset_state(True)


def _accelerate_loop(accelerator, model, batch):
    loader = torch.utils.data.DataLoader(_Data(n=24), batch_size=batch, shuffle=False)  # 3 steps of GA 2
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    log = []
    for data in loader:
        with accelerator.accumulate(model):
            loss = model(**data).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                log.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        if len(log) == STEPS:
            break
    return log


@_check
def finetune_with_dp_shard_matches_ddp(c):
    """``tpify finetune`` at dp 2 x tp 2: dp_shard 2 (FSDP2) against dp_shard 1 (DDP), float32."""
    from tpify.cli.finetune import FinetuneConfig, finetune

    runs = {}
    for shard in (1, 2):
        cfg = FinetuneConfig(model_dir=c.model_dir, out_dir=f"{c.out}/finetune-{shard}", tp=2, dp=2, dp_shard=shard,
                             seq_len=16, batch_size=2, lr=1e-3, warmup=1, steps=2, lora_r=0, progress=False,
                             sample_tokens=0)
        runs[shard] = finetune(cfg)
    torch.testing.assert_close(runs[2], runs[1], rtol=1e-5, atol=0)


@_check
def bad_input_is_refused_on_every_rank(c):
    import peft
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tpify
    from tpify.api import load_weights_
    from tpify.integrations import TPAccelerator, TPTrainer, TPUsageError, get_peft_model

    half = DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("dp", "tp"))  # 2 of the 4 ranks
    with pytest.raises(ValueError, match=r"= 2 ranks, but the world has 4: the data-parallel and tensor-parallel"):
        tpify.parallelize(_llama(), mesh=half)
    with pytest.raises(ValueError, match=r"tp_size 3 = 3 does not divide the world size 4"):
        tpify.init_mesh(3)
    par = tpify.parallelize(_llama(), tp_size=2)
    with pytest.raises(ValueError, match=r"dp_replicate = 3 must be a positive divisor of the data-parallel size 2"):
        tpify.shard_data_parallel(par, dp_replicate=3)
    with pytest.raises(TPUsageError, match="process_group is the model's DP group"):
        tpify.replicate_data_parallel(par, process_group=None)
    tpify.shard_data_parallel(par)
    with pytest.raises(TPUsageError, match="parameters are DTensors already"):
        tpify.shard_data_parallel(par)
    with pytest.raises(TPUsageError, match="parameters are DTensors already"):
        tpify.replicate_data_parallel(par)
    with pytest.raises(TPUsageError, match="FSDP2 reduces the gradients over the data-parallel dimension itself"):
        tpify.training.sync_gradients(par)
    with pytest.raises(TPUsageError, match="add the adapters before sharding"):
        get_peft_model(par, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TPUsageError, match="load_weights_: .* DTensors"):
        load_weights_(par, c.out)
    dense = _llama()  # FSDP2 wrapped around a model before parallelize
    fully_shard(dense, mesh=init_device_mesh("cpu", (4,)))
    with pytest.raises(TPUsageError, match="DTensor parameters .* before tpify.parallelize"):
        tpify.parallelize(dense, tp_size=2)
    tputil.torchrun_env(c.rank, c.world)
    with pytest.raises(TPUsageError, match=r"fsdp_version=1 \(FSDP1\)"):
        TPTrainer(model=tpify.parallelize(_llama(), tp_size=2),
                  args=_trainer_args(c.out + "/bad", 2, fsdp="full_shard", fsdp_config={"version": 1}))
    accelerator = TPAccelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=1, tp_size=4))
    with pytest.raises(TPUsageError, match="tp_size 4 asked, the model has 2"):
        accelerator.prepare(tpify.parallelize(_llama(), tp_size=2))
    AcceleratorState._reset_state(True)


def _timed(fn):
    def run(c):
        import time

        start = time.perf_counter()
        try:
            fn(c)
        finally:
            c.seconds[fn.__name__] = round(time.perf_counter() - start, 1)
    return run


def _body(rank, world, out, model_dir):
    c = SimpleNamespace(rank=rank, world=world, out=out, model_dir=model_dir, measured={}, results={}, seconds={})
    checks = tputil.run_checks({name: _timed(fn) for name, fn in _CHECKS.items()}, c)
    if rank == 0:
        print(f"seconds per check: {c.seconds}", flush=True)
    if rank == 0:  # tensors travel through a file: a queue would share memory with an exiting process
        torch.save(c.results, Path(out) / "results.pt")
    return checks, c.measured


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path_factory.mktemp("tiny-gpt2")  # for tpify finetune: a tokenizer is needed
    tok = AutoTokenizer.from_pretrained(tputil.minilm_dir())
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=tok.vocab_size,
                               bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("scaling-out")
    ranks = tputil.spawn(_body, 4, str(out), str(model_dir), timeout=400)
    return ranks, torch.load(out / "results.pt", weights_only=False)


def _ok(job, name):
    tputil.assert_checks_ok([checks for checks, _ in job[0]], name)


@pytest.mark.parametrize("name", ["ddp_x_tp_matches_dense", "fsdp2_x_tp_matches_dense_generates_and_saves",
                                  "hsdp_x_tp_matches_dense", "lora_on_fsdp2_x_tp_matches_dense_peft",
                                  "fsdp2_mixed_precision_policy_is_passed_through",
                                  "finetune_with_dp_shard_matches_ddp", "bad_input_is_refused_on_every_rank",
                                  "replica_drift_under_fsdp2_raises_on_every_rank"])
def test_composition(job, name):
    _ok(job, name)
    for label, figures in job[0][0][1].items():
        print(f"measured {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in figures.items()))


def test_every_check_ran_on_every_rank(job):
    assert [sorted(checks) for checks, _ in job[0]] == [sorted(_CHECKS)] * 4


def test_tptrainer_with_fsdp_matches_dense_trainer(job, tmp_path):
    """Plain Trainer on the dense model, batch 4 = 2 per DP replica x dp 2; GA 2, clipping."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    _ok(job, "tptrainer_with_fsdp_runs_and_resumes")
    ref = _reference()
    trainer = Trainer(model=ref, args=_trainer_args(str(tmp_path), 4), train_dataset=_Data())
    trainer.train()
    AcceleratorState._reset_state(True)
    log, weights = job[1]["trainer_fsdp"]
    dense = _log(trainer)
    assert len(log) == len(dense) == STEPS + 1
    for (loss, norm), (loss_ref, norm_ref) in zip(log, dense):
        assert norm_ref > CLIP, "the test must exercise clipping"
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)  # Trainer logs a float32 loss
        torch.testing.assert_close(norm, norm_ref, **F64)
    for name, w in ref.named_parameters():
        torch.testing.assert_close(weights[name], w.detach(), **WEIGHTS, msg=lambda m: f"{name}: {m}")
    print(f"measured TPTrainer FSDP2 x TP: grad-norm rel {max(abs(a[1] - b[1]) / b[1] for a, b in zip(log, dense)):.1e}"
          f", weights max abs {max((weights[n] - w).abs().max().item() for n, w in ref.named_parameters()):.1e}")


def test_tpaccelerator_with_parallelism_config_matches_dense_accelerate(job):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    _ok(job, "tpaccelerator_with_parallelism_config_shards")
    ref = _reference()
    dense = _accelerate_loop(Accelerator(cpu=True, gradient_accumulation_steps=GA), ref, 4)
    AcceleratorState._reset_state(True)
    log, weights = job[1]["accelerate_fsdp"]
    assert len(log) == len(dense) == STEPS and min(dense) > CLIP
    torch.testing.assert_close(log, dense, **F64)
    for name, w in ref.named_parameters():
        torch.testing.assert_close(weights[name], w.detach(), **WEIGHTS, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Two hosts: two torchrun launches of 2 ranks each, one c10d rendezvous on localhost.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_train_dp_x_tp_as_the_dense_model(tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 2`` twice (node ranks 0 and 1): host-local TP groups
    (``init_mesh(2, host_local_tp=True)``), DDP over the two nodes; 3 AdamW steps equal the dense
    model's; a TP group across the two nodes with ``host_local_tp=True`` is refused on every rank."""
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent.parent), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
         str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tpify-two-hosts",
         "--max-restarts", "0", str(HERE / "two_hosts.py"), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in launches]
    for p, text in zip(launches, outputs):
        assert p.returncode == 0, text[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in results] == ["0", "0", "1", "1"], results
    for r in results:
        assert r["split_refused"].startswith("ValueError: tensor-parallel groups span hosts"), r
        assert r["norm_rel"] < 1e-9 and r["weights_abs"] < 1e-8, r
    print(f"measured two torchrun nodes, DDP x TP (dp 2 x tp 2): grad-norm rel {results[0]['norm_rel']:.1e}, "
          f"weights max abs {results[0]['weights_abs']:.1e}")
