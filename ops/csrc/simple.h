/* Q8_0, Q4_0 and MXFP4 rows times two-plane int8 activation rows (act_q8_0 of quant.h), and F32/F16/BF16 rows times
 * float rows. The int8 formats are 32 integer codes q and one scale d per block, w = d * q, so they share one dot:
 *   Q8_0  34 B per 32 weights: fp16 d, int8 qs[32].
 *   Q4_0  18 B per 32 weights: fp16 d, qs[16] (byte l: weight l in the low nibble, l + 16 in the high one);
 *         q = the nibble - 8 (Q4_0_VALUES).
 *   MXFP4 17 B per 32 weights: e8m0 e, qs[16] as Q4_0's; q = the e2m1 value of the nibble doubled (an integer,
 *         |q| <= 12, MXFP4_VALUES), d = 2^(e - 128).
 * The two nibble formats (nib_* below) differ only in the scale byte(s) and the table a nibble is looked up in.
 */
#ifndef MOECACHE_SIMPLE_H
#define MOECACHE_SIMPLE_H

#include "quant.h"

enum { I8_Q8_0, I8_MXFP4, I8_Q4_0 }; /* the int8-code block formats */

/* e2m1 values doubled, by nibble (ggml's kvalues_mxfp4) */
static const int8_t MXFP4_VALUES[16] __attribute__((aligned(16))) = {0, 1, 2, 3, 4, 6, 8, 12,
                                                                     0, -1, -2, -3, -4, -6, -8, -12};
/* nibble - 8 */
static const int8_t Q4_0_VALUES[16] __attribute__((aligned(16))) = {-8, -7, -6, -5, -4, -3, -2, -1,
                                                                    0,  1,  2,  3,  4,  5,  6,  7};

/* e8m0 byte -> 2^(e - 128), subnormal below e = 2 (ggml_e8m0_to_fp32_half) */
MC_INLINE float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A nibble block: its bytes (the 16 bytes of nibbles last), its scale, its code table. */
MC_INLINE int64_t nib_bytes(int kind) { return kind == I8_Q4_0 ? 18 : 17; }
MC_INLINE float nib_d(const uint8_t *blk, int kind) { return kind == I8_Q4_0 ? fp16_to_fp32(blk) : e8m0_half(blk[0]); }
MC_INLINE const int8_t *nib_values(int kind) { return kind == I8_Q4_0 ? Q4_0_VALUES : MXFP4_VALUES; }

#if MC_SIMD == 2

typedef __m512 q8_acc;

/* Two blocks b, b+1 in one vector: |q| times a with q's sign, so dpbusd stays exact. */
typedef struct {
    __m512i uq;    /* |q| of both blocks */
    __mmask64 neg; /* where q < 0 */
    __m512 dw;     /* d of block b in lanes 0..7, of block b+1 in 8..15: the dpbusd lanes' blocks */
} q8_pair;

MC_INLINE void q8_decode_pair(const uint8_t *blk, q8_pair *p) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2))),
                                         _mm256_loadu_si256((const __m256i *)(blk + 36)), 1);
    uint16_t h0, h1;
    memcpy(&h0, blk, 2);
    memcpy(&h1, blk + 34, 2);
    p->uq = _mm512_abs_epi8(q);
    p->neg = _mm512_movepi8_mask(q);
    const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)h0 | (uint32_t)h1 << 16)));
    p->dw = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                  _mm512_castps128_ps512(dw));
}

/* the last block of an odd count, in the lower half */
MC_INLINE void q8_decode_one(const uint8_t *blk, q8_pair *p) {
    const __m512i q = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2)));
    p->uq = _mm512_maskz_abs_epi8(0xffffffffull, q);
    p->neg = _mm512_movepi8_mask(q) & 0xffffffffull;
    p->dw = _mm512_maskz_mov_ps(0x00ff, _mm512_set1_ps(fp16_to_fp32(blk)));
}

/* Nibble blocks b, b+1 (where !two, b alone: zeros above) in q8_pair form: the nibbles in weight order, looked
 * up as |value|, the mask where the value is negative (MXFP4: bit 3 set; Q4_0: clear). */
MC_INLINE void nib_decode_pair(const uint8_t *blk, int two, int kind, q8_pair *p) {
    const int64_t bytes = nib_bytes(kind), qs = bytes - 16;
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + qs)));
    const __m256i hi = two ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + bytes + qs)))
                           : _mm256_setzero_si256();
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m512i idx = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                         _mm512_set1_epi8(0x0f));
    const __m512i mags = _mm512_abs_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)nib_values(kind))));
    p->uq = _mm512_shuffle_epi8(mags, idx);
    p->neg = kind == I8_Q4_0 ? _mm512_testn_epi8_mask(idx, _mm512_set1_epi8(8))
                             : _mm512_test_epi8_mask(idx, _mm512_set1_epi8(8));
    p->dw = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(nib_d(blk, kind)),
                                 _mm512_set1_ps(two ? nib_d(blk + bytes, kind) : 0.0f));
}

