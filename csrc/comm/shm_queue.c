/* shm_queue.c — the per-group progress thread: runs submitted items in order (consecutive
 * point-to-point items together), so Python (which only enqueues and waits with the GIL released)
 * keeps computing meanwhile; and the inline path, where a synchronous op finds the queue idle and
 * runs on the calling thread. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "comm/shm_internal.h"

/* The CLOCK_REALTIME time `seconds` from now (pthread's timed waits take absolute times). */
static struct timespec realtime_after(double seconds) {
    struct timespec abs;
    clock_gettime(CLOCK_REALTIME, &abs);
    time_t whole = (time_t)seconds;
    abs.tv_sec += whole;
    abs.tv_nsec += (long)((seconds - (double)whole) * 1e9);
    if (abs.tv_nsec >= 1000000000L) {
        abs.tv_sec++;
        abs.tv_nsec -= 1000000000L;
    }
    return abs;
}

static void work_finish(fsc_shm_work_t *w, fsc_status_t st) {
    pthread_mutex_lock(&w->mu);
    w->st = st;
    if (st != FSC_OK) snprintf(w->msg, sizeof(w->msg), "%s", fsc_last_error());
    atomic_store_explicit(&w->done, 1, memory_order_release);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void fsc_shm_work_release(fsc_shm_work_t *w) {
    if (w == NULL || atomic_fetch_sub(&w->refs, 1) != 1) return;
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->args);
    free(w->p2p);
    free(w);
}

/* Drop the finished head of the queue and publish its result (unless it was published already:
 * a point-to-point item that completed behind an unfinished one, see run_p2p_items). */
static void pop_finished(fsc_shm_group_t *g, fsc_shm_work_t *w, fsc_status_t st) {
    if (!atomic_load_explicit(&w->done, memory_order_acquire)) work_finish(w, st);
    pthread_mutex_lock(&g->qmu);
    g->qhead = w->next;
    if (g->qhead == NULL) g->qtail = NULL;
    pthread_mutex_unlock(&g->qmu);
    fsc_shm_work_release(w);
}

/* Publish every admitted item behind the head (up to `last`) whose ops are all done, though it
 * stays queued until the items before it are: a recv must not wait for an earlier send of its own
 * rank, which may need a later recv of the peer's to find room (both ranks isend a few messages,
 * then recv them one by one). Only the progress thread unlinks items, and producers append after
 * `last` only, so the links up to `last` are stable without the lock. */
static void publish_done(fsc_shm_work_t *head, fsc_shm_work_t *last, fsc_shm_p2p_t *const *recs, size_t m) {
    size_t i = 0;
    for (fsc_shm_work_t *w = head; w != NULL && i < m; w = w->next) {
        size_t k = 0;
        while (k < w->n && recs[i + k]->done) k++;
        if (k == w->n && !atomic_load_explicit(&w->done, memory_order_acquire)) work_finish(w, FSC_OK);
        i += w->n;
        if (w == last) break;
    }
}

/* Run the point-to-point items at the head of the queue together, admitting those queued behind
 * them while they move. An item is published as soon as its ops are done (publish_done) and
 * unlinked in queue order. Returns when none is left in flight. */
static void run_p2p_items(fsc_shm_group_t *g) {
    enum { CAP = 256 };
    fsc_shm_p2p_t *recs[CAP];
    fsc_shm_work_t *last = NULL; /* last item admitted */
    size_t m = 0;
    fsc_shm_backoff_t b = {0};
    fsc_status_t st = fsc_shm_check_usable(g);
    g->deadline = fsc_comm_now() + g->timeout;
    for (;;) {
        pthread_mutex_lock(&g->qmu);
        fsc_shm_work_t *next = last == NULL ? g->qhead : last->next;
        while (next != NULL && next->p2p_only && m + next->n <= CAP) {
            for (size_t i = 0; i < next->n; i++) {
                memset(&next->p2p[i], 0, sizeof(next->p2p[i]));
                next->p2p[i].a = &next->args[i];
                recs[m++] = &next->p2p[i];
            }
            last = next;
            next = next->next;
        }
        fsc_shm_work_t *head = g->qhead;
        pthread_mutex_unlock(&g->qmu);
        if (st != FSC_OK) break;
        uint32_t seen = atomic_load_explicit(&g->ranks[g->rank].bell, memory_order_acquire);
        int progressed = 0;
        size_t left = 0;
        st = fsc_shm_p2p_pass(g, recs, m, &progressed, &left);
        if (st != FSC_OK) break;
        /* finish the items at the front whose ops are all done, in queue order */
        size_t drop = 0;
        while (head != NULL && drop < m) {
            size_t k = 0;
            while (k < head->n && recs[drop + k]->done) k++;
            if (k < head->n) break;
            fsc_shm_work_t *next_head = head->next;
            drop += head->n;
            if (head == last) last = NULL, next_head = NULL;
            pop_finished(g, head, FSC_OK);
            head = next_head;
        }
        if (drop) {
            memmove(recs, recs + drop, (m - drop) * sizeof(*recs));
            m -= drop;
        }
        if (progressed && m > 0) publish_done(head, last, recs, m);
        if (m == 0) {
            pthread_mutex_lock(&g->qmu);
            int more = g->qhead != NULL && g->qhead->p2p_only;
            pthread_mutex_unlock(&g->qmu);
            if (!more) return;
            continue;
        }
        if (progressed || drop) {
            memset(&b, 0, sizeof(b));
            g->deadline = fsc_comm_now() + g->timeout;
            continue;
        }
        st = fsc_shm_p2p_backoff(g, &b, recs, m, seen);
    }
    /* a failure breaks the group: every admitted item fails with it */
    st = fsc_shm_fail(g, st);
    while (last != NULL) {
        pthread_mutex_lock(&g->qmu);
        fsc_shm_work_t *head = g->qhead;
        pthread_mutex_unlock(&g->qmu);
        int was_last = head == last;
        pop_finished(g, head, st);
        if (was_last) break;
    }
}

