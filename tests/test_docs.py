"""The docs as a map: every link between pages lands on a page and a heading that exist, every page is in the
README's documentation list, and docs/request-life.md names only files, classes and functions the code has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
SOURCES = sorted((ROOT / "trtspec").rglob("*.py"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NOT_OURS = {"pb_utils", "sender"}  # Triton's module and objects the page names beside trtspec's own


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a `#` in a code block is no heading
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]


def test_slugs_are_githubs():
    assert slug("3. The session: what this request may do at this load") == (
        "3-the-session-what-this-request-may-do-at-this-load"
    )
    assert slug("A verification's rows attend together") == "a-verifications-rows-attend-together"
    assert slug("Its own forward (`model.py`)") == "its-own-forward-modelpy"


def test_every_link_lands_on_a_page_and_a_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "links that go nowhere:\n" + "\n".join(broken)


def test_the_link_check_finds_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## A part\n\n[ok](#a-part) [gone](#no-part) [file](b.md)\n")
    found = [t for t in links(tmp_path / "a.md") if t.startswith("#") and t[1:] not in anchors(tmp_path / "a.md")]
    assert found == ["#no-part"]
    assert not (tmp_path / "b.md").exists()


def test_every_page_is_in_the_readmes_documentation_list():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Documentation\n(.*?)(?=^## )", readme, flags=re.M | re.S)
    assert section, "the README has no Documentation section"
    listed = {t.split("#")[0] for t in LINK.findall(section.group(1))}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")} | {"docs/notes/README.md"}
    missing = sorted(pages - listed)
    assert not missing, f"pages the README's documentation list does not name: {missing}"


def _defined(name: str) -> list[Path]:
    pattern = re.compile(rf"^\s*(?:async )?(?:def|class) {re.escape(name)}\b", flags=re.M)
    return [p for p in SOURCES if pattern.search(p.read_text())]


def test_the_request_life_names_what_the_code_has():
    """Each `Class.method`, `module.function`, `_private`, `CamelCase` and file the page names exists, so a rename
    that leaves the page behind fails here."""
    text = (DOCS / "request-life.md").read_text()
    missing = []
    for token in sorted(set(re.findall(r"`([^`\s]+)`", text))):
        if re.fullmatch(r"[\w/.]+\.(py|c|pbtxt)|[\w/]+/", token):  # a file or a folder
            bare = "/" not in token.rstrip("/")
            found = (
                any((ROOT / "trtspec").rglob(token))
                if bare
                else any((base / token).exists() for base in (ROOT, ROOT / "trtspec"))
            )
            if not found:
                missing.append(token)
        elif m := re.fullmatch(r"([A-Z]\w*)\.(\w+)", token):  # Class.method: both in one file
            owners = _defined(m.group(1))
            if not any(p in owners for p in _defined(m.group(2))):
                missing.append(token)
        elif m := re.fullmatch(r"([a-z_]+)\.(\w+)", token):  # module.function
            if m.group(1) not in NOT_OURS and not any(p.stem == m.group(1) for p in _defined(m.group(2))):
                missing.append(token)
        elif re.fullmatch(r"_[a-z]\w*|_?[A-Z][a-z]\w*", token) and not _defined(token):
            missing.append(token)
    assert not missing, f"docs/request-life.md names what the code does not have: {missing}"
