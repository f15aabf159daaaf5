"""The dense save: a parallelized model written as a standard Hugging Face directory, atomically.

The files of the plan (:func:`plan_shards`) are assigned to the ranks in turn (every rank that
sees the temporary directory writes, :func:`staged`). In rounds of one file per writer, each
file's tensors are gathered to their dense layout (:func:`gather_dense`; padding stripped,
packed parts re-packed) on every rank, kept by the file's writer only, and the writers write
their files in parallel into the temporary directory beside the target; each round ends with
every rank learning that every rank's file is complete (:func:`tpify.agree.on_every_rank`), so
a failure on any rank raises on every rank and nothing is moved. Then global rank 0 writes the
index and the configs and the target goes from the checkpoint it holds to the new one in one
atomic rename or unlink (:func:`_swap_into_place`), so it holds one whole checkpoint at every
instant, a kill included (:func:`tpify.agree.on_writing_rank` reports that step's outcome).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from ..agree import on_every_rank, on_writing_rank
from ..comm import all_gather_objects
from ..hf_modules import config_get, config_set
from ..info import tp_info_of
from ..sharding import ShardSpec, is_dtensor, shard_spec_of
from .files import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, SAVE_ID

__all__ = ["ShardPlan", "plan_shards", "shard_size_limit", "gather_dense", "staged"]


def _spec(specs: dict[int, ShardSpec | None], t: torch.Tensor) -> ShardSpec | None:
    """``t``'s spec: the one recorded for it by id (FSDP2's DTensors lost theirs), else its own."""
    return specs.get(id(t), shard_spec_of(t))


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go in which file, in save order.

    Attributes:
        files: ``(file name, [(key, local tensor), ...])`` per file: ``model.safetensors`` when
            one file holds everything, else ``model-0000i-of-0000n.safetensors`` (names in the
            temporary directory; :func:`_swap_into_place` may rename them in the target).
        total: the dense size of every tensor, in bytes (the index's ``total_size``).
    """

    files: list[tuple[str, list[tuple[str, torch.Tensor]]]]
    total: int

    def index(self, save_id: str) -> dict | None:
        """The ``model.safetensors.index.json`` to write (``None`` for one file), with ``save_id``."""
        if len(self.files) == 1:
            return None
        weight_map = {key: name for name, entries in self.files for key, _ in entries}
        return {"metadata": {"total_size": self.total, SAVE_ID: save_id},
                "weight_map": dict(sorted(weight_map.items()))}


def shard_size_limit(max_shard_size: int | str) -> int:
    """``max_shard_size`` in bytes: a positive ``int``, or a string transformers parses
    (``"2GB"``, ``"500MB"``, ``"5GiB"``, ``"300KB"``; ``"...Gb"`` in bits; its
    ``convert_file_size_to_int``). Local.

    Raises:
        ValueError: not a positive int nor such a string, or a size of 0 bytes or less (every
            tensor would get a file of its own: a model of 300 tensors written as 300 files).
    """
    from transformers.utils.hub import convert_file_size_to_int

    usage = ("max_shard_size is the largest file in bytes: a positive int, or a string with a unit as "
             "transformers takes it ('2GB', '500MB', '5GiB', '300KB')")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        raise ValueError(f"save_pretrained: {usage}; got {max_shard_size!r} ({type(max_shard_size).__name__})")
    try:
        limit = convert_file_size_to_int(max_shard_size.strip() if isinstance(max_shard_size, str) else max_shard_size)
    except ValueError:
        raise ValueError(f"save_pretrained: {usage}; got {max_shard_size!r}") from None
    if limit <= 0:
        parsed = f" = {limit} bytes" if isinstance(max_shard_size, str) else ""
        raise ValueError(f"save_pretrained: {usage}; got {max_shard_size!r}{parsed}, which would give every tensor a "
                         f"file of its own")
    return limit


