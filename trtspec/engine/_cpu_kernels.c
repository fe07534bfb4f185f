/* The embedded engine's CPU kernels (x86-64, AVX2 + FMA), float32 activations:
 *   linear     y[M, N] = x[M, K] W^T (+ bias), weights float32 or bfloat16, streamed once per call whatever M is;
 *   rms_norm   y = w * (x / rms(x)), after adding a residual into x when one is given;
 *   attention  rotary embedding of the new rows' queries and keys, their keys and values written into the
 *              sequence's KV cache, and causal (optionally sliding-window) attention over it.
 *
 * Why kernels of its own: a decode step is a few hundred small products whose cost is reading their weights,
 * and the library products read them at half the memory bandwidth (oneDNN's prepacked float32 product
 * streamed 13-14 GB/s on a 2-core AVX2 machine whose plain read reaches 27 GB/s); a bfloat16 weight on a CPU
 * without bfloat16 instructions took PyTorch's slow path; and the step's other work, as framework operations
 * on one row at a time, cost a third as much again as its weights. And the engine needs batch invariance: a
 * row's result must not depend on which rows share the call. Here each output is computed by the same code
 * in the same order whatever the number of rows, the row's place among them, the other sequences in the pass
 * or the thread that computes it: a linear's output is one multiply-add chain over k = 0..K-1 in order; an
 * attention row sums over its keys in position order. Batch invariance holds by construction, not by a
 * library's habits.
 *
 * Linear layout: W is packed once (trtspec/engine/kernels.py) as [N/16][K][16]: each block of 16 outputs is
 * one contiguous stream, and the blocks are split between threads in order, so each thread reads one
 * sequential stream. Rows are taken up to 6 at a time (6 x 16 accumulators fill 12 of AVX2's 16 registers);
 * a block is read from memory by its first group of rows and from cache by the others.
 *
 * Built by setup.py as an optional extension; where it is missing or the CPU lacks AVX2/FMA the engine uses
 * PyTorch's operations instead (kernels.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_KERNEL 1
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 16
#define MAX_ROWS 6
#define TARGET __attribute__((target("avx2,fma")))
#define INLINE inline __attribute__((always_inline))

TARGET static INLINE void load16(const void *w, int bf16, ptrdiff_t at, __m256 *lo, __m256 *hi) {
    if (bf16) {
        /* a bfloat16 is the top half of a float32: widen and shift, exactly */
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    } else {
        *lo = _mm256_loadu_ps((const float *)w + at);
        *hi = _mm256_loadu_ps((const float *)w + at + 8);
    }
}

/* `rows` (1..MAX_ROWS) rows of x against one packed block; a constant after inlining, so the accumulators
 * stay in registers */
