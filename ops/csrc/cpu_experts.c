/* Routed-expert FFN of one MoE layer on the CPU, straight from raw GGUF bytes.
 *
 *   out[t] = sum over pairs p with token[p] == t of weight[p] * down_e(silu(gate_e(x_t)) * up_e(x_t))
 *
 * One call per layer. Pairs are grouped by expert; every weight row is read once per call and used
 * for all pairs of its expert (TILE_TOKENS at a time). Weight blocks are decoded in registers inside
 * the dot products, never into a dequantized matrix. Activations are quantized once per call to the
 * int8 form the weight format multiplies with, in two planes: the second quantizes what rounding the
 * first lost, so x = d1*q1 + d2*q2 to 1/(4*127^2) of each block's largest |x| and the integer dot
 * products give float32-level results. (One int8 plane is 1/254 of the block maximum: 0.5-2% error per
 * layer, enough to flip a later router's top-k and move a token's log-probability by tenths of a nat
 * against a float reference, or against the same model with its experts computed elsewhere.) OpenMP
 * threads split the output rows; every output
 * element is summed by one thread in a fixed order, so results do not depend on the thread count.
 * Threads wait for work to be done, not for each other: on a busy host a thread that starts late
 * finds its share taken instead of holding up a barrier.
 */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <sched.h>
#include <stdlib.h>

#include "common.h"
#include "kquants.h"
#include "simple.h"

/* Rows of one expert matrix per work item. */
#define ROW_CHUNK 32
/* Tokens that share a pass over a weight row: each brings up to two activation planes to the dot. */
#define TILE_TOKENS (MAX_TILE / 2)
/* Below this many activations, x is quantized by the calling thread alone. */
#define SERIAL_QUANT_MAX 65536

enum {
    MOE_OK = 0,
    MOE_EBADTYPE = -1,
    MOE_EBADSHAPE = -2,
    MOE_EBADTOKEN = -3,
    MOE_EBADEXPERT = -4,
    MOE_ENOMEM = -5,
};

/* ---- activation formats ---- */

/* Quantizes a row of n activations into `planes` consecutive planes of blocks. */
typedef void (*quant_fn)(const float *x, uint8_t *y, int64_t n);

typedef struct {
    int block;
    int bytes;
    int planes;
    quant_fn quant;
} act_fmt;

/* q = round(x * 127 / max|x|), half to even; returns the scale d with x ~= d * q and, when residual
 * is not NULL, writes what the rounding lost: residual = x - d * q. */
static float quant_int8(const float *x, int8_t *q, int n, float *residual) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    for (int i = 0; i < n; ++i) q[i] = (int8_t)fmaxf(-127.0f, fminf(127.0f, nearbyintf(x[i] * id)));
    if (residual)
        for (int i = 0; i < n; ++i) residual[i] = x[i] - d * (float)q[i];
    return d;
}

static void quant_q8k_block(const float *x, act_q8k *y, float *residual) {
    y->d = quant_int8(x, y->qs, QK_K, residual);
    for (int j = 0; j < QK_K / 16; ++j) {
        int s = 0;
        for (int l = 0; l < 16; ++l) s += y->qs[16 * j + l];
        y->bsums[j] = (int16_t)s;
    }
}

/* Plane 0 (blocks 0 .. nb-1) rounds x, plane 1 (blocks nb .. 2nb-1) rounds what plane 0 lost. */
static void quant_q8k(const float *x, uint8_t *y, int64_t n) {
    act_q8k *hi = (act_q8k *)y, *lo = hi + n / QK_K;
    float residual[QK_K];
    for (int64_t b = 0; b < n / QK_K; ++b) {
        quant_q8k_block(x + b * QK_K, hi + b, residual);
        quant_q8k_block(residual, lo + b, NULL);
    }
}

static void quant_q8_0(const float *x, uint8_t *y, int64_t n) {
    act_q8_0 *hi = (act_q8_0 *)y, *lo = hi + n / QK8_0;
    float residual[QK8_0];
    for (int64_t b = 0; b < n / QK8_0; ++b) {
        hi[b].d = quant_int8(x + b * QK8_0, hi[b].qs, QK8_0, residual);
        lo[b].d = quant_int8(residual, lo[b].qs, QK8_0, NULL);
    }
}

static void quant_f32(const float *x, uint8_t *y, int64_t n) { memcpy(y, x, (size_t)n * sizeof(float)); }

static const act_fmt ACT_Q8K = {QK_K, (int)sizeof(act_q8k), 2, quant_q8k};
static const act_fmt ACT_Q8_0 = {QK8_0, (int)sizeof(act_q8_0), 2, quant_q8_0};
static const act_fmt ACT_F32 = {1, (int)sizeof(float), 1, quant_f32};

/* ---- weight formats, by ggml type id ---- */

