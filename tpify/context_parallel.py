"""Context parallelism: each rank of a CP group holds ``T / cp`` tokens of every sequence.

The pure parts: the layout over the mesh's ``"cp"`` axis (:func:`cp_of`), the load-balanced
split (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, :func:`load_balanced_index`), the
batch (:func:`split_batch`: labels shifted before the split), the gather, the model check. The
hooks and the attention function: :mod:`tpify.hooks.context_parallel`. Llama 3
(arXiv:2407.21783, section 3.3.2); why and how: docs/context-parallelism.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .info import TPUsageError, find_tp_model, get_tp_info

__all__ = ["load_balanced_index", "sequence_order", "split_batch", "gather_sequence", "check_model", "cp_of",
           "refuse", "VERIFIED_MODEL_TYPES", "SPLIT_KEYS", "CP_ATTENTION_MODES"]

#: Model types whose attention, positions and loss tpify has verified exact under context
#: parallelism (tests/distributed/test_context_parallel.py; mixtral, whose experts and router are per
#: token, in test_context_parallel_tools.py): attention through transformers'
#: attention interface with the call's keyword arguments, positions from ``position_ids`` alone
#: (RoPE or learned), causal full or sliding-window masks. Others are refused by name.
VERIFIED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2", "mixtral")

#: How attention runs over the CP group (``parallelize(cp_attention=...)``): ``"allgather"`` (the
#: default: ``[K | V]`` all-gathered, Llama 3's form), ``"ring"`` (``[K | V]`` blocks passed around
#: the ring by P2P, merged by the online softmax, :mod:`tpify.hooks.cp_ring`), ``"alltoall"``
#: (Ulysses: the heads split over the group for the attention, :mod:`tpify.hooks.cp_ulysses`).
CP_ATTENTION_MODES = ("allgather", "ring", "alltoall")

#: The per-token keys :func:`split_batch` splits (``attention_mask``: all ones only, dropped).
SPLIT_KEYS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "position_ids", "attention_mask")


def load_balanced_index(tokens: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank ``cp_rank`` holds, ``(tokens / cp_size,)`` int64.

    The sequence is cut into ``2 * cp_size`` chunks of ``c = tokens / (2 cp_size)``; the rank holds
    chunk ``cp_rank`` then chunk ``2 cp_size - 1 - cp_rank`` (so that causal attention costs every
    rank the same). Pure; no communication.

    Raises:
        ValueError: ``tokens`` not divisible by ``2 * cp_size``; ``cp_rank`` outside the group.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallelism: rank {cp_rank} is not in a group of {cp_size}")
    if tokens % (2 * cp_size):
        raise ValueError(f"context parallelism: a sequence of {tokens} tokens cannot be cut into 2 x cp_size = "
                         f"{2 * cp_size} equal chunks (load balancing gives each rank a front and a back chunk); "
                         f"pad it to a multiple of {2 * cp_size} tokens (split_batch(..., pad_token_id=...) does)")
    c = tokens // (2 * cp_size)
    front = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    back = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([front, back])


def sequence_order(tokens: int, cp_size: int, device=None) -> torch.Tensor:
    """The global positions of a sequence gathered over the CP group in rank order (what an
    all-gather of each rank's :func:`load_balanced_index` tokens gives), ``(tokens,)`` int64. Pure."""
    return torch.cat([load_balanced_index(tokens, cp_size, r, device) for r in range(cp_size)])


def cp_of(model_or_mesh) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(cp_group, cp_size, cp_rank)`` of a tpify model (or a wrapper of one) or of a DeviceMesh
    with a ``"cp"`` axis (``(None, 1, 0)`` without context parallelism). Local.

    Raises:
        ValueError: neither a tpify model nor a DeviceMesh.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(model_or_mesh, DeviceMesh):
        names = model_or_mesh.mesh_dim_names or ()
        if "cp" not in names or model_or_mesh["cp"].size() == 1:
            return None, 1, 0
        sub = model_or_mesh["cp"]
        return sub.get_group(), sub.size(), sub.get_local_rank()
    tp_model = find_tp_model(model_or_mesh) if isinstance(model_or_mesh, nn.Module) else None
    if tp_model is None:
        raise ValueError(f"context parallelism: expected a model tpify parallelized (or a DeviceMesh from "
                         f"tpify.init_mesh), got {type(model_or_mesh).__name__}")
    info = get_tp_info(tp_model)
    return info.cp_group, info.cp_size, info.cp_rank


def _split_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[:, index]`` (the tokens along dim 1), contiguous."""
    return x.index_select(1, index.to(x.device)).contiguous()


def split_batch(batch: Mapping, model_or_mesh=None, *, cp_size: int | None = None, cp_rank: int | None = None,
                ignore_index: int = -100, pad_token_id: int | None = None) -> dict:
    """This rank's part of a batch of whole sequences, for a context-parallel model: what a data
    loader or a training loop calls on every rank (every rank of a CP group given the same batch).

    ``input_ids`` / ``inputs_embeds`` and ``position_ids`` (default ``arange(T)``): chunks ``r`` and
    ``2 cp - 1 - r`` (:func:`load_balanced_index`); ``labels`` shifted over the whole sequence
    first (HF's ``ForCausalLMLoss``), returned as ``shift_labels`` and ``labels``; an all-ones
    ``attention_mask`` dropped; non-tensors and 0-dim tensors kept. With ``pad_token_id``, ``T``
    is padded at the end to a multiple of ``2 * cp`` (targets ``ignore_index``). With
    ``cp_size == 1`` the batch comes back as a dict, labels unshifted. Each key's rule:
    docs/context-parallelism.md, "The batch: load balancing and the label shift".

    Args:
        batch: a mapping of the model's keyword arguments.
        model_or_mesh: the tpify model (or a wrapper of one), or the DeviceMesh (:func:`cp_of`).
        cp_size, cp_rank: instead of ``model_or_mesh`` (a data loader process without the model).
        ignore_index: the label value the loss ignores (HF: -100).
        pad_token_id: pad ``T`` up to a multiple of ``2 * cp`` with this id (default: refuse).

    Shapes: ``(B, T)`` in, ``(B, T / cp)`` out (``T`` padded first with ``pad_token_id``).
    Communication: none. Host syncs: one, to check that an ``attention_mask`` holds only ones.

    Raises:
        ValueError: ``T`` not a multiple of ``2 * cp`` (without ``pad_token_id``); a padding
            ``attention_mask``; tensors of different lengths; a tensor under another key (it is
            not known how to split it); neither ``input_ids`` nor ``inputs_embeds``; both or
            neither of ``model_or_mesh`` and ``cp_size``/``cp_rank``.
    """
    if (model_or_mesh is None) == (cp_size is None or cp_rank is None):
        raise ValueError("split_batch: pass the model (or the DeviceMesh), or cp_size= and cp_rank=, not both")
    if model_or_mesh is not None:
        _, cp_size, cp_rank = cp_of(model_or_mesh)
    out = dict(batch)
    if cp_size == 1:
        return out
    tokens_key = _check_batch(out)
    x = out[tokens_key]
    tokens = x.shape[1]
    positions = out.get("position_ids")
    if positions is None:
        positions = torch.arange(tokens, device=x.device).unsqueeze(0)
    target = out.pop("shift_labels", None)
    labels = out.pop("labels", None)
    if target is None and labels is not None:  # HF's ForCausalLMLoss shift, over the whole sequence
        target = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    pad = -tokens % (2 * cp_size)
    if pad and pad_token_id is not None:
        x, positions, target = _pad_at_end(x, positions, target, pad, pad_token_id, ignore_index)
        tokens += pad
    index = load_balanced_index(tokens, cp_size, cp_rank, device=x.device)  # raises on T % 2cp
    out[tokens_key] = _split_tokens(x, index)
    out["position_ids"] = _split_tokens(positions, index)
    if target is not None:
        out["shift_labels"] = _split_tokens(target, index)
        out["labels"] = out["shift_labels"]
    return out


def _check_batch(out: dict) -> str:
    """The key of the batch's tokens (``input_ids`` or ``inputs_embeds``), after checking that every
    other tensor is one :func:`split_batch` splits, of the same length, and that an
    ``attention_mask`` (popped from ``out``) pads nothing. One host sync (the mask).

    Raises:
        ValueError: as :func:`split_batch` says (unknown keys, no tokens, other lengths, padding).
    """
    unknown = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in SPLIT_KEYS]
    if unknown:
        raise ValueError(f"split_batch: no rule to split {unknown} over the context-parallel group; it splits "
                         f"{list(SPLIT_KEYS)} (and keeps non-tensors and 0-dim tensors): drop the others or split "
                         f"them yourself with tpify.context_parallel.load_balanced_index")
    tokens_key = "input_ids" if out.get("input_ids") is not None else "inputs_embeds"
    if out.get(tokens_key) is None:
        raise ValueError("split_batch: the batch has neither input_ids nor inputs_embeds")
    x = out[tokens_key]
    tokens = x.shape[1]
    for key in SPLIT_KEYS:
        value = out.get(key)
        if isinstance(value, torch.Tensor) and (value.dim() < 2 or value.shape[-1 if key != "inputs_embeds" else 1]
                                                != tokens):
            raise ValueError(f"split_batch: {key} has shape {tuple(value.shape)} but {tokens_key} has {tokens} tokens "
                             f"per sequence; pass whole sequences of one length")
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool(mask.bool().all()):  # a host sync, in the data pipeline
        raise ValueError("split_batch: the attention_mask pads some sequences; under context parallelism the "
                         "attention builds its mask from the positions and takes no padding mask. Pad at the end "
                         "(split_batch(..., pad_token_id=...): the padding is never attended to and its labels are "
                         "ignored) or pack the sequences (position ids that restart at 0)")
    return tokens_key


def _pad_at_end(x, positions, target, pad: int, pad_token_id: int, ignore_index: int):
    """``(x, positions, target)`` padded at the end by ``pad`` tokens: ids ``pad_token_id``,
    positions continuing the last document's, targets ``ignore_index``."""
    x = _pad_tokens(x, pad, pad_token_id)
    step = torch.arange(1, pad + 1, device=positions.device)
    positions = torch.cat([positions, positions[..., -1:] + step], dim=-1)
    target = None if target is None else torch.nn.functional.pad(target, (0, pad), value=ignore_index)
    return x, positions, target


def _pad_tokens(x: torch.Tensor, pad: int, pad_token_id: int) -> torch.Tensor:
    """``x`` ``(B, T)`` ids or ``(B, T, H)`` embeddings with ``pad`` tokens appended (ids:
    ``pad_token_id``; embeddings: zeros)."""
    if x.dim() == 2:
        return torch.nn.functional.pad(x, (0, pad), value=pad_token_id)
    return torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], dim=1)


