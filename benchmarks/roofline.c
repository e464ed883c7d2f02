/* The machine's roofline, measured (benchmarks/kernels.py compiles and runs this):
 *   read GB/s   - 512-bit loads summed over a buffer larger than any cache, every thread; the
 *                 median pass (one pass's best catches bursts these shared hosts give)
 *   int8 GMAC/s - independent vpdpbusd chains on zmm registers (AVX-512 VNNI), every thread
 * Prints one JSON object. Usage: roofline MEGABYTES SECONDS */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int ascending(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double read_gbs(size_t bytes, double seconds) {
    char *buffer = aligned_alloc(64, bytes);
    memset(buffer, 1, bytes);
    double rates[4096];
    int passes = 0;
    const double started = omp_get_wtime();
    volatile float sink = 0.0f;
    while (omp_get_wtime() - started < seconds) {
        const double t0 = omp_get_wtime();
        float total = 0.0f;
#pragma omp parallel reduction(+ : total)
        {   /* each thread streams 4 quarters of its share at once (as the GEMM streams
             * tiles), each into an accumulator folded once */
            const size_t quarter = bytes / omp_get_num_threads() / 4 / 64 * 64;
            const char *p = buffer + 4 * quarter * omp_get_thread_num();
            __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
            for (size_t i = 0; i < quarter; i += 64) {
                a = _mm512_add_ps(a, _mm512_load_ps(p + i));
                b = _mm512_add_ps(b, _mm512_load_ps(p + quarter + i));
                c = _mm512_add_ps(c, _mm512_load_ps(p + 2 * quarter + i));
                d = _mm512_add_ps(d, _mm512_load_ps(p + 3 * quarter + i));
            }
            total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
        }
        sink += total;
        if (passes < 4096) rates[passes++] = bytes / (omp_get_wtime() - t0) / 1e9;
    }
    free(buffer);
    qsort(rates, passes, sizeof rates[0], ascending);
    return rates[passes / 2];
}

static double int8_gmacs(double seconds) {
    const long iterations = 20000000;
    double best = 0.0, started = omp_get_wtime();
    while (omp_get_wtime() - started < seconds) {
        long done = 0;
        const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : done)
        {
            /* distinct starting values: identical chains would be merged by the compiler */
            __m512i acc[12];
            for (int k = 0; k < 12; k++) acc[k] = _mm512_set1_epi32(k + omp_get_thread_num());
            __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(2);
            for (long i = 0; i < iterations; i++) {
                __asm__ volatile("" : "+v"(w), "+v"(x));
#pragma GCC unroll 12
                for (int k = 0; k < 12; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], w, x);
            }
            __m512i sum = acc[0];
            for (int k = 1; k < 12; k++) sum = _mm512_add_epi32(sum, acc[k]);
            done += iterations * 12 + (_mm512_reduce_add_epi32(sum) == 42);
        }
        const double rate = (double)done * 64 / (omp_get_wtime() - t0) / 1e9;
        if (rate > best) best = rate;
    }
    return best;
}

int main(int argc, char **argv) {
    const size_t megabytes = argc > 1 ? strtoul(argv[1], NULL, 10) : 640;
    const double seconds = argc > 2 ? atof(argv[2]) : 2.0;
    printf("{\"threads\": %d, \"read_gb_per_s\": %.2f, \"int8_gmac_per_s\": %.1f}\n",
           omp_get_max_threads(), read_gbs(megabytes << 20, seconds), int8_gmacs(seconds));
    return 0;
}
