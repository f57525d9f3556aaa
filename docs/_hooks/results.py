"""mkdocs hook: the docs link a benchmark result where it lies in the repository (``../benchmarks/results/...`` from
docs/, ``../../benchmarks/results/...`` from docs/serving/), so that the link also works read on the repository.
That place is outside docs_dir, so each such linked file (a plot, a JSON; not a ``.md``, which mkdocs would take for
a page) is added to the site at ``benchmarks/results/...`` and the page's link rewritten to reach it there.  A link to
a file that does not exist is left alone, and the strict build reports it.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"\]\(((?:\.\./)+)benchmarks/results/([^)\s#]+)")


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _ups(page_uri: str) -> int:
    """How many ``../`` lead from the page's folder to the repository root (its depth under docs/, plus one)."""
    return page_uri.count("/") + 1


def on_files(files, config):
    root = _root(config)
    for md in [f for f in files if f.is_documentation_page()]:
        for up, rel in LINK.findall(Path(md.abs_src_path).read_text(encoding="utf-8")):
            uri = f"benchmarks/results/{rel}"
            if (len(up) // 3 == _ups(md.src_uri) and not rel.endswith(".md") and (root / uri).is_file()
                    and files.get_file_from_path(uri) is None):
                files.append(File(uri, str(root), config.site_dir, config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    def local(m: re.Match) -> str:
        uri = f"benchmarks/results/{m[2]}"
        if len(m[1]) // 3 != _ups(page.file.src_uri) or files.get_file_from_path(uri) is None:
            return m[0]
        return "](" + "../" * (_ups(page.file.src_uri) - 1) + uri
    return LINK.sub(local, markdown)
