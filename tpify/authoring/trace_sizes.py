"""Sizes of a split dimension that a traced forward passes as numbers: where each comes from.

A view, split or slice of a split dimension that passes a dense size (``view(B, T, 4, 8)``)
would be wrong on a rank unless that size is divided per rank. :func:`resolve_literals` looks
for it by value in the ``forward`` source of the module that passed it: an integer attribute
(``self.<name>``, divided with ``divide``) or config value (``config.<name>``, ``divide_config``),
times 1 or ``head_dim``, or a sum of two (phi3's ``query_pos + num_key_value_heads * head_dim``).
A second trace with other head counts (:func:`second_trace`: 6 heads instead of 4) confirms it:
the number must follow that value (a constant such as codegen's ``mp_num = 4``, equal to the
head count in the first trace only by chance, does not).
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from .small import small_config
from .tracer import FlowTrace, trace_flows

__all__ = ["second_trace", "resolve_literals"]


def second_trace(config, cls):
    """The trace of ``cls`` on the family's small config made for tp 3 (6 heads, 3 KV heads,
    hidden 48; else for tp 8: 8 heads), to tell sizes that follow the head count from constants;
    ``(model, trace)``, or None if neither runs."""
    for tp in (3, 8):  # 6 heads / 3 KV heads, else 8 heads (families whose code needs a multiple of 4)
        try:
            small = small_config(config, (tp,))
            small._attn_implementation = "eager"
            torch.manual_seed(0)
            model = cls(small).float().eval()
            return model, trace_flows(model)
        except Exception:  # noqa: BLE001 - the confirmation is then missing, and said so
            continue
    return None


def resolve_literals(trace: FlowTrace, other, modules: dict, small):
    """Where each size passed as a number comes from, confirmed by the second trace.

    ``trace``: the first trace; ``other``: :func:`second_trace`'s ``(model, trace)`` or None;
    ``modules``: FQN -> module of the first trace's model; ``small``: its config.

    Returns ``(found, problems, notes)``: producer -> ``[(module FQN, "attr" | "config", name)]``
    to divide; producer -> reasons it cannot be split; review lines."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    problems: dict[str, list[str]] = {}
    notes: list[str] = []
    other_model, other_trace = other if other is not None else (None, None)
    seen: dict[tuple, int] = {}
    other_values: dict[tuple, list[int]] = {}
    if other_trace is not None:
        for producer, where, op, value in other_trace.literals:
            other_values.setdefault((producer, where, op), []).append(value)
    done = set()
    for producer, where, op, value in trace.literals:
        key = (producer, where, op)
        i = seen.get(key, 0)
        seen[key] = i + 1
        if (key, value) in done:
            continue
        done.add((key, value))
        module = modules.get(where) if where else None
        cname = type(module).__name__ if module is not None else "the model"
        source = _literal_source(module, small, value)
        twin = other_values.get(key, [])
        v2 = twin[i] if i < len(twin) else None
        names = " + ".join(f"{n}{' * head_dim' if f != 1 else ''}" for _, n, f in source) if source else ""
        if other_trace is None:
            if source is None:
                problems.setdefault(producer, []).append(f"{cname} passes the size {value} to {op}, from no "
                                                         f"attribute or config value its forward reads")
            else:
                found.setdefault(producer, []).extend((where, k, n) for k, n, _ in source)
                notes.append(f"{cname}: {names} divided because {op} is passed {value}; not confirmed by a second "
                             f"trace (none could run)")
            continue
        if source is not None:
            m2 = other_model.get_submodule(where) if where else None
            expect = 0
            for kind, name, f in source:
                owner = m2 if kind == "attr" else other_model.config
                v = getattr(owner, name, None)
                f2 = 1 if f == 1 else getattr(m2, "head_dim", None)
                if not isinstance(v, int) or not isinstance(f2, int):
                    expect = None
                    break
                expect += v * f2
            if expect is not None and expect == v2:
                found.setdefault(producer, []).extend((where, k, n) for k, n, _ in source)
                continue
            problems.setdefault(producer, []).append(
                f"{cname} passes the size {value} to {op}; it equals {names} here, but with other head counts it "
                f"is {v2} while that is {expect} (a constant?)")
            continue
        if v2 == value:
            problems.setdefault(producer, []).append(f"{cname} passes the constant size {value} of the split "
                                                     f"dimension to {op} (the same with other head counts)")
        else:
            problems.setdefault(producer, []).append(f"{cname} passes the size {value} of the split dimension to "
                                                     f"{op} ({v2} with other head counts) from no attribute or "
                                                     f"config value its forward reads")
    return found, problems, notes


def _size_sources(module: nn.Module | None, config) -> list[tuple[str, str, int, int]]:
    """Per-rank-divisible sizes ``module``'s forward reads: ``(kind, name, value, factor)`` for each
    integer attribute it reads as ``self.<name>`` (``"attr"``) and config value (``"config"``),
    with factor 1 and, when the module has a ``head_dim``, factor ``head_dim`` (a head count times
    the head size). Names holding a per-head size (``*dim*``) are left out."""
    if module is None:
        return []
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return []
    hd = getattr(module, "head_dim", None)
    factors = [1] + ([hd] if isinstance(hd, int) and hd > 1 else [])
    out = []
    for kind, names, owner in (("attr", re.findall(r"self\.(\w+)", src), module),
                               ("config", re.findall(r"config\.(\w+)", src), config)):
        for name in dict.fromkeys(names):
            if "dim" in name:
                continue
            try:
                v = getattr(owner, name, None)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                out += [(kind, name, v, f) for f in factors]
    return out


def _literal_source(module: nn.Module | None, config, value: int) -> list[tuple[str, str, int]] | None:
    """Where a dense size passed in ``module``'s forward comes from: ``[(kind, name, factor)]`` for
    one size (``self.<name>``, or ``config.<name>``, times 1 or ``head_dim``) equal to it, else
    two whose sum is (phi3's ``query_pos + num_key_value_heads * head_dim``); None if neither."""
    sources = _size_sources(module, config)
    for kind, name, v, f in sources:
        if v * f == value:
            return [(kind, name, f)]
    for i, (k1, n1, v1, f1) in enumerate(sources):
        for k2, n2, v2, f2 in sources[i + 1:]:
            if n1 != n2 and v1 * f1 + v2 * f2 == value:
                return [(k1, n1, f1), (k2, n2, f2)]
    return None
