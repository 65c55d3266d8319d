/* shm_internal.h — private to csrc/shm*.c: the segment layout, the group struct and the
 * wait/post primitives the algorithms are built from. */
#ifndef FSC_SHM_INTERNAL_H
#define FSC_SHM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "comm/shm.h"

#define FSC_SHM_LINE 128                    /* two x86 lines: adjacent-line prefetch must not cause false sharing */
#define FSC_SHM_MAGIC 0x31306d6873637366ull /* "fscshm01" */
#define FSC_SHM_VERSION 1u
#define FSC_SHM_MAX_RANKS 256

/* Per-rank control block, written only by its rank. */
typedef struct {
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t arrive;  /* barrier epoch; futex word */
    _Atomic uint32_t sleepers;                       /* ranks sleeping in futex on `arrive` */
    _Alignas(FSC_SHM_LINE) fsc_comm_header_t hdr[2]; /* collective header, indexed by seq & 1 */
    fsc_comm_header_t cur;                           /* what the rank is doing now (diagnostics) */
    _Atomic int32_t pid;
    _Atomic uint32_t attached;
} fsc_shm_rank_ctrl_t;

/* One direction of a send/recv pair: src writes `sent` and `hdr`, dst writes `acked`. */
typedef struct {
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t sent;
    _Atomic uint32_t sent_sleepers;
    fsc_comm_header_t hdr;
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t acked;
    _Atomic uint32_t acked_sleepers;
    _Atomic uint32_t err;   /* receiver saw a mismatching header */
    fsc_comm_header_t rhdr; /* the receiver's header when err is set */
} fsc_shm_chan_t;

/* Start of the segment. Everything after it is addressed by the offsets. */
typedef struct {
    _Atomic uint64_t magic; /* written last by the creator */
    uint32_t version;
    int32_t size;
    uint64_t chunk;     /* bytes per data slot buffer */
    uint64_t p2p_chunk; /* bytes per send/recv buffer */
    uint64_t total;
    uint64_t off_ranks, off_chans, off_slots, off_result, off_p2p;
    _Alignas(FSC_SHM_LINE) _Atomic uint32_t nattached;
} fsc_shm_seg_t;

struct fsc_shm_work {
    fsc_shm_args_t args;
    _Atomic int refs;
    _Atomic int done;
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
    size_t chunk, p2p_chunk;
    /* private copies of the segment's offsets, validated once at attach: a peer that rewrites
     * the header afterwards cannot move this rank's reads and writes */
    size_t off_slots, off_result, off_p2p;
    int unlinked;
    /* protocol state (the thread running ops owns it) */
    uint32_t epoch;
    uint64_t coll_seq;
    uint64_t step;
    uint64_t *send_seq, *recv_seq; /* per peer */
    /* current op, for error messages */
    char op_desc[192];
    double deadline;
    /* set by fsc_shm_group_close when its grace period ran out: waits for peers give up */
    _Atomic int abandon;
    /* sticky failure: once an op fails every later op fails with this */
    fsc_status_t broken;
    char broken_msg[1024];
    /* progress thread (shm_queue.c) */
    int engine_started;
    int stop;
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

static inline fsc_shm_chan_t *fsc_shm_chan(fsc_shm_group_t *g, int src, int dst) {
    return &g->chans[(size_t)src * (size_t)g->size + (size_t)dst];
}

static inline uint8_t *fsc_shm_p2p_buf(fsc_shm_group_t *g, int src, int dst, uint32_t k) {
    size_t pair = (size_t)src * (size_t)g->size + (size_t)dst;
    return g->base + g->off_p2p + (pair * 2 + (k & 1)) * g->p2p_chunk;
}

/* Publish `value` in `word` and wake its sleepers. */
void fsc_shm_post(_Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t value);

/* Block until `word` has reached `target` (wrap-around aware), spinning briefly, then sleeping
 * in futex slices while checking g->deadline and whether rank `peer` is still alive. Errors
 * name g->op_desc, the group and the peer. */
fsc_status_t fsc_shm_wait(fsc_shm_group_t *g, _Atomic uint32_t *word, _Atomic uint32_t *sleepers, uint32_t target,
                          int peer);

/* Bump this rank's barrier epoch; with `wait`, block until every other rank has reached it. */
fsc_status_t fsc_shm_arrive(fsc_shm_group_t *g, int wait);

/* FSC_ERR_COMM when the calling process is not the one that opened `g` (a fork() child: the
 * progress thread and any lock it held did not come along), else FSC_OK. */
fsc_status_t fsc_shm_check_owner(const fsc_shm_group_t *g);

/* Stop and join the progress thread once its queue has drained (shm_queue.c). With
 * grace_s >= 0, an op still waiting for a peer after grace_s seconds is abandoned (it fails, and
 * so do the ops queued behind it). No-op when it was never started, and in a fork() child (whose
 * copy has no thread to join). */
void fsc_shm_engine_stop(fsc_shm_group_t *g, double grace_s);

#endif /* FSC_SHM_INTERNAL_H */
