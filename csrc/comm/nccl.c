/* nccl.c — NCCL backend: dlopen'ed libnccl; blocking communicators by default, their init on a
 * thread of its own and their calls on the submitter thread (nccl_submit.c), so that both stay
 * bounded; non-blocking ones on request (FAIRSCALE_C_NCCL_BLOCKING=0), their calls polled until
 * they leave ncclInProgress; collectives on caller streams (nccl_ops.c), and waits that poll
 * ncclCommGetAsyncError. With the watchdog thread per communicator (nccl_watchdog.c), a dead peer
 * becomes an error, not a hang, even when the host never waits. The NCCL ABI (nccl_internal.h) is
 * declared from the documented nccl.h; no header is needed. */
#include "comm/nccl_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

static const struct {
    const char *name;
    size_t offset;
    int optional;
} nccl_symbols[] = {
#define NCCL_SYM(field, opt) \
    { "nccl" #field, offsetof(nccl_api_t, field), opt }
    NCCL_SYM(GetVersion, 0),
    NCCL_SYM(GetUniqueId, 0),
    NCCL_SYM(CommInitRank, 0),
    NCCL_SYM(CommDestroy, 0),
    NCCL_SYM(CommAbort, 0),
    NCCL_SYM(CommGetAsyncError, 0),
    NCCL_SYM(GetErrorString, 0),
    NCCL_SYM(AllGather, 0),
    NCCL_SYM(ReduceScatter, 0),
    NCCL_SYM(AllReduce, 0),
    NCCL_SYM(Broadcast, 0),
    NCCL_SYM(Reduce, 0),
    NCCL_SYM(Send, 0),
    NCCL_SYM(Recv, 0),
    NCCL_SYM(GroupStart, 0),
    NCCL_SYM(GroupEnd, 0),
    NCCL_SYM(CommInitRankConfig, 1),
    NCCL_SYM(CommFinalize, 1),
    NCCL_SYM(GetLastError, 1),
#undef NCCL_SYM
};

/* ---- library loading ------------------------------------------------------------------------- */

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
nccl_api_t fsc_nccl_api;   /* the entry points, filled once by fsc_nccl_load */
static int nccl_loaded;    /* written once under load_lock, read after fsc_nccl_load returned OK */
int fsc_nccl_version_code; /* the loaded library's ncclGetVersion, set once by fsc_nccl_load */
static char nccl_lib_path[512];

/* Resolve every entry point from `h`; 0 on success, else the name of the first missing one. */
static const char *resolve(void *h, nccl_api_t *api) {
    memset(api, 0, sizeof(*api));
    for (size_t i = 0; i < sizeof(nccl_symbols) / sizeof(nccl_symbols[0]); i++) {
        void *p = dlsym(h, nccl_symbols[i].name);
        if (p == NULL && !nccl_symbols[i].optional) return nccl_symbols[i].name;
        memcpy((char *)api + nccl_symbols[i].offset, &p, sizeof(p));
    }
    return NULL;
}

/* Append "; <what>: <why>" to the list of attempts. */
static void note_attempt(char *tried, size_t cap, const char *what, const char *why) {
    size_t len = strlen(tried);
    if (len < cap) snprintf(tried + len, cap - len, "%s%s: %s", len ? "; " : "", what, why ? why : "not found");
}

static int try_handle(void *h, const char *what, char *tried, size_t cap) {
    if (h == NULL) {
        note_attempt(tried, cap, what, dlerror());
        return 0;
    }
    nccl_api_t api;
    const char *missing = resolve(h, &api);
    if (missing != NULL) {
        note_attempt(tried, cap, what, "lacks a required symbol");
        FSC_WARN("nccl", "%s lacks %s; not using it", what, missing);
        dlclose(h);
        return 0;
    }
    int version = 0;
    if (api.GetVersion(&version) != NCCL_OK) version = 0;
    fsc_nccl_api = api;
    fsc_nccl_version_code = version;
    Dl_info info;
    void *sym;
    memcpy(&sym, &api.GetVersion, sizeof(sym));
    snprintf(nccl_lib_path, sizeof(nccl_lib_path), "%s", dladdr(sym, &info) && info.dli_fname ? info.dli_fname : what);
    nccl_loaded = 1;
    FSC_INFO("nccl", "loaded NCCL %d from %s", version, nccl_lib_path);
    return 1; /* the handle stays open for the life of the process */
}

fsc_status_t fsc_nccl_load(const char *const *paths, size_t npaths) {
    char tried[768] = "";
    pthread_mutex_lock(&load_lock);
    if (!nccl_loaded)
        try_handle(dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD), "libnccl.so.2 (already loaded)", tried,
                   sizeof(tried));
    for (size_t i = 0; i < npaths && !nccl_loaded; i++)
        if (paths[i] != NULL && paths[i][0] != '\0')
            try_handle(dlopen(paths[i], RTLD_NOW | RTLD_LOCAL), paths[i], tried, sizeof(tried));
    if (!nccl_loaded) try_handle(dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL), "libnccl.so.2", tried, sizeof(tried));
    int ok = nccl_loaded;
    pthread_mutex_unlock(&load_lock);
    if (!ok) return fsc_error(FSC_ERR_UNAVAILABLE, "NCCL could not be loaded (tried %s)", tried);
    return FSC_OK;
}