TARGET static INLINE void rows_block(const float *x, ptrdiff_t ldx, int rows, int K, const void *wb, int bf16,
                                     float *y, ptrdiff_t ldy, const float *scale, const float *bias, const char *ahead) {
    __m256 acc[MAX_ROWS][2];
    ptrdiff_t step = bf16 ? 2 * BLOCK : 4 * BLOCK;   /* bytes of the block per k */
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 w0, w1;
        if (ahead) _mm_prefetch(ahead + k * step, _MM_HINT_T1);
        load16(wb, bf16, (ptrdiff_t)k * BLOCK, &w0, &w1);
        for (int r = 0; r < rows; r++) {
            __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
    __m256 s0 = scale ? _mm256_loadu_ps(scale) : _mm256_set1_ps(1.0f), s1 = scale ? _mm256_loadu_ps(scale + 8) : s0;
    __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps(), b1 = bias ? _mm256_loadu_ps(bias + 8) : b0;
    for (int r = 0; r < rows; r++) {
        __m256 a0 = acc[r][0], a1 = acc[r][1];
        if (scale) { a0 = _mm256_mul_ps(a0, s0); a1 = _mm256_mul_ps(a1, s1); }
        if (bias) { a0 = _mm256_add_ps(a0, b0); a1 = _mm256_add_ps(a1, b1); }
        _mm256_storeu_ps(y + r * ldy, a0);
        _mm256_storeu_ps(y + r * ldy + 8, a1);
    }
}

TARGET static void one_block(const float *x, ptrdiff_t M, int K, const void *wb, int bf16, float *y, ptrdiff_t N,
                             const float *scale, const float *bias) {
    /* With more rows than one group, every group also fetches the next block into L2 (a block ahead in this
     * thread's stream), so that the weights keep streaming from memory while the later groups compute from
     * cache instead of after them. Past the last block the address is merely not fetched: a prefetch never
     * faults. */
    const char *ahead = M > MAX_ROWS ? (const char *)wb + (ptrdiff_t)K * BLOCK * (bf16 ? 2 : 4) : NULL;
    for (ptrdiff_t m = 0; m < M; m += MAX_ROWS) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        switch (M - m >= MAX_ROWS ? MAX_ROWS : (int)(M - m)) {
        case 6: rows_block(xm, K, 6, K, wb, bf16, ym, N, scale, bias, ahead); break;
        case 5: rows_block(xm, K, 5, K, wb, bf16, ym, N, scale, bias, ahead); break;
        case 4: rows_block(xm, K, 4, K, wb, bf16, ym, N, scale, bias, ahead); break;
        case 3: rows_block(xm, K, 3, K, wb, bf16, ym, N, scale, bias, ahead); break;
        case 2: rows_block(xm, K, 2, K, wb, bf16, ym, N, scale, bias, ahead); break;
        default: rows_block(xm, K, 1, K, wb, bf16, ym, N, scale, bias, ahead); break;
        }
    }
}

static void linear(const float *x, ptrdiff_t M, int K, const void *w, int bf16, ptrdiff_t N, const float *bias,
                   float *y, int threads) {
    ptrdiff_t blocks = N / BLOCK, elem = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (ptrdiff_t b = 0; b < blocks; b++)
        one_block(x, M, K, (const char *)w + b * (ptrdiff_t)K * BLOCK * elem, bf16, y + b * BLOCK, N, NULL,
                  bias ? bias + b * BLOCK : NULL);
}

/* sum of a[i] * b[i], i < n (a multiple of 8), in a fixed order: eight lanes, then the lanes pairwise */
TARGET static INLINE float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Each row: x += residual (when given), then y = w * (x * 1 / sqrt(mean(x^2) + eps)), as transformers'
 * LlamaRMSNorm computes it in float32. K a multiple of 8. */
TARGET static void rms_norm(float *x, const float *residual, ptrdiff_t M, int K, const float *w, float eps,
                            float *y) {
    for (ptrdiff_t m = 0; m < M; m++) {
        float *xr = x + m * K, *yr = y + m * K;
        if (residual)
            for (int i = 0; i < K; i += 8)
                _mm256_storeu_ps(xr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(residual + m * K + i)));
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(dot(xr, xr, K) / (float)K + eps));
        for (int i = 0; i < K; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), r)));
    }
}

