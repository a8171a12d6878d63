"""The README as a newcomer reads it."""

import re
from pathlib import Path


def test_the_readmes_contents_line_links_every_section():
    """A newcomer finds "Interrupt and resume" and "Reproducible reruns" from the contents line: it links every
    `## ` section, by GitHub's anchors."""
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    contents = readme.split("Contents:", 1)[1].split("\n\n", 1)[0]
    linked = set(re.findall(r"\(#([a-z0-9-]+)\)", contents))
    for title in re.findall(r"^## (.+)$", readme, flags=re.M):
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        assert anchor in linked, title
    assert {"interrupt-and-resume", "reproducible-reruns"} <= linked
