/* nccl_ops.c — the NCCL collectives and point-to-point calls: argument dtypes and reduce ops in
 * NCCL's terms, then one enqueue path (blocking communicators through the submitter thread,
 * non-blocking ones settled by polling) that counts each op for the watchdog. */
#include "comm/nccl_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"

/* ---- collectives ------------------------------------------------------------------------------ */

/* The NCCL dtype of a tensor the engine-wide rules (fsc_comm_check_call) have admitted, refusing
 * what the loaded NCCL is too old for. */
static fsc_status_t nccl_dtype(const fsc_tensor_t *t, fsc_comm_op_t op, int redop, int *nccl_dtype) {
    const char *opname = fsc_comm_op_name(op);
    if ((t->dtype == FSC_BFLOAT16 || redop == FSC_RED_AVG) && fsc_nccl_version_code < NCCL_MIN_VERSION_BF16_AVG)
        return fsc_error(FSC_ERR_UNAVAILABLE, "%s: %s needs NCCL >= 2.10.3, loaded %d", opname,
                         redop == FSC_RED_AVG ? "op avg" : "bfloat16", fsc_nccl_version_code);
    switch (t->dtype) {
        case FSC_FLOAT16: *nccl_dtype = NCCL_FLOAT16; break;
        case FSC_BFLOAT16: *nccl_dtype = NCCL_BFLOAT16; break;
        case FSC_FLOAT32: *nccl_dtype = NCCL_FLOAT32; break;
        case FSC_FLOAT64: *nccl_dtype = NCCL_FLOAT64; break;
        case FSC_INT32: *nccl_dtype = NCCL_INT32; break;
        case FSC_INT64: *nccl_dtype = NCCL_INT64; break;
        case FSC_UINT8: *nccl_dtype = NCCL_UINT8; break;
        /* admitted for ops that only move bytes (fsc_comm_check_dtype): NCCL copies them as a type of
         * the same size (it has no int16) */
        case FSC_INT8: *nccl_dtype = NCCL_INT8; break;
        case FSC_BOOL: *nccl_dtype = NCCL_UINT8; break;
        case FSC_INT16: *nccl_dtype = NCCL_FLOAT16; break;
        default: /* fsc_comm_check_dtype admitted a dtype this table lacks */
            return fsc_error(FSC_ERR_INTERNAL, "%s: no NCCL type for %s", opname, fsc_dtype_name(t->dtype));
    }
    return FSC_OK;
}

static int nccl_redop(fsc_reduce_op_t op) {
    switch (op) {
        case FSC_RED_AVG: return NCCL_AVG;
        case FSC_RED_MAX: return NCCL_MAX;
        case FSC_RED_MIN: return NCCL_MIN;
        default: return NCCL_SUM;
    }
}

/* Lock `c`, refuse a dead communicator, and make its device current. */
static fsc_status_t op_begin(fsc_nccl_comm_t *c, fsc_comm_op_t op, fsc_gpu_ctx_t *g) {
    fsc_status_t st;
    FSC_CHECK(fsc_nccl_check_owner(c, fsc_comm_op_name(op)));
    pthread_mutex_lock(&c->lock);
    if (c->state != COMM_ALIVE) {
        st = fsc_nccl_dead_error(c, fsc_comm_op_name(op));
        pthread_mutex_unlock(&c->lock);
        return st;
    }
    st = fsc_gpu_ctx_enter(c->device, g);
    if (st != FSC_OK) pthread_mutex_unlock(&c->lock);
    return st;
}

/* Settle the enqueue result `r` of an operation on `stream`, count and track it, restore the
 * context and unlock. */
