/* Activation rows in the form each weight format multiplies with, quantized once per layer call.
 *
 * The int8 forms hold two planes: plane 0 rounds x to d0 * q0, plane 1 rounds what that lost, x - d0 * q0, on a
 * grid 2^PLANE_BITS = 256 times finer, so x ~= d0 * (q0 + q1 / 256) to 1/(2 * 127 * 256) of the block's max |x|.
 * One plane alone is 1/254 of the block maximum: 0.7-1.9% error in each MoE layer's output, enough to flip a
 * later router's top-k and move a token's log-probability by tenths of a nat against a float reference. The dots
 * decode a weight block once for both planes and add the planes in a fixed order.
 *
 * A row of n columns, on a cache line, its arrays on 16-byte boundaries:
 *   K-quants (act_k):  int8 qs[2][n] | float sums[n / 16] | float d[n / 256][4]
 *                      x ~= d[b][0] * qs[0][i] + d[b][2] * qs[1][i] (b = i / 256), d[b] = d0, d0, d0 / 256,
 *                      d0 / 256: the lane order of the AVX-512 dot's sums. sums[j]: the two planes' values
 *                      16j .. 16j+15 summed, for the mins; the planes' values, not x, so that a weight's scale
 *                      and min parts meet the same x and the error stays that of w . x.
 *   Q8_0 (act_q8_0):   int8 qs[2][n] | float d[(n + 63) / 64]
 *                      x ~= d[i / 64] * (256 * qs[0][i] + qs[1][i]), d = d0 / 256: one scale per QA8 = 64 (the
 *                      last block may have 32), shared by the two weight blocks of an AVX-512 vector.
 *   floats (act_f32):  float x[n]
 * Every SIMD level rounds identically: q = round(v * id) half to even, clamped to [-127, 127], with id =
 * 127 / max|x| for plane 0 and 256 times that for plane 1; x - d0 * q0 is a multiply, then a subtract, in float32.
 */
#ifndef MOECACHE_QUANT_H
#define MOECACHE_QUANT_H

#include "common.h"

#define ACT_PLANES 2
#define PLANE_BITS 8
#define PLANE_RATIO ((float)(1 << PLANE_BITS))
#define QA8 64

MC_INLINE const float *act_k_sums(const uint8_t *a, int64_t n) { return (const float *)(a + ACT_PLANES * n); }
MC_INLINE const float *act_k_d(const uint8_t *a, int64_t n) { return act_k_sums(a, n) + n / 16; }
MC_INLINE int64_t act_q8_0_blocks(int64_t n) { return (n + QA8 - 1) / QA8; }
MC_INLINE const float *act_q8_0_d(const uint8_t *a, int64_t n) { return (const float *)(a + ACT_PLANES * n); }

/* Block b of an act_k row */
typedef struct {
    const int8_t *qs[ACT_PLANES]; /* [256] each */
    const float *sums;            /* [16] */
    const float *d;               /* [4]: d0, d0, d1, d1 */
} act_k_blk;

MC_INLINE act_k_blk act_k_block(const uint8_t *a, int64_t n, int64_t b) {
    const int8_t *qs = (const int8_t *)a + b * QK_K;
    return (act_k_blk){{qs, qs + n}, act_k_sums(a, n) + 16 * b, act_k_d(a, n) + 4 * b};
}

/* amax of a block of n floats (n a multiple of 16) */
MC_INLINE float block_amax(const float *x, int n) {
#if MC_SIMD == 2
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    return _mm512_reduce_max_ps(m);
#else
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
#endif
}

/* q = round(x * id) clamped to [-127, 127]; n a multiple of 16 */
MC_INLINE void block_round(const float *x, int8_t *q, int n, float id) {
#if MC_SIMD == 2
    const __m512 s = _mm512_set1_ps(id);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int i = 0; i < n; i += 16) {
        /* cvtps rounds half to even under the default MXCSR, like nearbyintf */
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), s));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
    }
#else
    for (int i = 0; i < n; ++i) q[i] = (int8_t)fmaxf(-127.0f, fminf(127.0f, nearbyintf(x[i] * id)));
#endif
}

/* q for one block of n floats; returns the scale d with x ~= d * q. */

/* r = x - d * q: what rounding lost; n a multiple of 16 */
MC_INLINE void block_residual(const float *x, const int8_t *q, float d, float *r, int n) {
#if MC_SIMD == 2
    const __m512 vd = _mm512_set1_ps(d);
    for (int i = 0; i < n; i += 16) {
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i))));
        _mm512_storeu_ps(r + i, _mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_mul_ps(vd, qf)));
    }
#else
    for (int i = 0; i < n; ++i) r[i] = x[i] - d * (float)q[i];
#endif
}

/* Both planes of one block of n <= QK_K floats: q0 rounds x, q1 rounds x - d0 * q0 on a grid PLANE_RATIO
 * times finer; returns d0. */
MC_INLINE float quant_planes(const float *x, int8_t *q0, int8_t *q1, int n) {
    float r[QK_K];
    const float amax = block_amax(x, n), id = amax > 0.0f ? 127.0f / amax : 0.0f, d0 = amax / 127.0f;
    block_round(x, q0, n, id);
    block_residual(x, q0, d0, r, n);
    block_round(r, q1, n, id * PLANE_RATIO);
    return d0;
}

static void quant_k(const float *x, uint8_t *a, int64_t n) {
    int8_t *q0 = (int8_t *)a, *q1 = q0 + n;
    float *sums = (float *)act_k_sums(a, n), *d = (float *)act_k_d(a, n);
    for (int64_t b = 0; b < n / QK_K; ++b) {
        const float d0 = quant_planes(x + b * QK_K, q0 + b * QK_K, q1 + b * QK_K, QK_K);
        d[4 * b] = d[4 * b + 1] = d0, d[4 * b + 2] = d[4 * b + 3] = d0 / PLANE_RATIO;
    }
    for (int64_t j = 0; j < n / 16; ++j) {
        int s0 = 0, s1 = 0;
        for (int l = 0; l < 16; ++l) s0 += q0[16 * j + l], s1 += q1[16 * j + l];
        sums[j] = d[j / 16 * 4] * (float)s0 + d[j / 16 * 4 + 2] * (float)s1;
    }
}

static void quant_q8_0(const float *x, uint8_t *a, int64_t n) {
    int8_t *q0 = (int8_t *)a, *q1 = q0 + n;
    float *d = (float *)act_q8_0_d(a, n);
    for (int64_t i = 0; i < n; i += QA8)
        d[i / QA8] = quant_planes(x + i, q0 + i, q1 + i, (int)min64(QA8, n - i)) / PLANE_RATIO;
}

static void quant_f32(const float *x, uint8_t *a, int64_t n) { memcpy(a, x, (size_t)n * sizeof(float)); }

static int64_t row_bytes_k(int64_t n) { return align_up(ACT_PLANES * n + n / 4 + n / 16, MC_ALIGN); }
static int64_t row_bytes_q8_0(int64_t n) { return align_up(ACT_PLANES * n + 4 * act_q8_0_blocks(n), MC_ALIGN); }
static int64_t row_bytes_f32(int64_t n) { return align_up(n * (int64_t)sizeof(float), MC_ALIGN); }

typedef struct {
    int64_t (*row_bytes)(int64_t n);
    void (*quant)(const float *x, uint8_t *a, int64_t n);
} act_fmt;

static const act_fmt ACT_K = {row_bytes_k, quant_k};
static const act_fmt ACT_Q8_0 = {row_bytes_q8_0, quant_q8_0};
static const act_fmt ACT_F32 = {row_bytes_f32, quant_f32};

#endif