/* 64 (or, where !two, 32) activations with the sign of the weights they meet */
MC_INLINE __m512i q8_signed(const q8_pair *p, const uint8_t *a, int two) {
    const __m512i va = two ? _mm512_loadu_si512(a) : _mm512_maskz_loadu_epi8(0xffffffffull, a);
    return _mm512_mask_sub_epi8(va, p->neg, _mm512_setzero_si512(), va);
}

/* Blocks b, b+1 (b + 1 past the row: 0 in uq and dw) of both planes of activation row a: their dpbusd sums
 * t0, t1 (|t| <= 4 * 128 * 127 per lane) make one integer t = 2^PLANE_BITS * t0 + t1 < 2^24, exact in float,
 * scaled by the activation block's d and the weights'. */
MC_INLINE void q8_dot_pair(const q8_pair *p, const uint8_t *a, int64_t n, int64_t b, int two, q8_acc *acc) {
    const uint8_t *a0 = a + QK8_0 * b, *a1 = a0 + n;
    const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p->uq, q8_signed(p, a0, two));
    const __m512i t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t0, PLANE_BITS), p->uq, q8_signed(p, a1, two));
    const float ad = act_q8_0_d(a, n)[b * QK8_0 / QA8];
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(ad)), p->dw, *acc);
}

/* blocks b (even) and, where `two`, b+1 of row w for nt activation rows */
MC_INLINE void q8_step(const uint8_t *w, int64_t b, int two, const uint8_t *const *acts, int nt, int64_t n,
                       int kind, q8_acc *acc) {
    q8_pair p;
    if (kind != I8_Q8_0)
        nib_decode_pair(w + nib_bytes(kind) * b, two, kind, &p);
    else if (two)
        q8_decode_pair(w + 34 * b, &p);
    else
        q8_decode_one(w + 34 * b, &p);
    for (int i = 0; i < nt; ++i) q8_dot_pair(&p, acts[i], n, b, two, &acc[i]);
}

MC_INLINE q8_acc q8_acc_zero(void) { return _mm512_setzero_ps(); }
MC_INLINE float q8_acc_sum(q8_acc acc) { return _mm512_reduce_add_ps(acc); }

#elif MC_SIMD == 1

typedef __m256 q8_acc;

/* sum of q . a over 32 int8 pairs, as 8 int32 lanes; |q| <= 128 and |a| <= 127 keep maddubs exact */
MC_INLINE __m256i q8_dot32(__m256i q, __m256i a) {
    const __m256i uq = _mm256_abs_epi8(q), sa = _mm256_sign_epi8(a, q);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(uq, sa), _mm256_set1_epi16(1));
}

/* block k's 32 codes and scale */
MC_INLINE __m256i i8_block(const uint8_t *w, int64_t k, int kind, float *d) {
    if (kind == I8_Q8_0) {
        *d = fp16_to_fp32(w + 34 * k);
        return _mm256_loadu_si256((const __m256i *)(w + 34 * k + 2));
    }
    const uint8_t *blk = w + nib_bytes(kind) * k;
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + nib_bytes(kind) - 16)), m4 = _mm_set1_epi8(0x0f);
    const __m256i idx = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(raw, m4)),
                                                _mm_and_si128(_mm_srli_epi16(raw, 4), m4), 1);
    *d = nib_d(blk, kind);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)nib_values(kind))), idx);
}

MC_INLINE void q8_step(const uint8_t *w, int64_t b, int two, const uint8_t *const *acts, int nt, int64_t n,
                       int kind, q8_acc *acc) {
    for (int64_t k = b; k < b + 1 + two; ++k) {
        float d;
        const __m256i q = i8_block(w, k, kind, &d);
        for (int i = 0; i < nt; ++i) {
            const uint8_t *a = acts[i] + QK8_0 * k;
            const __m256i t0 = q8_dot32(q, _mm256_loadu_si256((const __m256i *)a));
            const __m256i t1 = q8_dot32(q, _mm256_loadu_si256((const __m256i *)(a + n)));
            const __m256i t = _mm256_add_epi32(_mm256_slli_epi32(t0, PLANE_BITS), t1);
            const float ad = act_q8_0_d(acts[i], n)[k * QK8_0 / QA8];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * ad), acc[i]);
        }
    }
}

MC_INLINE q8_acc q8_acc_zero(void) { return _mm256_setzero_ps(); }
MC_INLINE float q8_acc_sum(q8_acc acc) { return hsum256_ps(acc); }

#else

typedef float q8_acc;

