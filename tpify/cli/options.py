"""The options of ``tpify finetune`` that the parser needs: the limits of its numbers, its dtypes, its
prompt. Apart from :mod:`tpify.cli.finetune` (torch, the training loop) so that building the parser
(``tpify --help``, a usage error) imports nothing heavy; :class:`tpify.cli.finetune.FinetuneConfig`
checks its fields against the same :data:`LIMITS`.
"""

from __future__ import annotations

from .checks import NON_NEGATIVE_INT, POSITIVE_INT, Limit

__all__ = ["LIMITS", "DTYPES", "DEFAULT_PROMPT", "QUANTIZE", "PP_SCHEDULES"]

# The prompt whose greedy continuation is shown before and after training: the default text is
# the GNU GPL, so what the model learnt shows in the continuation.
DEFAULT_PROMPT = "The GNU General Public License is"

# The values of each numeric option of FinetuneConfig; the `tpify finetune` flags are parsed with
# the same limits (tpify/cli/__init__.py), so a value the parser refuses is refused from Python too.
LIMITS = {
    "tp": POSITIVE_INT,
    "cp": Limit(low=1, note="context-parallel ranks, each holding seq_len / cp tokens of every sequence; 1: none"),
    "dp": POSITIVE_INT,
    "dp_shard": Limit(low=1, note="ranks FSDP2 shards each TP shard over; 1: DDP, no sharding"),
    "seq_len": Limit(low=2, note="a causal LM learns to predict each token from the ones before it, so a "
                                 "sequence needs two"),
    "batch_size": POSITIVE_INT,
    "lr": Limit(integer=False, low=0),
    "warmup": NON_NEGATIVE_INT,
    "steps": POSITIVE_INT,
    "clip": Limit(integer=False, low=0, note="the largest global gradient norm; 0 turns clipping off"),
    "weight_decay": Limit(integer=False, low=0),
    "save_every": Limit(low=0, note="0 writes the final model only"),
    "seed": Limit(low=0, high=2**63),
    "lora_r": Limit(low=0, note="0 fine-tunes every parameter"),
    "lora_alpha": Limit(low=1, none=True, note="unset: twice the LoRA rank"),
    "sample_tokens": Limit(low=0, note="0 shows no continuation"),
    "pp": Limit(low=1, note="pipeline stages (tpify.pipeline); 1: no pipeline"),
    "microbatches": Limit(low=1, none=True, note="microbatches per step of the pipeline; unset: --pp"),
}
# The schedules of ``tpify finetune --pp-schedule`` and ``tpify plan --pp-schedule`` (tpify.pipeline.schedule.SCHEDULES).
PP_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
DTYPES = ("float32", "bfloat16")
# `tpify finetune --quantize`: the bitsandbytes 4-bit formats of a QLoRA base (tpify/quantized.py).
QUANTIZE = ("nf4", "fp4")
