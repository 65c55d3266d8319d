/* comm.h — backend-neutral collective vocabulary: op codes, reduce ops, the per-op header, timeouts. */
#ifndef FSC_COMM_H
#define FSC_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/tensor.h"

/* What a rank is doing. Values are stable: they travel between processes in op headers. */
typedef enum {
    FSC_OP_NONE = 0,
    FSC_OP_BARRIER,
    FSC_OP_ALL_GATHER,
    FSC_OP_REDUCE_SCATTER,
    FSC_OP_ALL_REDUCE,
    FSC_OP_BROADCAST,
    FSC_OP_REDUCE,
    FSC_OP_SEND,
    FSC_OP_RECV,
    FSC_OP_COPY, /* local: output = input (same dtype and count); no other rank takes part */
    FSC_NUM_OPS
} fsc_comm_op_t;

typedef enum { FSC_RED_SUM = 0, FSC_RED_AVG, FSC_RED_MAX, FSC_RED_MIN, FSC_NUM_REDS } fsc_reduce_op_t;

/* The header every rank publishes before an op, so that ranks which diverge get an error that
 * names both sides instead of a hang or silent garbage. `count` is the per-rank element count
 * (all_gather: input numel; reduce_scatter: output numel; others: tensor numel). `root` is the
 * group rank of the root (broadcast, reduce) or the peer (send, recv), else -1. `tag` is the
 * message tag of a send or recv (0 otherwise). `seq` counts the collectives a rank has issued on
 * the group (send/recv count per peer pair instead). */
typedef struct {
    uint32_t op;    /* fsc_comm_op_t */
    uint32_t dtype; /* fsc_dtype_t */
    uint32_t redop; /* fsc_reduce_op_t, or 0 when the op does not reduce */
    int32_t root;
    int32_t tag;
    uint32_t reserved; /* 0 */
    uint64_t count;
    uint64_t seq;
} fsc_comm_header_t;

/* "all_reduce", "send", ... */
const char *fsc_comm_op_name(fsc_comm_op_t op);

/* "sum", "avg", "max", "min". */
const char *fsc_reduce_op_name(fsc_reduce_op_t op);

/* Parse "sum" | "avg" | "max" | "min" into *out; FSC_ERR_VALUE naming the accepted values
 * otherwise. */
fsc_status_t fsc_reduce_op_parse(const char *name, fsc_reduce_op_t *out);

/* Bounds of FAIRSCALE_C_TIMEOUT: the default, and the largest value accepted (about 31 years;
 * larger ones would overflow the time types the waits convert to). */
#define FSC_COMM_TIMEOUT_DEFAULT_S 600.0
#define FSC_COMM_TIMEOUT_MAX_S 1e9

/* The one parser of FAIRSCALE_C_TIMEOUT, read on every call so tests can change it: unset or
 * empty gives the default; otherwise a finite number of seconds in (0, FSC_COMM_TIMEOUT_MAX_S]
 * (strtod syntax, nothing after it). Anything else ("abc", "nan", "inf", "1e400", "-1", "0") is
 * FSC_ERR_VALUE naming the variable and its value, and *out is left unchanged. Python reads it
 * through _C._comm_timeout_s(). */
fsc_status_t fsc_comm_timeout_get(double *out);

/* fsc_comm_timeout_get for callers that cannot fail: an invalid value (which building a group
 * has already refused) gives the default with a warning. */
double fsc_comm_timeout_s(void);

/* FSC_OK when `whole` == `size` x `part`: the element counts of an all_gather's output and input,
 * or of a reduce_scatter's input and output. The product is not formed, so counts whose product
 * overflows int64 are refused instead of wrapping onto a small `whole`. Otherwise FSC_ERR_VALUE:
 * "<op>: <whole_name> has W elements; expected group size (S) x <part_name> elements (P) = ...". */
fsc_status_t fsc_comm_check_blocks(const char *op, const char *whole_name, int64_t whole, const char *part_name,
                                   int64_t part, int size);

/* Monotonic clock in seconds. */
double fsc_comm_now(void);

/* Write a human description of `h` ("all_reduce(count=10, dtype=float32, op=sum, seq=3)",
 * "send(count=4, dtype=float32, peer=1, tag=7, seq=2)") into buf (always NUL-terminated). */
void fsc_comm_header_format(const fsc_comm_header_t *h, char *buf, size_t cap);

