/* shm_direct.c — direct collectives: a collective moves each byte from its owner's buffer into the
 * reader's with one copy instead of two through the slots, and passes two or three barriers in all
 * instead of one per piece. Two ways to reach a peer's buffer:
 *   - mapped: every rank's buffers lie in the same shared tensor allocation (shm_shared.h), which
 *     every rank maps; a plain copy from (or, all_reduce, into) the peer's memory;
 *   - read: process_vm_readv, the kernel copying from the peer's private memory (slower than a
 *     plain copy), in the window of sizes where that beats the slots.
 *
 * Every rank publishes its input's (and output's) address, and where they lie in shared
 * allocations, in its control block before the op's first barrier; after it every rank sees the
 * same publications, so every rank picks the same way. The last barrier tells each rank that
 * nobody touches its buffers any more, so the op may return. Reductions combine the rank's own
 * input first, then the others in rank order, as the slot algorithms do.
 *
 * When it runs direct (fsc_shm_direct_run):
 *   - in the read window (fsc_shm_direct_fits): all_gather, reduce_scatter and broadcast from
 *     blocks of FSC_SHM_DIRECT_MIN bytes, below which the system call costs more than the slots;
 *     all_reduce from FSC_SHM_DIRECT_ALL_REDUCE_MIN, below which its two rounds of reads lost to the
 *     slots' pipeline; every op up to fsc_shm_group_read_max bytes. Mapped when it can be, read
 *     otherwise. From FSC_SHM_CHOICE_MIN bytes, with FAIRSCALE_C_SHM_DIRECT_READS "auto", a
 *     synchronous op on rank 0 picks reads or the slots for every rank from its timings of both
 *     (choose_reads): the kernel's copy pins the peer's pages one by one, and whether one such
 *     copy beats two plain ones through the slots depends on the machine and on how far apart
 *     the ranks' cores are, which on a VM changes from hour to hour (docs/benchmarks.md). A queued
 *     op is not timed (reads_untimed): it reads up to FSC_SHM_UNTIMED_READ_MAX bytes, as reads
 *     cost the least CPU beside the caller's computation, and goes through the slots above.
 *   - outside it, from FSC_SHM_SHARED_MIN bytes: the ranks first compare their publications; mapped
 *     when every rank's buffers are shared, else the slots (one barrier more than the slots alone).
 * reduce has no read form (the root alone would copy every peer's input); mapped, every rank
 * reduces a part into the root's output. Measurements: docs/benchmarks.md, "Direct reads" and
 * "Shared tensors". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "comm/shm_direct.h"
#include "comm/shm_reduce.h"
#include "comm/shm_shared.h"

#define FSC_SHM_DIRECT_MIN ((size_t)32 << 10)
#define FSC_SHM_DIRECT_PIECE ((size_t)256 << 10) /* bytes per peer per reduction step */
#define FSC_SHM_DIRECT_ALL_REDUCE_MIN ((size_t)2 << 20)
/* A queued op is not timed: it reads up to these op sizes (16 MiB, reduce_scatter's input 8 MiB)
 * and takes the slots above them, where which way wins depends on the machine's state. */
#define FSC_SHM_UNTIMED_READ_MAX ((size_t)16 << 20)
#define FSC_SHM_UNTIMED_REDUCE_SCATTER_MAX ((size_t)8 << 20)
#define FSC_SHM_SHARED_MIN ((size_t)1 << 20)
/* From this op size on (the whole read window), in "auto" mode, rank 0 picks reads or slots by
 * timing both (choose_reads): the winner depends on the machine at every size. */
#define FSC_SHM_CHOICE_MIN FSC_SHM_DIRECT_MIN
#define FSC_SHM_CHOICE_SAMPLES 3  /* timings each way before choosing */
#define FSC_SHM_CHOICE_RECHECK 32 /* then every this many calls, one the other way */

static size_t min_sz(size_t a, size_t b) {
    return a < b ? a : b;
}

static size_t op_bytes(const fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t nb = a->count * fsc_dtype_size(a->dtype);
    return a->op == FSC_OP_ALL_GATHER || a->op == FSC_OP_REDUCE_SCATTER ? nb * (size_t)g->size : nb;
}

