"""A local process and its live descendants, read from /proc: a server with --workers is a supervisor, its front-end
workers and its engine processes, and the benches measure them together (/proc/<pid>/task/*/children would need a
kernel option, so the tree is built from every process's parent pid)."""

from __future__ import annotations

import os
from pathlib import Path


def processes() -> dict[int, tuple[int, float]]:
    """Every live process -> (parent pid, user + system CPU seconds so far): each /proc/<n>/stat read once (fields 4,
    14 and 15, counted after the command name, which may hold spaces)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = path.read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(path.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):  # it exited meanwhile
            continue
    return out


def descendants(pid: int, table: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """Every live descendant of `pid`, however deep (`table`: processes()' answer, read now if not given)."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for process, (parent, _) in table.items():
        children.setdefault(parent, []).append(process)
    found, todo = [], list(children.get(pid, []))
    while todo:
        process = todo.pop()
        found.append(process)
        todo += children.get(process, [])
    return found