/* block k's 32 codes (in buf where they are decoded) and scale */
MC_INLINE const int8_t *i8_block(const uint8_t *w, int64_t k, int kind, int8_t buf[QK8_0], float *d) {
    if (kind == I8_Q8_0) {
        *d = fp16_to_fp32(w + 34 * k);
        /* read through an int8_t pointer: GCC 12 -O3 vectorizes `(int8_t)u8 * s8` as unsigned */
        return (const int8_t *)(w + 34 * k + 2);
    }
    const uint8_t *blk = w + nib_bytes(kind) * k, *qs = blk + nib_bytes(kind) - 16;
    const int8_t *values = nib_values(kind);
    for (int l = 0; l < QK8_0 / 2; ++l) buf[l] = values[qs[l] & 0x0f], buf[l + QK8_0 / 2] = values[qs[l] >> 4];
    *d = nib_d(blk, kind);
    return buf;
}

MC_INLINE void q8_step(const uint8_t *w, int64_t b, int two, const uint8_t *const *acts, int nt, int64_t n,
                       int kind, q8_acc *acc) {
    for (int64_t k = b; k < b + 1 + two; ++k) {
        int8_t buf[QK8_0];
        float d;
        const int8_t *q = i8_block(w, k, kind, buf, &d);
        for (int i = 0; i < nt; ++i) {
            const int8_t *a = (const int8_t *)acts[i] + QK8_0 * k;
            int32_t t0 = 0, t1 = 0;
            for (int l = 0; l < QK8_0; ++l) t0 += q[l] * a[l], t1 += q[l] * a[n + l];
            acc[i] += d * act_q8_0_d(acts[i], n)[k * QK8_0 / QA8] * (float)(t0 * (1 << PLANE_BITS) + t1);
        }
    }
}

MC_INLINE q8_acc q8_acc_zero(void) { return 0.0f; }
MC_INLINE float q8_acc_sum(q8_acc acc) { return acc; }

#endif

/* Each pair of blocks is decoded once and used for all nt activation rows; the matrices' blocks alternate. */
MC_INLINE void q8_rows(const rows_job *j, int64_t n, const int nm, const int nt, const int kind) {
    const int64_t pf = prefetch_rows(j->w[0].row_bytes), nb = n / QK8_0;
    for (int64_t r = 0; r < j->num_rows; ++r) {
        for (int m = 0; m < nm; ++m) prefetch_row(j->w[m], j->next[m], r + pf);
        q8_acc acc[MAX_MATS][MAX_TILE];
        for (int m = 0; m < nm; ++m)
            for (int i = 0; i < nt; ++i) acc[m][i] = q8_acc_zero();
        for (int64_t b = 0; b < nb; b += 2)
            for (int m = 0; m < nm; ++m)
                q8_step(j->w[m].w + r * j->w[m].row_bytes, b, b + 1 < nb, j->acts[m], nt, n, kind, acc[m]);
        for (int m = 0; m < nm; ++m)
            for (int i = 0; i < nt; ++i) j->out[m][i * j->out_stride + r] = q8_acc_sum(acc[m][i]);
    }
}

/* one instance per common (nm, nt): batch 1 and 2 */
#define I8_ROWS_FN(name, kind)                        \
    static void name(const rows_job *j, int64_t n) {  \
        if (j->nm == 1 && j->nt == 1)                 \
            q8_rows(j, n, 1, 1, kind);                \
        else if (j->nm == 2 && j->nt == 1)            \
            q8_rows(j, n, 2, 1, kind);                \
        else if (j->nm == 1 && j->nt == 2)            \
            q8_rows(j, n, 1, 2, kind);                \
        else if (j->nm == 2 && j->nt == 2)            \
            q8_rows(j, n, 2, 2, kind);                \
        else                                          \
            q8_rows(j, n, j->nm, j->nt, kind);        \
    }

I8_ROWS_FN(dot_q8_0_rows, I8_Q8_0)
I8_ROWS_FN(dot_mxfp4_rows, I8_MXFP4)
I8_ROWS_FN(dot_q4_0_rows, I8_Q4_0)

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

MC_INLINE void float_rows(const rows_job *j, int64_t n, int kind) {
    for (int m = 0; m < j->nm; ++m)
        for (int64_t r = 0; r < j->num_rows; ++r) {
            const uint8_t *w = j->w[m].w + r * j->w[m].row_bytes;
            const uint8_t *const *acts = j->acts[m];
            float y[MAX_TILE];
            for (int64_t c = float_tile_simd(w, acts, j->nt, n, y, kind); c < n; ++c) {
                const float wc = float_at(w, c, kind);
                for (int i = 0; i < j->nt; ++i) y[i] += wc * ((const float *)acts[i])[c];
            }
            for (int i = 0; i < j->nt; ++i) j->out[m][i * j->out_stride + r] = y[i];
        }
}

static void dot_f32_rows(const rows_job *j, int64_t n) { float_rows(j, n, FLOAT_F32); }
static void dot_f16_rows(const rows_job *j, int64_t n) { float_rows(j, n, FLOAT_F16); }
static void dot_bf16_rows(const rows_job *j, int64_t n) { float_rows(j, n, FLOAT_BF16); }

#endif
