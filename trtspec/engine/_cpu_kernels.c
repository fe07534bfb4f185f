/* The embedded engine's CPU kernels (x86-64, AVX-512 or AVX2 + FMA + F16C), float32 activations:
 *   linear     y[M, N] = x[M, K] W^T * scale (+ bias), weights float32, bfloat16 or FP8 E4M3 codes, streamed
 *              once per call for up to 12 (AVX-512) or 6 (AVX2) rows; or, for a bfloat16 model on a CPU with
 *              AVX512_BF16 and AVX512_VBMI, the rows rounded to bfloat16 and multiplied in pairs (below; on AMX tiles
 *              where the CPU has AMX-BF16);
 *   rms_norm   y = w * (x / rms(x)), after adding a residual into x when one is given;
 *   attention  rotary embedding of the new rows' queries and keys, their keys and values written into the
 *              sequence's KV cache, and causal (optionally sliding-window) attention over it;
 *   decoder    every decoder layer of a Llama-style model (the above, and silu(gate) * up) in one parallel region.
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
 * library's habits; the AVX-512 and AVX2 paths compute the same chains and give the same bits.
 *
 * Linear layout: W is packed once (trtspec/engine/kernels.py) as [N/16][K][16]: each block of 16 outputs is
 * one contiguous stream, and the blocks are split between threads in order, each thread one range of them.
 * A tile of rows x blocks (the tile shapes below) reads its blocks from memory with its first rows and from
 * cache for the others.
 *
 * Built by setup.py as an optional extension; where it is missing or the CPU lacks AVX2/FMA/F16C the engine uses
 * PyTorch's operations instead (kernels.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Weight formats of a packed linear (kernels.PackedLinear), and the instruction sets a product can use. The
 * pair formats hold bfloat16 values or E4M3 codes laid out for vdpbf16ps, and take their rows in bfloat16. */
enum { W_F32 = 0, W_BF16 = 1, W_E4M3 = 2, W_BF16_PAIRS = 3, W_E4M3_PAIRS = 4 };
enum { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AMX = 2 };  /* ISA_AMX: the pair formats on AMX tiles */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_KERNEL 1
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 16
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define TARGET512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define TARGETBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")))
#define INLINE inline __attribute__((always_inline))

static const int ELEM[5] = {4, 2, 1, 2, 1};

/* FP8 E4M3 codes as IEEE half floats, 16 at a time: each code sign-extended to 16 bits and shifted up by 7
 * puts its exponent and mantissa (bits 0-6) at fp16 bits 7-13 and its sign at bit 15; bit 14, a copy of the
 * sign, is cleared. An E4M3 exponent e (bias 7) read with fp16's bias 15 gives code value * 2^-8,
 * subnormals included; F16C widens that to float32 exactly (ignoring the denormals-are-zero mode), and the
 * product's epilogue multiplies by 2^8, which is exact. The NaN codes (0x7F, 0xFF) read as +-480: the
 * quantizer never writes them (it clamps to 448). */
TARGET static INLINE __m256i e4m3_as_fp16(__m128i codes) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(codes), 7), _mm256_set1_epi16((short)0xBFFF));
}

