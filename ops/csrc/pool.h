/* A persistent pool of worker threads that run one job at a time with the thread that submits it.
 *
 * A job is a count of numbered items and a function that runs one. Threads claim items in order from one
 * word that also names the job (gen, total, next), so a worker that wakes late for an old job claims nothing
 * and never touches it; the submitter claims items like any worker and returns once every item is done, not
 * once every worker has shown up: a worker the OS has not scheduled holds up no one.
 *
 * Idle workers spin on the job generation for `spin_ns` (yielding the core between looks after the first
 * POLITE_NS, so a runnable thread that needs the core gets it), so a job that follows soon starts within a
 * microsecond or so; then they sleep in the kernel (futex on Linux, a condition variable elsewhere) and are
 * woken by the next submit. Workers a job does not need go back to sleep at once.
 */
#ifndef MOECACHE_POOL_H
#define MOECACHE_POOL_H

#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "common.h"

#define POOL_MAX_THREADS 256
#define POOL_DEFAULT_SPIN_NS 200000
#define POLITE_NS 20000
/* claim word: generation (24 bits) | total items (20) | next item (20) */
#define CLAIM_ITEM_BITS 20
#define POOL_MAX_ITEMS ((1 << CLAIM_ITEM_BITS) - 1)

/* run(ctx, item, next): next is the item this thread runs after it (-1: none), for prefetching */
typedef void (*pool_item_fn)(void *ctx, int64_t item, int64_t next);

typedef struct {
    pool_item_fn run;
    void *ctx;
    int64_t num_items;
} pool_job;

typedef struct pool pool;

typedef struct {
    pool *p;
    int index; /* 1 .. num_threads - 1; the submitter is 0 */
    uint32_t first_gen;
} pool_worker;

struct pool {
    _Alignas(64) _Atomic uint32_t gen; /* futex word: the last submitted job */
    _Atomic int sleepers;
    _Alignas(64) _Atomic uint64_t claim;
    _Alignas(64) _Atomic int64_t done; /* items of the current job finished */
    _Alignas(64) pool_job job;         /* NOTE: written only between jobs, read only under a claimed item */
    _Atomic int job_threads;           /* threads the current job may use, submitter included */
    _Atomic int64_t spin_ns;           /* how long idle workers spin before they sleep */
    int num_threads;                   /* submitter + started workers */
    int default_threads;
    pthread_mutex_t sleep_lock; /* condition-variable wake-ups, where there is no futex */
    pthread_cond_t wake;
    pool_worker workers[POOL_MAX_THREADS];
};

MC_INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

MC_INLINE int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait for *v >= target: spin with pause, and past POLITE_NS yield the core each round (the thread being
 * waited for may need it). */
static void wait_at_least(_Atomic int64_t *v, int64_t target) {
    if (atomic_load_explicit(v, memory_order_acquire) >= target) return;
    const int64_t start = now_ns();
    for (unsigned i = 1; atomic_load_explicit(v, memory_order_acquire) < target; ++i) {
        cpu_relax();
        if (!(i & 63) && now_ns() - start > POLITE_NS) sched_yield();
    }
}

MC_INLINE uint64_t claim_word(uint32_t gen, int64_t total, int64_t next) {
    return (uint64_t)(gen & 0xffffffu) << (2 * CLAIM_ITEM_BITS) | (uint64_t)total << CLAIM_ITEM_BITS |
           (uint64_t)next;
}

/* The next item of job `gen`, or -1 when it has none left (or is over). */
static int64_t pool_claim(pool *p, uint32_t gen) {
    const uint64_t mask = (1u << CLAIM_ITEM_BITS) - 1;
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_relaxed);
    for (;;) {
        const int64_t next = (int64_t)(c & mask), total = (int64_t)(c >> CLAIM_ITEM_BITS & mask);
        if (c >> (2 * CLAIM_ITEM_BITS) != (gen & 0xffffffu) || next >= total) return -1;
        if (atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acquire, memory_order_relaxed))
            return next;
    }
}

