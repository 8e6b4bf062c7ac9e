"""scripts/cache_thrash.py reproduces the thrashing table (per-shape cache vs ladder): its own
checks pass on the tiny model."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cache_thrash.py"


def test_cache_thrash_script_checks_pass():
    result = subprocess.run([sys.executable, str(SCRIPT), "--new-tokens", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert "ok   exact keys without padding keep building in the second pass" in result.stdout
    assert "ok   padding on builds nothing in the second pass" in result.stdout
