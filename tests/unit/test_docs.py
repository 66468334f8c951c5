"""The README and the docs site: the site builds strictly, links no raw file (a link out of docs/ opens the file's
page on the repository host; images are copied in) and sets its public addresses, every page is in its nav and
linked from the README, every relative link of the README and of the pages resolves (anchors as GitHub and mkdocs
both spell them), the tests they name exist, the README stays short, and the README's test command is CI's."""

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
import urllib.parse
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250


def _hooks():
    """scripts/mkdocs_hooks.py: the link parser the site build uses."""
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages():
    return sorted(DOCS.glob("*.md"))


def _nav_pages(nav):
    for item in nav:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for value in item.values():
                yield from _nav_pages(value) if isinstance(value, list) else [value]


def _headings(path: Path) -> list[str]:
    text = re.sub(r"^(```|~~~).*?^\1[ \t]*$", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)]


def _plain(heading: str) -> str:
    heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    return heading.replace("`", "").replace("*", "")


def github_slug(heading: str) -> str:
    """GitHub's anchor: lower case, punctuation but `-` and `_` dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", _plain(heading).lower()).replace(" ", "-")


def toc_slug(heading: str) -> str:
    """Python-Markdown's `toc` anchor (what mkdocs validates): ASCII, punctuation dropped, runs of `-`/space one `-`."""
    text = unicodedata.normalize("NFKD", _plain(heading)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    """Anchors that work both on GitHub and on the site: a heading's two slugs must agree."""
    return {github_slug(h) for h in _headings(path) if github_slug(h) == toc_slug(h)}


def _check_links(page: Path) -> list[str]:
    """Every relative link of `page`: an existing file inside the repository, its anchor a heading of the target."""
    hooks = _hooks()
    errors = []
    for raw in hooks.markdown_links(page.read_text(encoding="utf-8")):
        if not hooks.is_relative(raw) and not raw.startswith("#"):
            if raw.startswith("/") or raw.startswith("file:"):
                errors.append(f"{raw}: absolute local path")
            continue
        target, _, fragment = raw.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.is_relative_to(ROOT):
            errors.append(f"{raw}: outside the repository")
        elif not path.exists():
            errors.append(f"{raw}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            errors.append(
                f"{raw}: no heading of {path.relative_to(ROOT)} has the anchor #{fragment} on GitHub and mkdocs"
            )
    return errors


def test_mkdocs_build_is_strict_and_clean(tmp_path):
    """A broken link or anchor, a page missing from nav, or a link out of the repository fails the build."""
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"), (
        "mkdocs and mkdocs-material come with the dev extra: bash scripts/install.sh dev"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not re.search(r"^WARNING", done.stderr, flags=re.M), done.stderr
    for page in _pages():
        built = tmp_path / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), built
    assert 'href="stylesheets/extra.css"' in (tmp_path / "index.html").read_text(encoding="utf-8")  # wrapped code
    # images the pages embed from outside docs/ are copied into the site, e.g. the benchmark plots
    assert (tmp_path / "_repo" / "benchmarks" / "results" / "2026-12-01-memory-peak.png").is_file()
    config = _mkdocs_config()
    errors = _raw_file_links(tmp_path, config["repo_url"], urllib.parse.urlparse(config["site_url"]).path)
    assert not errors, "\n".join(errors)


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _raw_file_links(site: Path, repo_url: str, base: str = "/") -> list[str]:
    """Every `<a href>` of the built site that opens a raw file: a file of the site that is not a page, or the
    repository host's raw view. A page is a folder with an index.html or an .html file; `base` is the path of
    site_url, which absolute links start with."""
    errors = []
    for html in site.rglob("*.html"):
        for href in re.findall(r"<a\b[^>]*?\bhref=\"([^\"]*)\"", html.read_text(encoding="utf-8")):
            where = f"{html.relative_to(site)}: {href}"
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", href):
                if "raw.githubusercontent.com" in href or "/raw/" in href:
                    errors.append(f"{where} (the host's raw view)")
                elif href.startswith(repo_url + "/") and not re.match(rf"{re.escape(repo_url)}/(blob|tree)/", href):
                    errors.append(f"{where} (neither a file's nor a folder's page)")
                continue
            path = href.split("#", 1)[0].split("?", 1)[0]
            if path.startswith(base):  # absolute under site_url's path (the 404 page's links)
                path = os.path.relpath(site / path[len(base) :], html.parent)
            target = (html.parent / path).resolve()
            page = (target / "index.html").is_file() or (target.suffix == ".html" and target.is_file())
            if href.split("#", 1)[0] and not page:
                errors.append(f"{where} (not a page of the site)")
    return errors