int fsc_shm_direct_fits(const fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t max = fsc_shm_group_read_max(g);
    if (max == 0) return 0;
    size_t nb = a->count * fsc_dtype_size(a->dtype), n = (size_t)g->size;
    switch (a->op) {
        case FSC_OP_ALL_GATHER: return nb >= FSC_SHM_DIRECT_MIN && nb * n <= max;
        case FSC_OP_REDUCE_SCATTER: return nb >= FSC_SHM_DIRECT_MIN && nb * n <= max;
        case FSC_OP_BROADCAST: return nb >= FSC_SHM_DIRECT_MIN && nb <= max;
        case FSC_OP_ALL_REDUCE: return nb >= FSC_SHM_DIRECT_ALL_REDUCE_MIN && nb <= max;
        default: return 0; /* reduce: the root alone would copy everything (slower, measured) */
    }
}

/* Whether an op that is not timed reads in "auto" (a queued one; fsc_shm_direct_run). */
static int reads_untimed(const fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    return op_bytes(g, a) <=
           (a->op == FSC_OP_REDUCE_SCATTER ? FSC_SHM_UNTIMED_REDUCE_SCATTER_MAX : FSC_SHM_UNTIMED_READ_MAX);
}

/* Outside the read window, an op this large asks whether every rank's buffers are shared. */
static int may_map(const fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    switch (a->op) {
        case FSC_OP_ALL_GATHER:
        case FSC_OP_REDUCE_SCATTER:
        case FSC_OP_BROADCAST:
        case FSC_OP_REDUCE:
        case FSC_OP_ALL_REDUCE: return op_bytes(g, a) >= FSC_SHM_SHARED_MIN;
        default: return 0;
    }
}

/* Copy n bytes at address `src` of rank p into dst (process_vm_readv). */
static fsc_status_t read_peer(fsc_shm_group_t *g, int p, void *dst, uint64_t src, size_t n) {
    int err = fsc_shm_peer_read(g, p, dst, src, n);
    if (err == 0) return FSC_OK;
    char mine[192];
    return fsc_error(FSC_ERR_COMM, "%s on group '%s' (rank %d of %d): reading rank %d's buffer (pid %d) failed: %s",
                     fsc_shm_op_desc(g, mine, sizeof(mine)), g->name, g->rank, g->size, p,
                     (int)atomic_load(&g->ranks[p].pid), strerror(err));
}

static void publish(fsc_shm_group_t *g, const void *in, size_t in_bytes, void *out, size_t out_bytes) {
    fsc_shm_rank_ctrl_t *me = &g->ranks[g->rank]; /* released by the op's first barrier */
    me->direct_in = (uint64_t)(uintptr_t)in;
    me->direct_out = (uint64_t)(uintptr_t)out;
    fsc_shm_shared_locate(in, in_bytes, &me->shared_in_id, &me->shared_in_off);
    me->shared_out_id = me->shared_out_off = 0;
    if (out != NULL) fsc_shm_shared_locate(out, out_bytes, &me->shared_out_id, &me->shared_out_off);
}

/* 1 when every rank published an input (`out`: an output) in this rank's shared allocation: then
 * every rank holds a slice of it, so every rank maps it, and every rank decides alike. */
static int all_shared(const fsc_shm_group_t *g, int out) {
    uint64_t mine = out ? g->ranks[g->rank].shared_out_id : g->ranks[g->rank].shared_in_id;
    if (mine == 0) return 0;
    for (int p = 0; p < g->size; p++)
        if ((out ? g->ranks[p].shared_out_id : g->ranks[p].shared_in_id) != mine) return 0;
    return 1;
}

/* This process's address of bytes [off, off + n) of rank p's input (`out`: output), mapped. */
static fsc_status_t mapped(fsc_shm_group_t *g, int p, int out, size_t off, size_t n, uint8_t **addr) {
    const fsc_shm_rank_ctrl_t *r = &g->ranks[p];
    *addr = fsc_shm_shared_addr(out ? r->shared_out_id : r->shared_in_id,
                                (out ? r->shared_out_off : r->shared_in_off) + off, n);
    if (*addr != NULL) return FSC_OK;
    return fsc_error(FSC_ERR_INTERNAL, "shm group '%s' rank %d: rank %d's shared buffer is not mapped here", g->name,
                     g->rank, p);
}