/* The 16 weights of one block at one k, widened to float32 exactly: two AVX2 vectors or one AVX-512 vector */
TARGET static INLINE void load16(const char *w, int fmt, __m256 *lo, __m256 *hi) {
    if (fmt == W_E4M3) {
        __m256i h = e4m3_as_fp16(_mm_loadu_si128((const __m128i *)w));
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else if (fmt == W_BF16) {
        /* a bfloat16 is the top half of a float32: widen and shift, exactly */
        __m256i raw = _mm256_loadu_si256((const __m256i *)w);
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    } else {
        *lo = _mm256_loadu_ps((const float *)w);
        *hi = _mm256_loadu_ps((const float *)w + 8);
    }
}

TARGET512 static INLINE __m512 load16_512(const char *w, int fmt) {
    if (fmt == W_E4M3) return _mm512_cvtph_ps(e4m3_as_fp16(_mm_loadu_si128((const __m128i *)w)));
    if (fmt == W_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
    return _mm512_loadu_ps((const float *)w);
}

/* The epilogue every path shares, on one output's chain `acc`: E4M3 codes were read as value * 2^-8 (exact
 * to undo), then the scale, then the bias. The same operations in the same order on every path. */
#define EPILOGUE(SUFFIX, acc, s, b, fmt, scale, bias)                                        \
    do {                                                                                     \
        if (fmt == W_E4M3) acc = _mm##SUFFIX##_mul_ps(acc, _mm##SUFFIX##_set1_ps(256.0f));  \
        if (scale) acc = _mm##SUFFIX##_mul_ps(acc, s);                                      \
        if (bias) acc = _mm##SUFFIX##_add_ps(acc, b);                                       \
    } while (0)

/* A tile: R rows of x against G consecutive packed blocks (16 outputs each, `stride` bytes apart), every output
 * one multiply-add chain over k = 0..K-1 in order, whatever R and G are: the tile shape only decides how
 * many independent chains are in flight (a single chain waits on its multiply-add's latency every k) and
 * how often a block is read. R and G are constants after inlining, so the accumulators stay in registers.
 * `ahead`: where to prefetch the blocks the next tile of this thread reads, when rows come in several tiles. */
TARGET static INLINE void tile_avx2(const float *x, ptrdiff_t ldx, int R, int G, int K, const char *w, ptrdiff_t stride,
                                    int fmt, float *y, ptrdiff_t ldy, const float *scale, const float *bias, const char *ahead) {
    __m256 acc[6][3][2];                              /* R * G * 2 <= 12 of AVX2's 16 registers */
    ptrdiff_t step = BLOCK * ELEM[fmt];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 w0[3], w1[3];
        for (int g = 0; g < G; g++) {
            if (ahead) _mm_prefetch(ahead + g * stride + k * step, _MM_HINT_T1);
            load16(w + g * stride + k * step, fmt, &w0[g], &w1[g]);
        }
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            for (int g = 0; g < G; g++) {
                acc[r][g][0] = _mm256_fmadd_ps(w0[g], xv, acc[r][g][0]);
                acc[r][g][1] = _mm256_fmadd_ps(w1[g], xv, acc[r][g][1]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float *sg = scale ? scale + g * BLOCK : NULL, *bg = bias ? bias + g * BLOCK : NULL;
        __m256 s0 = sg ? _mm256_loadu_ps(sg) : _mm256_setzero_ps(), s1 = sg ? _mm256_loadu_ps(sg + 8) : s0;
        __m256 b0 = bg ? _mm256_loadu_ps(bg) : _mm256_setzero_ps(), b1 = bg ? _mm256_loadu_ps(bg + 8) : b0;
        for (int r = 0; r < R; r++) {
            __m256 a0 = acc[r][g][0], a1 = acc[r][g][1];
            EPILOGUE(256, a0, s0, b0, fmt, sg, bg);
            EPILOGUE(256, a1, s1, b1, fmt, sg, bg);
            _mm256_storeu_ps(y + r * ldy + g * BLOCK, a0);
            _mm256_storeu_ps(y + r * ldy + g * BLOCK + 8, a1);
        }
    }
}

/* An AVX-512 tile's R x G accumulators through the epilogue into y */
TARGET512 static INLINE void store_512(const __m512 *acc, int R, int G, int fmt, float *y, ptrdiff_t ldy,
                                       const float *scale, const float *bias) {
    for (int g = 0; g < G; g++) {
        const float *sg = scale ? scale + g * BLOCK : NULL, *bg = bias ? bias + g * BLOCK : NULL;
        __m512 s = sg ? _mm512_loadu_ps(sg) : _mm512_setzero_ps(), b = bg ? _mm512_loadu_ps(bg) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512 a = acc[r * G + g];
            EPILOGUE(512, a, s, b, fmt, sg, bg);
            _mm512_storeu_ps(y + r * ldy + g * BLOCK, a);
        }
    }
}

TARGET512 static INLINE void tile_avx512(const float *x, ptrdiff_t ldx, int R, int G, int K, const char *w, ptrdiff_t stride,
                                         int fmt, float *y, ptrdiff_t ldy, const float *scale, const float *bias, const char *ahead) {
    __m512 acc[24];                                   /* R * G <= 24 of AVX-512's 32 registers */
    ptrdiff_t step = BLOCK * ELEM[fmt];
    for (int i = 0; i < R * G; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 wv[8];
        for (int g = 0; g < G; g++) {
            if (ahead) _mm_prefetch(ahead + g * stride + k * step, _MM_HINT_T1);
            wv[g] = load16_512(w + g * stride + k * step, fmt);
        }
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            for (int g = 0; g < G; g++) acc[r * G + g] = _mm512_fmadd_ps(wv[g], xv, acc[r * G + g]);
        }
    }
    store_512(acc, R, G, fmt, y, ldy, scale, bias);
}

/* The tile shapes, chosen by the number of rows: a single row needs several blocks at once to keep enough
 * multiply-adds in flight (one chain waits 4 cycles a step; on a 2-core AVX-512 machine one row over FP8
 * codes streamed 20 GB/s two blocks at a time and 30 GB/s eight at a time); more rows bring their own
 * chains, and as many rows as the registers hold make one tile, so that a pass of up to 6 (AVX2) or 12
 * (AVX-512) rows reads each weight once. */
#define ROWS_AVX2(M) ((M) == 1 ? 1 : (M) < 6 ? (int)(M) : 6)
#define GROUP_AVX2(M) ((M) == 1 ? 3 : (M) <= 3 ? 2 : 1)
#define ROWS_AVX512(M) ((M) < 12 ? (int)(M) : 12)
#define GROUP_AVX512(M) ((M) <= 3 ? 8 : (M) <= 6 ? 4 : 2)

#define CASE_R(ISA, R, G) case R: tile_##ISA(xm, K, R, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); break
#define TILE_SWITCH_3(ISA, G)                                                                            \
    switch (rows) { CASE_R(ISA, 1, G); CASE_R(ISA, 2, G);                                               \
                    default: tile_##ISA(xm, K, 3, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }
#define TILE_SWITCH_6(ISA, G)                                                                            \
    switch (rows) { CASE_R(ISA, 1, G); CASE_R(ISA, 2, G); CASE_R(ISA, 3, G); CASE_R(ISA, 4, G);         \
                    CASE_R(ISA, 5, G); default: tile_##ISA(xm, K, 6, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }
#define TILE_SWITCH_12(ISA, G)                                                                           \
    switch (rows) { CASE_R(ISA, 1, G); CASE_R(ISA, 2, G); CASE_R(ISA, 3, G); CASE_R(ISA, 4, G);         \
                    CASE_R(ISA, 5, G); CASE_R(ISA, 6, G); CASE_R(ISA, 7, G); CASE_R(ISA, 8, G);         \
                    CASE_R(ISA, 9, G); CASE_R(ISA, 10, G); CASE_R(ISA, 11, G);                          \
                    default: tile_##ISA(xm, K, 12, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }

/* One tile: `rows` rows from xm against g blocks from wb, with that instruction set's widest tile for the pair */
typedef void (*tiles_fn)(const float *xm, int K, int rows, int g, const char *wb, ptrdiff_t stride, int fmt, float *ym,
                         ptrdiff_t N, const float *sb, const float *bb, const char *ahead);

TARGET static void tiles_avx2(const float *xm, int K, int rows, int g, const char *wb, ptrdiff_t stride, int fmt,
                              float *ym, ptrdiff_t N, const float *sb, const float *bb, const char *ahead) {
    switch (g) {                                /* rows * g * 2 <= 12 accumulators */
    case 3: tile_avx2(xm, K, 1, 3, K, wb, stride, fmt, ym, N, sb, bb, ahead); break;   /* M == 1 */
    case 2: TILE_SWITCH_3(avx2, 2) break;
    default: TILE_SWITCH_6(avx2, 1) break;
    }
}

TARGET512 static void tiles_avx512(const float *xm, int K, int rows, int g, const char *wb, ptrdiff_t stride, int fmt,
                                   float *ym, ptrdiff_t N, const float *sb, const float *bb, const char *ahead) {
    switch (g) {                                /* rows * g <= 24 accumulators */
    case 8: TILE_SWITCH_3(avx512, 8) break;
    case 7: TILE_SWITCH_3(avx512, 7) break;
    case 6: TILE_SWITCH_3(avx512, 6) break;
    case 5: TILE_SWITCH_3(avx512, 5) break;
    case 4: TILE_SWITCH_6(avx512, 4) break;
    case 3: TILE_SWITCH_6(avx512, 3) break;
    case 2: TILE_SWITCH_12(avx512, 2) break;
    default: TILE_SWITCH_12(avx512, 1) break;
    }
}

/* The pair formats: a bfloat16 model's products as bfloat16 hardware multiplies them (AVX512_BF16's vdpbf16ps,
 * two bfloat16 products added to a float32 sum per instruction), with the rows rounded to bfloat16 to nearest
 * even, as a bfloat16 network's products take them. A block's weights are packed by pairs of k: [K/2][16][2],
 * so one vector holds the 16 outputs' weights at k = 2j and 2j + 1, and each output is one chain over
 * j = 0..K/2-1 in order, whatever the tile. Twice the multiply-adds per instruction, and bfloat16 weights need
 * no widening, so a pass of many rows stays bound by the weights' bytes longer than the float32 path.
 * FP8 codes become bfloat16 through two byte lookups (vpermi2b: a code's low 7 bits index 128 entries), the
 * sign ORed in; the 64 codes of two pairs come packed so that the lookups' two interleaves give pair j and
 * pair j + 1 (kernels.PackedLinear). The values are exact (E4M3 fits bfloat16), so no epilogue factor. */
static uint8_t E4M3_BF16_LO[128], E4M3_BF16_HI[128];

static void init_e4m3_tables(void) {
    for (int i = 0; i < 128; i++) {
        int e = i >> 3, m = i & 7;
        /* 0x7F is a NaN code; read as 480 like the F16C path (the quantizer never writes it) */
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        E4M3_BF16_LO[i] = (uint8_t)(bits >> 16);
        E4M3_BF16_HI[i] = (uint8_t)(bits >> 24);
    }
}

/* The rows x[M][K] as bfloat16, rounded to nearest even, into xb[M][Kp] (Kp >= K a multiple of 4; zeros after K) */
TARGETBF static void rows_as_bf16(const float *x, ptrdiff_t M, int K, int Kp, uint16_t *xb) {
    for (ptrdiff_t m = 0; m < M; m++)
        for (int i = 0; i < Kp; i += 16) {
            __mmask16 in = K - i >= 16 ? 0xFFFF : K > i ? (__mmask16)((1u << (K - i)) - 1) : 0;
            __mmask16 out = Kp - i >= 16 ? 0xFFFF : (__mmask16)((1u << (Kp - i)) - 1);
            __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, x + m * K + i));
            _mm256_mask_storeu_epi16(xb + m * Kp + i, out, (__m256i)h);
        }
}

/* A tile of the pair formats, as tile_avx512 but over pairs: `x` is the rows as bfloat16 pairs (uint32 each,
 * `ldx` of them a row), K the number of pairs (even) */
TARGETBF static INLINE void tile_pairs(const float *x, ptrdiff_t ldx, int R, int G, int K, const char *w, ptrdiff_t stride,
                                       int fmt, float *y, ptrdiff_t ldy, const float *scale, const float *bias, const char *ahead) {
    const uint32_t *xp = (const uint32_t *)x;
    __m512 acc[24];
    ptrdiff_t step = 2 * 2 * BLOCK * ELEM[fmt];        /* bytes of two pairs of one block */
    __m512i lo0 = _mm512_loadu_si512(E4M3_BF16_LO), lo1 = _mm512_loadu_si512(E4M3_BF16_LO + 64);
    __m512i hi0 = _mm512_loadu_si512(E4M3_BF16_HI), hi1 = _mm512_loadu_si512(E4M3_BF16_HI + 64);
    __m512i sign = _mm512_set1_epi8((char)0x80);
    for (int i = 0; i < R * G; i++) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < K; j += 2) {
        for (int g = 0; g < G; g++) {
            const char *wg = w + g * stride + (j / 2) * step;
            __m512i a, b;
            if (ahead) _mm_prefetch(ahead + g * stride + (j / 2) * step, _MM_HINT_T1);
            if (fmt == W_E4M3_PAIRS) {
                __m512i c = _mm512_loadu_si512(wg);
                __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
                __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);
                a = _mm512_unpacklo_epi8(lo, hi);
                b = _mm512_unpackhi_epi8(lo, hi);
            } else {
                if (ahead) _mm_prefetch(ahead + g * stride + (j / 2) * step + 64, _MM_HINT_T1);
                a = _mm512_loadu_si512(wg);
                b = _mm512_loadu_si512(wg + 64);
            }
            for (int r = 0; r < R; r++) {
                __m512i xa = _mm512_set1_epi32((int)xp[r * ldx + j]), xb = _mm512_set1_epi32((int)xp[r * ldx + j + 1]);
                acc[r * G + g] = _mm512_dpbf16_ps(acc[r * G + g], (__m512bh)a, (__m512bh)xa);
                acc[r * G + g] = _mm512_dpbf16_ps(acc[r * G + g], (__m512bh)b, (__m512bh)xb);
            }
        }
    }
    store_512(acc, R, G, fmt, y, ldy, scale, bias);    /* the pair formats' values are exact: no 2^8 to undo */
}

