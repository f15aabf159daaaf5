"""What the recipe-author commands (``tpify plan``, ``tpify verify``, ``tpify draft``) take as a target.

A target is a Hugging Face ``model_type`` known to the installed transformers (``gpt2``,
``falcon``), whose default config then describes the family, or a local directory holding a
``config.json`` (a checkpoint, or a config saved by ``save_pretrained``). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TargetError", "resolve_config", "head_classes", "HEAD_TASKS"]

# Head tasks, in the order they are reported: task name -> the transformers auto-mapping that
# lists, per model_type, the class of that head. "base" is the model without a head.
HEAD_TASKS = {
    "base": "MODEL_MAPPING_NAMES",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
}


class TargetError(ValueError):
    """A target that is neither a known ``model_type`` nor a directory with a ``config.json``."""


def resolve_config(target: str):
    """The config a target names: ``AutoConfig.from_pretrained(dir)`` for a local directory with
    a ``config.json``, else ``AutoConfig.for_model(model_type)`` (the family's default config).

    Raises:
        TargetError: the target is a path without ``config.json``, or not a model_type that the
            installed transformers knows (the message says which of the two and how to fix it).
    """
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"{target} is a directory without a config.json; pass a checkpoint directory "
                              f"(saved with save_pretrained) or a model_type such as 'gpt2'")
        return AutoConfig.from_pretrained(path)
    if target not in CONFIG_MAPPING_NAMES:
        raise TargetError(f"{target!r} is neither a directory nor a model_type known to the installed transformers "
                          f"(e.g. 'gpt2', 'llama', 'falcon'; the config's model_type field)")
    return AutoConfig.for_model(target)


def head_classes(model_type: str) -> dict[str, type]:
    """The head classes transformers defines for ``model_type``: task name -> class, in the order
    of :data:`HEAD_TASKS` (tasks the family lacks are left out)."""
    import transformers
    from transformers.models.auto import modeling_auto

    found = {}
    for task, mapping in HEAD_TASKS.items():
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        cls = getattr(transformers, name, None) if name else None
        if cls is not None:
            found[task] = cls
    return found