/* x * cos + rotate_half(x) * sin for one head of d values, rotate_half(x) = [-x[d/2:], x[:d/2]] */
static INLINE void rope(const float *x, const float *cos, const float *sin, int d, float *out) {
    int h = d / 2;
    for (int i = 0; i < h; i++) {
        out[i] = x[i] * cos[i] - x[i + h] * sin[i];
        out[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
    }
}

/* The lanes of v summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the order sum8x8 uses for each of its
 * eight vectors, so a key's score is the same bits whichever way it is computed */
TARGET static INLINE float sum8(__m256 v) {
    __m256 t = _mm256_hadd_ps(v, v);
    t = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* The lane sums of eight vectors at once, each in sum8's order: [sum8(a[0]), ..., sum8(a[7])] */
TARGET static INLINE __m256 sum8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x for x <= 0 (a softmax's shifted scores): 2^n e^r with |r| <= ln2/2, a degree-6 polynomial for e^r
 * (relative error about 2e-7, as good as float32's expf to a couple of units in the last place); 0 below -87 */
TARGET static INLINE __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* One query row of one head over keys lo..pos (inclusive): scores q.k * scale, softmax, the weighted sum of
 * values into out[d]. scores: room for pos + 8 floats. Every key's score, weight and contribution is computed
 * in the same order whatever lo, pos and the other rows are. */
TARGET static void attend_one(const float *q, const float *keys, const float *values, ptrdiff_t lo, ptrdiff_t pos,
                              int d, float scale, float *scores, float *out) {
    ptrdiff_t j = lo, end = pos + 1;
    for (; j + 8 <= end; j += 8) {
        __m256 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (j + t) * d + i), acc[t]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
    }
    for (; j < end; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(keys + j * d + i), acc);
        scores[j] = sum8(acc) * scale;
    }
    float top = -INFINITY;
    for (j = lo; j < end; j++) top = scores[j] > top ? scores[j] : top;
    /* weights e^(s - top), summed in eight lanes over groups of eight keys from lo, then the rest in order */
    __m256 sum = _mm256_setzero_ps(), t8 = _mm256_set1_ps(top);
    for (j = lo; j + 8 <= end; j += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(scores + j), t8));
        _mm256_storeu_ps(scores + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = sum8(sum);
    for (; j < end; j++) {
        float e[8] = {scores[j] - top};
        _mm256_storeu_ps(e, exp_neg(_mm256_loadu_ps(e)));
        scores[j] = e[0];
        total += e[0];
    }
    float inv = 1.0f / total;
    for (int i0 = 0; i0 < d; i0 += 64) {            /* up to 8 vectors of the output in registers at a time */
        int w = d - i0 < 64 ? (d - i0) / 8 : 8;
        __m256 acc[8];
        for (int t = 0; t < w; t++) acc[t] = _mm256_setzero_ps();
        for (j = lo; j < end; j++) {
            __m256 pj = _mm256_set1_ps(scores[j]);
            const float *vj = values + j * d + i0;
            for (int t = 0; t < w; t++) acc[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * t), acc[t]);
        }
        for (int t = 0; t < w; t++) _mm256_storeu_ps(out + i0 + 8 * t, _mm256_mul_ps(acc[t], _mm256_set1_ps(inv)));
    }
}

/* The new rows of one sequence, at positions start..start+n-1, on one layer.
 * q, k, v: row r's heads at q + r*ldq (hq heads of d), k + r*ldk, v + r*ldv (hkv heads each);
 * cos, sin: [n][d], the rotary tables of the rows' positions; cache: [2][hkv][cap][d] (keys, then values),
 * holding positions 0..start-1; window: keys a row may see are those within `window` positions of it
 * (0: all earlier ones). Writes the rotated keys and the values into the cache, then out[r*ldo + h*d ..]. */
TARGET static void attention(const float *q, ptrdiff_t ldq, const float *k, ptrdiff_t ldk, const float *v,
                             ptrdiff_t ldv, ptrdiff_t n, int hq, int hkv, int d, const float *cos, const float *sin,
                             float *cache, ptrdiff_t cap, ptrdiff_t start, ptrdiff_t window, float scale, float *out,
                             ptrdiff_t ldo, int threads) {
    float *keys = cache, *values = cache + (ptrdiff_t)hkv * cap * d;
    for (ptrdiff_t r = 0; r < n; r++)
        for (int h = 0; h < hkv; h++) {
            ptrdiff_t at = ((ptrdiff_t)h * cap + start + r) * d;
            rope(k + r * ldk + h * d, cos + r * d, sin + r * d, d, keys + at);
            memcpy(values + at, v + r * ldv + h * d, sizeof(float) * d);
        }
    int groups = hq / hkv;
    ptrdiff_t tasks = n * hq, longest = start + n;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (longest + 8 + d));
        float *qr = scores + longest + 8;
#pragma omp for schedule(static)
        for (ptrdiff_t t = 0; t < tasks; t++) {
            ptrdiff_t r = t / hq, pos = start + r;
            int h = (int)(t % hq), kh = h / groups;
            ptrdiff_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            rope(q + r * ldq + h * d, cos + r * d, sin + r * d, d, qr);
            attend_one(qr, keys + (ptrdiff_t)kh * cap * d, values + (ptrdiff_t)kh * cap * d, lo, pos, d, scale, scores,
                       out + r * ldo + (ptrdiff_t)h * d);
        }
        free(scores);
    }
}
#endif

