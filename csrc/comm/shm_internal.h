/* shm_internal.h — private to csrc/shm*.c: the segment layout, the group struct and the
 * wait/post primitives the algorithms are built from. */
#ifndef FSC_SHM_INTERNAL_H
#define FSC_SHM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "comm/shm.h"

#define FSC_SHM_LINE 128                    /* two x86 lines: adjacent-line prefetch must not cause false sharing */
#define FSC_SHM_MAGIC 0x31306d6873637366ull /* "fscshm01" */
#define FSC_SHM_VERSION 10u
#define FSC_SHM_MAX_RANKS 256

/* Per-rank control block, written only by its rank. */
typedef struct {
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t arrive;  /* barrier epoch; futex word */
    _Atomic uint32_t sleepers;                       /* ranks sleeping in futex on `arrive` */
    _Alignas(FSC_SHM_LINE) fsc_comm_header_t hdr[2]; /* collective header, indexed by seq & 1 */
    fsc_comm_header_t cur;                           /* what the rank is doing now (diagnostics) */
    _Atomic int32_t pid;
    _Atomic uint32_t attached;
    _Atomic uint32_t gave_up; /* 1 once this rank has given up on the group (fsc_shm_group_give_up) */
    /* Where this rank last arrived or started waiting: (thread id << 32) | CPU; 0 when unknown. */
    _Atomic uint64_t where;
    /* Rung by a peer each time it posts on a send/recv channel towards this rank, so a rank with
     * several point-to-point ops in flight sleeps on one futex word. */
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t bell;
    _Atomic uint32_t bell_sleepers;
    /* Direct reads (shm_direct.c): the peers copy this rank's buffers with process_vm_readv.
     * Before joining, the rank publishes its limit and a random cookie that it also keeps in its
     * own memory at direct_cookie_addr; at join every rank reads every peer's cookie that way and says
     * whether it could (direct_ok). */
    _Alignas(FSC_SHM_LINE) uint64_t direct_in; /* the current direct op's input, in this rank's address space */
    uint64_t direct_out;                       /* ... and its output (all_reduce) */
    /* The same buffers as (allocation id, offset) when they lie in a shared tensor (shm_shared.h;
     * id 0: they do not): a peer that maps that allocation reads and writes them itself. */
    uint64_t shared_in_id, shared_in_off, shared_out_id, shared_out_off;
    uint64_t direct_max;  /* this rank's FAIRSCALE_C_SHM_DIRECT_MAX */
    uint32_t reads_mode;  /* this rank's FAIRSCALE_C_SHM_DIRECT_READS: 0 off, 1 auto, 2 on */
    uint32_t read_choice; /* rank 0, auto: 1 when the current direct op reads the peers' buffers, 0: slots */
    uint64_t direct_cookie, direct_cookie_addr;
    _Atomic uint32_t direct_ok; /* 0: not probed yet; 1: read every peer's cookie; 2: could not */
} fsc_shm_rank_ctrl_t;

/* One direction of a send/recv pair. Messages travel in chunks through two buffers; chunk j (counted
 * over the channel's life) uses buffer j & 1 and carries its message's header in hdr[j & 1]. src
 * writes `sent` (= chunks posted) and `hdr`, dst writes `acked` (= chunks taken). A direct message
 * (shm_p2p.c) is one chunk whose buffer stays empty: src[j & 1] is the sender's buffer in the
 * sender's address space (and src_shared_*[j & 1] the same as a shared allocation's id and offset,
 * id 0 when it is not in one), which the receiver copies from itself. */
typedef struct {
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t sent;
    _Atomic uint32_t sent_sleepers;
    fsc_comm_header_t hdr[2];
    uint64_t src[2], src_shared_id[2], src_shared_off[2];
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t acked;
    _Atomic uint32_t acked_sleepers;
    _Atomic uint32_t err;   /* receiver saw a mismatching header */
    fsc_comm_header_t rhdr; /* the receiver's header when err is set */
    fsc_comm_header_t shdr; /* the refused message's header when err is set */
} fsc_shm_chan_t;

/* Start of the segment. Everything after it is addressed by the offsets. */
typedef struct {
    _Atomic uint64_t magic; /* written last by the creator */
    uint32_t version;
    int32_t size;
    uint64_t chunk;     /* bytes per data slot buffer */
    uint64_t p2p_chunk; /* bytes per send/recv buffer */
    uint64_t piece;     /* bytes per pipeline step of all_gather, broadcast and reduce: chunk or chunk / 4 */
    uint64_t total;
    uint64_t off_ranks, off_chans, off_slots, off_result, off_p2p;
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t nattached;
    _Atomic uint32_t gave_up; /* ranks that have given up: one load per op tells whether to look */
} fsc_shm_seg_t;