static fsc_status_t op_end(fsc_nccl_comm_t *c, fsc_comm_op_t op, nccl_result_t r, fsc_stream_t stream,
                           fsc_gpu_ctx_t *g) {
    fsc_status_t st = fsc_nccl_settle_locked(c, r, fsc_comm_op_name(op), fsc_nccl_deadline_after(c->op_timeout), 0);
    if (st == FSC_OK) {
        c->last_op = op;
        c->nops++;
        fsc_nccl_track_locked(c, op, stream);
    }
    fsc_gpu_ctx_exit(g);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* The NCCL dtype of an operation that passed the engine's argument rules. */
static fsc_status_t op_dtype(const fsc_nccl_op_t *o, int *dt) {
    int reduces = o->op == FSC_OP_ALL_REDUCE || o->op == FSC_OP_REDUCE || o->op == FSC_OP_REDUCE_SCATTER;
    if (o->op == FSC_OP_BARRIER || o->op == FSC_OP_NONE)
        return fsc_error(FSC_ERR_VALUE, "%s cannot be enqueued on NCCL", fsc_comm_op_name(o->op));
    return nccl_dtype(o->tensor, o->op, reduces ? (int)o->redop : -1, dt);
}

/* The NCCL call of an operation that passed the argument rules, with dtype `dt`. */
static fsc_nccl_call_t call_of(const fsc_nccl_op_t *o, int dt) {
    const fsc_tensor_t *t = o->tensor;
    fsc_nccl_call_t k = {o->op, t->data, t->data, (size_t)t->numel, dt, nccl_redop(o->redop), o->peer};
    if (o->op == FSC_OP_ALL_GATHER) k.send = o->input->data, k.count = (size_t)o->input->numel;
    if (o->op == FSC_OP_REDUCE_SCATTER) k.send = o->input->data;
    return k;
}

/* After a submit that timed out: the call is still inside NCCL, and the submitter thread now owns
 * the NCCL communicator (it aborts it when the call returns). Mark `c` dead, let go of the thread,
 * restore the context and unlock. */
static fsc_status_t op_abandon(fsc_nccl_comm_t *c, fsc_comm_op_t op, fsc_gpu_ctx_t *g) {
    char msg[512];
    snprintf(msg, sizeof(msg),
             "nccl %s #%llu on rank %d of %d (cuda:%d): NCCL's enqueue did not return within %g s (a peer has not "
             "issued the matching operation, or has died); communicator abandoned",
             fsc_comm_op_name(op), (unsigned long long)c->nops + 1, c->rank, c->nranks, c->device, c->op_timeout);
    c->comm = NULL;
    fsc_nccl_abort_locked(c, msg);
    fsc_nccl_submitter_stop(c->submitter);
    c->submitter = NULL;
    fsc_gpu_ctx_exit(g);
    pthread_mutex_unlock(&c->lock);
    return fsc_error(FSC_ERR_TIMEOUT, "%s (the timeout is FAIRSCALE_C_TIMEOUT by default)", msg);
}

/* Check every op (nothing is enqueued unless all pass; `checked`: the caller has), then enqueue
 * them on `stream`; inside one ncclGroupStart/End when `grouped` (batches, and point-to-point, so
 * that NCCL can schedule a send/recv pair without deadlocking). `batch` prefixes argument errors
 * with the op's index. A copy (grouped only) is a send to this rank and a recv from it, which NCCL
 * runs as a local copy. A blocking communicator's calls run on its submitter thread, waited for up
 * to the timeout. */
static fsc_status_t enqueue(fsc_nccl_comm_t *c, const fsc_nccl_op_t *ops, size_t n, fsc_stream_t stream, int grouped,
                            int batch, int checked) {
    fsc_nccl_call_t calls[FSC_NCCL_MAX_BATCH];
    fsc_gpu_ctx_t g;
    size_t ncalls = n;
    for (size_t i = 0; i < n; i++) ncalls += ops[i].op == FSC_OP_COPY;
    if (ncalls > FSC_NCCL_MAX_BATCH)
        return fsc_error(FSC_ERR_VALUE, "batch: at most %d NCCL calls (a copy makes two), got %zu", FSC_NCCL_MAX_BATCH,
                         ncalls);
    if (batch && !checked)
        FSC_CHECK(fsc_comm_check_batch(ops, n, c->rank, c->nranks, FSC_DEV_CUDA, c->device));
    else if (n == 1 && !checked)
        FSC_CHECK(fsc_comm_check_call(&ops[0], c->rank, c->nranks, FSC_DEV_CUDA, c->device));
    for (size_t i = 0, k = 0; i < n; i++) {
        int dt = 0;
        FSC_CHECK(op_dtype(&ops[i], &dt));
        calls[k++] = call_of(&ops[i], dt);
        if (ops[i].op != FSC_OP_COPY) continue;
        if (!grouped) return fsc_error(FSC_ERR_INTERNAL, "nccl: a copy outside a group");
        fsc_nccl_call_t *send = &calls[k - 1], *recv = &calls[k++];
        *recv = *send;
        send->op = FSC_OP_SEND, send->send = send->recv = ops[i].input->data, send->peer = c->rank;
        recv->op = FSC_OP_RECV, recv->send = recv->recv = ops[i].tensor->data, recv->peer = c->rank;
    }
    if (n == 0) return FSC_OK;
    /* the op the watchdog names: the last one that involves a peer */
    size_t named = n - 1;
    while (named > 0 && ops[named].op == FSC_OP_COPY) named--;
    fsc_comm_op_t last = ops[named].op;
    n = ncalls;
    FSC_CHECK(op_begin(c, last, &g));
    nccl_result_t r = NCCL_OK;
    if (c->submitter == NULL) {
        r = fsc_nccl_issue_calls(c->comm, calls, n, grouped, (cuda_stream_h)stream, NULL);
    } else if (fsc_nccl_submit(c->submitter, calls, n, grouped, (cuda_stream_h)stream,
                               fsc_nccl_deadline_after(c->op_timeout), &r) != FSC_OK) {
        return op_abandon(c, last, &g);
    }
    return op_end(c, last, r, stream, &g);
}

fsc_status_t fsc_nccl_all_gather(fsc_nccl_comm_t *c, fsc_tensor_t *output, const fsc_tensor_t *input,
                                 fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_ALL_GATHER, output, input, FSC_RED_SUM, 0, 0};
    return enqueue(c, &o, 1, stream, 0, 0, 0);
}

