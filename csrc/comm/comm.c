/* comm.c — op names, header comparison, the timeout setting, the argument rules and the all-to-all
 * plan shared by all backends. */
#include "comm/comm.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"

const char *fsc_comm_op_name(fsc_comm_op_t op) {
    switch (op) {
        case FSC_OP_NONE: return "none";
        case FSC_OP_BARRIER: return "barrier";
        case FSC_OP_ALL_GATHER: return "all_gather";
        case FSC_OP_REDUCE_SCATTER: return "reduce_scatter";
        case FSC_OP_ALL_REDUCE: return "all_reduce";
        case FSC_OP_BROADCAST: return "broadcast";
        case FSC_OP_REDUCE: return "reduce";
        case FSC_OP_SEND: return "send";
        case FSC_OP_RECV: return "recv";
        case FSC_OP_COPY: return "copy";
        case FSC_NUM_OPS: break;
    }
    return "unknown-op";
}

const char *fsc_reduce_op_name(fsc_reduce_op_t op) {
    switch (op) {
        case FSC_RED_SUM: return "sum";
        case FSC_RED_AVG: return "avg";
        case FSC_RED_MAX: return "max";
        case FSC_RED_MIN: return "min";
        case FSC_NUM_REDS: break;
    }
    return "unknown-reduce-op";
}

fsc_status_t fsc_reduce_op_parse(const char *name, fsc_reduce_op_t *out) {
    for (int i = 0; i < FSC_NUM_REDS; i++) {
        if (name != NULL && strcmp(name, fsc_reduce_op_name((fsc_reduce_op_t)i)) == 0) {
            *out = (fsc_reduce_op_t)i;
            return FSC_OK;
        }
    }
    return fsc_error(FSC_ERR_VALUE, "op: expected one of 'sum', 'avg', 'max', 'min', got '%s'", name ? name : "(null)");
}

