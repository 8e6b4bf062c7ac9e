"""A process without AMX: what MLAS runs on an AVX-512 CPU that has no AMX tiles.

MLAS turns its AMX kernels on only after Linux grants the process the AMX tile state
(`MlasInitAMX`: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, mlas/lib/platform.cpp);
otherwise it keeps the AVX-512 VNNI kernels. `shim()` builds, with the system's C compiler, a
library that refuses that one request (EPERM) and passes every other system call through;
`LD_PRELOAD` set to it, the same CPU measures the kernels of an AVX-512 machine without AMX.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

ARCH_REQ_XCOMP_PERM = 0x1023

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

long syscall(long number, ...) {
    static long (*real)(long, ...) = 0;
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    va_list args;
    va_start(args, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(args, long);
    va_end(args);
    if (number == SYS_arch_prctl && a[0] == REQUEST) { errno = EPERM; return -1; }
    return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
""".replace("REQUEST", str(ARCH_REQ_XCOMP_PERM))


def shim(folder: Path | None = None) -> Path:
    """The shim library, built into `folder` (default a new temporary folder); RuntimeError
    when no C compiler is found or the build fails."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the no-AMX shim")
    folder = Path(tempfile.mkdtemp(prefix="no-amx-")) if folder is None else folder
    source, library = folder / "no_amx.c", folder / "libno_amx.so"
    source.write_text(_SOURCE)
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library),
                           str(source), "-ldl"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the no-AMX shim failed: {done.stderr.strip()}")
    return library
