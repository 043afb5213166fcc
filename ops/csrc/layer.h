/* One MoE layer call as one pool job of numbered items, claimed in order:
 *   x items        quantize the rows of tokens that have pairs, to the form the gate/up weights take
 *   gate/up items  (group, rows): h = act(gate x + b_gate, up x + b_up) for the group's pairs (moe_math); the
 *                  item that finishes a group's last rows quantizes the group's h rows for the down projection
 *   down items     (rows): those rows of out for every token, weight * (down h + b_down) summed over groups in
 *                  expert order
 * An item waits only for what it reads (every x row; its group's h), never for all threads. Items read
 * up to ITEM_BYTES of weights, fewer where that leaves each thread ITEMS_PER_THREAD items: long streams
 * from DRAM, and balance across threads. The weights an item reads next are prefetched while it ends
 * (rows_job in common.h).
 */
#ifndef MOECACHE_LAYER_H
#define MOECACHE_LAYER_H

#include <stdlib.h>

#include "pool.h"
#include "quant.h"

#ifndef ITEM_BYTES
#define ITEM_BYTES (128 << 10)
#endif
#define ITEMS_PER_THREAD 8
#define MAX_ITEM_ROWS 64
#define GU_ROW_STEP 16 /* h rows of one item fill whole cache lines */
#define DOWN_ROW_STEP 8
#define X_ROWS 4 /* token rows quantized per x item */

typedef struct {
    int type;
    int block;
    int bytes;
    const act_fmt *act;
    dot_rows_fn dot;
} weight_fmt;

typedef struct { /* one layer's experts: [num_experts, rows, cols] */
    const weight_fmt *f;
    const uint8_t *data;
    int64_t rows, cols, row_bytes;
} expert_mat;

enum { MOE_SILU = 0, MOE_SWIGLU_OAI = 1, MOE_GELU = 2 };

/* What an expert computes between its matrices (ops/expert_math.py); mirrored by MoeMathStruct in
 * ops/cpu_experts.py. Biases are float32 rows indexed by expert id, or NULL for none. */
typedef struct moe_math {
    const float *gate_bias, *up_bias; /* [num_experts, ff] */
    const float *down_bias;           /* [num_experts, hidden] */
    int32_t activation;               /* MOE_SILU: silu(g) * u; MOE_GELU: gelu_tanh(g) * u; MOE_SWIGLU_OAI:
                                         min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + 1) */
    float alpha, limit;
    int32_t reserved;
} moe_math;

typedef struct { /* pairs in the caller's order */
    int64_t num;
    const int64_t *token, *expert;
    const float *weight;
} pair_list;

typedef struct { /* grow-only scratch; a measuring pass sizes it, a second one hands out the addresses */
    uint8_t *base;
    size_t cap, used;
    int measuring;
} arena;

typedef struct {
    expert_mat gate, up, down;
    moe_math math;
    const float *x; /* [num_tokens, hidden] */
    float *out;     /* [num_tokens, hidden] */
    int64_t num_tokens, num_pairs, num_groups, num_used;
    int64_t *pair_token;            /* [num_pairs] in group order */
    float *pair_weight;             /* [num_pairs] in group order */
    int64_t *group_expert;          /* [num_groups], ascending */
    int64_t *group_start;           /* [num_groups + 1] */
    int64_t *used_tokens;           /* [num_used] tokens with a pair */
    uint8_t *xg, *xu, *hq;          /* quantized x for gate and up (by token), h for down (by pair) */
    int64_t xg_bytes, xu_bytes, hq_bytes;
    float *h;                       /* [num_pairs, ff] */
    int64_t num_x, gu_rows, gu_chunks, num_gu, down_rows, num_down;
    _Atomic int64_t x_done;         /* x items done */
    _Atomic int64_t *chunks_left;   /* [num_groups] gate/up items not yet done */
    _Atomic int64_t *group_ready;   /* [num_groups] 1 once the group's h is quantized */
} layer;

