/* shm.h — the shared-memory collective engine for CPU tensors of ranks on one host: group
 * rendezvous over a POSIX shm segment, blocking collectives, and an in-order progress thread. */
#ifndef FSC_SHM_H
#define FSC_SHM_H

#include <stddef.h>

#include "base/status.h"
#include "base/tensor.h"
#include "comm/comm.h"

/* One rank's handle on a group's segment. Opaque; not thread-safe except where noted (the
 * progress thread is the only user once fsc_shm_engine_start has been called). */
typedef struct fsc_shm_group fsc_shm_group_t;

/* One queued op. Owned jointly by the submitter and the progress thread (reference counted). */
typedef struct fsc_shm_work fsc_shm_work_t;

/* Description of one op. Buffers are contiguous CPU memory of `dtype`; element counts:
 *   BARRIER         in/out unused, count 0
 *   ALL_GATHER      in: count, out: size * count (rank r's input lands at out[r * count])
 *   REDUCE_SCATTER  in: size * count, out: count (rank r gets block r reduced over ranks)
 *   ALL_REDUCE      in, out: count (may be the same buffer)
 *   BROADCAST       root's in is copied to every rank's out (in == out is fine)
 *   REDUCE          in: count; root's out receives the reduction, other ranks' out is unused
 *   SEND / RECV     in (send) / out (recv): count; `root` is the peer's group rank, `tag` the
 *                   message's tag (a recv takes the next message from its peer, which must carry
 *                   the same tag, count and dtype)
 * The caller keeps the buffers alive and unmodified until the op completes. */
typedef struct {
    fsc_comm_op_t op;
    fsc_reduce_op_t redop;
    int root;
    fsc_dtype_t dtype;
    size_t count;
    const void *in;
    void *out;
    int32_t tag; /* send / recv only; 0 otherwise */
} fsc_shm_args_t;

/* Open this rank's handle. With `create` a new segment is made under `seg_name` ("/name"), or
 * under a fresh "/fsc-<pid>-<hex>" when seg_name is NULL (the caller then sends
 * fsc_shm_group_segment_name() to the other ranks). Without `create` the named segment is
 * attached, waiting until the creator has set it up: up to the timeout, or until `creator_pid`
 * (0: unknown) has exited, after which the half-made name is removed. A segment is attached only
 * when it belongs to this process's effective uid and has no group/other permission bits, and
 * its header is validated once against the layout `size` implies (FSC_ERR_COMM otherwise); the
 * offsets are then kept privately and never read from shared memory again. Publishing the name
 * before creating the segment therefore leaves nothing behind if the creator dies while any
 * peer is alive. `group_name` appears in every error message. Sizes come from
 * FAIRSCALE_C_SHM_CHUNK (bytes per pipeline chunk, default 1 MiB) read by the creator. The
 * timeout for rendezvous and for every op is FAIRSCALE_C_TIMEOUT, read here (FSC_ERR_VALUE when
 * invalid). Creating a segment first sweeps stale ones (fsc_shm_sweep_stale). On success *out is
 * owned by the caller (fsc_shm_group_close). */
fsc_status_t fsc_shm_group_open(const char *group_name, const char *seg_name, int create, int creator_pid, int rank,
                                int size, fsc_shm_group_t **out);

/* A fresh segment name, "/fsc-<pid>-<pid namespace>-<8 random hex digits>", for a creator to
 * publish before it creates the segment. The pid and namespace let fsc_shm_sweep_stale judge
 * whether the creator still runs. `cap` >= 64. */
void fsc_shm_segment_name(char *buf, size_t cap);

/* Remove the /dev/shm segments that processes of this uid, in this pid namespace, created and
 * left behind when they died before the name could be removed (e.g. every rank killed during
 * rendezvous). Segments of other users, of other pid namespaces (whose pids mean nothing here),
 * of live processes, and names of any other form are left alone. Returns how many were removed.
 * fsc_shm_group_open calls it whenever it creates a segment. */
int fsc_shm_sweep_stale(void);

/* The segment's name ("/fsc-<pid>-<pidns>-<hex>"); valid while the group is open. */
const char *fsc_shm_group_segment_name(const fsc_shm_group_t *g);