/* Progress of one send or recv. */
typedef struct {
    const fsc_shm_args_t *a;
    fsc_comm_header_t h;
    uint32_t j0;      /* channel index of the message's first chunk */
    uint32_t nchunks; /* chunks of the message (1 for an empty one) */
    uint32_t k;       /* chunks moved so far */
    int started, done;
    int direct; /* the receiver copies the message from the sender's buffer (shm_p2p.c) */
    int posted; /* direct send: its chunk is posted */
} fsc_shm_p2p_t;

/* Rank 0's recent timings of one op and size class in the direct window, each way (shm_direct.c,
 * choose_reads): the last FSC_SHM_CHOICE_KEEP op times through the slots (way 0) and through
 * reads of the peers' buffers (way 1). */
#define FSC_SHM_CHOICE_OPS 4      /* all_gather, reduce_scatter, broadcast, all_reduce */
#define FSC_SHM_CHOICE_CLASSES 16 /* 32, 64, ... 512 KiB, 1 MiB, ... 512 MiB, 1 GiB and up (op bytes, rounded down) */
#define FSC_SHM_CHOICE_KEEP 8
typedef struct {
    double secs[2][FSC_SHM_CHOICE_KEEP];
    uint32_t n[2]; /* timings taken each way (the last FSC_SHM_CHOICE_KEEP are kept) */
    uint32_t calls;
} fsc_shm_choice_t;

/* 1 on a group's progress thread (shm_queue.c): the ops it runs were queued (async). */
extern _Thread_local int fsc_shm_on_progress_thread;

/* One submitted item: a single op or a batch. */
struct fsc_shm_work {
    fsc_shm_args_t *args;
    size_t n;
    int p2p_only;       /* every op is a send or recv */
    fsc_shm_p2p_t *p2p; /* n entries, used by the sends and recvs */
    _Atomic int refs;
    _Atomic int done;
    int owner_pid; /* the process that submitted it (its progress thread runs it) */
    fsc_status_t st;
    char msg[1024];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct fsc_shm_work *next;
};

struct fsc_shm_group {
    char name[128];
    char seg_name[64];
    int rank, size;
    int owner_pid; /* the process that opened it; a forked child must not use or stop it */
    double timeout;
    uint8_t *base;
    size_t bytes;
    fsc_shm_seg_t *seg;
    fsc_shm_rank_ctrl_t *ranks;
    fsc_shm_chan_t *chans; /* [src * size + dst] */
    size_t chunk, p2p_chunk, piece;
    /* largest op that may read the peers' memory directly (shm_direct.c; agreed by every rank at
     * join; 0: never). direct_cookie is what peers read to check that they can. */
    size_t direct_max;
    /* the agreed FAIRSCALE_C_SHM_DIRECT_READS (0 off, 1 auto, 2 on), the same on every rank: with
     * 0, collectives never read the peers' private buffers (process_vm_readv), only the slots */
    uint32_t reads_mode;
    /* auto: rank 0 times both ways per op and size class and picks for every rank (shm_direct.c) */
    fsc_shm_choice_t choice[FSC_SHM_CHOICE_OPS][FSC_SHM_CHOICE_CLASSES];
    fsc_shm_choice_t *choice_pending; /* rank 0: the op running now is timed into it ... */
    int choice_reads;                 /* ... for this way (1: reads, 0: slots) */
    uint64_t direct_cookie;
    uint8_t *direct_scratch;     /* (size - 1) pieces the reductions read the peers' data into (shm_direct.c) */
    _Atomic uint64_t mapped_ops; /* collectives run on shared tensors (shm_direct.c) */
    _Atomic uint64_t read_ops;   /* ... and by reading the peers' private buffers */
    int spins, yields;           /* a waiter's pause and yield budget before it sleeps (fsc_shm_wait_budget) */
    /* private copies of the segment's offsets, validated once at attach: a peer that rewrites
     * the header afterwards cannot move this rank's reads and writes */
    size_t off_slots, off_result, off_p2p;
    int unlinked;
    /* protocol state (the thread running ops owns it) */
    uint32_t epoch;
    uint64_t coll_seq;
    uint64_t step;
    uint64_t *send_seq, *recv_seq;   /* messages per peer (header sequence numbers) */
    uint32_t *send_next, *recv_next; /* chunks per peer: channel index of the next chunk */
    uint8_t *send_busy, *recv_busy;  /* per peer, scratch of one progress pass */
    /* current op, for error messages (formatted only when one is raised) */
    fsc_comm_header_t cur_hdr;
    double deadline;
    size_t p2p_probe; /* which in-flight send/recv the next point-to-point wait watches */
    /* set by fsc_shm_group_close when its grace period ran out: waits for peers give up */
    _Atomic int abandon;
    /* sticky failure: once an op fails every later op fails with this */
    fsc_status_t broken;
    char broken_msg[1024];
    /* progress thread (shm_queue.c) */
    int engine_started;
    int thread_joined; /* fsc_shm_engine_stop has joined it; the queue's lock and condition live on */
    int stop;
    int inline_running; /* the calling thread is running an op itself (qmu) */
    pthread_t thread;
    pthread_mutex_t qmu;
    pthread_cond_t qcv;
    fsc_shm_work_t *qhead, *qtail;
};

