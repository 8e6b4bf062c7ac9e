"""The machine's compute roofs: the int8 multiply-add and fp32 FMA rates a tight loop reaches.

A kernel's share of its roof says whether it is the limit (docs/benchmarks.md, "Prefill
candidates on CPU"). The loop is C, compiled here with the system's C compiler at
`-march=native`, so it uses the widest instructions this CPU has, as MLAS and llama.cpp pick
theirs at run time: int8 by AVX-512 VNNI `vpdpbusd` (64 products a 512-bit instruction) where
the CPU has it, else AVX2 `vpmaddubsw` + `vpmaddwd` (32 products); fp32 by 512-bit FMA where
AVX-512F is, else 256-bit FMA. Each thread runs independent accumulators (more than an
instruction's latency times its throughput), so the rate is the issue rate. Two ops count per
product (a multiply and an add), as the kernels' G-ops/s do (2 * M * K * N).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ACCUMULATORS 10
static long iterations;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_ISA "avx512-vnni vpdpbusd"
#define INT8_OPS (64 * 2)
typedef __m512i ivec;
static ivec int8_step(ivec acc, ivec a, ivec b) { return _mm512_dpbusd_epi32(acc, a, b); }
static ivec int8_splat(char value) { return _mm512_set1_epi8(value); }
#else
#define INT8_ISA "avx2 vpmaddubsw+vpmaddwd"
#define INT8_OPS (32 * 2)
typedef __m256i ivec;
static ivec int8_step(ivec acc, ivec a, ivec b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b),
                                                   _mm256_set1_epi16(1)));
}
static ivec int8_splat(char value) { return _mm256_set1_epi8(value); }
#endif

#if defined(__AVX512F__)
#define FP32_ISA "avx512f fma"
#define FP32_OPS (16 * 2)
typedef __m512 fvec;
static fvec fp32_step(fvec acc, fvec a, fvec b) { return _mm512_fmadd_ps(a, b, acc); }
static fvec fp32_splat(float value) { return _mm512_set1_ps(value); }
#else
#define FP32_ISA "avx2 fma"
#define FP32_OPS (8 * 2)
typedef __m256 fvec;
static fvec fp32_step(fvec acc, fvec a, fvec b) { return _mm256_fmadd_ps(a, b, acc); }
static fvec fp32_splat(float value) { return _mm256_set1_ps(value); }
#endif

static volatile int sink;

static void *int8_loop(void *unused) {
    ivec a = int8_splat(1), b = int8_splat(2), acc[ACCUMULATORS];
    for (int j = 0; j < ACCUMULATORS; j++) acc[j] = int8_splat(0);
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < ACCUMULATORS; j++) {
            acc[j] = int8_step(acc[j], a, b);
            __asm__ volatile("" : "+x"(acc[j]));
        }
    int out[sizeof(ivec) / 4];
    __builtin_memcpy(out, &acc[0], sizeof out);
    sink = out[0];
    return unused;
}

static void *fp32_loop(void *unused) {
    fvec a = fp32_splat(1.0001f), b = fp32_splat(0.9999f), acc[ACCUMULATORS];
    for (int j = 0; j < ACCUMULATORS; j++) acc[j] = fp32_splat(0.0f);
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < ACCUMULATORS; j++) {
            acc[j] = fp32_step(acc[j], a, b);
            __asm__ volatile("" : "+x"(acc[j]));
        }
    float out[sizeof(fvec) / 4];
    __builtin_memcpy(out, &acc[0], sizeof out);
    sink = (int)out[0];
    return unused;
}

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

static double rate(void *(*loop)(void *), int threads, int ops) {
    pthread_t ids[256];
    double began = seconds();
    for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, loop, NULL);
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    return (double)threads * iterations * ACCUMULATORS * ops / (seconds() - began) / 1e9;
}

int main(int argc, char **argv) {
    int threads = atoi(argv[1]);
    iterations = atol(argv[2]);
    double best_int8 = 0, best_fp32 = 0;
    for (int repeat = 0; repeat < 3; repeat++) {
        double int8 = rate(int8_loop, threads, INT8_OPS), fp32 = rate(fp32_loop, threads, FP32_OPS);
        if (int8 > best_int8) best_int8 = int8;
        if (fp32 > best_fp32) best_fp32 = fp32;
    }
    printf("{\"int8_isa\": \"%s\", \"int8_gops\": %.1f, \"fp32_isa\": \"%s\", "
           "\"fp32_gflops\": %.1f}\n", INT8_ISA, best_int8, FP32_ISA, best_fp32);
    return 0;
}
"""


class RoofUnavailable(RuntimeError):
    """No C compiler, or it cannot build the loop for this CPU."""


def measure(threads: int, iterations: int = 40_000_000) -> dict:
    """The best of three runs of each loop on `threads` threads: {"int8_isa", "int8_gops",
    "fp32_isa", "fp32_gflops"}. RoofUnavailable without a C compiler that builds it."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RoofUnavailable("no C compiler (cc, gcc or clang) on PATH to build the roof loop")
    with tempfile.TemporaryDirectory(prefix="roof_") as folder:
        source, binary = Path(folder) / "roof.c", Path(folder) / "roof"
        source.write_text(_SOURCE)
        built = subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o",
                                str(binary)], capture_output=True, text=True, check=False)
        if built.returncode != 0:
            raise RoofUnavailable(f"{compiler} cannot build the roof loop for this CPU (needs "
                                  f"AVX2 and FMA): {built.stderr.strip()[-300:]}")
        ran = subprocess.run([str(binary), str(threads), str(iterations)], capture_output=True,
                             text=True, check=True)
    return json.loads(ran.stdout)
