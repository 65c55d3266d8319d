/* pingpong.c — the latency floor for the shm engine: two processes (fork) bounce a counter on one
 * cache line of a MAP_SHARED | MAP_ANONYMOUS mapping and each round trip is timed on its own.
 * "spin" mode: both sides spin on the line (the floor of any shared-memory handshake). "futex"
 * mode: a side whose answer has not arrived sleeps in FUTEX_WAIT until the other wakes it (what a
 * handshake costs once a waiter goes to sleep). Nothing is pinned (the engine's ranks are not either), so the
 * scheduler places the two processes as it places two ranks.
 *
 * With `bytes` > 0 each side also owns a buffer of that many bytes: on its turn it reads the
 * peer's buffer (written on the peer's last turn, so still in the peer's cache), writes its own,
 * then answers. Half such a round trip is the floor of moving `bytes` from one rank to the other
 * once, as a collective's rank reads what its peer just posted.
 *
 * Built and run by benchmarks/collectives.py --latency (cc -O2, cached under build/):
 *     pingpong [round_trips [spin|futex [bytes]]]     (default 20000 spin 0, after 2000 untimed ones)
 * prints one line: "round_trip_ns mode=M bytes=B median=X p10=X p90=X min=X n=N"; exits 1 with a
 * message on stderr if the peer does not answer a round trip within TIMEOUT_S seconds (or dies),
 * so it never hangs. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WARMUP 2000
#define TIMEOUT_S 10.0
#define FUTEX_SLICE_NS 100000000L /* futex mode: check the peer and the deadline every 100 ms */
#define QUIT UINT32_MAX

/* The one cache line both processes wait on: the parent writes odd values, the child answers with
 * the next even one. 32 bits, as a futex word must be. */
typedef struct {
    _Alignas(64) _Atomic uint32_t counter;
    char pad[64 - sizeof(uint32_t)];
} line_t;

static int use_futex;          /* set before fork(); the child inherits it */
static size_t nbytes;          /* each side's buffer, 0 for none */
static uint64_t *bufs[2];      /* [0]: the parent's, [1]: the child's; in the shared mapping */
static volatile uint64_t sink; /* keeps the reads of the peer's buffer */

/* One side's turn with a payload: read the peer's buffer, write this side's. */
static void touch(int me, uint64_t value) {
    size_t n = nbytes / sizeof(uint64_t);
    const uint64_t *peer = bufs[1 - me];
    uint64_t *own = bufs[me], sum = 0;
    for (size_t i = 0; i < n; i++) sum += peer[i];
    for (size_t i = 0; i < n; i++) own[i] = value + i;
    sink = sum;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void post(line_t *l, uint32_t value) {
    atomic_store_explicit(&l->counter, value, memory_order_release);
    if (use_futex) syscall(SYS_futex, (uint32_t *)&l->counter, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* Wait until the counter is `want`: spinning, or sleeping in FUTEX_WAIT. Every 4096 spins (or
 * futex slice that ran out) it checks that the peer still runs and that TIMEOUT_S has not passed
 * since the first check; the clock is read only off the fast path. Returns 0, or -1 on timeout, a
 * dead peer, or QUIT. */
static int wait_for(line_t *l, uint32_t want, pid_t peer) {
    uint64_t deadline = 0;
    for (unsigned spins = 1;; spins++) {
        uint32_t v = atomic_load_explicit(&l->counter, memory_order_acquire);
        if (v == want) return 0;
        if (v == QUIT) return -1;
        if (use_futex) {
            struct timespec slice = {0, FUTEX_SLICE_NS};
            long r = syscall(SYS_futex, (uint32_t *)&l->counter, FUTEX_WAIT, v, &slice, NULL, 0);
            if ((r == 0 || errno != ETIMEDOUT) && (spins & 4095u) != 0) continue;
        } else if ((spins & 4095u) != 0) {
            continue;
        }
        uint64_t t = now_ns();
        if (deadline == 0) deadline = t + (uint64_t)(TIMEOUT_S * 1e9);
        if (t > deadline) return -1;
        if (kill(peer, 0) != 0 && errno == ESRCH) return -1;
    }
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void child(line_t *l, pid_t parent, long total) {
    for (long i = 0; i < total; i++) {
        if (wait_for(l, 2 * (uint32_t)i + 1, parent) != 0) {
            post(l, QUIT);
            _exit(1);
        }
        if (nbytes) touch(1, (uint64_t)i);
        post(l, 2 * (uint32_t)i + 2);
    }
    _exit(0);
}

int main(int argc, char **argv) {
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : 20000;
    if (n < 1 || n > 100000000) {
        fprintf(stderr, "pingpong: round_trips must be 1..1e8, got %s\n", argv[1]);
        return 2;
    }
    const char *mode = argc > 2 ? argv[2] : "spin";
    if (strcmp(mode, "spin") != 0 && strcmp(mode, "futex") != 0) {
        fprintf(stderr, "pingpong: mode must be spin or futex, got %s\n", mode);
        return 2;
    }
    use_futex = strcmp(mode, "futex") == 0;
    long b = argc > 3 ? strtol(argv[3], NULL, 10) : 0;
    if (b < 0 || b > (64L << 20) || b % 8) {
        fprintf(stderr, "pingpong: bytes must be a multiple of 8 in 0..64 MiB, got %s\n", argv[3]);
        return 2;
    }
    nbytes = (size_t)b;
    long total = n + WARMUP;
    uint64_t *rtt = malloc((size_t)n * sizeof(*rtt));
    size_t map_len = sizeof(line_t) + 2 * nbytes;
    line_t *l = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (rtt == NULL || l == MAP_FAILED) {
        fprintf(stderr, "pingpong: out of memory\n");
        return 1;
    }
    bufs[0] = (uint64_t *)(l + 1);
    bufs[1] = bufs[0] + nbytes / sizeof(uint64_t);
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
        if (nbytes) touch(0, (uint64_t)i);
        post(l, 2 * (uint32_t)i + 1);
        if (wait_for(l, 2 * (uint32_t)i + 2, pid) != 0) {
            fprintf(stderr, "pingpong: no answer to round trip %ld within %.0f s\n", i, TIMEOUT_S);
            rc = 1;
            break;
        }
        if (i >= WARMUP) rtt[i - WARMUP] = now_ns() - t0;
    }
    if (rc != 0) {
        post(l, QUIT);
        kill(pid, SIGKILL);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) < 0 || (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))) {
        fprintf(stderr, "pingpong: the child failed\n");
        rc = 1;
    }
    if (rc == 0) {
        qsort(rtt, (size_t)n, sizeof(*rtt), cmp_u64);
        printf("round_trip_ns mode=%s bytes=%zu median=%llu p10=%llu p90=%llu min=%llu n=%ld\n", mode, nbytes,
               (unsigned long long)rtt[n / 2], (unsigned long long)rtt[(size_t)(n / 10)],
               (unsigned long long)rtt[(size_t)(n * 9 / 10)], (unsigned long long)rtt[0], n);
    }
    munmap(l, map_len);
    free(rtt);
    return rc;
}