int fsc_nccl_version(void) {
    pthread_mutex_lock(&load_lock);
    int v = nccl_loaded ? fsc_nccl_version_code : 0;
    pthread_mutex_unlock(&load_lock);
    return v;
}

const char *fsc_nccl_path(void) {
    pthread_mutex_lock(&load_lock);
    const char *p = nccl_loaded ? nccl_lib_path : "";
    pthread_mutex_unlock(&load_lock);
    return p;
}

static fsc_status_t ensure_loaded(void) {
    pthread_mutex_lock(&load_lock);
    int ok = nccl_loaded;
    pthread_mutex_unlock(&load_lock);
    return ok ? FSC_OK : fsc_nccl_load(NULL, 0);
}

fsc_status_t fsc_nccl_get_unique_id(unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES]) {
    nccl_unique_id_t uid;
    FSC_CHECK(ensure_loaded());
    nccl_result_t r = fsc_nccl_api.GetUniqueId(&uid);
    if (r != NCCL_OK)
        return fsc_error(FSC_ERR_COMM, "nccl unique_id: ncclGetUniqueId failed: %s", fsc_nccl_api.GetErrorString(r));
    memcpy(id, uid.internal, FSC_NCCL_UNIQUE_ID_BYTES);
    return FSC_OK;
}

/* ---- communicators --------------------------------------------------------------------------- */

int fsc_nccl_comm_rank(const fsc_nccl_comm_t *c) {
    return c->rank;
}
int fsc_nccl_comm_size(const fsc_nccl_comm_t *c) {
    return c->nranks;
}
int fsc_nccl_comm_device(const fsc_nccl_comm_t *c) {
    return c->device;
}

double fsc_nccl_deadline_after(double timeout_s) {
    return fsc_comm_now() + (timeout_s > 0 ? timeout_s : fsc_comm_timeout_s());
}

/* Poll pacing for a wait that began at `since` (fsc_comm_now()): yield for its first
 * millisecond, so that an enqueue NCCL finishes on its own thread, or a short collective, is
 * seen within microseconds instead of at the end of a sleep; then sleep 50 us per poll. Time-
 * based rather than a poll count, since a yield returns at once on an idle core. */