/* Compare two ranks' headers. FSC_OK when they describe the same op; otherwise records an
 * FSC_ERR_MISMATCH message naming the group, both ranks and both headers. Headers match when
 * op, count, dtype, redop, root and seq are equal. */
fsc_status_t fsc_comm_header_check(const char *group, int rank_a, const fsc_comm_header_t *a, int rank_b,
                                   const fsc_comm_header_t *b);

/* FSC_OK when `dt` is a dtype the op supports and `redop` is valid for it; FSC_ERR_VALUE naming
 * `argname` otherwise. Ops that only move bytes (redop < 0: all_gather, broadcast, send, recv,
 * copy, all-to-all) take every dtype of fsc_dtype_t; reductions take float16, bfloat16, float32,
 * float64, int32, int64 and uint8, and avg only the floating ones. */
fsc_status_t fsc_comm_check_dtype(fsc_dtype_t dt, int redop, const char *opname, const char *argname);

/* One call into the engine, as every backend takes it. `tensor` is the tensor the op writes
 * (all_gather / reduce_scatter / copy output; the tensor of all_reduce, broadcast, reduce, recv)
 * or, for send, the one it reads; NULL for barrier. `input` is the all_gather / reduce_scatter /
 * copy input (NULL otherwise). `peer` is the broadcast / reduce root or the send / recv peer (group ranks). `tag` is
 * a send / recv's message tag (any int32; 0 for every other op). */
typedef struct {
    fsc_comm_op_t op;
    fsc_tensor_t *tensor;
    const fsc_tensor_t *input;
    fsc_reduce_op_t redop;
    int peer;
    int32_t tag;
} fsc_comm_call_t;

/* The engine's argument rules, the same for every backend, checked before anything is sent:
 * tensors contiguous, on `device_type` (and on `device_id` when it is >= 0), of a supported dtype
 * (the same for input and output) that suits the reduce op; written tensors writable; sizes
 * (all_gather: output = size x input; reduce_scatter: input = size x output); root / peer a rank
 * of the group (a peer other than this rank); input and output disjoint except that the input
 * may be exactly this rank's block of the output (all_gather) or the output exactly this rank's
 * block of the input (reduce_scatter), the in-place forms; a copy's input and output of one
 * element count and not sharing memory at all; a tag only on send / recv, and on CUDA
 * (NCCL, which has no message tags) only tag 0. FSC_ERR_VALUE naming the op and the argument
 * otherwise. */
fsc_status_t fsc_comm_check_call(const fsc_comm_call_t *c, int rank, int size, int device_type, int device_id);

/* fsc_comm_check_call for each of `n` calls issued together (errors say "batch operation i: "),
 * and no send or recv shares memory with another call of the batch where either writes it (the
 * collectives of a batch run in list order, so they may share memory with each other). */
fsc_status_t fsc_comm_check_batch(const fsc_comm_call_t *calls, size_t n, int rank, int size, int device_type,
                                  int device_id);

/* The all-to-all (torch.distributed.all_to_all_single's meaning) as every backend runs it: rank j
 * receives `input`'s dim-0 block j, and this rank's `output` block i comes from rank i. `out_rows`
 * and `in_rows` hold `size` row counts (the blocks' lengths on dim 0), or are NULL for equal
 * blocks. Checks the op's argument rules: both tensors as an all_gather's (device, contiguous,
 * dtype, output writable), one dtype, at least one dimension, rows of one element count, split
 * sizes >= 0 that sum to dim 0 (dim 0 divisible by `size` when not given), this rank's own block
 * the same length in both, output and input disjoint; FSC_ERR_VALUE naming the argument otherwise.
 * On success fills `views` (2 x size flat blocks: output block j at 2j, input block j at 2j + 1)
 * and `calls` (2 x size - 1, pointing into `views`: a send and a recv with every peer in rank
 * order, then the copy of this rank's own block) and sets *ncalls. Empty blocks are sent too, so a
 * peer whose split sizes disagree fails its recv instead of leaving a message in the channel. */
fsc_status_t fsc_comm_all_to_all_plan(fsc_tensor_t *output, const fsc_tensor_t *input, const int64_t *out_rows,
                                      const int64_t *in_rows, int rank, int size, int device_type, int device_id,
                                      fsc_tensor_t *views, fsc_comm_call_t *calls, size_t *ncalls);

#endif /* FSC_COMM_H */