fsc_status_t fsc_nccl_reduce_scatter(fsc_nccl_comm_t *c, fsc_tensor_t *output, const fsc_tensor_t *input,
                                     fsc_reduce_op_t op, fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_REDUCE_SCATTER, output, input, op, 0, 0};
    return enqueue(c, &o, 1, stream, 0, 0, 0);
}

fsc_status_t fsc_nccl_all_reduce(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, fsc_reduce_op_t op, fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_ALL_REDUCE, tensor, NULL, op, 0, 0};
    return enqueue(c, &o, 1, stream, 0, 0, 0);
}

fsc_status_t fsc_nccl_broadcast(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, int root, fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_BROADCAST, tensor, NULL, FSC_RED_SUM, root, 0};
    return enqueue(c, &o, 1, stream, 0, 0, 0);
}

fsc_status_t fsc_nccl_reduce(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, fsc_reduce_op_t op, int root,
                             fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_REDUCE, tensor, NULL, op, root, 0};
    return enqueue(c, &o, 1, stream, 0, 0, 0);
}

fsc_status_t fsc_nccl_send(fsc_nccl_comm_t *c, const fsc_tensor_t *tensor, int peer, int32_t tag, fsc_stream_t stream) {
    /* the send only reads `tensor`; the op struct is shared with the writing ops */
    fsc_nccl_op_t o = {FSC_OP_SEND, (fsc_tensor_t *)tensor, NULL, FSC_RED_SUM, peer, tag};
    return enqueue(c, &o, 1, stream, 1, 0, 0);
}

fsc_status_t fsc_nccl_recv(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, int peer, int32_t tag, fsc_stream_t stream) {
    fsc_nccl_op_t o = {FSC_OP_RECV, tensor, NULL, FSC_RED_SUM, peer, tag};
    return enqueue(c, &o, 1, stream, 1, 0, 0);
}

fsc_status_t fsc_nccl_batch(fsc_nccl_comm_t *c, const fsc_nccl_op_t *ops, size_t n, fsc_stream_t stream) {
    return enqueue(c, ops, n, stream, 1, 1, 0);
}

fsc_status_t fsc_nccl_all_to_all(fsc_nccl_comm_t *c, const fsc_nccl_op_t *ops, size_t n, fsc_stream_t stream) {
    if (2 * (size_t)c->nranks > FSC_NCCL_MAX_BATCH) /* a send and a recv per rank, the own block's included */
        return fsc_error(FSC_ERR_VALUE,
                         "all_to_all_single on NCCL: at most %d ranks (one NCCL group of %d calls), the group has %d",
                         FSC_NCCL_MAX_BATCH / 2, FSC_NCCL_MAX_BATCH, c->nranks);
    return enqueue(c, ops, n, stream, 1, 1, 1);
}
