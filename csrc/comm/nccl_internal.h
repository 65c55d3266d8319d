/* nccl_internal.h — what the NCCL backend's files share (nccl.c: loading, communicators,
 * operations; nccl_watchdog.c: the watchdog): NCCL's ABI as declared in the documented nccl.h,
 * the loaded entry points, and the communicator's layout. Not a public header. */
#ifndef FSC_NCCL_INTERNAL_H
#define FSC_NCCL_INTERNAL_H

#include <limits.h>
#include <pthread.h>
#include <stdint.h>

#include "comm/nccl.h"

/* ---- ABI ------------------------------------------------------------------------------------ */

typedef int nccl_result_t; /* ncclResult_t */
#define NCCL_OK 0
#define NCCL_INTERNAL_ERROR 3
#define NCCL_INVALID_ARGUMENT 4
#define NCCL_IN_PROGRESS 7
#define NCCL_TIMEOUT_RESULT 8 /* ncclTimeout, 2.23+ */

typedef void *nccl_comm_h; /* ncclComm_t */
typedef void *cuda_stream_h;

typedef struct {
    char internal[FSC_NCCL_UNIQUE_ID_BYTES];
} nccl_unique_id_t;

/* ncclConfig_t as of NCCL 2.17 (struct ncclConfig_v21700). NCCL reads `size` bytes of it and
 * resets any field newer than `version`, so this prefix of the current struct is accepted by
 * every release that has ncclCommInitRankConfig; fields added later keep NCCL's defaults. */
typedef struct {
    size_t size;
    unsigned int magic;   /* NCCL_API_MAGIC */
    unsigned int version; /* NCCL_VERSION code of this layout */
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
} nccl_config_t;
#define NCCL_API_MAGIC 0xcafebeefu
#define NCCL_CONFIG_LAYOUT_VERSION 21700
#define NCCL_CONFIG_UNDEF_INT INT_MIN

/* ncclDataType_t and ncclRedOp_t values. */
enum {
    NCCL_INT8 = 0,
    NCCL_UINT8 = 1,
    NCCL_INT32 = 2,
    NCCL_INT64 = 4,
    NCCL_FLOAT16 = 6,
    NCCL_FLOAT32 = 7,
    NCCL_FLOAT64 = 8,
    NCCL_BFLOAT16 = 9
};
enum { NCCL_SUM = 0, NCCL_MAX = 2, NCCL_MIN = 3, NCCL_AVG = 4 };

#define NCCL_MIN_VERSION_BF16_AVG 21003 /* ncclBfloat16 (2.10) and ncclAvg (2.10.3) */

typedef struct {
    nccl_result_t (*GetVersion)(int *);
    nccl_result_t (*GetUniqueId)(nccl_unique_id_t *);
    nccl_result_t (*CommInitRank)(nccl_comm_h *, int, nccl_unique_id_t, int);
    nccl_result_t (*CommDestroy)(nccl_comm_h);
    nccl_result_t (*CommAbort)(nccl_comm_h);
    nccl_result_t (*CommGetAsyncError)(nccl_comm_h, nccl_result_t *);
    const char *(*GetErrorString)(nccl_result_t);
    nccl_result_t (*AllGather)(const void *, void *, size_t, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*ReduceScatter)(const void *, void *, size_t, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*Broadcast)(const void *, void *, size_t, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*Reduce)(const void *, void *, size_t, int, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*Send)(const void *, size_t, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*Recv)(void *, size_t, int, int, nccl_comm_h, cuda_stream_h);
    nccl_result_t (*GroupStart)(void);
    nccl_result_t (*GroupEnd)(void);
    /* optional: absent from old releases */
    nccl_result_t (*CommInitRankConfig)(nccl_comm_h *, int, nccl_unique_id_t, int, nccl_config_t *); /* 2.14 */
    nccl_result_t (*CommFinalize)(nccl_comm_h);                                                      /* 2.14 */
    const char *(*GetLastError)(nccl_comm_h);                                                        /* 2.13 */
} nccl_api_t;

/* The entry points of the loaded library (fsc_nccl_load fills them once). */
extern nccl_api_t fsc_nccl_api;

/* The loaded library's version code (ncclGetVersion), set with fsc_nccl_api. */
extern int fsc_nccl_version_code;

/* ---- communicators --------------------------------------------------------------------------- */

typedef enum { COMM_ALIVE = 0, COMM_ABORTED, COMM_DESTROYED } comm_state_t;

#define WD_MAX_PENDING 1024   /* operations the watchdog tracks at once; later ones go untracked */
#define WD_POLL_NS 100000000L /* watchdog period: 100 ms */

/* An enqueued operation the watchdog has not yet seen complete: an event recorded on its
 * stream right after it, and when it was enqueued. */
typedef struct {
    fsc_gpu_event_t ev;
    fsc_comm_op_t op;
    uint64_t seq;
    double t;
} pending_op_t;

/* One NCCL call of an enqueue, its arguments resolved (buffers, element count, NCCL dtype and
 * reduction, root or peer): what the submitter thread needs without the caller's tensors. */
typedef struct {
    fsc_comm_op_t op;
    const void *send;
    void *recv;
    size_t count;
    int dt, redop, peer;
} fsc_nccl_call_t;

typedef struct fsc_nccl_submitter fsc_nccl_submitter_t;

