/* Shared pieces of the CPU expert kernels: SIMD level, activation blocks, half-float loads. */
#ifndef MOECACHE_COMMON_H
#define MOECACHE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 2: AVX-512 (BW, VL, VNNI), 1: AVX2 + FMA + F16C, 0: portable C. MOECACHE_SCALAR forces 0. */
#if !defined(MOECACHE_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MC_SIMD 2
#elif !defined(MOECACHE_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MC_SIMD 1
#else
#define MC_SIMD 0
#endif

#if MC_SIMD
#include <immintrin.h>
#endif

#define MC_INLINE static inline __attribute__((always_inline))

#define QK_K 256
#define QK8_0 32
/* Tokens of one expert that share a single pass over a weight row. */
#define MAX_TILE 8

/* int8 activations for the K-quants: x ~= d * qs; bsums[j] = sum of qs[16j .. 16j+15]. */
typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} act_q8k;

/* int8 activations for Q8_0 weights: x ~= d * qs. */
typedef struct {
    float d;
    int8_t qs[QK8_0];
} act_q8_0;

/* out[i] = dot(weight row w, activation row acts[i]) for i < nt <= MAX_TILE; n = columns. */
typedef void (*dot_tile_fn)(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out);

MC_INLINE float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if MC_SIMD
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        const float v = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -v : v;
    }
    bits = exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

MC_INLINE float bf16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

MC_INLINE float f32_at(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

#if MC_SIMD
MC_INLINE float hsum256_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
