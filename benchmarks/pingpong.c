/* pingpong.c — the latency floor for the shm engine: two processes (fork) bounce a counter on one
 * cache line of a MAP_SHARED | MAP_ANONYMOUS mapping, spinning, and each round trip is timed on
 * its own. Nothing is pinned (the engine's ranks are not either), so the scheduler places the two
 * processes as it places two ranks.
 *
 * Built and run by benchmarks/collectives.py --latency (cc -O2, cached under build/):
 *     pingpong [round_trips]          (default 20000, after 2000 untimed ones)
 * prints one line: "round_trip_ns median=M p90=P min=L n=N"; exits 1 with a message on stderr if
 * the peer does not answer a round trip within TIMEOUT_S seconds (or dies), so it never hangs. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WARMUP 2000
#define TIMEOUT_S 10.0
#define QUIT UINT64_MAX

/* The one cache line both processes spin on: the parent writes odd values, the child answers with
 * the next even one. */
typedef struct {
    _Alignas(64) _Atomic uint64_t counter;
    char pad[64 - sizeof(uint64_t)];
} line_t;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spin until the counter is `want`. Every 4096 spins it checks that the peer still runs and
 * that TIMEOUT_S has not passed since the first check (the clock is read only off the fast path).
 * Returns 0, or -1 on timeout, a dead peer, or QUIT. */
static int wait_for(line_t *l, uint64_t want, pid_t peer) {
    uint64_t deadline = 0;
    for (unsigned spins = 1;; spins++) {
        uint64_t v = atomic_load_explicit(&l->counter, memory_order_acquire);
        if (v == want) return 0;
        if (v == QUIT) return -1;
        if ((spins & 4095u) == 0) {
            uint64_t t = now_ns();
            if (deadline == 0) deadline = t + (uint64_t)(TIMEOUT_S * 1e9);
            if (t > deadline) return -1;
            if (kill(peer, 0) != 0 && errno == ESRCH) return -1;
        }
    }
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void child(line_t *l, pid_t parent, long total) {
    for (long i = 0; i < total; i++) {
        if (wait_for(l, 2 * (uint64_t)i + 1, parent) != 0) {
            atomic_store(&l->counter, QUIT);
            _exit(1);
        }
        atomic_store_explicit(&l->counter, 2 * (uint64_t)i + 2, memory_order_release);
    }
    _exit(0);
}

int main(int argc, char **argv) {
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : 20000;
    if (n < 1 || n > 100000000) {
        fprintf(stderr, "pingpong: round_trips must be 1..1e8, got %s\n", argv[1]);
        return 2;
    }
    long total = n + WARMUP;
    uint64_t *rtt = malloc((size_t)n * sizeof(*rtt));
    line_t *l = mmap(NULL, sizeof(line_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (rtt == NULL || l == MAP_FAILED) {
        fprintf(stderr, "pingpong: out of memory\n");
        return 1;
    }
    atomic_store(&l->counter, 0);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("pingpong: fork");
        return 1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the parent */
        if (getppid() != parent) _exit(1);
        child(l, parent, total);
    }
    int rc = 0;
    for (long i = 0; i < total; i++) {
        uint64_t t0 = now_ns();
        atomic_store_explicit(&l->counter, 2 * (uint64_t)i + 1, memory_order_release);
        if (wait_for(l, 2 * (uint64_t)i + 2, pid) != 0) {
            fprintf(stderr, "pingpong: no answer to round trip %ld within %.0f s\n", i, TIMEOUT_S);
            rc = 1;
            break;
        }
        if (i >= WARMUP) rtt[i - WARMUP] = now_ns() - t0;
    }
    if (rc != 0) {
        atomic_store(&l->counter, QUIT);
        kill(pid, SIGKILL);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) < 0 || (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))) {
        fprintf(stderr, "pingpong: the child failed\n");
        rc = 1;
    }
    if (rc == 0) {
        qsort(rtt, (size_t)n, sizeof(*rtt), cmp_u64);
        printf("round_trip_ns median=%llu p90=%llu min=%llu n=%ld\n", (unsigned long long)rtt[n / 2],
               (unsigned long long)rtt[(size_t)(n * 9 / 10)], (unsigned long long)rtt[0], n);
    }
    munmap(l, sizeof(line_t));
    free(rtt);
    return rc;
}