/* Bytes [off, off + n) of rank p's input into dst: mapped, or read. */
static fsc_status_t fetch_in(fsc_shm_group_t *g, int map, int p, void *dst, size_t off, size_t n, int streaming) {
    if (!map) return read_peer(g, p, dst, g->ranks[p].direct_in + off, n);
    uint8_t *src;
    FSC_CHECK(mapped(g, p, 0, off, n, &src));
    fsc_shm_copy_out(dst, src, n, streaming);
    return FSC_OK;
}

/* The group's scratch: (size - 1) pieces the read reductions copy the peers' data into, and the
 * mapped all_reduce reduces a piece into. */
static fsc_status_t scratch(fsc_shm_group_t *g) {
    if (g->direct_scratch == NULL && (g->direct_scratch = malloc((size_t)(g->size - 1) * FSC_SHM_DIRECT_PIECE)) == NULL)
        return fsc_error(FSC_ERR_NOMEM, "shm group '%s': out of memory for the direct reads' scratch", g->name);
    return FSC_OK;
}

/* Rank r's inputs at byte `off` (its own first, then the peers' in rank order), mapped. */
static fsc_status_t mapped_inputs(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t off, size_t nb,
                                  const void **srcs) {
    srcs[0] = (const uint8_t *)a->in + off;
    for (int p = 0, j = 1; p < g->size; p++) {
        if (p == g->rank) continue;
        uint8_t *src;
        FSC_CHECK(mapped(g, p, 0, off, nb, &src));
        srcs[j++] = src;
    }
    return FSC_OK;
}

/* Every rank's output at byte `off` (indexed by rank), this rank's own and the peers' mapped. */
static fsc_status_t mapped_outputs(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t off, size_t nb, void **dsts) {
    for (int p = 0; p < g->size; p++) {
        uint8_t *dst = (uint8_t *)a->out + off;
        if (p != g->rank) FSC_CHECK(mapped(g, p, 1, off, nb, &dst));
        dsts[p] = dst;
    }
    return FSC_OK;
}

/* dst[0, n) = this rank's input (op) every peer's input, from byte offset `off` (own first, then
 * rank order), n elements. dst may be the input. Mapped, the peers' inputs are reduced where they
 * lie; read, through the scratch. */
static fsc_status_t reduce_from_peers(fsc_shm_group_t *g, const fsc_shm_args_t *a, int map, void *dst, size_t off,
                                      size_t n) {
    size_t esz = fsc_dtype_size(a->dtype), per = FSC_SHM_DIRECT_PIECE / esz;
    if (!map) FSC_CHECK(scratch(g));
    const void *srcs[FSC_SHM_MAX_RANKS];
    for (size_t i = 0; i < n; i += per) {
        size_t k = min_sz(per, n - i), at = off + i * esz;
        if (map) {
            FSC_CHECK(mapped_inputs(g, a, at, k * esz, srcs));
        } else {
            srcs[0] = (const uint8_t *)a->in + at;
            for (int p = 0, j = 1; p < g->size; p++) {
                if (p == g->rank) continue;
                uint8_t *buf = g->direct_scratch + (size_t)(j - 1) * FSC_SHM_DIRECT_PIECE;
                FSC_CHECK(read_peer(g, p, buf, g->ranks[p].direct_in + at, k * esz));
                srcs[j++] = buf;
            }
        }
        FSC_CHECK(fsc_shm_reduce((uint8_t *)dst + i * esz, srcs, g->size, k, a->dtype, a->redop, g->size));
    }
    return FSC_OK;
}

/* Pull (inputs shared, or read): each rank copies every peer's block from the peer's input. Push
 * (`push`: every rank's output shared): each rank copies its input once into its block of every
 * rank's output, so at world 2 an out-of-place gather reads each input once instead of twice. */
