/* Q4_K, Q5_K, Q6_K rows times int8 activation rows (act_k of quant.h), one 256-weight super-block at a time.
 *
 * Every super-block decodes to the same form: unsigned q[256] (0..63), int16 scales per 16 weights s16,
 * int16 mins per 16 weights m16, and floats d, dm, so that  w[i] = d * s16[i/16] * q[i] - dm * m16[i/16].
 * Then, with the activation block x ~= ad * qs and bsums its sums per 16,
 *   dot(w, x) = ad * (d * sum_j s16[j] * (q . qs)_j  -  dm * sum_j m16[j] * bsums[j])
 * with exact integer inner sums. Q6_K's offset of -32 is a min of 32 * scale with dm = d, subtracted in
 * integers. Block layouts (little endian, fp16 d/dmin):
 *   Q4_K 144 B: d, dmin, scales[12] (6-bit scale and min per 32), qs[128] (nibbles)
 *   Q5_K 176 B: d, dmin, scales[12], qh[32] (bit i of qh[l] -> weight 32i+l), qs[128]
 *   Q6_K 210 B: ql[128], qh[64], int8 scales[16] (per 16), d
 * In qs, byte l of 32-byte chunk j holds weight 64j+l (low nibble) and 64j+32+l (high nibble); in Q6_K's
 * ql, half h's bytes l of its two 32-byte chunks hold weights 128h+l, +32 (low) and +64, +96 (high).
 */
#ifndef MOECACHE_KQUANTS_H
#define MOECACHE_KQUANTS_H

#include "quant.h"

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
/* k4_scale_words in vector lanes: 8 scale bytes, then 8 min bytes (reads 16 bytes from s12: the block
 * goes on past its scales). */
MC_INLINE __m128i k4_scale_bytes(const uint8_t *s12) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s12);
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* w0, w2, w1, w2 */
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* w0, w0, w1, w1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* fp16 d and dmin at the block's start */
MC_INLINE void k4_d_dmin(const uint8_t *blk, float *d, float *dm) {
    int32_t h;
    memcpy(&h, blk, 4);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
    *d = _mm_cvtss_f32(v), *dm = _mm_cvtss_f32(_mm_movehdup_ps(v));
}
#endif

#if MC_SIMD == 2

/* q[k]: weights 64k .. 64k+63. The dot takes dpbusd sums of 4 products per int32 lane (|sum| <= 4 * 63 *
 * 127 fits int16), packs the lanes of q[0], q[1] and of q[2], q[3] to int16 (packssdw interleaves them
 * per 128-bit lane: 4 lanes of the first, 4 of the second) and scales them with one dpwssd each:
 * sc[j] holds the scale of each packed int16 lane. */
typedef struct {
    __m512i q[4], sc[2];
    __m256i m16;
    float d, dm;
} kq_blk;

typedef struct {
    __m512 v;
    __m256 m; /* the mins' part, subtracted at the end */
} kq_acc;

/* vpshufb controls for Q4_K/Q5_K's 8 scale bytes (one per 32 weights): packed int16 lane i of 128-bit
 * lane L of sc[j] comes from q[2j + i/4], whose lanes L = 0,1 are in group 4j + 2(i/4) and L = 2,3 in
 * the next one; the high byte is 0. */
static const uint8_t K4_SCALE_PICK[2][64] __attribute__((aligned(64))) = {
#define K4_I16(s) s, 0x80, s, 0x80, s, 0x80, s, 0x80
#define K4_LANE(a, b) K4_I16(a), K4_I16(b)
#define K4_ROW(j) {K4_LANE(4 * j, 4 * j + 2), K4_LANE(4 * j, 4 * j + 2), K4_LANE(4 * j + 1, 4 * j + 3), \
                   K4_LANE(4 * j + 1, 4 * j + 3)}
    K4_ROW(0), K4_ROW(1),
#undef K4_ROW
#undef K4_LANE
#undef K4_I16
};

MC_INLINE void k4_scales(const uint8_t *s12, kq_blk *r) {
    const __m128i v = k4_scale_bytes(s12);
    const __m512i vb = _mm512_broadcast_i32x4(v);
    for (int j = 0; j < 2; ++j) r->sc[j] = _mm512_shuffle_epi8(vb, _mm512_load_si512(K4_SCALE_PICK[j]));
    r->m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v)); /* each per-32 min covers two groups of 16 */
}

