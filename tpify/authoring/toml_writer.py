"""A recipe mapping as commented TOML text (``tomllib`` reads TOML; nothing in the standard library
writes it): :func:`to_toml`, used by ``tpify draft``."""

from __future__ import annotations

__all__ = ["to_toml"]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _comment(text: str, width: int = 100) -> list[str]:
    lines = []
    for para in text.splitlines() or [""]:
        words, line = para.split(" "), "#"
        for w in words:
            if len(line) + 1 + len(w) > width and line != "#":
                lines.append(line)
                line = "#  "
            line += " " + w
        lines.append(line)
    return lines


def to_toml(data: dict, notes: list[str] | None = None, header: list[str] | None = None,
            review: list[str] | None = None) -> str:
    """A recipe mapping as TOML text: top-level keys, ``[loss]``/``[checkpoint]`` tables, then one
    ``[[rule]]`` per rule, each after its note as a comment; ``header`` and ``review`` lines as
    comments at the top and the end. ``tomllib.loads`` of the result equals ``data``."""
    out: list[str] = []
    for line in header or []:
        out += _comment(line)
    out.append("")
    for key, value in data.items():
        if key in ("rule",) or isinstance(value, dict):
            continue
        out.append(f"{key} = {_toml_value(value)}")
    for key, value in data.items():
        if isinstance(value, dict):
            out += ["", f"[{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    for i, rule in enumerate(data.get("rule", [])):
        out.append("")
        if notes and i < len(notes) and notes[i]:
            out += _comment(notes[i])
        out.append("[[rule]]")
        out += [f"{k} = {_toml_value(v)}" for k, v in rule.items()]
    if review:
        out += ["", "# ---- to review " + "-" * 80]
        for line in review:
            out += _comment("- " + line)
    return "\n".join(out) + "\n"