fsc_status_t fsc_comm_timeout_get(double *out) {
    const char *s = getenv("FAIRSCALE_C_TIMEOUT");
    if (s == NULL || *s == '\0') {
        *out = FSC_COMM_TIMEOUT_DEFAULT_S;
        return FSC_OK;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    /* !(v > 0) also refuses NaN; ERANGE is an overflow to HUGE_VAL or an underflow to ~0. */
    if (end == s || *end != '\0' || errno == ERANGE || !(v > 0.0) || v > FSC_COMM_TIMEOUT_MAX_S)
        return fsc_error(FSC_ERR_VALUE,
                         "FAIRSCALE_C_TIMEOUT='%.64s' is not a valid timeout: expected a finite number of seconds "
                         "> 0 and <= 1e9 (default %g when unset)",
                         s, FSC_COMM_TIMEOUT_DEFAULT_S);
    *out = v;
    return FSC_OK;
}

double fsc_comm_timeout_s(void) {
    double v = FSC_COMM_TIMEOUT_DEFAULT_S;
    if (fsc_comm_timeout_get(&v) != FSC_OK) FSC_WARN("comm", "%s; using %g", fsc_last_error(), v);
    return v;
}

fsc_status_t fsc_comm_check_blocks(const char *op, const char *whole_name, int64_t whole, const char *part_name,
                                   int64_t part, int size) {
    int64_t want;
    if (size > 0 && part >= 0 && !__builtin_mul_overflow(part, (int64_t)size, &want) && want == whole) return FSC_OK;
    if (size > 0 && part >= 0 && !__builtin_mul_overflow(part, (int64_t)size, &want))
        return fsc_error(FSC_ERR_VALUE,
                         "%s: %s has %lld elements; expected group size (%d) x %s elements (%lld) = %lld", op,
                         whole_name, (long long)whole, size, part_name, (long long)part, (long long)want);
    return fsc_error(FSC_ERR_VALUE,
                     "%s: %s has %lld elements; expected group size (%d) x %s elements (%lld), which overflows int64",
                     op, whole_name, (long long)whole, size, part_name, (long long)part);
}

double fsc_comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void fsc_comm_header_format(const fsc_comm_header_t *h, char *buf, size_t cap) {
    fsc_comm_op_t op = (fsc_comm_op_t)h->op;
    if (op == FSC_OP_NONE) { /* a rank that has not entered any op of the group */
        snprintf(buf, cap, "no op yet");
        return;
    }
    const char *dt = h->dtype < FSC_NUM_DTYPES ? fsc_dtype_name((fsc_dtype_t)h->dtype) : "?";
    int n = snprintf(buf, cap, "%s(count=%llu, dtype=%s", fsc_comm_op_name(op), (unsigned long long)h->count, dt);
    if (n < 0 || (size_t)n >= cap) return;
    if (op == FSC_OP_ALL_REDUCE || op == FSC_OP_REDUCE || op == FSC_OP_REDUCE_SCATTER)
        n += snprintf(buf + n, cap - (size_t)n, ", op=%s", fsc_reduce_op_name((fsc_reduce_op_t)h->redop));
    if ((size_t)n >= cap) return;
    if (op == FSC_OP_BROADCAST || op == FSC_OP_REDUCE)
        n += snprintf(buf + n, cap - (size_t)n, ", root=%d", h->root);
    else if (op == FSC_OP_SEND || op == FSC_OP_RECV)
        n += snprintf(buf + n, cap - (size_t)n, ", peer=%d, tag=%d", h->root, h->tag);
    if ((size_t)n >= cap) return;
    snprintf(buf + n, cap - (size_t)n, ", seq=%llu)", (unsigned long long)h->seq);
}

fsc_status_t fsc_comm_header_check(const char *group, int rank_a, const fsc_comm_header_t *a, int rank_b,
                                   const fsc_comm_header_t *b) {
    if (a->op == b->op && a->count == b->count && a->dtype == b->dtype && a->redop == b->redop && a->root == b->root &&
        a->seq == b->seq)
        return FSC_OK;
    char da[160], db[160];
    fsc_comm_header_format(a, da, sizeof(da));
    fsc_comm_header_format(b, db, sizeof(db));
    return fsc_error(FSC_ERR_MISMATCH, "collective mismatch in group '%s': rank %d called %s but rank %d called %s",
                     group, rank_a, da, rank_b, db);
}

fsc_status_t fsc_comm_check_dtype(fsc_dtype_t dt, int redop, const char *opname, const char *argname) {
    if (redop < 0 && (unsigned)dt < FSC_NUM_DTYPES) return FSC_OK; /* the op only moves bytes */
    switch (dt) {
        case FSC_FLOAT16:
        case FSC_BFLOAT16:
        case FSC_FLOAT32:
        case FSC_FLOAT64: return FSC_OK;
        case FSC_INT32:
        case FSC_INT64:
        case FSC_UINT8:
            if (redop == FSC_RED_AVG)
                return fsc_error(FSC_ERR_VALUE,
                                 "%s: %s has dtype %s; op='avg' needs a floating dtype "
                                 "(float16, bfloat16, float32, float64)",
                                 opname, argname, fsc_dtype_name(dt));
            return FSC_OK;
        default: break;
    }
    return fsc_error(FSC_ERR_VALUE,
                     "%s: %s has dtype %s; a reduction takes one of float16, bfloat16, float32, float64, "
                     "int32, int64, uint8",
                     opname, argname, (unsigned)dt < FSC_NUM_DTYPES ? fsc_dtype_name(dt) : "?");
}

/* ---- argument rules ------------------------------------------------------------------------- */

static const char *device_name(int device_type) {
    return device_type == FSC_DEV_CUDA ? "cuda" : "cpu";
}

static fsc_status_t check_tensor(const fsc_tensor_t *t, const char *op, const char *arg, int writable, int redop,
                                 int device_type, int device_id) {
    if (t->device_type != device_type)
        return fsc_error(FSC_ERR_VALUE, "%s: %s is on %s; expected a %s tensor", op, arg, device_name(t->device_type),
                         device_name(device_type));
    if (device_id >= 0 && t->device_id != device_id)
        return fsc_error(FSC_ERR_VALUE, "%s: %s is on %s:%d but the communicator is on %s:%d", op, arg,
                         device_name(device_type), t->device_id, device_name(device_type), device_id);
    if (!fsc_tensor_is_contiguous(t))
        return fsc_error(FSC_ERR_VALUE, "%s: argument '%s' must be contiguous (call .contiguous() first)", op, arg);
    if (writable && t->readonly)
        return fsc_error(FSC_ERR_VALUE, "%s: argument '%s' is read-only; expected writable memory", op, arg);
    if (t->numel > 0 && t->data == NULL) return fsc_error(FSC_ERR_VALUE, "%s: %s has no data", op, arg);
    return fsc_comm_check_dtype(t->dtype, redop, op, arg);
}

static fsc_status_t check_rank(const char *op, const char *arg, int r, int rank, int size, int not_self) {
    if (r < 0 || r >= size || (not_self && r == rank))
        return fsc_error(FSC_ERR_VALUE, "%s: %s=%d is not a valid group rank (expected 0 <= %s < %d%s)", op, arg, r,
                         arg, size, not_self ? " and not this rank" : "");
    return FSC_OK;
}

/* Byte ranges [a, a + na) and [b, b + nb) share a byte. */
static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    const uint8_t *pa = a, *pb = b;
    return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

/* all_gather / reduce_scatter: `big` is size x `small`; they may share memory only when `small`
 * is exactly this rank's block of `big`. */
static fsc_status_t check_blocks(const char *op, const fsc_tensor_t *big, const char *big_arg,
                                 const fsc_tensor_t *small, const char *small_arg, int rank, int size) {
    if (big->dtype != small->dtype)
        return fsc_error(FSC_ERR_VALUE, "%s: output has dtype %s but input has dtype %s; expected the same dtype", op,
                         fsc_dtype_name(!strcmp(big_arg, "output") ? big->dtype : small->dtype),
                         fsc_dtype_name(!strcmp(big_arg, "output") ? small->dtype : big->dtype));
    FSC_CHECK(fsc_comm_check_blocks(op, big_arg, big->numel, small_arg, small->numel, size));
    size_t nb_small = fsc_tensor_nbytes(small), nb_big = fsc_tensor_nbytes(big);
    const uint8_t *own = (const uint8_t *)big->data + (size_t)rank * nb_small;
    if (overlaps(big->data, nb_big, small->data, nb_small) && (const uint8_t *)small->data != own)
        return fsc_error(FSC_ERR_VALUE,
                         "%s: %s overlaps %s but is not this rank's block of it; for the in-place form pass %s = "
                         "%s[rank * n:(rank + 1) * n] (rank %d)",
                         op, small_arg, big_arg, small_arg, big_arg, rank);
    return FSC_OK;
}

/* An op of one output and one input of the same dtype (a copy, an all-to-all) that share no
 * memory. */
static fsc_status_t check_pair(const char *op, const fsc_tensor_t *out, const fsc_tensor_t *in) {
    if (out->dtype != in->dtype)
        return fsc_error(FSC_ERR_VALUE, "%s: output is %s but input is %s; expected the same dtype", op,
                         fsc_dtype_name(out->dtype), fsc_dtype_name(in->dtype));
    if (overlaps(out->data, fsc_tensor_nbytes(out), in->data, fsc_tensor_nbytes(in)))
        return fsc_error(FSC_ERR_VALUE, "%s: output overlaps input; expected disjoint tensors", op);
    return FSC_OK;
}

static int is_p2p(fsc_comm_op_t op) {
    return op == FSC_OP_SEND || op == FSC_OP_RECV;
}

fsc_status_t fsc_comm_check_call(const fsc_comm_call_t *c, int rank, int size, int device_type, int device_id) {
    const char *op = fsc_comm_op_name(c->op);
    int redop =
        (c->op == FSC_OP_ALL_REDUCE || c->op == FSC_OP_REDUCE || c->op == FSC_OP_REDUCE_SCATTER) ? (int)c->redop : -1;
    if (redop >= FSC_NUM_REDS) return fsc_error(FSC_ERR_VALUE, "%s: unknown reduce op %d", op, redop);
    if (c->tag != 0 && !is_p2p(c->op))
        return fsc_error(FSC_ERR_VALUE, "%s: tag=%d given; only send and recv take a tag", op, (int)c->tag);
    if (c->op == FSC_OP_BARRIER) return FSC_OK;
    if (c->op <= FSC_OP_NONE || c->op >= FSC_NUM_OPS) return fsc_error(FSC_ERR_VALUE, "unknown op %d", (int)c->op);
    if (c->tag != 0 && device_type == FSC_DEV_CUDA)
        return fsc_error(FSC_ERR_VALUE,
                         "%s: tag=%d is not supported for CUDA tensors (NCCL has no message tags); expected tag=0", op,
                         (int)c->tag);
    if (c->tensor == NULL) return fsc_error(FSC_ERR_VALUE, "%s needs a tensor", op);
    switch (c->op) {
        case FSC_OP_ALL_GATHER:
        case FSC_OP_REDUCE_SCATTER: {
            if (c->input == NULL) return fsc_error(FSC_ERR_VALUE, "%s needs an input", op);
            FSC_CHECK(check_tensor(c->tensor, op, "output", 1, redop, device_type, device_id));
            FSC_CHECK(check_tensor(c->input, op, "input", 0, redop, device_type, device_id));
            if (c->op == FSC_OP_ALL_GATHER) return check_blocks(op, c->tensor, "output", c->input, "input", rank, size);
            return check_blocks(op, c->input, "input", c->tensor, "output", rank, size);
        }
        case FSC_OP_COPY: {
            if (c->input == NULL) return fsc_error(FSC_ERR_VALUE, "%s needs an input", op);
            FSC_CHECK(check_tensor(c->tensor, op, "output", 1, -1, device_type, device_id));
            FSC_CHECK(check_tensor(c->input, op, "input", 0, -1, device_type, device_id));
            if (c->tensor->numel != c->input->numel)
                return fsc_error(FSC_ERR_VALUE, "%s: output has %lld elements but input has %lld; expected the same",
                                 op, (long long)c->tensor->numel, (long long)c->input->numel);
            return check_pair(op, c->tensor, c->input);
        }
        case FSC_OP_BROADCAST:
        case FSC_OP_REDUCE: FSC_CHECK(check_rank(op, "root", c->peer, rank, size, 0)); break;
        case FSC_OP_SEND: FSC_CHECK(check_rank(op, "dst", c->peer, rank, size, 1)); break;
        case FSC_OP_RECV: FSC_CHECK(check_rank(op, "src", c->peer, rank, size, 1)); break;
        default: break;
    }
    return check_tensor(c->tensor, op, "tensor", c->op != FSC_OP_SEND, redop, device_type, device_id);
}

/* The bytes call `c` writes (*w) and reads besides them (*r). */
static void call_extents(const fsc_comm_call_t *c, const void **w, size_t *nw, const void **r, size_t *nr) {
    *w = *r = NULL;
    *nw = *nr = 0;
    if (c->tensor == NULL) return;
    if (c->op == FSC_OP_SEND) {
        *r = c->tensor->data;
        *nr = fsc_tensor_nbytes(c->tensor);
        return;
    }
    *w = c->tensor->data;
    *nw = fsc_tensor_nbytes(c->tensor);
    if (c->input != NULL) {
        *r = c->input->data;
        *nr = fsc_tensor_nbytes(c->input);
    }
}

fsc_status_t fsc_comm_check_batch(const fsc_comm_call_t *calls, size_t n, int rank, int size, int device_type,
                                  int device_id) {
    for (size_t i = 0; i < n; i++) {
        if (fsc_comm_check_call(&calls[i], rank, size, device_type, device_id) != FSC_OK) {
            char why[512]; /* fsc_error formats into the buffer fsc_last_error returns */
            snprintf(why, sizeof(why), "%s", fsc_last_error());
            return fsc_error(FSC_ERR_VALUE, "batch operation %zu: %s", i, why);
        }
    }
    for (size_t i = 0; i < n; i++) {
        const void *wi, *ri;
        size_t nwi, nri;
        call_extents(&calls[i], &wi, &nwi, &ri, &nri);
        for (size_t j = 0; j < n; j++) {
            /* collectives of a batch run in list order; point-to-point runs beside everything */
            if (j == i || !(is_p2p(calls[i].op) || is_p2p(calls[j].op))) continue;
            const void *wj, *rj;
            size_t nwj, nrj;
            call_extents(&calls[j], &wj, &nwj, &rj, &nrj);
            if (overlaps(wi, nwi, wj, nwj) || overlaps(wi, nwi, rj, nrj))
                return fsc_error(FSC_ERR_VALUE,
                                 "batch: operation %zu (%s) writes memory that operation %zu (%s) also uses; expected "
                                 "disjoint tensors",
                                 i, fsc_comm_op_name(calls[i].op), j, fsc_comm_op_name(calls[j].op));
        }
    }
    return FSC_OK;
}

/* ---- all-to-all ------------------------------------------------------------------------------ */

/* Elements in one dim-0 row of `t` (the product of its other dims); -1 when that overflows. */
static int64_t row_numel(const fsc_tensor_t *t) {
    int64_t n = 1;
    for (int d = 1; d < t->ndim; d++)
        if (__builtin_mul_overflow(n, t->shape[d], &n)) return -1;
    return n;
}

/* The dim-0 rows of `t` per rank: `given` (NULL: equal blocks), summing to dim 0. */
static fsc_status_t split_rows(const char *op, const char *argname, const fsc_tensor_t *t, const int64_t *given,
                               int size, int64_t *rows) {
    int64_t dim0 = t->shape[0], sum = 0;
    if (given == NULL) {
        if (dim0 % size)
            return fsc_error(
                FSC_ERR_VALUE,
                "%s: %s is not given, so dim 0 of the tensor (%lld) must divide evenly over the group's %d "
                "ranks",
                op, argname, (long long)dim0, size);
        for (int j = 0; j < size; j++) rows[j] = dim0 / size;
        return FSC_OK;
    }
    for (int j = 0; j < size; j++) {
        if (given[j] < 0)
            return fsc_error(FSC_ERR_VALUE, "%s: argument '%s' must hold %d ints >= 0, got %lld at index %d", op,
                             argname, size, (long long)given[j], j);
        if (__builtin_add_overflow(sum, given[j], &sum))
            return fsc_error(FSC_ERR_VALUE,
                             "%s: argument '%s' sums past the largest int64 (at index %d); expected dim 0 of the "
                             "tensor (%lld)",
                             op, argname, j, (long long)dim0);
        rows[j] = given[j];
    }
    if (sum != dim0)
        return fsc_error(FSC_ERR_VALUE, "%s: argument '%s' sums to %lld; expected dim 0 of the tensor (%lld)", op,
                         argname, (long long)sum, (long long)dim0);
    return FSC_OK;
}

/* A flat view of `count` elements of contiguous `t`, from element `offset`. */
static fsc_tensor_t flat_block(const fsc_tensor_t *t, int64_t offset, int64_t count) {
    fsc_tensor_t v = *t;
    if (t->data != NULL) v.data = (uint8_t *)t->data + (size_t)offset * fsc_dtype_size(t->dtype);
    v.ndim = 1;
    v.numel = count;
    v.shape[0] = count;
    v.strides[0] = 1;
    return v;
}

fsc_status_t fsc_comm_all_to_all_plan(fsc_tensor_t *output, const fsc_tensor_t *input, const int64_t *out_rows,
                                      const int64_t *in_rows, int rank, int size, int device_type, int device_id,
                                      fsc_tensor_t *views, fsc_comm_call_t *calls, size_t *ncalls) {
    const char *op = "all_to_all_single";
    *ncalls = 0;
    FSC_CHECK(check_tensor(output, op, "output", 1, -1, device_type, device_id));
    FSC_CHECK(check_tensor(input, op, "input", 0, -1, device_type, device_id));
    FSC_CHECK(check_pair(op, output, input));
    const fsc_tensor_t *ts[2] = {output, input};
    const char *names[2] = {"output", "input"};
    for (int k = 0; k < 2; k++)
        if (ts[k]->ndim < 1)
            return fsc_error(FSC_ERR_VALUE,
                             "%s: argument '%s' must have at least one dimension (blocks are split on dim 0)", op,
                             names[k]);
    int64_t row = row_numel(output), in_row = row_numel(input);
    if (row < 0 || row != in_row)
        return fsc_error(FSC_ERR_VALUE,
                         "%s: a row of output has %lld elements but a row of input has %lld; expected the same", op,
                         (long long)row, (long long)in_row);
    int64_t *rows = malloc(2 * (size_t)size * sizeof(*rows));
    if (rows == NULL) return fsc_error(FSC_ERR_NOMEM, "%s: out of memory for %d ranks' split sizes", op, size);
    int64_t *orows = rows, *irows = rows + size;
    fsc_status_t st = split_rows(op, "output_split_sizes", output, out_rows, size, orows);
    if (st == FSC_OK) st = split_rows(op, "input_split_sizes", input, in_rows, size, irows);
    if (st == FSC_OK && orows[rank] != irows[rank])
        st = fsc_error(
            FSC_ERR_VALUE,
            "%s: this rank's own block has %lld rows in output but %lld in input (rank %d of the split sizes); "
            "expected the same",
            op, (long long)orows[rank], (long long)irows[rank], rank);
    if (st == FSC_OK) {
        int64_t oo = 0, io = 0;
        size_t n = 0;
        for (int j = 0; j < size; j++) {
            views[2 * j] = flat_block(output, oo, orows[j] * row);
            views[2 * j + 1] = flat_block(input, io, irows[j] * row);
            oo += orows[j] * row;
            io += irows[j] * row;
            if (j == rank) continue;
            calls[n++] = (fsc_comm_call_t){FSC_OP_SEND, &views[2 * j + 1], NULL, FSC_RED_SUM, j, 0};
            calls[n++] = (fsc_comm_call_t){FSC_OP_RECV, &views[2 * j], NULL, FSC_RED_SUM, j, 0};
        }
        calls[n++] = (fsc_comm_call_t){FSC_OP_COPY, &views[2 * rank], &views[2 * rank + 1], FSC_RED_SUM, -1, 0};
        *ncalls = n;
    }
    free(rows);
    return st;
}
