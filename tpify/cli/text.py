"""Plain text for the terminal from the reStructuredText of docstrings: what ``tpify --help`` prints.

The command's descriptions are its modules' docstrings (one text for the reader of the code and
the user of the command); :func:`plain` drops the markup a terminal would show literally:
````literal```` -> ``literal``, ``:func:`tpify.x.y``` and ``:mod:`~tpify.x``` -> the name.
"""

from __future__ import annotations

import re

__all__ = ["plain"]

_ROLE = re.compile(r":[a-z]+:`~?([^`<]+?)(?:\s*<[^`]*>)?`")  # :func:`name`, :class:`~a.b.C`, :ref:`text <t>`
_LITERAL = re.compile(r"``(.+?)``", re.S)


def plain(text: str | None) -> str:
    """``text`` without reStructuredText roles, double backticks and escaped spaces (``Row\\ s``)."""
    text = _ROLE.sub(lambda m: m.group(1).strip(), text or "")
    text = _LITERAL.sub(r"\1", text)
    return text.replace("\\ ", "")
