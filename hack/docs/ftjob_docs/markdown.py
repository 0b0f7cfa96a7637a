"""Text into Markdown table cells: code spans kept as written, the rest escaped so it renders as the source said."""

from __future__ import annotations

import re

# Outside code spans these would start emphasis, HTML, links or end a table cell.
_SPECIAL = re.compile(r"([\\*_\[\]|<>])")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def text(value: str) -> str:
    """Prose for one table cell: one line, Markdown's specials escaped outside `code spans`."""
    out, pos = [], 0
    flat = " ".join(value.split())
    for m in _CODE_SPAN.finditer(flat):
        out.append(_escape(flat[pos : m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_escape(flat[pos:]))
    return "".join(out)


def code(value: str) -> str:
    """A code span holding ``value`` verbatim on one line (pipes are safe inside code spans of a table)."""
    flat = " ".join(value.split())
    fence = "``" if "`" in flat else "`"
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of already-escaped cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _escape(part: str) -> str:
    return _SPECIAL.sub(
        lambda m: "&lt;" if m.group(1) == "<" else "&gt;" if m.group(1) == ">" else "\\" + m.group(1), part
    )