static fsc_status_t all_gather(fsc_shm_group_t *g, const fsc_shm_args_t *a, int map, int push, int own_done) {
    size_t row = a->count * fsc_dtype_size(a->dtype);
    uint8_t *out = a->out, *mine = out + (size_t)g->rank * row;
    int streaming = row * (size_t)g->size >= FSC_SHM_STREAM_MIN;
    if (push) {
        void *dsts[FSC_SHM_MAX_RANKS];
        int nd = g->size;
        FSC_CHECK(mapped_outputs(g, a, (size_t)g->rank * row, row, dsts));
        if (mine == (const uint8_t *)a->in || own_done) dsts[g->rank] = dsts[--nd]; /* in place, or copied already */
        fsc_shm_copy_out_n(dsts, nd, a->in, row, streaming);
        return fsc_shm_arrive(g, 1);
    }
    if (mine != (const uint8_t *)a->in && !own_done) fsc_shm_copy_out(mine, a->in, row, streaming);
    for (int k = 1; k < g->size; k++) { /* each rank starts at its right-hand peer: the sources spread */
        int p = (g->rank + k) % g->size;
        FSC_CHECK(fetch_in(g, map, p, out + (size_t)p * row, 0, row, streaming));
    }
    return fsc_shm_arrive(g, 1);
}

static fsc_status_t broadcast(fsc_shm_group_t *g, const fsc_shm_args_t *a, int map) {
    size_t nb = a->count * fsc_dtype_size(a->dtype);
    int streaming = nb >= FSC_SHM_STREAM_MIN;
    if (a->root == g->rank) {
        if (a->out != a->in) memcpy(a->out, a->in, nb);
    } else {
        FSC_CHECK(fetch_in(g, map, a->root, a->out, 0, nb, streaming));
    }
    return fsc_shm_arrive(g, 1);
}

/* Rank r reduces block r: its own block first (`out` may be it: in place), then the peers'. An
 * output too large for the caches is written with streaming stores (mapped, float). */
static fsc_status_t reduce_scatter(fsc_shm_group_t *g, const fsc_shm_args_t *a, int map) {
    size_t esz = fsc_dtype_size(a->dtype), off = (size_t)g->rank * a->count * esz, done = 0;
    if (map && a->count * esz * (size_t)g->size >= FSC_SHM_STREAM_MIN) {
        const void *srcs[FSC_SHM_MAX_RANKS];
        void *dst = a->out;
        FSC_CHECK(mapped_inputs(g, a, off, a->count * esz, srcs));
        done = fsc_shm_reduce_stream(&dst, 1, srcs, g->size, a->count, a->dtype, a->redop, g->size);
    }
    FSC_CHECK(reduce_from_peers(g, a, map, (uint8_t *)a->out + done * esz, off + done * esz, a->count - done));
    return fsc_shm_arrive(g, 1);
}

/* Read: each rank reduces its part of the input into its output (in place: its own part of its
 * input, which no peer reads), a barrier, then it reads every peer's part of the result from the
 * peer's output. Each element is reduced once, so every rank receives the same bits. */
static fsc_status_t all_reduce_read(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), lo = 0, hi = 0;
    uint8_t *out = a->out;
    fsc_shm_part(g, g->rank, a->count, esz, &lo, &hi);
    FSC_CHECK(reduce_from_peers(g, a, 0, out + lo * esz, lo * esz, hi - lo));
    FSC_CHECK(fsc_shm_arrive(g, 1));
    for (int k = 1; k < g->size; k++) {
        int p = (g->rank + k) % g->size;
        fsc_shm_part(g, p, a->count, esz, &lo, &hi);
        if (hi > lo) FSC_CHECK(read_peer(g, p, out + lo * esz, g->ranks[p].direct_out + lo * esz, (hi - lo) * esz));
    }
    return fsc_shm_arrive(g, 1);
}

/* Where this rank stores bytes [off, off + nb) of its reduced part: all_reduce, into every rank's
 * output (indexed by rank); reduce, into the root's alone. *nd: how many destinations. */
static fsc_status_t part_destinations(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t off, size_t nb, void **dsts,
                                      int *nd) {
    if (a->op == FSC_OP_ALL_REDUCE) {
        *nd = g->size;
        return mapped_outputs(g, a, off, nb, dsts);
    }
    uint8_t *dst = (uint8_t *)a->out + off;
    if (a->root != g->rank) FSC_CHECK(mapped(g, a->root, 1, off, nb, &dst));
    dsts[0] = dst;
    *nd = 1;
    return FSC_OK;
}

