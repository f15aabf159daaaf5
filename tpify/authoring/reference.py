"""The dense reference of one verify case: float64 where its kernels allow, on inputs where it is finite.

:func:`dense_reference` chooses it before anything is compared (eager MoE experts, the padded
row moved or dropped when float64 is not finite with it, float32 where kernels refuse float64,
:class:`DenseNotFinite` when nothing is finite), after :func:`perturb_constants` gave every
constant tensor seeded noise; :func:`float64_loss_function` keeps HF's losses in float64. Each
choice is stated in a ``dense reference: ...`` row; why: docs/families.md, "Constants perturbed"
and "Dense references that are not plain float64 with a left-padded row".
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch

from .compare import ATOL, RTOL, TOLERANCE, float32_tolerance
from .inputs import float_outputs, loss_of, make_inputs, synthetic_loss, text_config
from .verify_report import DENSE_REFERENCE

__all__ = ["DenseNotFinite", "DenseModelFailed", "PERTURB_STD", "Reference", "build_seeded", "dense_reference", "float64_loss_function",
           "perturb_constants", "use_eager_experts"]

def float64_loss_function(loss_type: str):
    """Hugging Face's loss for ``loss_type`` computed in the logits' dtype, or None if HF's own does.

    HF's ``ForCausalLM`` (also ``ForConditionalGeneration``), ``ForMaskedLM`` and
    ``ForTokenClassification`` losses upcast with ``logits.float()``: float32 even for a float64
    model, which would cap every float64 comparison at float32 precision (~1e-8). The returned
    function has the same signature and semantics (causal: labels shifted by one, or
    ``shift_labels``; ``ignore_index``; mean, or sum / ``num_items_in_batch``) without the upcast.
    Set it as ``model.loss_function = float64_loss_function(model.loss_type)``.
    """
    import torch.nn.functional as F

    def _ce(logits, target, num_items_in_batch, ignore_index):
        red = "mean" if num_items_in_batch is None else "sum"
        loss = F.cross_entropy(logits, target.to(logits.device), ignore_index=ignore_index, reduction=red)
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    if loss_type in ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM"):
        causal = loss_type != "ForMaskedLM"

        def lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                    **kwargs):
            if causal:
                target = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            else:
                target = labels
            return _ce(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), num_items_in_batch, ignore_index)
        return lm_loss
    if loss_type == "ForTokenClassification":
        def token_loss(logits, labels, config, num_items_in_batch=None, ignore_index=-100, **kwargs):
            return _ce(logits.reshape(-1, config.num_labels), labels.reshape(-1), num_items_in_batch, ignore_index)
        return token_loss
    return None


def _use_float64_loss(model) -> None:
    """Give ``model`` HF's loss in float64 where HF's own would upcast to float32 only."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    loss_type = getattr(model, "loss_type", None)
    if loss_type not in LOSS_MAPPING:
        loss_type = "ForCausalLM"  # what PreTrainedModel.loss_function falls back to
    fn = float64_loss_function(loss_type)
    if fn is not None:
        model.loss_function = fn


class DenseNotFinite(RuntimeError):
    """The dense reference gives NaN or infinity on every input verify tries: nothing to compare."""


class DenseModelFailed(RuntimeError):
    """transformers' own dense model raised (built, or run forward and backward on verify's batch),
    before tpify parallelized anything: the family's code fails, not tpify's; nothing to compare.
    The message names the class, the error and where in transformers it was raised."""


def _transformers_failure(cls: type, error: BaseException) -> BaseException:
    """``error`` as a :class:`DenseModelFailed` naming the frame of transformers' modeling code it
    came from (the deepest frame inside ``transformers/``), or ``error`` itself when it did not pass
    through transformers' code (an error of tpify's own input builders stays what it is)."""
    import traceback

    import transformers

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/transformers/" in f.filename.replace("\\", "/")]
    if not frames:
        return error
    frame = frames[-1]
    where = frame.filename.replace("\\", "/").rpartition("/transformers/")[2]
    first = str(error).splitlines()[0] if str(error) else ""
    return DenseModelFailed(f"transformers' own dense {cls.__name__} fails before tpify parallelizes anything: "
                            f"{type(error).__name__}: {first} (transformers {transformers.__version__}, "
                            f"{where}:{frame.lineno} in {frame.name}); a failure of the family's code, not of tpify: "
                            f"nothing was compared")