typedef struct {
    int type;
    int block;
    int bytes;
    const act_fmt *act;
    dot_tile_fn dot;
} weight_fmt;

static const weight_fmt FORMATS[] = {
    {0, 1, 4, &ACT_F32, dot_f32_tile},       {1, 1, 2, &ACT_F32, dot_f16_tile},
    {30, 1, 2, &ACT_F32, dot_bf16_tile},     {8, QK8_0, 34, &ACT_Q8_0, dot_q8_0_tile},
    {12, QK_K, 144, &ACT_Q8K, dot_q4k_tile}, {13, QK_K, 176, &ACT_Q8K, dot_q5k_tile},
    {14, QK_K, 210, &ACT_Q8K, dot_q6k_tile},
};

static const weight_fmt *find_format(int type) {
    for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); ++i)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

int moe_supports_type(int type) { return find_format(type) != NULL; }

/* 2: AVX-512 VNNI, 1: AVX2, 0: portable C */
int moe_simd_level(void) { return MC_SIMD; }

/* ---- operands ---- */

typedef struct { /* one layer's experts: [num_experts, rows, cols] */
    const weight_fmt *f;
    const uint8_t *data;
    int64_t rows, cols, row_bytes;
} expert_mat;

typedef struct { /* quantized activation rows, each `f->planes` planes of plane_bytes */
    const act_fmt *f;
    uint8_t *data;
    int64_t row_bytes, plane_bytes;
} act_rows;

typedef struct { /* pairs grouped by expert, ascending; stable within a group */
    int64_t num_groups;
    int64_t *expert, *start, *count; /* [num_groups] */
    int64_t *chunks_left;            /* [num_groups] gate/up row chunks not yet done */
    int64_t *groups_ready;           /* groups whose h rows are quantized */
    int64_t *order;                  /* [num_pairs] pair ids, grouped */
} routing;

static int make_mat(expert_mat *m, int type, const uint8_t *data, int64_t rows, int64_t cols) {
    m->f = find_format(type);
    if (!m->f) return MOE_EBADTYPE;
    if (cols <= 0 || rows <= 0 || cols % m->f->block) return MOE_EBADSHAPE;
    m->data = data;
    m->rows = rows;
    m->cols = cols;
    m->row_bytes = cols / m->f->block * m->f->bytes;
    return MOE_OK;
}

MC_INLINE const uint8_t *mat_row(const expert_mat *m, int64_t expert, int64_t row) {
    return m->data + (expert * m->rows + row) * m->row_bytes;
}

static int make_acts(act_rows *a, const act_fmt *f, int64_t num_rows, int64_t cols) {
    a->f = f;
    a->plane_bytes = cols / f->block * f->bytes;
    a->row_bytes = f->planes * a->plane_bytes;
    a->data = malloc((size_t)(num_rows > 0 ? num_rows : 1) * (size_t)a->row_bytes);
    return a->data ? MOE_OK : MOE_ENOMEM;
}

static int check_ids(const int64_t *ids, int64_t n, int64_t limit) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= limit) return 0;
    return 1;
}

/* Counting sort of the pairs by expert; group_of is scratch [num_experts]. */
static void group_pairs(routing *r, const int64_t *expert_ids, int64_t num_pairs, int64_t num_experts,
                        int64_t *group_of) {
    memset(group_of, 0, (size_t)num_experts * sizeof(int64_t));
    for (int64_t p = 0; p < num_pairs; ++p) group_of[expert_ids[p]]++;
    int64_t g = 0, pos = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (!group_of[e]) continue;
        r->expert[g] = e, r->start[g] = pos, r->count[g] = 0;
        pos += group_of[e];
        group_of[e] = g++;
    }
    r->num_groups = g;
    for (int64_t p = 0; p < num_pairs; ++p) {
        const int64_t grp = group_of[expert_ids[p]];
        r->order[r->start[grp] + r->count[grp]++] = p;
    }
}

static int make_routing(routing *r, const int64_t *expert_ids, int64_t num_pairs, int64_t num_experts) {
    /* expert, start, count, chunks_left: [num_experts] each (the upper bound on groups);
     * order: [num_pairs]; groups_ready; then [num_experts] of scratch */
    int64_t *buf = malloc((size_t)(5 * num_experts + num_pairs + 1) * sizeof(int64_t));
    if (!buf) return MOE_ENOMEM;
    r->expert = buf, r->start = buf + num_experts, r->count = buf + 2 * num_experts;
    r->chunks_left = buf + 3 * num_experts, r->order = buf + 4 * num_experts;
    r->groups_ready = r->order + num_pairs;
    group_pairs(r, expert_ids, num_pairs, num_experts, r->groups_ready + 1);
    return MOE_OK;
}

/* ---- the stages; gate_up and down are orphaned `omp for nowait` run by one team ---- */

