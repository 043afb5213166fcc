/* The doorbell of the CPU's expert tasks in a decode step (the device rings, a watcher thread answers).
 *
 * Two words of pinned host memory: `ring`, which a device kernel writes (seq << BELL_TASK_BITS | task) once
 * it has written the task's inputs, and `done`, which the watcher writes (seq) once the task's output is
 * written; a device kernel waits for done >= seq before it reads the output. Nothing on the host calls
 * CUDA: the watcher sees the word change, runs the task on the worker pool with itself as the submitter,
 * and answers. The round trip is a PCIe write each way, where a host node in a CUDA graph costs tens of
 * microseconds of driver work (measured on the H200 host: docs/benchmarks.md).
 *
 * The watcher spins while steps are running (a layer rings every ~100 us), then polls with short sleeps,
 * then long ones; the first layer after a long idle waits up to one long sleep. */
#ifndef MOECACHE_BELL_H
#define MOECACHE_BELL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "pool.h"

#define BELL_TASK_BITS 16
#define BELL_NAP_NS 20000        /* quiet past spin_ns: look every 20 us */
#define BELL_SLEEP_NS 1000000    /* quiet for a second: look every millisecond */
#define BELL_DROWSY_NS 1000000000

typedef void (*bell_task_fn)(void *task);

typedef struct moe_bell {
    const volatile int64_t *ring; /* written by the device */
    volatile int64_t *done;       /* written by the watcher */
    bell_task_fn run;
    void **tasks; /* task index -> argument of run (NULL: none) */
    int64_t num_tasks, spin_ns;
    int64_t last; /* the sequence number of the ring answered last (the ring word's at start) */
    _Atomic int stop;
    _Atomic int64_t answered; /* rings answered, for tests */
    pthread_t thread;
} moe_bell;

static void bell_nap(int64_t ns) {
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    nanosleep(&t, NULL);
}

static void *bell_main(void *arg) {
    moe_bell *b = arg;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "moecache-bell");
#endif
    int64_t last = b->last, quiet_since = now_ns();
    for (unsigned i = 1; !atomic_load_explicit(&b->stop, memory_order_relaxed); ++i) {
        const int64_t word = __atomic_load_n(b->ring, __ATOMIC_ACQUIRE);
        const int64_t seq = word >> BELL_TASK_BITS, task = word & ((1 << BELL_TASK_BITS) - 1);
        if (seq != last) {
            /* NOTE: the device wrote the task's inputs before the ring (a system-scope fence between) */
            if (task < b->num_tasks && b->tasks[task]) b->run(b->tasks[task]);
            last = seq;
            __atomic_store_n(b->done, seq, __ATOMIC_RELEASE); /* after the output: the device reads it next */
            atomic_fetch_add_explicit(&b->answered, 1, memory_order_relaxed);
            quiet_since = now_ns();
            continue;
        }
        cpu_relax();
        if (i & 63) continue;
        const int64_t quiet = now_ns() - quiet_since;
        if (quiet > b->spin_ns) bell_nap(quiet > BELL_DROWSY_NS ? BELL_SLEEP_NS : BELL_NAP_NS);
    }
    return NULL;
}

/* Start watching `ring` (tasks[i] is run for task index i; `tasks` is copied); NULL on failure. */
static moe_bell *bell_start(const int64_t *ring, int64_t *done, bell_task_fn run, void *const *tasks,
                            int64_t num_tasks, int64_t spin_us) {
    if (num_tasks < 0 || num_tasks > (1 << BELL_TASK_BITS)) return NULL;
    moe_bell *b = calloc(1, sizeof(*b));
    if (!b) return NULL;
    b->tasks = calloc((size_t)(num_tasks > 0 ? num_tasks : 1), sizeof(void *));
    if (!b->tasks) return free(b), NULL;
    for (int64_t i = 0; i < num_tasks; ++i) b->tasks[i] = tasks[i];
    b->ring = ring;
    b->done = done;
    b->run = run;
    b->num_tasks = num_tasks;
    b->spin_ns = spin_us * 1000;
    b->last = __atomic_load_n(ring, __ATOMIC_ACQUIRE) >> BELL_TASK_BITS; /* NOTE: before any ring can come */
    if (pthread_create(&b->thread, NULL, bell_main, b)) return free(b->tasks), free(b), NULL;
    return b;
}

/* Stop the watcher and free it (its last task, if any, finishes first). */
static void bell_stop(moe_bell *b) {
    if (!b) return;
    atomic_store(&b->stop, 1);
    pthread_join(b->thread, NULL);
    free(b->tasks);
    free(b);
}

#endif
