/* Q8_0 rows times int8 activation rows (act_q8_0), and F32/F16/BF16 rows times float rows.
 *   Q8_0 34 B per 32 weights: fp16 d, int8 qs[32]; w = d * q.
 */
#ifndef MOECACHE_SIMPLE_H
#define MOECACHE_SIMPLE_H

#include "common.h"

#if MC_SIMD

/* sum of q . a over 32 int8 pairs, as 8 int32 lanes; |q| <= 128 and |a| <= 127 keep maddubs exact */
MC_INLINE __m256i q8_dot32(__m256i q, __m256i a) {
    const __m256i uq = _mm256_abs_epi8(q), sa = _mm256_sign_epi8(a, q);
#if MC_SIMD == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), uq, sa);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(uq, sa), _mm256_set1_epi16(1));
#endif
}

static void dot_q8_0_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    __m256 acc[MAX_TILE];
    for (int i = 0; i < nt; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK8_0; ++b) {
        const uint8_t *blk = w + 34 * b;
        const float d = fp16_to_fp32(blk);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        for (int i = 0; i < nt; ++i) {
            const act_q8_0 *a = (const act_q8_0 *)acts[i] + b;
            const __m256i isum = q8_dot32(q, _mm256_loadu_si256((const __m256i *)a->qs));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * a->d), acc[i]);
        }
    }
    for (int i = 0; i < nt; ++i) out[i] = hsum256_ps(acc[i]);
}

#else

static void dot_q8_0_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    for (int i = 0; i < nt; ++i) out[i] = 0.0f;
    for (int64_t b = 0; b < n / QK8_0; ++b) {
        const uint8_t *blk = w + 34 * b;
        const float d = fp16_to_fp32(blk);
        /* read through an int8_t pointer: GCC 12 -O3 vectorizes `(int8_t)u8 * s8` as unsigned */
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int i = 0; i < nt; ++i) {
            const act_q8_0 *a = (const act_q8_0 *)acts[i] + b;
            int32_t isum = 0;
            for (int l = 0; l < QK8_0; ++l) isum += q[l] * a->qs[l];
            out[i] += d * a->d * (float)isum;
        }
    }
}

#endif

/* ---- float weights: activations stay float32 ---- */

enum { FLOAT_F32, FLOAT_F16, FLOAT_BF16 };

MC_INLINE float float_at(const uint8_t *w, int64_t j, int kind) {
    switch (kind) {
    case FLOAT_F16: return fp16_to_fp32(w + 2 * j);
    case FLOAT_BF16: return bf16_to_fp32(w + 2 * j);
    default: return f32_at(w + 4 * j);
    }
}

#if MC_SIMD

MC_INLINE __m256 float_at8(const uint8_t *w, int64_t j, int kind) {
    switch (kind) {
    case FLOAT_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * j)));
    case FLOAT_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * j))), 16));
    default: return _mm256_loadu_ps((const float *)(w + 4 * j));
    }
}

/* Prefix of the row handled 8 columns at a time; returns where the scalar tail starts. */
MC_INLINE int64_t float_tile_simd(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out,
                                  int kind) {
    __m256 acc[MAX_TILE];
    for (int i = 0; i < nt; ++i) acc[i] = _mm256_setzero_ps();
    const int64_t n8 = n - n % 8;
    for (int64_t j = 0; j < n8; j += 8) {
        const __m256 wv = float_at8(w, j, kind);
        for (int i = 0; i < nt; ++i)
            acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps((const float *)acts[i] + j), acc[i]);
    }
    for (int i = 0; i < nt; ++i) out[i] = hsum256_ps(acc[i]);
    return n8;
}

#else

MC_INLINE int64_t float_tile_simd(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out,
                                  int kind) {
    (void)w, (void)acts, (void)n, (void)kind;
    for (int i = 0; i < nt; ++i) out[i] = 0.0f;
    return 0;
}

#endif

MC_INLINE void float_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out,
                          int kind) {
    for (int64_t j = float_tile_simd(w, acts, nt, n, out, kind); j < n; ++j) {
        const float wj = float_at(w, j, kind);
        for (int i = 0; i < nt; ++i) out[i] += wj * ((const float *)acts[i])[j];
    }
}

static void dot_f32_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    float_tile(w, acts, nt, n, out, FLOAT_F32);
}

static void dot_f16_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    float_tile(w, acts, nt, n, out, FLOAT_F16);
}

static void dot_bf16_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    float_tile(w, acts, nt, n, out, FLOAT_BF16);
}

#endif
