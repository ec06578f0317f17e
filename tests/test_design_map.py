"""docs/design.md's map (folder → job) names exactly the package's folders and root modules, so it stays
true when one is added, moved or removed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bmt_wrap"


def _map_entries() -> set[str]:
    """The paths in the first column of the map's table."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## The map (folder → job)", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {entry for row in rows for entry in re.findall(r"`([^`]+)`", row)}


def _package_entries() -> set[str]:
    """Every root module and every package folder (any depth) of bmt_wrap."""
    modules = {p.name for p in PACKAGE.glob("*.py")}
    folders = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.rglob("__init__.py")
               if p.parent != PACKAGE}
    return modules | folders


def test_the_map_lists_every_folder_and_root_module() -> None:
    listed, present = _map_entries(), _package_entries()
    assert not present - listed, f"add to docs/design.md's map: {sorted(present - listed)}"
    assert not listed - present, f"the map names what no longer exists: {sorted(listed - present)}"