# A kernel's refusal of float64, as torch and transformers word it: grouped_mm's "Expected mat_a
# to be Float32, BFloat16 or Float16 matrix, got Double", "... not implemented for 'Double'",
# "expected scalar type Float but found Double", "Input type (double) and bias type (float) ...".
_FLOAT64_REFUSAL = re.compile(r"\b(double|float64)\b", re.IGNORECASE)
_PADDINGS = {"left": "left padding", "right": "right padding", "none": "no padding"}  # in the order tried


@dataclass
class Reference:
    """The dense reference of one case and the choices made for it (the same on every rank).

    Attributes:
        model: the dense model, ``eval()``, its loss in its own dtype.
        dtype: ``torch.float64``, or ``torch.float32`` where its kernels refuse float64.
        padding: the side of the padded row (``"left"``, ``"right"``, ``"none"``).
        eager_experts: whether fused MoE experts were switched to their eager implementation.
        notes: why each choice differs from float64 with a left-padded row, and the kernel
            switches made (empty when none).
        layers: the model's depth (:func:`_depth`), for the float32 tolerance.
        float32_parameters: the parameters a float64 model's own code casts to float32 before
            using them (:func:`float32_parameters`); their gradients are computed in float32
            and compared with the float32 tolerance.
        through_float32: the parameters whose gradient passes through a section the family's
            own code computes in float32 (:func:`float32_parameters`; llama's and gemma's
            norms, muse_glimmer's attention): a gradient of these outside the float64
            tolerance is compared again with the float32 one (:meth:`fallback_tolerance`).
        outputs_through_float32: the graph of the outputs computes a section in float32 (any
            cast to float32 in the float64 model: a norm, a softmax); an output, loss or gradient
            outside the float64 tolerance is compared again with the float32 one
            (:meth:`output_fallback_tolerance`, :meth:`fallback_tolerance`).
        perturbed: the tensors the family's init left constant, given seeded noise before
            anything was compared (:func:`perturb_constants`).
    """

    model: torch.nn.Module
    dtype: torch.dtype
    padding: str
    eager_experts: bool
    notes: list[str]
    layers: int
    float32_parameters: tuple[str, ...] = ()
    through_float32: tuple[str, ...] = ()
    outputs_through_float32: bool = False
    perturbed: tuple[str, ...] = ()

    @property
    def tolerance(self) -> tuple[float, float, str]:
        """``(atol, rtol, in words)`` of the comparisons: :data:`ATOL`/:data:`RTOL` in float64,
        :func:`float32_tolerance` of the model's depth in float32 (normwise)."""
        if self.dtype == torch.float64:
            return ATOL, RTOL, TOLERANCE
        return float32_tolerance(self.layers)

    def summary(self) -> str:
        """The check name of the row stating the choices (``dense reference: float32, ...``)."""
        parts = ["float64" if self.dtype == torch.float64 else "float32"]
        parts.append({"left": "left-padded batch", "right": "right-padded batch", "none": "no padding"}[self.padding])
        if self.eager_experts:
            parts.append("eager experts")
        if self.float32_parameters:
            parts.append("parameters used in float32")
        return f"{DENSE_REFERENCE}: " + ", ".join(parts)

    def gradient_tolerance(self, name: str) -> tuple[float, float, str] | None:
        """The float32 tolerance of the depth for a parameter in :attr:`float32_parameters`
        (normwise), else None (the reference's own tolerance applies)."""
        if self.dtype == torch.float64 and name in self.float32_parameters:
            return float32_tolerance(self.layers)
        return None

    def fallback_tolerance(self, name: str) -> tuple[float, float, str] | None:
        """The float32 tolerance of the depth (normwise) for a parameter in
        :attr:`through_float32` of a float64 reference, else None.

        Such a gradient is a float64 sum of values the family's code rounded to float32 on the
        way (a norm computed in float32, attention scores in float32): when the incoming
        float64 gradients of the dense and the parallel model differ by the order of a sum (1e-16
        relative), a value lying on a float32 rounding tie rounds differently, and everything
        computed from it differs by one float32 ulp (measured: muse_glimmer's layer-0
        ``k_proj`` row of one key dim, 1.1e-6 against max|e| 476, 2.4e-9 relative). Checked
        first with the float64 tolerance; only a gradient outside it is compared again with
        this one, and the row says how many were. Where the outputs pass through a float32
        section (:attr:`outputs_through_float32`), every gradient does too: a value a float32
        section rounded differently in the forward reaches the gradients of the parameters after
        it (granite_swa's final norm weight: 1.5e-7 in 14 of 32 values, its attention's softmax
        in float32)."""
        if self.dtype == torch.float64 and (name in self.through_float32 or self.outputs_through_float32):
            return float32_tolerance(self.layers)
        return None

    def output_fallback_tolerance(self) -> tuple[float, float, str] | None:
        """The float32 tolerance of the depth (normwise) for the outputs and losses of a float64
        reference whose graph computes a section in float32 (:attr:`outputs_through_float32`:
        granite_swa's attention takes its softmax and sink scaling in float32), else None.

        The same reason as :meth:`fallback_tolerance`: a value on a float32 rounding tie rounds
        differently when the float64 inputs differ by the order of a sum, and what follows differs
        by one float32 ulp (measured: granite_swa's last hidden state, 1.2e-7 in 24 of 640 values).
        Checked first with the float64 tolerance; only an output outside it is compared again,
        and the row says so. A wrong split differs by far more (1e-3 and above)."""
        if self.dtype == torch.float64 and self.outputs_through_float32:
            return float32_tolerance(self.layers)
        return None


