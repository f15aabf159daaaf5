"""save_pretrained into an existing checkpoint, killed at every step of the swap; what a load
picks in a directory that holds several weight files; indexes and headers that name a tensor twice.

One process, tp = 1, tiny float32 GPT-2 models. Comparisons are bitwise (``torch.equal``):
saving and loading move bytes, they compute nothing. The kill is simulated in process: the
k-th call of ``os.replace``/``os.rename``/``os.unlink``/``os.rmdir`` or of the write of a file
(every file is written before anything is moved, by the rank it is assigned to) during a save
raises before it acts, and so does every later one, so no ``except``/``finally`` of the dead save
changes the directory (as after a SIGKILL, which runs none); its temporary directory stays.
tests/unit/test_loading_unit.py kills a real process while it writes (before any swap).
"""

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import tpify
from tpify.io.save import _OWNED_WEIGHTS

# About 20 KB of float32: "6KB" shards give 4 files, "4KB" 6, "1GB" one model.safetensors.
_CFG = dict(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)


def _gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**_CFG)).eval()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _which(state: dict, refs: dict[str, dict]) -> str:
    """The name of the reference ``state`` equals exactly (every tensor), or a failure."""
    same = [name for name, ref in refs.items()
            if state.keys() == ref.keys() and all(torch.equal(state[k], v) for k, v in ref.items())]
    assert len(same) == 1, f"the loaded weights are none of {sorted(refs)} whole (a mix?)"
    return same[0]


class _Killed(BaseException):
    """The simulated SIGKILL: not an Exception, so no ``except Exception`` of the save swallows it."""


@contextlib.contextmanager
def _kill_at(step: int | None):
    """During the block, the ``step``-th (0-based) filesystem rename/unlink/rmdir or file write
    (``save_file`` of each file, by whichever rank writes it) and every later one raise
    :class:`_Killed` without acting; ``None``: count them. Yields ``[calls made]``."""
    made, dead = [0], [False]
    import tpify.io.save as save

    reals = {(os, name): getattr(os, name) for name in ("replace", "rename", "unlink", "rmdir")}
    reals[(save, "save_file")] = save.save_file  # each file's write: a kill there leaves the target as it was

    def wrap(real):
        def call(*args, **kwargs):
            if dead[0] or made[0] == step:
                dead[0] = True
                raise _Killed(f"killed at step {step}")
            made[0] += 1
            return real(*args, **kwargs)
        return call

    for (module, name), real in reals.items():
        setattr(module, name, wrap(real))
    try:
        yield made
    finally:
        for (module, name), real in reals.items():
            setattr(module, name, real)


_OTHERS = {"tokenizer.json": b'{"version": "1.0"}', "NOTES.txt": b"keep me",
           "checkpoint-1/trainer_state.json": b'{"global_step": 1}',
           "checkpoint-1/model.safetensors": b"not a weight file of this checkpoint"}


def _others(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in _OTHERS if (path / name).exists()}


def _old_checkpoint(template: Path, how: str, model) -> None:
    """``template``: the old checkpoint (``how``: 'single'/'sharded' by tpify, 'hf-sharded' by
    transformers' own save_pretrained, no save ids) plus files a save must not touch."""
    if how == "hf-sharded":
        model.save_pretrained(template, max_shard_size="6KB")
    else:
        tpify.save_pretrained(tpify.parallelize(model, tp_size=1), template,
                              max_shard_size="1GB" if how == "single" else "6KB")
    for name, data in _OTHERS.items():
        (template / name).parent.mkdir(exist_ok=True)
        (template / name).write_bytes(data)


def _weight_files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if _OWNED_WEIGHTS.match(p.name)}


def _used_files(path: Path) -> set[str]:
    """The weight files of the checkpoint transformers loads from ``path`` (its precedence)."""
    if (path / "model.safetensors").is_file():
        return {"model.safetensors"}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return {"model.safetensors.index.json", *index["weight_map"].values()}


