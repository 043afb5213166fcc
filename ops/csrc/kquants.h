/* Q4_K, Q5_K, Q6_K rows times int8 activation rows (act_k of quant.h), one 256-weight super-block at a time.
 *
 * Every super-block decodes to the same form: unsigned q[256] (0..63), int16 scales per 16 weights s16,
 * float mins per 16 weights mins, and a float d, so that  w[i] = d * s16[i/16] * q[i] - mins[i/16].
 * Then, with the activation block x ~= ad0 * qs0 + ad1 * qs1 (its two planes) and xs those values' sums per 16,
 *   dot(w, x) = d * sum_p ad_p * sum_j s16[j] * (q . qs_p)_j  -  sum_j mins[j] * xs[j]
 * with exact integer inner sums; the mins take xs, both planes at once. Q4_K/Q5_K: mins = dmin * min; Q6_K's
 * offset of -32 is a min of 32 * d * scale. Block layouts (little endian, fp16 d/dmin):
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

/* q[k]: weights 64k .. 64k+63; its 128-bit lane L holds group 4k + L of 16 weights. Per activation, the dot
 * takes dpbusd sums of 4 products per int32 lane (|sum| <= 4 * 63 * 127 fits int16) with both planes, packs
 * the two to int16 (packssdw: per 128-bit lane 4 lanes of plane 0, then 4 of plane 1) and scales them with
 * one dpwssd: sc[k] holds the scale of group 4k + L in every int16 lane of 128-bit lane L. */
typedef struct {
    __m512i q[4], sc[4];
    __m512 mins; /* per group of 16 */
    float d;
} kq_blk;

typedef __m512 kq_acc;

/* vpshufb controls for Q4_K/Q5_K's 8 scale bytes (one per 32 weights): group 4k + L takes byte 2k + L/2;
 * the high byte is 0. */
static const uint8_t K4_SCALE_PICK[4][64] __attribute__((aligned(64))) = {
#define K4_LANE(s) s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80, s, 0x80
#define K4_ROW(k) {K4_LANE(2 * k), K4_LANE(2 * k), K4_LANE(2 * k + 1), K4_LANE(2 * k + 1)}
    K4_ROW(0), K4_ROW(1), K4_ROW(2), K4_ROW(3),
#undef K4_ROW
#undef K4_LANE
};

MC_INLINE void k4_scales(const uint8_t *s12, float dm, kq_blk *r) {
    const __m128i v = k4_scale_bytes(s12);
    const __m512i vb = _mm512_broadcast_i32x4(v);
    for (int k = 0; k < 4; ++k) r->sc[k] = _mm512_shuffle_epi8(vb, _mm512_load_si512(K4_SCALE_PICK[k]));
    /* each per-32 min covers two groups of 16 */
    const __m512i m = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(v, v));
    r->mins = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(dm));
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

/* Q6_K scales, one per 16 weights: every int16 lane of 128-bit lane L of sc[k] takes group 4k + L */
static const int16_t K6_SCALE_INDEX[4][32] __attribute__((aligned(64))) = {
#define K6_LANE(g) g, g, g, g, g, g, g, g
#define K6_ROW(k) {K6_LANE(4 * k), K6_LANE(4 * k + 1), K6_LANE(4 * k + 2), K6_LANE(4 * k + 3)}
    K6_ROW(0), K6_ROW(1), K6_ROW(2), K6_ROW(3),
#undef K6_ROW
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
    for (int k = 0; k < 4; ++k)
        r->sc[k] = _mm512_permutexvar_epi16(_mm512_load_si512(K6_SCALE_INDEX[k]), _mm512_castsi256_si512(s16));
    r->d = fp16_to_fp32(blk + 208);
    /* the -32 offset, as a min of 32 * d * scale */
    r->mins = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(s16)), _mm512_set1_ps(32.0f * r->d));
}