void fsc_nccl_backoff(double since) {
    if (fsc_comm_now() - since < 1e-3) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

/* Abort under c->lock and remember why. */
void fsc_nccl_abort_locked(fsc_nccl_comm_t *c, const char *why) {
    if (c->comm != NULL) {
        fsc_gpu_ctx_t g;
        int entered = fsc_gpu_ctx_enter(c->device, &g) == FSC_OK;
        fsc_nccl_api.CommAbort(c->comm);
        if (entered) fsc_gpu_ctx_exit(&g);
        c->comm = NULL;
    }
    if (c->state == COMM_ALIVE) {
        c->state = COMM_ABORTED;
        snprintf(c->why_dead, sizeof(c->why_dead), "%s", why);
        FSC_WARN("nccl", "rank %d of %d aborted its communicator: %s", c->rank, c->nranks, why);
    }
}

/* Record the failure `r` of `what` on `c` (under c->lock). An invalid argument had no effect,
 * so the communicator stays usable (unless `fatal`); anything else aborts it. */
fsc_status_t fsc_nccl_fail_locked(fsc_nccl_comm_t *c, nccl_result_t r, const char *what, int fatal) {
    char msg[768];
    const char *last = (fsc_nccl_api.GetLastError && c->comm) ? fsc_nccl_api.GetLastError(c->comm) : NULL;
    snprintf(msg, sizeof(msg), "nccl %s on rank %d of %d (cuda:%d) failed: %s%s%s%s", what, c->rank, c->nranks,
             c->device, fsc_nccl_api.GetErrorString(r), last && *last ? " (" : "", last && *last ? last : "",
             last && *last ? ")" : "");
    if (r == NCCL_INVALID_ARGUMENT && !fatal) return fsc_error(FSC_ERR_VALUE, "%s", msg);
    fsc_nccl_abort_locked(c, msg);
    return fsc_error(r == NCCL_TIMEOUT_RESULT ? FSC_ERR_TIMEOUT : FSC_ERR_COMM, "%s; communicator aborted", msg);
}

/* Turn the result of an NCCL call on `c` into a status (under c->lock). A non-blocking
 * communicator answers ncclInProgress while it works in the background; poll its async error
 * state until the call has settled or `deadline` passes. */
fsc_status_t fsc_nccl_settle_locked(fsc_nccl_comm_t *c, nccl_result_t r, const char *what, double deadline, int fatal) {
    double since = fsc_comm_now();
    while (r == NCCL_IN_PROGRESS) {
        if (fsc_comm_now() > deadline) {
            char msg[384];
            snprintf(msg, sizeof(msg), "nccl %s on rank %d of %d (cuda:%d) did not complete in time", what, c->rank,
                     c->nranks, c->device);
            fsc_nccl_abort_locked(c, msg);
            return fsc_error(FSC_ERR_TIMEOUT, "%s (timeout %g s; FAIRSCALE_C_TIMEOUT by default); communicator aborted",
                             msg, c->op_timeout);
        }
        fsc_nccl_backoff(since);
        nccl_result_t async = NCCL_OK;
        nccl_result_t q = fsc_nccl_api.CommGetAsyncError(c->comm, &async);
        r = q != NCCL_OK ? q : async;
    }
    return r == NCCL_OK ? FSC_OK : fsc_nccl_fail_locked(c, r, what, fatal);
}

fsc_status_t fsc_nccl_dead_error(const fsc_nccl_comm_t *c, const char *what) {
    if (c->state == COMM_DESTROYED) return fsc_error(FSC_ERR_COMM, "nccl %s: the communicator was destroyed", what);
    return fsc_error(FSC_ERR_COMM, "nccl %s: the communicator was aborted earlier: %s", what, c->why_dead);
}

fsc_status_t fsc_nccl_blocking_get(int *out) {
    const char *s = getenv("FAIRSCALE_C_NCCL_BLOCKING");
    if (s == NULL || *s == '\0' || strcmp(s, "1") == 0) {
        *out = 1;
        return FSC_OK;
    }
    if (strcmp(s, "0") == 0) {
        *out = 0;
        return FSC_OK;
    }
    return fsc_error(FSC_ERR_VALUE, "FAIRSCALE_C_NCCL_BLOCKING='%.64s': expected 1 (default) or 0", s);
}

/* A communicator config with NCCL's defaults but for `blocking`. */
static nccl_config_t config_of(int blocking) {
    nccl_config_t cfg = {sizeof(nccl_config_t), NCCL_API_MAGIC,        NCCL_CONFIG_LAYOUT_VERSION, blocking,
                         NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,      NULL};
    return cfg;
}

/* ---- blocking init ------------------------------------------------------------------------
 * A blocking NCCL init returns only once every rank has joined, and hands out no communicator to
 * abort before then. It therefore runs on a thread of its own while the caller waits up to the
 * deadline; a caller that gives up leaves the thread behind, and the thread aborts whatever
 * communicator it gets later. The state is shared by the two and freed by whichever lets go last. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC, as fsc_comm_now() */
    int refs;          /* the caller and the thread */
    int done, abandoned;
    int device, rank, nranks;
    nccl_unique_id_t uid;
    nccl_comm_h comm;
    nccl_result_t r;
} blocking_init_t;

/* Drop one reference; called with b->mu held, returns with it released. */
static void blocking_init_release(blocking_init_t *b) {
    int last = --b->refs == 0;
    pthread_mutex_unlock(&b->mu);
    if (!last) return;
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}