struct fsc_nccl_comm {
    pthread_mutex_t lock; /* serialises every NCCL call on `comm`, and guards everything below */
    nccl_comm_h comm;     /* NULL once aborted or destroyed */
    int rank, nranks, device;
    int blocking; /* created with config.blocking = 1 (or ncclCommInitRank): see fsc_nccl_comm_destroy */
    fsc_nccl_submitter_t *submitter; /* blocking communicators: the thread that makes their calls */
    int owner_pid;                   /* the process that created it; a fork() child must not touch NCCL or the lock */
    comm_state_t state;
    char why_dead[768];    /* the error that aborted it */
    fsc_comm_op_t last_op; /* last operation enqueued, for wait's messages */
    uint64_t nops;         /* operations enqueued so far */
    double op_timeout;     /* an operation older than this makes the watchdog abort */
    /* watchdog (see watchdog_main): a ring of pending operations, oldest at pend_head */
    pending_op_t *pending;
    size_t pend_head, pend_count;
    uint64_t untracked; /* operations enqueued while the ring was full or an event failed */
    pthread_t wd_thread;
    pthread_cond_t wd_cv;
    int wd_started, wd_stop;
};

/* Abort `c` under c->lock and remember `why` for the calls that follow. */
void fsc_nccl_abort_locked(fsc_nccl_comm_t *c, const char *why);

/* The status of a failed NCCL call `r` on `c` (under c->lock); aborts `c` unless the call was an
 * argument error and `fatal` is 0. */
fsc_status_t fsc_nccl_fail_locked(fsc_nccl_comm_t *c, nccl_result_t r, const char *what, int fatal);

/* Poll pacing for a wait that began at `since` (fsc_comm_now()). */
void fsc_nccl_backoff(double since);

/* fsc_comm_now() plus `timeout_s`, or plus FAIRSCALE_C_TIMEOUT when `timeout_s` <= 0. */
double fsc_nccl_deadline_after(double timeout_s);

/* The status of NCCL call result `r` of `what` on `c` (under c->lock); a non-blocking
 * communicator's ncclInProgress is polled until it settles or `deadline` passes (then `c` is
 * aborted). */
fsc_status_t fsc_nccl_settle_locked(fsc_nccl_comm_t *c, nccl_result_t r, const char *what, double deadline, int fatal);

/* The error for a call `what` on a destroyed or aborted `c`. */
fsc_status_t fsc_nccl_dead_error(const fsc_nccl_comm_t *c, const char *what);

/* FSC_OK in the process that created `c`; FSC_ERR_COMM in a fork() child of it. */
fsc_status_t fsc_nccl_check_owner(const fsc_nccl_comm_t *c, const char *what);

/* ---- watchdog (nccl_watchdog.c) ----------------------------------------------------------------
 * Every call below except start and stop runs under c->lock. */

/* Start `c`'s watchdog thread ("fsc_nccl_wd"). */
fsc_status_t fsc_nccl_watchdog_start(fsc_nccl_comm_t *c);

/* Stop and join the watchdog (idempotent), then release the events it still tracked. */
void fsc_nccl_watchdog_stop(fsc_nccl_comm_t *c);

/* Record an event after the operation just enqueued on `stream`, for the watchdog to follow. */
void fsc_nccl_track_locked(fsc_nccl_comm_t *c, fsc_comm_op_t op, fsc_stream_t stream);

/* Wait until every tracked operation has completed; past `deadline`, abort `c` and return
 * FSC_ERR_TIMEOUT. */
fsc_status_t fsc_nccl_drain_locked(fsc_nccl_comm_t *c, double deadline);

/* ---- submitter (nccl_submit.c) ------------------------------------------------------------- */

/* Make the calls of one enqueue on `comm`, inside ncclGroupStart/End when `grouped`; the first
 * failure's result, else the last call's (or GroupEnd's). With a submitter `s`, calls after the
 * first are skipped once its caller has given up. */
nccl_result_t fsc_nccl_issue_calls(nccl_comm_h comm, const fsc_nccl_call_t *calls, size_t n, int grouped,
                                   cuda_stream_h stream, fsc_nccl_submitter_t *s);

/* Start the thread that makes a blocking communicator's calls, on `device`. */
fsc_status_t fsc_nccl_submitter_start(nccl_comm_h comm, int device, int rank, fsc_nccl_submitter_t **out);

/* Hand one enqueue (copied) to the thread and wait for it until `deadline` (fsc_comm_now()).
 * FSC_OK with NCCL's result in *r, or FSC_ERR_TIMEOUT (no error message set): the call is still
 * inside NCCL, the thread now owns `comm` and aborts it once the call returns, and the caller must
 * let go with fsc_nccl_submitter_stop and never touch `comm` again. One caller at a time (under
 * the communicator's lock). */
fsc_status_t fsc_nccl_submit(fsc_nccl_submitter_t *s, const fsc_nccl_call_t *calls, size_t n, int grouped,
                             cuda_stream_h stream, double deadline, nccl_result_t *r);

/* Stop and join the thread (not under a call), or, after a timed-out submit, leave it to finish
 * and free itself. NULL is a no-op. */
void fsc_nccl_submitter_stop(fsc_nccl_submitter_t *s);

#endif /* FSC_NCCL_INTERNAL_H */