@pytest.mark.parametrize("old_how,new_size", [("single", "6KB"), ("sharded", "6KB"), ("sharded", "1GB"),
                                              ("hf-sharded", "4KB"), ("single", "1GB")],
                         ids=["single-to-sharded", "sharded-to-sharded", "sharded-to-single",
                              "hf-sharded-to-more-shards", "single-to-single"])
def test_save_killed_at_every_step_leaves_one_whole_checkpoint(tmp_path, old_how, new_size):
    """Saving model B over a directory holding model A, killed before each rename/unlink of the
    save in turn (and not at all): plain ``AutoModelForCausalLM.from_pretrained`` loads exactly A
    or exactly B, never a mix and never an error; ``tpify.from_pretrained`` loads the same one;
    B from the switch on; the tokenizer, notes and ``checkpoint-*`` files are untouched. The
    next, complete save leaves only its own weight files and no temporary directory."""
    old, new = _gpt2(1), _gpt2(2)
    refs = {"old": _state(old), "new": _state(new)}
    template = tmp_path / "template"
    _old_checkpoint(template, old_how, old)
    path = tmp_path / "ckpt"
    saving = tpify.parallelize(new, tp_size=1)
    shutil.copytree(template, path)
    with _kill_at(None) as made:  # how many steps a whole save takes
        tpify.save_pretrained(saving, path, max_shard_size=new_size)
    steps = made[0]
    assert steps >= 4, steps
    kept = {p.name: p.read_bytes() for p in template.iterdir() if p.is_file()}
    seen, states = [], {}
    for step in range(steps + 1):
        shutil.rmtree(path)
        for leftover in tmp_path.glob(".ckpt.tmp-*"):
            shutil.rmtree(leftover)
        shutil.copytree(template, path)
        with _kill_at(step):
            try:
                tpify.save_pretrained(saving, path, max_shard_size=new_size)
                assert step == steps, f"the save made fewer than {steps} steps"
            except _Killed:
                assert step < steps
        assert _others(path) == _OTHERS, f"killed at step {step}: a file the save does not own changed"
        state = tuple(sorted((p.name, p.is_file() and kept.get(p.name) == p.read_bytes()) for p in path.iterdir()))
        if state not in states:  # the same files (old or new) as after an earlier step: the same load
            hf = _which(_state(AutoModelForCausalLM.from_pretrained(path)), refs)
            tp = _which(_state(tpify.from_pretrained(path)), refs)
            assert tp == hf, f"killed at step {step}: transformers loads the {hf} model, tpify the {tp} one"
            states[state] = hf
        seen.append(states[state])
        assert bool(list(tmp_path.glob(".ckpt.tmp-*"))) == (step < steps), "a killed save cleans nothing up"
        again = "6KB" if new_size == "1GB" else "1GB"  # the next save, of the other kind, cleans up after a killed one
        tpify.save_pretrained(saving, path, max_shard_size=again)
        assert _weight_files(path) == _used_files(path), f"killed at step {step}: weight files left behind"
        assert not list(tmp_path.glob(".ckpt.tmp-*")), f"killed at step {step}: the temporary directory left"
    print(f"{old_how} -> {new_size}: {steps} steps, {len(states)} distinct directories, loads {seen}")
    assert seen[0] == "old" and seen[-1] == "new", seen
    assert seen == sorted(seen, reverse=True), f"old until the switch, new after it: {seen}"  # 'old' > 'new'
    assert _others(path) == _OTHERS
    assert _which(_state(AutoModelForCausalLM.from_pretrained(path)), refs) == "new"