static void *blocking_init_main(void *arg) {
    blocking_init_t *b = arg;
    nccl_comm_h comm = NULL;
    nccl_result_t r = NCCL_INTERNAL_ERROR;
    fsc_gpu_ctx_t g;
    int entered = fsc_gpu_ctx_enter(b->device, &g) == FSC_OK;
    if (entered && fsc_nccl_api.CommInitRankConfig != NULL) {
        nccl_config_t cfg = config_of(1);
        r = fsc_nccl_api.CommInitRankConfig(&comm, b->nranks, b->uid, b->rank, &cfg);
    } else if (entered) {
        r = fsc_nccl_api.CommInitRank(&comm, b->nranks, b->uid, b->rank);
    }
    pthread_mutex_lock(&b->mu);
    int abandoned = b->abandoned;
    b->done = 1;
    b->r = r;
    b->comm = abandoned ? NULL : comm;
    pthread_cond_broadcast(&b->cv);
    blocking_init_release(b);
    if (abandoned && comm != NULL) fsc_nccl_api.CommAbort(comm); /* its caller timed out and is gone */
    if (entered) fsc_gpu_ctx_exit(&g);
    return NULL;
}

/* Join as a blocking communicator (config.blocking = 1, or ncclCommInitRank where the library has
 * no config) on a thread of its own; store the result of NCCL's call in *r and the communicator
 * in *comm. FSC_ERR_TIMEOUT when `timeout_s` passes first (the thread is left to finish). */
static fsc_status_t init_blocking(const nccl_unique_id_t *uid, int rank, int nranks, int device, double timeout_s,
                                  nccl_comm_h *comm, nccl_result_t *r) {
    double deadline = fsc_comm_now() + timeout_s;
    blocking_init_t *b = calloc(1, sizeof(*b));
    if (b == NULL) return fsc_error(FSC_ERR_NOMEM, "nccl init: out of memory");
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&b->mu, NULL);
    b->refs = 2;
    b->device = device, b->rank = rank, b->nranks = nranks, b->uid = *uid;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int rc = pthread_create(&t, &attr, blocking_init_main, b);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        pthread_mutex_lock(&b->mu);
        b->refs = 1;
        blocking_init_release(b);
        return fsc_error(FSC_ERR_SYSTEM, "nccl init: cannot start the init thread: %s", strerror(rc));
    }
    struct timespec until; /* `deadline` on CLOCK_MONOTONIC, as fsc_comm_now() reads it */
    until.tv_sec = (time_t)deadline;
    until.tv_nsec = (long)((deadline - (double)until.tv_sec) * 1e9);
    if (until.tv_nsec >= 1000000000L) until.tv_nsec = 999999999L;
    pthread_mutex_lock(&b->mu);
    while (!b->done) {
        int e = pthread_cond_timedwait(&b->cv, &b->mu, &until);
        if (e != 0 && e != EINTR) break; /* ETIMEDOUT, or a wait that cannot work: stop waiting */
    }
    fsc_status_t st = FSC_OK;
    if (b->done) {
        *comm = b->comm;
        *r = b->r;
    } else {
        b->abandoned = 1;
        st = fsc_error(FSC_ERR_TIMEOUT,
                       "nccl init on rank %d of %d (cuda:%d): not every rank joined the blocking communicator "
                       "within %g s (the timeout; FAIRSCALE_C_TIMEOUT by default)",
                       rank, nranks, device, timeout_s);
    }
    blocking_init_release(b);
    return st;
}