MC_INLINE row_span mat_rows(const expert_mat *m, int64_t expert, int64_t r0, int64_t num_rows) {
    return (row_span){m->data + (expert * m->rows + r0) * m->row_bytes, m->row_bytes, num_rows};
}

/* ---- scratch ---- */

static uint8_t *carve(arena *a, int64_t bytes) {
    uint8_t *p = a->measuring ? NULL : a->base + a->used;
    a->used += (size_t)align_up(bytes > 0 ? bytes : 0, MC_ALIGN);
    return p;
}

/* After a measuring pass: room for what it counted; 0, or -1 when out of memory. */
static int arena_reserve(arena *a) {
    const size_t need = a->used;
    a->used = 0, a->measuring = 0;
    if (need <= a->cap) return 0;
    free(a->base);
    a->base = aligned_alloc(MC_ALIGN, need);
    a->cap = a->base ? need : 0;
    return a->base ? 0 : -1;
}

static void layer_carve(layer *L, arena *a, int64_t num_experts, int64_t **cursor, uint8_t **seen) {
    const int64_t P = L->num_pairs, T = L->num_tokens, G = min64(P, num_experts);
    L->pair_token = (int64_t *)carve(a, P * 8);
    L->pair_weight = (float *)carve(a, P * 4);
    L->group_expert = (int64_t *)carve(a, G * 8);
    L->group_start = (int64_t *)carve(a, (G + 1) * 8);
    L->used_tokens = (int64_t *)carve(a, T * 8);
    L->chunks_left = (_Atomic int64_t *)carve(a, G * 8);
    L->group_ready = (_Atomic int64_t *)carve(a, G * 8);
    *cursor = (int64_t *)carve(a, num_experts * 8);
    *seen = carve(a, T);
    L->xg = carve(a, T * L->xg_bytes);
    L->xu = L->up.f->act == L->gate.f->act ? L->xg : carve(a, T * L->xu_bytes);
    L->hq = carve(a, P * L->hq_bytes);
    L->h = (float *)carve(a, P * L->gate.rows * 4);
}

/* Counting sort of the pairs by expert (stable), and the tokens that have pairs. */
static void group_pairs(layer *L, pair_list pl, int64_t num_experts, int64_t *cursor, uint8_t *seen) {
    memset(cursor, 0, (size_t)num_experts * sizeof(int64_t));
    for (int64_t p = 0; p < pl.num; ++p) cursor[pl.expert[p]]++;
    int64_t g = 0, pos = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (!cursor[e]) continue;
        L->group_expert[g] = e, L->group_start[g++] = pos;
        const int64_t count = cursor[e];
        cursor[e] = pos; /* where the expert's next pair goes */
        pos += count;
    }
    L->num_groups = g;
    L->group_start[g] = pos;
    memset(seen, 0, (size_t)L->num_tokens);
    L->num_used = 0;
    for (int64_t p = 0; p < pl.num; ++p) {
        const int64_t k = cursor[pl.expert[p]]++, t = pl.token[p];
        L->pair_token[k] = t, L->pair_weight[k] = pl.weight[p];
        if (!seen[t]) seen[t] = 1, L->used_tokens[L->num_used++] = t;
    }
}

/* Rows per item: about ITEM_BYTES of weights and at least ITEMS_PER_THREAD items a thread where the
 * matrix allows; a multiple of step, at most MAX_ITEM_ROWS. */
static int64_t rows_per_item(int64_t bytes_per_row, int64_t step, int64_t total_rows, int num_threads) {
    int64_t r = bytes_per_row > 0 ? ITEM_BYTES / bytes_per_row : MAX_ITEM_ROWS;
    const int64_t spread = total_rows / ((int64_t)ITEMS_PER_THREAD * num_threads);
    r = min64(min64(r, spread), MAX_ITEM_ROWS) / step * step;
    return r < step ? step : r;
}

