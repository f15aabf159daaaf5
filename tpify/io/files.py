"""Which files make a checkpoint, each opened once: the directory side of loading.

transformers 5 loads one checkpoint from a directory, chosen by precedence
(:func:`_weight_files`): the file ``config.json`` names in ``transformers_weights``, else
``model.safetensors``, else ``model.safetensors.index.json`` and the files its ``weight_map``
names. :func:`open_checkpoint` opens that checkpoint's files once each (a :class:`Snapshot`),
reads every header once (shape, file, stored dtype of each tensor: :class:`TensorHeader`) and
checks that the files are one whole save, looking again while a concurrent
:func:`tpify.save_pretrained` switches the directory. Local: no communication; the same result
or error on every rank given the same directory.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from . import CheckpointError

__all__ = ["Snapshot", "TensorHeader", "open_checkpoint", "check_safetensors", "stored_float_dtype", "STORED_DTYPES",
           "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAVE_ID"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SAVE_ID = "tpify_save_id"  # metadata every file of one save_pretrained carries (index and shards)

#: torch dtype of each safetensors dtype code torch can hold (``TensorHeader.dtype``).
STORED_DTYPES = {code: getattr(torch, name) for code, name in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "C64": "complex64", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}.items() if hasattr(torch, name)}
_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what a model's parameters may be


class TensorHeader(NamedTuple):
    """What the header of the file holding a checkpoint tensor says of it."""

    shape: tuple[int, ...]
    file: str  # the file's name in the checkpoint directory
    dtype: torch.dtype | None  # as stored; None for a dtype torch cannot hold


class Snapshot:
    """The files of a checkpoint directory, each opened once for the whole load.

    A file is opened (``os.open``) the first time it is named and stays open until
    :meth:`close`; every later read goes through that descriptor (``/proc/self/fd/<n>`` on
    Linux), so a save that replaces or deletes the file meanwhile (``os.replace``,
    ``os.unlink``) cannot change what this load reads: it keeps reading the file it opened (and
    the views :class:`tpify.io.reader._Reader` returns keep that file's mapping).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fds: dict[str, int] = {}

    def where(self, name: str) -> str:
        """A path that reads the opened file ``name`` (opening it now if needed).

        Raises:
            FileNotFoundError: ``name`` is not in the directory (:func:`open_checkpoint` looks again).
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
    """No weights file where transformers looks (:func:`open_checkpoint` looks once more: a save may be
    switching from a single file to an index, or back)."""


class _MixedSaves(CheckpointError):
    """The index and the files it names carry different save ids (:func:`open_checkpoint` looks again)."""

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
    return dict(weight_map), metadata.get(SAVE_ID) if isinstance(metadata, dict) else None


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _explicit_weights(snap: Snapshot) -> str | None:
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


def _weight_files(snap: Snapshot) -> tuple[dict[str, str], list]:
    """``({checkpoint key: file name}, [the index's save id])`` of the checkpoint transformers 5
    loads from the directory, every file it names opened in ``snap``.

    transformers' precedence (``modeling_utils._get_resolved_checkpoint_files``, local directory):
    the file ``config.json`` names in ``transformers_weights``; else ``model.safetensors``; else
    ``model.safetensors.index.json`` and the files its ``weight_map`` names. A single file has no
    save id of its own (``[]``). Other weight files in the directory are never opened.

    Raises:
        FileNotFoundError: a file the index names is not there (:func:`open_checkpoint` looks again:
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


def _open(file: Path, where: str | None = None, fix: str = "re-download or re-save it"):
    """``safe_open`` of ``file`` (read through ``where``, an opened descriptor's path), turning a
    truncated or corrupt file into a clear error naming it and ``fix``."""
    try:
        return safe_open(where or str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError (not exported) or OSError
        size = file.stat().st_size if file.exists() else "missing"
        raise CheckpointError(f"cannot read safetensors file {file} ({size} bytes): {e}. The file is truncated or "
                              f"corrupt; {fix}.") from e


def check_safetensors(file: Path, fix: str = "re-download or re-save it") -> None:
    """Whether ``file`` is a whole safetensors file: its header parses and its tensors cover the
    file exactly (what safetensors checks when it opens one). Local.

    Raises:
        CheckpointError: missing, truncated or corrupt (named, with its size, and ``fix``).
    """
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"safetensors file {file} is missing; {fix}.")
    _open(file, fix=fix)


def _headers(snap: Snapshot, weight_map: dict[str, str],
             index_ids: list = ()) -> tuple[dict[str, TensorHeader], list]:
    """``({key: TensorHeader}, [each file's save id])``, reading each file's header once, the
    files in sorted order and each file's tensors in its own order.

    Raises:
        _MixedSaves: the files (and ``index_ids``) carry different save ids; checked first, since
            files of two saves may hold the same tensors.
        CheckpointError: a tensor stored in two files (each named); a tensor the index lists
            that is in no file.
    """
    out: dict[str, TensorHeader] = {}
    ids, seen, twice = [], {}, []
    files = sorted(set(weight_map.values()))
    for name in files:
        handle = _open(snap.path / name, snap.where(name))
        ids.append((handle.metadata() or {}).get(SAVE_ID))
        for key in handle.keys():
            if key in seen:
                twice.append((key, seen[key], name))
            seen[key] = name
            stored = handle.get_slice(key)
            out[key] = TensorHeader(tuple(stored.get_shape()), name, STORED_DTYPES.get(stored.get_dtype()))
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


def open_checkpoint(path: Path, attempts: int = 10) -> tuple[Snapshot, dict[str, str], dict]:
    """Open every file of the checkpoint transformers would load: ``(snapshot, weight_map, headers)``.

    A save (:func:`tpify.save_pretrained`) switches a directory from one whole checkpoint to another
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
        snap = Snapshot(path)
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


def stored_float_dtype(headers: dict[str, TensorHeader], weight_map: dict[str, str]) -> torch.dtype:
    """The dtype of the first floating tensor (float32, float16, bfloat16 or float64) of the
    checkpoint's first file (by name), as stored; float32 when that file holds none. What
    ``dtype="auto"`` falls back to when ``config.json`` names no dtype."""
    first = sorted(set(weight_map.values()))[0]
    return next((h.dtype for h in headers.values() if h.file == first and h.dtype in _FLOATING), torch.float32)
