/* Threads no Python knows of, like a CUDA driver's callback thread calling a graph's host function. */
#include <pthread.h>
#include <stdint.h>

typedef void (*host_fn)(void *);

typedef struct {
    host_fn fn;
    void *arg;
    int times;
} host_call;

static void *call_times(void *p) {
    const host_call *c = p;
    for (int i = 0; i < c->times; ++i) c->fn(c->arg);
    return NULL;
}

/* Run fn(args[i]) `times` times on thread i of num_threads new threads, all at once; 0 once all joined. */
int run_on_host_threads(void *fn, void **args, int num_threads, int times) {
    pthread_t threads[64];
    host_call calls[64];
    if (num_threads > 64) return -1;
    int started = 0;
    for (; started < num_threads; ++started) {
        calls[started] = (host_call){(host_fn)(uintptr_t)fn, args[started], times};
        if (pthread_create(&threads[started], NULL, call_times, &calls[started])) break;
    }
    for (int i = 0; i < started; ++i) pthread_join(threads[i], NULL);
    return started == num_threads ? 0 : -1;
}
