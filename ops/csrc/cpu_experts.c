/* Routed-expert FFN of one MoE layer on the CPU, straight from raw GGUF bytes.
 *
 *   out[t] = sum over pairs p with token[p] == t of weight[p] * down_e(silu(gate_e(x_t)) * up_e(x_t))
 *
 * or, with a moe_math (layer.h), weight[p] * (down_e(act(gate_e(x_t) + bg_e, up_e(x_t) + bu_e)) + bd_e).
 *
 * One call per layer, run by a persistent worker pool (pool.h) with the calling thread, as one job of
 * numbered items (layer.h). Pairs are grouped by expert; every weight row is read once per call and used
 * for all pairs of its expert (MAX_TILE at a time). Weight blocks are decoded in registers inside the dot
 * products, never into a dequantized matrix. Activations are quantized once per call to the int8 form
 * the weight format multiplies with, in two planes, the second rounding what the first lost, for float32-level
 * results (quant.h). Every output element is summed by one thread in a fixed order, so results do not depend
 * on the thread count.
 *
 * Two entry points: moe_expert_ffn (pairs as arrays, from Python through ctypes) and moe_task_run (a
 * moe_task, from the watcher a GPU kernel rings, bell.h: no Python, no GIL, no CUDA). Calls are serialized: one layer
 * at a time owns the pool and the scratch.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "common.h"
#include "kquants.h"
#include "layer.h"
#include "pool.h"
#include "bell.h"
#include "simple.h"

enum {
    MOE_OK = 0,
    MOE_EBADTYPE = -1,
    MOE_EBADSHAPE = -2,
    MOE_EBADTOKEN = -3,
    MOE_EBADEXPERT = -4,
    MOE_ENOMEM = -5,
    MOE_EBADMATH = -6,
};

/* ---- weight formats, by ggml type id ---- */

static const weight_fmt FORMATS[] = {
    {0, 1, 4, &ACT_F32, dot_f32_rows},       {1, 1, 2, &ACT_F32, dot_f16_rows},
    {30, 1, 2, &ACT_F32, dot_bf16_rows},     {8, QK8_0, 34, &ACT_Q8_0, dot_q8_0_rows},
    {12, QK_K, 144, &ACT_K, dot_q4k_rows},   {13, QK_K, 176, &ACT_K, dot_q5k_rows},
    {14, QK_K, 210, &ACT_K, dot_q6k_rows},   {39, QK8_0, 17, &ACT_Q8_0, dot_mxfp4_rows},
    {2, QK8_0, 18, &ACT_Q8_0, dot_q4_0_rows},
};

static const weight_fmt *find_format(int type) {
    for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); ++i)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

int moe_supports_type(int type) { return find_format(type) != NULL; }

/* 2: AVX-512 VNNI, 1: AVX2, 0: portable C */
int moe_simd_level(void) { return MC_SIMD; }

/* stride: bytes from one expert to the next, 0 for rows * row_bytes (contiguous experts) */
static int make_mat(expert_mat *m, int type, const uint8_t *data, int64_t rows, int64_t cols, int64_t stride) {
    m->f = find_format(type);
    if (!m->f) return MOE_EBADTYPE;
    if (cols <= 0 || rows <= 0 || cols % m->f->block) return MOE_EBADSHAPE;
    m->data = data;
    m->rows = rows;
    m->cols = cols;
    m->row_bytes = cols / m->f->block * m->f->bytes;
    m->stride = stride ? stride : rows * m->row_bytes;
    return m->stride < rows * m->row_bytes ? MOE_EBADSHAPE : MOE_OK;
}

/* strides: gate, up, down bytes from one expert to the next (NULL: contiguous experts) */
static int make_mats(layer *L, const uint8_t *gate, const uint8_t *up, const uint8_t *down, int gate_type,
                     int up_type, int down_type, int64_t hidden, int64_t ff, const int64_t *strides) {
    const int64_t none[3] = {0, 0, 0}, *s = strides ? strides : none;
    int err = make_mat(&L->gate, gate_type, gate, ff, hidden, s[0]);
    if (!err) err = make_mat(&L->up, up_type, up, ff, hidden, s[1]);
    if (!err) err = make_mat(&L->down, down_type, down, hidden, ff, s[2]);
    if (!err && (L->math.activation < MOE_SILU || L->math.activation > MOE_GELU)) err = MOE_EBADMATH;
    return err;
}

/* ---- the one pool and its scratch ---- */

/* NOTE: g_lock is held for a whole layer call: it owns g_pool's submit side and the arenas. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pool g_pool;
static int g_pool_ready;
static arena g_scratch, g_pairs;

/* A forked child has none of the parent's workers: it starts a pool of its own at first use. */
static void after_fork_child(void) {
    pthread_mutex_init(&g_lock, NULL);
    g_pool_ready = 0;
}

