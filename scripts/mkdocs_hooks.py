"""mkdocs hook (mkdocs.yml `hooks:`): links from docs/ pages to files elsewhere in the repository.

The pages link to the repository's own files with relative links (`../benchmarks/results/x.md`,
`../tests/dist/test_dpo.py`), which work on GitHub. mkdocs only knows the files under docs/ and would report
each such link as not found. This hook checks every one of them instead: a target that does not exist, or lies
outside the repository, is a warning (so `mkdocs build --strict` fails); an existing file is copied into the
site under `_repo/` with its path kept, and the link points there. Links inside docs/ are left to mkdocs.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files, InclusionLevel

log = get_plugin_logger("hf_longctx_repo_links")

# [text](target) and ![alt](target), with an optional "title"; targets without spaces (the pages use none).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def markdown_links(text: str) -> list[str]:
    """Every link target of a markdown text, code blocks and code spans left out."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def is_relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


class RepoFile(File):
    """A repository file outside docs/, copied as is (a markdown file too: it is not rendered as a page)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False

    def is_media_file(self) -> bool:
        return True


def on_files(files: Files, config) -> Files:
    docs_dir = os.path.realpath(config["docs_dir"])
    repo = os.path.dirname(os.path.realpath(config["config_file_path"]))
    added: set[str] = set()
    for page in list(files.documentation_pages()):
        with open(page.abs_src_path, encoding="utf-8") as fh:
            text = fh.read()
        for raw in markdown_links(text):
            if not is_relative(raw):
                continue
            target = raw.split("#", 1)[0].split("?", 1)[0]
            if not target:
                continue
            src_uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.src_uri), target))
            if not src_uri.startswith("../"):
                continue  # inside docs/: mkdocs validates it
            path = os.path.realpath(os.path.join(docs_dir, src_uri))
            rel = os.path.relpath(path, repo)
            if rel.startswith(".."):
                log.warning("Doc file '%s' links to '%s', outside the repository.", page.src_uri, raw)
            elif not os.path.isfile(path):
                log.warning("Doc file '%s' links to '%s', which is not a file of the repository.", page.src_uri, raw)
            elif src_uri not in added:
                added.add(src_uri)
                dest = "_repo/" + rel.replace(os.sep, "/")
                repo_file = RepoFile(
                    src_uri,
                    docs_dir,
                    config["site_dir"],
                    config["use_directory_urls"],
                    dest_uri=dest,
                    inclusion=InclusionLevel.INCLUDED,
                )
                files.append(repo_file)
    return files