/* The pair formats' tile shapes: at most 20 accumulators, since the lookups hold five more registers and the
 * two pairs of a block two more (24 spilled: a 6-row pass cost more than a 7-row one) */
#define ROWS_PAIRS(M) ((M) < 5 ? (int)(M) : 5)
#define GROUP_PAIRS(M) ((M) <= 2 ? 8 : (M) <= 4 ? 4 : 3)

#define PAIRS_2(G)                                                                                       \
    switch (rows) { CASE_R(pairs, 1, G); default: tile_pairs(xm, K, 2, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }
#define PAIRS_5(G)                                                                                       \
    switch (rows) { CASE_R(pairs, 1, G); CASE_R(pairs, 2, G); CASE_R(pairs, 3, G); CASE_R(pairs, 4, G);     \
                    default: tile_pairs(xm, K, 5, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }
#define PAIRS_10(G)                                                                                      \
    switch (rows) { CASE_R(pairs, 1, G); CASE_R(pairs, 2, G); CASE_R(pairs, 3, G); CASE_R(pairs, 4, G);     \
                    CASE_R(pairs, 5, G); CASE_R(pairs, 6, G); CASE_R(pairs, 7, G); CASE_R(pairs, 8, G);     \
                    CASE_R(pairs, 9, G); default: tile_pairs(xm, K, 10, G, K, wb, stride, fmt, ym, N, sb, bb, ahead); }

TARGETBF static void tiles_pairs(const float *xm, int K, int rows, int g, const char *wb, ptrdiff_t stride, int fmt,
                                 float *ym, ptrdiff_t N, const float *sb, const float *bb, const char *ahead) {
    switch (g) {                                /* rows * g <= 20 accumulators */
    case 8: PAIRS_2(8) break;
    case 7: PAIRS_2(7) break;
    case 6: PAIRS_2(6) break;
    case 5: PAIRS_2(5) break;
    case 4: PAIRS_5(4) break;
    case 3: PAIRS_5(3) break;
    case 2: PAIRS_10(2) break;
    default: PAIRS_10(1) break;
    }
}

/* AMX's intrinsics need GCC 11 or clang 12; an older compiler builds the other paths without it (isas() then
 * never names amx) rather than failing the whole extension */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define HAVE_AMX 1
/* The pair formats on AMX (Intel's tile unit, AMX-BF16): tdpbf16ps multiplies a tile of up to 16 rows x 16 pairs by
 * a tile of 16 pairs x 16 outputs (2 x 8,192 products) into up to 16 x 16 float32 sums, so a pass of up to 16 rows
 * costs about what one row does and stays bound by the weights' bytes. A block packed by pairs ([K/2][16][2]) is
 * already that second tile's layout, 64 bytes a pair; FP8 codes are first turned into bfloat16 by the lookups above,
 * a chunk of 16 pairs of every block of a group at a time, into a buffer that the tile loads then read (a load
 * right behind the stores that wrote its bytes waits for them). Each output is one chain over the chunks in order, and
 * within a chunk the instruction's fixed order: a row's sums never meet another row's, whatever the tile's number
 * of rows, so rows stay batch-invariant (other bits than vdpbf16ps's: a product runs on one of the two, chosen by
 * the isa argument for the whole model). Tiles: 0-3 the sums of up to 4 blocks, 4 a chunk of the rows, 5 a chunk of
 * a block, 6 and 7 the same two for the last chunk when K/2 is not a multiple of 16. */
#define TARGETAMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")))
#define AMX_GROUP 4
#define AMX_ROWS 16
#define CHUNK 16                                      /* pairs of k per tile */
#define AMX_AHEAD 2                                   /* chunks a block's stream is fetched ahead of its tiles */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

TARGETAMX static void amx_configure(int rows, int tail) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    c.rows[5] = CHUNK, c.colsb[5] = 64;
    if (tail) c.rows[6] = (uint8_t)rows, c.colsb[6] = (uint16_t)(tail * 4), c.rows[7] = (uint8_t)tail, c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* `pairs` pairs of one block's E4M3 codes (packed as tile_pairs reads them) as bfloat16, 64 bytes a pair, into out */
TARGETBF static INLINE void e4m3_pairs_as_bf16(const char *w, int pairs, char *out) {
    __m512i lo0 = _mm512_loadu_si512(E4M3_BF16_LO), lo1 = _mm512_loadu_si512(E4M3_BF16_LO + 64);
    __m512i hi0 = _mm512_loadu_si512(E4M3_BF16_HI), hi1 = _mm512_loadu_si512(E4M3_BF16_HI + 64);
    __m512i sign = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < pairs; j += 2) {
        __m512i c = _mm512_loadu_si512(w + j * 32);
        __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);
        _mm512_storeu_si512(out + j * 64, _mm512_unpacklo_epi8(lo, hi));
        _mm512_storeu_si512(out + j * 64 + 64, _mm512_unpackhi_epi8(lo, hi));
    }
}

/* Fetch into L1 the chunk AMX_AHEAD past chunk c (of `nchunks`) of each of the G blocks at wb: a single row's tiles
 * finish a chunk long before the hardware's prefetcher has the next one in (one row over a decoder layer's codes
 * streamed at half the rate of a large product), and the tiles never stall on a prefetch. Past a block's end, the
 * same block of the next group (wb + G blocks), while it is one of this thread's blocks (`left` blocks from wb). */
