/* The decoder's per-row fp32 ops on the CPU, one threaded pass each, called through ctypes (engine/models/native.py).

   Paddle 3.3.1's CPU elementwise ops, reductions and broadcasts run on one thread, and RMSNorm and the rotary
   embedding are eight or nine of them per call (forward and backward, twice a layer): about a tenth of the
   0.3B step (docs/benchmarks.md, CPU training step). Each function here is the plain path's arithmetic in one
   OpenMP loop over rows, fp32 throughout. The plain ops in plain_ops.py stay the reference: kernels.py probes
   these against them before using them, and kernel_self_tests compares whole models.

   The causal attention here does its products with oneDNN's sgemm, handed in as a function pointer (the
   libdnnl Paddle's wheel bundles; native.py finds it), so this file still links nothing but OpenMP.

   Built by native.py with the machine's C compiler (-O3 -march=native), linked to the OpenMP runtime Paddle's
   wheel bundles so that these loops share the team oneDNN and Paddle use. No other dependency. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int ernie_cpu_ops_version(void) { return 2; }

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

/* ---- causal softmax attention, forward and backward ------------------------------------------------------

   q [B, T, H, D], k / v [B, T, Hkv, D] (grouped query heads: head h reads kv head h / (H / Hkv)), out and the
   gradients in the same layouts, all contiguous fp32. Query i sees keys 0..i (T == S, the square causal case
   of training), less those an additive mask [B or 1, 1, T, T] sets to -inf (packed samples, padding), and
   none before `key_starts[i / starts_block]` when key_starts is given (the first key a query block of packed
   samples can see). Flash-attention's order, one (batch, head, block of QBLOCK queries) after another: the
   block's scores against the keys it can see are one sgemm into a scratch buffer, the softmax runs on its rows
   in place (rows in parallel), and one more sgemm writes the block's output rows. Only the per-row
   log-sum-exp is kept for backward (B x H x T floats, not the T x T probabilities); backward recomputes each
   block's probabilities from it. The products read the heads in place (leading dimension H * D), so nothing
   is transposed or copied.

   The sgemm is oneDNN's (handed in as a function pointer from the libdnnl Paddle's wheel bundles, so this
   file links nothing but OpenMP), and it is called from one thread at a time, each call threaded by oneDNN
   itself: two sgemm calls running at once from the threads of a parallel region here gave wrong products
   (rows of the output off by 0.3 at 1,024 tokens on 2 threads; correct with the calls serialised), so no
   call is made inside a parallel region. One thread at a time also keeps the adds into dk / dv in one order:
   a run repeats bit for bit. */

typedef int (*ernie_sgemm_t)(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                             int64_t, float, float *, int64_t);

enum { QBLOCK = 128 };

/* exp(x) for x <= 0 (softmax after its max is taken off): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor
   polynomial (relative error below 2e-7), 0 below -87.3 (where fp32's exp is subnormal); vectorised by the
   compiler where expf is a library call. */
static inline float ernie_exp_neg(float x) {
    const float lo = -87.3f;
    float xc = x < lo ? lo : x;
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        uint32_t u;
        float f;
    } two_n;
    two_n.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < lo ? 0.0f : p * two_n.f;
}

/* One block of queries r0 .. r1 of (batch b, head h) against keys k0 .. r1, and where its rows sit. */
typedef struct {
    int64_t r0, rows, k0, n, qoff, koff, loff;
    const float *mask;
} ernie_block;

/* Block i of the (batch, head, query block) walk, in that order. */
static ernie_block ernie_block_at(int64_t i, int64_t t, int64_t heads, int64_t kv_heads, int64_t dim,
                                  const float *mask, int64_t mask_bstride, const int64_t *key_starts,
                                  int64_t starts_block) {
    int64_t blocks = (t + QBLOCK - 1) / QBLOCK, qb = i % blocks, h = (i / blocks) % heads, b = i / (blocks * heads);
    ernie_block blk;
    blk.r0 = qb * QBLOCK;
    int64_t r1 = blk.r0 + QBLOCK < t ? blk.r0 + QBLOCK : t;
    blk.rows = r1 - blk.r0;
    blk.k0 = 0;
    if (key_starts) { /* the earliest start of the start blocks this block of queries spans */
        int64_t k0 = blk.r0;
        for (int64_t sb = blk.r0 / starts_block; sb <= (r1 - 1) / starts_block; sb++)
            k0 = key_starts[sb] < k0 ? key_starts[sb] : k0;
        blk.k0 = k0 < 0 ? 0 : k0;
    }
    blk.n = r1 - blk.k0;
    blk.qoff = (b * t + blk.r0) * heads * dim + h * dim;
    blk.koff = (b * t + blk.k0) * kv_heads * dim + (h / (heads / kv_heads)) * dim;
    blk.loff = (b * heads + h) * t + blk.r0;
    blk.mask = mask ? mask + b * mask_bstride + blk.r0 * t + blk.k0 : NULL;
    return blk;
}

/* Row i of a block's scores (n keys from k0) plus its mask row; keys after the query are zeroed. Returns how
   many keys the row sees. */