/* Mapped all_reduce and reduce: each rank reduces its part of every input and stores it into
 * every rank's output (all_reduce) or the root's (reduce), so one barrier ends the op and the
 * root of a reduce no longer reads every input alone. Outputs too large for the caches: line by
 * line with streaming stores (float), else piece by piece through a scratch piece that stays in
 * the cache. In place, a rank writes only its own part of each buffer, which it has read already
 * and no peer reads. */
static fsc_status_t reduce_mapped(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), per = FSC_SHM_DIRECT_PIECE / esz, lo = 0, hi = 0;
    int streaming = a->count * esz >= FSC_SHM_STREAM_MIN, nd = 0;
    void *dsts[FSC_SHM_MAX_RANKS];
    fsc_shm_part(g, g->rank, a->count, esz, &lo, &hi);
    size_t i = lo;
    if (streaming && hi > lo) {
        const void *srcs[FSC_SHM_MAX_RANKS];
        FSC_CHECK(mapped_inputs(g, a, lo * esz, (hi - lo) * esz, srcs));
        FSC_CHECK(part_destinations(g, a, lo * esz, (hi - lo) * esz, dsts, &nd));
        i += fsc_shm_reduce_stream(dsts, nd, srcs, g->size, hi - lo, a->dtype, a->redop, g->size);
    }
    if (i < hi) FSC_CHECK(scratch(g));
    for (; i < hi; i += per) {
        size_t k = min_sz(per, hi - i);
        FSC_CHECK(reduce_from_peers(g, a, 1, g->direct_scratch, i * esz, k));
        FSC_CHECK(part_destinations(g, a, i * esz, k * esz, dsts, &nd));
        fsc_shm_copy_out_n(dsts, nd, g->direct_scratch, k * esz, streaming);
    }
    return fsc_shm_arrive(g, 1);
}

/* Whether the op runs on the mappings, from the publications every rank sees alike: all_gather
 * when every input or every output is shared (`push`: the outputs), broadcast and reduce_scatter
 * when every input is, all_reduce when every input and every output is, reduce when every input
 * and the root's output are. */
static int mapped_path(const fsc_shm_group_t *g, const fsc_shm_args_t *a, int *push) {
    *push = a->op == FSC_OP_ALL_GATHER && all_shared(g, 1);
    switch (a->op) {
        case FSC_OP_ALL_GATHER: return *push || all_shared(g, 0);
        case FSC_OP_ALL_REDUCE: return all_shared(g, 0) && all_shared(g, 1);
        case FSC_OP_REDUCE:
            return all_shared(g, 0) && g->ranks[a->root].shared_out_id == g->ranks[g->rank].shared_in_id;
        default: return all_shared(g, 0);
    }
}

/* The op's slot in rank 0's timings, or NULL when it is not chosen by timing. */
static fsc_shm_choice_t *choice_of(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t bytes = op_bytes(g, a);
    if (g->reads_mode != 1 || bytes < FSC_SHM_CHOICE_MIN) return NULL;
    int op = a->op == FSC_OP_ALL_GATHER ? 0 : a->op == FSC_OP_REDUCE_SCATTER ? 1 : a->op == FSC_OP_BROADCAST ? 2 : 3;
    int c = 0;
    while (c + 1 < FSC_SHM_CHOICE_CLASSES && bytes >= (FSC_SHM_CHOICE_MIN << (c + 1))) c++;
    return &g->choice[op][c];
}

