/* shm_queue.c — the per-group progress thread: runs submitted ops one at a time in order, so
 * Python (which only enqueues and waits with the GIL released) keeps computing meanwhile. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    free(w);
}

static void *progress_main(void *arg) {
    fsc_shm_group_t *g = arg;
    pthread_setname_np(pthread_self(), "fsc_progress"); /* names it in /proc, top -H, gdb */
    fsc_log_set_rank(g->rank);
    pthread_mutex_lock(&g->qmu);
    for (;;) {
        while (g->qhead == NULL && !g->stop) pthread_cond_wait(&g->qcv, &g->qmu);
        fsc_shm_work_t *w = g->qhead;
        if (w == NULL) break; /* stop requested and queue drained */
        pthread_mutex_unlock(&g->qmu);
        work_finish(w, fsc_shm_run(g, &w->args));
        pthread_mutex_lock(&g->qmu);
        g->qhead = w->next;
        if (g->qhead == NULL) g->qtail = NULL;
        fsc_shm_work_release(w);
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
    g->engine_started = 1;
    return FSC_OK;
}

void fsc_shm_engine_stop(fsc_shm_group_t *g, double grace_s) {
    if (!g->engine_started) return;
    if (fsc_shm_check_owner(g) != FSC_OK) { /* a fork() child: no thread to join, the lock may be held */
        g->engine_started = 0;
        return;
    }
    pthread_mutex_lock(&g->qmu);
    g->stop = 1;
    pthread_cond_signal(&g->qcv);
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
    pthread_mutex_destroy(&g->qmu);
    pthread_cond_destroy(&g->qcv);
    g->engine_started = 0;
}

fsc_status_t fsc_shm_submit(fsc_shm_group_t *g, const fsc_shm_args_t *a, fsc_shm_work_t **out) {
    *out = NULL;
    FSC_CHECK(fsc_shm_check_owner(g));
    if (!g->engine_started) return fsc_error(FSC_ERR_INTERNAL, "shm group '%s': progress thread not started", g->name);
    fsc_shm_work_t *w = calloc(1, sizeof(*w));
    if (w == NULL) return fsc_error(FSC_ERR_NOMEM, "shm: out of memory queueing %s", fsc_comm_op_name(a->op));
    w->args = *a;
    atomic_store(&w->refs, 2); /* caller + queue */
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    pthread_mutex_lock(&g->qmu);
    if (g->qtail)
        g->qtail->next = w;
    else
        g->qhead = w;
    g->qtail = w;
    pthread_cond_signal(&g->qcv);
    pthread_mutex_unlock(&g->qmu);
    *out = w;
    return FSC_OK;
}

int fsc_shm_work_done(fsc_shm_work_t *w) {
    return atomic_load_explicit(&w->done, memory_order_acquire);
}

fsc_status_t fsc_shm_work_wait(fsc_shm_work_t *w, double timeout_s) {
    struct timespec abs = realtime_after(timeout_s >= 0 ? timeout_s : 0);
    pthread_mutex_lock(&w->mu);
    while (!atomic_load(&w->done)) {
        if (timeout_s < 0) {
            pthread_cond_wait(&w->cv, &w->mu);
        } else if (pthread_cond_timedwait(&w->cv, &w->mu, &abs) == ETIMEDOUT && !atomic_load(&w->done)) {
            pthread_mutex_unlock(&w->mu);
            return fsc_error(FSC_ERR_TIMEOUT, "Work.wait: %s did not complete within %g s (it is still running)",
                             fsc_comm_op_name(w->args.op), timeout_s);
        }
    }
    fsc_status_t st = w->st;
    pthread_mutex_unlock(&w->mu);
    if (st != FSC_OK) return fsc_error(st, "%s", w->msg);
    return FSC_OK;
}
