/* shm_wait.c — the wait/post primitives on a segment's words: a waiter spins briefly (moving off
 * a CPU its peer waits for), yields, then sleeps in futex slices that check the deadline, the
 * peer's liveness, a close's abandon flag and the caller's interrupt check. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "comm/shm_internal.h"

#define FSC_SHM_SPINS 2000       /* pause-loop iterations before yielding */
#define FSC_SHM_YIELDS 50        /* sched_yield calls before sleeping in futex */
#define FSC_SHM_CPU_CHECK 256    /* pause iterations between two looks at where the peer is */
#define FSC_SHM_SLICE_NS 2000000 /* futex sleep slice: 2 ms */
#define FSC_SHM_LIVENESS_S 0.05  /* how often a sleeping waiter checks the peer's pid */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* CPUs this process may run on (its affinity mask; the online count when that cannot be read). */
int fsc_shm_cpus_available(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* A waiter spins and yields before it sleeps only when every rank of the group can have a CPU of
 * its own. With more ranks than CPUs the awaited peer is most likely waiting for this CPU, and
 * spinning only delays it: there the waiter sleeps at once (measurements: docs/benchmarks.md,
 * "Why these settings"). */
void fsc_shm_wait_budget(fsc_shm_group_t *g) {
    int own = fsc_shm_cpus_available() >= g->size;
    g->spins = own ? FSC_SHM_SPINS : 0;
    g->yields = own ? FSC_SHM_YIELDS : 0;
}

/* Read the /proc stat file at `path` into buf; return the space before its third field (the
 * state), or NULL when it cannot be read. The name before it may hold spaces and parentheses. */
static const char *proc_stat_fields(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NULL;
    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n <= 0) return NULL;
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    return p != NULL && p[1] == ' ' ? p + 1 : NULL;
}

/* 1 when `pid` no longer runs: gone (ESRCH) or a zombie nobody has reaped yet. */
int fsc_shm_pid_dead(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) == -1 && errno == ESRCH) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    const char *p = proc_stat_fields(path, buf, sizeof(buf));
    return p != NULL && (p[1] == 'Z' || p[1] == 'X');
}

