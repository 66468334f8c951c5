"""mkdocs hook (mkdocs.yml `hooks:`): links from docs/ pages to files elsewhere in the repository.

The pages link to the repository's own files with relative links (`../benchmarks/results/x.md`,
`../tests/dist/test_dpo.py`), which work on GitHub. On the site no such link may open a raw file: each is checked
(a target that does not exist, or lies outside the repository, is a warning, so `mkdocs build --strict` fails) and
then
- an embedded image (`![alt](../benchmarks/results/plot.png)`) is copied into the site under `_repo/` with its path
  kept, so the page shows it;
- every other link points at the file's page on the repository host: `repo_url` + the blob (file) or tree (folder)
  path that `edit_uri` names, e.g. https://github.com/OWNER/REPO/blob/main/tests/dist/test_dpo.py.
Links inside docs/ are left to mkdocs.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files, InclusionLevel

log = get_plugin_logger("hf_longctx_repo_links")

# [text](target) and ![alt](target), with an optional "title"; targets without spaces (the pages use none).
LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def _prose(text: str) -> list[tuple[bool, str]]:
    """`text` cut into (is_prose, piece) in order: fenced blocks and code spans are not prose."""
    pieces: list[tuple[bool, str]] = []
    last = 0
    for block in FENCE.finditer(text):
        pieces += _spans(text[last : block.start()]) + [(False, block.group(0))]
        last = block.end()
    return pieces + _spans(text[last:])


def _spans(chunk: str) -> list[tuple[bool, str]]:
    pieces: list[tuple[bool, str]] = []
    last = 0
    for span in CODE_SPAN.finditer(chunk):
        pieces += [(True, chunk[last : span.start()]), (False, span.group(0))]
        last = span.end()
    return pieces + [(True, chunk[last:])]


def markdown_links(text: str) -> list[str]:
    """Every link target of a markdown text, code blocks and code spans left out."""
    return [m.group(2) for prose, piece in _prose(text) if prose for m in LINK.finditer(piece)]


def is_relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


class RepoFile(File):
    """An image of the repository outside docs/, copied as is."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False

    def is_media_file(self) -> bool:
        return True


def _outside_docs(page_uri: str, raw: str) -> str | None:
    """The docs-relative path (`../x/y`) a relative link of a page points to outside docs/, else None."""
    if not is_relative(raw):
        return None
    target = raw.split("#", 1)[0].split("?", 1)[0]
    src_uri = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target)) if target else ""
    return src_uri if src_uri.startswith("../") else None


def _repo_path(config, src_uri: str, page_uri: str, raw: str) -> str | None:
    """The repository path of `src_uri`; None, with a warning, when it is not a file or folder of the repository."""
    repo = os.path.dirname(os.path.realpath(config["config_file_path"]))
    path = os.path.realpath(os.path.join(config["docs_dir"], src_uri))
    rel = os.path.relpath(path, repo)
    if rel.startswith(".."):
        log.warning("Doc file '%s' links to '%s', outside the repository.", page_uri, raw)
    elif not os.path.exists(path):
        log.warning("Doc file '%s' links to '%s', which is not a file of the repository.", page_uri, raw)
    else:
        return rel.replace(os.sep, "/")
    return None


def on_files(files: Files, config) -> Files:
    """Copy every image a page embeds from outside docs/ into the site under `_repo/`."""
    added: set[str] = set()
    for page in list(files.documentation_pages()):
        with open(page.abs_src_path, encoding="utf-8") as fh:
            text = fh.read()
        for prose, piece in _prose(text):
            for m in LINK.finditer(piece) if prose else ():
                src_uri = _outside_docs(page.src_uri, m.group(2))
                if not m.group(1) or src_uri is None or src_uri in added:
                    continue
                rel = _repo_path(config, src_uri, page.src_uri, m.group(2))
                if rel is not None and os.path.isfile(os.path.join(os.path.dirname(config["config_file_path"]), rel)):
                    added.add(src_uri)
                    image = RepoFile(
                        src_uri,
                        config["docs_dir"],
                        config["site_dir"],
                        config["use_directory_urls"],
                        dest_uri="_repo/" + rel,
                        inclusion=InclusionLevel.INCLUDED,
                    )
                    files.append(image)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Point every non-image link to a file outside docs/ at its page on the repository host."""
    if not config.get("repo_url"):
        log.warning("mkdocs.yml sets no repo_url: links to repository files cannot leave the site.")
        return markdown
    # edit_uri "blob/main/docs/" -> files under ".../blob/main/", folders under ".../tree/main/"
    blob = config["repo_url"].rstrip("/") + "/" + posixpath.dirname(config["edit_uri"].strip("/"))

    def rewrite(m: re.Match) -> str:
        src_uri = _outside_docs(page.file.src_uri, m.group(2))
        if m.group(1) or src_uri is None:
            return m.group(0)
        rel = _repo_path(config, src_uri, page.file.src_uri, m.group(2))
        if rel is None:
            return m.group(0)
        fragment = m.group(2)[len(m.group(2).split("#", 1)[0]) :]
        folder = os.path.isdir(os.path.join(os.path.dirname(config["config_file_path"]), rel))
        url = (blob.replace("/blob/", "/tree/", 1) if folder else blob) + "/" + rel + fragment
        return m.group(0).replace(m.group(2), url, 1)

    return "".join(LINK.sub(rewrite, piece) if prose else piece for prose, piece in _prose(markdown))
