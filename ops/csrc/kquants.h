/* Q4_K, Q5_K, Q6_K rows times int8 activation rows (act_q8k), one 256-weight super-block at a time.
 *
 * Every super-block decodes to the same form: unsigned q[256] (0..63), per-16 int16 scales s16 and
 * mins m16, and two floats, so that  w[i] = d * s16[i/16] * q[i] - dm * m16[i/16].  Then
 *   dot(w, a) = a.d * (d * sum_j s16[j] * (q . a.qs)_j  -  dm * sum_j m16[j] * a.bsums[j])
 * with exact integer inner sums. Block layouts (little endian, fp16 d/dmin):
 *   Q4_K 144 B: d, dmin, scales[12] (6-bit scale and min per 32), qs[128] (nibbles)
 *   Q5_K 176 B: d, dmin, scales[12], qh[32] (bit i of qh[l] -> weight 32i+l), qs[128]
 *   Q6_K 210 B: ql[128], qh[64], int8 scales[16] (per 16), d; q - 32 is the signed weight
 */
#ifndef MOECACHE_KQUANTS_H
#define MOECACHE_KQUANTS_H

#include "common.h"

#if MC_SIMD
typedef struct {
    __m256i q[8]; /* weights 32k .. 32k+31, natural order */
    __m256i s16, m16;
    float d, dm;
} kq_raw;
#else
typedef struct {
    uint8_t q[QK_K];
    int16_t s16[16], m16[16];
    float d, dm;
} kq_raw;
#endif

/* Q4_K/Q5_K 12-byte scale field -> 8 scales (u[0..1]) and 8 mins (u[2..3]), one byte each:
 * entries 0..3 are the low 6 bits of bytes 0..3 (4..7 for mins); entries 4..7 take their low
 * nibble from bytes 8..11 (high nibble for mins) and their top 2 bits from bits 6..7 of 0..3 (4..7). */
MC_INLINE void k4_scale_words(const uint8_t *s12, uint32_t u[4]) {
    uint32_t w0, w1, w2;
    memcpy(&w0, s12, 4);
    memcpy(&w1, s12 + 4, 4);
    memcpy(&w2, s12 + 8, 4);
    u[0] = w0 & 0x3f3f3f3fu;
    u[1] = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    u[2] = w1 & 0x3f3f3f3fu;
    u[3] = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
}

#if MC_SIMD

MC_INLINE void k4_scales(const uint8_t *s12, kq_raw *r) {
    uint32_t u[4];
    k4_scale_words(s12, u);
    const __m128i v = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
    /* each per-32 value covers two groups of 16 */
    r->s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
    r->m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
}

MC_INLINE void k4_nibbles(const uint8_t *qs, kq_raw *r) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        r->q[2 * j] = _mm256_and_si256(raw, m4);
        r->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
}

MC_INLINE void k5_high_bits(const uint8_t *qh, kq_raw *r) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
    for (int i = 0; i < 8; ++i) {
        r->q[i] = _mm256_or_si256(r->q[i], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
        hb = _mm256_srli_epi16(hb, 1);
    }
}

MC_INLINE void decode_q6k(const uint8_t *blk, kq_raw *r) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        /* low nibbles of l0, l1, then high nibbles; bit pairs 0-1, 2-3, 4-5, 6-7 of qh become
         * bits 4-5 of the four 32-weight groups */
        const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        const __m256i hi[4] = {_mm256_slli_epi16(hh, 4), _mm256_slli_epi16(hh, 2), hh, _mm256_srli_epi16(hh, 2)};
        for (int s = 0; s < 4; ++s) r->q[4 * h + s] = _mm256_or_si256(lo[s], _mm256_and_si256(hi[s], m30));
    }
    r->s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    r->m16 = _mm256_slli_epi16(r->s16, 5); /* the -32 offset, as a min of 32 * scale */
    r->d = r->dm = fp16_to_fp32(blk + 208);
}

#else

