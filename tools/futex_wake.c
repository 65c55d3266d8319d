/* futex_wake.c — what waking a sleeping peer costs on this machine, the step of every hand-off
 * between two ranks when the receiver has gone to sleep: one process sleeps in FUTEX_WAIT on a
 * word of a MAP_SHARED mapping; the other works (spins) for `work_us`, then posts the word and
 * calls FUTEX_WAKE. Timed on one clock (CLOCK_MONOTONIC, shared by both processes):
 *   - wake call: how long FUTEX_WAKE takes the waker (time it cannot spend on its next work);
 *   - resume: from just before the post until the sleeper runs again.
 *
 *     cc -O2 -o build/futex_wake tools/futex_wake.c && build/futex_wake [work_us [rounds]]
 *
 * (defaults 1000 and 400). Prints one line of medians and p90s in microseconds. Every wait has a
 * timeout (TIMEOUT_S): the program exits 1 with a message instead of hanging. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_S 5.0
#define MAX_ROUNDS 100000

typedef struct {
    _Atomic uint32_t word, sleepers;
    _Atomic double posted_at;
    double wake_call[MAX_ROUNDS], resume[MAX_ROUNDS];
} shared_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Round i: the waker posts 2i + 1, the sleeper answers 2i + 2. */
static void sleeper(shared_t *s, int rounds) {
    const struct timespec slice = {0, 100 * 1000 * 1000};
    for (int i = 0; i < rounds; i++) {
        uint32_t seen = 2u * (uint32_t)i;
        double start = now();
        while (atomic_load(&s->word) == seen) {
            if (now() - start > TIMEOUT_S) {
                fprintf(stderr, "futex_wake: no post within %.0f s in round %d\n", TIMEOUT_S, i);
                _exit(1);
            }
            atomic_fetch_add(&s->sleepers, 1);
            syscall(SYS_futex, (uint32_t *)&s->word, FUTEX_WAIT, seen, &slice, NULL, 0);
            atomic_fetch_sub(&s->sleepers, 1);
        }
        s->resume[i] = now() - atomic_load(&s->posted_at);
        atomic_store(&s->word, seen + 2);
    }
    _exit(0);
}

static int waker(shared_t *s, int rounds, double work_s) {
    for (int i = 0; i < rounds; i++) {
        double start = now();
        while (now() - start < work_s) { /* the waker's computation */
        }
        while (atomic_load(&s->sleepers) == 0) /* measure only wakes of a sleeping peer */
            if (now() - start > TIMEOUT_S) return fprintf(stderr, "futex_wake: the peer never slept\n"), 1;
        double t = now();
        atomic_store(&s->posted_at, t);
        atomic_store(&s->word, 2u * (uint32_t)i + 1);
        if (atomic_load(&s->sleepers) > 0)
            syscall(SYS_futex, (uint32_t *)&s->word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
        s->wake_call[i] = now() - t;
        while (atomic_load(&s->word) != 2u * (uint32_t)i + 2)
            if (now() - t > TIMEOUT_S) return fprintf(stderr, "futex_wake: no answer in round %d\n", i), 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    double work_us = argc > 1 ? atof(argv[1]) : 1000.0;
    int rounds = argc > 2 ? atoi(argv[2]) : 400;
    if (!(work_us >= 0.0) || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: futex_wake [work_us >= 0 [rounds in 1..%d]]\n", MAX_ROUNDS);
        return 2;
    }
    shared_t *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED) return perror("futex_wake: mmap"), 1;
    pid_t child = fork();
    if (child < 0) return perror("futex_wake: fork"), 1;
    if (child == 0) sleeper(s, rounds);
    int failed = waker(s, rounds, work_us * 1e-6), status = 0;
    if (failed) kill(child, SIGKILL);
    waitpid(child, &status, 0);
    if (failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    qsort(s->wake_call, (size_t)rounds, sizeof(double), by_value);
    qsort(s->resume, (size_t)rounds, sizeof(double), by_value);
    printf("work %.0f us, %d rounds: wake call median %.1f p90 %.1f us; resume median %.1f p90 %.1f us\n", work_us,
           rounds, s->wake_call[rounds / 2] * 1e6, s->wake_call[rounds * 9 / 10] * 1e6, s->resume[rounds / 2] * 1e6,
           s->resume[rounds * 9 / 10] * 1e6);
    return 0;
}
