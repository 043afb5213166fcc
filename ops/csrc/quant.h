/* Activation rows in the form each weight format multiplies with, quantized once per layer call.
 *
 * A row of n columns is laid out as arrays, each starting on a 16-byte boundary, the row on a cache line:
 *   K-quants (act_k):  int8 qs[n] | int16 bsums[n / 16] | float d[n / 256]   x ~= d[i / 256] * qs[i]
 *   Q8_0 (act_q8_0):   int8 qs[n] | float d[n / 32]                            x ~= d[i / 32] * qs[i]
 *   floats (act_f32):  float x[n]
 * bsums[j] = sum of qs[16j .. 16j+15] (for the K-quants' mins). Every SIMD level rounds identically:
 * q = round(x * (127 / max|x|)) half to even, in float32.
 */
#ifndef MOECACHE_QUANT_H
#define MOECACHE_QUANT_H

#include "common.h"

MC_INLINE const int16_t *act_k_bsums(const uint8_t *a, int64_t n) { return (const int16_t *)(a + n); }
MC_INLINE const float *act_k_d(const uint8_t *a, int64_t n) { return (const float *)(a + n + n / 8); }
MC_INLINE const float *act_q8_0_d(const uint8_t *a, int64_t n) { return (const float *)(a + n); }

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
MC_INLINE float quant_block(const float *x, int8_t *q, int n) {
    const float amax = block_amax(x, n);
    block_round(x, q, n, amax > 0.0f ? 127.0f / amax : 0.0f);
    return amax / 127.0f;
}

static void quant_k(const float *x, uint8_t *a, int64_t n) {
    int8_t *qs = (int8_t *)a;
    int16_t *bsums = (int16_t *)act_k_bsums(a, n);
    float *d = (float *)act_k_d(a, n);
    for (int64_t b = 0; b < n / QK_K; ++b) d[b] = quant_block(x + b * QK_K, qs + b * QK_K, QK_K);
    for (int64_t j = 0; j < n / 16; ++j) {
        int s = 0;
        for (int l = 0; l < 16; ++l) s += qs[16 * j + l];
        bsums[j] = (int16_t)s;
    }
}

static void quant_q8_0(const float *x, uint8_t *a, int64_t n) {
    float *d = (float *)act_q8_0_d(a, n);
    for (int64_t b = 0; b < n / QK8_0; ++b) d[b] = quant_block(x + b * QK8_0, (int8_t *)a + b * QK8_0, QK8_0);
}

static void quant_f32(const float *x, uint8_t *a, int64_t n) { memcpy(a, x, (size_t)n * sizeof(float)); }

static int64_t row_bytes_k(int64_t n) { return align_up(n + n / 8 + n / 64, MC_ALIGN); }
static int64_t row_bytes_q8_0(int64_t n) { return align_up(n + n / 8, MC_ALIGN); }
static int64_t row_bytes_f32(int64_t n) { return align_up(n * (int64_t)sizeof(float), MC_ALIGN); }

typedef struct {
    int block; /* columns per scale: a row's length is a multiple */
    int64_t (*row_bytes)(int64_t n);
    void (*quant)(const float *x, uint8_t *a, int64_t n);
} act_fmt;

static const act_fmt ACT_K = {QK_K, row_bytes_k, quant_k};
static const act_fmt ACT_Q8_0 = {QK8_0, row_bytes_q8_0, quant_q8_0};
static const act_fmt ACT_F32 = {1, row_bytes_f32, quant_f32};

#endif
