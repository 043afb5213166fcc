/* Shared pieces of the CPU expert kernels: SIMD level, half-float loads, the row-kernel contract. */
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
#define MC_ALIGN 64 /* a cache line: scratch rows start on one, so threads never share a line */

#define QK_K 256
#define QK8_0 32
/* Tokens of one expert that share a single pass over a weight row. */
#define MAX_TILE 8
/* How far ahead of the row being computed weight rows are prefetched, and where to: locality 1 (prefetcht2)
 * fills L2, not L1, whose few fill buffers the demand loads need (into L1 was slower, measured on Zen 4);
 * software prefetch also runs on across 4 KiB pages, where hardware prefetchers stop. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

/* Rows [0, num_rows) of one expert matrix, row_bytes apart. */
typedef struct {
    const uint8_t *w;
    int64_t row_bytes, num_rows;
} row_span;

/* The same rows of nm <= MAX_MATS matrices of one format, read together row by row so that each core keeps
 * as many streams in flight (gate and up; two experts' down):
 *   out[m][i * out_stride + r] = dot(row r of w[m], activation row acts[m][i])   r < num_rows, i < nt
 * n = columns. Rows are prefetched PREFETCH_BYTES ahead, running on into next[m] past the last row. */
#define MAX_MATS 2
typedef struct {
    int nm, nt;
    int64_t num_rows, out_stride;
    row_span w[MAX_MATS], next[MAX_MATS];
    const uint8_t *const *acts[MAX_MATS];
    float *out[MAX_MATS];
} rows_job;

typedef void (*dot_rows_fn)(const rows_job *j, int64_t n);

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

MC_INLINE int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
MC_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Rows between a row and the one prefetched while it is computed. */
MC_INLINE int64_t prefetch_rows(int64_t row_bytes) {
    return PREFETCH_BYTES ? (PREFETCH_BYTES + row_bytes - 1) / row_bytes : 1 << 30;
}

/* Prefetch row r of s, or row r - s.num_rows of next past the end (nothing past next's end). */
MC_INLINE void prefetch_row(row_span s, row_span next, int64_t r) {
    if (r >= s.num_rows) {
        r -= s.num_rows;
        s = next;
        if (!s.w || r >= s.num_rows) return;
    }
    const char *p = (const char *)(s.w + r * s.row_bytes);
    for (int64_t off = 0; off < s.row_bytes; off += 64) __builtin_prefetch(p + off, 0, PREFETCH_LOCALITY);
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