static pool *locked_pool(void) {
    if (!g_pool_ready) {
        static int registered;
        if (!registered) registered = !pthread_atfork(NULL, NULL, after_fork_child);
        pool_init(&g_pool);
        g_pool_ready = 1;
    }
    return &g_pool;
}

static int threads_for(const pool *p, int num_threads) {
    const int n = num_threads > 0 ? num_threads : p->default_threads;
    return n < POOL_MAX_THREADS ? n : POOL_MAX_THREADS;
}

/* Start the pool with num_threads threads, the caller of a layer included (<= 0: one per core), and the
 * time idle workers spin before they sleep (< 0: unchanged). Returns the pool's thread count. */
int moe_pool_start(int num_threads, int spin_us) {
    pthread_mutex_lock(&g_lock);
    pool *p = locked_pool();
    if (spin_us >= 0) atomic_store(&p->spin_ns, (int64_t)spin_us * 1000);
    if (num_threads > 0) p->default_threads = threads_for(p, num_threads);
    const int n = pool_grow(p, p->default_threads);
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Start threads until a layer can run on num_threads (<= 0: the default) without starting any; returns the
 * pool's thread count. */
int moe_pool_reserve(int num_threads) {
    pthread_mutex_lock(&g_lock);
    pool *p = locked_pool();
    const int n = pool_grow(p, threads_for(p, num_threads));
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Threads started so far, the caller included. */
int moe_pool_threads(void) {
    pthread_mutex_lock(&g_lock);
    const int n = locked_pool()->num_threads;
    pthread_mutex_unlock(&g_lock);
    return n;
}

static void zero_rows(float *out, int64_t num_rows, int64_t hidden) {
    if (num_rows > 0 && hidden > 0) memset(out, 0, (size_t)(num_rows * hidden) * sizeof(float));
}

/* Compute the layer for pairs `pl` (ids already checked) under g_lock. */
static int locked_layer(layer *L, pair_list pl, int64_t num_experts, int num_threads) {
    if (!pl.num) {
        zero_rows(L->out, L->num_tokens, L->down.rows);
        L->num_groups = 0;
        return MOE_OK;
    }
    pool *p = locked_pool();
    const int threads = threads_for(p, num_threads);
    if (layer_prepare(L, &g_scratch, pl, num_experts, threads)) return MOE_ENOMEM;
    if (layer_items(L) > POOL_MAX_ITEMS) return MOE_EBADSHAPE;
    layer_run(L, p, threads);
    return MOE_OK;
}

/* ---- entry point: pairs as arrays ---- */

static int check_ids(const int64_t *ids, int64_t n, int64_t limit) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= limit) return 0;
    return 1;
}

/* x: float32 [num_tokens, hidden]; token_ids, expert_ids, weights: [num_pairs];
 * gate, up: [num_experts, ff, row bytes of hidden]; down: [num_experts, hidden, row bytes of ff];
 * out: float32 [num_tokens, hidden], every row written; num_threads <= 0: the pool's default;
 * math: biases and activation, NULL for silu without biases; strides: gate, up, down bytes from one expert to
 * the next (NULL: contiguous experts; views of merged gate/up tensors step over the other half). */
int moe_expert_ffn(const float *x, int64_t num_tokens, const int64_t *token_ids, const int64_t *expert_ids,
                   const float *weights, int64_t num_pairs, const uint8_t *gate, const uint8_t *up,
                   const uint8_t *down, int gate_type, int up_type, int down_type, int64_t num_experts,
                   int64_t hidden, int64_t ff, float *out, int num_threads, const moe_math *math,
                   const int64_t *strides) {
    layer L = {.x = x, .out = out, .num_tokens = num_tokens};
    if (math) L.math = *math;
    int err = make_mats(&L, gate, up, down, gate_type, up_type, down_type, hidden, ff, strides);
    if (err) return err;
    if (num_tokens < 0 || num_pairs < 0) return MOE_EBADSHAPE;
    if (!check_ids(token_ids, num_pairs, num_tokens)) return MOE_EBADTOKEN;
    if (!check_ids(expert_ids, num_pairs, num_experts)) return MOE_EBADEXPERT;
    const pair_list pl = {num_pairs, token_ids, expert_ids, weights};
    pthread_mutex_lock(&g_lock);
    err = locked_layer(&L, pl, num_experts, num_threads);
    pthread_mutex_unlock(&g_lock);
    return err;
}

/* ---- entry point: a task, run by the bell watcher (bell.h) when a GPU kernel rings for it ---- */