/* both nibbles of a 32-byte chunk: low ones in the lower 256 bits, high ones in the upper */
MC_INLINE void k4_nibbles(const uint8_t *qs, kq_blk *r) {
    const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4), m4 = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; ++k) {
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
        r->q[k] = _mm512_and_si512(_mm512_srlv_epi64(b, shift), m4);
    }
}

/* OR bit s of qh into bit 4 (0x10 mask) or bits s, s+1 into bits 4-5 (0x30): rotate each 32-bit lane left
 * by 4 - s mod 32, so the bit moves within its own byte; lower and upper 256 bits take their own s. */
MC_INLINE __m512i or_high_bits(__m512i q, __m512i qh, int s_lo, int s_hi, int mask) {
    const __m512i rot = _mm512_inserti64x4(_mm512_set1_epi32((4 - s_lo) & 31), _mm256_set1_epi32((4 - s_hi) & 31), 1);
    return _mm512_ternarylogic_epi32(q, _mm512_rolv_epi32(qh, rot), _mm512_set1_epi8((char)mask), 0xf8);
}

MC_INLINE void k5_high_bits(const uint8_t *qh, kq_blk *r) {
    const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
    for (int k = 0; k < 4; ++k) r->q[k] = or_high_bits(r->q[k], hb, 2 * k, 2 * k + 1, 0x10);
}

/* Q6_K scales, one per 16 weights: packed int16 lane i of 128-bit lane L of sc[j] is in group
 * 8j + 4(i/4) + L */
static const int16_t K6_SCALE_INDEX[2][32] __attribute__((aligned(64))) = {
#define K6_LANE(g) g, g, g, g, g + 4, g + 4, g + 4, g + 4
    {K6_LANE(0), K6_LANE(1), K6_LANE(2), K6_LANE(3)},
    {K6_LANE(8), K6_LANE(9), K6_LANE(10), K6_LANE(11)},
#undef K6_LANE
};

MC_INLINE void decode_q6k(const uint8_t *blk, kq_blk *r) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i hh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        r->q[2 * h] = or_high_bits(_mm512_and_si512(ql, m4), hh, 0, 2, 0x30);
        r->q[2 * h + 1] = or_high_bits(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hh, 4, 6, 0x30);
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    for (int j = 0; j < 2; ++j)
        r->sc[j] = _mm512_permutexvar_epi16(_mm512_load_si512(K6_SCALE_INDEX[j]), _mm512_castsi256_si512(s16));
    r->m16 = _mm256_slli_epi16(s16, 5); /* the -32 offset, as a min of 32 * scale */
    r->d = r->dm = fp16_to_fp32(blk + 208);
}

MC_INLINE __m512i kq_isum(const kq_blk *r, const int8_t *qs) {
    const __m512i z = _mm512_setzero_si512();
    __m512i p[4];
    for (int k = 0; k < 4; ++k) p[k] = _mm512_dpbusd_epi32(z, r->q[k], _mm512_load_si512(qs + 64 * k));
    const __m512i s = _mm512_dpwssd_epi32(z, _mm512_packs_epi32(p[0], p[1]), r->sc[0]);
    return _mm512_dpwssd_epi32(s, _mm512_packs_epi32(p[2], p[3]), r->sc[1]);
}

/* Q4_K, Q5_K: the mins scale by dm */
MC_INLINE void kq_dot_min(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)bsums));
    acc->v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(kq_isum(r, qs)), _mm512_set1_ps(r->d * ad), acc->v);
    acc->m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(r->dm * ad), acc->m);
}

/* Q6_K: the offset scales by d, like the weights */
MC_INLINE void kq_dot_offset(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)bsums));
    const __m512i isum = _mm512_sub_epi32(kq_isum(r, qs), _mm512_zextsi256_si512(msum));
    acc->v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(r->d * ad), acc->v);
}

MC_INLINE kq_acc kq_acc_zero(void) { return (kq_acc){_mm512_setzero_ps(), _mm256_setzero_ps()}; }
MC_INLINE float kq_acc_sum(kq_acc acc) { return _mm512_reduce_add_ps(acc.v) - hsum256_ps(acc.m); }

#elif MC_SIMD == 1

/* q[k]: weights 32k .. 32k+31; sc[k]: the int16 scale of each of its maddubs lanes */
typedef struct {
    __m256i q[8], sc[8];
    __m256i m16;
    float d, dm;
} kq_blk;

typedef struct {
    __m256 v, m;
} kq_acc;