def test_raw_file_link_check_catches_raw_links(tmp_path):
    """The check above fails on each kind of raw link (a copied file, the host's raw view)."""
    (tmp_path / "page").mkdir()
    (tmp_path / "page" / "index.html").write_text('<a href="../">home</a> <a href="#x">anchor</a>')
    (tmp_path / "index.html").write_text(
        '<a href="page/">ok</a> <a href="_repo/tests/test_x.py">raw</a> '
        '<a href="https://github.com/o/r/blob/main/a.py">ok</a> <a href="https://github.com/o/r/raw/main/a.py">raw</a>'
    )
    (tmp_path / "_repo" / "tests").mkdir(parents=True)
    (tmp_path / "_repo" / "tests" / "test_x.py").write_text("")
    errors = _raw_file_links(tmp_path, "https://github.com/o/r")
    assert len(errors) == 2 and "test_x.py" in errors[0] + errors[1], errors


def test_site_and_repository_addresses_are_set():
    config = _mkdocs_config()
    assert re.match(r"^https://[^/]+/.*/$", config["site_url"]), "site_url: the published address, ending in /"
    assert re.match(r"^https://github\.com/[\w.-]+/[\w.-]+$", config["repo_url"]), config.get("repo_url")
    assert re.match(r"^blob/[\w.-]+/docs/$", config["edit_uri"]), "edit_uri: blob/<branch>/docs/ (the hook's links)"


def test_code_blocks_wrap_instead_of_scrolling_out_of_sight():
    """Material scrolls a long code line behind a thin scrollbar: at 1280 px the Home commands looked cut off."""
    sheets = _mkdocs_config().get("extra_css") or []
    rules = "".join((DOCS / sheet).read_text(encoding="utf-8") for sheet in sheets)
    rule = re.search(r"\.md-typeset pre > code \{([^}]*)\}", rules)
    assert rule and re.search(r"white-space:\s*pre-wrap", rule.group(1)), f"no wrapping rule in extra_css {sheets}"


def test_home_clones_the_repository_and_its_tables_have_headers():
    """Home's install starts from `git clone <repo_url>` (the site's repository link), no placeholder; no table of
    any page has a header row with every cell empty."""
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    assert f"git clone {_mkdocs_config()['repo_url']} && cd hf_longctx" in home
    assert not re.search(r"<this repository>|<repo(sitory)?[ _-]?url>", home)
    for page in _pages():
        text = re.sub(r"^(```|~~~).*?^\1[ \t]*$", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        lines = text.splitlines()
        for i, line in enumerate(lines[1:], start=1):
            if re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line.strip()):
                header = [cell.strip() for cell in lines[i - 1].strip().strip("|").split("|")]
                assert any(header), f"{page.name}:{i}: a table header row with every cell empty"


def test_readme_stays_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES}: move detail to docs/"
    )


def test_every_docs_page_is_in_the_nav_and_linked_from_the_readme():
    nav = set(_nav_pages(_mkdocs_config()["nav"]))
    pages = {p.name for p in _pages()}
    assert pages == nav, f"in docs/ but not in nav: {pages - nav}; in nav but not in docs/: {nav - pages}"
    linked = {
        Path(raw.partition("#")[0]).name
        for raw in _hooks().markdown_links(README.read_text(encoding="utf-8"))
        if raw.startswith("docs/")
    }
    assert pages - {"index.md"} <= linked, f"docs pages the README does not link: {pages - {'index.md'} - linked}"


