/* shm_direct.c — direct reads: in a window of sizes, a collective moves each byte from its owner's
 * buffer into the reader's with one copy (process_vm_readv, done by the kernel) instead of two
 * through the slots, and passes two or three barriers in all instead of one per piece.
 *
 * Every rank publishes the addresses of its input (and output) in its control block before the
 * op's first barrier; the peers read them after it. The last barrier tells each rank that nobody
 * reads its buffers any more, so the op may return. Reductions read the peers' data piece by piece
 * into a private scratch that stays in the cache and reduce it with the rank's own input first,
 * then the others in rank order, as the slot algorithms do.
 *
 * The window (fsc_shm_direct_fits): all_gather, reduce_scatter and broadcast from blocks of
 * FSC_SHM_DIRECT_MIN bytes, below which the system call costs more than the slots; all_reduce from
 * FSC_SHM_DIRECT_ALL_REDUCE_MIN, below which its two rounds of reads lost to the slots' pipeline;
 * every op up to g->direct_max bytes (reduce_scatter's input up to 8 MiB), above which the slots'
 * pipeline with streaming stores won or drew. reduce keeps the slots: the root alone would copy
 * every peer's input. Measurements: docs/benchmarks.md, "Direct reads". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/shm_direct.h"
#include "comm/shm_reduce.h"

#define FSC_SHM_DIRECT_MIN ((size_t)32 << 10)
#define FSC_SHM_DIRECT_PIECE ((size_t)256 << 10) /* bytes per peer per reduction step */
#define FSC_SHM_DIRECT_ALL_REDUCE_MIN ((size_t)2 << 20)
#define FSC_SHM_DIRECT_REDUCE_SCATTER_MAX ((size_t)8 << 20)

static size_t min_sz(size_t a, size_t b) {
    return a < b ? a : b;
}

int fsc_shm_direct_fits(const fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    if (g->direct_max == 0) return 0;
    size_t nb = a->count * fsc_dtype_size(a->dtype), n = (size_t)g->size;
    switch (a->op) {
        case FSC_OP_ALL_GATHER: return nb >= FSC_SHM_DIRECT_MIN && nb * n <= g->direct_max;
        case FSC_OP_REDUCE_SCATTER:
            return nb >= FSC_SHM_DIRECT_MIN && nb * n <= g->direct_max && nb * n <= FSC_SHM_DIRECT_REDUCE_SCATTER_MAX;
        case FSC_OP_BROADCAST: return nb >= FSC_SHM_DIRECT_MIN && nb <= g->direct_max;
        case FSC_OP_ALL_REDUCE: return nb >= FSC_SHM_DIRECT_ALL_REDUCE_MIN && nb <= g->direct_max;
        default: return 0; /* reduce: the root alone would copy everything (slower, measured) */
    }
}

/* Copy n bytes at address `src` of rank p into dst. */
static fsc_status_t read_peer(fsc_shm_group_t *g, int p, void *dst, uint64_t src, size_t n) {
    int err = fsc_shm_peer_read(g, p, dst, src, n);
    if (err == 0) return FSC_OK;
    char mine[192];
    return fsc_error(FSC_ERR_COMM, "%s on group '%s' (rank %d of %d): reading rank %d's buffer (pid %d) failed: %s",
                     fsc_shm_op_desc(g, mine, sizeof(mine)), g->name, g->rank, g->size, p,
                     (int)atomic_load(&g->ranks[p].pid), strerror(err));
}

/* dst[0, n) = mine (op) every peer's input at byte offset `off` (rank order), n elements. dst may
 * be mine. */
static fsc_status_t reduce_from_peers(fsc_shm_group_t *g, const fsc_shm_args_t *a, void *dst, const void *mine,
                                      size_t off, size_t n) {
    size_t esz = fsc_dtype_size(a->dtype), per = FSC_SHM_DIRECT_PIECE / esz;
    if (g->direct_scratch == NULL && (g->direct_scratch = malloc((size_t)(g->size - 1) * FSC_SHM_DIRECT_PIECE)) == NULL)
        return fsc_error(FSC_ERR_NOMEM, "shm group '%s': out of memory for the direct reads' scratch", g->name);
    const void *srcs[FSC_SHM_MAX_RANKS];
    for (size_t i = 0; i < n; i += per) {
        size_t k = min_sz(per, n - i);
        srcs[0] = (const uint8_t *)mine + i * esz;
        for (int p = 0, j = 1; p < g->size; p++) {
            if (p == g->rank) continue;
            uint8_t *buf = g->direct_scratch + (size_t)(j - 1) * FSC_SHM_DIRECT_PIECE;
            FSC_CHECK(read_peer(g, p, buf, g->ranks[p].direct_in + off + i * esz, k * esz));
            srcs[j++] = buf;
        }
        FSC_CHECK(fsc_shm_reduce((uint8_t *)dst + i * esz, srcs, g->size, k, a->dtype, a->redop, g->size));
    }
    return FSC_OK;
}