MC_INLINE float silu(float v) { return v / (1.0f + expf(-v)); }

typedef struct {
    const expert_mat *gate, *up, *down;
    const act_rows *xg, *xu, *hq; /* x for gate, x for up, h for down */
    const routing *r;
    const int64_t *token_ids;
    const float *weights;
    float *h;   /* [num_pairs, ff] */
    float *out; /* [num_tokens, hidden] */
} ffn_job;

/* Pointers to the activation planes of the group's pairs t0 .. t0+nt-1: plane k of pair i at k*nt + i. */
MC_INLINE void tile_acts(const ffn_job *j, const act_rows *a, int64_t grp, int64_t t0, int nt, int by_token,
                         const uint8_t **ptrs) {
    for (int i = 0; i < nt; ++i) {
        const int64_t p = j->r->order[j->r->start[grp] + t0 + i];
        const uint8_t *row = a->data + (by_token ? j->token_ids[p] : p) * a->row_bytes;
        for (int k = 0; k < a->f->planes; ++k) ptrs[k * nt + i] = row + k * a->plane_bytes;
    }
}

/* y[i] = dot(weight row w, activation row of pair i), its planes summed in plane order. */
MC_INLINE void tile_dot(const expert_mat *m, const act_rows *a, const uint8_t *w, const uint8_t *const *ptrs,
                        int nt, float *y) {
    float part[MAX_TILE];
    m->f->dot(w, ptrs, a->f->planes * nt, m->cols, part);
    for (int i = 0; i < nt; ++i) y[i] = a->f->planes == 2 ? part[i] + part[nt + i] : part[i];
}

static void gate_up_rows(const ffn_job *j, int64_t grp, int64_t r0, int64_t r1) {
    const int64_t e = j->r->expert[grp], n = j->r->count[grp], ff = j->gate->rows;
    const int64_t *pairs = j->r->order + j->r->start[grp];
    for (int64_t row = r0; row < r1; ++row) {
        const uint8_t *wg = mat_row(j->gate, e, row), *wu = mat_row(j->up, e, row);
        for (int64_t t0 = 0; t0 < n; t0 += TILE_TOKENS) {
            const int nt = (int)(n - t0 < TILE_TOKENS ? n - t0 : TILE_TOKENS);
            const uint8_t *ag[MAX_TILE], *au[MAX_TILE];
            float g[TILE_TOKENS], u[TILE_TOKENS];
            tile_acts(j, j->xg, grp, t0, nt, 1, ag);
            tile_acts(j, j->xu, grp, t0, nt, 1, au);
            tile_dot(j->gate, j->xg, wg, ag, nt, g);
            tile_dot(j->up, j->xu, wu, au, nt, u);
            for (int i = 0; i < nt; ++i) j->h[pairs[t0 + i] * ff + row] = silu(g[i]) * u[i];
        }
    }
}

static void quantize_x(const ffn_job *j, const float *x, int64_t num_tokens, int num_threads) {
    const int64_t hidden = j->gate->cols;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_tokens * hidden > SERIAL_QUANT_MAX)
    for (int64_t t = 0; t < num_tokens; ++t) {
        j->xg->f->quant(x + t * hidden, j->xg->data + t * j->xg->row_bytes, hidden);
        if (j->xu != j->xg) j->xu->f->quant(x + t * hidden, j->xu->data + t * j->xu->row_bytes, hidden);
    }
}

/* The thread that completes a group's last row chunk quantizes the group's h rows for the down
 * projection, then counts the group ready. */
static void finish_chunk(const ffn_job *j, int64_t grp) {
    int64_t left;
#pragma omp atomic capture seq_cst
    left = --j->r->chunks_left[grp];
    if (left) return;
    const int64_t ff = j->gate->rows, *pairs = j->r->order + j->r->start[grp];
    for (int64_t i = 0; i < j->r->count[grp]; ++i)
        j->hq->f->quant(j->h + pairs[i] * ff, j->hq->data + pairs[i] * j->hq->row_bytes, ff);
#pragma omp atomic update seq_cst
    ++*j->r->groups_ready;
}

/* Yield while gate/up items other threads hold are still running (they may need this core). */
static void wait_groups_ready(const ffn_job *j) {
    for (;;) {
        int64_t ready;
#pragma omp atomic read seq_cst
        ready = *j->r->groups_ready;
        if (ready == j->r->num_groups) return;
        sched_yield();
    }
}

static void gate_up(const ffn_job *j) {
    const int64_t ff = j->gate->rows, chunks = (ff + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < j->r->num_groups * chunks; ++item) {
        const int64_t r0 = item % chunks * ROW_CHUNK;
        gate_up_rows(j, item / chunks, r0, r0 + ROW_CHUNK < ff ? r0 + ROW_CHUNK : ff);
        finish_chunk(j, item / chunks);
    }
}

