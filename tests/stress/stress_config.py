"""How big a stress run is, and where its figures go (imported by the stress tests).

`make test` runs the short versions (MODELD_STRESS_SCALE unset: 1);
`make stress` runs them at MODELD_STRESS_SCALE=20 and records what it
measured in MODELD_STRESS_RESULTS (bench/results/stress.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SCALE = float(os.environ.get("MODELD_STRESS_SCALE", "1"))
RESULTS = os.environ.get("MODELD_STRESS_RESULTS", "")


def scaled(base: int) -> int:
    return max(1, int(base * SCALE))


def record(section: str, figures: dict) -> None:
    """Merge one test's figures into the results file, when the run keeps one."""
    if not RESULTS:
        return
    path = Path(RESULTS)
    data = json.loads(path.read_text()) if path.exists() else {}
    data["python"] = sys.version.split()[0]
    data[section] = {**figures, "command": os.environ.get("MODELD_STRESS_COMMAND", "make stress"), "scale": SCALE,
                     "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