static void publish(fsc_shm_group_t *g, const void *in, const void *out) {
    g->ranks[g->rank].direct_in = (uint64_t)(uintptr_t)in; /* released by the op's first barrier */
    g->ranks[g->rank].direct_out = (uint64_t)(uintptr_t)out;
}

static fsc_status_t all_gather(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t row = a->count * fsc_dtype_size(a->dtype);
    uint8_t *out = a->out, *mine = out + (size_t)g->rank * row;
    publish(g, a->in, NULL);
    if (mine != (const uint8_t *)a->in) memcpy(mine, a->in, row); /* skipped in place */
    FSC_CHECK(fsc_shm_open_collective(g, a));
    for (int k = 1; k < g->size; k++) { /* each rank starts at its right-hand peer: the sources spread */
        int p = (g->rank + k) % g->size;
        FSC_CHECK(read_peer(g, p, out + (size_t)p * row, g->ranks[p].direct_in, row));
    }
    return fsc_shm_arrive(g, 1);
}

static fsc_status_t broadcast(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t nb = a->count * fsc_dtype_size(a->dtype);
    int is_root = a->root == g->rank;
    if (is_root) {
        publish(g, a->in, NULL);
        if (a->out != a->in) memcpy(a->out, a->in, nb);
    }
    FSC_CHECK(fsc_shm_open_collective(g, a));
    if (!is_root) FSC_CHECK(read_peer(g, a->root, a->out, g->ranks[a->root].direct_in, nb));
    return fsc_shm_arrive(g, 1);
}

/* Rank r reduces block r: its own block first (`out` may be it: in place), then the peers'. */
static fsc_status_t reduce_scatter(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t row = a->count * fsc_dtype_size(a->dtype);
    publish(g, a->in, NULL);
    FSC_CHECK(fsc_shm_open_collective(g, a));
    size_t off = (size_t)g->rank * row;
    FSC_CHECK(reduce_from_peers(g, a, a->out, (const uint8_t *)a->in + off, off, a->count));
    return fsc_shm_arrive(g, 1);
}

/* Each rank reduces its part of the input into its output (in place: its own part of its input,
 * which no peer reads), a barrier, then it reads every peer's part of the result from the peer's
 * output. Each element is reduced once, so every rank receives the same bits. */
static fsc_status_t all_reduce(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), lo = 0, hi = 0;
    uint8_t *out = a->out;
    const uint8_t *in = a->in;
    publish(g, a->in, a->out);
    FSC_CHECK(fsc_shm_open_collective(g, a));
    fsc_shm_part(g, g->rank, a->count, esz, &lo, &hi);
    FSC_CHECK(reduce_from_peers(g, a, out + lo * esz, in + lo * esz, lo * esz, hi - lo));
    FSC_CHECK(fsc_shm_arrive(g, 1));
    for (int k = 1; k < g->size; k++) {
        int p = (g->rank + k) % g->size;
        fsc_shm_part(g, p, a->count, esz, &lo, &hi);
        if (hi > lo) FSC_CHECK(read_peer(g, p, out + lo * esz, g->ranks[p].direct_out + lo * esz, (hi - lo) * esz));
    }
    return fsc_shm_arrive(g, 1);
}

fsc_status_t fsc_shm_direct_run(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    switch (a->op) {
        case FSC_OP_ALL_GATHER: return all_gather(g, a);
        case FSC_OP_BROADCAST: return broadcast(g, a);
        case FSC_OP_REDUCE_SCATTER: return reduce_scatter(g, a);
        case FSC_OP_ALL_REDUCE: return all_reduce(g, a);
        default: break;
    }
    return fsc_error(FSC_ERR_INTERNAL, "shm: op %d has no direct form", (int)a->op);
}