/* bytes of int16 lanes 2m (low 128-bit lane) and 2m+1 (high lane), repeated */
MC_INLINE __m256i kq_scale_shuffle(int m) {
    const char a = (char)(4 * m), b = (char)(4 * m + 1), c = (char)(4 * m + 2), e = (char)(4 * m + 3);
    return _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, /* low 128 bits */
                            c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e);
}

/* s16: int16 scale per group of 16 -> the scale of every maddubs lane of q[k] */
MC_INLINE void kq_spread_scales(__m256i s16, kq_blk *r) {
    const __m256i lo = _mm256_permute2x128_si256(s16, s16, 0x00);
    const __m256i hi = _mm256_permute2x128_si256(s16, s16, 0x11);
    for (int k = 0; k < 8; ++k) r->sc[k] = _mm256_shuffle_epi8(k < 4 ? lo : hi, kq_scale_shuffle(k % 4));
}

MC_INLINE void k4_scales(const uint8_t *s12, kq_blk *r) {
    const __m128i v = k4_scale_bytes(s12);
    /* each per-32 value covers two groups of 16 */
    kq_spread_scales(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)), r);
    r->m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
}

MC_INLINE void k4_nibbles(const uint8_t *qs, kq_blk *r) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        r->q[2 * j] = _mm256_and_si256(raw, m4);
        r->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
}

MC_INLINE void k5_high_bits(const uint8_t *qh, kq_blk *r) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
    for (int i = 0; i < 8; ++i) {
        r->q[i] = _mm256_or_si256(r->q[i], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
        hb = _mm256_srli_epi16(hb, 1);
    }
}

MC_INLINE void decode_q6k(const uint8_t *blk, kq_blk *r) {
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
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    kq_spread_scales(s16, r);
    r->m16 = _mm256_slli_epi16(s16, 5); /* the -32 offset, as a min of 32 * scale */
    r->d = r->dm = fp16_to_fp32(blk + 208);
}

MC_INLINE __m256i kq_isum(const kq_blk *r, const int8_t *qs) {
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        const __m256i p = _mm256_maddubs_epi16(r->q[k], _mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, r->sc[k]));
    }
    return s;
}

MC_INLINE void kq_dot_min(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)bsums));
    acc->v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_isum(r, qs)), _mm256_set1_ps(r->d * ad), acc->v);
    acc->m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(r->dm * ad), acc->m);
}

MC_INLINE void kq_dot_offset(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    const __m256i msum = _mm256_madd_epi16(r->m16, _mm256_loadu_si256((const __m256i *)bsums));
    const __m256i isum = _mm256_sub_epi32(kq_isum(r, qs), msum);
    acc->v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(r->d * ad), acc->v);
}

