/* nccl.h — the collective engine's NCCL backend: libnccl loaded at run time, one communicator
 * per group (blocking by default, its calls made by a submitter thread under the timeout;
 * non-blocking on request), collectives enqueued on caller streams, error-polling waits, and a
 * watchdog thread per communicator. */
#ifndef FSC_NCCL_H
#define FSC_NCCL_H

#include <stddef.h>

#include "base/status.h"
#include "base/tensor.h"
#include "comm/comm.h"
#include "gpu/gpu.h"

#define FSC_NCCL_UNIQUE_ID_BYTES 128

/* One communicator: a rank's membership in one NCCL group, bound to one CUDA device.
 * Opaque; created by fsc_nccl_comm_init, released by fsc_nccl_comm_free. Calls on one
 * communicator are serialised by an internal lock, so it may be shared between threads (the
 * order in which threads issue collectives is then theirs to keep identical on every rank). */
typedef struct fsc_nccl_comm fsc_nccl_comm_t;

/* Load libnccl once per process (thread-safe; a failed attempt may be retried). Tries, in
 * order: the libnccl.so.2 already in the process (the one torch loaded), each of the
 * `npaths` files in `paths` (e.g. the nvidia-nccl wheel's lib/libnccl.so.2; may be NULL when
 * npaths is 0), then "libnccl.so.2" through the normal library search.
 * FSC_ERR_UNAVAILABLE listing what was tried when none loads. Does not initialise CUDA. */
fsc_status_t fsc_nccl_load(const char *const *paths, size_t npaths);

/* NCCL_VERSION_CODE of the loaded library (e.g. 22703 for 2.27.3; 0 when not loaded) and the
 * file it came from ("" when not loaded). */
int fsc_nccl_version(void);
const char *fsc_nccl_path(void);

/* Fill `id` with a fresh ncclUniqueId (128 bytes) for rank 0 to send to the other ranks.
 * Loads NCCL with no extra paths if it is not loaded yet. */
fsc_status_t fsc_nccl_get_unique_id(unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES]);

/* The communicator mode FAIRSCALE_C_NCCL_BLOCKING asks for: 1 (unset, empty or "1") for
 * blocking, 0 ("0") for non-blocking; anything else is FSC_ERR_VALUE naming the variable.
 * A non-blocking communicator makes NCCL start a thread of its own for every call, which adds
 * more host latency to an operation than the launch itself. A blocking communicator's calls run
 * on one thread per communicator (the submitter) while the caller waits up to the timeout, so an
 * enqueue that waits for a peer (the first connection to it) is bounded too; its init runs on a
 * thread of its own under the timeout, and destroy is bounded. The watchdog bounds the device
 * work in both modes. */
fsc_status_t fsc_nccl_blocking_get(int *out);

/* Join the group identified by `id` as `rank` of `nranks` on CUDA device `device`, and store
 * the new communicator in *out. ncclCommInitRankConfig, blocking unless fsc_nccl_blocking_get
 * says non-blocking, where the library has it, else ncclCommInitRank (a blocking communicator).
 * Blocks until every rank has joined or `timeout_s` (<= 0: fsc_comm_timeout_s()) has passed; on
 * error or timeout the half-made communicator is aborted (a blocking init that times out is left
 * to finish on its thread, which then aborts it) and FSC_ERR_COMM / FSC_ERR_TIMEOUT returned.
 * The new communicator has a watchdog thread ("fsc_nccl_wd") that every 100 ms polls NCCL's
 * asynchronous error state and the oldest enqueued operation that has not completed (an event
 * is recorded after each). An NCCL error, or an operation still pending `timeout_s` after it
 * was enqueued, aborts the communicator, so device work waiting on a dead peer ends and the
 * host never blocks for good; the next call on the communicator returns FSC_ERR_COMM with the
 * reason. A blocking communicator also has its submitter thread ("fsc_nccl_submit"). */
fsc_status_t fsc_nccl_comm_init(const unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES], int rank, int nranks, int device,
                                double timeout_s, fsc_nccl_comm_t **out);

int fsc_nccl_comm_rank(const fsc_nccl_comm_t *c);
int fsc_nccl_comm_size(const fsc_nccl_comm_t *c);
int fsc_nccl_comm_device(const fsc_nccl_comm_t *c);

/* ---- collectives ----------------------------------------------------------------------------
 * Tensors are contiguous CUDA views on the communicator's device with a dtype the engine
 * supports (fsc_comm_check_dtype). Each call checks its arguments (FSC_ERR_VALUE naming the
 * argument, nothing enqueued), enqueues the operation on `stream` and returns once NCCL has
 * accepted it; it does not wait for the data (use fsc_nccl_wait or stream ordering). The
 * memory must stay allocated until the stream has passed the operation. Every rank must issue
 * the same collectives in the same order. An NCCL failure aborts the communicator
 * (FSC_ERR_COMM); an enqueue that NCCL has not accepted within the timeout (a peer that never
 * connects) returns FSC_ERR_TIMEOUT and leaves the communicator dead; later calls on it fail
 * with FSC_ERR_COMM. */

