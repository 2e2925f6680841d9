"""The benchmark docs' relative links lead somewhere: every ``[text](path#anchor)`` of docs/benchmarks.md and
docs/bench/*.md names a file that exists and, into a Markdown file, a heading it has (GitHub's anchors)."""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["docs/benchmarks.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/bench/*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: str) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-``; a repeated one gets ``-1``, ``-2``, ..."""
    with open(path) as f:
        text = FENCE.sub("", f.read())
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_heading_anchors_follow_github() -> None:
    assert "the-shared-tier-docsbenchprefix-shared-2026-11-23t1204zjson" in \
        anchors(os.path.join(ROOT, "docs/bench/HISTORY.md"))


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_leads_to_a_file_and_heading(doc: str) -> None:
    with open(os.path.join(ROOT, doc)) as f:
        text = FENCE.sub("", f.read())
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):            # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(target):
            broken.append(f"{link}: no such file")
        elif anchor and target.endswith(".md") and anchor not in anchors(target):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{doc}: {broken}"