void fsc_shm_post(_Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t value) {
    atomic_store_explicit(word, value, memory_order_seq_cst);
    if (atomic_load_explicit(sleepers, memory_order_seq_cst) > 0)
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void fsc_shm_ring(fsc_shm_group_t *g, int r) {
    fsc_shm_rank_ctrl_t *peer = &g->ranks[r];
    atomic_fetch_add_explicit(&peer->bell, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&peer->bell_sleepers, memory_order_seq_cst) > 0)
        syscall(SYS_futex, (uint32_t *)&peer->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* The interrupt check of the calling thread (fsc_shm_set_interrupt_check). */
static _Thread_local int (*interrupt_fn)(void *);
static _Thread_local void *interrupt_arg;

void fsc_shm_set_interrupt_check(int (*fn)(void *), void *arg) {
    interrupt_fn = fn;
    interrupt_arg = arg;
}

void fsc_shm_get_interrupt_check(int (**fn)(void *), void **arg) {
    *fn = interrupt_fn;
    *arg = interrupt_arg;
}

int fsc_shm_interrupted(void) {
    return interrupt_fn != NULL && interrupt_fn(interrupt_arg);
}

const char *fsc_shm_op_desc(fsc_shm_group_t *g, char *buf, size_t cap) {
    fsc_comm_header_format(&g->cur_hdr, buf, cap);
    return buf;
}

static fsc_status_t wait_failed(fsc_shm_group_t *g, int peer, int dead) {
    char peer_op[192], mine[192];
    fsc_comm_header_format(&g->ranks[peer].cur, peer_op, sizeof(peer_op));
    fsc_shm_op_desc(g, mine, sizeof(mine));
    if (dead)
        return fsc_error(FSC_ERR_COMM,
                         "%s on group '%s' (rank %d of %d): rank %d (pid %d) exited while this rank "
                         "was waiting for it (it was last in %s)",
                         mine, g->name, g->rank, g->size, peer, (int)atomic_load(&g->ranks[peer].pid), peer_op);
    return fsc_error(FSC_ERR_TIMEOUT,
                     "%s on group '%s' (rank %d of %d): rank %d did not arrive within "
                     "FAIRSCALE_C_TIMEOUT=%g s (it was last in %s)",
                     mine, g->name, g->rank, g->size, peer, g->timeout, peer_op);
}

/* Publish where this thread runs as this rank's `where` (peer_waits_for_my_cpu reads it). */
static void publish_where(fsc_shm_group_t *g) {
    static _Thread_local uint32_t tid;
    if (tid == 0) tid = (uint32_t)syscall(SYS_gettid);
    int cpu = sched_getcpu();
    uint64_t w = cpu < 0 ? 0 : (uint64_t)tid << 32 | (uint32_t)cpu;
    atomic_store_explicit(&g->ranks[g->rank].where, w, memory_order_relaxed);
}

/* 1 when thread `tid` of process `pid` is runnable ("R") on `cpu` according to /proc. */
static int runnable_on(pid_t pid, uint32_t tid, int cpu) {
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/task/%u/stat", (int)pid, tid);
    const char *p = proc_stat_fields(path, buf, sizeof(buf));
    if (p == NULL || p[1] != 'R') return 0;
    /* Fields are separated by single spaces: find the one before field 39, the CPU. */
    for (int field = 4; field <= 39; field++) {
        p = strchr(p + 1, ' ');
        if (p == NULL) return 0;
    }
    return atoi(p + 1) == cpu;
}

/* 1 when the thread through which rank `peer` last arrived or waited is runnable on the CPU this
 * thread runs on: it waits for this CPU, which this thread holds while it spins. A cheap look at
 * the CPU the peer published comes first; /proc is read only when it matches, and then *read_proc
 * is set. */
static int peer_waits_for_my_cpu(fsc_shm_group_t *g, int peer, int *read_proc) {
    int cpu = sched_getcpu();
    uint64_t w = atomic_load_explicit(&g->ranks[peer].where, memory_order_relaxed);
    if (cpu < 0 || w == 0 || (uint32_t)w != (uint32_t)cpu) return 0;
    *read_proc = 1;
    return runnable_on((pid_t)atomic_load(&g->ranks[peer].pid), (uint32_t)(w >> 32), cpu);
}

/* Move the calling thread to another CPU it may run on, leaving its affinity as it was.
 *
 * The scheduler at times puts two ranks on one CPU while another CPU idles: a thread woken by
 * another (a socket, a futex) often lands on its waker's CPU, and as both ran a moment ago the
 * balancer leaves them there for milliseconds. A waiter that spins there keeps the peer it waits
 * for off the CPU until its budget runs out, and then the peer does the same at the next op: every
 * op costs a spin budget. Taking the current CPU out of the thread's mask for a moment makes the
 * kernel move it at once; the mask is then restored as it was. */
static void move_off_cpu(fsc_shm_group_t *g, int peer) {
    int cpu = sched_getcpu();
    cpu_set_t mask, others;
    if (cpu < 0 || sched_getaffinity(0, sizeof(mask), &mask) != 0 || !CPU_ISSET(cpu, &mask) || CPU_COUNT(&mask) < 2)
        return;
    others = mask;
    CPU_CLR(cpu, &others);
    if (sched_setaffinity(0, sizeof(others), &others) != 0) return;
    publish_where(g);
    FSC_TRACE("shm", "group '%s' rank %d: moved off CPU %d, on which rank %d waited to run", g->name, g->rank, cpu,
              peer);
    if (sched_setaffinity(0, sizeof(mask), &mask) != 0)
        FSC_WARN("shm", "could not restore this thread's CPU affinity after moving it off CPU %d: %s", cpu,
                 strerror(errno));
}

fsc_status_t fsc_shm_backoff(fsc_shm_group_t *g, fsc_shm_backoff_t *b, _Atomic uint32_t *word,
                             _Atomic uint32_t *sleepers, uint32_t seen, int peer) {
    if (b->spins < g->spins) {
        if (b->spins == 0) publish_where(g);
        b->spins++;
        cpu_relax();
        /* A peer waiting for this CPU cannot arrive while this thread spins on it (/proc read at
         * most once per wait). */
        if (!b->read_proc && b->spins % FSC_SHM_CPU_CHECK == 0 && peer_waits_for_my_cpu(g, peer, &b->read_proc))
            move_off_cpu(g, peer);
        return FSC_OK;
    }
    if (b->yields < g->yields) {
        b->yields++;
        sched_yield();
        return FSC_OK;
    }
    char mine[192];
    double now = fsc_comm_now();
    if (b->last_check == 0) b->last_check = now;
    if (b->started == 0) b->started = now;
    if (now > g->deadline && now - b->started > g->timeout) return wait_failed(g, peer, 0);
    if (atomic_load_explicit(&g->abandon, memory_order_relaxed))
        return fsc_error(FSC_ERR_COMM,
                         "%s on group '%s' (rank %d of %d): abandoned while waiting for rank %d, because "
                         "the group was closed (at exit, or while unwinding an error) and the op did not "
                         "finish within the grace period",
                         fsc_shm_op_desc(g, mine, sizeof(mine)), g->name, g->rank, g->size, peer);
    if (now - b->last_check > FSC_SHM_LIVENESS_S) {
        b->last_check = now;
        FSC_CHECK(fsc_shm_check_refused(g));
        FSC_CHECK(fsc_shm_check_gave_up(g, fsc_shm_op_desc(g, mine, sizeof(mine))));
        if (fsc_shm_pid_dead((pid_t)atomic_load(&g->ranks[peer].pid)) && atomic_load(word) == seen)
            return wait_failed(g, peer, 1);
        if (interrupt_fn != NULL && interrupt_fn(interrupt_arg))
            return fsc_error(FSC_ERR_COMM,
                             "%s on group '%s' (rank %d of %d): interrupted while waiting for rank %d; the op "
                             "ran on the calling thread and cannot finish now, so the group is unusable",
                             fsc_shm_op_desc(g, mine, sizeof(mine)), g->name, g->rank, g->size, peer);
    }
    struct timespec slice = {0, FSC_SHM_SLICE_NS};
    atomic_fetch_add(sleepers, 1);
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &slice, NULL, 0);
    atomic_fetch_sub(sleepers, 1);
    return FSC_OK;
}

fsc_status_t fsc_shm_wait(fsc_shm_group_t *g, _Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t target,
                          int peer) {
    fsc_shm_backoff_t b = {0};
    for (;;) {
        uint32_t v = atomic_load_explicit(word, memory_order_acquire);
        if ((int32_t)(v - target) >= 0) return FSC_OK;
        FSC_CHECK(fsc_shm_backoff(g, &b, word, sleepers, v, peer));
    }
}

fsc_status_t fsc_shm_arrive(fsc_shm_group_t *g, int wait) {
    fsc_shm_rank_ctrl_t *me = &g->ranks[g->rank];
    uint32_t e = ++g->epoch;
    publish_where(g);
    fsc_shm_post(&me->arrive, &me->sleepers, e);
    if (!wait) return FSC_OK;
    for (int p = 0; p < g->size; p++) {
        if (p == g->rank) continue;
        FSC_CHECK(fsc_shm_wait(g, &g->ranks[p].arrive, &g->ranks[p].sleepers, e, p));
    }
    return FSC_OK;
}