typedef struct moe_task { /* mirrored by MoeTaskStruct in ops/cpu_experts.py */
    /* inputs: pinned host memory that a GPU kernel writes before it rings */
    const float *x;            /* [max_tokens, hidden] */
    const int32_t *expert_ids; /* [max_tokens * top_k]: pair p belongs to token p / top_k; < 0: none */
    const float *weights;      /* [max_tokens * top_k] */
    const int32_t *on_cpu;     /* [max_tokens * top_k]: nonzero where the CPU computes the pair */
    const int32_t *num_tokens; /* [1]: tokens of this step (<= max_tokens), read when the task runs */
    float *out;                /* [max_tokens, hidden]: rows < *num_tokens written, 0 where no CPU pair */
    int64_t max_tokens, top_k, hidden, ff, num_experts;
    const uint8_t *gate, *up, *down; /* the layer's experts, raw GGUF bytes, as moe_expert_ffn takes them */
    int64_t strides[3];              /* gate, up, down bytes from one expert to the next (0: contiguous) */
    moe_math math;                   /* biases and activation (all zero: silu without biases) */
    int32_t gate_type, up_type, down_type, num_threads;
    /* written by the task: the last run's error (0 or a MOE_E* code), cumulative counters */
    int32_t error, reserved;
    int64_t calls, pairs, experts, bytes, busy_ns; /* bytes: the distinct experts' bytes read */
} moe_task;

/* The flagged pairs of this step into g_pairs; MOE_EBADEXPERT on an id past num_experts. */
static int task_pairs(const moe_task *t, int64_t num_tokens, pair_list *pl) {
    const int64_t n = num_tokens * t->top_k;
    int64_t count = 0;
    for (int64_t p = 0; p < n; ++p) {
        if (!t->on_cpu[p] || t->expert_ids[p] < 0) continue;
        if (t->expert_ids[p] >= t->num_experts) return MOE_EBADEXPERT;
        ++count;
    }
    arena *a = &g_pairs;
    a->used = 0, a->measuring = 1;
    carve(a, count * 8), carve(a, count * 8), carve(a, count * 4);
    if (arena_reserve(a)) return MOE_ENOMEM;
    int64_t *token = (int64_t *)carve(a, count * 8), *expert = (int64_t *)carve(a, count * 8);
    float *weight = (float *)carve(a, count * 4);
    count = 0;
    for (int64_t p = 0; p < n; ++p) {
        if (!t->on_cpu[p] || t->expert_ids[p] < 0) continue;
        token[count] = p / t->top_k, expert[count] = t->expert_ids[p], weight[count++] = t->weights[p];
    }
    *pl = (pair_list){count, token, expert, weight};
    return MOE_OK;
}

static int task_layer(moe_task *t, layer *L, int64_t num_tokens) {
    int err = make_mats(L, t->gate, t->up, t->down, t->gate_type, t->up_type, t->down_type, t->hidden, t->ff,
                        t->strides);
    if (err) return err;
    if (num_tokens < 0 || num_tokens > t->max_tokens || t->top_k <= 0 || t->num_experts <= 0) return MOE_EBADSHAPE;
    pair_list pl;
    err = task_pairs(t, num_tokens, &pl);
    return err ? err : locked_layer(L, pl, t->num_experts, t->num_threads);
}

static void count_task(moe_task *t, const layer *L, int64_t start_ns) {
    const int64_t expert_bytes = L->gate.row_bytes * L->gate.rows + L->up.row_bytes * L->up.rows +
                                 L->down.row_bytes * L->down.rows;
    t->calls += 1;
    t->pairs += L->num_pairs;
    t->experts += L->num_groups;
    t->bytes += L->num_groups * expert_bytes;
    t->busy_ns += now_ns() - start_ns;
}

/* Compute the step's flagged pairs into out; returns when done. `task` is a moe_task *. On bad input,
 * error is set and rows < *num_tokens (at most max_tokens) are zero. */
void moe_task_run(void *task) {
    moe_task *t = task;
    const int64_t start = now_ns(), num_tokens = *t->num_tokens;
    layer L = {.x = t->x, .out = t->out, .num_tokens = num_tokens, .math = t->math};
    pthread_mutex_lock(&g_lock);
    t->error = task_layer(t, &L, num_tokens);
    if (t->error) {
        zero_rows(t->out, num_tokens < t->max_tokens ? num_tokens : t->max_tokens, t->hidden);
        L.num_pairs = L.num_groups = 0;
    }
    count_task(t, &L, start);
    pthread_mutex_unlock(&g_lock);
}

/* Answer the device's rings with moe_task_run(tasks[i]) on a watcher thread (bell.h); NULL on failure. */
void *moe_bell_start(const int64_t *ring, int64_t *done, void *const *tasks, int64_t num_tasks, int64_t spin_us) {
    return bell_start(ring, done, moe_task_run, tasks, num_tasks, spin_us);
}

void moe_bell_stop(void *bell) { bell_stop(bell); }

/* Rings answered so far. */
int64_t moe_bell_answered(void *bell) { return atomic_load(&((moe_bell *)bell)->answered); }

/* sizeof(moe_task), for the Python mirror's layout check */
size_t moe_task_size(void) { return sizeof(moe_task); }
