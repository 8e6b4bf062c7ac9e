"""Run a Python script (or `-c` code) and write this process's own peak resident set at exit.

`python peak_launcher.py SCRIPT|-c CODE ARGS...`: runs it as `python SCRIPT ARGS...` would,
then writes `VmHWM` (KiB) from /proc/self/status to the file $ONNX_CHUNK_PEAK_FILE names.
VmHWM belongs to the process's own address space, which exec started afresh, so it counts
nothing of the parent's; `wait4`'s ru_maxrss instead starts from the parent's resident set at
fork and survives exec. Standard library only: it runs in the peer venv too.
"""

import atexit
import os
import runpy
import sys

PEAK_FILE_ENV = "ONNX_CHUNK_PEAK_FILE"


def _peak_kib() -> int | None:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def _write_peak(path: str) -> None:
    peak = _peak_kib()
    if peak is not None:
        with open(path, "w") as out:
            out.write(str(peak))


def main() -> None:
    path = os.environ.pop(PEAK_FILE_ENV)
    atexit.register(_write_peak, path)
    if sys.argv[1] == "-c":
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    else:
        script = sys.argv[1]
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