/* int32 lanes 0, 1 of each 128-bit lane of the sums are plane 0's, lanes 2, 3 plane 1's: a.d is d0, d0, d1, d1.
 * |each lane| <= 8 * 32767 * 128 fits int32. */
MC_INLINE void kq_dot(const kq_blk *r, act_k_blk a, kq_acc *acc) {
    const __m512i z = _mm512_setzero_si512();
    __m512i s = z;
    for (int k = 0; k < 4; ++k) {
        const __m512i p0 = _mm512_dpbusd_epi32(z, r->q[k], _mm512_load_si512(a.qs[0] + 64 * k));
        const __m512i p1 = _mm512_dpbusd_epi32(z, r->q[k], _mm512_load_si512(a.qs[1] + 64 * k));
        s = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(p0, p1), r->sc[k]);
    }
    const __m512 ad = _mm512_mul_ps(_mm512_set1_ps(r->d), _mm512_broadcast_f32x4(_mm_load_ps(a.d)));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ad, *acc);
    *acc = _mm512_fnmadd_ps(r->mins, _mm512_load_ps(a.sums), *acc);
}

MC_INLINE kq_acc kq_acc_zero(void) { return _mm512_setzero_ps(); }
MC_INLINE float kq_acc_sum(kq_acc acc) { return _mm512_reduce_add_ps(acc); }

#elif MC_SIMD == 1

/* q[k]: weights 32k .. 32k+31; sc[k]: the int16 scale of each of its maddubs lanes */
typedef struct {
    __m256i q[8], sc[8];
    __m256 mins[2]; /* groups 0..7, 8..15 */
    float d;
} kq_blk;

typedef __m256 kq_acc;

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

/* m16: int16 min per group of 16, times dm */
MC_INLINE void kq_set_mins(__m256i m16, float dm, kq_blk *r) {
    const __m256 vdm = _mm256_set1_ps(dm);
    r->mins[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(m16))), vdm);
    r->mins[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(m16, 1))), vdm);
}

MC_INLINE void k4_scales(const uint8_t *s12, float dm, kq_blk *r) {
    const __m128i v = k4_scale_bytes(s12);
    /* each per-32 value covers two groups of 16 */
    kq_spread_scales(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)), r);
    kq_set_mins(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v)), dm, r);
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
    r->d = fp16_to_fp32(blk + 208);
    kq_set_mins(s16, 32.0f * r->d, r); /* the -32 offset, as a min of 32 * d * scale */
}

MC_INLINE __m256i kq_isum(const kq_blk *r, const int8_t *qs) {
    __m256i s = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
        const __m256i p = _mm256_maddubs_epi16(r->q[k], _mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, r->sc[k]));
    }
    return s;
}

MC_INLINE void kq_dot(const kq_blk *r, act_k_blk a, kq_acc *acc) {
    for (int p = 0; p < ACT_PLANES; ++p)
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_isum(r, a.qs[p])), _mm256_set1_ps(r->d * a.d[2 * p]), *acc);
    *acc = _mm256_fnmadd_ps(r->mins[0], _mm256_load_ps(a.sums), *acc);
    *acc = _mm256_fnmadd_ps(r->mins[1], _mm256_load_ps(a.sums + 8), *acc);
}

MC_INLINE kq_acc kq_acc_zero(void) { return _mm256_setzero_ps(); }
MC_INLINE float kq_acc_sum(kq_acc acc) { return hsum256_ps(acc); }

#else

typedef struct {
    uint8_t q[QK_K];
    int16_t s16[16];
    float mins[16];
    float d;
} kq_blk;

typedef float kq_acc;

