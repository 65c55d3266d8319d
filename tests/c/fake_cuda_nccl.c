/* fake_cuda_nccl.c — a stand-in for libcuda.so.1 and libnccl.so.2, so the NCCL backend's error
 * handling (non-blocking init, async errors, the watchdog, abort) runs on machines without a
 * GPU. Built as one shared object that the tests reach under both names (symlinks), so the
 * driver half and the NCCL half share state. "Device memory" is host memory; communicators have
 * one rank, whose collectives copy input to output on the spot, and whose recv from itself takes
 * the oldest unmatched send to itself.
 *
 * fake_set_mode() picks what the next collectives do:
 *   FAKE_OK          complete at once;
 *   FAKE_HANG        never complete: events recorded after them on the same stream stay
 *                    unfired, and cuStreamSynchronize blocks, until the communicator is aborted
 *                    (as NCCL's kernels spin until a dead peer's data arrives or ncclCommAbort);
 *   FAKE_ASYNC_ERROR hang, and 0.2 s later ncclCommGetAsyncError reports ncclRemoteError;
 *   FAKE_ENQUEUE_HANG on a blocking communicator, a collective's call does not return until the
 *                    mode changes (a blocking enqueue waiting for a peer that never connects). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

enum { FAKE_OK = 0, FAKE_HANG = 1, FAKE_ASYNC_ERROR = 2, FAKE_ENQUEUE_HANG = 3 };

/* ncclResult_t / CUresult values used here */
#define R_OK 0
#define R_NCCL_INVALID_ARGUMENT 4
#define R_NCCL_REMOTE_ERROR 6
#define R_NCCL_IN_PROGRESS 7
#define R_CU_INVALID_VALUE 1
#define R_CU_NOT_READY 600
#define R_CU_NOT_SUPPORTED 801

#define MAX_COMMS 64

typedef struct {
    int used, hung, aborted;
    int blocking;   /* created with config.blocking = 1, or by ncclCommInitRank */
    int init_polls; /* ncclCommGetAsyncError answers ncclInProgress this many more times */
    double err_at;  /* > 0: report ncclRemoteError from this time on */
} comm_t;

typedef struct {
    comm_t *blocked_by; /* a hung collective was enqueued on this stream */
} stream_t;

typedef struct {
    comm_t *blocked_by; /* fires once that communicator stops hanging */
} event_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static comm_t comms[MAX_COMMS];
static stream_t default_stream;
static int mode, aborts, live_events, ctx_token;
static _Thread_local void *current_ctx;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static stream_t *stream_of(void *s) {
    return s ? (stream_t *)s : &default_stream;
}

static int blocked(const comm_t *c) {
    return c != NULL && c->hung;
}

/* ---- control (called by the tests through dlsym) ---- */

EXPORT void fake_set_mode(int m) {
    pthread_mutex_lock(&mu);
    mode = m;
    pthread_mutex_unlock(&mu);
}

EXPORT int fake_aborts(void) {
    pthread_mutex_lock(&mu);
    int n = aborts;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT int fake_live_events(void) {
    pthread_mutex_lock(&mu);
    int n = live_events;
    pthread_mutex_unlock(&mu);
    return n;
}

/* ---- driver ---- */

EXPORT int cuInit(unsigned int flags) {
    (void)flags;
    return R_OK;
}
EXPORT int cuDriverGetVersion(int *v) {
    *v = 13000;
    return R_OK;
}
EXPORT int cuDeviceGetCount(int *n) {
    *n = 1;
    return R_OK;
}
EXPORT int cuDeviceGet(int *dev, int ordinal) {
    *dev = ordinal;
    return R_OK;
}
EXPORT int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    (void)dev;
    *ctx = &ctx_token;
    return R_OK;
}
EXPORT int cuCtxGetCurrent(void **ctx) {
    *ctx = current_ctx;
    return R_OK;
}
EXPORT int cuCtxSetCurrent(void *ctx) {
    current_ctx = ctx;
    return R_OK;
}
EXPORT int cuCtxPushCurrent_v2(void *ctx) {
    current_ctx = ctx; /* one level is all the backend uses */
    return R_OK;
}
EXPORT int cuCtxPopCurrent_v2(void **ctx) {
    if (ctx) *ctx = current_ctx;
    current_ctx = NULL;
    return R_OK;
}
EXPORT int cuModuleLoadData(void **mod, const void *image) {
    (void)mod, (void)image;
    return R_CU_NOT_SUPPORTED;
}
EXPORT int cuModuleGetFunction(void **fn, void *mod, const char *name) {
    (void)fn, (void)mod, (void)name;
    return R_CU_NOT_SUPPORTED;
}
EXPORT int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shmem, void *stream, void **params, void **extra) {
    (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)params,
        (void)extra;
    return R_CU_NOT_SUPPORTED;
}
/* Blocks while a hung collective is on the stream (at most 30 s, so a broken watchdog fails
 * the test instead of hanging it). */