def test_repeated_saves_alternate_shard_names(tmp_path):
    """A save never overwrites a file the current checkpoint uses: the second sharded save of the
    same size writes ``model-<id>-0000i-of-0000n`` names, the third the standard ones again,
    each removing the other's files; transformers' own save into the directory removes them too."""
    path = tmp_path / "ckpt"
    model = tpify.parallelize(_gpt2(1), tp_size=1)
    names = []
    for _ in range(3):
        tpify.save_pretrained(model, path, max_shard_size="6KB")
        names.append(sorted(_weight_files(path) - {"model.safetensors.index.json"}))
        assert _weight_files(path) == _used_files(path)
    assert names[0] == names[2] and names[0][0] == "model-00001-of-00004.safetensors", names
    assert not set(names[0]) & set(names[1]) and names[1][0].endswith("-00001-of-00004.safetensors"), names
    tpify.save_pretrained(model, path, max_shard_size="6KB")
    _gpt2(1).save_pretrained(path, max_shard_size="6KB")
    assert _weight_files(path) == _used_files(path), "transformers' save left tpify's shard names"


def test_load_picks_what_transformers_picks(tmp_path):
    """A directory holding ``model.safetensors`` (model A) and an index with its shards (model B)
    loads A, as transformers does; ``transformers_weights`` in config.json names the file to load
    before both; the shards of neither are opened when not named."""
    a, b = _gpt2(1), _gpt2(2)
    refs = {"a": _state(a), "b": _state(b)}
    path = tmp_path / "both"
    tpify.save_pretrained(tpify.parallelize(b, tp_size=1), path, max_shard_size="6KB")
    save_file({k: v.contiguous() for k, v in a.state_dict().items() if k != "lm_head.weight"},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    assert _which(_state(AutoModelForCausalLM.from_pretrained(path)), refs) == "a"
    assert _which(_state(tpify.from_pretrained(path)), refs) == "a"
    os.replace(path / "model.safetensors", path / "a.safetensors")
    (path / "model-00004-of-00004.safetensors").write_bytes(b"corrupt, and in no checkpoint")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "transformers_weights": "a.safetensors"}))
    assert _which(_state(AutoModelForCausalLM.from_pretrained(path)), refs) == "a"
    assert _which(_state(tpify.from_pretrained(path)), refs) == "a"


def test_index_naming_a_tensor_twice_is_refused(tmp_path):
    """An index listing one tensor in two files (json.loads would keep the last), and a tensor
    stored in the headers of two files: each a CheckpointError naming the tensor and both files,
    before any collective; the same entry written twice (unambiguous) loads."""
    path = tmp_path / "ckpt"
    model = _gpt2(1)
    tpify.save_pretrained(tpify.parallelize(model, tp_size=1), path, max_shard_size="6KB")
    index_file = path / "model.safetensors.index.json"
    text = index_file.read_text()
    index = json.loads(text)
    key, first = next(iter(index["weight_map"].items()))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != first)
    entry = f'"{key}": "{first}",'
    assert entry in text
    index_file.write_text(text.replace(entry, f'{entry}\n    "{key}": "{other}",'))
    with pytest.raises(tpify.CheckpointError, match=rf"(?s){key}.*{first}.*{other}.*one entry per tensor"):
        tpify.from_pretrained(path)
    index_file.write_text(text.replace(entry, f"{entry}\n    {entry}"))
    assert _which(_state(tpify.from_pretrained(path)), {"model": _state(model)}) == "model"
    index_file.write_text(text)
    shard = path / other
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(shard)
    tensors[key] = load_file(path / first)[key] + 1.0  # a second, different copy
    save_file(tensors, str(shard), metadata=metadata)
    a, b = sorted((first, other))
    with pytest.raises(tpify.CheckpointError, match=rf"{key} in {a} and in {b}"):
        tpify.from_pretrained(path)