fsc_status_t fsc_nccl_comm_init(const unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES], int rank, int nranks, int device,
                                double timeout_s, fsc_nccl_comm_t **out) {
    fsc_status_t st = FSC_OK;
    fsc_gpu_ctx_t g;
    nccl_unique_id_t uid;
    if (nranks < 1) return fsc_error(FSC_ERR_VALUE, "nccl init: size must be >= 1, got %d", nranks);
    if (rank < 0 || rank >= nranks)
        return fsc_error(FSC_ERR_VALUE, "nccl init: rank must be in [0, %d), got %d", nranks, rank);
    int blocking = 0;
    FSC_CHECK(fsc_nccl_blocking_get(&blocking));
    FSC_CHECK(ensure_loaded());
    FSC_CHECK(fsc_gpu_ctx_enter(device, &g)); /* NCCL binds the comm to the current device */
    fsc_nccl_comm_t *c = calloc(1, sizeof(*c));
    if (c == NULL) FSC_CHECK_GOTO(fsc_error(FSC_ERR_NOMEM, "nccl init: out of memory"), st, exit);
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->wd_cv, NULL);
    c->rank = rank;
    c->nranks = nranks;
    c->device = device;
    c->blocking = blocking || fsc_nccl_api.CommInitRankConfig == NULL;
    c->owner_pid = (int)getpid();
    c->op_timeout = timeout_s > 0 ? timeout_s : fsc_comm_timeout_s();
    c->pending = calloc(WD_MAX_PENDING, sizeof(pending_op_t));
    if (c->pending == NULL) FSC_CHECK_GOTO(fsc_error(FSC_ERR_NOMEM, "nccl init: out of memory"), st, fail);
    memcpy(uid.internal, id, FSC_NCCL_UNIQUE_ID_BYTES);

    double deadline = fsc_comm_now() + c->op_timeout;
    nccl_result_t r = NCCL_INTERNAL_ERROR;
    if (fsc_nccl_api.CommInitRankConfig != NULL && !blocking) {
        nccl_config_t cfg = config_of(0);
        r = fsc_nccl_api.CommInitRankConfig(&c->comm, nranks, uid, rank, &cfg);
    } else {
        if (fsc_nccl_api.CommInitRankConfig == NULL)
            FSC_INFO("nccl", "NCCL %d has no ncclCommInitRankConfig; using blocking ncclCommInitRank",
                     fsc_nccl_version_code);
        FSC_CHECK_GOTO(init_blocking(&uid, rank, nranks, device, c->op_timeout, &c->comm, &r), st, fail);
    }
    if (r == NCCL_IN_PROGRESS && c->comm == NULL) r = NCCL_INTERNAL_ERROR; /* no handle to poll */
    pthread_mutex_lock(&c->lock);
    st = fsc_nccl_settle_locked(c, r, "init", deadline, 1);
    pthread_mutex_unlock(&c->lock);
    if (st != FSC_OK) goto fail;
    if (c->blocking) FSC_CHECK_GOTO(fsc_nccl_submitter_start(c->comm, device, rank, &c->submitter), st, fail);
    FSC_CHECK_GOTO(fsc_nccl_watchdog_start(c), st, fail);
    FSC_INFO("nccl", "rank %d of %d joined on cuda:%d (%s communicator)", rank, nranks, device,
             c->blocking ? "blocking" : "non-blocking");
    *out = c;
    goto exit;
fail:
    fsc_nccl_comm_free(c);
exit:
    fsc_gpu_ctx_exit(&g);
    return st;
}

/* FSC_ERR_COMM in a fork() child of the process that created `c`: NCCL and CUDA do not survive
 * fork, the watchdog thread did not come along, and the lock may have been held at the fork. */
fsc_status_t fsc_nccl_check_owner(const fsc_nccl_comm_t *c, const char *what) {
    if ((int)getpid() == c->owner_pid) return FSC_OK;
    return fsc_error(FSC_ERR_COMM,
                     "nccl %s: the communicator was created by pid %d; this process (pid %d) is a fork() child "
                     "of it and cannot use it",
                     what, c->owner_pid, (int)getpid());
}

/* ---- waiting and teardown -------------------------------------------------------------------- */