EXPORT int cuStreamSynchronize(void *s) {
    double give_up = now() + 30.0;
    for (;;) {
        pthread_mutex_lock(&mu);
        int b = blocked(stream_of(s)->blocked_by);
        pthread_mutex_unlock(&mu);
        if (!b || now() > give_up) return b ? R_CU_NOT_READY : R_OK;
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
}
EXPORT int cuEventCreate(void **ev, unsigned int flags) {
    (void)flags;
    static event_t pool[4096];
    static int next;
    pthread_mutex_lock(&mu);
    int i = next++ % 4096;
    live_events++;
    pthread_mutex_unlock(&mu);
    memset(&pool[i], 0, sizeof(pool[i]));
    *ev = &pool[i];
    return R_OK;
}
EXPORT int cuEventRecord(void *ev, void *s) {
    pthread_mutex_lock(&mu);
    comm_t *c = stream_of(s)->blocked_by;
    ((event_t *)ev)->blocked_by = blocked(c) ? c : NULL;
    pthread_mutex_unlock(&mu);
    return R_OK;
}
EXPORT int cuEventQuery(void *ev) {
    pthread_mutex_lock(&mu);
    int b = blocked(((event_t *)ev)->blocked_by);
    pthread_mutex_unlock(&mu);
    return b ? R_CU_NOT_READY : R_OK;
}
EXPORT int cuEventDestroy_v2(void *ev) {
    (void)ev;
    pthread_mutex_lock(&mu);
    live_events--;
    pthread_mutex_unlock(&mu);
    return R_OK;
}
/* CUDA_MEMCPY2D (size_t fields, as cuMemcpy2DAsync_v2 takes it); device memory is host memory,
 * so copies happen on the spot. A pitch above the real drivers' limit is refused like theirs. */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    size_t srcPitch, dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    size_t dstPitch, WidthInBytes, Height;
} memcpy2d_t;
static int copies_2d, copies_1d;
EXPORT int cuMemcpy2DAsync_v2(const memcpy2d_t *c, void *stream) {
    (void)stream;
    if (c->srcPitch > INT32_MAX || c->dstPitch > INT32_MAX || c->WidthInBytes > c->srcPitch ||
        c->WidthInBytes > c->dstPitch || c->srcMemoryType != 2 || c->dstMemoryType != 2)
        return R_CU_INVALID_VALUE;
    for (size_t y = 0; y < c->Height; y++)
        memcpy((char *)(uintptr_t)c->dstDevice + c->dstXInBytes + (c->dstY + y) * c->dstPitch,
               (const char *)(uintptr_t)c->srcDevice + c->srcXInBytes + (c->srcY + y) * c->srcPitch, c->WidthInBytes);
    copies_2d++;
    return R_OK;
}
EXPORT int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void *stream) {
    (void)stream;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    copies_1d++;
    return R_OK;
}
/* How many 2D and 1D copies were enqueued so far. */
EXPORT int fake_copies(int two_d) {
    return two_d ? copies_2d : copies_1d;
}
EXPORT int cuGetErrorName(int r, const char **s) {
    *s = r == R_CU_NOT_READY ? "CUDA_ERROR_NOT_READY" : r == 0 ? "CUDA_SUCCESS" : "CUDA_ERROR_NOT_SUPPORTED";
    return R_OK;
}
EXPORT int cuGetErrorString(int r, const char **s) {
    *s = r == 0 ? "no error" : "fake driver";
    return R_OK;
}