static void plan_items(layer *L, int num_threads) {
    const int64_t ff = L->gate.rows, hidden = L->down.rows, G = L->num_groups;
    L->num_x = (L->num_used + X_ROWS - 1) / X_ROWS;
    L->gu_rows = min64(rows_per_item(L->gate.row_bytes + L->up.row_bytes, GU_ROW_STEP, G * ff, num_threads), ff);
    L->gu_chunks = (ff + L->gu_rows - 1) / L->gu_rows;
    L->num_gu = G * L->gu_chunks;
    L->down_rows = min64(rows_per_item(L->down.row_bytes * G, DOWN_ROW_STEP, hidden, num_threads), hidden);
    L->num_down = (hidden + L->down_rows - 1) / L->down_rows;
    /* relaxed: the pool's submit publishes them */
    for (int64_t g = 0; g < G; ++g) {
        atomic_store_explicit(&L->chunks_left[g], L->gu_chunks, memory_order_relaxed);
        atomic_store_explicit(&L->group_ready[g], 0, memory_order_relaxed);
    }
    atomic_store_explicit(&L->x_done, 0, memory_order_relaxed);
}

/* ---- items ---- */

MC_INLINE float silu(float v) { return v / (1.0f + expf(-v)); }

/* torch's gelu(approximate="tanh") */
MC_INLINE float gelu_tanh(float v) {
    return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))); /* sqrt(2 / pi) */
}

MC_INLINE float swiglu_oai(float g, float u, float alpha, float limit) {
    g = fminf(g, limit), u = fminf(fmaxf(u, -limit), limit);
    return g * (1.0f / (1.0f + expf(-alpha * g))) * (u + 1.0f);
}

MC_INLINE const float *bias_row(const float *bias, int64_t expert, int64_t row_len, int64_t r0) {
    return bias ? bias + expert * row_len + r0 : NULL;
}

/* h[r] = act(gate[r] + bg[r], up[r] + bu[r]) for r < nr (bg, bu: NULL for none) */
static void hidden_rows(const moe_math *m, const float *gate, const float *up, const float *bg, const float *bu,
                        float *h, int64_t nr) {
    float g[MAX_ITEM_ROWS], u[MAX_ITEM_ROWS];
    for (int64_t r = 0; r < nr; ++r) g[r] = bg ? gate[r] + bg[r] : gate[r], u[r] = bu ? up[r] + bu[r] : up[r];
    switch (m->activation) {
    case MOE_SWIGLU_OAI:
        for (int64_t r = 0; r < nr; ++r) h[r] = swiglu_oai(g[r], u[r], m->alpha, m->limit);
        break;
    case MOE_GELU:
        for (int64_t r = 0; r < nr; ++r) h[r] = gelu_tanh(g[r]) * u[r];
        break;
    default:
        for (int64_t r = 0; r < nr; ++r) h[r] = silu(g[r]) * u[r];
    }
}

static void x_item(layer *L, int64_t i) {
    const int64_t hidden = L->gate.cols;
    for (int64_t k = i * X_ROWS; k < min64(L->num_used, (i + 1) * X_ROWS); ++k) {
        const int64_t t = L->used_tokens[k];
        L->gate.f->act->quant(L->x + t * hidden, L->xg + t * L->xg_bytes, hidden);
        if (L->xu != L->xg) L->up.f->act->quant(L->x + t * hidden, L->xu + t * L->xu_bytes, hidden);
    }
    atomic_fetch_add_explicit(&L->x_done, 1, memory_order_release);
}

/* The item that completes a group's last gate/up rows quantizes the group's h rows, then marks it ready. */
static void finish_gu_chunk(layer *L, int64_t g) {
    if (atomic_fetch_sub_explicit(&L->chunks_left[g], 1, memory_order_acq_rel) != 1) return;
    const int64_t ff = L->gate.rows;
    for (int64_t p = L->group_start[g]; p < L->group_start[g + 1]; ++p)
        L->down.f->act->quant(L->h + p * ff, L->hq + p * L->hq_bytes, ff);
    atomic_store_explicit(&L->group_ready[g], 1, memory_order_release);
}