_Thread_local int fsc_shm_on_progress_thread = 0;

static void *progress_main(void *arg) {
    fsc_shm_on_progress_thread = 1;
    fsc_shm_group_t *g = arg;
    fsc_log_set_rank(g->rank);
    pthread_mutex_lock(&g->qmu);
    for (;;) {
        while ((g->qhead == NULL || g->inline_running) && !g->stop) pthread_cond_wait(&g->qcv, &g->qmu);
        while (g->inline_running) pthread_cond_wait(&g->qcv, &g->qmu); /* stopping: let it finish */
        fsc_shm_work_t *w = g->qhead;
        if (w == NULL) break; /* stop requested and queue drained */
        pthread_mutex_unlock(&g->qmu);
        if (w->p2p_only)
            run_p2p_items(g);
        else
            pop_finished(g, w, fsc_shm_run_batch(g, w->args, w->n));
        pthread_mutex_lock(&g->qmu);
    }
    pthread_mutex_unlock(&g->qmu);
    return NULL;
}

fsc_status_t fsc_shm_engine_start(fsc_shm_group_t *g) {
    if (g->engine_started) return FSC_OK;
    if (pthread_mutex_init(&g->qmu, NULL) != 0 || pthread_cond_init(&g->qcv, NULL) != 0)
        return fsc_error(FSC_ERR_SYSTEM, "shm group '%s': cannot create progress thread sync objects", g->name);
    int rc = pthread_create(&g->thread, NULL, progress_main, g);
    if (rc != 0) return fsc_error(FSC_ERR_SYSTEM, "shm group '%s': pthread_create: %s", g->name, strerror(rc));
    /* named by its creator, so it carries the name as soon as this returns (/proc, top -H, gdb) */
    pthread_setname_np(g->thread, "fsc_progress");
    g->engine_started = 1;
    return FSC_OK;
}

void fsc_shm_engine_stop(fsc_shm_group_t *g, double grace_s) {
    if (!g->engine_started || g->thread_joined) return;
    if (fsc_shm_check_owner(g) != FSC_OK) { /* a fork() child: no thread to join, the lock may be held */
        g->engine_started = 0;
        return;
    }
    pthread_mutex_lock(&g->qmu);
    g->stop = 1;
    pthread_cond_broadcast(&g->qcv);
    pthread_mutex_unlock(&g->qmu);
    if (grace_s >= 0) {
        struct timespec abs = realtime_after(grace_s);
        if (pthread_timedjoin_np(g->thread, NULL, &abs) == 0) goto joined;
        /* Still waiting for a peer that may never come: make its waits give up. Ops that are
         * moving data finish their chunk; the check sits where a rank sleeps for a peer. */
        atomic_store(&g->abandon, 1);
        FSC_WARN("shm", "group '%s': closing with an op still waiting for a peer after %g s; abandoning it", g->name,
                 grace_s);
    }
    pthread_join(g->thread, NULL);
joined:
    g->thread_joined = 1;
}

void fsc_shm_engine_free(fsc_shm_group_t *g) {
    if (!g->engine_started) return;
    fsc_shm_engine_stop(g, -1);
    if (!g->engine_started) return; /* a fork() child: the lock may be held, leave it be */
    pthread_mutex_destroy(&g->qmu);
    pthread_cond_destroy(&g->qcv);
    g->engine_started = 0;
}

/* FSC_OK when ops may be issued on `g`: opened by this process, progress thread started. */
static fsc_status_t check_usable(const fsc_shm_group_t *g) {
    FSC_CHECK(fsc_shm_check_owner(g));
    if (!g->engine_started)
        return fsc_error(FSC_ERR_INTERNAL, "shm group '%s': its progress thread was never started (join() first)",
                         g->name);
    return FSC_OK;
}

/* An op issued while the group is being closed (by another thread) fails with this. */
static fsc_status_t closed_error(const fsc_shm_group_t *g) {
    return fsc_error(FSC_ERR_COMM, "shm group '%s' was closed while this op was being issued", g->name);
}

static int all_p2p(const fsc_shm_args_t *a, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (a[i].op != FSC_OP_SEND && a[i].op != FSC_OP_RECV) return 0;
    return 1;
}