def float32_parameters(model: torch.nn.Module, loss: torch.Tensor) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``(cast, through, any)``: the parameters of ``model`` that the autograd graph of ``loss``
    casts to float32 before using them, those whose gradient passes through any dtype conversion
    on its way from ``loss`` (a section computed in float32), by name, and whether the graph has
    such a conversion at all (the outputs pass through a float32 section).

    Some families compute a norm in float32 whatever the model's dtype (gemma3's RMSNorm:
    ``output * (1.0 + self.weight.float())``). In a float64 model the gradient of such a weight
    is then accumulated in float32: a sum over tokens and heads whose order differs when the
    heads are split over ranks, so the dense and the parallel gradient differ by float32
    roundings (3.6e-7 measured, gemma3_text's ``k_norm``), although both compute the same
    function. Found from the graph, before ``backward``: a float64 parameter whose consumer is
    a dtype conversion (``ToCopyBackward0``; in a float64 model only a cast to a lower
    precision is an operation).
    """
    names: dict[int, list[str]] = {}  # every name of a tied parameter (lm_head.weight beside embed_tokens.weight)
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    found, through, seen, stack = set(), set(), set(), [(loss.grad_fn, False)]
    any_cast = False
    while stack:
        node, below = stack.pop()
        if node is None or (node, below) in seen:
            continue
        seen.add((node, below))
        casts = node.name().startswith("ToCopyBackward")
        any_cast = any_cast or casts
        below = below or casts
        for child, _ in node.next_functions:
            if child is None:
                continue
            var = getattr(child, "variable", None)
            if var is not None and id(var) in names:
                if casts and var.dtype != torch.float32:
                    found.update(names[id(var)])
                if below:
                    through.update(names[id(var)])
            stack.append((child, below))
    return tuple(sorted(found)), tuple(sorted(through)), any_cast


def _refuses_float64(error: BaseException) -> bool:
    """Whether ``error`` is a kernel refusing float64 (a dtype error naming Double / float64).

    Only errors of the dense reference's own forward or backward are read this way (in
    :func:`dense_reference`, before anything is compared), so a float64 error of the parallel
    model is never mistaken for one.
    """
    return isinstance(error, (RuntimeError, NotImplementedError, TypeError, ValueError)) \
        and bool(_FLOAT64_REFUSAL.search(str(error)))


def use_eager_experts(model: torch.nn.Module) -> bool:
    """Switch ``model``'s fused MoE experts to transformers' eager implementation; True if it has any.

    transformers 5 runs fused experts (classes decorated ``@use_experts_implementation``, whose
    instances carry ``has_gate`` and ``is_transposed``: qwen2_moe, mixtral, olmoe, ...) with
    ``grouped_mm`` by default, whose kernel accepts float32, bfloat16 and float16 only.
    ``experts_implementation="eager"`` is the family's own loop over the experts: the same
    function (each token's experts, weighted by the router) in any dtype, so the reference stays
    float64; experts built from a per-layer config (Dots3-Note's vision tower), which
    ``set_experts_implementation`` does not reach, are switched too. A model without such
    experts is left as it is.
    """
    has_experts = any(hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())
    if not has_experts or not hasattr(model, "set_experts_implementation"):
        return False
    if any(v not in (None, "eager") for v in model.get_experts_implementation().values()):
        model.set_experts_implementation("eager")
    for module in model.modules():  # experts built from a per-layer config (Dots3-Note's vision
        config = getattr(module, "config", None)  # tower), which the model's setting does not reach
        if hasattr(module, "has_gate") and getattr(config, "_experts_implementation", "eager") != "eager":
            config._experts_implementation = "eager"
    return True


def build_seeded(cls: type, config, seed: int) -> tuple[torch.nn.Module, list[str]]:
    """``(cls(config) built after torch.manual_seed(seed), the parameters its init left
    uninitialised)``, the same on every rank.

    Some families' ``_init_weights`` skip a module that a composite's checkpoint fills
    (Qwen3-Omni's talker built alone: its fused experts are ``torch.empty``), so that their
    values are whatever memory held: different on every rank, often NaN. The model is built
    with torch's fill of uninitialised memory on (``torch.use_deterministic_algorithms(True)``,
    ``warn_only``; ``torch.utils.deterministic.fill_uninitialized_memory``: NaN), both restored
    after; a parameter entirely NaN after the family's init was never initialised and is drawn
    from ``N(0, initializer_range)`` (0.02 where the config has none) with a generator seeded by
    ``seed``. A parameter the family sets to NaN in part (tests/verify_models.py's
    ``NaNLlamaModel``) is left as it is.
    """
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.manual_seed(seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        model = cls(config)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    std = getattr(config, "initializer_range", None)
    std = std if isinstance(std, float) else 0.02
    g = torch.Generator().manual_seed(seed)
    uninitialised = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.numel() and bool(torch.isnan(p).all()):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
                uninitialised.append(name)
    return model, uninitialised


PERTURB_STD = 0.1  # the noise of perturb_constants: std s, times max(1, |c|) for a constant c
PERTURB_SEED_OFFSET = 0x9E3779B9  # perturb_constants' generator: seeded apart from the model's init


def _is_constant(t: torch.Tensor) -> bool:
    """A floating tensor with at least one element, every element the same finite value."""
    if not t.is_floating_point() or t.numel() == 0 or t.is_meta:
        return False
    first = t.detach().reshape(-1)[0]
    return bool(torch.isfinite(first)) and bool((t == first).all())


def _is_rotary(module: torch.nn.Module) -> bool:
    """A rotary-embedding module (its tables, and what parameterises them, are computed, not learned)."""
    return hasattr(module, "inv_freq") or re.search(r"rotary|rope", type(module).__name__, re.IGNORECASE) is not None


def perturb_constants(model: torch.nn.Module, seed: int = 0, std: float = PERTURB_STD) -> list[str]:
    """Give every constant floating tensor of ``model`` seeded noise, in place; return their names.

    Which: floating parameters whose elements are all equal, and such persistent buffers outside
    rotary-embedding modules. How: ``c + std * max(1, |c|) * z``, ``z ~ N(0, 1)`` drawn in float64
    from a generator seeded with ``seed + PERTURB_SEED_OFFSET``, ``std`` = :data:`PERTURB_STD`; the
    same on every rank, the global random state untouched, tied parameters once. Why (a bias added
    on every rank passes with zeros): docs/families.md, "tpify.authoring.reference.perturb_constants".

    Returns the perturbed names (parameters, then buffers). Local; no communication.
    """
    gen = torch.Generator().manual_seed(seed + PERTURB_SEED_OFFSET)
    names = []

    def perturb(name: str, t: torch.Tensor) -> None:
        c = float(t.detach().reshape(-1)[0])
        z = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            t.copy_((c + std * max(1.0, abs(c)) * z).to(t.dtype))
        names.append(name)

    for name, param in model.named_parameters():
        if _is_constant(param):
            perturb(name, param)
    for module_name, module in model.named_modules():
        if _is_rotary(module):
            continue
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name not in module._non_persistent_buffers_set and _is_constant(buffer):
                perturb(f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer)
    return names


def _perturbed_note(names: list[str], std: float) -> str:
    """The note of :func:`perturb_constants`: how many tensors, a few of their names."""
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    return (f"{len(names)} tensors the family's init leaves constant ({shown}) perturbed: c + {std:g} * max(1, |c|) "
            f"* N(0, 1), seeded (zero biases, unit norms, sinks and gates then exercise their split)")


def _not_finite(model, inputs: dict, labels: dict) -> tuple[list[str], tuple[tuple[str, ...], tuple[str, ...]]]:
    """``(what is not finite in one forward and backward of model (outputs, loss, gradients),
    the parameters its graph uses in float32 and those whose gradients pass through float32
    (:func:`float32_parameters`))``."""
    out = model(**inputs, **labels) if labels else model(**inputs)
    problems = [f"{name} ({int((~torch.isfinite(v)).sum())} of {v.numel()})"
                for name, v in float_outputs(out).items() if not bool(torch.isfinite(v).all())]
    loss = loss_of(out) if labels else synthetic_loss(out)
    if not problems and not bool(torch.isfinite(loss).all()):
        problems.append("the loss")
    in_float32: tuple[tuple[str, ...], tuple[str, ...], bool] = ((), (), False)
    if not problems and loss.requires_grad:
        in_float32 = float32_parameters(model, loss)
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            more = " ..." if len(bad) > 3 else ""
            problems.append(f"gradients of {len(bad)} parameters ({', '.join(bad[:3])}{more})")
    model.zero_grad(set_to_none=True)
    return problems, in_float32


def dense_reference(cls: type, config, task: str, seed: int = 0, dtype: torch.dtype | None = None) -> Reference:
    """The dense reference of one case: float64 where its kernels allow, inputs where it is finite.

    Built seeded (:func:`build_seeded`), constants perturbed (:func:`perturb_constants`), fused
    experts eager; then float64, else float32 (a kernel's refusal of float64), with the padded row
    on the left, else on the right, else none, until outputs, loss and every gradient are finite.
    ``dtype`` forces one dtype. Every choice other than float64 with left padding is in ``notes``.
    Why each fallback exists: docs/recipes.md, "tpify.authoring.reference.dense_reference".

    Raises:
        DenseNotFinite: no padding gives finite values (names what is NaN / infinite for each).
        DenseModelFailed: transformers' own dense model raised while built or run (names the class,
            the error and the frame of transformers' code; not the parallel model's fault).
        Exception: anything else raised on the way (tpify's input builders).
    """
    try:
        return _dense_reference(cls, config, task, seed, dtype)
    except (DenseNotFinite, DenseModelFailed):
        raise
    except Exception as e:  # noqa: BLE001 - named as transformers' own failure where it is one
        raise _transformers_failure(cls, e) from e


def _dense_reference(cls: type, config, task: str, seed: int, dtype: torch.dtype | None) -> Reference:
    """:func:`dense_reference`'s work (that function names a failure of transformers' own code)."""
    base, uninitialised = build_seeded(cls, config, seed)
    base.eval()
    perturbed = perturb_constants(base, seed)
    eager = use_eager_experts(base)
    notes = []
    if uninitialised:
        notes.append(f"{len(uninitialised)} parameters ({', '.join(uninitialised[:3])}"
                     f"{' ...' if len(uninitialised) > 3 else ''}) are left uninitialised by the family's own init "
                     f"(torch.empty: a composite's checkpoint fills them); drawn from N(0, initializer_range)")
    if perturbed:
        notes.append(_perturbed_note(perturbed, PERTURB_STD))
    if eager:
        notes.append("fused MoE experts run with experts_implementation='eager' (the family's loop over experts, "
                     "the same function; transformers' default grouped_mm kernel refuses float64)")
    dtypes = [dtype] if dtype is not None else [torch.float64, torch.float32]
    for dt in dtypes:
        model = copy.deepcopy(base).to(dt)
        _use_float64_loss(model)
        tried = []
        try:
            for padding in _PADDINGS:
                inputs, labels, _ = make_inputs(task, cls, config, padding=padding, dtype=dt)
                problems, in_float32 = _not_finite(model, inputs, labels)
                if not problems:
                    if tried:
                        notes.append(f"{_PADDINGS[padding]}: the dense {_dtype_name(dt)} model is not finite with "
                                     + "; ".join(tried))
                    if in_float32[0]:
                        notes.append(_float32_note(model, in_float32[0], config))
                    return Reference(model, dt, padding, eager, notes, _depth(config), *in_float32,
                                     perturbed=tuple(perturbed))
                tried.append(f"{_PADDINGS[padding]} ({', '.join(problems)})")
        except Exception as e:  # noqa: BLE001 - a refusal of float64 switches dtype, anything else propagates
            if dt == torch.float64 and len(dtypes) > 1 and _refuses_float64(e):
                notes.append(f"float32: the dense model's kernels refuse float64 ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); tolerance {float32_tolerance(_depth(config))[2]}")
                continue
            raise
        raise DenseNotFinite(f"dense reference not finite: the {_dtype_name(dt)} dense model gives NaN or infinity "
                             f"with every input verify tries: {'; '.join(tried)}; nothing was compared")
    raise AssertionError("unreachable")  # the last dtype returns or raises


def _float32_note(model: torch.nn.Module, names: tuple[str, ...], config) -> str:
    """The note of :attr:`Reference.float32_parameters`: how many, of which module classes."""
    modules = dict(model.named_modules())
    classes = sorted({type(modules.get(n.rpartition(".")[0], model)).__name__ for n in names})
    return (f"{len(names)} parameters ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) are cast to "
            f"float32 by the family's own code ({', '.join(classes)}) in the float64 model: their gradients are "
            f"float32 sums, compared with {float32_tolerance(_depth(config))[2]}")


def _depth(config) -> int:
    """The number of layers of ``config`` (an encoder-decoder's encoder and decoder together; a
    composite without its own layer count: its text part, :func:`~tpify.authoring.inputs.text_config`),
    at least 1."""
    if not _config_value(config, "num_hidden_layers") and not getattr(config, "is_encoder_decoder", False):
        config = text_config(config)

    def first(names) -> int:
        values = (_config_value(config, n) for n in names)
        return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), 0)

    layers = first(("num_hidden_layers", "num_layers", "n_layer", "num_encoder_layers", "encoder_layers"))
    if getattr(config, "is_encoder_decoder", False):
        layers = first(("num_encoder_layers", "encoder_layers", "num_layers", "num_hidden_layers")) \
            + first(("num_decoder_layers", "decoder_layers"))
    return max(layers, 1)


def _config_value(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - some configs raise on attributes they define per layer
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

