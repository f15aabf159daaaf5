"""The dense Hugging Face model that ``from_pretrained`` starts from, built without its weights.

Built from the config on the meta device as transformers' own ``from_pretrained`` builds it
(:func:`build_meta_model`: the class from ``config.architectures``, the parameters' dtype as
the default dtype, no initialisation of the meta parameters, ties restored), then given what
no checkpoint holds, exactly as transformers computes it: non-persistent buffers (rotary
tables, ``position_ids``) and head parameters a base checkpoint lacks (:func:`init_missing`).

Not file I/O (:mod:`tpify.io` reads and writes checkpoints; this builds and initialises
modules), and model-agnostic: every model-specific value comes from the model's own
constructor and ``_init_weights``. Local: no communication.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .io.keys import persistent_buffers

__all__ = ["resolve_class", "resolve_dtype", "build_meta_model", "init_missing"]


def resolve_class(config, model_class: type | None) -> type:
    """``model_class``, else the first class of ``config.architectures`` that transformers has,
    else the base model class ``AutoModel`` maps the config to.

    Raises:
        ValueError: ``config.architectures`` names no class of this transformers version.
    """
    if model_class is not None:
        return model_class
    import transformers

    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if names:
        raise ValueError(f"config.architectures = {names} names no class of transformers "
                         f"{transformers.__version__}; pass model_class=")
    return transformers.AutoModel._model_mapping[type(config)]


_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def resolve_dtype(config, headers_dtype: torch.dtype, torch_dtype, argument: str = "torch_dtype") -> torch.dtype:
    """The floating dtype to load parameters in: ``torch_dtype`` (the value of ``from_pretrained``'s
    ``dtype=``, or of its deprecated name ``torch_dtype=``, which ``argument`` names in the error);
    for ``None`` or ``"auto"``, ``config.dtype``, else ``headers_dtype`` (the checkpoint's), else
    float32.

    Raises:
        ValueError: ``torch_dtype`` names no torch floating dtype (``"float33"``) or a
            non-floating one (``"int8"``: quantization is not supported).
    """
    if torch_dtype is None or torch_dtype == "auto":
        dtype = getattr(config, "dtype", None) or headers_dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    dtype = getattr(torch, torch_dtype, None) if isinstance(torch_dtype, str) else torch_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"from_pretrained: {argument}={torch_dtype!r} is not a floating dtype; use one of "
                         f"{list(_FLOAT_DTYPES)} (or a torch.dtype, or 'auto'); quantized loading is not supported")
    return dtype


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _meta_params_skip_init():
    """Inside accelerate's ``init_empty_weights``: the constructor's ``post_init`` skips the
    initialisation of the (meta) parameters, and still initialises the (real) buffers.

    Every parameter the constructor registers on the meta device is marked
    ``_is_hf_initialized`` while the constructor runs; transformers' init functions
    (``transformers.initialization``, and ``torch.nn.init`` under its ``initialize_weights``
    guard) skip tensors so marked. Initialising a meta tensor computes nothing, but each call
    still goes through torch's Python reference of the op; transformers' own ``from_pretrained``
    skips it likewise (it builds the model under ``torch.device("meta")``, where
    ``init_weights`` returns at once). The marks are removed on exit, so later initialisations
    (:func:`init_missing`, :func:`_init_non_persistent_buffers`) see the parameters as before.
    Local; no communication.
    """
    registered = nn.Module.register_parameter  # accelerate's, which moves the parameter to meta
    marked: list[torch.Tensor] = []

    def register(module, name, param):
        registered(module, name, param)
        new = module._parameters.get(name)
        if new is not None and new.is_meta and not hasattr(new, "_is_hf_initialized"):
            new._is_hf_initialized = True
            marked.append(new)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = registered
        for param in marked:
            param.__dict__.pop("_is_hf_initialized", None)


def build_meta_model(config, cls: type, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from ``config`` with its parameters on the meta device (``dtype`` as the
    default dtype and ``config.dtype``, as transformers builds it), ties restored, in eval mode, its non-persistent
    buffers computed as transformers computes them.

    Touches the process's default dtype and ``nn.Module.register_parameter`` while the
    constructor runs (both restored on exit, an error included). Local; no communication.
    """
    from accelerate import init_empty_weights

    config.dtype = dtype  # the dtype the model is built in, as transformers' from_pretrained records it
    with init_empty_weights(include_buffers=False), _default_dtype(dtype), _meta_params_skip_init():
        model = cls._from_config(config)  # picks the attention implementation as from_pretrained does
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    model.eval()
    _init_non_persistent_buffers(model)  # before surgery: the config still holds the dense values
    return model


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers as transformers' ``from_pretrained`` does.

    The meta model was built under the checkpoint's dtype as the default dtype, so its
    constructor computed tables such as GPT-J's sinusoidal ``embed_positions`` in that dtype
    (float64 for a float64 load). transformers computes them after loading, in the model's
    ``_init_weights`` under the process's default dtype (float32), then stores them in the
    buffer's dtype: the values differ (up to 4e-8 for GPT-J in float64). To give exactly what a
    user of the checkpoint gets from transformers, this runs ``_init_weights`` on every module
    that owns a non-persistent buffer, with every parameter and persistent buffer (still on the
    meta device) marked initialised (transformers' init functions skip those), so only the
    buffers are recomputed. Called on the dense meta model, before surgery divides any config
    value (rotary tables read the head count from the config). Local; no communication.
    """
    owners = [(fqn, m) for fqn, m in model.named_modules()
              if any(m._buffers.get(name) is not None for name in m._non_persistent_buffers_set)]
    if not owners or not hasattr(model, "_init_weights"):
        return
    # transformers initialises each module with its innermost PreTrainedModel's _init_weights (a base
    # model inside a head class: Gemma3nTextModel's reads its own hidden_size, which the head lacks)
    holders = {fqn: m for fqn, m in model.named_modules() if hasattr(m, "_init_weights")}

    def init_of(fqn: str):
        parts = fqn.split(".") if fqn else []
        for i in range(len(parts), -1, -1):
            holder = holders.get(".".join(parts[:i]))
            if holder is not None:
                return holder._init_weights
        return model._init_weights

    persistent = set(persistent_buffers(model))
    marked = [t for t in model.parameters()] + [model.get_buffer(f) for f in persistent]
    flags = [(t, getattr(t, "_is_hf_initialized", None)) for t in marked]
    for t in marked:
        t._is_hf_initialized = True
    try:
        with torch.no_grad():
            for fqn, module in owners:
                init_of(fqn)(module)
    finally:
        for t, old in flags:
            if old is None:
                del t._is_hf_initialized
            else:
                t._is_hf_initialized = old


def init_missing(model: nn.Module, fqns: list[str], dtype: torch.dtype) -> None:
    """Initialise the parameters ``fqns`` (a head a base checkpoint lacks, replicated) with the
    model's ``_init_weights`` of their modules, in ``dtype``, under seed 0 (the same values on
    every rank; the global RNG state is restored). Nothing when ``fqns`` is empty.
    """
    if not fqns:
        return
    modules = {}
    for fqn in fqns:
        mname, _, pname = fqn.rpartition(".")
        module = model.get_submodule(mname)
        param = getattr(module, pname)
        if param.is_meta:
            module._parameters[pname] = nn.Parameter(torch.empty(param.shape, dtype=dtype),
                                                     requires_grad=param.requires_grad)
        modules[mname] = module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # same values on every rank: the parameters are replicated
        for module in modules.values():
            model._init_weights(module)