static INLINE void amx_fetch_ahead(const char *wb, int G, ptrdiff_t stride, int c, int nchunks, ptrdiff_t cbytes,
                                   ptrdiff_t left) {
    int t = c + AMX_AHEAD;
    for (int g = 0; g < G; g++) {
        const char *p = t < nchunks ? wb + g * stride + t * cbytes
                        : G + g < left ? wb + (G + g) * stride + (t - nchunks) * cbytes : NULL;
        if (p)
            for (ptrdiff_t l = 0; l < cbytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    }
}

#define AMX_ACC(g, A, B)                                                                                   \
    switch (g) {                                                                                           \
    case 0: _tile_dpbf16ps(0, A, B); break;                                                                \
    case 1: _tile_dpbf16ps(1, A, B); break;                                                                \
    case 2: _tile_dpbf16ps(2, A, B); break;                                                                \
    default: _tile_dpbf16ps(3, A, B);                                                                      \
    }
#define AMX_STORE(t, g)                                                                                    \
    if (G > g) _tile_stored(t, ym + (g) * BLOCK, ldy)
/* Chunk c (`pairs` pairs of k) of the rows into tile A and of each of the G blocks into tile B, each block's products
 * into its sums. Codes are decoded for every block before the first tile load: a load right behind the stores that
 * wrote its bytes waits for them */
#define AMX_CHUNK(A, B, c, pairs)                                                                          \
    do {                                                                                                   \
        if (m == 0) amx_fetch_ahead(wb, G, stride, c, chunks + (tail > 0), cbytes, b1 - b);                \
        if (fmt == W_E4M3_PAIRS)                                                                           \
            for (int g = 0; g < G; g++)                                                                    \
                e4m3_pairs_as_bf16(wb + g * stride + (ptrdiff_t)(c) * CHUNK * 32, pairs, buf + g * CHUNK * 64); \
        _tile_loadd(A, xm + (c) * 2 * CHUNK, lda);                                                         \
        for (int g = 0; g < G; g++) {                                                                      \
            if (fmt == W_E4M3_PAIRS) _tile_loadd(B, buf + g * CHUNK * 64, 64);                             \
            else _tile_loadd(B, wb + g * stride + (ptrdiff_t)(c) * CHUNK * 64, 64);                        \
            AMX_ACC(g, A, B);                                                                              \
        }                                                                                                  \
    } while (0)

/* Blocks b0..b1-1 against the M rows xb (bfloat16, Kp a row, Kp a multiple of 4), AMX_GROUP blocks at a time and
 * every group of up to AMX_ROWS rows in turn; the sums go to y through the pair formats' epilogue (scale, bias) */
TARGETAMX static void amx_blocks(const uint16_t *xb, ptrdiff_t M, int Kp, const char *w, int fmt, ptrdiff_t N,
                                 const float *scale, const float *bias, float *y, ptrdiff_t b0, ptrdiff_t b1) {
    int P = Kp / 2, chunks = P / CHUNK, tail = P % CHUNK, configured = 0;
    ptrdiff_t stride = (ptrdiff_t)P * 2 * BLOCK * ELEM[fmt], lda = (ptrdiff_t)Kp * 2, ldy = N * (ptrdiff_t)sizeof(float);
    ptrdiff_t cbytes = (ptrdiff_t)CHUNK * 2 * BLOCK * ELEM[fmt];   /* one chunk of one block */
    _Alignas(64) char buf[AMX_GROUP * CHUNK * 64];
    for (ptrdiff_t b = b0; b < b1; b += AMX_GROUP) {
        int G = b1 - b < AMX_GROUP ? (int)(b1 - b) : AMX_GROUP;
        const char *wb = w + b * stride;
        for (ptrdiff_t m = 0; m < M; m += AMX_ROWS) {
            int rows = M - m < AMX_ROWS ? (int)(M - m) : AMX_ROWS;
            if (rows != configured) amx_configure(rows, tail), configured = rows;
            const uint16_t *xm = xb + m * Kp;
            float *ym = y + m * N + b * BLOCK;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int c = 0; c < chunks; c++) AMX_CHUNK(4, 5, c, CHUNK);
            if (tail) AMX_CHUNK(6, 7, chunks, tail);
            AMX_STORE(0, 0);
            AMX_STORE(1, 1);
            AMX_STORE(2, 2);
            AMX_STORE(3, 3);
            if (scale || bias) {  /* the sums back through the epilogue the other AVX-512 tiles use */
                __m512 acc[AMX_ROWS * AMX_GROUP];
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < G; g++) acc[r * G + g] = _mm512_loadu_ps(ym + r * N + g * BLOCK);
                store_512(acc, rows, G, fmt, ym, N, scale ? scale + b * BLOCK : NULL, bias ? bias + b * BLOCK : NULL);
            }
        }
    }
    if (configured) _tile_release();
}
#endif

/* Blocks b0..b1-1 (one thread's share) against all M rows, g blocks at a time, every group of rows in turn.
 * With more rows than one tile, every tile also fetches the next group's blocks into L2, so that the weights
 * keep streaming from memory while the later tiles compute from cache; with one tile, it fetches its own
 * blocks STREAM_AHEAD bytes ahead (as amx_fetch_ahead does; not for the pair formats' vdpbf16ps tiles, which
 * measured no faster with it). Past the last block the address is merely not fetched: a prefetch never faults. */
#define STREAM_AHEAD 1024
#define ATT_ROWS 9          /* query rows of one head that attend_rows takes at a time: a verification of 8 drafts */
static void linear_blocks(const float *x, ptrdiff_t M, int K, const char *w, int fmt, ptrdiff_t N, const float *scale,
                          const float *bias, float *y, ptrdiff_t b0, ptrdiff_t b1, int isa) {
    int pairs = fmt >= W_BF16_PAIRS, wide = pairs || isa >= ISA_AVX512;
    uint16_t *xb = NULL;
    ptrdiff_t ldx = K;                          /* what a tile's x and K are: floats, or bfloat16 pairs */
    if (pairs) {            /* each thread rounds the rows itself: a few thousand values, and no barrier */
        if (b0 >= b1) return;
        int Kp = (K + 3) & ~3;
        xb = malloc(sizeof(uint16_t) * M * Kp);
        rows_as_bf16(x, M, K, Kp, xb);
#ifdef HAVE_AMX
        if (isa == ISA_AMX) {
            amx_blocks(xb, M, Kp, w, fmt, N, scale, bias, y, b0, b1);
            free(xb);
            return;
        }
#endif
        x = (const float *)xb;
        ldx = Kp / 2;
    }
    ptrdiff_t stride = (pairs ? (ptrdiff_t)ldx * 2 : K) * BLOCK * ELEM[fmt];
    int group = pairs ? GROUP_PAIRS(M) : wide ? GROUP_AVX512(M) : GROUP_AVX2(M);
    int per_tile = pairs ? ROWS_PAIRS(M) : wide ? ROWS_AVX512(M) : ROWS_AVX2(M);
    tiles_fn tiles = pairs ? tiles_pairs : wide ? tiles_avx512 : tiles_avx2;
    for (ptrdiff_t b = b0; b < b1; b += group) {
        int g = b1 - b < group ? (int)(b1 - b) : group;
        const char *wb = w + b * stride, *ahead = M > per_tile ? wb + g * stride : pairs ? NULL : wb + STREAM_AHEAD;
        const float *sb = scale ? scale + b * BLOCK : NULL, *bb = bias ? bias + b * BLOCK : NULL;
        for (ptrdiff_t m = 0; m < M; m += per_tile) {
            int rows = M - m < per_tile ? (int)(M - m) : per_tile;
            tiles(x + m * ldx, (int)ldx, rows, g, wb, stride, fmt, y + m * N + b * BLOCK, N, sb, bb, ahead);
        }
    }
    free(xb);
}