def test_every_relative_link_in_the_readme_resolves():
    errors = _check_links(README)
    assert not errors, "\n".join(errors)
    text = README.read_text(encoding="utf-8")
    assert "shared/" not in text and "/work/" not in text, "the README links or names something outside the repo"


@pytest.mark.parametrize("page", [p.name for p in _pages()])
def test_every_relative_link_in_a_docs_page_resolves(page):
    errors = _check_links(DOCS / page)
    assert not errors, "\n".join(errors)


def test_the_tests_the_docs_name_exist():
    """`test_x.py` and `test_x.py::test_name` in the README and the pages name a test file and function that exist."""
    files = {}
    for path in (ROOT / "tests").rglob("*.py"):
        files.setdefault(path.name, []).append(path)
        files[str(path.relative_to(ROOT))] = [path]
    errors = []
    for doc in [README, *_pages()]:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"\b((?:tests/[\w/]+/)?test_\w+\.py)(?:::(\w+))?", text):
            name, function = m.groups()
            candidates = files.get(name) or files.get(Path(name).name)
            if not candidates:
                errors.append(f"{doc.name}: {name} does not exist")
            elif function and not any(re.search(rf"def {function}\b", p.read_text()) for p in candidates):
                errors.append(f"{doc.name}: {name}::{function} does not exist")
    assert not errors, "\n".join(sorted(set(errors)))


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = shlex.split(re.search(r'^TEST_CMD="([^"]+)"', ci, flags=re.M).group(1))
    assert "bash scripts/install.sh dev" in ci
    section = README.read_text(encoding="utf-8").split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert f"bash scripts/install.sh dev && {shlex.join(test_cmd)}" in lines, lines


def _section(path: Path, heading: str) -> str:
    return path.read_text(encoding="utf-8").split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _logged_steps(text: str) -> list[dict[str, float]]:
    """The Trainer's per-step log dicts in `text` (values printed as strings), as numbers."""
    steps = [ast.literal_eval(m) for m in re.findall(r"\{'loss': [^}]*\}", text)]
    return [{k: float(v) for k, v in step.items() if k != "tokens_per_second"} for step in steps]


@pytest.mark.slow
def test_quickstart_prints_the_documented_output(tmp_path):
    """Home's quickstart command, run as written (output folder moved to tmp), logs the steps its expected output
    shows: loss, grad_norm, token accuracy, token count (tokens/s is the machine's)."""
    section = _section(DOCS / "index.md", "Quickstart")
    command = shlex.split(re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1))
    expected = _logged_steps(re.search(r"```text\n(.*?)```", section, flags=re.S).group(1))
    assert command[:2] == ["accelerate", "launch"] and len(expected) == 3, (command, expected)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *command[2:], "--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = _logged_steps(done.stdout + done.stderr)
    assert len(logged) == len(expected), done.stdout[-2000:]
    for step, (want, got) in enumerate(zip(expected, logged, strict=True), start=1):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=2e-3), f"step {step} {key}: documented {value}, logged {got}"


def test_hardware_status_is_on_the_first_screen_of_the_readme_and_home():
    """What ran on which GPU and what never has: in the README's first 25 lines and Home's first section, naming
    the same commit for the last GPU run."""
    readme = "\n".join(README.read_text(encoding="utf-8").splitlines()[:25])
    home = _section(DOCS / "index.md", "What has run on a GPU")
    commits = []
    for text in (readme, home):
        assert re.search(r"never r[au]n on a GPU", text), text
        commits.append(re.search(r"commit `([0-9a-f]{7,40})`", text).group(1))
    assert commits[0] == commits[1], commits
