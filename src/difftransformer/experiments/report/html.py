"""The report as one self-contained HTML page: the Markdown rendered, every figure embedded.

A report travels as one file (mailed, attached to an issue, opened from a results folder without the
PNGs beside it): images referenced by the Markdown are inlined as base64 data URIs. Rendering uses
Python-Markdown (tables and fenced code); nothing is fetched when the page is opened. Raw HTML in the
Markdown is not passed through: arm names, prompts and samples come from the user, so `<`, `>` and `&`
in them are escaped and the page holds no markup but the renderer's own (an arm named
`<img onerror=...>` must not run a script when the report is opened).
"""

from __future__ import annotations

import base64
import html as html_lib
import re
from pathlib import Path

from difftransformer._io import atomic_write_text

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; line-height: 1.45; color: #1f2328; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
code { background: #f6f8fa; padding: 0.1em 0.3em; border-radius: 4px; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; white-space: pre-wrap; }
pre code { background: none; padding: 0; }
img { max-width: 100%; }
blockquote { border-left: 4px solid #d0d7de; margin: 0; padding: 0 1em; color: #57606a; }
"""

_IMG = re.compile(r'(<img\b[^>]*\bsrc=")([^"]+)(")')


def render_html(markdown_text: str, base: Path, title: str) -> str:
    """`markdown_text` as a standalone HTML page; images relative to `base` are embedded."""
    import markdown

    md = markdown.Markdown(extensions=["tables", "fenced_code"], output_format="html")
    md.preprocessors.deregister("html_block")  # raw HTML in the Markdown is text, never markup (R10-R12)
    md.inlinePatterns.deregister("html")
    body = md.convert(markdown_text)
    body = _IMG.sub(lambda m: m.group(1) + _data_uri(base, m.group(2)) + m.group(3), body)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html_lib.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n{body}\n"
            f"</body>\n</html>\n")


def write_html(markdown_text: str, path: Path, base: Path, title: str) -> Path:
    atomic_write_text(path, render_html(markdown_text, base, title))
    return path


def _data_uri(base: Path, src: str) -> str:
    """A local PNG/SVG/JPEG as a data URI; anything else (or a missing file) is left as it was."""
    if src.startswith(("data:", "http://", "https://")):
        return src
    path = base / src
    mime = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}.get(
        path.suffix.lower())
    if mime is None or not path.is_file():
        return src
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")