fsc_status_t fsc_nccl_wait(fsc_nccl_comm_t *c, fsc_stream_t stream, double timeout_s) {
    fsc_status_t st = FSC_OK;
    fsc_gpu_event_t ev = NULL;
    double timeout = timeout_s > 0 ? timeout_s : fsc_comm_timeout_s();
    double deadline = fsc_comm_now() + timeout;
    double since = fsc_comm_now();

    FSC_CHECK(fsc_nccl_check_owner(c, "wait"));
    pthread_mutex_lock(&c->lock);
    st = c->state == COMM_ALIVE ? FSC_OK : fsc_nccl_dead_error(c, "wait");
    fsc_comm_op_t last = c->last_op;
    uint64_t nops = c->nops;
    pthread_mutex_unlock(&c->lock);
    FSC_CHECK(st);
    FSC_CHECK(fsc_gpu_event_record(c->device, stream, &ev));
    for (;;) {
        int done = 0;
        FSC_CHECK_GOTO(fsc_gpu_event_query(c->device, ev, &done), st, exit);
        if (done) break;
        /* The lock is taken per poll, never across the sleep, so abort() from another thread
         * gets through. */
        pthread_mutex_lock(&c->lock);
        if (c->state != COMM_ALIVE) {
            st = fsc_nccl_dead_error(c, "wait");
        } else {
            nccl_result_t async = NCCL_OK;
            nccl_result_t q = fsc_nccl_api.CommGetAsyncError(c->comm, &async);
            nccl_result_t r = q != NCCL_OK ? q : async;
            if (r != NCCL_OK && r != NCCL_IN_PROGRESS) {
                char what[64];
                snprintf(what, sizeof(what), "wait for %s #%llu", fsc_comm_op_name(last), (unsigned long long)nops);
                st = fsc_nccl_fail_locked(c, r, what, 1);
            } else if (fsc_comm_now() > deadline) {
                char msg[256];
                snprintf(msg, sizeof(msg),
                         "nccl wait on rank %d of %d (cuda:%d): %s #%llu did not complete within %g s", c->rank,
                         c->nranks, c->device, fsc_comm_op_name(last), (unsigned long long)nops, timeout);
                fsc_nccl_abort_locked(c, msg);
                st = fsc_error(FSC_ERR_TIMEOUT, "%s; communicator aborted", msg);
            }
        }
        pthread_mutex_unlock(&c->lock);
        if (st != FSC_OK) goto exit;
        fsc_nccl_backoff(since);
    }
exit:
    fsc_gpu_event_destroy(c->device, ev);
    return st;
}

fsc_status_t fsc_nccl_comm_abort(fsc_nccl_comm_t *c) {
    FSC_CHECK(fsc_nccl_check_owner(c, "abort"));
    pthread_mutex_lock(&c->lock);
    fsc_nccl_abort_locked(c, "aborted by the user");
    pthread_mutex_unlock(&c->lock);
    return FSC_OK;
}

fsc_status_t fsc_nccl_comm_destroy(fsc_nccl_comm_t *c, double timeout_s) {
    fsc_status_t st = FSC_OK;
    fsc_gpu_ctx_t g;
    FSC_CHECK(fsc_nccl_check_owner(c, "destroy"));
    pthread_mutex_lock(&c->lock);
    if (c->state != COMM_ALIVE) goto unlock; /* already gone: idempotent */
    FSC_CHECK_GOTO(fsc_gpu_ctx_enter(c->device, &g), st, unlock);
    if (c->blocking) {
        /* A blocking finalize (and a destroy, which finalizes) waits for every peer without a
         * bound. Wait for this rank's own operations up to the deadline instead, then release the
         * communicator locally: ncclCommAbort frees its resources without talking to peers. */
        FSC_CHECK_GOTO(fsc_nccl_drain_locked(c, fsc_nccl_deadline_after(timeout_s)), st, exit);
        fsc_nccl_api.CommAbort(c->comm);
        c->comm = NULL;
        c->state = COMM_DESTROYED;
        goto exit;
    }
    if (fsc_nccl_api.CommFinalize != NULL)
        FSC_CHECK_GOTO(fsc_nccl_settle_locked(c, fsc_nccl_api.CommFinalize(c->comm), "finalize",
                                              fsc_nccl_deadline_after(timeout_s), 1),
                       st, exit);
    nccl_result_t r = fsc_nccl_api.CommDestroy(c->comm);
    c->comm = NULL;
    c->state = COMM_DESTROYED;
    if (r != NCCL_OK)
        st = fsc_error(FSC_ERR_COMM, "nccl destroy on rank %d of %d failed: %s", c->rank, c->nranks,
                       fsc_nccl_api.GetErrorString(r));
exit:
    fsc_gpu_ctx_exit(&g);
unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

void fsc_nccl_comm_free(fsc_nccl_comm_t *c) {
    if (c == NULL) return;
    if (fsc_nccl_check_owner(c, "free") != FSC_OK) { /* a fork() child: release the host memory only */
        free(c->pending);
        free(c);
        return;
    }
    fsc_nccl_watchdog_stop(c);
    fsc_nccl_submitter_stop(c->submitter); /* idle: no caller holds the lock */
    c->submitter = NULL;
    pthread_mutex_lock(&c->lock);
    if (c->comm != NULL) fsc_nccl_abort_locked(c, "released without destroy()");
    pthread_mutex_unlock(&c->lock);
    pthread_cond_destroy(&c->wd_cv);
    pthread_mutex_destroy(&c->lock);
    free(c->pending);
    free(c);
}