/* output (nranks * input.numel elements) = concatenation of every rank's input, rank order.
 * In place when input is output's own rank-th block. */
fsc_status_t fsc_nccl_all_gather(fsc_nccl_comm_t *c, fsc_tensor_t *output, const fsc_tensor_t *input,
                                 fsc_stream_t stream);

/* output (input.numel / nranks elements) = this rank's block of the elementwise reduction of
 * every rank's input. */
fsc_status_t fsc_nccl_reduce_scatter(fsc_nccl_comm_t *c, fsc_tensor_t *output, const fsc_tensor_t *input,
                                     fsc_reduce_op_t op, fsc_stream_t stream);

/* tensor = the elementwise reduction of every rank's tensor, in place on all ranks. */
fsc_status_t fsc_nccl_all_reduce(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, fsc_reduce_op_t op, fsc_stream_t stream);

/* tensor = root's tensor on every rank. */
fsc_status_t fsc_nccl_broadcast(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, int root, fsc_stream_t stream);

/* root's tensor = the elementwise reduction of every rank's tensor; other ranks' tensors are
 * left unchanged. */
fsc_status_t fsc_nccl_reduce(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, fsc_reduce_op_t op, int root,
                             fsc_stream_t stream);

/* Point-to-point, each in its own NCCL group: `peer` must issue the matching recv / send with
 * the same numel and dtype. NCCL has no message tags: `tag` must be 0 (FSC_ERR_VALUE otherwise,
 * from fsc_comm_check_call, so that code written for the shm engine's tags fails clearly). */
fsc_status_t fsc_nccl_send(fsc_nccl_comm_t *c, const fsc_tensor_t *tensor, int peer, int32_t tag, fsc_stream_t stream);
fsc_status_t fsc_nccl_recv(fsc_nccl_comm_t *c, fsc_tensor_t *tensor, int peer, int32_t tag, fsc_stream_t stream);

/* One operation of a batch: the engine's call description (comm.h), checked by the same rules. */
typedef fsc_comm_call_t fsc_nccl_op_t;

#define FSC_NCCL_MAX_BATCH 256

/* Enqueue `n` operations (at most FSC_NCCL_MAX_BATCH NCCL calls; a copy makes two) as one NCCL
 * group (ncclGroupStart/End): they launch together and progress concurrently, and sends and
 * receives between the same ranks cannot deadlock on their order. Every operation is checked first, as the single-op
 * calls check theirs; nothing is enqueued unless all pass. */
fsc_status_t fsc_nccl_batch(fsc_nccl_comm_t *c, const fsc_nccl_op_t *ops, size_t n, fsc_stream_t stream);

/* Enqueue an all-to-all: the calls fsc_comm_all_to_all_plan made (and checked) for this
 * communicator's rank, size and device, as one NCCL group; the own block's copy is a send to this
 * rank and a recv from it. At most FSC_NCCL_MAX_BATCH / 2 ranks. */
fsc_status_t fsc_nccl_all_to_all(fsc_nccl_comm_t *c, const fsc_nccl_op_t *ops, size_t n, fsc_stream_t stream);

/* Block until the work enqueued on `stream` so far has finished, polling the communicator's
 * asynchronous error state meanwhile. On an NCCL error, or when `timeout_s` (<= 0:
 * fsc_comm_timeout_s()) passes first, aborts the communicator and returns FSC_ERR_COMM /
 * FSC_ERR_TIMEOUT naming the last operation enqueued. Call without holding the GIL. */
fsc_status_t fsc_nccl_wait(fsc_nccl_comm_t *c, fsc_stream_t stream, double timeout_s);

/* Abort: stop pending operations and free NCCL's resources without waiting for the other
 * ranks. Idempotent; the communicator then refuses every call. */
fsc_status_t fsc_nccl_comm_abort(fsc_nccl_comm_t *c);

/* Orderly teardown (ncclCommFinalize, wait up to `timeout_s`, ncclCommDestroy); every rank
 * should call it. Aborts instead when finalisation fails or times out, and returns that
 * error. A blocking communicator, whose finalize would wait for the peers without a bound,
 * instead waits up to `timeout_s` for this rank's own operations and is then released locally
 * (ncclCommAbort). Idempotent. Blocks. */
fsc_status_t fsc_nccl_comm_destroy(fsc_nccl_comm_t *c, double timeout_s);

/* Release `c` (aborting it first if it was neither destroyed nor aborted). NULL is a no-op. */
void fsc_nccl_comm_free(fsc_nccl_comm_t *c);

#endif /* FSC_NCCL_H */