MC_INLINE void k4_scales(const uint8_t *s12, kq_raw *r) {
    uint32_t u[4];
    uint8_t b[16];
    k4_scale_words(s12, u);
    memcpy(b, u, 16);
    for (int j = 0; j < 16; ++j) {
        r->s16[j] = b[j / 2];
        r->m16[j] = b[8 + j / 2];
    }
}

MC_INLINE void k4_nibbles(const uint8_t *qs, kq_raw *r) {
    for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
            r->q[64 * j + l] = qs[32 * j + l] & 0x0f;
            r->q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
}

MC_INLINE void k5_high_bits(const uint8_t *qh, kq_raw *r) {
    for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 32; ++l) r->q[32 * i + l] |= ((qh[l] >> i) & 1) << 4;
}

MC_INLINE void decode_q6k(const uint8_t *blk, kq_raw *r) {
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const uint8_t l0 = blk[64 * h + l], l1 = blk[64 * h + 32 + l], hh = blk[128 + 32 * h + l];
            r->q[128 * h + l] = (l0 & 0x0f) | ((hh & 3) << 4);
            r->q[128 * h + 32 + l] = (l1 & 0x0f) | (((hh >> 2) & 3) << 4);
            r->q[128 * h + 64 + l] = (l0 >> 4) | (((hh >> 4) & 3) << 4);
            r->q[128 * h + 96 + l] = (l1 >> 4) | (((hh >> 6) & 3) << 4);
        }
    for (int j = 0; j < 16; ++j) {
        r->s16[j] = (int8_t)blk[192 + j];
        r->m16[j] = (int16_t)(32 * r->s16[j]);
    }
    r->d = r->dm = fp16_to_fp32(blk + 208);
}

#endif

MC_INLINE void decode_q4k(const uint8_t *blk, kq_raw *r) {
    r->d = fp16_to_fp32(blk);
    r->dm = fp16_to_fp32(blk + 2);
    k4_scales(blk + 4, r);
    k4_nibbles(blk + 16, r);
}

MC_INLINE void decode_q5k(const uint8_t *blk, kq_raw *r) {
    r->d = fp16_to_fp32(blk);
    r->dm = fp16_to_fp32(blk + 2);
    k4_scales(blk + 4, r);
    k4_nibbles(blk + 48, r);
    k5_high_bits(blk + 16, r);
}

/* ---- the integer dot of one decoded super-block with one activation block ---- */

#if MC_SIMD == 2

typedef __m512 kq_acc;
typedef struct {
    __m512i q[4], sc[4]; /* 64 weights each; sc: the int16 scale of every maddubs lane */
} kq_vec;

MC_INLINE void kq_prepare(const kq_raw *r, kq_vec *v) {
    static const int16_t lane_group[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const __m512i groups = _mm512_loadu_si512(lane_group);
    const __m512i s = _mm512_castsi256_si512(r->s16); /* only lanes 0..15 are indexed */
    for (int k = 0; k < 4; ++k) {
        v->q[k] = _mm512_inserti64x4(_mm512_castsi256_si512(r->q[2 * k]), r->q[2 * k + 1], 1);
        v->sc[k] = _mm512_permutexvar_epi16(_mm512_add_epi16(groups, _mm512_set1_epi16((short)(4 * k))), s);
    }
}

MC_INLINE void kq_dot(const kq_vec *v, const kq_raw *r, const act_q8k *a, kq_acc *acc) {
    __m512i isum = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
        const __m512i p = _mm512_maddubs_epi16(v->q[k], _mm512_loadu_si512(a->qs + 64 * k));
        isum = _mm512_dpwssd_epi32(isum, p, v->sc[k]);
    }
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)a->bsums));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(a->d * r->d), *acc);
    const __m512 mins = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(msum));
    *acc = _mm512_fnmadd_ps(mins, _mm512_set1_ps(a->d * r->dm), *acc);
}

MC_INLINE kq_acc kq_acc_zero(void) { return _mm512_setzero_ps(); }
MC_INLINE float kq_acc_sum(kq_acc acc) { return _mm512_reduce_add_ps(acc); }