def plan_shards(entries: list[tuple[str, torch.Tensor]], specs: dict, max_shard_size: int | str) -> ShardPlan:
    """Group ``entries`` (key, local tensor), in order, into files of at most ``max_shard_size``
    dense bytes (``"2GB"``, ``"300KB"`` or a number; a larger tensor gets a file of its own).
    Local: sizes from the shapes and the specs, no communication.

    Raises:
        ValueError: ``max_shard_size`` is not a positive size (:func:`shard_size_limit`).
    """
    limit = shard_size_limit(max_shard_size)
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = total = 0
    for key, t in entries:
        spec = _spec(specs, t)
        numel = t.numel() // t.shape[spec.dim] * spec.global_size if spec is not None else t.numel()
        nbytes = numel * t.element_size()
        total += nbytes
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((key, t))
        size += nbytes
    names = ([SAFE_WEIGHTS_NAME] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    return ShardPlan(list(zip(names, groups)), total)


def gather_dense(entries: list[tuple[str, torch.Tensor]], specs: dict, group, keep: bool) -> dict[str, torch.Tensor]:
    """The dense value of each of ``entries`` (one file's), kept (contiguous, in host memory) only
    when ``keep`` (on the writing rank): ``{}`` elsewhere.

    Communication: per sharded tensor, one all-gather over the TP ``group``
    (:meth:`ShardSpec.gather`); under FSDP2 (a DTensor), first ``full_tensor`` over the DP
    dimension. Every rank of every TP group must call it with the same entries.
    """
    dense = {}
    for key, t in entries:
        spec = _spec(specs, t)
        local = t.detach()
        if is_dtensor(local):  # FSDP2: first the whole TP shard, gathered over the DP dimension
            local = local.full_tensor()
        value = spec.gather(local, group) if spec is not None else local
        if keep:
            dense[key] = value.contiguous().cpu()  # one file's tensors at a time, in host memory
    return dense


class _Stage:
    """A save in progress: its id (global rank 0's, shared), its temporary directory beside the
    target (:func:`staged`), and the ranks that write its files (:attr:`writers`)."""

    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        # In every file of this save: a reader can tell one save from a mix of two. Rank 0's, on every rank.
        self.save_id = all_gather_objects(uuid.uuid4().hex)[0]
        self.target = path.resolve() if path.is_symlink() else path  # tmp on the target's filesystem: atomic renames
        self.tmp = self.target.parent / f".{self.target.name}.tmp-{self.save_id[:8]}"
        self.writing, self.held = False, None
        self.writers: list[int] = [0]

    def writer_of(self, index: int) -> int:
        """The global rank that writes the ``index``-th file of the plan: the writers in turn."""
        return self.writers[index % len(self.writers)]

    def rounds(self, files: list) -> Iterator[list[tuple[int, str, list]]]:
        """The plan's files in rounds of one file per writer: ``[(writer, name, entries), ...]``.
        A rank holds the dense tensors of at most one file at a time (the one it writes)."""
        step = len(self.writers)
        for start in range(0, len(files), step):
            yield [(self.writer_of(start + j), name, entries) for j, (name, entries) in
                   enumerate(files[start: start + step])]

    def write_own(self, mine: tuple[str, dict[str, torch.Tensor]] | None) -> None:
        """Every rank: write its file of this round (``mine``: ``(name, dense tensors)``, or
        ``None``) into the temporary directory, all in parallel; then every rank learns that
        every rank's file is complete (:func:`tpify.agree.on_every_rank`).

        Communication: one all-gather of a small object over the world.
        """
        where = f"writing {mine[0] if mine else 'its file'} into {self.tmp}"
        with on_every_rank(where):
            if mine is not None:
                name, dense = mine
                with self.still_there():
                    save_file(dense, str(self.tmp / name), metadata={"format": "pt", SAVE_ID: self.save_id})

    @contextlib.contextmanager
    def still_there(self):
        """Turn an error raised because this save's temporary directory is gone
        (``FileNotFoundError``, safetensors' ``SafetensorError``) into a ``FileNotFoundError`` that
        says so: another process removed it while this save wrote into it (a save into the same
        folder on a filesystem without ``flock``, a cleanup of hidden folders)."""
        try:
            yield
        except Exception as e:  # FileNotFoundError, or safetensors' SafetensorError on a missing folder
            if self.tmp.is_dir():
                raise
            raise FileNotFoundError(
                f"save_pretrained: this save's temporary folder {self.tmp} disappeared while the save was writing "
                f"into it: another process removed it (another save into {self.path} at the same time, or a "
                f"cleanup of hidden folders). {self.path} is untouched: it holds what it held before this save. "
                f"Save again, one save at a time into one folder (give concurrent jobs their own output "
                f"folders)") from e

    def commit(self, model: nn.Module, index: dict | None) -> None:
        """Write ``model``'s dense config (and generation config) beside the weights, then move
        the new checkpoint into the target (:func:`_swap_into_place`), on global rank 0; every
        other rank's files are complete (each round ended in :meth:`write_own`'s agreement).

        Communication: one all-reduce of one int over the world (:func:`on_writing_rank`).
        """
        with on_writing_rank(f"moving {self.tmp} to {self.path}", self.device) as writing:
            if writing:
                with self.still_there():
                    _write_configs(model, self.tmp)
                    _swap_into_place(self.tmp, self.target, index, self.save_id)


@contextlib.contextmanager
def staged(path: Path, device: torch.device, several_writers: bool = True) -> Iterator[_Stage]:
    """A save into ``path``: global rank 0 creates its temporary directory ``.NAME.tmp-<id>``
    beside ``path`` (beside the directory a symlinked ``path`` points to), first removing such
    directories no live save holds (left by a killed save), and holds a lock on it until the
    block ends; then it removes whatever is left of it (nothing after a commit).

    Writers (``several_writers``): every rank that sees the temporary directory (a filesystem
    the ranks share: one host, or a shared mount), in rank order; on hosts that do not see it,
    none (then rank 0's host writes every file). Without ``several_writers``, rank 0 alone.

    Communication: one all-gather of the save's id, one all-reduce of one int over the world
    after the creation (:func:`on_writing_rank`), one all-gather of who sees the directory;
    every rank must enter the block.

    Concurrent saves into one folder (other processes) each write their own temporary
    directory; the removal of dead ones and the creation and locking of a new one happen under
    a ``flock`` of the parent folder, so a save never removes another's directory between its
    creation and its lock. Their moves into the target are serialised (:func:`_swap_into_place`);
    the last to move wins, and the target holds one whole checkpoint throughout.

    Raises:
        OSError: creating the directory failed (on the writing rank; ``RuntimeError`` elsewhere).
        FileNotFoundError: the temporary directory disappeared while the save wrote into it
            (another process removed it); the message says so, and that the target is untouched.
    """
    stage = _Stage(path, device)
    with on_writing_rank(f"creating {stage.tmp}", device) as writing:
        stage.writing = writing
        if writing:
            stage.target.parent.mkdir(parents=True, exist_ok=True)
            parent = _lock(stage.target.parent, wait=True)  # another save's cleanup never sees an unlocked new dir
            try:
                _remove_dead_saves(stage.target)
                stage.tmp.mkdir()
                stage.held = _lock(stage.tmp, wait=True)  # until the save ends: other saves' cleanup leaves it
            finally:
                _unlock(parent)
    if several_writers:
        sees = all_gather_objects(stage.tmp.is_dir())
        stage.writers = [r for r, seen in enumerate(sees) if seen] or [0]
    try:
        yield stage
    finally:
        if stage.writing:
            try:
                if stage.tmp.exists():
                    shutil.rmtree(stage.tmp, ignore_errors=True)
            finally:
                _unlock(stage.held)


def _write_configs(model: nn.Module, directory: Path) -> None:
    """``config.json`` (dense: :func:`_dense_config`) and, for a model that generates,
    ``generation_config.json``, written into ``directory``."""
    with _dense_config(model):
        model.config.save_pretrained(str(directory))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(str(directory))


@contextlib.contextmanager
def _dense_config(model: nn.Module):
    """The model's config as it must be written: the values the layout divided per rank put back
    dense; ``architectures`` naming the model's class and ``dtype`` the dtype of its first floating
    parameter (the dtype of the tensors written), both as transformers' ``save_pretrained`` sets them
    (a model loaded from a float32 checkpoint with ``dtype=torch.bfloat16``, or converted with
    ``.to(torch.bfloat16)``, keeps the config's ``"float32"``, and transformers would reload the
    bfloat16 files at twice the memory). Restored afterwards."""
    info = tp_info_of(model)
    divided = dict(info.layout.config_divides) if info is not None else {}
    config = model.config
    divided["architectures"] = [type(model).__name__]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        divided["dtype"] = str(dtype).split(".")[1]
    per_rank = {name: config_get(config, name) for name in divided}
    try:
        for name, dense in divided.items():
            config_set(config, name, dense)
        yield config
    finally:
        for name, value in per_rank.items():
            config_set(config, name, value)


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
        try:
            fd = _lock(entry, wait=False)
        except FileNotFoundError:  # its save ended and removed it since the listing: nothing to do
            continue
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
    """Move the checkpoint written in ``tmp`` (``index``: the index to write, or ``None`` for one
    ``model.safetensors``) into ``path``: a new ``path`` is ``tmp`` renamed (atomic); into an
    existing directory, under an exclusive ``flock`` of it, the new shards under unused names, then
    one atomic switch (``os.replace`` of the file or index), then the configs, then the earlier
    saves' unused weight files. A kill at any point leaves one whole checkpoint loadable. The order
    and why: docs/loading-and-saving.md, "_swap_into_place".

    Raises:
        OSError: a rename or unlink failed (``path`` then holds one whole checkpoint).
    """
    if not path.exists():
        if index is not None:
            _write_index(tmp / SAFE_WEIGHTS_INDEX_NAME, index)
        try:
            os.rename(tmp, path)
            return
        except OSError as e:  # another save made path since: move into it as into any checkpoint
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not path.is_dir():
                raise
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
