"""Where every side-by-side benchmark leaves its results: ``<stem>.json`` (meta and
raw rows) and ``<stem>.md`` (the table quoted in the README)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: Path, stem: str, meta: dict[str, Any], rows: list, text: str) -> Path:
    """Write ``stem``.json and ``stem``.md under ``out``; returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(text)
    return path