/* This thread's share of y[M, N] = x[M, K] W^T * scale + bias, where `lin` is (packed W, format, N, scale, bias)
 * (addresses as integers, 0 for none). The blocks are split between the threads of the enclosing parallel region
 * (all of them when there is none) in order, each thread one contiguous range and so one sequential stream
 * (or `group` of them). */
static void linear_part(const float *x, ptrdiff_t M, int K, const int64_t *lin, float *y, int isa) {
    ptrdiff_t N = (ptrdiff_t)lin[2], blocks = N / BLOCK;
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    ptrdiff_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    const char *w = (const char *)(intptr_t)lin[0];
    const float *scale = (const float *)(intptr_t)lin[3], *bias = (const float *)(intptr_t)lin[4];
    linear_blocks(x, M, K, w, (int)lin[1], N, scale, bias, y, b0, b1, isa);
}

static void linear(const float *x, ptrdiff_t M, int K, const int64_t *lin, float *y, int threads, int isa) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    linear_part(x, M, K, lin, y, isa);
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
 * LlamaRMSNorm computes it in float32. K a multiple of 8. Rows are split between the threads of the enclosing
 * parallel region, if any. */
TARGET static void rms_norm(float *x, const float *residual, ptrdiff_t M, int K, const float *w, float eps,
                            float *y) {
#pragma omp for schedule(static)
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

/* KV cache elements: float32, or bfloat16 or float16 (half the bytes: float32 rounded to nearest even when written,
 * widened exactly when read); the codes kernels.KV_FORMATS gives */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

TARGET static INLINE __m256 kv_load8(const void *base, ptrdiff_t at, int kvf) {
    if (kvf == KV_F32) return _mm256_loadu_ps((const float *)base + at);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    if (kvf == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* n floats (a multiple of 8) into the cache from element `at` on */
TARGET static INLINE void kv_store(void *base, ptrdiff_t at, const float *x, int n, int kvf) {
    if (kvf == KV_F32) {
        memcpy((float *)base + at, x, sizeof(float) * n);
        return;
    }
    uint16_t *out = (uint16_t *)base + at;
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m128i h;
        if (kvf == KV_F16) {
            h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        } else {  /* bfloat16: round to nearest even on the 16 bits dropped (cache values are finite) */
            __m256i b = _mm256_castps_si256(v);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
            b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
            h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xD8));
        }
        _mm_storeu_si128((__m128i *)(out + i), h);
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

/* The scores of keys lo..end-1 replaced by their weights e^(s - max) (unnormalised); returns 1 / their sum */
TARGET static INLINE float softmax_weights(float *scores, ptrdiff_t lo, ptrdiff_t end) {
    ptrdiff_t j;
    /* the largest score, eight lanes at a time (a maximum is exact in any order: the same bits) */
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (j = lo; j + 8 <= end; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(scores + j));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; j < end; j++) top = scores[j] > top ? scores[j] : top;
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
    return 1.0f / total;
}

/* One query row of one head over keys lo..pos (inclusive): scores q.k * scale, softmax, the weighted sum of
 * values into out[d]. scores: room for pos + 8 floats. Every key's score, weight and contribution is computed
 * in the same order whatever lo, pos and the other rows are. */
TARGET static void attend_one(const float *q, const void *keys, const void *values, int kvf, ptrdiff_t lo,
                              ptrdiff_t pos, int d, float scale, float *scores, float *out) {
    ptrdiff_t j = lo, end = pos + 1;
    for (; j + 8 <= end; j += 8) {
        __m256 acc[8];
        for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, kv_load8(keys, (j + t) * d + i, kvf), acc[t]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
    }
    for (; j < end; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(keys, j * d + i, kvf), acc);
        scores[j] = sum8(acc) * scale;
    }
    float inv = softmax_weights(scores, lo, end);
    for (int i0 = 0; i0 < d; i0 += 64) {            /* up to 8 vectors of the output in registers at a time */
        int w = d - i0 < 64 ? (d - i0) / 8 : 8;
        __m256 acc[8];
        for (int t = 0; t < w; t++) acc[t] = _mm256_setzero_ps();
        for (j = lo; j < end; j++) {
            __m256 pj = _mm256_set1_ps(scores[j]);
            for (int t = 0; t < w; t++) acc[t] = _mm256_fmadd_ps(pj, kv_load8(values, j * d + i0 + 8 * t, kvf), acc[t]);
        }
        for (int t = 0; t < w; t++) _mm256_storeu_ps(out + i0 + 8 * t, _mm256_mul_ps(acc[t], _mm256_set1_ps(inv)));
    }
}

/* The weighted sums of values of RN query rows (row r's weights at scores + r*ldscores, over keys lo..end0+r-1,
 * scaled by inv[r]), 8*W outputs of every row at a time (d a multiple of 8*W), each value widened once: row r
 * sums its keys in order, as attend_one does */
TARGET static INLINE void weighted_values(const void *values, int kvf, ptrdiff_t lo, ptrdiff_t end0, const int RN,
                                          const int W, int d, const float *scores, ptrdiff_t ldscores,
                                          const float *inv, float *out, ptrdiff_t ldo) {
    for (int i = 0; i < d; i += 8 * W) {
        __m256 acc[ATT_ROWS * 4], v[4];
        for (int a = 0; a < RN * W; a++) acc[a] = _mm256_setzero_ps();
        ptrdiff_t j = lo;
        for (; j < end0; j++) {             /* keys every row sees */
            for (int w = 0; w < W; w++) v[w] = kv_load8(values, j * d + i + 8 * w, kvf);
            for (int r = 0; r < RN; r++) {
                __m256 p = _mm256_set1_ps(scores[r * ldscores + j]);
                for (int w = 0; w < W; w++) acc[r * W + w] = _mm256_fmadd_ps(p, v[w], acc[r * W + w]);
            }
        }
        for (; j < end0 + RN - 1; j++) {    /* the later rows' last keys */
            for (int w = 0; w < W; w++) v[w] = kv_load8(values, j * d + i + 8 * w, kvf);
            for (int r = 0; r < RN; r++) {
                if (j >= end0 + r) continue;
                __m256 p = _mm256_set1_ps(scores[r * ldscores + j]);
                for (int w = 0; w < W; w++) acc[r * W + w] = _mm256_fmadd_ps(p, v[w], acc[r * W + w]);
            }
        }
        for (int r = 0; r < RN; r++)
            for (int w = 0; w < W; w++)
                _mm256_storeu_ps(out + r * ldo + i + 8 * w, _mm256_mul_ps(acc[r * W + w], _mm256_set1_ps(inv[r])));
    }
}

/* attend_rows' scores of each row's keys after its last whole group of eight (one at a time, as attend_one's), then
 * each row's softmax weights, with 1 / their sum in inv[r] */
TARGET static void rows_finish(const float *q, int rn, const void *keys, int kvf, ptrdiff_t lo, ptrdiff_t end0, int d,
                               float scale, float *scores, ptrdiff_t ldscores, float *inv) {
    for (int r = 0; r < rn; r++) {
        ptrdiff_t end = end0 + r;
        float *sr = scores + r * ldscores;
        for (ptrdiff_t j = lo + (end - lo) / 8 * 8; j < end; j++) {
            __m256 acc = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + i), kv_load8(keys, j * d + i, kvf), acc);
            sr[j] = sum8(acc) * scale;
        }
        inv[r] = softmax_weights(sr, lo, end);
    }
}