static PyObject *py_available(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
#ifdef HAVE_KERNEL
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

/* The arguments as `spec` says: 'i' an integer (an address, a size; 0 for no tensor), 'f' a float. */
static int parse(PyObject *const *args, Py_ssize_t nargs, const char *spec, Py_ssize_t *ints, double *floats) {
    Py_ssize_t want = (Py_ssize_t)strlen(spec);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (spec[i] == 'f') {
            floats[i] = PyFloat_AsDouble(args[i]);
            if (floats[i] == -1.0 && PyErr_Occurred()) return -1;
        } else {
            ints[i] = PyLong_AsSsize_t(args[i]);
            if (ints[i] == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

#ifdef HAVE_KERNEL
#define CALL(stmt) do { Py_BEGIN_ALLOW_THREADS stmt; Py_END_ALLOW_THREADS Py_RETURN_NONE; } while (0)
#else
#define CALL(stmt) do { PyErr_SetString(PyExc_RuntimeError, "this build has no CPU kernels (x86-64 only)"); return NULL; } while (0)
#endif
#define F(i) ((float *)v[i])

/* linear(x, M, K, w, bf16, N, bias, y, threads): x [M, K] and y [M, N] contiguous, w packed [N/16][K][16] */
static PyObject *py_linear(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[9];
    if (parse(args, nargs, "iiiiiiiii", v, NULL)) return NULL;
    if (v[5] % 16 || v[1] < 0 || v[2] <= 0) {
        PyErr_SetString(PyExc_ValueError, "linear: N must be a multiple of 16, M >= 0, K > 0");
        return NULL;
    }
    CALL(linear(F(0), v[1], (int)v[2], (const void *)v[3], (int)v[4], v[5], F(6), F(7), (int)v[8]));
}

/* rms_norm(x, residual, M, K, w, eps, y): rows of K (a multiple of 8), contiguous */
static PyObject *py_rms_norm(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[7];
    double f[7];
    if (parse(args, nargs, "iiiiifi", v, f)) return NULL;
    if (v[3] % 8) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: K must be a multiple of 8");
        return NULL;
    }
    CALL(rms_norm(F(0), F(1), v[2], (int)v[3], F(4), (float)f[5], F(6)));
}

/* attention(q, ldq, k, ldk, v, ldv, n, hq, hkv, d, cos, sin, cache, cap, start, window, scale, out, ldo, threads) */
static PyObject *py_attention(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[20];
    double f[20];
    if (parse(args, nargs, "iiiiiiiiiiiiiiiifiii", v, f)) return NULL;
    if (v[9] % 8 || v[8] <= 0 || v[7] % v[8] || v[14] + v[6] > v[13]) {
        PyErr_SetString(PyExc_ValueError, "attention: d must be a multiple of 8, hq of hkv, and the cache must hold every row");
        return NULL;
    }
    CALL(attention(F(0), v[1], F(2), v[3], F(4), v[5], v[6], (int)v[7], (int)v[8], (int)v[9], F(10), F(11), F(12),
                   v[13], v[14], v[15], (float)f[16], F(17), v[18], (int)v[19]));
}

static PyMethodDef methods[] = {
    {"available", py_available, METH_NOARGS, "Whether this CPU runs the kernels (AVX2 and FMA)."},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, "y = x W^T (+ bias) on packed W."},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "x += residual; y = w * x / rms(x)."},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL, "rope, KV write, causal attention."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