static inline uint8_t *fsc_shm_slot(fsc_shm_group_t *g, int r, uint64_t step) {
    return g->base + g->off_slots + ((size_t)r * 2 + (size_t)(step & 1)) * g->chunk;
}

static inline uint8_t *fsc_shm_result(fsc_shm_group_t *g, uint64_t step) {
    return g->base + g->off_result + (size_t)(step & 1) * g->chunk;
}

/* Rank r's part [*lo, *hi) of n elements an all_reduce splits among the ranks: 1/size of them,
 * rounded up to 64 bytes so that no two ranks write the same cache line. */
static inline void fsc_shm_part(const fsc_shm_group_t *g, int r, size_t n, size_t esz, size_t *lo, size_t *hi) {
    size_t align = 64 / esz;
    size_t part = ((n + (size_t)g->size - 1) / (size_t)g->size + align - 1) / align * align;
    *lo = (size_t)r * part < n ? (size_t)r * part : n;
    *hi = *lo + part < n ? *lo + part : n;
}

static inline fsc_shm_chan_t *fsc_shm_chan(fsc_shm_group_t *g, int src, int dst) {
    return &g->chans[(size_t)src * (size_t)g->size + (size_t)dst];
}

static inline uint8_t *fsc_shm_p2p_buf(fsc_shm_group_t *g, int src, int dst, uint32_t k) {
    size_t pair = (size_t)src * (size_t)g->size + (size_t)dst;
    return g->base + g->off_p2p + (pair * 2 + (k & 1)) * g->p2p_chunk;
}

/* CPUs this process may run on (its affinity mask; the online count when that cannot be read). */
int fsc_shm_cpus_available(void);

/* Set g->spins and g->yields, the waiters' budget before they sleep, for the group's size. */
void fsc_shm_wait_budget(fsc_shm_group_t *g);

/* 1 when `pid` no longer runs: gone, or a zombie nobody has reaped yet. */
int fsc_shm_pid_dead(pid_t pid);

/* Publish `value` in `word` and wake its sleepers. */
void fsc_shm_post(_Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t value);

/* Ring rank `r`'s bell (after posting on a channel towards it). */
void fsc_shm_ring(fsc_shm_group_t *g, int r);

/* 1 when `word` has reached `target` (wrap-around aware). */
static inline int fsc_shm_reached(_Atomic uint32_t *word, uint32_t target) {
    return (int32_t)(atomic_load_explicit(word, memory_order_acquire) - target) >= 0;
}

/* How long a waiter has been waiting: spins, then yields, then futex sleeps in slices. */
typedef struct {
    int spins, yields;
    double started;    /* when this waiter first slept */
    double last_check; /* last peer liveness check */
    int read_proc;     /* looked in /proc whether the peer waits for this CPU (shm_wait.c, fsc_shm_backoff) */
} fsc_shm_backoff_t;

/* One step of waiting for `word` to change from `seen` (spin, yield or a futex slice), then the
 * checks a sleeping waiter makes: the timeout (the op's deadline passed and this waiter has slept
 * for the timeout: an op that keeps moving may outlast it), the group being abandoned, an interrupt of the
 * calling thread, and (every 50 ms) whether rank `peer` is alive and whether any rank gave up on
 * the group. FSC_OK to look again. */
fsc_status_t fsc_shm_backoff(fsc_shm_group_t *g, fsc_shm_backoff_t *b, _Atomic uint32_t *word,
                             _Atomic uint32_t *sleepers, uint32_t seen, int peer);