def test_missing_shard_and_mixed_saves_are_named(tmp_path):
    """A file the index names that is missing, and an index naming a shard another save wrote:
    each a CheckpointError naming the file (and the save ids), raised after one second look
    (not ten retries), and never blamed on a concurrent writer."""
    path, other = tmp_path / "ckpt", tmp_path / "other"
    for p, seed in ((path, 1), (other, 2)):
        tpify.save_pretrained(tpify.parallelize(_gpt2(seed), tp_size=1), p, max_shard_size="6KB")
    shard = "model-00002-of-00004.safetensors"
    shutil.copy(other / shard, path / shard)
    start = time.perf_counter()
    with pytest.raises(tpify.CheckpointError, match=rf"mixes files of different saves .*{shard}") as err:
        tpify.from_pretrained(path)
    assert time.perf_counter() - start < 1.0 and "another process" not in str(err.value)
    (path / shard).unlink()
    with pytest.raises(tpify.CheckpointError, match=rf"{shard} is missing: the checkpoint's index names it"):
        tpify.from_pretrained(path)


def test_next_save_removes_only_dead_temporary_directories(tmp_path):
    """A save removes ``.NAME.tmp-<id>`` directories beside its target that no process holds
    (a killed save's: the kernel released its flock), keeps one a live save holds (locked
    here through another descriptor), and never touches other names beside the target."""
    from tpify.io.save import _lock, _unlock

    path = tmp_path / "ckpt"
    dead, live = tmp_path / ".ckpt.tmp-0123abcd", tmp_path / ".ckpt.tmp-4567cdef"
    others = [tmp_path / ".ckpt.tmp-notes", tmp_path / ".other.tmp-89abcdef", tmp_path / "ckpt.tmp-01234567"]
    for d in (dead, live, *others):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    held = _lock(live, wait=True)
    assert held is not None, "this filesystem has no flock"
    model = tpify.parallelize(_gpt2(1), tp_size=1)
    try:
        tpify.save_pretrained(model, path)
        assert not dead.exists() and live.exists() and all(d.exists() for d in others)
    finally:
        _unlock(held)
    tpify.save_pretrained(model, path)
    assert not live.exists() and all(d.exists() for d in others)


def _save_in_a_loop(path: str, seed: int, start: float, saves: int, out) -> None:
    """Body of one of two processes that save into one folder at the same time."""
    import traceback

    torch.set_num_threads(1)
    model = tpify.parallelize(_gpt2(seed), tp_size=1)
    while time.time() < start:
        pass
    errors = []
    for i in range(saves):
        try:
            tpify.save_pretrained(model, path, max_shard_size="6KB" if i % 2 else "1GB")
        except Exception:  # noqa: BLE001 - reported to the test
            errors.append(traceback.format_exc())
    out.put((seed, errors))


