"""A bench's JSON report, printed and (--out) written, the same text both ways."""

from __future__ import annotations

import json
from pathlib import Path


def print_report(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
