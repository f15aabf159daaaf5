"""tpify models in the tools people already fine-tune with: transformers Trainer, accelerate, PEFT.

* :class:`TPTrainer` (``tpify.integrations.trainer``): ``transformers.Trainer`` for a tpify model;
  :func:`tp_trainer_class` / :class:`TPTrainerMixin`: the same for any Trainer subclass, TRL's
  ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer`` and ``RewardTrainer`` included (``tpify.integrations.trl``).
* :class:`TPAccelerator` (``tpify.integrations.accelerate``): ``accelerate.Accelerator`` for one.
* :func:`get_peft_model`, :func:`load_peft_adapter` (``tpify.integrations.peft``): PEFT LoRA and
  DoRA on tensor-parallel layers, new or from a dense adapter directory.
* :mod:`tpify.integrations.model`: HF's own methods on a parallelized model (installed by
  :func:`tpify.parallelize`).
* :mod:`tpify.integrations.resume`: the manifest every training checkpoint carries
  (TPTrainer, TPAccelerator, ``tpify finetune``): the model and optimizer it fits; a resume into
  another is refused on every rank (another layout is fine: :mod:`tpify.checkpoint` reshards).

Imported lazily, so ``import tpify`` does not import Trainer, accelerate or peft.
"""

from __future__ import annotations

__all__ = ["TPTrainer", "TPTrainerMixin", "tp_trainer_class", "TPAccelerator", "get_peft_model", "load_peft_adapter",
           "save_adapter", "TPUsageError"]


def __getattr__(name: str):
    if name in ("TPTrainer", "TPTrainerMixin", "tp_trainer_class"):
        from . import trainer
        return getattr(trainer, name)
    if name == "TPAccelerator":
        from .accelerate import TPAccelerator
        return TPAccelerator
    if name in ("get_peft_model", "load_peft_adapter", "save_adapter"):
        from . import peft
        return getattr(peft, name)
    if name == "TPUsageError":
        from ..info import TPUsageError
        return TPUsageError
    raise AttributeError(f"module 'tpify.integrations' has no attribute {name!r}")