@pytest.mark.slow  # about 30 s on the shared 2-core machine; the deterministic tests below are quick
def test_two_saves_into_one_folder_at_once_both_succeed_and_leave_one_whole_checkpoint(tmp_path):
    """Two processes saving into one folder at the same time, 25 saves each, sharded and not: no
    save fails (before, one failed now and then with FileNotFoundError on a ``.NAME.tmp-<id>``
    folder: the other save's cleanup listed it, then it was gone, or removed it between its
    creation and its lock), and the folder holds one of the two models whole."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    path = tmp_path / "ckpt"
    start = time.time() + 8  # both processes ready (imports) before the first save
    procs = [ctx.Process(target=_save_in_a_loop, args=(str(path), seed, start, 25, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {1: [], 2: []}, "\n".join(e for errors in results.values() for e in errors)
    loaded = _state(AutoModelForCausalLM.from_pretrained(path))
    _which(loaded, {"model 1": _state(_gpt2(1)), "model 2": _state(_gpt2(2))})
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]


def test_a_save_into_a_folder_another_save_creates_meanwhile_moves_into_it(tmp_path, monkeypatch):
    """The target did not exist when the save began its move, and another save created it just
    before the rename: the save moves into it as into any existing checkpoint (before: OSError,
    directory not empty)."""
    import tpify.io.save as save

    path = tmp_path / "ckpt"
    first, second = tpify.parallelize(_gpt2(1), tp_size=1), tpify.parallelize(_gpt2(2), tp_size=1)
    real_rename, raced = os.rename, []

    def rename(src, dst, *args, **kwargs):
        if Path(dst) == path and not raced:  # the other save wins the race to create the folder
            raced.append(True)
            monkeypatch.setattr(os, "rename", real_rename)
            tpify.save_pretrained(second, path)
            monkeypatch.setattr(os, "rename", rename)
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    tpify.save_pretrained(first, path, max_shard_size="6KB")
    monkeypatch.setattr(os, "rename", real_rename)
    assert raced
    loaded = _state(AutoModelForCausalLM.from_pretrained(path))
    assert _which(loaded, {"first": _state(_gpt2(1)), "second": _state(_gpt2(2))}) == "first"
    assert _used_files(path) == _weight_files(path)  # the second save's model.safetensors removed


def test_a_save_whose_temporary_folder_is_removed_says_so_and_leaves_the_target_whole(tmp_path, monkeypatch):
    """Another process removes this save's temporary folder while it writes (a save on a
    filesystem without flock, a cleanup): the error names the folder, says another process
    removed it and that the target is untouched; the target still holds the old checkpoint."""
    import tpify.io.save as save

    path = tmp_path / "ckpt"
    tpify.save_pretrained(tpify.parallelize(_gpt2(1), tp_size=1), path)
    real = save.save_file

    def removed_first(tensors, filename, *args, **kwargs):
        shutil.rmtree(Path(filename).parent)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(save, "save_file", removed_first)
    with pytest.raises(FileNotFoundError) as e:
        tpify.save_pretrained(tpify.parallelize(_gpt2(2), tp_size=1), path)
    text = str(e.value)
    assert "temporary folder" in text and ".ckpt.tmp-" in text and "another save into" in text, text
    assert f"{path} is untouched" in text, text
    loaded = _state(AutoModelForCausalLM.from_pretrained(path))
    assert _which(loaded, {"old": _state(_gpt2(1)), "new": _state(_gpt2(2))}) == "old"


def test_a_dead_save_folder_that_vanishes_during_the_cleanup_is_skipped(tmp_path, monkeypatch):
    """A save lists ``.NAME.tmp-<id>`` folders beside its target to remove dead ones; one that its
    own save removes (it ended) between the listing and the lock is skipped (before: the
    FileNotFoundError stopped this save)."""
    import tpify.io.save as save

    path = tmp_path / "ckpt"
    other = tmp_path / ".ckpt.tmp-0123abcd"
    other.mkdir()
    real = save._lock

    def lock(directory, wait):
        if Path(directory) == other:
            shutil.rmtree(other)  # the other save ends just now
        return real(directory, wait)

    monkeypatch.setattr(save, "_lock", lock)
    model = tpify.parallelize(_gpt2(1), tp_size=1)
    tpify.save_pretrained(model, path)
    assert _which(_state(AutoModelForCausalLM.from_pretrained(path)), {"saved": _state(_gpt2(1))}) == "saved"


@pytest.mark.parametrize("size", [-1, 0, "0GB", "-5MB", "2 XB", "lots", 1.5, True, None])
def test_save_refuses_a_shard_size_that_is_not_a_positive_size(tmp_path, size):
    """``max_shard_size=-1`` wrote a file per tensor (31 for this model's kind): a size that is not
    a positive int or a string transformers parses is refused before anything is written."""
    model = tpify.parallelize(_gpt2(1), tp_size=1)
    with pytest.raises(ValueError, match=r"max_shard_size is the largest file in bytes: a positive int, or a string"):
        tpify.save_pretrained(model, tmp_path / "ckpt", max_shard_size=size)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("size,files", [(6000, 4), ("6KB", 4), ("6kB", 4), ("48Kb", 4), ("1GiB", 1), (" 1GB ", 1)])
def test_save_takes_shard_sizes_as_transformers_does(tmp_path, size, files):
    model = tpify.parallelize(_gpt2(1), tp_size=1)
    tpify.save_pretrained(model, tmp_path / "ckpt", max_shard_size=size)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == files
