/* callcount.c — an LD_PRELOAD library that counts a process's pthread_create, sched_yield and
 * nanosleep calls; tools/nccl_calls/probe.py reads the counts through ctypes (cc_creates,
 * cc_yields, cc_sleeps) to show what one collective call does on the host. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static _Atomic long n_create, n_yield, n_sleep;

long cc_creates(void) {
    return atomic_load(&n_create);
}
long cc_yields(void) {
    return atomic_load(&n_yield);
}
long cc_sleeps(void) {
    return atomic_load(&n_sleep);
}

int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *arg) {
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
    atomic_fetch_add(&n_create, 1);
    return real(t, a, f, arg);
}

int sched_yield(void) {
    static int (*real)(void);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "sched_yield");
    atomic_fetch_add(&n_yield, 1);
    return real();
}

int nanosleep(const struct timespec *req, struct timespec *rem) {
    static int (*real)(const struct timespec *, struct timespec *);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "nanosleep");
    atomic_fetch_add(&n_sleep, 1);
    return real(req, rem);
}