fsc_status_t fsc_shm_submit(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n, fsc_shm_work_t **out) {
    *out = NULL;
    FSC_CHECK(check_usable(g));
    if (n == 0 || n > 256) return fsc_error(FSC_ERR_VALUE, "shm: a batch holds 1 to 256 ops, got %zu", n);
    fsc_shm_work_t *w = calloc(1, sizeof(*w));
    if (w != NULL) {
        w->args = malloc(n * sizeof(*a));
        w->p2p = calloc(n, sizeof(*w->p2p));
    }
    if (w == NULL || w->args == NULL || w->p2p == NULL) {
        if (w != NULL) free(w->args), free(w->p2p), free(w);
        return fsc_error(FSC_ERR_NOMEM, "shm: out of memory queueing %s", fsc_comm_op_name(a->op));
    }
    memcpy(w->args, a, n * sizeof(*a));
    w->n = n;
    w->p2p_only = all_p2p(a, n);
    atomic_store(&w->refs, 2); /* caller + queue */
    w->owner_pid = (int)getpid();
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&g->qmu);
    if (g->stop) {
        pthread_mutex_unlock(&g->qmu);
        free(w->args), free(w->p2p), free(w);
        return closed_error(g);
    }
    int behind = g->qtail != NULL; /* the progress thread may be waiting on point-to-point ops */
    if (g->qtail)
        g->qtail->next = w;
    else
        g->qhead = w;
    g->qtail = w;
    pthread_cond_signal(&g->qcv);
    pthread_mutex_unlock(&g->qmu);
    /* A progress thread waiting for point-to-point progress sleeps on this rank's bell, not on qcv:
     * ring it, so that it admits this item now instead of at the end of its sleep slice
     * (benchmarks/p2p_queued.py). */
    if (behind && w->p2p_only) fsc_shm_ring(g, g->rank);
    *out = w;
    return FSC_OK;
}

fsc_status_t fsc_shm_try_inline(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n, int *ran) {
    *ran = 0;
    FSC_CHECK(check_usable(g));
    pthread_mutex_lock(&g->qmu);
    if (g->stop) {
        pthread_mutex_unlock(&g->qmu);
        return closed_error(g);
    }
    int idle = g->qhead == NULL && !g->inline_running;
    if (idle) g->inline_running = 1;
    pthread_mutex_unlock(&g->qmu);
    if (!idle) return FSC_OK;
    *ran = 1;
    fsc_status_t st = fsc_shm_run_batch(g, a, n);
    char msg[1024]; /* the unlock below must not lose the message of a failed op */
    if (st != FSC_OK) snprintf(msg, sizeof(msg), "%s", fsc_last_error());
    pthread_mutex_lock(&g->qmu);
    g->inline_running = 0;
    /* Wake the progress thread only for work queued meanwhile: a wake-up with nothing to do
     * would put it on a CPU beside the ranks, which the next op's peer is waiting for. */
    if (g->qhead != NULL || g->stop) pthread_cond_broadcast(&g->qcv);
    pthread_mutex_unlock(&g->qmu);
    if (st != FSC_OK) fsc_error(st, "%s", msg);
    return st;
}

int fsc_shm_work_owned(const fsc_shm_work_t *w) {
    return (int)getpid() == w->owner_pid;
}

fsc_status_t fsc_shm_work_check_owner(const fsc_shm_work_t *w) {
    if (fsc_shm_work_owned(w)) return FSC_OK;
    return fsc_error(FSC_ERR_COMM,
                     "Work: %s was issued by pid %d; this process (pid %d) is a fork() child of it, where the op "
                     "does not run (the parent's progress thread runs it): wait for it in the parent",
                     w->n > 1 ? "the batch" : fsc_comm_op_name(w->args[0].op), w->owner_pid, (int)getpid());
}

int fsc_shm_work_done(fsc_shm_work_t *w) {
    return atomic_load_explicit(&w->done, memory_order_acquire);
}

fsc_status_t fsc_shm_work_timed_out(fsc_shm_work_t *w, double waited_s) {
    return fsc_error(FSC_ERR_TIMEOUT, "Work.wait: %s did not complete within %g s (it is still running)",
                     w->n > 1 ? "batch" : fsc_comm_op_name(w->args[0].op), waited_s);
}

fsc_status_t fsc_shm_work_wait(fsc_shm_work_t *w, double timeout_s) {
    struct timespec abs = realtime_after(timeout_s >= 0 ? timeout_s : 0);
    pthread_mutex_lock(&w->mu);
    while (!atomic_load(&w->done)) {
        if (timeout_s < 0) {
            pthread_cond_wait(&w->cv, &w->mu);
        } else if (pthread_cond_timedwait(&w->cv, &w->mu, &abs) == ETIMEDOUT && !atomic_load(&w->done)) {
            pthread_mutex_unlock(&w->mu);
            return fsc_shm_work_timed_out(w, timeout_s);
        }
    }
    fsc_status_t st = w->st;
    pthread_mutex_unlock(&w->mu);
    if (st != FSC_OK) return fsc_error(st, "%s", w->msg);
    return FSC_OK;
}