/* Block until every rank has attached, then remove the segment's name so nothing is left in
 * /dev/shm whatever happens later. On timeout the name is removed too and FSC_ERR_TIMEOUT names
 * the ranks that never attached. */
fsc_status_t fsc_shm_group_join(fsc_shm_group_t *g);

/* Remove the segment's name now (idempotent; a missing name is not an error). For error paths
 * between open and join. */
void fsc_shm_group_unlink(fsc_shm_group_t *g);

/* Stop the progress thread (after the queued ops finish or fail), unmap and free. NULL is a
 * no-op. With grace_s < 0 it blocks at most about one timeout. With grace_s >= 0, an op still
 * waiting for a peer grace_s seconds after the call is abandoned: it fails with FSC_ERR_COMM
 * ("abandoned"), as do the ops queued behind it, so closing takes about grace_s at most (the
 * path for interpreter exit and error unwinding, where a peer may never come). A grace_s that is
 * NaN, infinite or above 1e9 s counts as no grace (< 0). */
void fsc_shm_group_close(fsc_shm_group_t *g, double grace_s);

/* Run one op on the calling thread and block until it completes. Every rank must issue the
 * same collectives in the same order (send/recv pair up per peer); a divergence is reported as
 * FSC_ERR_MISMATCH naming both sides, a peer that dies or stalls as FSC_ERR_COMM /
 * FSC_ERR_TIMEOUT naming the op, the group and the rank. After any such error the group is
 * unusable: later ops fail with the same message. Arguments are not validated here (the
 * binding layer checks them with fsc_comm_check_call before anything is sent). A send completes
 * once its data is in the shared buffers (it does not wait for the receiver to take it), so a
 * send of up to two p2p chunks (FAIRSCALE_C_SHM_CHUNK / 4 each, at least 64 KiB) never blocks. */
fsc_status_t fsc_shm_run(fsc_shm_group_t *g, const fsc_shm_args_t *a);

/* Run `n` ops issued together on the calling thread: the sends and recvs all at once (each
 * channel in order, channels side by side, so no order of issue can deadlock), then the
 * collectives in list order. */
fsc_status_t fsc_shm_run_batch(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n);

/* Start the group's progress thread. Afterwards ops go through fsc_shm_submit or
 * fsc_shm_try_inline only. */
fsc_status_t fsc_shm_engine_start(fsc_shm_group_t *g);

/* Tell every rank that this one gives up on the group (an error left its part of the collectives
 * unfinished): from now on each rank's ops on it, this rank's included, fail with FSC_ERR_COMM naming
 * this rank, those waiting already within about 50 ms. Only atomic stores: safe from any thread,
 * while ops run. Idempotent. */
void fsc_shm_group_give_up(fsc_shm_group_t *g);

/* FSC_OK, or the error that broke the group (a failed op or join), with its message. */
fsc_status_t fsc_shm_group_status(const fsc_shm_group_t *g);

/* Stop and join the progress thread once its queue has drained. With grace_s >= 0, an op still
 * waiting for a peer after grace_s seconds is abandoned (it fails, and so do the ops queued behind
 * it). Afterwards fsc_shm_submit and fsc_shm_try_inline fail (the group is closed) but `g` stays
 * valid until fsc_shm_group_close. Idempotent; no-op when the thread was never started, and in a
 * fork() child (whose copy has no thread to join). Blocks. */
void fsc_shm_engine_stop(fsc_shm_group_t *g, double grace_s);

/* Queue `n` ops issued together (one op, or a batch as in fsc_shm_run_batch) for the progress
 * thread; items run in submission order, except that consecutive items made only of sends and
 * recvs run together, as one batch would. Does not block; `a` is copied. On success *out holds
 * a reference owned by the caller (fsc_shm_work_release); items complete in submission order.
 * Safe to call from one thread at a time (the binding layer holds the GIL). */
fsc_status_t fsc_shm_submit(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n, fsc_shm_work_t **out);