def gather_sequence(x: torch.Tensor, model_or_mesh) -> torch.Tensor:
    """The whole sequence from every rank's tokens, in order: ``(B, T / cp, ...)`` -> ``(B, T, ...)``
    (logits, hidden states, per-token losses), the inverse of :func:`split_batch`'s split.

    Communication: forward, one all-gather over the CP group (along dim 1); backward, this rank's
    tokens of the gradient (no communication: use it where every rank computes the same thing
    from the gathered tensor). Identity without context parallelism.
    """
    group, cp_size, _ = cp_of(model_or_mesh)
    if cp_size == 1:
        return x
    gathered = comm.gather_from_sequence_region(x, group, partial_grad=False)  # rank order
    order = sequence_order(gathered.shape[1], cp_size, device=x.device)
    return gathered.index_select(1, torch.argsort(order))


def check_model(model: nn.Module, cp_size: int, cp_attention: str = "allgather", tp_size: int = 1) -> None:
    """Whether tpify can run ``model`` context-parallel with attention ``cp_attention``
    (:data:`CP_ATTENTION_MODES`) at ``tp_size``; local, no communication (called by
    :func:`tpify.parallelize` before its agreement, so every rank raises alike).

    Raises:
        ValueError: ``cp_attention`` not one of :data:`CP_ATTENTION_MODES`.
        TPUsageError: a model type not verified under context parallelism (:data:`VERIFIED_MODEL_TYPES`:
            its positions may not be plain token positions, its attention may not go through
            transformers' attention interface), an encoder-decoder, a bidirectional (non-causal)
            model, a config whose ``output_router_logits`` adds a loss term over all tokens;
            ``cp_attention="alltoall"`` where the query heads per TP rank do not divide by ``cp_size``.
    """
    if cp_attention not in CP_ATTENTION_MODES:
        raise ValueError(f"cp_attention must be one of {', '.join(map(repr, CP_ATTENTION_MODES))}, "
                         f"got {cp_attention!r}")
    if cp_size == 1:
        return
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    problems = []
    if model_type not in VERIFIED_MODEL_TYPES:
        problems.append(f"model type {model_type!r} is not verified under context parallelism (verified: "
                        f"{', '.join(VERIFIED_MODEL_TYPES)}): its positions may not be plain token positions "
                        f"(ALiBi, relative buckets, multimodal RoPE) or its attention may not go through "
                        f"transformers' attention interface, and a split sequence would then be silently wrong")
    if getattr(config, "is_encoder_decoder", False):
        problems.append("an encoder-decoder model")
    if not getattr(config, "is_causal", True) or getattr(config, "add_cross_attention", False):
        problems.append("bidirectional or cross attention")
    if getattr(config, "output_router_logits", False):
        problems.append("output_router_logits=True (the router's auxiliary loss is a mean over all tokens)")
    heads = getattr(config, "num_attention_heads", None)
    if cp_attention == "alltoall" and isinstance(heads, int) and heads % tp_size == 0 and (heads // tp_size) % cp_size:
        problems.append(f"cp_attention='alltoall' splits the attention heads over the CP group, but {heads} query "
                        f"heads / tp_size {tp_size} = {heads // tp_size} per TP rank do not divide by cp_size {cp_size} "
                        f"(use cp_attention='ring' or 'allgather', or a cp_size that divides {heads // tp_size})")
    if problems:
        raise TPUsageError(f"context parallelism (cp_size {cp_size}) on {type(model).__name__}: "
                           + "; ".join(problems) + ". Run it with cp_size=1 (tpify.init_mesh(tp_size, cp_size=1))")


def refuse(info, what: str) -> None:
    """Raise for a tool that does not support context parallelism yet, given the model's
    :class:`~tpify.info.TPInfo` (nothing at ``cp_size == 1``). Local.

    Raises:
        TPUsageError: ``info.cp_size > 1``, naming ``what`` and what runs instead.
    """
    if info is not None and info.cp_size > 1:
        raise TPUsageError(f"{what} does not support context parallelism yet (the model was parallelized with "
                           f"cp_size {info.cp_size}); under context parallelism train with your own loop: "
                           f"tpify.context_parallel.split_batch on every batch, the model's loss, backward (the "
                           f"gradients are summed over the CP group by tpify), tpify.training.clip_grad_norm_ and "
                           f"the optimizer; or parallelize with cp_size=1 (docs/context-parallelism.md)")
