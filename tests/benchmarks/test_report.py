"""`report.update_section`: a script's rewrite of its BENCHMARKS.md section keeps the notes
written by hand below `NOTES_MARK`, and leaves the other sections alone."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from report import NOTES_MARK, update_section  # noqa: E402


def test_rewrite_keeps_hand_notes_and_other_sections(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(f"# Benchmarks\n\n## A\n\nold table\n\n{NOTES_MARK}\nwhy the table moved\n\n## B\n\nuntouched\n")
    update_section(path, "A", "new table")
    assert path.read_text() == (f"# Benchmarks\n\n## A\n\nnew table\n\n{NOTES_MARK}\nwhy the table moved\n\n"
                                "## B\n\nuntouched\n")
    update_section(path, "B", "rewritten")  # the last section; no notes to keep
    assert path.read_text().endswith("## B\n\nrewritten\n") and "why the table moved" in path.read_text()
    update_section(path, "C", "appended")
    assert path.read_text().endswith("## B\n\nrewritten\n\n## C\n\nappended\n")
