/* The decoder's per-row fp32 ops on the CPU, one threaded pass each, called through ctypes (engine/models/native.py).

   Paddle 3.3.1's CPU elementwise ops, reductions and broadcasts run on one thread, and RMSNorm and the rotary
   embedding are eight or nine of them per call (forward and backward, twice a layer): about a tenth of the
   0.3B step (docs/benchmarks.md, CPU training step). Each function here is the plain path's arithmetic in one
   OpenMP loop over rows, fp32 throughout. The plain ops in plain_ops.py stay the reference: kernels.py probes
   these against them before using them, and kernel_self_tests compares whole models.

   Built by native.py with the machine's C compiler (-O3 -march=native), linked to the OpenMP runtime Paddle's
   wheel bundles so that these loops share the team oneDNN and Paddle use. No other dependency. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int ernie_cpu_ops_version(void) { return 1; }

/* y = x * rstd * w per row of x [rows, cols], rstd = 1 / sqrt(mean(x^2) + eps), kept per row for backward. */
void ernie_rms_norm_forward(const float *x, const float *w, float *y, float *rstd, int64_t rows, int64_t cols,
                            float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < cols; c++) ss += xr[c] * xr[c];
        float s = 1.0f / sqrtf(ss / (float)cols + eps);
        if (rstd) rstd[r] = s;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) yr[c] = xr[c] * s * w[c];
    }
}

/* The gradients of ernie_rms_norm_forward: with n = x * rstd and g = dy * w,
   dx = rstd * (g - n * mean(g * n)) per row (when dx is given), dw = sum over rows of dy * n (when dw is given;
   each thread sums its rows, then the threads' sums are added in thread order, so a run repeats bit for bit). */
void ernie_rms_norm_backward(const float *x, const float *w, const float *rstd, const float *dy, float *dx,
                             float *dw, int64_t rows, int64_t cols) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    float *partial = dw ? calloc((size_t)threads * (size_t)cols, sizeof(float)) : NULL;
    if (dw && !partial) threads = 1, partial = dw, memset(dw, 0, (size_t)cols * sizeof(float));
#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *mine = partial ? partial + (size_t)t * (size_t)cols : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * cols, *gr = dy + r * cols;
            float s = rstd[r];
            if (dx) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t c = 0; c < cols; c++) dot += gr[c] * w[c] * (xr[c] * s);
                float m = dot / (float)cols;
                float *dxr = dx + r * cols;
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) dxr[c] = s * (gr[c] * w[c] - (xr[c] * s) * m);
            }
            if (mine) {
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) mine[c] += gr[c] * (xr[c] * s);
            }
        }
    }
    if (dw && partial != dw) {
        memcpy(dw, partial, (size_t)cols * sizeof(float));
        for (int t = 1; t < threads; t++) {
            const float *p = partial + (size_t)t * (size_t)cols;
            for (int64_t c = 0; c < cols; c++) dw[c] += p[c];
        }
        free(partial);
    }
}

/* The interleaved rotary rotation of x [rows, heads, dim] (rows = batch * time): each (even, odd) pair i of a
   head turns by the row's angle, out = (e cos - o sin, o cos + e sin) with sin scaled by `sign` (-1 rotates
   back, which is the backward). cos / sin [rows, dim / 2]. out may be x. */
void ernie_rope(const float *x, const float *cos_t, const float *sin_t, float *out, int64_t rows, int64_t heads,
                int64_t dim, float sign) {
    int64_t half = dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *cr = cos_t + r * half, *sr = sin_t + r * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (r * heads + h) * dim;
            float *o = out + (r * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float e = xr[2 * i], d = xr[2 * i + 1], c = cr[i], s = sign * sr[i];
                o[2 * i] = e * c - d * s;
                o[2 * i + 1] = d * c + e * s;
            }
        }
    }
}

/* sum(x^2) of n fp32 values in float64: each block of 4096 squares summed in fp32 (vectorised), the blocks
   added into one float64 per thread, the threads' totals added in thread order (a run repeats bit for bit). */
double ernie_sum_squares(const float *x, int64_t n) {
    enum { BLOCK = 4096, MAX_THREADS = 256 };
    double per_thread[MAX_THREADS] = {0.0};
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
    if (threads > MAX_THREADS) threads = MAX_THREADS;
#endif
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        double mine = 0.0;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = lo; i < hi; i++) s += x[i] * x[i];
            mine += (double)s;
        }
        per_thread[t] = mine;
    }
    double total = 0.0;
    for (int t = 0; t < threads; t++) total += per_thread[t];
    return total;
}

/* x *= a in place. */
void ernie_scale(float *x, int64_t n, float a) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] *= a;
}