/* Claim and run items of job `gen` until none is left; the job is read only under a claimed item. */
static void pool_work(pool *p, uint32_t gen) {
    int64_t cur = pool_claim(p, gen);
    if (cur < 0) return;
    const pool_job job = p->job;
    while (cur >= 0) {
        const int64_t next = pool_claim(p, gen);
        job.run(job.ctx, cur, next);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        cur = next;
    }
}

static void pool_sleep(pool *p, uint32_t seen) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)&p->gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->sleep_lock);
    while (atomic_load(&p->gen) == seen) pthread_cond_wait(&p->wake, &p->sleep_lock);
    pthread_mutex_unlock(&p->sleep_lock);
#endif
}

static void pool_wake_all(pool *p) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->sleep_lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->sleep_lock);
#endif
}

/* The next job generation after `seen`: spin for spin_ns (none when `spin` is 0), then sleep. */
static uint32_t pool_wait(pool *p, uint32_t seen, int spin) {
    const int64_t start = now_ns();
    for (unsigned i = 1; spin; ++i) {
        const uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen) return g;
        cpu_relax();
        if (i & 63) continue;
        const int64_t waited = now_ns() - start;
        if (waited > atomic_load_explicit(&p->spin_ns, memory_order_relaxed)) break;
        if (waited > POLITE_NS) sched_yield();
    }
    /* NOTE: sleepers is raised before gen is read again, and the submitter reads sleepers after it
     * writes gen (both seq_cst), so either this thread sees the new job or the submitter wakes it. */
    atomic_fetch_add(&p->sleepers, 1);
    uint32_t g;
    while ((g = atomic_load(&p->gen)) == seen) pool_sleep(p, seen);
    atomic_fetch_sub(&p->sleepers, 1);
    return g;
}

static void *pool_worker_main(void *arg) {
    pool_worker *me = arg;
    pool *p = me->p;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "moecache-cpu");
#endif
    uint32_t seen = me->first_gen;
    int spin = 1;
    for (;;) {
        seen = pool_wait(p, seen, spin);
        /* a thread this job does not need goes back to sleep */
        spin = me->index < atomic_load_explicit(&p->job_threads, memory_order_relaxed);
        if (spin) pool_work(p, seen);
    }
    return NULL;
}

/* Start workers until the pool has `num_threads` threads (submitter included). Caller: the submitter. */
static int pool_grow(pool *p, int num_threads) {
    if (num_threads > POOL_MAX_THREADS) num_threads = POOL_MAX_THREADS;
    while (p->num_threads < num_threads) {
        pool_worker *w = &p->workers[p->num_threads];
        w->p = p, w->index = p->num_threads;
        w->first_gen = atomic_load(&p->gen);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int err = pthread_create(&t, &attr, pool_worker_main, w);
        pthread_attr_destroy(&attr);
        if (err) break;
        p->num_threads++;
    }
    return p->num_threads;
}

/* Run every item of `job` on up to num_threads threads, this one included; returns when all are done.
 * NOTE: one submitter at a time (the caller serializes submits). */
static void pool_run(pool *p, const pool_job *job, int num_threads) {
    if (job->num_items <= 0) return;
    pool_grow(p, num_threads);
    const uint32_t gen = atomic_load_explicit(&p->gen, memory_order_relaxed) + 1;
    p->job = *job;
    atomic_store_explicit(&p->job_threads, num_threads, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, claim_word(gen, job->num_items, 0), memory_order_release);
    atomic_store(&p->gen, gen);
    if (atomic_load(&p->sleepers) > 0) pool_wake_all(p);
    pool_work(p, gen);
    wait_at_least(&p->done, job->num_items);
}

static void pool_init(pool *p) {
    memset(p, 0, sizeof(*p));
    p->num_threads = 1;
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    p->default_threads = cores > 0 ? (int)(cores < POOL_MAX_THREADS ? cores : POOL_MAX_THREADS) : 1;
    atomic_store(&p->spin_ns, POOL_DEFAULT_SPIN_NS);
    pthread_mutex_init(&p->sleep_lock, NULL);
    pthread_cond_init(&p->wake, NULL);
}

#endif