/* attend_one for rn query rows of one head at consecutive positions pos0 + r (q[r*d ..]) that see keys from the
 * same lo: each key's keys and values are read and widened once for all the rows (a verification's rows, or a
 * prompt's), and every row's scores, weights and sums are the same operations in the same order as attend_one's,
 * so its bits are too. Row r's output at out + r*ldo; scores: rn rows of `ldscores` floats (>= pos0 + rn + 8);
 * kbuf: room for 8 keys of d floats. */
TARGET static void attend_rows(const float *q, int rn, const void *keys, const void *values, int kvf, ptrdiff_t lo,
                               ptrdiff_t pos0, int d, float scale, float *scores, ptrdiff_t ldscores, float *kbuf,
                               float *out, ptrdiff_t ldo) {
    ptrdiff_t end0 = pos0 + 1, last = end0 + rn - 1;    /* row r sees keys lo..end0+r-1 */
    /* whole groups of eight keys from lo, for each row whose keys they fall within */
    for (ptrdiff_t j = lo; j + 8 <= last; j += 8) {
        for (int t = 0; t < 8; t++)
            for (int i = 0; i < d; i += 8) _mm256_storeu_ps(kbuf + t * d + i, kv_load8(keys, (j + t) * d + i, kvf));
        for (int r = 0; r < rn; r++) {
            if (j + 8 > end0 + r) continue;
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + r * d + i);
                for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbuf + t * d + i), acc[t]);
            }
            _mm256_storeu_ps(scores + r * ldscores + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
        }
    }
    float inv[ATT_ROWS];
    rows_finish(q, rn, keys, kvf, lo, end0, d, scale, scores, ldscores, inv);
    /* constant counts keep the sums in registers (AVX2's 16: at most 12 sums, their values and a weight) */
#define WV(RN, W) weighted_values(values, kvf, lo, end0, RN, W, d, scores, ldscores, inv, out, ldo)
    int wide = d % 32 == 0 ? 4 : d % 16 == 0 ? 2 : 1, half = wide < 2 ? wide : 2;
    switch (rn) {
    case 2: if (wide == 4) WV(2, 4); else if (wide == 2) WV(2, 2); else WV(2, 1); break;
    case 3: if (half == 2) WV(3, 2); else WV(3, 1); break;
    case 4: if (half == 2) WV(4, 2); else WV(4, 1); break;
    case 5: if (half == 2) WV(5, 2); else WV(5, 1); break;
    case 6: if (half == 2) WV(6, 2); else WV(6, 1); break;
    case 7: WV(7, 1); break;
    case 8: WV(8, 1); break;
    default: WV(ATT_ROWS, 1);
    }
#undef WV
}

/* attend_rows with AVX-512: the same operations on each lane as attend_rows' eight-lane vectors, two of those vectors
 * at a time, so every score, weight and output has the same bits (what a row computes does not depend on the
 * instruction set). A key's score sums its eight lanes over d in the same order (keys go in pairs, one in each half
 * of a vector, the query's eight floats in both); the weighted values are 16 outputs a vector, each lane summing its
 * keys in order. AVX512F alone. */
TARGET512 static INLINE __m512 pair256(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

TARGET512 static INLINE __m256 high256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

TARGET512 static INLINE __m512 kv_load16(const void *base, ptrdiff_t at, int kvf) {
    if (kvf == KV_F32) return _mm512_loadu_ps((const float *)base + at);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kvf == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The scores of 8 keys (a[p] holding keys 2p and 2p+1, in halves) as attend_one's sum8x8 would give them */
TARGET512 static INLINE __m256 sum8x8_pairs(const __m512 *a) {
    __m256 h[8];
    for (int p = 0; p < 4; p++) h[2 * p] = _mm512_castps512_ps256(a[p]), h[2 * p + 1] = high256(a[p]);
    return sum8x8(h);
}

/* weighted_values with 16 outputs a vector (W of them, d a multiple of 16 * W) */
TARGET512 static INLINE void weighted_values16(const void *values, int kvf, ptrdiff_t lo, ptrdiff_t end0, const int RN,
                                               const int W, int d, const float *scores, ptrdiff_t ldscores,
                                               const float *inv, float *out, ptrdiff_t ldo) {
    for (int i = 0; i < d; i += 16 * W) {
        __m512 acc[ATT_ROWS * 2], v[4];
        for (int a = 0; a < RN * W; a++) acc[a] = _mm512_setzero_ps();
        for (ptrdiff_t j = lo; j < end0 + RN - 1; j++) {
            for (int w = 0; w < W; w++) v[w] = kv_load16(values, j * d + i + 16 * w, kvf);
            for (int r = 0; r < RN; r++) {
                if (j >= end0 + r) continue;    /* row r sees keys lo..end0+r-1 */
                __m512 p = _mm512_set1_ps(scores[r * ldscores + j]);
                for (int w = 0; w < W; w++) acc[r * W + w] = _mm512_fmadd_ps(p, v[w], acc[r * W + w]);
            }
        }
        for (int r = 0; r < RN; r++)
            for (int w = 0; w < W; w++)
                _mm512_storeu_ps(out + r * ldo + i + 16 * w, _mm512_mul_ps(acc[r * W + w], _mm512_set1_ps(inv[r])));
    }
}

/* attend_rows with AVX-512 (d a multiple of 16); kbuf: room for 8 keys of d floats, held as pairs of keys */
TARGET512 static void attend_rows16(const float *q, int rn, const void *keys, const void *values, int kvf,
                                    ptrdiff_t lo, ptrdiff_t pos0, int d, float scale, float *scores, ptrdiff_t ldscores,
                                    float *kbuf, float *out, ptrdiff_t ldo) {
    ptrdiff_t end0 = pos0 + 1, last = end0 + rn - 1;    /* row r sees keys lo..end0+r-1 */
    for (ptrdiff_t j = lo; j + 8 <= last; j += 8) {
        /* keys j+2p and j+2p+1, eight floats of each at a time side by side: pair p's chunk i at kbuf + (p*d + 2*i) */
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < d; i += 8)
                _mm512_storeu_ps(kbuf + p * 2 * d + 2 * i, pair256(kv_load8(keys, (j + 2 * p) * d + i, kvf),
                                                                   kv_load8(keys, (j + 2 * p + 1) * d + i, kvf)));
        for (int r = 0; r < rn; r++) {
            if (j + 8 > end0 + r) continue;
            __m512 acc[4];
            for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
            for (int i = 0; i < d; i += 8) {
                __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + r * d + i))));
                for (int p = 0; p < 4; p++) acc[p] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kbuf + p * 2 * d + 2 * i), acc[p]);
            }
            _mm256_storeu_ps(scores + r * ldscores + j, _mm256_mul_ps(sum8x8_pairs(acc), _mm256_set1_ps(scale)));
        }
    }
    float inv[ATT_ROWS];
    rows_finish(q, rn, keys, kvf, lo, end0, d, scale, scores, ldscores, inv);
    /* constant counts keep the sums in registers (32 of them: at most 16 sums, their values and a weight) */
#define WV(RN, W) weighted_values16(values, kvf, lo, end0, RN, W, d, scores, ldscores, inv, out, ldo)
    int two = d % 32 == 0;
    switch (rn) {
    case 2: if (d % 64 == 0) WV(2, 4); else if (two) WV(2, 2); else WV(2, 1); break;
    case 3: if (two) WV(3, 2); else WV(3, 1); break;
    case 4: if (two) WV(4, 2); else WV(4, 1); break;
    case 5: if (two) WV(5, 2); else WV(5, 1); break;
    case 6: if (two) WV(6, 2); else WV(6, 1); break;
    case 7: if (two) WV(7, 2); else WV(7, 1); break;
    case 8: if (two) WV(8, 2); else WV(8, 1); break;
    default: if (two) WV(ATT_ROWS, 2); else WV(ATT_ROWS, 1);
    }
#undef WV
}

