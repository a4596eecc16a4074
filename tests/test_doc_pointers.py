"""Every doc section that a message or docstring of lopd names exists: `docs/X.md, "Section"`,
`docs/X.md#anchor` and the README's "Section" (a user follows these from an error or a verdict)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r'(docs/[a-z_]+\.md|README(?:\.md|\'s)), \\?"([^"\\]+)\\?"|(docs/[a-z_]+\.md)#([a-z0-9-]+)|'
                   r'the README\'s \\?"([^"\\]+)\\?"')


def _headings(path: Path) -> list[str]:
    return [ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def pointers() -> list[tuple[str, str, str]]:
    """(source file, doc file, section or #anchor) for every doc section named in lopd_cli/."""
    found = []
    for src in sorted((ROOT / "lopd_cli").rglob("*.py")):
        for m in NAMED.finditer(src.read_text()):
            if m.group(1):
                doc = "README.md" if m.group(1).startswith("README") else m.group(1)
                found.append((src.name, doc, m.group(2)))
            elif m.group(3):
                found.append((src.name, m.group(3), "#" + m.group(4)))
            else:
                found.append((src.name, "README.md", m.group(5)))
    return found


def test_pointers_are_found():
    named = pointers()
    assert ("check.py", "docs/algorithm.md", "Cold start") in named
    assert any(p[2] == "#mcp-servers" for p in named)


def test_every_named_doc_section_exists():
    missing = []
    for src, doc, section in pointers():
        path = ROOT / doc
        if not path.is_file():
            missing.append(f"{src}: {doc} does not exist")
            continue
        heads = _headings(path)
        ok = (_anchor(section[1:]) in {_anchor(h) for h in heads} or section[1:] in {_anchor(h) for h in heads}) \
            if section.startswith("#") else any(section.strip("`") == h.strip("`") or section == h for h in heads)
        if not ok:
            missing.append(f"{src}: {doc} has no section {section!r}")
    assert not missing, "\n".join(missing)
