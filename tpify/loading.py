"""Sharded loading of Hugging Face safetensors checkpoints, and saving back to the HF layout.

Data flows ``config -> meta model -> recipe surgery (on meta) -> read this rank's slices``.
:func:`from_pretrained` never materialises the dense model: it builds it on the meta device
(accelerate's ``init_empty_weights``), parallelizes it there with the pipeline of
:func:`tpify.parallelize` (``api.prepare`` -> one agreement -> ``api.finish``), then
each rank reads only its own bytes with ``safe_open(...).get_slice(name)``: a shard that is one
contiguous range of its file becomes a zero-copy view of the file's private mapping (as
transformers 5 loads a whole model), the others are copied by
:meth:`tpify.sharding.ShardSpec.read` (packed ``[Q|K|V]`` projections split per part, padded
vocabularies padded with zero rows). :func:`save_pretrained` gathers each tensor to its dense
layout with :meth:`~tpify.sharding.ShardSpec.gather` (padding stripped, packed parts re-packed) and
writes a standard HF directory, shard file by shard file, into a temporary directory; an
existing target then goes from its checkpoint to the new one with one atomic rename or unlink
(:func:`_swap_into_place`), so it holds one whole checkpoint at every instant. Loads pick the
checkpoint transformers 5 picks in a directory (:func:`_weight_files`) and read only its files.
Megatron-LM, arXiv:1909.08053, section 3 (the layouts sharded).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import comm
from .agree import agree, digest
from .sharding import ShardSpec, is_dtensor, shard_spec_of

__all__ = ["from_pretrained", "save_pretrained", "load_weights_", "CheckpointError"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SAVE_ID = "tpify_save_id"  # metadata every file of one save_pretrained carries (index and shards)


class CheckpointError(ValueError):
    """A checkpoint directory does not fit the model: missing, misshapen or unreadable tensors."""


# ----------------------------------------------------------------------------------------------
# Reading the directory (local, deterministic: the same result or error on every rank)
# ----------------------------------------------------------------------------------------------

class _Snapshot:
    """The files of a checkpoint directory, each opened once for the whole load.

    A file is opened (``os.open``) the first time it is named and stays open until
    :meth:`close`; every later read goes through that descriptor (``/proc/self/fd/<n>`` on
    Linux), so a save that replaces or deletes the file meanwhile (``os.replace``,
    ``os.unlink``) cannot change what this load reads: it keeps reading the file it opened (and
    the views :class:`_Reader` returns keep that file's mapping).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fds: dict[str, int] = {}

    def where(self, name: str) -> str:
        """A path that reads the opened file ``name`` (opening it now if needed).

        Raises:
            FileNotFoundError: ``name`` is not in the directory (:func:`_snapshot` looks again).
        """
        if name not in self.fds:
            self.fds[name] = os.open(self.path / name, os.O_RDONLY)
        proc = f"/proc/self/fd/{self.fds[name]}"
        return proc if os.path.exists(proc) else str(self.path / name)

    def has(self, name: str) -> bool:
        """Whether ``name`` is a regular file of the directory (``os.path.isfile``, as transformers
        asks), opening it if so: the answer and the file later read are the same file."""
        try:
            self.where(name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISREG(os.fstat(self.fds[name]).st_mode):
            os.close(self.fds.pop(name))
            return False
        return True

    def read_text(self, name: str) -> str:
        with open(self.where(name), encoding="utf-8") as f:
            return f.read()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _NoWeights(CheckpointError):
    """No weights file where transformers looks (:func:`_snapshot` looks once more: a save may be
    switching from a single file to an index, or back)."""


class _MixedSaves(CheckpointError):
    """The index and the files it names carry different save ids (:func:`_snapshot` looks again)."""

    def __init__(self, path: Path, ids: dict[str, object]):
        self.ids = ids
        listed = ", ".join(f"{name}: {value}" for name, value in ids.items())
        super().__init__(f"{path} mixes files of different saves (tpify_save_id of each: {listed}): the index "
                         f"names files that another save wrote (files copied in by hand, or a directory assembled "
                         f"from two checkpoints). Re-save the model, or copy one whole checkpoint (the index and "
                         f"every file it names, all from one save).")


def _parse_index(text: str, file: Path) -> tuple[dict[str, str], object]:
    """``(weight_map, save id or None)`` of a ``model.safetensors.index.json``.

    A JSON object that gives one key two different values is refused: ``json.loads`` would keep
    the last one silently, so a tensor listed twice would be read from whichever file came last
    (the same key twice with the same value is unambiguous and accepted). Local; no communication.

    Raises:
        CheckpointError: not JSON; no ``weight_map`` mapping names to file names; a key given
            twice with different values (each listed, with both values).
    """
    clashes: list[tuple[str, object, object]] = []

    def unique(pairs):
        out: dict = {}
        for key, value in pairs:
            if key in out and out[key] != value:
                clashes.append((key, out[key], value))
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=unique)
        weight_map = data["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{file}: 'weight_map' must map tensor names to file names, got "
                              f"{type(weight_map).__name__}; re-save the checkpoint or fix the index")
    if clashes:
        listed = "\n  - ".join(f"{key!r}: {_short(a)} and {_short(b)}" for key, a, b in clashes[:10])
        raise CheckpointError(f"{file} gives {len(clashes)} key(s) two different values (for 'weight_map' entries: "
                              f"a tensor listed in two files), so which one holds it is ambiguous:\n  - {listed}\n"
                              f"Keep one entry per tensor (the file whose header holds it) or re-save the checkpoint.")
    metadata = data.get("metadata")
    return dict(weight_map), metadata.get(_SAVE_ID) if isinstance(metadata, dict) else None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _explicit_weights(snap: _Snapshot) -> str | None:
    """The weights file ``config.json`` names in ``transformers_weights``, which transformers 5
    loads before any other (a ``*.safetensors`` file or ``*.safetensors.index.json``), or None.

    Raises:
        CheckpointError: the name is neither, or leaves the directory (transformers refuses both).
    """
    if not snap.has("config.json"):
        return None
    try:
        name = json.loads(snap.read_text("config.json")).get("transformers_weights")
    except (ValueError, AttributeError):  # AutoConfig reports an unreadable config.json
        return None
    if name is None:
        return None
    inside = isinstance(name, str) and not os.path.isabs(name) and ".." not in Path(name).parts
    if not inside or not (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")):
        raise CheckpointError(f"{snap.path / 'config.json'}: transformers_weights = {name!r} must name a "
                              f"*.safetensors file or *.safetensors.index.json inside {snap.path}; fix config.json")
    return name


def _weight_files(snap: _Snapshot) -> tuple[dict[str, str], list]:
    """``({checkpoint key: file name}, [the index's save id])`` of the checkpoint transformers 5
    loads from the directory, every file it names opened in ``snap``.

    transformers' precedence (``modeling_utils._get_resolved_checkpoint_files``, local directory):
    the file ``config.json`` names in ``transformers_weights``; else ``model.safetensors``; else
    ``model.safetensors.index.json`` and the files its ``weight_map`` names. A single file has no
    save id of its own (``[]``). Other weight files in the directory are never opened.

    Raises:
        FileNotFoundError: a file the index names is not there (:func:`_snapshot` looks again:
            a save may have switched to another checkpoint meanwhile).
        _NoWeights: no safetensors weights where transformers looks.
        CheckpointError: an invalid index (:func:`_parse_index`) or ``transformers_weights``.
    """
    path = snap.path
    explicit = _explicit_weights(snap)
    candidates = [explicit] if explicit is not None else [SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME]
    name = next((n for n in candidates if snap.has(n)), None)
    if name is None:
        if explicit is not None:
            raise _NoWeights(f"{path / 'config.json'} names transformers_weights = {explicit!r}, which is not in "
                             f"{path}; restore that file or remove the entry from config.json")
        raise _NoWeights(f"{path} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}; tpify loads "
                         f"safetensors checkpoints only (save with save_pretrained(safe_serialization=True))")
    if name.endswith(".index.json"):
        weight_map, save_id = _parse_index(snap.read_text(name), path / name)
        for file in sorted(set(weight_map.values())):  # open every shard now, right after the index
            snap.where(file)
        return weight_map, [save_id]
    return {key: name for key in _open(path / name, snap.where(name)).keys()}, []


def _open(file: Path, where: str | None = None):
    """``safe_open`` of ``file`` (read through ``where``, an opened descriptor's path), turning a
    truncated or corrupt file into a clear error naming it."""
    try:
        return safe_open(where or str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError (not exported) or OSError
        raise CheckpointError(f"cannot read safetensors file {file} ({file.stat().st_size if file.exists() else 'missing'}"
                              f" bytes): {e}. The file is truncated or corrupt; re-download or re-save it.") from e


def _headers(snap: _Snapshot, weight_map: dict[str, str],
             index_ids: list = ()) -> tuple[dict[str, tuple[tuple[int, ...], str]], list]:
    """``({key: (shape, file name)}, [each file's save id])``, reading each file's header once.

    Raises:
        _MixedSaves: the files (and ``index_ids``) carry different save ids; checked first, since
            files of two saves may hold the same tensors.
        CheckpointError: a tensor stored in two files (each named); a tensor the index lists
            that is in no file.
    """
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    ids, seen, twice = [], {}, []
    files = sorted(set(weight_map.values()))
    for name in files:
        handle = _open(snap.path / name, snap.where(name))
        ids.append((handle.metadata() or {}).get(_SAVE_ID))
        for key in handle.keys():
            if key in seen:
                twice.append((key, seen[key], name))
            seen[key] = name
            out[key] = (tuple(handle.get_slice(key).get_shape()), name)
    if len(set(list(index_ids) + ids)) > 1:
        named = dict(zip([SAFE_WEIGHTS_INDEX_NAME] * len(index_ids), index_ids))
        raise _MixedSaves(snap.path, {**named, **dict(zip(files, ids))})
    if twice:
        listed = "\n  - ".join(f"{key} in {a} and in {b}" for key, a, b in twice[:10])
        raise CheckpointError(f"{snap.path}: {len(twice)} tensor(s) stored in two files of one checkpoint, so which "
                              f"copy loads would depend on the reading order:\n  - {listed}\nRemove each tensor "
                              f"from all files but one (the one the index names) or re-save the checkpoint.")
    missing = sorted(k for k, f in weight_map.items() if k not in out)
    if missing:
        raise CheckpointError(f"the index of {snap.path} lists tensors that are in no file: {missing[:5]}")
    return out, ids


def _snapshot(path: Path, attempts: int = 10) -> tuple[_Snapshot, dict[str, str], dict]:
    """Open every file of the checkpoint transformers would load: ``(snapshot, weight_map, headers)``.

    A save (:func:`save_pretrained`) switches a directory from one whole checkpoint to another
    with one atomic rename or unlink, then deletes the old files; a load that read the old index
    may then find a file gone, or (after a second save reused the names) a file of another save:
    every file of one save carries the same ``tpify_save_id``. Either way the load opens
    everything again (up to ``attempts`` times, 50 ms more each time), so it sees one whole
    checkpoint, never a mix. The same missing file or the same mix seen twice in a row is the
    directory's state, not a save in flight: that is an error at once.

    Raises:
        CheckpointError: a file the index names is missing; the index names files of different
            saves (:class:`_MixedSaves`); the directory kept changing on every try; or as
            :func:`_weight_files` and :func:`_headers`.
    """
    previous, problem = None, None
    for attempt in range(attempts):
        snap = _Snapshot(path)
        try:
            weight_map, index_ids = _weight_files(snap)
            headers, _ = _headers(snap, weight_map, index_ids)
            return snap, weight_map, headers
        except FileNotFoundError as e:
            snap.close()
            seen = ("missing", e.filename)
            problem = CheckpointError(f"{e.filename} is missing: the checkpoint's index names it but it is not in "
                                      f"{path}. Copy the whole checkpoint (the index and every file it names) or "
                                      f"re-save it.")
        except (_MixedSaves, _NoWeights) as e:
            snap.close()
            seen, problem = (type(e).__name__, str(e)), e
        except BaseException:
            snap.close()
            raise
        if seen == previous:
            raise problem
        previous = seen
        time.sleep(0.05 * (attempt + 1))
    raise CheckpointError(f"{path} changed on each of {attempts} tries to open one whole checkpoint (a process "
                          f"is saving into it again and again); the last try: {problem}")


def _rename(key: str, expected: set[str], prefix: str, renames=()) -> str:
    """Map a checkpoint key to the model's naming, as transformers 5 does on load.

    The recipe's ``[checkpoint] renames`` (suffix ``(old, new)`` pairs, BERT's legacy
    ``LayerNorm.gamma/beta``) apply first; then the base-model prefix (``bert.``,
    ``transformer.``) is stripped or added when that makes the key one the model has.
    """
    for old, new in renames:
        if key.endswith(old):
            key = key[: -len(old)] + new
    if prefix and key not in expected:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
            return key[len(prefix) + 1:]
        if f"{prefix}.{key}" in expected:
            return f"{prefix}.{key}"
    return key


def _resolve_class(config, model_class):
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


def _resolve_dtype(config, headers_dtype, torch_dtype):
    """The floating dtype to load parameters in.

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
        raise ValueError(f"from_pretrained: torch_dtype={torch_dtype!r} is not a floating dtype; use one of "
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
    goes through torch's Python reference of the op (about 2 ms per ``normal_``: 0.3 s for a
    16-layer Llama); transformers' own ``from_pretrained`` skips it likewise (it builds the model
    under ``torch.device("meta")``, where ``init_weights`` returns at once). The marks are removed
    on exit, so later initialisations (:func:`_init_missing`, :func:`_init_non_persistent_buffers`)
    see the parameters as before. Local; no communication.
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


def _tied_names(model: nn.Module) -> set[str]:
    """Names transformers declares as tied copies (``lm_head.weight``): not stored on save."""
    from transformers.modeling_utils import _get_tied_weight_keys

    return set(_get_tied_weight_keys(model))


def _param_groups(model: nn.Module) -> list[list[str]]:
    """FQNs of every parameter, grouped by object (a tied weight gives one group of several)."""
    groups: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(fqn)
    return list(groups.values())


def _persistent_buffers(model: nn.Module) -> list[str]:
    out = []
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                out.append(f"{mname}.{bname}" if mname else bname)
    return out


def _non_persistent_buffers(model: nn.Module) -> set[str]:
    out = set()
    for mname, module in model.named_modules():
        for bname in module._non_persistent_buffers_set:
            out.add(f"{mname}.{bname}" if mname else bname)
    return out


# ----------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------

def from_pretrained(
    path: str | os.PathLike,
    *,
    tp_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    dp_group: "dist.ProcessGroup | None | str" = "infer",
    torch_dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    recipe=None,
    pad_vocab_multiple: int = 1,
    sequence_parallel: bool = False,
    disable_mmap: bool = False,
) -> nn.Module:
    """Load a local Hugging Face safetensors checkpoint tensor-parallel, each rank reading its slice.

    The model is built on the meta device, parallelized there by the recipe (the same sequence
    as :func:`tpify.parallelize`), and every parameter is then read with
    ``safe_open(file).get_slice(name)`` through its :class:`~tpify.sharding.ShardSpec`: rank
    ``r`` reads only the rows/columns it holds (packed ``[Q|K|V]`` per part, padded vocabularies
    padded with zero rows), replicated parameters are read whole. Shards that are one range of
    their split dimension in the stored dtype (replicated tensors, unpadded vocabulary rows,
    column-parallel ``nn.Linear`` weights: contiguous; row-parallel ``nn.Linear`` weights: a
    strided slice of every row, not contiguous) are zero-copy views of a private
    (copy-on-write) mapping of the file, read from the page cache when first used, as
    transformers 5 does for a whole model; the others (packed parts, padded vocabularies, a
    dtype conversion) are copied into owned memory. A rank's peak memory is about its shard
    (plus, for strided views, the page-cache pages its rows share with the next rank's) plus
    one block (16 MiB) in flight, never the dense model.
    As with transformers, replacing or deleting the files afterwards is safe, rewriting them in
    place while the model lives is not (``disable_mmap=True`` copies everything). Tied parameters
    (``lm_head.weight`` = ``wte.weight``) are read once and stay one Parameter. Non-persistent
    buffers (BERT ``position_ids``, rotary ``inv_freq``) are computed by the model's constructor
    exactly as transformers does. Keys are mapped as transformers 5 maps them: the base-model
    prefix (``bert.``) is added or stripped, legacy ``LayerNorm.gamma/beta`` are renamed;
    checkpoint tensors stored for non-persistent buffers (old ``position_ids``) are ignored.

    Args:
        path: local directory with ``config.json`` and ``model.safetensors`` or several files
            plus ``model.safetensors.index.json`` (``weight_map``). Nothing is downloaded. Where
            several are present, the one transformers 5 loads is read (``transformers_weights``
            in config.json, then ``model.safetensors``, then the index), and only its files.
        tp_size, tp_group, dp_group: as in :func:`tpify.parallelize` (default: the whole world).
        torch_dtype: dtype of the floating parameters; each slice is converted as it is read.
            Default (``None``/``"auto"``): ``config.dtype``, else the checkpoint's dtype.
        model_class: the ``transformers`` class to build; default ``config.architectures[0]``.
            A head class loads a base-model checkpoint (keys without ``bert.``) and vice versa.
            Head parameters absent from a base checkpoint are initialised by the model's
            ``_init_weights`` under a fixed seed (identical on every rank) with a warning, as
            transformers does; they must be replicated (a missing sharded tensor is an error).
        recipe: a recipe name, path, mapping or Recipe; default ``config.model_type``.
        disable_mmap: copy every shard into owned memory, none left as a view of the file's
            mapping (transformers' ``disable_mmap``): the model then no longer depends on the
            files at all, at the cost of a copy (slower where first-touching new memory is slow).

    Returns:
        The parallelized model (``model.tp_info`` set), in eval mode like transformers' loads.

    Communication: one agreement (``comm.agree``) after the local checks, so a rank whose copy
    of the checkpoint is missing, truncated or different (tensor names and shapes, dtype) stops
    every rank with an error instead of a hang; then :func:`tpify.parallelize`'s agreement and
    groups; reading issues no collective, and one more agreement after it reports a file that
    failed while reading on any rank to every rank.

    Raises:
        FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
        CheckpointError: no safetensors weights; a truncated/corrupt file (named); tensors the
            model needs that the checkpoint lacks; tensors whose shape differs from the model's;
            an index that lists a tensor in two files, a tensor stored in two files, a file the
            index names that is missing, files of different saves (:func:`_snapshot`).
        PlanError, RecipeError, ValueError: as :func:`tpify.parallelize`.
        AgreementError: on the other ranks, when one rank raised one of these; when the ranks'
            checkpoints or arguments differ.
    Warns:
        UserWarning: checkpoint tensors the model does not use (like transformers' "unexpected").
    """
    from .api import agreement_scope, finish

    path = Path(path)
    error, found = None, {}
    group, share = agreement_scope(tp_group, dp_group)
    try:  # every local check (checkpoint and layout), then one agreement: the same outcome on every rank
        found = _open_checkpoint(path, model_class, torch_dtype, recipe, tp_size, tp_group,
                                 (pad_vocab_multiple, sequence_parallel, dp_group), group)
    except Exception as e:  # noqa: BLE001 - re-raised by comm.agree here, reported on the other ranks
        error = e
    tp_groups = agree("tpify.from_pretrained", found.get("fingerprint", {}), error, group=group, share=share)
    model, source, headers, dtype, to_init, snap = (found[k] for k in ("model", "source", "headers", "dtype",
                                                                         "to_init", "snap"))
    try:
        # groups, surgery on meta, tp_info, hooks
        finish(model, found["tp_size"], found["layout"], tp_group, dp_group, tp_groups)
        error, read = None, {}
        try:
            _materialize(model, snap, source, headers, dtype, to_init, copy=disable_mmap)
            read = _replicated_fingerprint(model)
        except Exception as e:  # noqa: BLE001 - a file that fails while reading on one rank stops every rank
            error = e
        agree("reading the checkpoint in tpify.from_pretrained", read, error, group=tp_group)
    finally:
        snap.close()  # the files stay open from the headers to the last slice: one save, never a mix
    return model


def _replicated_fingerprint(model: nn.Module) -> dict:
    """A sample of the values every rank read whole (replicated parameters and buffers), to
    compare across the TP group: a copy of the checkpoint that differs on one host (same names
    and shapes, other values) would otherwise make the replicas disagree silently."""
    from .api import weights_digest

    replicated = [t for t in [*model.parameters(), *model.buffers()] if shard_spec_of(t) is None]
    return {"replicated weights read (a sample)": weights_digest(replicated)}


def _open_checkpoint(path: Path, model_class, torch_dtype, recipe, tp_size, tp_group, options=(1, False, None),
                     agree_group=None) -> dict:
    """The local part of :func:`from_pretrained`: config, headers, the meta model, its layout
    (``api.prepare``) and the key map.

    No collective. Returns ``model`` (dense, on meta), ``tp_size``, ``layout``, ``source`` (fqn ->
    checkpoint key), ``headers``, ``dtype``, ``to_init`` and the ``fingerprint`` every rank must
    share (the checkpoint's and :func:`tpify.api.fingerprint`).
    """
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: from_pretrained needs a local Hugging Face model "
                                f"directory (config.json + model.safetensors); nothing is downloaded")
    config = AutoConfig.from_pretrained(str(path))
    cls = _resolve_class(config, model_class)
    snap, weight_map, headers = _snapshot(path)  # every file opened once, for the whole load
    try:
        return _meta_model(path, snap, config, cls, weight_map, headers, torch_dtype, recipe, tp_size, tp_group,
                           options, agree_group)
    except BaseException:
        snap.close()
        raise


def _meta_model(path, snap, config, cls, weight_map, headers, torch_dtype, recipe, tp_size, tp_group,
                options=(1, False, None), agree_group=None) -> dict:
    """The rest of :func:`_open_checkpoint`, on the opened files."""
    from accelerate import init_empty_weights

    from .api import fingerprint, prepare

    first_file = sorted(set(weight_map.values()))[0]
    handle = _open(path / first_file, snap.where(first_file))
    float_dtype = next((handle.get_slice(k).get_dtype() for k in handle.keys()
                        if handle.get_slice(k).get_dtype() in ("F32", "F16", "BF16", "F64")), "F32")
    dtype = _resolve_dtype(config, {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                                    "F64": torch.float64}[float_dtype], torch_dtype)
    with init_empty_weights(include_buffers=False), _default_dtype(dtype), _meta_params_skip_init():
        model = cls._from_config(config)  # picks the attention implementation as from_pretrained does
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    model.eval()
    _init_non_persistent_buffers(model)  # before surgery: the config still holds the dense values

    size, layout = prepare(model, tp_size, tp_group, recipe, *options)  # (pad_vocab_multiple, sequence_parallel, dp)

    # ---- match checkpoint keys to the dense meta model: local checks, before any collective
    dense_shapes = {fqn: tuple(t.shape) for fqn, t in _named_tensors(model)}
    source, to_init = _match_checkpoint(model, headers, dense_shapes, path, cls.__name__, layout.renames,
                                        may_init=lambda fqns: _replicated_head(model, fqns, layout))

    shared = {**fingerprint(model, layout, size, agree_group), "dtype": str(dtype),
              "checkpoint tensors": digest(sorted((k, list(v[0])) for k, v in headers.items()))}
    return {"model": model, "tp_size": size, "layout": layout, "source": source, "headers": headers, "dtype": dtype,
            "to_init": to_init, "fingerprint": shared, "snap": snap}


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (tied ones under each name) and persistent buffer, by FQN."""
    named = list(model.named_parameters(remove_duplicate=False))
    return named + [(fqn, model.get_buffer(fqn)) for fqn in _persistent_buffers(model)]


def _replicated_head(model: nn.Module, fqns: list[str], layout) -> bool:
    """Whether tied parameter names ``fqns`` lie outside the base model, in modules the layout
    replicates (a head a base checkpoint lacks may then be initialised)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if base is None or any(f.startswith(prefix + ".") for f in fqns):
        return False
    sharded = layout.sharded()
    return not any(f.rpartition(".")[0] in sharded for f in fqns)


def _match_checkpoint(model, headers, dense_shapes, path, cls_name, renames=(), may_init=None):
    """``({model fqn: checkpoint key}, [fqns to initialise])``; local, before any collective.

    ``dense_shapes``: the dense shape of every tensor the model needs, by FQN. A tied group is
    read from whichever of its names the checkpoint holds. ``may_init(fqns)`` says whether a
    group missing from the checkpoint may be initialised instead (``None``: never).

    Raises:
        CheckpointError: missing tensors, or tensors whose shape differs (all listed).
    Warns:
        UserWarning: unused checkpoint tensors; tensors that will be newly initialised.
    """
    groups = _param_groups(model)  # buffers a checkpoint lacks keep the values the constructor gave them
    expected = set(dense_shapes)
    prefix = getattr(model, "base_model_prefix", "") or ""
    source: dict[str, str] = {}  # model fqn -> checkpoint key
    unexpected = []
    skip = _non_persistent_buffers(model)
    for key in headers:
        name = _rename(key, expected, prefix, renames)
        if name in expected:
            source.setdefault(name, key)
        elif _rename(key, skip, prefix, renames) not in skip:
            unexpected.append(key)
    errors, to_init = [], []
    for fqns in groups:
        have = [f for f in fqns if f in source]
        if not have:
            if may_init is not None and may_init(fqns):
                to_init.extend(fqns)
            else:
                errors.append(f"missing tensor {fqns[0]} (shape {list(dense_shapes[fqns[0]])})")
            continue
        for f in fqns:
            source[f] = source[have[0]]
    for fqn in list(source):
        shape = headers[source[fqn]][0]
        if shape != dense_shapes[fqn]:
            errors.append(f"tensor {source[fqn]} in {headers[source[fqn]][1]} has shape {list(shape)}, but "
                          f"{cls_name}.{fqn} needs {list(dense_shapes[fqn])}")
    if errors:
        raise CheckpointError(f"checkpoint {path} does not fit {cls_name} (config {path / 'config.json'}):\n  - "
                              + "\n  - ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20
                                                               else "")
                              + "\nCheck model_class= and that the files belong to this config.")
    if unexpected:
        warnings.warn(f"tpify: some weights of {path} were not used when initializing {cls_name}: "
                      f"{sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}", stacklevel=3)
    if to_init:
        warnings.warn(f"tpify: some weights of {cls_name} were not in {path} and are newly initialized: "
                      f"{sorted(to_init)}. You should probably train this model.", stacklevel=3)
    return source, to_init


def load_weights_(model: nn.Module, path: str | os.PathLike) -> None:
    """Read a dense Hugging Face safetensors checkpoint into a parallelized model, in place.

    Each rank reads only its slices (as :func:`from_pretrained`) and copies them into the
    existing parameters and persistent buffers, converted to their dtype, so optimizers and other
    holders keep pointing at the same tensors (used to resume a Trainer run). Every tensor the
    model needs must be in the checkpoint with its dense shape.

    Communication: as :func:`from_pretrained`, one agreement (``comm.agree``, over the model's
    TP group) after the local checks, so a rank whose copy is missing, truncated or different
    stops every rank, and one after reading. Call it on every rank of the TP group.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`from_pretrained`.
        AgreementError: on the other ranks, when one rank raised; when the ranks' checkpoints differ.
    """
    from .api import get_tp_info

    info = get_tp_info(model)  # raises for a model tpify did not parallelize
    tp_group = info.tp_group
    path = Path(path)
    error, snap, source, headers = None, None, None, None
    try:  # every local check, then one agreement: the same outcome on every rank
        if any(is_dtensor(p) for p in model.parameters()):
            from .integrations.model import TPUsageError

            raise TPUsageError(f"load_weights_: {type(model).__name__}'s parameters are DTensors (FSDP2's "
                               f"fully_shard); reading a checkpoint into a model FSDP2 shards is not supported yet: "
                               f"load it with tpify.from_pretrained, then shard it with fully_shard")
        if not path.is_dir():
            raise FileNotFoundError(f"load_weights_: {path} is not a directory")
        snap, _, headers = _snapshot(path)
        dense_shapes = {}
        for fqn, t in _named_tensors(model):
            spec = shard_spec_of(t)
            shape = list(t.shape)
            if spec is not None:
                shape[spec.dim] = spec.global_size
            dense_shapes[fqn] = tuple(shape)
        source, _ = _match_checkpoint(model, headers, dense_shapes, path, type(model).__name__, info.layout.renames)
    except Exception as e:  # noqa: BLE001 - re-raised by comm.agree here, reported on the other ranks
        error = e
        if snap is not None:
            snap.close()
    fingerprint = {} if error is not None else {
        "checkpoint tensors": digest(sorted((k, list(v[0])) for k, v in headers.items()))}
    agree("tpify.load_weights_", fingerprint, error, group=tp_group)
    try:
        error = None
        try:
            _materialize(model, snap, source, headers, None, [], in_place=True)
        except Exception as e:  # noqa: BLE001 - a file that fails while reading on one rank stops every rank
            error = e
        agree("reading the checkpoint in tpify.load_weights_", {}, error, group=tp_group)
    finally:
        snap.close()


def _set_tensor(model: nn.Module, holders: dict[int, list[tuple[nn.Module, str]]], old, value: torch.Tensor):
    spec = shard_spec_of(old)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        if spec is not None:
            new.tp_shard_spec = spec
        for module, name in holders[id(old)]:
            module._parameters[name] = new
    else:
        for module, name in holders[id(old)]:
            module._buffers[name] = value


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _FileTensor:
    """A ``get_slice``-like handle on one tensor of an opened file, for the copying reads.

    Each ``[index]`` maps the file anew (``safe_open`` of the load's opened descriptor,
    :class:`_Snapshot`, so every block comes from the file the load opened even if a save
    replaced it since; about 0.1 ms) and returns a view of just that block (safetensors >= 0.7
    returns views, no copy). :meth:`ShardSpec.read` copies the view into the preallocated shard
    and drops it, which unmaps it, so the source pages a copy touched leave this process's
    resident set: a load holds its shards plus one block (``block_bytes``, 16 MiB) in flight.
    Keeping one mapping per tensor instead saves nothing measurable (the cost is the page
    faults, the same either way) and holds a whole tensor's pages.
    """

    def __init__(self, file: str, key: str, shape: tuple[int, ...]):
        self.file, self.key, self.shape = file, key, tuple(shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return safe_open(self.file, framework="pt", device="cpu").get_slice(self.key)[index]

    def read_whole(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole tensor (a replicated parameter) copied into owned memory, converted to ``dtype``."""
        if not self.shape:  # a 0-d tensor
            value = safe_open(self.file, framework="pt", device="cpu").get_tensor(self.key)
            return value.to(dtype) if dtype is not None else value.clone()
        return ShardSpec(0, (self.shape[0],), 1).read(self, 0, dtype)  # one "rank" holding everything


def _single_range(spec: ShardSpec | None, shape: tuple[int, ...], tp_rank: int) -> tuple[int, int] | None:
    """``(start, stop)`` along ``spec.dim`` when this rank's shard is one range of that dimension
    of the dense tensor (so a view of the file's bytes can hold it), else ``None``.

    One range: a replicated tensor (the whole of dim 0); a split whose ranges, adjacent ones
    merged (packed ``[Q|K|V]`` parts at tp = 1, the last rank's query chunk next to replicated
    K/V), make one range with no padding rows. Along dimension 0 (column-parallel ``nn.Linear``
    weights, vocabulary rows) the shard is one contiguous byte range of the file; along a later
    dimension (row-parallel ``nn.Linear``, column-parallel ``Conv1D``) it is a strided one, a
    slice of every row. Not one range: packed parts at tp > 1 (``[Q_r|K_r|V_r]``), vocabulary
    padding rows."""
    if not shape:
        return None
    if spec is None:
        return 0, shape[0]
    merged: list[list[int]] = []
    for a, b in spec.ranges(tp_rank):
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    if len(merged) != 1 or merged[0][1] - merged[0][0] != spec.local_size:
        return None
    return merged[0][0], merged[0][1]


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a view of a mapped file, contiguous or strided) as a tensor whose storage spans
    only the bytes from its first element to its last, not the whole dense tensor's: ``torch.save``
    of a shard then writes those bytes only, and for a contiguous shard ``untyped_storage().nbytes()``
    is the shard's size (for a strided one, the span of its rows, the other ranks' columns in
    between included). Shares the memory, copies nothing; keeps the strides."""
    size = view.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(view.shape, view.stride())) if view.numel() else 0
    start = view.storage_offset() * size
    raw = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())  # numpy has no bfloat16: bytes
    flat = torch.from_numpy(raw.numpy()[start:start + span * size]).view(view.dtype)
    return flat.as_strided(view.shape, view.stride())


# Shards smaller than this are copied even when contiguous: a view keeps the page-cache pages it
# touched mapped, counted whole (a kernel with large folios maps up to 2 MiB around a touched
# byte), so a 4 KiB LayerNorm weight would cost up to 2 MiB of resident set; a copy costs 4 KiB.
_VIEW_MIN_BYTES = 1 << 20


class _Reader:
    """Reads this rank's slice of each checkpoint tensor from the load's opened files.

    A shard that is one range of its split dimension (:func:`_single_range`: replicated
    tensors, unpadded vocabulary rows, column-parallel ``nn.Linear`` weights split along
    dimension 0, which are one contiguous byte range of the file, and row-parallel ``nn.Linear``
    or column-parallel ``Conv1D`` weights split along dimension 1, a strided slice of every row),
    of at least ``_VIEW_MIN_BYTES`` (1 MiB) and stored in the dtype asked for, is returned as a
    zero-copy view of a private (copy-on-write) mapping of the file, as transformers 5 does for
    a whole model: its pages are read from the page cache when first touched, nothing is copied,
    and writes to the tensor (training) copy the written pages, never touching the file. One
    mapping per file serves every view. Any other shard (packed ``[Q|K|V]`` parts at tp > 1,
    padded vocabularies, a dtype conversion, ``in_place`` loads, every shard when ``views`` is
    false) is copied by :meth:`ShardSpec.read` block by block through a :class:`_FileTensor`,
    whose mappings are dropped after each block, so the source pages a copy touched do not stay
    resident.

    Why views: on the 2-core VM of issue 11, first-touching new anonymous memory costs about
    0.4 s/GB and a copy's source pages (mapped, faulted, unmapped) about as much again, while
    reading mapped page-cache pages costs about 0.2 s/GB: a copy costs four times a view.

    The cost of a strided view: a page holding the end of this rank's slice of one row and the
    start of the next rank's is mapped by both ranks, so a rank's resident set counts more than
    its shard (at tp = 2 a 4 KiB half row of a 2048-wide float32 matrix straddles two pages).
    These are page-cache pages, shared by every rank and by the page cache itself, not extra
    memory of the machine; the first optimizer step's writes make private copies of the written
    pages only. ``disable_mmap=True`` copies every shard into memory of its own instead.

    Like transformers' own loads, a view reads the file it was opened from: replacing or
    deleting the file (``os.replace``, as :func:`save_pretrained` does) changes nothing, but
    rewriting that same file in place while the model lives changes the pages not yet read or
    written.
    """

    def __init__(self, snap: _Snapshot, headers: dict, tp_rank: int, views: bool = True):
        self.snap, self.headers, self.tp_rank, self.views = snap, headers, tp_rank, views
        self.maps: dict[str, object] = {}  # file name -> safe_open handle whose mapping the views share

    def read(self, key: str, spec: ShardSpec | None, dtype: torch.dtype | None,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``key``, converted to ``dtype`` (``None``: as
        stored); with ``into``, copied into that tensor (converted to its dtype) and returned."""
        shape, file = self.headers[key]
        where = self.snap.where(file)
        rows = _single_range(spec, shape, self.tp_rank)
        if rows is not None and into is None and self.views:
            if file not in self.maps:
                self.maps[file] = safe_open(where, framework="pt", device="cpu")
            file_slice = self.maps[file].get_slice(key)
            stored = _SAFETENSORS_DTYPES.get(file_slice.get_dtype())
            dim = spec.dim if spec is not None else 0
            nbytes = math.prod(shape) // shape[dim] * (rows[1] - rows[0]) * (stored.itemsize if stored else 1)
            if (dtype is None or dtype == stored) and nbytes >= _VIEW_MIN_BYTES:
                index = (slice(None),) * dim + (slice(*rows),)
                return _own_storage(file_slice[index])
        file_tensor = _FileTensor(where, key, shape)
        cast = into.dtype if into is not None else dtype
        value = spec.read(file_tensor, self.tp_rank, cast) if spec is not None else file_tensor.read_whole(cast)
        if into is not None:
            with torch.no_grad():
                into.copy_(value)
            return into
        return value

    def close(self) -> None:
        """Drop the per-file handles (the views keep their mappings alive)."""
        self.maps.clear()


def _materialize(model, snap, source, headers, dtype, to_init, in_place: bool = False, copy: bool = False):
    """Replace every meta parameter/persistent buffer by this rank's slice read from the files
    (``in_place``: copy the slices into the existing tensors, which keep their identity).

    Reads go through :class:`_Reader`: contiguous shards in the stored dtype become zero-copy
    views of the file's mapping (unless ``copy``), the others are copied into owned memory."""
    tp_rank = model.tp_info.tp_rank
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    tensors: dict[int, tuple[str, torch.Tensor]] = {}
    for mname, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                fqn = f"{mname}.{name}" if mname else name
                holders.setdefault(id(t), []).append((module, name))
                if fqn in source and id(t) not in tensors:
                    tensors[id(t)] = (fqn, t)
    from tqdm.auto import tqdm

    reader = _Reader(snap, headers, tp_rank, views=not copy)
    try:
        for fqn, old in tqdm(list(tensors.values()), desc="tpify: loading", disable=tp_rank != 0 or None,
                             leave=False):
            spec = shard_spec_of(old)
            if in_place:
                reader.read(source[fqn], spec, None, into=old)
                continue
            value = reader.read(source[fqn], spec, dtype if old.is_floating_point() else None)
            _set_tensor(model, holders, old, value)
    finally:
        reader.close()
    if to_init:
        _init_missing(model, to_init, dtype)
    leftover = [f for f, p in model.named_parameters() if p.is_meta]
    if leftover:  # defensive: the checks above make this unreachable
        raise CheckpointError(f"tpify: parameters left unloaded: {leftover}")


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
    owners = [m for m in model.modules()
              if any(m._buffers.get(name) is not None for name in m._non_persistent_buffers_set)]
    if not owners or not hasattr(model, "_init_weights"):
        return
    persistent = set(_persistent_buffers(model))
    marked = [t for t in model.parameters()] + [model.get_buffer(f) for f in persistent]
    flags = [(t, getattr(t, "_is_hf_initialized", None)) for t in marked]
    for t in marked:
        t._is_hf_initialized = True
    try:
        with torch.no_grad():
            for module in owners:
                model._init_weights(module)
    finally:
        for t, old in flags:
            if old is None:
                del t._is_hf_initialized
            else:
                t._is_hf_initialized = old


def _init_missing(model, fqns, dtype):
    """Initialise head parameters absent from a base checkpoint, identically on every rank."""
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


# ----------------------------------------------------------------------------------------------
# save_pretrained
# ----------------------------------------------------------------------------------------------

def _parse_size(size) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


@contextlib.contextmanager
def _dense_config(model: nn.Module):
    """The model's config as it must be written: the values the layout divided per rank put back
    dense, and ``architectures`` naming the model's class (as transformers' save_pretrained sets it)."""
    info = getattr(model, "tp_info", None)
    divided = dict(info.layout.config_divides) if info is not None else {}
    config = model.config
    divided["architectures"] = [type(model).__name__]
    per_rank = {name: getattr(config, name) for name in divided}
    try:
        for name, dense in divided.items():
            setattr(config, name, dense)
        yield config
    finally:
        for name, value in per_rank.items():
            setattr(config, name, value)


def agree_on_write(ok: bool, where: str, error: BaseException | None, device: torch.device) -> None:
    """All ranks learn whether the writing rank succeeded (one all-reduce of one value).

    Every rank calls it after the writer's step; the writer re-raises its own ``error``, the
    others raise a ``RuntimeError`` naming ``where``.

    ``device``: where the flag lives (the model's device: NCCL reduces only CUDA tensors).
    """
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        comm.all_reduce(flag, None, op="max")
    if error is not None:
        raise error
    if flag.item():
        raise RuntimeError(f"tpify: saving failed on the writing rank (global rank 0) while {where}; "
                           f"see that rank's error. The target directory holds one whole checkpoint (the previous "
                           f"one unless the failure came after the switch to the new one).")


def _saved_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, local tensor)`` pairs to save: tied copies dropped as transformers 5 does."""
    tied = _tied_names(model)
    out, seen = [], set()
    named = list(model.named_parameters(remove_duplicate=False))
    named += [(f, model.get_buffer(f)) for f in _persistent_buffers(model)]
    by_id: dict[int, list[str]] = {}
    for fqn, t in named:
        by_id.setdefault(id(t), []).append(fqn)
    for fqn, t in named:
        if id(t) in seen:
            continue
        seen.add(id(t))
        names = by_id[id(t)]
        keep = [n for n in names if not any(re.search(pat, n) for pat in tied)] or names
        out.append((keep[0], t))
    return out


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = "2GB") -> None:
    """Save a (parallelized) model as a standard Hugging Face directory, from global rank 0.

    Every tensor is gathered to its dense layout with :meth:`ShardSpec.gather` (vocab padding
    stripped, packed ``[Q|K|V]`` re-packed), so ``transformers.AutoModel*.from_pretrained(path)``
    loads it, and :func:`from_pretrained` loads it at any valid tp size. Tied copies
    (``lm_head.weight``) are not stored, as transformers 5 does. Tensors are grouped in files of
    at most ``max_shard_size`` (``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``; one ``model.safetensors`` when all fit); files are gathered
    and written one at a time, so the writing rank never holds the whole dense model.

    What it touches: rank 0 writes every file into a temporary directory ``.NAME.tmp-<id>``
    beside ``path`` (beside the directory a symlinked ``path`` points to), first removing such
    directories that no live save holds (left by a killed save). A new ``path`` is that
    directory renamed. An existing ``path`` goes from the checkpoint it holds to the new one by
    one atomic rename or unlink (:func:`_swap_into_place`): at every instant, a kill included,
    ``path`` holds one whole checkpoint, the old one or the new one, and transformers and
    :func:`from_pretrained` load the same one. Then ``config.json`` and
    ``generation_config.json`` are replaced (each atomically), and the weight files of earlier
    saves that the new checkpoint does not use (``model*.safetensors``, its index,
    ``pytorch_model*.bin``) are removed. Every other file (tokenizer, notes, Trainer
    ``checkpoint-*`` directories) is kept, as transformers' ``save_pretrained`` does. Shard files
    get the standard names when no file in ``path`` has them, else
    ``model-<id>-0000i-of-0000n.safetensors`` (``<id>``: 8 hex digits of this save's id), so
    a save never overwrites a file the current checkpoint uses; repeated saves alternate. Every
    file of one save carries its id (``tpify_save_id`` in the safetensors and index metadata).
    Not synced to disk (``fsync``), as transformers does not: the guarantee holds against a
    killed process, not a power cut.

    Under FSDP2 (``fully_shard`` over the DP dimension, parameters that are DTensors) each tensor
    is first gathered over the DP dimension (``DTensor.full_tensor``), then over TP.

    Communication: per tensor, one all-gather over the TP group (every rank of every TP group
    must call this function); per file, one all-reduce of one int over the world, so a failure
    on the writing rank raises on every rank instead of hanging them.

    Raises:
        ValueError: ``path`` is an existing file.
        AgreementError: on the other ranks, when ``path`` is a file on one rank; when the ranks
            hold different models (the first communication compares them, ``comm.agree``).
        RuntimeError: on ranks other than 0, when rank 0 failed (rank 0 raises its own error);
            ``path`` then holds one whole checkpoint (the old one unless the failure came after
            the switch), at worst with unused new shard files the next save removes.
    """
    path = Path(path)
    error = None
    if path.exists() and not path.is_dir():
        error = ValueError(f"save_pretrained: {path} exists and is not a directory; pass a directory path")
    entries = _saved_tensors(model)
    specs = {}
    try:  # under FSDP2 the parameters are DTensors without their tp_shard_spec: the specs recorded by name
        from .api import param_specs

        specs = param_specs(model)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement below
        error = error or e
    shapes = digest([(k, list(t.shape), str(t.dtype)) for k, t in entries])
    agree("tpify.save_pretrained", {"saved tensors": shapes, "max_shard_size": str(max_shard_size)}, error)
    info = getattr(model, "tp_info", None)
    group = info.tp_group if info is not None else None
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    limit = _parse_size(max_shard_size)
    device = next((t.device for _, t in entries), torch.device("cpu"))
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    total = 0
    for key, t in entries:
        spec = specs.get(id(t), shard_spec_of(t))
        numel = t.numel() // t.shape[spec.dim] * spec.global_size if spec is not None else t.numel()
        nbytes = numel * t.element_size()
        total += nbytes
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append((key, t))
        size += nbytes
    names = ([SAFE_WEIGHTS_NAME] if len(files) == 1 else  # in tmp; _swap_into_place may rename them
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])

    save_id = uuid.uuid4().hex  # in every file of this save: a reader can tell one save from a mix of two
    target = path.resolve() if path.is_symlink() else path  # tmp on the target's filesystem: renames are atomic
    tmp = target.parent / f".{target.name}.tmp-{save_id[:8]}"
    err, held = None, None
    if writer:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove_dead_saves(target)
            tmp.mkdir()
            held = _lock(tmp, wait=True)  # until this save ends: a later save's _remove_dead_saves leaves it
        except BaseException as e:  # noqa: BLE001 - reported to every rank by _agree
            err = e
    agree_on_write(err is None, f"creating {tmp}", err, device)
    weight_map = {}
    try:
        for name, group_entries in zip(names, files):
            dense = {}
            for key, t in group_entries:
                spec = specs.get(id(t), shard_spec_of(t))
                local = t.detach()
                if is_dtensor(local):  # FSDP2: first the whole TP shard, gathered over the DP dimension
                    local = local.full_tensor()
                value = spec.gather(local, group) if spec is not None else local
                if writer:
                    dense[key] = value.contiguous().cpu()  # one file's tensors at a time, in host memory
                weight_map[key] = name
            err = None
            if writer:
                try:
                    save_file(dense, str(tmp / name), metadata={"format": "pt", _SAVE_ID: save_id})
                except BaseException as e:  # noqa: BLE001
                    err = e
            del dense
            agree_on_write(err is None, f"writing {name}", err, device)
        err = None
        if writer:
            try:
                index = None if len(files) == 1 else {"metadata": {"total_size": total, _SAVE_ID: save_id},
                                                      "weight_map": dict(sorted(weight_map.items()))}
                with _dense_config(model):
                    model.config.save_pretrained(str(tmp))
                generation_config = getattr(model, "generation_config", None)
                if generation_config is not None and getattr(model, "can_generate", lambda: False)():
                    generation_config.save_pretrained(str(tmp))
                _swap_into_place(tmp, target, index, save_id)
            except BaseException as e:  # noqa: BLE001
                err = e
        agree_on_write(err is None, f"moving {tmp} to {path}", err, device)
    finally:
        if writer:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            finally:
                _unlock(held)


# Weight files a save owns in its target: replaced by the new save, or removed when it writes others.
_OWNED_WEIGHTS = re.compile(r"^(model((-[0-9a-f]{8}|-[0-9a-f]{32})?-\d{5}-of-\d{5})?\.safetensors|"
                            r"model\.safetensors\.index\.json|"
                            r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$")
_CONFIG_FILES = ("config.json", "generation_config.json")  # moved in after the weights' switch, in this order


def _lock(directory: Path, wait: bool) -> int | None:
    """An exclusive ``flock`` on ``directory``: its descriptor (:func:`_unlock` releases it; so
    does the death of the process), or ``None`` when the platform or filesystem has no flock
    or, with ``wait=False``, another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:  # held (LOCK_NB), or no locks on this filesystem
        os.close(fd)
        return None
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _remove_dead_saves(target: Path) -> None:
    """Remove the temporary directories ``.NAME.tmp-<id>`` beside ``target`` whose save is dead.

    A save holds a ``flock`` on its temporary directory from just after creating it to its end;
    the kernel releases it when the process dies (SIGKILL included), so a directory this
    process can lock is a killed save's leftover. Where locks are unavailable nothing is
    removed (leftovers are harmless: no load reads them). A save whose directory is removed in
    the microseconds between its ``mkdir`` and its ``flock`` fails loudly on its next write;
    its target is untouched. Touches nothing else.
    """
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.tmp-[0-9a-f]{{8}}$")
    for entry in target.parent.iterdir():
        if not pattern.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        fd = _lock(entry, wait=False)
        if fd is not None:
            try:
                shutil.rmtree(entry, ignore_errors=True)
            finally:
                _unlock(fd)


def _shard_names(path: Path, count: int, save_id: str) -> list[str]:
    """Names of ``count`` shard files for a save into ``path``, none of which is a file there:
    the standard ``model-0000i-of-0000n.safetensors`` when all are free, else
    ``model-<8 hex digits of save_id>-0000i-of-0000n.safetensors`` (the whole id in the
    astronomically rare case that those exist too). transformers' own ``save_pretrained``
    removes both forms (names matching ``*-NNNNN-of-NNNNN``)."""
    for tag in ("", f"-{save_id[:8]}", f"-{save_id}"):
        names = [f"model{tag}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        if not any(os.path.lexists(path / n) for n in names):
            return names
    raise FileExistsError(f"save_pretrained: shard files of save {save_id} already exist in {path}")


def _swap_into_place(tmp: Path, path: Path, index: dict | None, save_id: str) -> None:
    """Move the checkpoint written in ``tmp`` (its shards, configs; ``index``: the index to
    write, with ``tmp``'s file names, or ``None`` for one ``model.safetensors``) into ``path``.

    A new ``path`` is ``tmp`` renamed (atomic). Into an existing directory, under an exclusive
    ``flock`` of it (two saves never interleave their moves), in this order:

    1. the shard files, under names no file in ``path`` has (:func:`_shard_names`; ``tmp``'s
       files renamed and the index written with those names): the checkpoint transformers
       loads is unchanged, the new files are unused;
    2. the switch, one atomic step: for one file, ``os.replace`` of ``model.safetensors``
       (transformers loads it before any index); for an index, ``os.replace`` of
       ``model.safetensors.index.json``, which is the switch unless a ``model.safetensors``
       is there, whose ``os.unlink`` then is (the new index and its shards are complete before);
    3. ``config.json``, then ``generation_config.json`` (each ``os.replace``): until then the new
       weights load with the old config (the same file in a resumed training; a loud shape error
       at worst, never a silent mix of weights);
    4. the weight files of earlier saves the new checkpoint does not use (``_OWNED_WEIGHTS``:
       the old index first, then files, ``pytorch_model*.bin``), all unused since the switch.

    A kill before step 2 leaves the old checkpoint and unused new files; after it, the new one
    and unused old files: the next save removes the unused ones (step 4). Every other file
    (tokenizer, notes, logs, ``checkpoint-*`` directories) stays, as with transformers.

    Raises:
        OSError: a rename or unlink failed (``path`` then holds one whole checkpoint).
    """
    if not path.exists():
        if index is not None:
            _write_index(tmp / SAFE_WEIGHTS_INDEX_NAME, index)
        os.rename(tmp, path)
        return
    held = _lock(path, wait=True)
    try:
        if index is not None:
            index = _rename_shards(tmp, path, index, save_id)
            _write_index(tmp / SAFE_WEIGHTS_INDEX_NAME, index)
        new = sorted(p.name for p in tmp.iterdir())
        shards = [n for n in new if n.endswith(".safetensors") and n != SAFE_WEIGHTS_NAME]
        for name in shards:  # 1. unused by the checkpoint transformers loads
            os.replace(tmp / name, path / name)
        if index is None:  # 2. the switch
            os.replace(tmp / SAFE_WEIGHTS_NAME, path / SAFE_WEIGHTS_NAME)
        else:
            os.replace(tmp / SAFE_WEIGHTS_INDEX_NAME, path / SAFE_WEIGHTS_INDEX_NAME)
            if (path / SAFE_WEIGHTS_NAME).is_file():
                os.unlink(path / SAFE_WEIGHTS_NAME)
        rest = [n for n in _CONFIG_FILES if n in new] + [n for n in new if n not in _CONFIG_FILES and n not in
                                                         (*shards, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)]
        for name in rest:  # 3. configs (and any file the config's save wrote, e.g. remote code)
            os.replace(tmp / name, path / name)
        stale = [p.name for p in path.iterdir()
                 if p.name not in new and _OWNED_WEIGHTS.match(p.name) and p.is_file()]
        for name in sorted(stale, key=lambda n: (not n.endswith(".json"), n)):  # 4. indexes first
            os.unlink(path / name)
        os.rmdir(tmp)
    finally:
        _unlock(held)


def _rename_shards(tmp: Path, path: Path, index: dict, save_id: str) -> dict:
    """Rename the shard files in ``tmp`` to names free in ``path`` (:func:`_shard_names`);
    the index with the new names."""
    written = sorted(set(index["weight_map"].values()))
    final = dict(zip(written, _shard_names(path, len(written), save_id)))
    for old, new in final.items():
        if old != new:
            os.rename(tmp / old, tmp / new)
    return {**index, "weight_map": {k: final[v] for k, v in index["weight_map"].items()}}


def _write_index(file: Path, index: dict) -> None:
    file.write_text(json.dumps(index, indent=2) + "\n")
