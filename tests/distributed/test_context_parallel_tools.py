"""Context parallelism through the tools: ``TPAccelerator`` and ``TPTrainer``, float64 against a dense loop.

4 gloo ranks, the model parallelized at cp 2 x tp 2 (``tpify.init_mesh(2, cp_size=2)``, dp 1), a
random Llama (grouped-query attention) in float64, sequences of 16 tokens with about 30% of the
labels -100. The dense reference is a hand-written loop on one model in each rank (the same
seed), written to do what the tool does:

* ``TPAccelerator(parallelism_config=ParallelismConfig(cp_size=2, tp_size=2),
  gradient_accumulation_steps=2)``: the loop calls ``tpify.context_parallel.split_batch`` on each
  batch, ``accelerator.backward`` (the loss divided by 2), ``accelerator.clip_grad_norm_(.., 1.0)``,
  AdamW; dense: each micro-batch's mean loss / 2, torch's clipping, AdamW;
* ``TPTrainer`` (``parallelism_config`` with ``cp_size=2``), 3 steps of 2 accumulated
  micro-batches, ``max_grad_norm=1.0``, constant learning rate: Trainer counts the targets of the
  2 whole micro-batches (``num_items_in_batch``) and the model divides each micro-batch's summed
  loss by it; dense: the same sum / count by HF's loss (float64 arithmetic), clipping, AdamW.

The same two tools at dp_shard 2 x cp 2 under FSDP2 (``ParallelismConfig(dp_shard_size=2, cp_size=2)``,
each replica one sequence per micro-batch; dense: the mean of the replicas' means for accelerate, Trainer's
count over both); and ``tpify.shard_data_parallel`` itself (FSDP2 over ``dp_shard x cp``, torchtitan's) at
dp_shard 2 x cp 2 (with the all-gather and the ring attention) and at cp 2 x tp 2 with sequence parallelism:
every gradient of the first step, then 3 AdamW steps clipped at the dense norm.

Tolerance ``atol 1e-10, rtol 1e-9`` on every weight after the 3 steps and on the clipping norms:
the same sums in another order (~1e-16) through 3 Adam steps whose clipped gradients are all well
above Adam's eps (as in test_context_parallel.py's AdamW check). Also: ``accelerator.save_model``
at cp 2 writes a directory plain transformers loads, with the trained weights exactly; what is
refused on every rank (TRL's SFT, DPO, GRPO and RLOO trainers, each with its reason; a ``cp_size``
that is not the model's; evaluation with logits).
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tputil
from tpify.authoring.reference import perturb_constants

TOL = dict(atol=1e-10, rtol=1e-9)
T, V, STEPS, MICRO = 16, 101, 3, 2


class _Data(torch.utils.data.Dataset):
    """``n`` sequences of ``T`` tokens, about 30% of the labels -100."""

    def __init__(self, n: int = 12, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, V, (n, T), generator=g)
        self.labels = self.ids.clone()
        self.labels[torch.rand(n, T, generator=g) < 0.3] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _reference():
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=48, vocab_size=V,
                                       max_position_embeddings=64)).double()
    perturb_constants(ref)
    ref.loss_function = tputil.float64_loss_function(causal=True)
    return ref


def _batches(batch: int):
    data = _Data()
    return [{k: torch.stack([data[i][k] for i in range(s, s + batch)]) for k in ("input_ids", "labels")}
            for s in range(0, len(data), batch)]


def _dense_steps(ref, batch: int, num_items: bool, replicas: int = 1) -> list[float]:
    """3 AdamW steps of 2 micro-batches, clipped at 1.0: each micro-batch's mean loss / 2 (with ``replicas``
    data-parallel replicas, each holding ``batch / replicas`` sequences: the mean of their means, as DDP and
    FSDP2 average), or (``num_items``) its summed loss / the targets of both micro-batches (Trainer's). The
    norms before clipping."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    batches, norms = _batches(batch), []
    for step in range(STEPS):
        micro = batches[MICRO * step: MICRO * (step + 1)]
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        for b in micro:
            if num_items:
                ref(**b, use_cache=False, num_items_in_batch=torch.tensor(float(count))).loss.backward()
            else:
                for part in range(replicas):
                    rows = slice(part * batch // replicas, (part + 1) * batch // replicas)
                    one = {k: v[rows] for k, v in b.items()}
                    (ref(**one, use_cache=False).loss / (MICRO * replicas)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    return norms


def _assert_weights(par, ref, what: str) -> float:
    want, got = tputil.dense_named(ref), tputil.dense_named(par)
    err = 0.0
    for fqn, w in want.items():
        torch.testing.assert_close(got[fqn], w, **TOL, msg=lambda m: f"{what}: weight {fqn}: {m}")
        err = max(err, float((got[fqn] - w).abs().max()))
    return err


def _accelerate(rank, out, fsdp: bool = False) -> dict:
    """cp 2 x tp 2 with DDP (dp 1), or (``fsdp``) dp_shard 2 x cp 2 under FSDP2, each replica 1 sequence."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    import tpify
    from tpify.context_parallel import split_batch
    from tpify.integrations import TPAccelerator

    tp, dp = (1, 2) if fsdp else (2, 1)
    what = "TPAccelerator " + ("FSDP2 dp_shard 2 x cp 2" if fsdp else "cp 2 x tp 2")
    ref = _reference()
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(tp, cp_size=2))
    accelerator = TPAccelerator(cpu=True, gradient_accumulation_steps=MICRO,
                                parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=2, tp_size=tp))
    loader = torch.utils.data.DataLoader(_Data(), batch_size=2 // dp, shuffle=False)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.0)
    model, opt, loader = accelerator.prepare(par, opt, loader)
    norms = []
    for i, batch in zip(range(STEPS * MICRO), loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(**split_batch(batch, model)).loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
    want = _dense_steps(ref, 2, num_items=False, replicas=dp)
    assert len(norms) == STEPS and all(n > 1.0 for n in want), (norms, want)  # clipping acts
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **TOL)
    err = _assert_weights(par, ref, what)
    if fsdp:
        AcceleratorState._reset_state(True)
        return {f"{what}, 3 AdamW steps x 2 micro-batches, clipped (weights)": err}
    # save_model at cp 2: a plain HF directory with the trained weights
    accelerator.save_model(model, f"{out}/accelerate-model")
    loaded = AutoModelForCausalLM.from_pretrained(f"{out}/accelerate-model", torch_dtype=torch.float64)
    saved = dict(loaded.named_parameters())
    for fqn, w in tputil.dense_named(ref).items():
        assert torch.equal(saved[fqn], w.cpu()) or torch.allclose(saved[fqn], w.cpu(), **TOL), fqn
    AcceleratorState._reset_state(True)
    return {f"{what}, 3 AdamW steps x 2 micro-batches, clipped (weights)": err}


def _trainer(rank, out, fsdp: bool = False) -> dict:
    """cp 2 x tp 2 with DDP (dp 1), or (``fsdp``) dp_shard 2 x cp 2 under FSDP2, each replica 1 sequence."""
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    import tpify
    from tpify.integrations import TPTrainer

    class Sequential(TPTrainer):  # the data in order, so that the dense loop sees the same batches
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    tp, dp = (1, 2) if fsdp else (2, 1)
    what = "TPTrainer " + ("FSDP2 dp_shard 2 x cp 2" if fsdp else "cp 2 x tp 2")
    ref = _reference()
    par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(tp, cp_size=2))
    args = TrainingArguments(output_dir=f"{out}/trainer-{tp}", per_device_train_batch_size=2 // dp,
                             gradient_accumulation_steps=MICRO, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
                             logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                             save_strategy="no",
                             parallelism_config=ParallelismConfig(dp_shard_size=dp, cp_size=2, tp_size=tp))
    trainer = Sequential(model=par, args=args, train_dataset=_Data())
    assert trainer.get_tp_size() == 2 * tp and trainer.get_cp_size() == 1
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    want = _dense_steps(ref, 2, num_items=True)
    assert all(n > 1.0 for n in want), want
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **TOL)
    err = _assert_weights(par, ref, what)
    if fsdp:
        return {f"{what}, 3 AdamW steps x 2 micro-batches, num_items_in_batch, clipped (weights)": err}
    from tpify.info import TPUsageError

    with pytest.raises(TPUsageError, match="evaluation with logits .* under context parallelism is not built"):
        trainer.predict(_Data(n=4, seed=3))
    return {f"{what}, 3 AdamW steps x 2 micro-batches, num_items_in_batch, clipped (weights)": err}


def _fsdp(rank) -> dict:
    """FSDP2 over dp_shard x cp (torchtitan's), 3 AdamW steps clipped at the dense norm: dp_shard 2 x cp 2
    (each replica its own sequence: the gradients of the dense mean over both), and cp 2 x tp 2 with sequence
    parallelism (FSDP2 over the CP group alone; the norms' partial gradients summed over TP by tpify); and
    dp_shard 2 x cp 2 again with the ring attention (``cp_attention="ring"``)."""
    import tpify
    from tpify.context_parallel import split_batch
    from tpify.sharding import is_dtensor
    from tpify.training import clip_grad_norm_

    worst = {}
    for tp, sp, attention in ((1, False, "allgather"), (2, True, "allgather"), (1, False, "ring")):
        what = f"FSDP2 {'dp_shard 2 x cp 2' if tp == 1 else 'cp 2 x tp 2 sp'}{' ring' if attention == 'ring' else ''}"
        ref = _reference()
        par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(tp, cp_size=2), sequence_parallel=sp,
                                cp_attention=attention)
        tpify.shard_data_parallel(par)
        assert all(is_dtensor(p) for p in par.parameters())
        replica, replicas = (rank // 2, 2) if tp == 1 else (0, 1)
        opt_ref, opt_par = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0) for m in (ref, par))
        err = 0.0
        for step in range(STEPS):
            batch = _batches(2)[step]
            ids, labels = batch["input_ids"], batch["labels"]
            if replicas == 1:
                ids, labels = ids[:1], labels[:1]
            # each replica's sequence: the dense loss is the mean over the replicas' targets when their counts are
            # equal; here they differ (-100 labels), so the dense reference sums and divides by the global count
            count = float((labels[:, 1:] != -100).sum())
            loss_ref = ref(input_ids=ids, labels=labels, use_cache=False,
                           num_items_in_batch=torch.tensor(count, dtype=torch.float64)).loss
            mine = {"input_ids": ids[replica:replica + 1], "labels": labels[replica:replica + 1],
                    "num_items_in_batch": torch.tensor(count / replicas, dtype=torch.float64)}
            loss_par = par(**split_batch(mine, par)).loss  # sum / (count / replicas); FSDP2 divides by replicas
            loss_ref.backward()
            loss_par.backward()
            if step == 0:
                want, got = tputil.dense_named(ref, "grad"), tputil.dense_named(par, "grad")
                for fqn, g in want.items():
                    torch.testing.assert_close(got[fqn], g, **TOL, msg=lambda m: f"{what}: grad {fqn}: {m}")
                    err = max(err, float((got[fqn] - g).abs().max()))
            norm_ref = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
            norm_par = float(clip_grad_norm_(par, 1.0))
            assert norm_ref > 1.0 and abs(norm_par - norm_ref) <= 1e-9 * norm_ref, (what, step, norm_par, norm_ref)
            opt_ref.step(), opt_par.step()
            opt_ref.zero_grad(), opt_par.zero_grad()
        worst[f"{what}: every gradient of step 1"] = err
        worst[f"{what}: weights after 3 AdamW steps, clipped"] = _assert_weights(par, ref, what)
    return worst


def _moe(rank) -> dict:
    """Mixtral (4 experts, top 2, eager experts: the grouped-mm kernel refuses float64) at cp 2 (dp 2 x cp 2, each
    replica the same batch), cp 2 x tp 2 and cp 2 x tp 2 with sequence parallelism: logits gathered, the loss and
    every gradient (the router's included) against dense. The experts and the router are per token; the router's
    load-balancing loss (``output_router_logits=True``, a product of two means over all tokens) is refused."""
    import transformers as tf

    import tpify
    from test_context_parallel import _compare, _ids
    from tpify.info import TPUsageError

    def mixtral(aux: bool = False):
        torch.manual_seed(0)
        ref = tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=aux, experts_implementation="eager")).double()
        perturb_constants(ref)
        ref.loss_function = tputil.float64_loss_function(causal=True)
        return ref

    worst = {}
    for tp, cp, sp in ((1, 2, False), (2, 2, False), (2, 2, True)):
        ref = mixtral()
        par = tpify.parallelize(copy.deepcopy(ref), mesh=tpify.init_mesh(tp, cp_size=cp), sequence_parallel=sp)
        _compare(par, ref, f"mixtral cp {cp} x tp {tp}{' sp' if sp else ''}", _ids(30), worst)
    with pytest.raises(TPUsageError, match="output_router_logits=True .*router's auxiliary loss"):
        tpify.parallelize(mixtral(aux=True), mesh=tpify.init_mesh(2, cp_size=2))
    return worst


def _refusals(rank) -> None:
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    import tpify
    from tpify.info import TPUsageError
    from tpify.integrations import TPAccelerator, TPTrainer, tp_trainer_class

    par = tpify.parallelize(_reference(), mesh=tpify.init_mesh(2, cp_size=2))
    import trl

    for cls, reason in (("SFTTrainer", "token accuracy and entropy"), ("DPOTrainer", "sums each sequence's log-probs"),
                        ("GRPOTrainer", "generates its completions"), ("RLOOTrainer", "generates its completions")):
        with pytest.raises(TPUsageError, match=f"TRL's {cls} under context parallelism .* not supported: .*{reason}"):
            tp_trainer_class(getattr(trl, cls))(model=par)
    with pytest.raises(TPUsageError, match="cp_size 1 asked, the model has 2"):
        TPAccelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2)).prepare(par)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[],
                             parallelism_config=ParallelismConfig(cp_size=4, tp_size=2))
    with pytest.raises(TPUsageError, match="asks for cp_size 4, the model was parallelized with cp_size 2"):
        TPTrainer(model=par, args=args)


def _body(rank, world, out):
    tputil.torchrun_env(rank, world)
    worst = {}
    worst.update(_accelerate(rank, out))
    worst.update(_trainer(rank, out))
    worst.update(_fsdp(rank))
    worst.update(_moe(rank))
    worst.update(_accelerate(rank, out, fsdp=True))
    worst.update(_trainer(rank, out, fsdp=True))
    _refusals(rank)
    return worst


@pytest.mark.slow
def test_accelerate_and_trainer_under_context_parallelism_match_dense(tmp_path):
    results = tputil.spawn(_body, 4, str(tmp_path), timeout=600)
    print("measured: max |difference from dense| (weights after 3 steps):", results[0])
