/* nccl_submit.c — the NCCL backend's submitter: a thread per blocking communicator that makes
 * its NCCL calls, so that the caller's wait for an enqueue has a deadline.
 *
 * A blocking communicator (config.blocking = 1) launches each call on the calling thread, about
 * as fast as torch's process group; a non-blocking one starts a thread of NCCL's for every call
 * and costs more than the call itself. But a blocking enqueue may wait for a peer (NCCL connects
 * to a peer at the first operation that needs the connection), and a peer that never issues the
 * matching operation would then keep the caller inside NCCL for good. So the calls of a blocking
 * communicator run here, handed over one enqueue at a time, while the caller waits up to its
 * deadline. A caller that gives up marks the communicator dead and leaves the thread to it: when
 * NCCL's call returns, if ever, the thread aborts the communicator and exits. NCCL is never
 * entered by two threads on one communicator at once, so nothing is aborted under a running call.
 *
 * Hand-over: the caller (holding c->lock) fills the job and bumps `posted`; the thread spins a
 * while after each job before it sleeps on the condition variable, so back-to-back operations do
 * not pay a wake-up. The caller polls `done`. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "comm/nccl_internal.h"

#define SUBMIT_SPIN_S 200e-6 /* how long the thread polls for the next job before it sleeps */

struct fsc_nccl_submitter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* the communicator and the thread; the last to let go frees it (under mu) */
    int stop, abandoned;
    _Atomic int sleeping;
    _Atomic uint64_t posted, done; /* job numbers: posted by the caller, finished by the thread */
    nccl_comm_h comm;
    int device, rank;
    pthread_t thread;
    /* the job: copies of the arguments, so that an abandoned job never reads the caller's memory */
    fsc_nccl_call_t calls[FSC_NCCL_MAX_BATCH];
    size_t n;
    int grouped;
    cuda_stream_h stream;
    nccl_result_t r;
};

