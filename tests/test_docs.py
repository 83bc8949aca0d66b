"""The README and docs/ hold together: every relative link leads to a file
(and a heading, where it names one), and the README stays a front page."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in
                               glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path):
    """GitHub's anchors of a markdown file's headings."""
    with open(path, encoding="utf-8") as f:
        heads = re.findall(r"^#+ +(.+?) *$", f.read(), flags=re.M)
    seen, anchors = {}, set()
    for head in heads:
        slug = re.sub(r"[^\w\- ]", "", head.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(f"{slug}-{n}" if n else slug)   # a repeated heading gets -1, -2, ...
    return anchors


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = (os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path
                    else os.path.join(ROOT, page))
            if not os.path.exists(full):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250
    for command in ("./dev.sh bench", "./dev.sh test"):
        assert any(line.startswith(command) for line in lines), command
