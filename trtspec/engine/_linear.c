/* The embedded engine's CPU linear: y[M, N] = x[M, K] W^T (* scale) (+ bias), float32 activations, weights
 * float32 or bfloat16, streamed once per call whatever M is.
 *
 * Why a kernel of its own: a decode step is a few hundred small products whose cost is reading their weights,
 * and the library products read them at half the memory bandwidth (oneDNN's prepacked float32 product
 * streamed 13-14 GB/s on a 2-core AVX2 machine whose plain read reaches 27 GB/s); a bfloat16 weight on a CPU
 * without bfloat16 instructions took PyTorch's slow path. And the engine needs batch invariance: a row's
 * result must not depend on how many rows share the call. Here every output is one fused multiply-add chain
 * over k = 0..K-1 in order, then the scale, then the bias, whatever M, the row's place among them or the
 * thread that computes it, so batch invariance holds by construction rather than by a library's habits.
 *
 * Layout: W is packed once (trtspec/engine/kernels.py) as [N/16][K][16]: each block of 16 outputs is one
 * contiguous stream, and the blocks are split between threads in order, so each thread reads one sequential
 * stream. Rows are taken up to 6 at a time (6 x 16 accumulators fill 12 of AVX2's 16 registers); a block is
 * read from memory by its first group of rows and from cache by the others.
 *
 * Built by setup.py as an optional extension; where it is missing or the CPU lacks AVX2/FMA the engine uses
 * oneDNN's products instead (kernels.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
                                     float *y, ptrdiff_t ldy, const float *scale, const float *bias) {
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 w0, w1;
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
    for (ptrdiff_t m = 0; m < M; m += MAX_ROWS) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        switch (M - m >= MAX_ROWS ? MAX_ROWS : (int)(M - m)) {
        case 6: rows_block(xm, K, 6, K, wb, bf16, ym, N, scale, bias); break;
        case 5: rows_block(xm, K, 5, K, wb, bf16, ym, N, scale, bias); break;
        case 4: rows_block(xm, K, 4, K, wb, bf16, ym, N, scale, bias); break;
        case 3: rows_block(xm, K, 3, K, wb, bf16, ym, N, scale, bias); break;
        case 2: rows_block(xm, K, 2, K, wb, bf16, ym, N, scale, bias); break;
        default: rows_block(xm, K, 1, K, wb, bf16, ym, N, scale, bias); break;
        }
    }
}

static void linear(const float *x, ptrdiff_t M, int K, const void *w, int bf16, ptrdiff_t N, const float *scale,
                   const float *bias, float *y, int threads) {
    ptrdiff_t blocks = N / BLOCK, elem = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (ptrdiff_t b = 0; b < blocks; b++)
        one_block(x, M, K, (const char *)w + b * (ptrdiff_t)K * BLOCK * elem, bf16, y + b * BLOCK, N,
                  scale ? scale + b * BLOCK : NULL, bias ? bias + b * BLOCK : NULL);
}
#endif

static PyObject *py_available(PyObject *self, PyObject *args) {
#ifdef HAVE_KERNEL
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

/* linear(x, M, K, w, bf16, N, scale, bias, y, threads): addresses as integers (0 for no scale / bias);
 * x [M, K] and y [M, N] contiguous float32, w packed [N/16][K][16], N a multiple of 16 */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "linear takes 10 arguments");
        return NULL;
    }
    Py_ssize_t v[10];
    for (int i = 0; i < 10; i++) {
        v[i] = PyLong_AsSsize_t(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    if (v[5] % 16 || v[1] < 0 || v[2] <= 0) {
        PyErr_SetString(PyExc_ValueError, "linear: N must be a multiple of 16, M >= 0, K > 0");
        return NULL;
    }
#ifdef HAVE_KERNEL
    Py_BEGIN_ALLOW_THREADS
    linear((const float *)v[0], v[1], (int)v[2], (const void *)v[3], (int)v[4], v[5], (const float *)v[6],
           (const float *)v[7], (float *)v[8], (int)v[9]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "this build has no linear kernel (x86-64 only)");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"available", py_available, METH_NOARGS, "Whether this CPU runs the kernel (AVX2 and FMA)."},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, "y = x W^T (* scale) (+ bias) on packed W."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_linear", NULL, -1, methods};

PyMODINIT_FUNC PyInit__linear(void) { return PyModule_Create(&module); }
