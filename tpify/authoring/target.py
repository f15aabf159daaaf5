"""What the recipe-authoring tools (``tpify plan``, ``tpify verify``, ``tpify draft``) take as a
target, and the head classes of its family.

A target is a Hugging Face ``model_type`` known to the installed transformers (``gpt2``,
``falcon``), whose default config then describes the family, or a local directory holding a
``config.json`` (a checkpoint, or a config saved by ``save_pretrained``). Nothing is downloaded.

The head classes come from transformers' auto mappings (:data:`HEAD_TASKS`, :func:`head_classes`),
then from the family's modeling module (:func:`family_head_classes`: ``GPT2DoubleHeadsModel``,
``BertForMultipleChoice``, ...).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TargetError", "resolve_config", "head_classes", "family_head_classes", "task_of", "HEAD_TASKS"]

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
    # a vision-language model's generating head (LlavaForConditionalGeneration): a causal LM on
    # text with image tokens (tpify.authoring.inputs.image_inputs builds the images it knows)
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
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


# Head classes outside the auto mappings, by the suffix of their name -> the task they are named by.
_EXTRA_TASKS = (("DoubleHeadsModel", "double-heads"), ("ForMultipleChoice", "multiple-choice"),
                ("ForNextSentencePrediction", "next-sentence"), ("ForPreTraining", "pretraining"),
                ("EncoderModel", "encoder"))


def family_head_classes(config) -> dict[str, type]:
    """Every head class of ``config``'s family: task -> class.

    The standard tasks of :func:`head_classes` (base, causal-lm, masked-lm, seq2seq-lm,
    sequence/token classification, question answering), then the other public
    ``PreTrainedModel`` classes of the family's modeling module, named by task
    (``GPT2DoubleHeadsModel``: ``double-heads``, ``BertForMultipleChoice``: ``multiple-choice``,
    ``BertForNextSentencePrediction``, ``BertForPreTraining``, ``T5EncoderModel``: ``encoder``;
    others: ``other:<ClassName>``). A class of the module built from another config class is
    not the family's (``modeling_llama4`` defines ``Llama4ForConditionalGeneration`` for
    ``Llama4Config`` beside ``Llama4VisionModel`` for ``Llama4VisionConfig``; built from the
    vision config it would take the full-size default text config) and is left out.

    A config that no public class is built from (a part of a composite model: T5Gemma's
    encoder config, T5Gemma2's text encoder and decoder, Voxtral-Realtime's text model) gets the
    module's model classes built from exactly its class (:func:`_part_classes`, task
    ``part:<ClassName>``): ``T5Gemma2TextEncoder``, ``T5Gemma2Decoder``,
    ``VoxtralRealtimeTextModel``, ``T5GemmaEncoder``.
    """
    import importlib

    from transformers import PreTrainedModel

    found = {task: cls for task, cls in head_classes(config.model_type).items() if not _built_from_part(cls, config)}
    seen = set(found.values())
    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return found
    for name in getattr(module, "__all__", []):
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)) or cls in seen \
                or name.endswith("PreTrainedModel"):
            continue
        if not _takes(cls, config):
            continue
        task = next((t for suffix, t in _EXTRA_TASKS if name.endswith(suffix)), f"other:{name}")
        found.setdefault(task, cls)
        seen.add(cls)
    if not found:
        found = _part_classes(config, module)
    return found


# Model classes transformers builds from a config whose class names another (the encoder of
# T5GemmaModel: ``T5GemmaEncoder(config.encoder)``, a T5GemmaModuleConfig, while its
# config_class is T5GemmaConfig): model_type -> class name.
_BUILT_FROM = {"t5_gemma_module": "T5GemmaEncoder"}


def _takes(cls: type, config) -> bool:
    """Whether ``cls`` is built from configs like ``config`` (its ``config_class``, where it names one)."""
    config_class = getattr(cls, "config_class", None)
    return not isinstance(config_class, type) or isinstance(config, config_class)


def _built_from_part(cls: type, config) -> bool:
    """Whether ``cls`` (listed by an auto mapping for ``config``'s model_type) is built from one of
    ``config``'s sub-configs rather than from ``config`` (``Llama4ForCausalLM`` takes the
    ``text_config`` of a ``Llama4Config``)."""
    config_class = getattr(cls, "config_class", None)
    parts = [c for c in (getattr(config, "sub_configs", None) or {}).values() if isinstance(c, type)]
    return isinstance(config_class, type) and not isinstance(config, config_class) and config_class in parts


def _part_classes(config, module) -> dict[str, type]:
    """For a config no public head class is built from (a part of a composite model: a text
    encoder, a decoder, a text tower): the model classes of ``module`` whose ``config_class`` is
    exactly ``config``'s class, or :data:`_BUILT_FROM`'s; task ``part:<ClassName>``."""
    from transformers import PreTrainedModel

    named = _BUILT_FROM.get(getattr(config, "model_type", None))
    found = {}
    for name, cls in vars(module).items():
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)) or cls.__module__ != module.__name__ \
                or name.endswith("PreTrainedModel"):
            continue
        if name == named or getattr(cls, "config_class", None) is type(config):
            found[f"part:{name}"] = cls
    return found


def task_of(cls: type) -> str:
    """The task of a head class, from the family's classes or its name."""
    config_class = getattr(cls, "config_class", None)
    model_type = getattr(config_class, "model_type", None)
    if model_type:
        try:
            for task, c in family_head_classes(config_class()).items():
                if c is cls:
                    return task
        except Exception:  # noqa: BLE001 - fall back to the name
            pass
    name = cls.__name__
    for suffix, task in (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                         ("ForConditionalGeneration", "seq2seq-lm"),
                         ("ForSequenceClassification", "sequence-classification"),
                         ("ForTokenClassification", "token-classification"),
                         ("ForQuestionAnswering", "question-answering")) + _EXTRA_TASKS:
        if name.endswith(suffix):
            return task
    return "base" if name.endswith("Model") else f"other:{name}"
