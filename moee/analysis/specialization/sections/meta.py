"""The run's metadata (command, versions, time, corpus), written by the command that runs the
report; the page shows it in the summary, so it has no place of its own."""

from __future__ import annotations

from moee.analysis.specialization.sections.base import Section

SECTION = Section("meta", "Run")
