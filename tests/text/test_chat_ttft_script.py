"""scripts/chat_ttft.py runs on the tiny reference decoder and reports both turn-two TTFTs."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chat_ttft.py"


def test_chat_ttft_script_reports_a_ratio():
    result = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--repeats", "1",
                             "--reply-tokens", "4", "--chunk-size", "64"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    kept = re.search(r"cache kept: +fed (\d+) tokens \((\d+) held\)", result.stdout)
    refed = re.search(r"re-prefilled: fed (\d+) tokens", result.stdout)
    assert kept and refed and int(kept.group(2)) > 0
    assert int(kept.group(1)) < int(refed.group(1))
    assert re.search(r"ratio \(re-prefilled / kept\): [\d.]+x", result.stdout)