/* Scratch floats one thread's attention_part needs for a sequence of `longest` positions and head dim d */
static INLINE ptrdiff_t attention_scratch(ptrdiff_t longest, int d) {
    return ATT_ROWS * (longest + 8) + ATT_ROWS * (ptrdiff_t)d + 8 * (ptrdiff_t)d;
}

/* The new rows of one sequence, at positions start..start+n-1, on one layer.
 * q, k, v: row r's heads at q + r*ldq (hq heads of d), k + r*ldk, v + r*ldv (hkv heads each);
 * cos, sin: [n][d], the rotary tables of the rows' positions; cache: [2][hkv][cap][d] (keys, then values) of
 * elements kvf (KV_*), holding positions 0..start-1; window: keys a row may see are those within `window`
 * positions of it (0: all earlier ones). Writes the rotated keys and the values into the cache, then
 * out[r*ldo + h*d ..]. Each head's rows go ATT_ROWS at a time through attend_rows where they see keys from the
 * same first one (scores: attention_scratch(start + n, d) floats); from ISA_AVX512 on, with AVX-512 where d is a
 * multiple of 16 (attend_rows16, the same bits; a lone row gains nothing from it: widening its keys from the cache is
 * most of its work). */
TARGET static void attention_part(const float *q, ptrdiff_t ldq, const float *k, ptrdiff_t ldk, const float *v,
                                  ptrdiff_t ldv, ptrdiff_t n, int hq, int hkv, int d, const float *cos, const float *sin,
                                  void *cache, int kvf, ptrdiff_t cap, ptrdiff_t start, ptrdiff_t window, float scale,
                                  float *out, ptrdiff_t ldo, float *scores, int isa) {
    ptrdiff_t head = cap * d * (kvf == KV_F32 ? 4 : 2);    /* bytes of one head's keys (or values) */
    char *keys = cache, *values = keys + hkv * head;
    ptrdiff_t lds = start + n + 8;
    float *qr = scores + ATT_ROWS * lds, *kbuf = qr + ATT_ROWS * d;
#pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < n * hkv; t++) {
        ptrdiff_t r = t / hkv, at = ((t % hkv) * cap + start + r) * d;
        rope(k + r * ldk + (t % hkv) * d, cos + r * d, sin + r * d, d, qr);
        kv_store(keys, at, qr, d, kvf);
        kv_store(values, at, v + r * ldv + (t % hkv) * d, d, kvf);
    }
    int groups = hq / hkv;
    ptrdiff_t blocks = (n + ATT_ROWS - 1) / ATT_ROWS;
#pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < hq * blocks; t++) {       /* head by head: each thread a run of whole heads */
        int h = (int)(t / blocks), kh = h / groups;
        ptrdiff_t r0 = (t % blocks) * ATT_ROWS, pos0 = start + r0;
        int rn = n - r0 < ATT_ROWS ? (int)(n - r0) : ATT_ROWS;
        ptrdiff_t lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        const char *kk = keys + kh * head, *vv = values + kh * head;
        for (int r = 0; r < rn; r++)
            rope(q + (r0 + r) * ldq + h * d, cos + (r0 + r) * d, sin + (r0 + r) * d, d, qr + r * d);
        if (rn > 1 && (window <= 0 || pos0 + rn - window <= 0)) {     /* every row sees keys from 0 */
            float *o = out + r0 * ldo + (ptrdiff_t)h * d;
            if (isa >= ISA_AVX512 && d % 16 == 0)
                attend_rows16(qr, rn, kk, vv, kvf, lo, pos0, d, scale, scores, lds, kbuf, o, ldo);
            else
                attend_rows(qr, rn, kk, vv, kvf, lo, pos0, d, scale, scores, lds, kbuf, o, ldo);
            continue;
        }
        for (int r = 0; r < rn; r++) {
            ptrdiff_t pos = pos0 + r, lr = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            attend_one(qr + r * d, kk, vv, kvf, lr, pos, d, scale, scores, out + (r0 + r) * ldo + (ptrdiff_t)h * d);
        }
    }
}

/* The new rows of one sequence, at positions start..start+n-1, on one layer.
 * q, k, v: row r's heads at q + r*ldq (hq heads of d), k + r*ldk, v + r*ldv (hkv heads each);
 * cos, sin: [n][d], the rotary tables of the rows' positions; cache: [2][hkv][cap][d] (keys, then values) of
 * elements kvf (KV_*), holding positions 0..start-1; window: keys a row may see are those within `window`
 * positions of it (0: all earlier ones). Writes the rotated keys and the values into the cache, then
 * out[r*ldo + h*d ..]; isa: ISA_AVX512 and up use AVX-512 (the same bits). */
TARGET static void attention(const float *q, ptrdiff_t ldq, const float *k, ptrdiff_t ldk, const float *v,
                             ptrdiff_t ldv, ptrdiff_t n, int hq, int hkv, int d, const float *cos, const float *sin,
                             void *cache, int kvf, ptrdiff_t cap, ptrdiff_t start, ptrdiff_t window, float scale, float *out,
                             ptrdiff_t ldo, int threads, int isa) {
#pragma omp parallel num_threads(threads) if (threads > 1 && n * hq > 1)
    {
        float *scores = malloc(sizeof(float) * attention_scratch(start + n, d));
        attention_part(q, ldq, k, ldk, v, ldv, n, hq, hkv, d, cos, sin, cache, kvf, cap, start, window, scale, out, ldo,
                       scores, isa);
        free(scores);
    }
}

/* silu(g) * u for the rows of gu = [gate | up] (I each, I a multiple of 8) into act [rows][I]: silu(g) = g *
 * sigmoid(g), with e^-|g| from exp_neg, so each element is the same few operations wherever it is computed */
TARGET static void silu_mul(const float *gu, ptrdiff_t rows, int I, float *act) {
    ptrdiff_t vectors = rows * (I / 8);
#pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < vectors; t++) {
        ptrdiff_t r = t / (I / 8), i = (t % (I / 8)) * 8;
        __m256 g = _mm256_loadu_ps(gu + r * 2 * I + i), u = _mm256_loadu_ps(gu + r * 2 * I + I + i);
        __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
        __m256 e = exp_neg(_mm256_min_ps(g, _mm256_sub_ps(_mm256_setzero_ps(), g)));   /* e^-|g| */
        __m256 one = _mm256_set1_ps(1.0f);
        /* sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) for g < 0 */
        __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
        _mm256_storeu_ps(act + r * I + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
    }
}

/* A decoder layer's table (int64 each): input norm, post-attention norm, then qkv, o, gate_up and down as
 * linear_part's (packed, format, N, scale, bias). A segment's: first row, rows, start position, its cache's
 * first layer [2][hkv][cap][d], bytes from one layer's cache to the next, cap, the cache's element (KV_*). */
#define LAYER_FIELDS 22
#define SEGMENT_FIELDS 7

/* Every decoder layer of a Llama-style model over the rows x [T][H] (the embeddings; left holding the last
 * residual stream), in one parallel region: the same kernels in the same order as the framework's loop over
 * them, with barriers in place of returns. */