/* Drop one reference; called with s->mu held, returns with it released. */
static void submitter_release(fsc_nccl_submitter_t *s) {
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (!last) return;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static int abandoned(fsc_nccl_submitter_t *s) {
    pthread_mutex_lock(&s->mu);
    int a = s->abandoned;
    pthread_mutex_unlock(&s->mu);
    return a;
}

static nccl_result_t issue(nccl_comm_h comm, const fsc_nccl_call_t *k, cuda_stream_h st) {
    switch (k->op) {
        case FSC_OP_ALL_GATHER: return fsc_nccl_api.AllGather(k->send, k->recv, k->count, k->dt, comm, st);
        case FSC_OP_REDUCE_SCATTER:
            return fsc_nccl_api.ReduceScatter(k->send, k->recv, k->count, k->dt, k->redop, comm, st);
        case FSC_OP_ALL_REDUCE: return fsc_nccl_api.AllReduce(k->send, k->recv, k->count, k->dt, k->redop, comm, st);
        case FSC_OP_BROADCAST: return fsc_nccl_api.Broadcast(k->send, k->recv, k->count, k->dt, k->peer, comm, st);
        case FSC_OP_REDUCE: return fsc_nccl_api.Reduce(k->send, k->recv, k->count, k->dt, k->redop, k->peer, comm, st);
        case FSC_OP_SEND: return fsc_nccl_api.Send(k->send, k->count, k->dt, k->peer, comm, st);
        default: return fsc_nccl_api.Recv(k->recv, k->count, k->dt, k->peer, comm, st);
    }
}

nccl_result_t fsc_nccl_issue_calls(nccl_comm_h comm, const fsc_nccl_call_t *calls, size_t n, int grouped,
                                   cuda_stream_h stream, fsc_nccl_submitter_t *s) {
    nccl_result_t r = grouped ? fsc_nccl_api.GroupStart() : NCCL_OK;
    if (r != NCCL_OK) return r;
    nccl_result_t first = NCCL_OK;
    for (size_t i = 0; i < n; i++) {
        /* a caller that gave up wants no more of its operations launched */
        if (s != NULL && i > 0 && abandoned(s)) break;
        nccl_result_t ri = issue(comm, &calls[i], stream);
        if (ri != NCCL_OK && ri != NCCL_IN_PROGRESS && first == NCCL_OK) first = ri;
        if (!grouped) r = ri;
    }
    if (grouped) {
        r = fsc_nccl_api.GroupEnd(); /* always close the group, even after a failed call inside it */
        if (first != NCCL_OK) r = first;
    }
    return r;
}

/* Wait for a job newer than `seen`, or for stop; 1 when there is a job. */
static int next_job(fsc_nccl_submitter_t *s, uint64_t seen) {
    double since = fsc_comm_now();
    while (atomic_load(&s->posted) == seen) {
        if (fsc_comm_now() - since < SUBMIT_SPIN_S) {
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&s->mu);
        atomic_store(&s->sleeping, 1);
        while (atomic_load(&s->posted) == seen && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        atomic_store(&s->sleeping, 0);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) return atomic_load(&s->posted) != seen;
    }
    return 1;
}

static void *submitter_main(void *arg) {
    fsc_nccl_submitter_t *s = arg;
    pthread_setname_np(pthread_self(), "fsc_nccl_submit");
    fsc_log_set_rank(s->rank);
    fsc_gpu_ctx_t g;
    int entered = fsc_gpu_ctx_enter(s->device, &g) == FSC_OK; /* NCCL launches on the current device */
    uint64_t seen = 0;
    while (next_job(s, seen)) {
        seen = atomic_load(&s->posted);
        nccl_result_t r =
            entered ? fsc_nccl_issue_calls(s->comm, s->calls, s->n, s->grouped, s->stream, s) : NCCL_INTERNAL_ERROR;
        pthread_mutex_lock(&s->mu);
        s->r = r;
        atomic_store(&s->done, seen);
        int gone = s->abandoned;
        pthread_mutex_unlock(&s->mu);
        if (gone) {
            /* Its caller timed out and marked the communicator dead; this thread alone holds it. */
            FSC_WARN("nccl", "rank %d: an abandoned enqueue returned; aborting its communicator", s->rank);
            fsc_nccl_api.CommAbort(s->comm);
            break;
        }
    }
    if (entered) fsc_gpu_ctx_exit(&g);
    pthread_mutex_lock(&s->mu);
    submitter_release(s);
    return NULL;
}

fsc_status_t fsc_nccl_submitter_start(nccl_comm_h comm, int device, int rank, fsc_nccl_submitter_t **out) {
    fsc_nccl_submitter_t *s = calloc(1, sizeof(*s));
    if (s == NULL) return fsc_error(FSC_ERR_NOMEM, "nccl init: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->refs = 2;
    s->comm = comm, s->device = device, s->rank = rank;
    int rc = pthread_create(&s->thread, NULL, submitter_main, s);
    if (rc != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return fsc_error(FSC_ERR_SYSTEM, "nccl init: cannot start the submitter thread: %s", strerror(rc));
    }
    *out = s;
    return FSC_OK;
}

fsc_status_t fsc_nccl_submit(fsc_nccl_submitter_t *s, const fsc_nccl_call_t *calls, size_t n, int grouped,
                             cuda_stream_h stream, double deadline, nccl_result_t *r) {
    memcpy(s->calls, calls, n * sizeof(*calls));
    s->n = n, s->grouped = grouped, s->stream = stream;
    uint64_t job = atomic_load(&s->posted) + 1;
    atomic_store(&s->posted, job);
    if (atomic_load(&s->sleeping)) {
        pthread_mutex_lock(&s->mu);
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    double since = fsc_comm_now();
    while (atomic_load(&s->done) != job) {
        if (fsc_comm_now() > deadline) {
            pthread_mutex_lock(&s->mu);
            int finished = atomic_load(&s->done) == job;
            if (!finished) s->abandoned = 1;
            pthread_mutex_unlock(&s->mu);
            if (finished) break;
            return FSC_ERR_TIMEOUT; /* the caller now lets go of `s` (fsc_nccl_submitter_stop) */
        }
        fsc_nccl_backoff(since);
    }
    *r = s->r;
    return FSC_OK;
}

void fsc_nccl_submitter_stop(fsc_nccl_submitter_t *s) {
    if (s == NULL) return;
    pthread_mutex_lock(&s->mu);
    int stuck = s->abandoned;
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_t t = s->thread;
    if (stuck) {
        pthread_detach(t); /* inside NCCL, maybe for good: it frees `s` when it gets out */
        submitter_release(s);
        return;
    }
    pthread_mutex_unlock(&s->mu);
    pthread_join(t, NULL);
    pthread_mutex_lock(&s->mu);
    submitter_release(s);
}
