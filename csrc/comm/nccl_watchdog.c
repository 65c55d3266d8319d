/* nccl_watchdog.c — the NCCL backend's watchdog: a thread per communicator that aborts it when
 * NCCL reports an asynchronous error or an enqueued operation outlives the timeout. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "comm/nccl_internal.h"

/* ---- watchdog ----------------------------------------------------------------------------------
 * FSDP on CUDA never waits on the host, so a peer that dies mid-collective would otherwise leave
 * this rank's NCCL kernels spinning, and the next loss.item() or synchronize() blocked for good.
 * Each enqueued operation is followed by an event; a thread per communicator checks every
 * 100 ms the communicator's asynchronous error state and the age of the oldest operation whose
 * event has not fired. An error, or an operation older than the timeout, aborts the
 * communicator: NCCL's kernels then return, the blocked host call comes back, and the next call
 * on the communicator raises with the reason. Everything below runs under c->lock. */

/* Drop the operations at the head of the ring that have completed. */
static void reap_locked(fsc_nccl_comm_t *c) {
    while (c->pend_count > 0) {
        pending_op_t *p = &c->pending[c->pend_head];
        int done = 0;
        if (fsc_gpu_event_query(c->device, p->ev, &done) == FSC_OK && !done) return;
        fsc_gpu_event_destroy(c->device, p->ev); /* done, or unqueryable: stop tracking it */
        c->pend_head = (c->pend_head + 1) % WD_MAX_PENDING;
        c->pend_count--;
    }
}

/* Record an event after the operation just enqueued on `stream`. Never fails the operation:
 * when the ring is full or the event cannot be made, the operation goes untracked (an older
 * tracked one still exposes a hang). */
void fsc_nccl_track_locked(fsc_nccl_comm_t *c, fsc_comm_op_t op, fsc_stream_t stream) {
    fsc_gpu_event_t ev = NULL;
    reap_locked(c);
    if (c->pending == NULL || c->pend_count == WD_MAX_PENDING ||
        fsc_gpu_event_record(c->device, stream, &ev) != FSC_OK) {
        if (c->untracked++ == 0)
            FSC_WARN("nccl", "rank %d of %d: watchdog cannot track %s #%llu (%s)", c->rank, c->nranks,
                     fsc_comm_op_name(op), (unsigned long long)c->nops,
                     c->pend_count == WD_MAX_PENDING ? "too many pending operations" : fsc_last_error());
        return;
    }
    pending_op_t *p = &c->pending[(c->pend_head + c->pend_count) % WD_MAX_PENDING];
    p->ev = ev;
    p->op = op;
    p->seq = c->nops;
    p->t = fsc_comm_now();
    c->pend_count++;
}

static void watchdog_check_locked(fsc_nccl_comm_t *c) {
    fsc_gpu_ctx_t g;
    if (fsc_gpu_ctx_enter(c->device, &g) != FSC_OK) return;
    nccl_result_t async = NCCL_OK;
    nccl_result_t q = fsc_nccl_api.CommGetAsyncError(c->comm, &async);
    nccl_result_t r = q != NCCL_OK ? q : async;
    if (r != NCCL_OK && r != NCCL_IN_PROGRESS) {
        char what[96];
        snprintf(what, sizeof(what), "operation (watchdog, after %s #%llu)", fsc_comm_op_name(c->last_op),
                 (unsigned long long)c->nops);
        fsc_nccl_fail_locked(c, r, what, 1);
    } else {
        reap_locked(c);
        if (c->pend_count > 0) {
            const pending_op_t *p = &c->pending[c->pend_head];
            double age = fsc_comm_now() - p->t;
            if (age > c->op_timeout) {
                char msg[384];
                snprintf(msg, sizeof(msg),
                         "nccl watchdog on rank %d of %d (cuda:%d): %s #%llu has not completed %.1f s after it "
                         "was enqueued (timeout %g s, FAIRSCALE_C_TIMEOUT); a peer has probably died or stopped "
                         "issuing collectives",
                         c->rank, c->nranks, c->device, fsc_comm_op_name(p->op), (unsigned long long)p->seq, age,
                         c->op_timeout);
                fsc_nccl_abort_locked(c, msg);
            }
        }
    }
    fsc_gpu_ctx_exit(&g);
}

/* Set at process exit: the driver and NCCL may be tearing down, so watchdogs stop touching them. */
static _Atomic int wd_exiting;
static pthread_once_t wd_atexit_once = PTHREAD_ONCE_INIT;
static void wd_at_exit(void) {
    atomic_store(&wd_exiting, 1);
}
static void wd_register_atexit(void) {
    atexit(wd_at_exit);
}

static void *watchdog_main(void *arg) {
    fsc_nccl_comm_t *c = arg;
    pthread_setname_np(pthread_self(), "fsc_nccl_wd");
    fsc_log_set_rank(c->rank);
    pthread_mutex_lock(&c->lock);
    while (!c->wd_stop && c->state == COMM_ALIVE) {
        struct timespec abs;
        clock_gettime(CLOCK_REALTIME, &abs);
        abs.tv_nsec += WD_POLL_NS;
        if (abs.tv_nsec >= 1000000000L) {
            abs.tv_sec++;
            abs.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->wd_cv, &c->lock, &abs);
        if (!c->wd_stop && c->state == COMM_ALIVE && !atomic_load(&wd_exiting)) watchdog_check_locked(c);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

fsc_status_t fsc_nccl_watchdog_start(fsc_nccl_comm_t *c) {
    pthread_once(&wd_atexit_once, wd_register_atexit);
    int rc = pthread_create(&c->wd_thread, NULL, watchdog_main, c);
    if (rc != 0) return fsc_error(FSC_ERR_SYSTEM, "nccl init: cannot start the watchdog thread: %s", strerror(rc));
    c->wd_started = 1;
    return FSC_OK;
}

/* Stop and join the watchdog (idempotent), then release the events it still tracked. */
void fsc_nccl_watchdog_stop(fsc_nccl_comm_t *c) {
    pthread_mutex_lock(&c->lock);
    int started = c->wd_started;
    c->wd_stop = 1;
    c->wd_started = 0;
    pthread_cond_broadcast(&c->wd_cv);
    pthread_mutex_unlock(&c->lock);
    if (started) pthread_join(c->wd_thread, NULL);
    for (; c->pend_count > 0; c->pend_count--) {
        fsc_gpu_event_destroy(c->device, c->pending[c->pend_head].ev);
        c->pend_head = (c->pend_head + 1) % WD_MAX_PENDING;
    }
}

/* Under c->lock: wait until every tracked operation of `c` has completed, or abort it and return
 * FSC_ERR_TIMEOUT once `deadline` passes. */
fsc_status_t fsc_nccl_drain_locked(fsc_nccl_comm_t *c, double deadline) {
    double since = fsc_comm_now();
    for (reap_locked(c); c->pend_count > 0; reap_locked(c)) {
        if (fsc_comm_now() > deadline) {
            char msg[256];
            snprintf(msg, sizeof(msg), "nccl destroy on rank %d of %d (cuda:%d): %zu operation(s) still running",
                     c->rank, c->nranks, c->device, c->pend_count);
            fsc_nccl_abort_locked(c, msg);
            return fsc_error(FSC_ERR_TIMEOUT, "%s; communicator aborted", msg);
        }
        fsc_nccl_backoff(since);
    }
    return FSC_OK;
}