static double median_of(const fsc_shm_choice_t *c, int way) {
    uint32_t n = c->n[way] < FSC_SHM_CHOICE_KEEP ? c->n[way] : FSC_SHM_CHOICE_KEEP;
    double v[FSC_SHM_CHOICE_KEEP];
    memcpy(v, c->secs[way], n * sizeof(double));
    for (uint32_t i = 1; i < n; i++) /* insertion sort of at most 8 */
        for (uint32_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* Rank 0: whether this op reads the peers' buffers (1) or goes through the slots (0). Each way is
 * timed FSC_SHM_CHOICE_SAMPLES times first, alternating; then the way with the lower median of its
 * recent timings, except that every FSC_SHM_CHOICE_RECHECK calls the other way is timed once more,
 * so a machine whose balance changes (as VMs' do) is followed. */
static int choose_reads(fsc_shm_choice_t *c) {
    uint32_t call = c->calls++;
    if (c->n[0] < FSC_SHM_CHOICE_SAMPLES || c->n[1] < FSC_SHM_CHOICE_SAMPLES)
        return c->n[1] < c->n[0] || (c->n[1] == c->n[0] && (call & 1));
    int best = median_of(c, 1) < median_of(c, 0);
    return call % FSC_SHM_CHOICE_RECHECK == 0 ? !best : best;
}

void fsc_shm_direct_timed(fsc_shm_group_t *g, double secs) {
    fsc_shm_choice_t *c = g->choice_pending;
    g->choice_pending = NULL;
    if (c == NULL) return;
    int way = g->choice_reads;
    c->secs[way][c->n[way] % FSC_SHM_CHOICE_KEEP] = secs;
    c->n[way]++;
}

fsc_status_t fsc_shm_direct_run(fsc_shm_group_t *g, const fsc_shm_args_t *a, int *ran) {
    *ran = 0;
    g->choice_pending = NULL;
    int fits = fsc_shm_direct_fits(g, a);
    if (!fits && !may_map(g, a)) return FSC_OK;
    size_t nb = a->count * fsc_dtype_size(a->dtype);
    size_t in_bytes = a->op == FSC_OP_REDUCE_SCATTER ? nb * (size_t)g->size : nb;
    size_t out_bytes = a->op == FSC_OP_ALL_GATHER ? nb * (size_t)g->size : nb;
    publish(g, a->in, in_bytes, a->out, out_bytes);
    fsc_shm_choice_t *choice = fits ? choice_of(g, a) : NULL; /* the same on every rank */
    if (choice != NULL && g->rank == 0) {
        /* A queued (async) op overlaps the caller's computation, where the CPU it takes counts
         * more than its time: reads, one copy and two barriers, cost the least of it (up to
         * reads_untimed's sizes). A synchronous call waits for the op: the faster way by rank 0's
         * timings. */
        int reads = fsc_shm_on_progress_thread ? reads_untimed(g, a) : choose_reads(choice);
        g->ranks[0].read_choice = (uint32_t)reads; /* released by the barrier below */
        g->choice_pending = fsc_shm_on_progress_thread ? NULL : choice;
        g->choice_reads = reads;
    }
    /* An all_gather that surely reads copies its own block while the peers arrive (out of place). */
    int own_done = fits && choice == NULL && a->op == FSC_OP_ALL_GATHER && a->out != NULL &&
                   (uint8_t *)a->out + (size_t)g->rank * nb != (const uint8_t *)a->in;
    if (own_done)
        fsc_shm_copy_out((uint8_t *)a->out + (size_t)g->rank * nb, a->in, nb,
                         nb * (size_t)g->size >= FSC_SHM_STREAM_MIN);
    FSC_CHECK(fsc_shm_open_collective(g, a));
    if (choice != NULL) fits = (int)g->ranks[0].read_choice; /* every rank follows rank 0 */
    int push = 0, map = mapped_path(g, a, &push);
    if (map && g->rank == 0) g->choice_pending = NULL; /* mapped: neither way the choice weighs */
    if (!map && !fits) return FSC_OK;                  /* every rank saw the same: the slots run it */
    *ran = 1;
    atomic_fetch_add_explicit(map ? &g->mapped_ops : &g->read_ops, 1, memory_order_relaxed);
    switch (a->op) {
        case FSC_OP_ALL_GATHER: return all_gather(g, a, map, push, own_done);
        case FSC_OP_BROADCAST: return broadcast(g, a, map);
        case FSC_OP_REDUCE_SCATTER: return reduce_scatter(g, a, map);
        case FSC_OP_ALL_REDUCE: return map ? reduce_mapped(g, a) : all_reduce_read(g, a);
        case FSC_OP_REDUCE: return reduce_mapped(g, a);
        default: break;
    }
    return fsc_error(FSC_ERR_INTERNAL, "shm: op %d has no direct form", (int)a->op);
}