/* ---- NCCL ---- */

typedef struct {
    char internal[128];
} unique_id_t;

EXPORT int ncclGetVersion(int *v) {
    *v = 23102;
    return R_OK;
}
EXPORT int ncclGetUniqueId(unique_id_t *id) {
    memset(id, 0x5a, sizeof(*id));
    return R_OK;
}
/* A blocking call that does not return while the mode is `m` (a peer that never shows up). */
static void block_while_mode(int m) {
    struct timespec nap = {0, 10 * 1000 * 1000};
    for (;;) {
        pthread_mutex_lock(&mu);
        int hang = mode == m;
        pthread_mutex_unlock(&mu);
        if (!hang) return;
        nanosleep(&nap, NULL);
    }
}
static int new_comm(void **out, int nranks, int rank, int polls) {
    /* Every communicator behaves as one rank (collectives copy input to output); a larger nranks
     * lets tests reach the argument checks that depend on the group size. */
    if (nranks < 1 || rank != 0) return R_NCCL_INVALID_ARGUMENT;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_COMMS; i++) {
        if (!comms[i].used) {
            memset(&comms[i], 0, sizeof(comms[i]));
            comms[i].used = 1;
            comms[i].init_polls = polls;
            *out = &comms[i];
            pthread_mutex_unlock(&mu);
            return polls ? R_NCCL_IN_PROGRESS : R_OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return R_NCCL_INVALID_ARGUMENT;
}
EXPORT int ncclCommInitRank(void **comm, int nranks, unique_id_t id, int rank) {
    (void)id;
    int r = new_comm(comm, nranks, rank, 0);
    if (r == R_OK) ((comm_t *)*comm)->blocking = 1;
    return r;
}
/* config.blocking = 0: returns ncclInProgress and the caller polls ncclCommGetAsyncError;
 * config.blocking = 1: done on return, and in FAKE_HANG mode it does not return until the mode
 * changes (a peer that never joins). (ncclConfig_t: size_t size, unsigned magic, unsigned
 * version, int blocking, ...) */
static int last_blocking = -1;
EXPORT int fake_last_blocking(void) {
    return last_blocking;
}
EXPORT int ncclCommInitRankConfig(void **comm, int nranks, unique_id_t id, int rank, void *config) {
    (void)id;
    int blocking;
    memcpy(&blocking, (char *)config + sizeof(size_t) + 2 * sizeof(unsigned), sizeof(int));
    last_blocking = blocking;
    if (blocking == 1) block_while_mode(FAKE_HANG);
    int r = new_comm(comm, nranks, rank, blocking == 1 ? 0 : 3);
    if (r == R_OK) ((comm_t *)*comm)->blocking = blocking == 1;
    return r;
}
EXPORT int ncclCommGetAsyncError(void *comm, int *async) {
    comm_t *c = comm;
    pthread_mutex_lock(&mu);
    if (c->init_polls > 0) {
        c->init_polls--;
        *async = R_NCCL_IN_PROGRESS;
    } else {
        *async = (c->err_at > 0 && now() >= c->err_at) ? R_NCCL_REMOTE_ERROR : R_OK;
    }
    pthread_mutex_unlock(&mu);
    return R_OK;
}
EXPORT int ncclCommAbort(void *comm) {
    comm_t *c = comm;
    pthread_mutex_lock(&mu);
    c->hung = 0; /* NCCL's kernels see the abort flag and return */
    c->aborted = 1;
    c->used = 0;
    aborts++;
    pthread_mutex_unlock(&mu);
    return R_OK;
}
EXPORT int ncclCommFinalize(void *comm) {
    (void)comm;
    return R_OK;
}
EXPORT int ncclCommDestroy(void *comm) {
    comm_t *c = comm;
    pthread_mutex_lock(&mu);
    c->used = 0;
    pthread_mutex_unlock(&mu);
    return R_OK;
}
EXPORT const char *ncclGetErrorString(int r) {
    switch (r) {
        case R_OK: return "no error";
        case R_NCCL_INVALID_ARGUMENT: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
        case R_NCCL_REMOTE_ERROR: return "remote process exited or there was a network error";
        case R_NCCL_IN_PROGRESS: return "NCCL operation in progress";
        default: return "unhandled error";
    }
}
EXPORT const char *ncclGetLastError(void *comm) {
    (void)comm;
    return "";
}

/* One rank: the data moves at once; in a hanging mode the stream is left blocked. */
static int collective(void *comm, void *stream, void *dst, const void *src, size_t bytes) {
    comm_t *c = comm;
    if (c->blocking) block_while_mode(FAKE_ENQUEUE_HANG);
    if (dst != src && bytes) memmove(dst, src, bytes);
    pthread_mutex_lock(&mu);
    if (mode != FAKE_OK && mode != FAKE_ENQUEUE_HANG) {
        c->hung = 1;
        stream_of(stream)->blocked_by = c;
        if (mode == FAKE_ASYNC_ERROR && c->err_at == 0) c->err_at = now() + 0.2;
    }
    pthread_mutex_unlock(&mu);
    return R_OK;
}

static size_t esize(int dt) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return dt >= 0 && dt < 10 ? sizes[dt] : 1;
}

