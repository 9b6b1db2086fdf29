"""MkDocs hook for the API reference. The docstrings are prose written with two reStructuredText
habits that markdown renders literally: Sphinx roles citing code (:func:`gradcheck`, shown as the
role's name before the code) and ``::`` closing the paragraph before an indented example (whose
block markdown already renders as code). The rendered page keeps the code and reads as rst would:
no role names, and one colon (none after a space, no paragraph of ``::`` alone)."""
import re

ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")
LITERAL_ALONE = re.compile(r"<p>::</p>\s*(?=<pre>)")
LITERAL_AFTER_SPACE = re.compile(r"\s::</p>(?=\s*<pre>)")
LITERAL_AFTER_TEXT = re.compile(r"::</p>(?=\s*<pre>)")


def on_page_content(html, page, config, files):
    html = ROLE.sub("", html)
    html = LITERAL_ALONE.sub("", html)
    html = LITERAL_AFTER_SPACE.sub("</p>", html)
    return LITERAL_AFTER_TEXT.sub(":</p>", html)
