"""Put the tables the benchmark scripts wrote into RESULTS.md, so its figures are regenerated, never edited.

    python benchmarks/assemble_results.py [--results benchmarks/results] [--doc DOC ...] [--check]

RESULTS.md (and README.md's benchmark section, docs/compile.md) hold each table between ``<!-- table: NAME.md -->`` and ``<!-- end table -->``; this replaces
what is between them with ``results/NAME.md`` (the table and the command that made it, as the script
wrote it). Tables whose file is absent stay as they are and are listed. ``--check`` changes nothing and
exits 1 if a table differs from its file or (in RESULTS.md) a Markdown table sits outside the markers.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+\.md) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def assemble(doc: str, results: Path) -> tuple[str, list[str], list[str]]:
    """``doc`` with every marked table replaced by its file; (new text, tables replaced, files missing)."""
    replaced, missing = [], []

    def fill(m: re.Match[str]) -> str:
        path = results / m["name"]
        if not path.is_file():
            missing.append(m["name"])
            return m.group(0)
        replaced.append(m["name"])
        return f"{m.group(1)}{path.read_text().rstrip()}\n{m.group(4)}"

    return BLOCK.sub(fill, doc), replaced, missing


def tables_outside_markers(doc: str) -> list[str]:
    """Markdown table rows not inside a marked block: figures someone typed in."""
    inside = BLOCK.sub("", doc)
    return [line for line in inside.splitlines() if line.startswith("|")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--doc", type=Path, nargs="+", default=[HERE / "RESULTS.md", HERE.parent / "README.md",
                                                                   HERE.parent / "docs" / "compile.md"])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    failed = False
    for path in args.doc:
        doc = path.read_text()
        new, replaced, missing = assemble(doc, args.results)
        loose = tables_outside_markers(doc) if path.name == "RESULTS.md" else []
        if args.check:
            stale = new != doc
            print(f"{path}: {'stale' if stale else 'up to date'}, {len(replaced)} table(s) compared, missing: {missing}")
            for line in loose:
                print(f"{path}: table row outside the markers: {line[:100]}")
            failed |= stale or bool(loose)
        else:
            path.write_text(new)
            print(f"{path}: {len(replaced)} table(s) from {args.results}; left as they were (no file): {missing}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