EXPORT int ncclAllGather(const void *in, void *out, size_t n, int dt, void *comm, void *s) {
    return collective(comm, s, out, in, n * esize(dt));
}
EXPORT int ncclReduceScatter(const void *in, void *out, size_t n, int dt, int op, void *comm, void *s) {
    (void)op;
    return collective(comm, s, out, in, n * esize(dt));
}
EXPORT int ncclAllReduce(const void *in, void *out, size_t n, int dt, int op, void *comm, void *s) {
    (void)op;
    return collective(comm, s, out, in, n * esize(dt));
}
EXPORT int ncclBroadcast(const void *in, void *out, size_t n, int dt, int root, void *comm, void *s) {
    (void)root;
    return collective(comm, s, out, in, n * esize(dt));
}
EXPORT int ncclReduce(const void *in, void *out, size_t n, int dt, int op, int root, void *comm, void *s) {
    (void)op, (void)root;
    return collective(comm, s, out, in, n * esize(dt));
}
/* Point-to-point: the one rank's sends to itself, waiting for their recvs (in order). */
#define MAX_SELF_SENDS 16
static struct {
    const void *buf;
    size_t bytes;
} self_sends[MAX_SELF_SENDS];
static int nself_sends = 0;

EXPORT int ncclSend(const void *buf, size_t n, int dt, int peer, void *comm, void *s) {
    (void)comm, (void)s;
    if (peer != 0 || nself_sends == MAX_SELF_SENDS) return R_NCCL_INVALID_ARGUMENT; /* one rank: only itself */
    self_sends[nself_sends].buf = buf;
    self_sends[nself_sends++].bytes = n * esize(dt);
    return R_OK;
}
EXPORT int ncclRecv(void *buf, size_t n, int dt, int peer, void *comm, void *s) {
    if (peer != 0 || nself_sends == 0 || self_sends[0].bytes != n * esize(dt)) return R_NCCL_INVALID_ARGUMENT;
    const void *src = self_sends[0].buf;
    memmove(self_sends, self_sends + 1, (size_t)--nself_sends * sizeof(self_sends[0]));
    return collective(comm, s, buf, src, n * esize(dt));
}
EXPORT int ncclGroupStart(void) {
    return R_OK;
}
EXPORT int ncclGroupEnd(void) {
    return R_OK;
}