static void down_rows(const ffn_job *j, int64_t grp, int64_t r0, int64_t r1) {
    const int64_t e = j->r->expert[grp], n = j->r->count[grp], hidden = j->down->rows;
    const int64_t *pairs = j->r->order + j->r->start[grp];
    for (int64_t row = r0; row < r1; ++row) {
        const uint8_t *w = mat_row(j->down, e, row);
        for (int64_t t0 = 0; t0 < n; t0 += TILE_TOKENS) {
            const int nt = (int)(n - t0 < TILE_TOKENS ? n - t0 : TILE_TOKENS);
            const uint8_t *a[MAX_TILE];
            float y[TILE_TOKENS];
            tile_acts(j, j->hq, grp, t0, nt, 0, a);
            tile_dot(j->down, j->hq, w, a, nt, y);
            for (int i = 0; i < nt; ++i) {
                const int64_t p = pairs[t0 + i];
                j->out[j->token_ids[p] * hidden + row] += j->weights[p] * y[i];
            }
        }
    }
}

/* Split by output rows: each thread owns its rows of out for every token. */
static void down(const ffn_job *j) {
    const int64_t hidden = j->down->rows, chunks = (hidden + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < hidden ? r0 + ROW_CHUNK : hidden;
        for (int64_t grp = 0; grp < j->r->num_groups; ++grp) down_rows(j, grp, r0, r1);
    }
}

static void run_team(const ffn_job *j, const float *x, int64_t num_tokens, int num_threads) {
    const int64_t chunks = (j->gate->rows + ROW_CHUNK - 1) / ROW_CHUNK;
    for (int64_t g = 0; g < j->r->num_groups; ++g) j->r->chunks_left[g] = chunks;
    *j->r->groups_ready = 0;
    quantize_x(j, x, num_tokens, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        gate_up(j);
        wait_groups_ready(j);
        down(j);
    }
}

/* ---- entry point ---- */

typedef struct {
    act_rows xg, xu, hq;
    float *h;
    routing r;
} scratch;

static void free_scratch(scratch *s) {
    free(s->xg.data);
    free(s->xu.data);
    free(s->hq.data);
    free(s->h);
    free(s->r.expert);
}

static int alloc_scratch(scratch *s, const expert_mat *gate, const expert_mat *up, const expert_mat *down,
                         int64_t num_tokens, int64_t num_pairs) {
    memset(s, 0, sizeof(*s));
    int err = make_acts(&s->xg, gate->f->act, num_tokens, gate->cols);
    if (!err && up->f->act != gate->f->act) err = make_acts(&s->xu, up->f->act, num_tokens, up->cols);
    if (!err) err = make_acts(&s->hq, down->f->act, num_pairs, down->cols);
    s->h = malloc((size_t)(num_pairs > 0 ? num_pairs : 1) * (size_t)gate->rows * sizeof(float));
    return err ? err : s->h ? MOE_OK : MOE_ENOMEM;
}

/* x: float32 [num_tokens, hidden]; token_ids, expert_ids, weights: [num_pairs];
 * gate, up: [num_experts, ff, row bytes of hidden]; down: [num_experts, hidden, row bytes of ff];
 * out: float32 [num_tokens, hidden], zeroed by the caller; num_threads <= 0: OpenMP default. */
int moe_expert_ffn(const float *x, int64_t num_tokens, const int64_t *token_ids, const int64_t *expert_ids,
                   const float *weights, int64_t num_pairs, const uint8_t *gate, const uint8_t *up,
                   const uint8_t *down, int gate_type, int up_type, int down_type, int64_t num_experts,
                   int64_t hidden, int64_t ff, float *out, int num_threads) {
    expert_mat g, u, d;
    int err = make_mat(&g, gate_type, gate, ff, hidden);
    if (!err) err = make_mat(&u, up_type, up, ff, hidden);
    if (!err) err = make_mat(&d, down_type, down, hidden, ff);
    if (err) return err;
    if (!check_ids(token_ids, num_pairs, num_tokens)) return MOE_EBADTOKEN;
    if (!check_ids(expert_ids, num_pairs, num_experts)) return MOE_EBADEXPERT;
    scratch s;
    err = alloc_scratch(&s, &g, &u, &d, num_tokens, num_pairs);
    if (!err) err = make_routing(&s.r, expert_ids, num_pairs, num_experts);
    if (!err) {
        const ffn_job job = {&g, &u, &d, &s.xg, s.xu.data ? &s.xu : &s.xg, &s.hq, &s.r, token_ids, weights,
                             s.h, out};
        run_team(&job, x, num_tokens, num_threads > 0 ? num_threads : omp_get_max_threads());
    }
    free_scratch(&s);
    return err;
}