/* The weight streams item i starts with (num_rows 0: none), for the item before it to prefetch. */
static void item_spans(const layer *L, int64_t i, row_span next[MAX_MATS]) {
    next[0] = next[1] = (row_span){0};
    i -= L->num_x;
    if (i < 0) return;
    if (i < L->num_gu) {
        const int64_t e = L->group_expert[i / L->gu_chunks], r0 = i % L->gu_chunks * L->gu_rows;
        const int64_t nr = min64(L->gu_rows, L->gate.rows - r0);
        next[0] = mat_rows(&L->gate, e, r0, nr), next[1] = mat_rows(&L->up, e, r0, nr);
        return;
    }
    const int64_t r0 = (i - L->num_gu) * L->down_rows, nr = min64(L->down_rows, L->down.rows - r0);
    for (int64_t g = 0; g < min64(L->num_groups, MAX_MATS); ++g)
        next[g] = mat_rows(&L->down, L->group_expert[g], r0, nr);
}

static void gu_item(layer *L, int64_t i, const row_span next[MAX_MATS]) {
    wait_at_least(&L->x_done, L->num_x);
    const int64_t g = i / L->gu_chunks, r0 = i % L->gu_chunks * L->gu_rows, ff = L->gate.rows;
    const int64_t nr = min64(L->gu_rows, ff - r0), e = L->group_expert[g], hidden = L->gate.cols;
    const row_span gs = mat_rows(&L->gate, e, r0, nr), us = mat_rows(&L->up, e, r0, nr), none = {0};
    const int fused = L->gate.f == L->up.f; /* then xu is xg */
    const float *bg = bias_row(L->math.gate_bias, e, ff, r0), *bu = bias_row(L->math.up_bias, e, ff, r0);
    for (int64_t p0 = L->group_start[g]; p0 < L->group_start[g + 1]; p0 += MAX_TILE) {
        const int nt = (int)min64(L->group_start[g + 1] - p0, MAX_TILE), last = p0 + nt == L->group_start[g + 1];
        const uint8_t *ag[MAX_TILE], *au[MAX_TILE];
        float gate[MAX_TILE * MAX_ITEM_ROWS], up[MAX_TILE * MAX_ITEM_ROWS];
        for (int k = 0; k < nt; ++k) {
            ag[k] = L->xg + L->pair_token[p0 + k] * L->xg_bytes;
            au[k] = L->xu + L->pair_token[p0 + k] * L->xu_bytes;
        }
        if (fused) { /* gate and up rows in one pass: two streams */
            const rows_job j = {2, nt, nr, nr, {gs, us}, {last ? next[0] : none, last ? next[1] : none}, {ag, ag},
                                {gate, up}};
            L->gate.f->dot(&j, hidden);
        } else {
            const rows_job jg = {1, nt, nr, nr, {gs}, {us}, {ag}, {gate}};
            const rows_job ju = {1, nt, nr, nr, {us}, {last ? next[0] : none}, {au}, {up}};
            L->gate.f->dot(&jg, hidden);
            L->up.f->dot(&ju, hidden);
        }
        for (int k = 0; k < nt; ++k)
            hidden_rows(&L->math, gate + k * nr, up + k * nr, bg, bu, L->h + (p0 + k) * ff + r0, nr);
    }
    finish_gu_chunk(L, g);
}

/* out rows r0 .. r0+nr of the tokens of pairs p0 .. p0+nt += weight * (y [nt, nr] + bias [nr]) (bias NULL: 0) */
static void add_pairs(layer *L, int64_t p0, int nt, int64_t r0, int64_t nr, const float *y, const float *bias) {
    for (int k = 0; k < nt; ++k) {
        float *o = L->out + L->pair_token[p0 + k] * L->down.rows + r0;
        const float w = L->pair_weight[p0 + k], *yk = y + k * nr;
        if (bias)
            for (int64_t r = 0; r < nr; ++r) o[r] += w * (yk[r] + bias[r]);
        else
            for (int64_t r = 0; r < nr; ++r) o[r] += w * yk[r];
    }
}

MC_INLINE int64_t group_size(const layer *L, int64_t g) { return L->group_start[g + 1] - L->group_start[g]; }