MC_INLINE void k4_scales(const uint8_t *s12, float dm, kq_blk *r) {
    uint32_t u[4];
    uint8_t b[16];
    k4_scale_words(s12, u);
    memcpy(b, u, 16);
    for (int j = 0; j < 16; ++j) {
        r->s16[j] = b[j / 2];
        r->mins[j] = (float)b[8 + j / 2] * dm;
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
    r->d = fp16_to_fp32(blk + 208);
    for (int j = 0; j < 16; ++j) {
        r->s16[j] = (int8_t)blk[192 + j];
        r->mins[j] = (float)r->s16[j] * (32.0f * r->d); /* the -32 offset, as a min of 32 * d * scale */
    }
}

MC_INLINE int32_t kq_isum(const kq_blk *r, const int8_t *qs) {
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) {
        int32_t s = 0;
        for (int l = 0; l < 16; ++l) s += r->q[16 * j + l] * qs[16 * j + l];
        isum += r->s16[j] * s;
    }
    return isum;
}

MC_INLINE void kq_dot(const kq_blk *r, act_k_blk a, kq_acc *acc) {
    for (int p = 0; p < ACT_PLANES; ++p) *acc += r->d * a.d[2 * p] * (float)kq_isum(r, a.qs[p]);
    for (int j = 0; j < 16; ++j) *acc -= r->mins[j] * a.sums[j];
}

MC_INLINE kq_acc kq_acc_zero(void) { return 0.0f; }
MC_INLINE float kq_acc_sum(kq_acc acc) { return acc; }

#endif

#if !MC_SIMD
MC_INLINE void k4_d_dmin(const uint8_t *blk, float *d, float *dm) {
    *d = fp16_to_fp32(blk);
    *dm = fp16_to_fp32(blk + 2);
}
#endif

MC_INLINE void decode_q4k(const uint8_t *blk, kq_blk *r) {
    float dm;
    k4_d_dmin(blk, &r->d, &dm);
    k4_scales(blk + 4, dm, r);
    k4_nibbles(blk + 16, r);
}

MC_INLINE void decode_q5k(const uint8_t *blk, kq_blk *r) {
    float dm;
    k4_d_dmin(blk, &r->d, &dm);
    k4_scales(blk + 4, dm, r);
    k4_nibbles(blk + 48, r);
    k5_high_bits(blk + 16, r);
}

/* ---- rows ---- */

typedef void (*kq_decode_fn)(const uint8_t *blk, kq_blk *r);

/* Each super-block is decoded once and used for both planes of all nt activation rows; nm and nt are constants
 * where the caller passes them, so the accumulators stay in registers. */
MC_INLINE void kq_rows(const rows_job *j, int64_t n, const int nm, const int nt, kq_decode_fn decode,
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
                for (int i = 0; i < nt; ++i) kq_dot(&blk, act_k_block(j->acts[m][i], n, b), &acc[m][i]);
            }
        for (int m = 0; m < nm; ++m)
            for (int i = 0; i < nt; ++i) j->out[m][i * j->out_stride + r] = kq_acc_sum(acc[m][i]);
    }
}

/* one instance per common (nm, nt): batch 1 and 2 */
#define KQ_ROWS_FN(name, decode, block_bytes)                                     \
    static void name(const rows_job *j, int64_t n) {                              \
        if (j->nm == 1 && j->nt == 1)                                             \
            kq_rows(j, n, 1, 1, decode, block_bytes);                             \
        else if (j->nm == 2 && j->nt == 1)                                        \
            kq_rows(j, n, 2, 1, decode, block_bytes);                             \
        else if (j->nm == 1 && j->nt == 2)                                        \
            kq_rows(j, n, 1, 2, decode, block_bytes);                             \
        else if (j->nm == 2 && j->nt == 2)                                        \
            kq_rows(j, n, 2, 2, decode, block_bytes);                             \
        else                                                                      \
            kq_rows(j, n, j->nm, j->nt, decode, block_bytes);                     \
    }

KQ_ROWS_FN(dot_q4k_rows, decode_q4k, 144)
KQ_ROWS_FN(dot_q5k_rows, decode_q5k, 176)
KQ_ROWS_FN(dot_q6k_rows, decode_q6k, 210)

#endif
