"""What the ``tpify`` command checks before it starts any rank: the arguments against the model.

A subcommand that launches ranks (``finetune``, ``embed``) first runs here, in the one process the
user started, what its ranks would find wrong before their first collective: the model directory
(a ``config.json``, whole safetensors files), the tp size against the model's config (heads, KV
heads, every dimension the recipe splits: the plan tpify builds on the meta device, the very
:class:`~tpify.layout.PlanError` the ranks would raise), and for ``finetune`` the output folder,
the data files, the extras and the checkpoint to resume from
(:func:`tpify.cli.finetune.check_run`). A problem is one clean error (exit status 2) instead of
the same traceback on every rank. Under a torchrun the user started, every rank runs the same
checks before the process group starts. ``tpify verify`` checks its plans in
:func:`tpify.authoring.verify.verify`, before its own ranks start.
"""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["model_problem", "finetune_problem", "embed_problem"]


def model_problem(model_dir, tp: int, head: str = "architectures", flag: str = "--model-dir") -> str | None:
    """Why the Hugging Face model in ``model_dir`` cannot be split over ``tp`` ranks, or None.

    ``head``: ``"architectures"``, the class ``tpify.from_pretrained`` builds (the config's
    ``architectures``), or ``"base"``, the one ``transformers.AutoModel`` builds. Reads the
    config and the safetensors headers (not the weights), builds the model on the meta device
    and its layout at ``tp`` (:func:`tpify.layout.build_layout`, with the recipe
    :func:`tpify.parallelize` would use). Local; no process group.
    """
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        return (f"{flag} {path} {what}: pass a local Hugging Face model directory (config.json and safetensors "
                f"weights; nothing is downloaded)")
    import torch
    import transformers

    from ..api import resolve_recipe
    from ..io import CheckpointError
    from ..io.files import open_checkpoint
    from ..layout import PlanError, build_layout
    from ..meta_model import build_meta_model, resolve_class
    from ..recipe import RecipeError

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
        cls = transformers.AutoModel._model_mapping[type(config)] if head == "base" else resolve_class(config, None)
        snap, _, _ = open_checkpoint(path)  # the files' headers: a missing or truncated file is named now
        snap.close()
        with warnings.catch_warnings():  # a family without a shipped recipe: its notice comes from the ranks
            warnings.simplefilter("ignore")
            model = build_meta_model(config, cls, torch.float32)
            build_layout(model, resolve_recipe(model, None), tp)
    except (PlanError, RecipeError, CheckpointError, ValueError, KeyError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def finetune_problem(cfg) -> str | None:
    """Why the run ``cfg`` (a :class:`~tpify.cli.finetune.FinetuneConfig`) cannot start, or None:
    :func:`tpify.cli.finetune.check_run` (output folder, data files, model directory, extras, the
    checkpoint to resume from), then :func:`model_problem` at ``cfg.tp``."""
    from .finetune import check_run

    try:
        check_run(cfg)
    except (ValueError, ImportError) as e:
        return str(e)
    return model_problem(cfg.model_dir, cfg.tp)


def embed_problem(model_dir, tp: int) -> str | None:
    """Why ``tpify embed`` cannot split the encoder in ``model_dir`` (None: the embedded
    all-MiniLM-L6-v2) over ``tp`` ranks, or None (:func:`model_problem`, the base model)."""
    if model_dir is None:
        from .demo_models import default_minilm_dir

        try:
            model_dir = default_minilm_dir()
        except FileNotFoundError as e:
            return str(e)
    return model_problem(model_dir, tp, head="base")