/* When nothing is queued or running, run `n` ops (as fsc_shm_run_batch) on the calling thread
 * and set *ran = 1: a synchronous op then costs no hand-off to the progress thread and back.
 * Otherwise set *ran = 0 and return FSC_OK (the caller queues it instead). Meanwhile the
 * progress thread does not start queued items. */
fsc_status_t fsc_shm_try_inline(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n, int *ran);

/* Install a check that a thread running ops itself calls while it sleeps for a peer (every
 * 50 ms or so): when `fn(arg)` returns nonzero the op fails (FSC_ERR_COMM, "interrupted") and the
 * group becomes unusable. Thread-local; NULL removes it. The binding layer uses it to honour
 * Ctrl-C during fsc_shm_try_inline. */
void fsc_shm_set_interrupt_check(int (*fn)(void *), void *arg);
/* The calling thread's check as installed (NULL, NULL when none): to put it back after a nested
 * wait (a signal handler's op inside an op) installed its own. */
void fsc_shm_get_interrupt_check(int (**fn)(void *), void **arg);

/* The calling thread's interrupt check (nonzero: stop waiting), or 0 when none is installed. The
 * rendezvous waits of fsc_shm_group_open and fsc_shm_group_join call it every 50 ms or so. */
int fsc_shm_interrupted(void);

/* 1 when the op has finished (successfully or not), else 0. Never blocks. */
int fsc_shm_work_done(fsc_shm_work_t *w);

/* 1 in the process that submitted the op; 0 in a fork() child of it, where nothing runs the op
 * (fsc_shm_work_check_owner: the same as a status, FSC_ERR_COMM with a message). */
int fsc_shm_work_owned(const fsc_shm_work_t *w);
fsc_status_t fsc_shm_work_check_owner(const fsc_shm_work_t *w);

/* Block until the op finishes or `timeout_s` passes (< 0: no limit). Returns the op's status
 * and records its message on the calling thread; FSC_ERR_TIMEOUT if it has not finished in
 * time (the op keeps running). Thread-safe. */
fsc_status_t fsc_shm_work_wait(fsc_shm_work_t *w, double timeout_s);
/* The timeout error of a wait that gave up after `waited_s` seconds (the op still runs). */
fsc_status_t fsc_shm_work_timed_out(fsc_shm_work_t *w, double waited_s);

/* Drop the caller's reference. The op itself is not cancelled. NULL is a no-op. */
void fsc_shm_work_release(fsc_shm_work_t *w);

/* Rank / size / name of an open group. */
int fsc_shm_group_rank(const fsc_shm_group_t *g);
int fsc_shm_group_size(const fsc_shm_group_t *g);
const char *fsc_shm_group_name(const fsc_shm_group_t *g);

/* Largest op, in bytes, whose data this group's ranks may read straight from each other's memory
 * (process_vm_readv) instead of through the slots (shm_direct.c has the window): agreed by every rank at
 * fsc_shm_group_join from FAIRSCALE_C_SHM_DIRECT_MAX (default SIZE_MAX, no limit; the smallest of the
 * ranks' values), 0 when any rank cannot read its peers' memory or the group has one rank. */
size_t fsc_shm_group_direct_max(const fsc_shm_group_t *g);

/* Largest collective, in bytes, that reads the peers' private buffers (process_vm_readv) in the
 * window: direct_max, or 0 when the group keeps such collectives on the slots. Agreed at
 * fsc_shm_group_join from FAIRSCALE_C_SHM_DIRECT_READS: "on", "off", or "auto" (the default),
 * where rank 0 times synchronous ops of 512 KiB and more both ways and picks for every rank. */
size_t fsc_shm_group_read_max(const fsc_shm_group_t *g);

/* Collectives this group has run on its ranks' shared tensors, copying straight between their
 * mappings (shm_direct.c; diagnostics and tests). */
uint64_t fsc_shm_group_mapped_ops(const fsc_shm_group_t *g);

/* Collectives this rank has run by reading its peers' private buffers (process_vm_readv;
 * shm_direct.c; diagnostics and tests). */
uint64_t fsc_shm_group_read_ops(const fsc_shm_group_t *g);

#endif /* FSC_SHM_H */