#elif MC_SIMD == 1

typedef __m256 kq_acc;
typedef struct {
    __m256i q[8], sc[8];
} kq_vec;

/* bytes of int16 lanes 2m (low 128-bit lane) and 2m+1 (high lane), repeated */
MC_INLINE __m256i kq_scale_shuffle(int m) {
    const char a = (char)(4 * m), b = (char)(4 * m + 1), c = (char)(4 * m + 2), e = (char)(4 * m + 3);
    return _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, /* low 128 bits */
                            c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e);
}

MC_INLINE void kq_prepare(const kq_raw *r, kq_vec *v) {
    const __m256i lo = _mm256_permute2x128_si256(r->s16, r->s16, 0x00);
    const __m256i hi = _mm256_permute2x128_si256(r->s16, r->s16, 0x11);
    for (int k = 0; k < 8; ++k) {
        v->q[k] = r->q[k];
        v->sc[k] = _mm256_shuffle_epi8(k < 4 ? lo : hi, kq_scale_shuffle(k % 4));
    }
}

MC_INLINE void kq_dot(const kq_vec *v, const kq_raw *r, const act_q8k *a, kq_acc *acc) {
    __m256i isum = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        const __m256i p = _mm256_maddubs_epi16(v->q[k], _mm256_loadu_si256((const __m256i *)(a->qs + 32 * k)));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, v->sc[k]));
    }
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)a->bsums));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(a->d * r->d), *acc);
    *acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(a->d * r->dm), *acc);
}

MC_INLINE kq_acc kq_acc_zero(void) { return _mm256_setzero_ps(); }
MC_INLINE float kq_acc_sum(kq_acc acc) { return hsum256_ps(acc); }

#else

typedef float kq_acc;
typedef int kq_vec; /* the scalar path reads kq_raw directly */

MC_INLINE void kq_prepare(const kq_raw *r, kq_vec *v) {
    (void)r;
    *v = 0;
}

MC_INLINE void kq_dot(const kq_vec *v, const kq_raw *r, const act_q8k *a, kq_acc *acc) {
    (void)v;
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 16; ++j) {
        int32_t s = 0;
        for (int l = 0; l < 16; ++l) s += r->q[16 * j + l] * a->qs[16 * j + l];
        isum += r->s16[j] * s;
        msum += r->m16[j] * a->bsums[j];
    }
    *acc += a->d * (r->d * (float)isum - r->dm * (float)msum);
}

MC_INLINE kq_acc kq_acc_zero(void) { return 0.0f; }
MC_INLINE float kq_acc_sum(kq_acc acc) { return acc; }

#endif

typedef void (*kq_decode_fn)(const uint8_t *blk, kq_raw *r);

/* Each super-block is decoded once and used for all nt activation rows. */
MC_INLINE void kq_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out,
                       kq_decode_fn decode, int64_t block_bytes) {
    kq_acc acc[MAX_TILE];
    for (int i = 0; i < nt; ++i) acc[i] = kq_acc_zero();
    for (int64_t b = 0; b < n / QK_K; ++b) {
        kq_raw r;
        kq_vec v;
        decode(w + b * block_bytes, &r);
        kq_prepare(&r, &v);
        for (int i = 0; i < nt; ++i) kq_dot(&v, &r, (const act_q8k *)acts[i] + b, &acc[i]);
    }
    for (int i = 0; i < nt; ++i) out[i] = kq_acc_sum(acc[i]);
}

static void dot_q4k_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    kq_tile(w, acts, nt, n, out, decode_q4k, 144);
}

static void dot_q5k_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    kq_tile(w, acts, nt, n, out, decode_q5k, 176);
}

static void dot_q6k_tile(const uint8_t *w, const uint8_t *const *acts, int nt, int64_t n, float *out) {
    kq_tile(w, acts, nt, n, out, decode_q6k, 210);
}

#endif