MC_INLINE kq_acc kq_acc_zero(void) { return (kq_acc){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
MC_INLINE float kq_acc_sum(kq_acc acc) { return hsum256_ps(acc.v) - hsum256_ps(acc.m); }

#else

typedef struct {
    uint8_t q[QK_K];
    int16_t s16[16], m16[16];
    float d, dm;
} kq_blk;

typedef struct {
    float v, m;
} kq_acc;

MC_INLINE void k4_scales(const uint8_t *s12, kq_blk *r) {
    uint32_t u[4];
    uint8_t b[16];
    k4_scale_words(s12, u);
    memcpy(b, u, 16);
    for (int j = 0; j < 16; ++j) {
        r->s16[j] = b[j / 2];
        r->m16[j] = b[8 + j / 2];
    }
}

MC_INLINE void k4_nibbles(const uint8_t *qs, kq_blk *r) {
    for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
            r->q[64 * j + l] = qs[32 * j + l] & 0x0f;
            r->q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
}

MC_INLINE void k5_high_bits(const uint8_t *qh, kq_blk *r) {
    for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 32; ++l) r->q[32 * i + l] |= ((qh[l] >> i) & 1) << 4;
}

MC_INLINE void decode_q6k(const uint8_t *blk, kq_blk *r) {
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

MC_INLINE void kq_sums(const kq_blk *r, const int8_t *qs, const int16_t *bsums, int32_t *isum, int32_t *msum) {
    *isum = *msum = 0;
    for (int j = 0; j < 16; ++j) {
        int32_t s = 0;
        for (int l = 0; l < 16; ++l) s += r->q[16 * j + l] * qs[16 * j + l];
        *isum += r->s16[j] * s;
        *msum += r->m16[j] * bsums[j];
    }
}

MC_INLINE void kq_dot_min(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    int32_t isum, msum;
    kq_sums(r, qs, bsums, &isum, &msum);
    acc->v += r->d * ad * (float)isum;
    acc->m += r->dm * ad * (float)msum;
}

MC_INLINE void kq_dot_offset(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc) {
    int32_t isum, msum;
    kq_sums(r, qs, bsums, &isum, &msum);
    acc->v += r->d * ad * (float)(isum - msum);
}

MC_INLINE kq_acc kq_acc_zero(void) { return (kq_acc){0.0f, 0.0f}; }
MC_INLINE float kq_acc_sum(kq_acc acc) { return acc.v - acc.m; }

#endif

#if !MC_SIMD
MC_INLINE void k4_d_dmin(const uint8_t *blk, float *d, float *dm) {
    *d = fp16_to_fp32(blk);
    *dm = fp16_to_fp32(blk + 2);
}
#endif

MC_INLINE void decode_q4k(const uint8_t *blk, kq_blk *r) {
    k4_d_dmin(blk, &r->d, &r->dm);
    k4_scales(blk + 4, r);
    k4_nibbles(blk + 16, r);
}

MC_INLINE void decode_q5k(const uint8_t *blk, kq_blk *r) {
    k4_d_dmin(blk, &r->d, &r->dm);
    k4_scales(blk + 4, r);
    k4_nibbles(blk + 48, r);
    k5_high_bits(blk + 16, r);
}

/* ---- rows ---- */

typedef void (*kq_decode_fn)(const uint8_t *blk, kq_blk *r);
typedef void (*kq_dot_fn)(const kq_blk *r, const int8_t *qs, const int16_t *bsums, float ad, kq_acc *acc);

/* Each super-block is decoded once and used for all nt activation rows; nm and nt are constants where the
 * caller passes them, so the accumulators stay in registers. */
MC_INLINE void kq_rows(const rows_job *j, int64_t n, const int nm, const int nt, kq_decode_fn decode, kq_dot_fn dot,
                       int64_t block_bytes) {
    const int64_t pf = prefetch_rows(j->w[0].row_bytes);
    for (int64_t r = 0; r < j->num_rows; ++r) {
        for (int m = 0; m < nm; ++m) prefetch_row(j->w[m], j->next[m], r + pf);
        kq_acc acc[MAX_MATS][MAX_TILE];
        for (int m = 0; m < nm; ++m)
            for (int i = 0; i < nt; ++i) acc[m][i] = kq_acc_zero();
        for (int64_t b = 0; b < n / QK_K; ++b)
            for (int m = 0; m < nm; ++m) {
                kq_blk blk;
                decode(j->w[m].w + r * j->w[m].row_bytes + b * block_bytes, &blk);
                for (int i = 0; i < nt; ++i) {
                    const uint8_t *a = j->acts[m][i];
                    dot(&blk, (const int8_t *)a + b * QK_K, act_k_bsums(a, n) + 16 * b, act_k_d(a, n)[b], &acc[m][i]);
                }
            }
        for (int m = 0; m < nm; ++m)
            for (int i = 0; i < nt; ++i) j->out[m][i * j->out_stride + r] = kq_acc_sum(acc[m][i]);
    }
}

/* one instance per common (nm, nt): batch 1 and 2 */
#define KQ_ROWS_FN(name, decode, dot, block_bytes)                                \
    static void name(const rows_job *j, int64_t n) {                              \
        if (j->nm == 1 && j->nt == 1)                                             \
            kq_rows(j, n, 1, 1, decode, dot, block_bytes);                        \
        else if (j->nm == 2 && j->nt == 1)                                        \
            kq_rows(j, n, 2, 1, decode, dot, block_bytes);                        \
        else if (j->nm == 1 && j->nt == 2)                                        \
            kq_rows(j, n, 1, 2, decode, dot, block_bytes);                        \
        else if (j->nm == 2 && j->nt == 2)                                        \
            kq_rows(j, n, 2, 2, decode, dot, block_bytes);                        \
        else                                                                      \
            kq_rows(j, n, j->nm, j->nt, decode, dot, block_bytes);                \
    }

KQ_ROWS_FN(dot_q4k_rows, decode_q4k, kq_dot_min, 144)
KQ_ROWS_FN(dot_q5k_rows, decode_q5k, kq_dot_min, 176)
KQ_ROWS_FN(dot_q6k_rows, decode_q6k, kq_dot_offset, 210)

#endif