/* Down rows r0 .. r0+nr of group g, and of g+1 in the same pass where both have the same single tile. */
static int64_t down_groups(layer *L, int64_t g, int64_t r0, int64_t nr, const row_span next[MAX_MATS]) {
    const int64_t n = group_size(L, g), ff = L->down.cols;
    const int nm = g + 1 < L->num_groups && group_size(L, g + 1) == n && n <= MAX_TILE ? 2 : 1;
    row_span after[MAX_MATS] = {next[0], {0}};
    for (int m = 0; m < MAX_MATS && g + nm + m < L->num_groups; ++m)
        after[m] = mat_rows(&L->down, L->group_expert[g + nm + m], r0, nr);
    for (int64_t t0 = 0; t0 < n; t0 += MAX_TILE) {
        const int nt = (int)min64(n - t0, MAX_TILE);
        const uint8_t *a[MAX_MATS][MAX_TILE];
        float y[MAX_MATS][MAX_TILE * MAX_ITEM_ROWS];
        rows_job j = {nm, nt, nr, nr, {{0}}, {{0}}, {a[0], a[1]}, {y[0], y[1]}};
        for (int m = 0; m < nm; ++m) {
            wait_at_least(&L->group_ready[g + m], 1);
            j.w[m] = mat_rows(&L->down, L->group_expert[g + m], r0, nr);
            j.next[m] = t0 + nt == n ? after[m] : (row_span){0};
            for (int k = 0; k < nt; ++k) a[m][k] = L->hq + (L->group_start[g + m] + t0 + k) * L->hq_bytes;
        }
        L->down.f->dot(&j, ff);
        for (int m = 0; m < nm; ++m)
            add_pairs(L, L->group_start[g + m] + t0, nt, r0, nr, y[m],
                      bias_row(L->math.down_bias, L->group_expert[g + m], L->down.rows, r0));
    }
    return g + nm;
}

/* NOTE: out[t, r] = 0 + the groups' terms in expert order, pairs in the caller's order within a group:
 * one thread, one order, whatever the thread count. */
static void down_item(layer *L, int64_t i, const row_span next[MAX_MATS]) {
    const int64_t r0 = i * L->down_rows, nr = min64(L->down_rows, L->down.rows - r0);
    for (int64_t t = 0; t < L->num_tokens; ++t) memset(L->out + t * L->down.rows + r0, 0, (size_t)nr * sizeof(float));
    for (int64_t g = 0; g < L->num_groups;) g = down_groups(L, g, r0, nr, next);
}

static void layer_item(void *ctx, int64_t item, int64_t next) {
    layer *L = ctx;
    row_span after[MAX_MATS] = {{0}, {0}};
    if (next >= 0) item_spans(L, next, after);
    if (item < L->num_x)
        x_item(L, item);
    else if (item < L->num_x + L->num_gu)
        gu_item(L, item - L->num_x, after);
    else
        down_item(L, item - L->num_x - L->num_gu, after);
}

/* ---- the call ---- */

/* Group the pairs (at least one) and plan the items; scratch from `a`. 0, or -1 when out of memory. */
static int layer_prepare(layer *L, arena *a, pair_list pl, int64_t num_experts, int num_threads) {
    L->num_pairs = pl.num;
    L->xg_bytes = L->gate.f->act->row_bytes(L->gate.cols);
    L->xu_bytes = L->up.f->act->row_bytes(L->up.cols);
    L->hq_bytes = L->down.f->act->row_bytes(L->down.cols);
    int64_t *cursor;
    uint8_t *seen;
    a->used = 0, a->measuring = 1;
    layer_carve(L, a, num_experts, &cursor, &seen);
    if (arena_reserve(a)) return -1;
    layer_carve(L, a, num_experts, &cursor, &seen);
    group_pairs(L, pl, num_experts, cursor, seen);
    plan_items(L, num_threads);
    return 0;
}

static int64_t layer_items(const layer *L) { return L->num_x + L->num_gu + L->num_down; }

static void layer_run(layer *L, pool *p, int num_threads) {
    const pool_job job = {layer_item, L, layer_items(L)};
    pool_run(p, &job, num_threads);
}

#endif
