"""The blocks of the disclosure report (:class:`Heading`, :class:`Para`, :class:`Bullets`, :class:`Table`,
:class:`Figure`, :class:`Pre` in a :class:`Report`) and their rendering: :func:`to_markdown` and the
self-contained :func:`to_html` (PNG figures embedded as base64). What the report says is built in
:mod:`kvcal.report.disclosure`."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    name: str
    caption: str
    png: bytes


@dataclass
class Pre:
    text: str


@dataclass
class Report:
    """A rendered-independent report: ``title`` and ordered ``blocks``; ``figures`` by name."""

    title: str
    blocks: list = field(default_factory=list)

    @property
    def figures(self) -> dict[str, Figure]:
        return {b.name: b for b in self.blocks if isinstance(b, Figure)}

    def add(self, *blocks) -> None:
        self.blocks.extend(b for b in blocks if b is not None)

    def section(self, heading: str) -> Report:
        """The blocks from the level-2 heading starting with ``heading`` up to the next one, as a
        title-less :class:`Report` (empty when absent) — used by the review notebook."""
        out, inside = Report(""), False
        for b in self.blocks:
            if isinstance(b, Heading) and b.level <= 2:
                inside = b.text.startswith(heading)
            if inside:
                out.blocks.append(b)
        return out


# ---- renderers -------------------------------------------------------------------------------
def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(rep: Report, figure_dir: str | None = "figures") -> str:
    """Markdown text; figures link ``{figure_dir}/{name}.png`` (or are embedded as data URIs when
    ``figure_dir`` is None)."""
    out = [f"# {rep.title}", ""] if rep.title else []
    for b in rep.blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            out += [b.text, ""]
        elif isinstance(b, Bullets):
            out += [f"- {i}" for i in b.items] + [""]
        elif isinstance(b, Table):
            out.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            out.append("|" + "---|" * len(b.header))
            out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
            out.append("")
        elif isinstance(b, Figure):
            src = (f"{figure_dir}/{b.name}.png" if figure_dir
                   else "data:image/png;base64," + base64.b64encode(b.png).decode())
            out += [f"![{b.name}]({src})", "", f"*{b.caption}*", ""]
        elif isinstance(b, Pre):
            out += ["```", b.text, "```", ""]
    return "\n".join(out)


def _inline(s: str) -> str:
    s = html.escape(s, quote=False)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)
    s = re.sub(r"(?<![\w*])\*([^*]+)\*(?![\w*])", r"<em>\1</em>", s)
    return s


_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:.85em}th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}pre{background:#f7f7f7;padding:.6em;overflow-x:auto;
font-size:.75em}figure{margin:1em 0}img{max-width:100%}figcaption{font-size:.85em;color:#555}
code{background:#f3f3f3;padding:0 3px}"""


def to_html(rep: Report) -> str:
    """Self-contained HTML (figures as base64 PNG ``<img>``); the ``<head>`` names kvcal as its generator
    (:data:`kvcal.outputs.REPORT_HTML_MARK`), which is how ``kvcal report`` knows the file as its own."""
    from kvcal import __version__
    from kvcal.outputs import REPORT_HTML_MARK

    out = ["<!DOCTYPE html>", f'<html lang="en"><head><meta charset="utf-8">{REPORT_HTML_MARK} {__version__}">',
           f"<title>{html.escape(rep.title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{html.escape(rep.title)}</h1>"]
    for b in rep.blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            out.append("<table><thead><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in b.header) + "</tr></thead><tbody>")
            for r in b.rows:
                cls = ""
                if "**FAIL**" in r:
                    cls = ' style="background:#fde8e8"'
                out.append(f"<tr{cls}>" + "".join(f"<td>{_inline(str(c))}</td>" for c in r) + "</tr>")
            out.append("</tbody></table>")
        elif isinstance(b, Figure):
            data = base64.b64encode(b.png).decode()
            out.append(f'<figure id="{b.name}"><img alt="{b.name}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{_inline(b.caption)}</figcaption></figure>")
        elif isinstance(b, Pre):
            out.append(f"<pre>{html.escape(b.text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out)