TARGET static void decoder(float *x, ptrdiff_t T, int H, const int64_t *layers, int L, const int64_t *segs, int S,
                           const float *cos, const float *sin, int hq, int hkv, int d, int I, ptrdiff_t window,
                           float scale, float eps, int threads, int isa) {
    ptrdiff_t nqkv = (ptrdiff_t)(hq + 2 * hkv) * d, na = (ptrdiff_t)hq * d, longest = 0;
    for (int s = 0; s < S; s++) {
        const int64_t *sg = segs + s * SEGMENT_FIELDS;
        if (sg[2] + sg[1] > longest) longest = sg[2] + sg[1];
    }
    float *h = malloc(sizeof(float) * T * (2 * H + nqkv + na + 3 * (ptrdiff_t)I + H));
    float *qkv = h + T * H, *att = qkv + T * nqkv, *o = att + T * na, *gu = o + T * H, *act = gu + T * 2 * I,
          *mlp = act + T * I;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scores = malloc(sizeof(float) * attention_scratch(longest, d));
        rms_norm(x, NULL, T, H, (const float *)(intptr_t)layers[0], eps, h);
        for (int i = 0; i < L; i++) {
            const int64_t *ly = layers + (ptrdiff_t)i * LAYER_FIELDS;
            linear_part(h, T, H, ly + 2, qkv, isa);
#pragma omp barrier
            for (int s = 0; s < S; s++) {
                const int64_t *sg = segs + s * SEGMENT_FIELDS;
                ptrdiff_t off = sg[0];
                const float *row = qkv + off * nqkv;
                attention_part(row, nqkv, row + na, nqkv, row + na + (ptrdiff_t)hkv * d, nqkv, sg[1], hq, hkv, d,
                               cos + off * d, sin + off * d, (char *)(intptr_t)sg[3] + i * sg[4], (int)sg[6], sg[5],
                               sg[2], window, scale, att + off * na, na, scores, isa);
            }
            linear_part(att, T, (int)na, ly + 7, o, isa);
#pragma omp barrier
            rms_norm(x, o, T, H, (const float *)(intptr_t)ly[1], eps, h);
            linear_part(h, T, H, ly + 12, gu, isa);
#pragma omp barrier
            silu_mul(gu, T, I, act);
            linear_part(act, T, I, ly + 17, mlp, isa);
#pragma omp barrier
            if (i + 1 < L) rms_norm(x, mlp, T, H, (const float *)(intptr_t)layers[(ptrdiff_t)(i + 1) * LAYER_FIELDS], eps, h);
        }
#pragma omp for schedule(static)
        for (ptrdiff_t j = 0; j < T * H; j++) x[j] += mlp[j];
        free(scores);
    }
    free(h);
}
#endif

/* The highest isa argument this process may pass: AMX's tiles need the kernel's leave first (isas() asks for it) */
static int max_isa = ISA_AVX512;

#if defined(HAVE_AMX) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
/* Whether this CPU has AMX-BF16 and AMX-TILE (CPUID leaf 7: EDX bits 22 and 24) and Linux lets this process use
 * the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 18; Linux 5.16 and later) */
static int amx_permitted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#else
static int amx_permitted(void) { return 0; }
#endif

/* The instruction sets a linear can use on this CPU, the widest last: "avx2" wherever the kernels run (AVX2, FMA
 * and F16C), "avx512" too where the CPU has AVX-512F, "avx512bf16" (the pair formats) where it also has
 * AVX512_BF16, _BW, _VL and _VBMI, and "amx" (the pair formats on tiles) where it also has AMX-BF16 and the OS lets
 * this process use it; none where the kernels do not run */
static PyObject *py_isas(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
#ifdef HAVE_KERNEL
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return PyTuple_New(0);
    if (!__builtin_cpu_supports("avx512f")) return Py_BuildValue("(s)", "avx2");
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi")) {
        if (max_isa == ISA_AMX || amx_permitted()) {
            max_isa = ISA_AMX;
            return Py_BuildValue("(ssss)", "avx2", "avx512", "avx512bf16", "amx");
        }
        return Py_BuildValue("(sss)", "avx2", "avx512", "avx512bf16");
    }
    return Py_BuildValue("(ss)", "avx2", "avx512");
#endif
    return PyTuple_New(0);
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

/* linear(x, M, K, w, fmt, N, scale, bias, y, threads, isa): x [M, K] and y [M, N] contiguous float32, w packed
 * [N/16][K][16] in format fmt (0 float32, 1 bfloat16, 2 FP8 E4M3 codes) or by pairs (3 bfloat16, 4 E4M3 codes,
 * K padded to a multiple of 4; only where isas() names avx512bf16), scale and bias N floats or 0 */
static PyObject *py_linear(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[11];
    if (parse(args, nargs, "iiiiiiiiiii", v, NULL)) return NULL;
    if (v[5] % 16 || v[1] < 0 || v[2] <= 0 || v[4] < W_F32 || v[4] > W_E4M3_PAIRS || v[10] < ISA_AVX2 || v[10] > max_isa) {
        PyErr_SetString(PyExc_ValueError, "linear: N must be a multiple of 16, M >= 0, K > 0, fmt 0-4, isa one isas() "
                                          "names (0 avx2, 1 avx512, 2 amx)");
        return NULL;
    }
    int64_t lin[5] = {v[3], v[4], v[5], v[6], v[7]};
    CALL(linear(F(0), v[1], (int)v[2], lin, F(8), (int)v[9], (int)v[10]));
}

/* decoder(x, T, H, layers, L, segments, S, cos, sin, hq, hkv, d, I, window, scale, eps, threads, isa): tables as
 * `decoder` reads them (int64), every N a multiple of 16, H, d and I multiples of 8 */
static PyObject *py_decoder(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[18];
    double f[18];
    if (parse(args, nargs, "iiiiiiiiiiiiiiffii", v, f)) return NULL;
    if (v[2] % 8 || v[11] % 8 || v[12] % 8 || v[10] <= 0 || v[9] % v[10] || v[17] < ISA_AVX2 || v[17] > max_isa) {
        PyErr_SetString(PyExc_ValueError, "decoder: H, d and I must be multiples of 8, hq of hkv, isa one isas() names "
                                          "(0 avx2, 1 avx512, 2 amx)");
        return NULL;
    }
    CALL(decoder(F(0), v[1], (int)v[2], (const int64_t *)v[3], (int)v[4], (const int64_t *)v[5], (int)v[6], F(7), F(8),
                 (int)v[9], (int)v[10], (int)v[11], (int)v[12], v[13], (float)f[14], (float)f[15], (int)v[16], (int)v[17]));
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

/* attention(q, ldq, k, ldk, v, ldv, n, hq, hkv, d, cos, sin, cache, kvf, cap, start, window, scale, out, ldo,
 * threads, isa) */
static PyObject *py_attention(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[22];
    double f[22];
    if (parse(args, nargs, "iiiiiiiiiiiiiiiiifiiii", v, f)) return NULL;
    if (v[9] % 8 || v[8] <= 0 || v[7] % v[8] || v[15] + v[6] > v[14] || v[13] < 0 || v[13] > 2 || v[21] < ISA_AVX2 ||
        v[21] > max_isa) {
        PyErr_SetString(PyExc_ValueError, "attention: d must be a multiple of 8, hq of hkv, kvf 0-2, isa one isas() "
                                          "names, and the cache must hold every row");
        return NULL;
    }
    CALL(attention(F(0), v[1], F(2), v[3], F(4), v[5], v[6], (int)v[7], (int)v[8], (int)v[9], F(10), F(11),
                   (void *)v[12], (int)v[13], v[14], v[15], v[16], (float)f[17], F(18), v[19], (int)v[20], (int)v[21]));
}

static PyMethodDef methods[] = {
    {"isas", py_isas, METH_NOARGS, "The instruction sets a linear can use here: avx2, avx512, avx512bf16, amx."},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, "y = x W^T * scale (+ bias) on packed W."},
    {"decoder", (PyCFunction)(void (*)(void))py_decoder, METH_FASTCALL, "every decoder layer in one call."},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "x += residual; y = w * x / rms(x)."},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL, "rope, KV write, causal attention."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
#ifdef HAVE_KERNEL
    init_e4m3_tables();
#endif
    return PyModule_Create(&module);
}
