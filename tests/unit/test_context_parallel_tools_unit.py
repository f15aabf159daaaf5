"""The local decisions of the tools under context parallelism, in one process: what accelerate's
``ParallelismConfig`` asks of a tpify model, and the per-trainer refusal of TRL's trainers."""

from types import SimpleNamespace

import pytest
from accelerate import ParallelismConfig

from tpify.info import TPUsageError
from tpify.integrations.accelerate import data_parallel_plan
from tpify.integrations.trl import CONTEXT_PARALLEL_REFUSALS, refuse_context_parallel


def test_parallelism_config_cp_size_is_read_and_sp_size_refused():
    plan = data_parallel_plan(None, ParallelismConfig(cp_size=2, tp_size=2))
    assert (plan.cp_size, plan.tp_size, plan.shard) == (2, 2, False)
    plan = data_parallel_plan(None, ParallelismConfig(dp_shard_size=2, cp_size=2))
    assert plan.shard and plan.cp_size == 2 and plan.dp_shard == 2  # FSDP2 over dp_shard x cp
    assert data_parallel_plan(None, None).cp_size is None  # no config: the model's
    with pytest.raises(TPUsageError, match=r"ParallelismConfig\(sp_size=2\) \(DeepSpeed's Ulysses"):
        data_parallel_plan(None, ParallelismConfig(sp_size=2))


@pytest.mark.slow  # importing trl costs ~10 s; the spawned job of test_context_parallel_tools.py checks it too
def test_each_trl_trainer_is_refused_under_context_parallelism_with_its_reason():
    import trl

    cp2, cp1 = SimpleNamespace(cp_size=2), SimpleNamespace(cp_size=1)
    for name, reason in CONTEXT_PARALLEL_REFUSALS.items():
        cls = type(f"TP{name}", (getattr(trl, name),), {})
        with pytest.raises(TPUsageError) as raised:
            refuse_context_parallel(cls, cp2)
        assert f"TRL's {name} under context parallelism (cp_size 2) is not supported: {reason}" in str(raised.value)
        refuse_context_parallel(cls, cp1)  # nothing at cp 1
    import transformers

    refuse_context_parallel(transformers.Trainer, cp2)  # not a TRL trainer: TPTrainer splits the batches