static inline int64_t ernie_visible(const ernie_block *blk, float *sr, int64_t i, int64_t t) {
    int64_t nv = blk->r0 + i - blk->k0 + 1;
    if (nv > blk->n) nv = blk->n;
    if (blk->mask) {
        const float *mr = blk->mask + i * t;
#pragma omp simd
        for (int64_t j = 0; j < nv; j++) sr[j] += mr[j];
    }
    for (int64_t j = nv; j < blk->n; j++) sr[j] = 0.0f;
    return nv;
}

int ernie_attention_forward(const float *q, const float *k, const float *v, const float *mask, int64_t mask_bstride,
                            const int64_t *key_starts, int64_t starts_block, float *out, float *lse, int64_t batch,
                            int64_t t, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                            ernie_sgemm_t sgemm) {
    int64_t blocks = (t + QBLOCK - 1) / QBLOCK, qs = heads * dim, ks = kv_heads * dim;
    float *s = malloc((size_t)QBLOCK * (size_t)t * sizeof(float));
    if (!s) return 1;
    int failed = 0;
    for (int64_t w = 0; w < batch * heads * blocks && !failed; w++) {
        ernie_block blk = ernie_block_at(w, t, heads, kv_heads, dim, mask, mask_bstride, key_starts, starts_block);
        int64_t n = blk.n;
        failed |= sgemm('N', 'T', blk.rows, n, dim, scale, q + blk.qoff, qs, k + blk.koff, ks, 0.0f, s, n);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < blk.rows; i++) {
            float *sr = s + i * n;
            int64_t nv = ernie_visible(&blk, sr, i, t);
            float mx = -INFINITY;
            for (int64_t j = 0; j < nv; j++) mx = sr[j] > mx ? sr[j] : mx;
            if (mx == -INFINITY) { /* every key masked (our masks never do): no output */
                for (int64_t j = 0; j < nv; j++) sr[j] = 0.0f;
                lse[blk.loff + i] = -INFINITY;
                continue;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < nv; j++) {
                float e = ernie_exp_neg(sr[j] - mx);
                sr[j] = e;
                sum += e;
            }
            float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t j = 0; j < nv; j++) sr[j] *= inv;
            lse[blk.loff + i] = mx + logf(sum);
        }
        failed |= sgemm('N', 'N', blk.rows, dim, n, 1.0f, s, n, v + blk.koff, ks, 0.0f, out + blk.qoff, qs);
    }
    free(s);
    return failed;
}

/* The gradients of ernie_attention_forward from dout and the kept out and lse: per block, P recomputed,
   dP = dout V^T, dS = P (dP - rowsum(dout * out)), dq = scale dS K, and dk += scale dS^T q, dv += P^T dout. */
int ernie_attention_backward(const float *q, const float *k, const float *v, const float *mask,
                             int64_t mask_bstride, const int64_t *key_starts, int64_t starts_block, const float *out,
                             const float *lse, const float *dout, float *dq, float *dk, float *dv, int64_t batch,
                             int64_t t, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                             ernie_sgemm_t sgemm) {
    int64_t blocks = (t + QBLOCK - 1) / QBLOCK, qs = heads * dim, ks = kv_heads * dim;
    float *p = malloc((size_t)QBLOCK * (size_t)t * sizeof(float));
    float *ds = malloc((size_t)QBLOCK * (size_t)t * sizeof(float));
    if (!p || !ds) {
        free(p);
        free(ds);
        return 1;
    }
    memset(dk, 0, (size_t)(batch * t * ks) * sizeof(float));
    memset(dv, 0, (size_t)(batch * t * ks) * sizeof(float));
    int failed = 0;
    for (int64_t w = 0; w < batch * heads * blocks && !failed; w++) {
        ernie_block blk = ernie_block_at(w, t, heads, kv_heads, dim, mask, mask_bstride, key_starts, starts_block);
        int64_t n = blk.n, qoff = blk.qoff, koff = blk.koff;
        failed |= sgemm('N', 'T', blk.rows, n, dim, scale, q + qoff, qs, k + koff, ks, 0.0f, p, n);
        failed |= sgemm('N', 'T', blk.rows, n, dim, 1.0f, dout + qoff, qs, v + koff, ks, 0.0f, ds, n);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < blk.rows; i++) {
            float *pr = p + i * n, *dr = ds + i * n;
            int64_t nv = ernie_visible(&blk, pr, i, t);
            float l = lse[blk.loff + i];
            const float *o = out + qoff + i * qs, *g = dout + qoff + i * qs;
            float d = 0.0f;
#pragma omp simd reduction(+ : d)
            for (int64_t c = 0; c < dim; c++) d += o[c] * g[c];
            if (l == -INFINITY) nv = 0;
#pragma omp simd
            for (int64_t j = 0; j < nv; j++) {
                float pj = ernie_exp_neg(pr[j] - l);
                pr[j] = pj;
                dr[j] = pj * (dr[j] - d);
            }
            for (int64_t j = nv; j < n; j++) pr[j] = dr[j] = 0.0f;
        }
        failed |= sgemm('N', 'N', blk.rows, dim, n, scale, ds, n, k + koff, ks, 0.0f, dq + qoff, qs);
        failed |= sgemm('T', 'N', n, dim, blk.rows, scale, ds, n, q + qoff, qs, 1.0f, dk + koff, ks);
        failed |= sgemm('T', 'N', n, dim, blk.rows, 1.0f, p, n, dout + qoff, qs, 1.0f, dv + koff, ks);
    }
    free(p);
    free(ds);
    return failed;
}
