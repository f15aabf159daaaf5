"""Tools for recipe authors: report, draft and prove a recipe (``tpify plan / draft / verify``).

Over the library (they import :mod:`tpify.api` and the core, never :mod:`tpify.cli`; the core
never imports them). One job per file:

  target.py         a model_type or a directory -> its config; the family's head classes
  small.py          small configs of a family; the bounds on what verify builds and runs
  plan.py           tpify plan: the coverage report of a recipe on a meta model (data)
  plan_text.py      that report as plain-text tables
  draft.py          tpify draft: the two sources tried in order, HF plans of every head class merged
  draft_types.py    Draft, DraftError, building a head class, the [loss] table
  tracer.py         the data-flow trace of one forward (a TorchFunctionMode over the ops)
  trace_sizes.py    sizes a traced forward passes as numbers: which attribute or config value
  trace_recipe.py   a trace -> a draft recipe (Megatron pairs, embeddings, LM head, replicate)
  toml_writer.py    a recipe mapping as commented TOML text
  verify.py         tpify verify: plan the cases of each target, one job per tp size, the report
  launcher.py       the ranks of a job: subprocesses, the store, the payload, memory limits
  checks.py         check_case: what one case checks on every rank, step by step
  reference.py      the dense reference: float64 where its kernels allow, inputs where it is finite
  inputs.py         a case's config, batch, labels and the scalar it differentiates
  compare.py        tolerances, compare(), dense_named() (gathered parameters and gradients)
  verify_report.py  Row, VerifyReport, the merge of the ranks' rows
"""