/* g->cur_hdr formatted ("all_reduce(count=..., seq=...)"). */
const char *fsc_shm_op_desc(fsc_shm_group_t *g, char *buf, size_t cap);

/* Run the sends and recvs among `ops` (n of them, issue order) to completion, all at once: each
 * send/recv channel moves its messages in order, the channels beside each other, so no order of
 * issue on the ranks can deadlock. Sends complete once their data is in the shared buffers
 * (shm_p2p.c). `st` holds one progress record per op. */
fsc_status_t fsc_shm_p2p_run(fsc_shm_group_t *g, const fsc_shm_args_t *ops, fsc_shm_p2p_t *st, size_t n);

/* One pass over `n` records (issue order): start what can start, move every chunk that can move.
 * Sets *progressed when anything moved; *left = records not done. Errors name the op. */
fsc_status_t fsc_shm_p2p_pass(fsc_shm_group_t *g, fsc_shm_p2p_t *const *recs, size_t n, int *progressed, size_t *left);

/* Wait a little for point-to-point progress on this rank's bell (seen: its value before the pass). */
fsc_status_t fsc_shm_p2p_backoff(fsc_shm_group_t *g, fsc_shm_backoff_t *b, fsc_shm_p2p_t *const *recs, size_t n,
                                 uint32_t seen);

/* A send completes before its receiver looks at it; a receiver that refused one (the header did
 * not match) says so on the channel, and the sender fails (FSC_ERR_MISMATCH naming the recv) at its
 * next op or while it waits in one. */
fsc_status_t fsc_shm_check_refused(fsc_shm_group_t *g);

/* FSC_ERR_COMM naming the rank when a rank of the group (this one included) has given up on it,
 * with `what` (the op waiting, or NULL) in the message; FSC_OK otherwise. */
fsc_status_t fsc_shm_check_gave_up(fsc_shm_group_t *g, const char *what);

/* Fail with the group's sticky error when it is broken, used from a fork() child, a message it
 * sent was refused, or a rank has given up on the group. */
fsc_status_t fsc_shm_check_usable(fsc_shm_group_t *g);

/* Record a failure as the group's sticky error (argument errors excepted) and return it. */
fsc_status_t fsc_shm_fail(fsc_shm_group_t *g, fsc_status_t st);

/* Block until `word` has reached `target` (wrap-around aware), spinning briefly, then sleeping
 * in futex slices while checking g->deadline and whether rank `peer` is still alive. Errors
 * name g->op_desc, the group and the peer. */
fsc_status_t fsc_shm_wait(fsc_shm_group_t *g, _Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t target,
                          int peer);

/* Ops whose output is at least this large write it with streaming stores (fsc_shm_copy_out). */
#define FSC_SHM_STREAM_MIN ((size_t)16 << 20)

/* Copy n bytes from src to each of the nd dsts; with `streaming`, into outputs too large to stay
 * in the caches, with non-temporal stores (x86-64), reading each source line once. */
void fsc_shm_copy_out_n(void *const *dsts, int nd, const void *src, size_t n, int streaming);

/* fsc_shm_copy_out_n to one destination (nothing to do when it is the source). */
void fsc_shm_copy_out(void *dst, const void *src, size_t n, int streaming);

/* Copy n bytes at address `src` of rank `peer`'s process into `dst` (process_vm_readv). Returns 0,
 * or the errno of the failed read (EIO for a read that moved nothing). */
int fsc_shm_peer_read(const fsc_shm_group_t *g, int peer, void *dst, uint64_t src, size_t n);

/* First barrier of a collective: publish the op's header, wait for every rank, compare the
 * headers (FSC_ERR_MISMATCH naming both sides when they differ). */
fsc_status_t fsc_shm_open_collective(fsc_shm_group_t *g, const fsc_shm_args_t *a);

/* Bump this rank's barrier epoch; with `wait`, block until every other rank has reached it. */
fsc_status_t fsc_shm_arrive(fsc_shm_group_t *g, int wait);

/* FSC_ERR_COMM when the calling process is not the one that opened `g` (a fork() child: the
 * progress thread and any lock it held did not come along), else FSC_OK. */
fsc_status_t fsc_shm_check_owner(const fsc_shm_group_t *g);

/* Stop the progress thread if it runs, then destroy the queue's lock and condition (shm_queue.c;
 * fsc_shm_group_close calls it). */
void fsc_shm_engine_free(fsc_shm_group_t *g);

#endif /* FSC_SHM_INTERNAL_H */
