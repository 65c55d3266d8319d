/* comm.c — op names, header comparison and the timeout setting shared by all backends. */
#include "comm/comm.h"

#include <errno.h>
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
    const char *dt = h->dtype < FSC_NUM_DTYPES ? fsc_dtype_name((fsc_dtype_t)h->dtype) : "?";
    int n = snprintf(buf, cap, "%s(count=%llu, dtype=%s", fsc_comm_op_name(op), (unsigned long long)h->count, dt);
    if (n < 0 || (size_t)n >= cap) return;
    if (op == FSC_OP_ALL_REDUCE || op == FSC_OP_REDUCE || op == FSC_OP_REDUCE_SCATTER)
        n += snprintf(buf + n, cap - (size_t)n, ", op=%s", fsc_reduce_op_name((fsc_reduce_op_t)h->redop));
    if ((size_t)n >= cap) return;
    if (op == FSC_OP_BROADCAST || op == FSC_OP_REDUCE)
        n += snprintf(buf + n, cap - (size_t)n, ", root=%d", h->root);
    else if (op == FSC_OP_SEND || op == FSC_OP_RECV)
        n += snprintf(buf + n, cap - (size_t)n, ", peer=%d", h->root);
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
                     "%s: %s has dtype %s; expected one of float16, bfloat16, float32, float64, "
                     "int32, int64, uint8",
                     opname, argname, (unsigned)dt < FSC_NUM_DTYPES ? fsc_dtype_name(dt) : "?");
}
