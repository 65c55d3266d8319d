/* shm_coll.c — the collective algorithms over a group's segment. Data moves in chunks through
 * per-rank double-buffered slots: a rank fills slot buffer (step & 1), everyone passes a barrier,
 * everyone reads. all_gather, broadcast and reduce fill g->piece bytes of a slot buffer per step
 * (the chunk or a quarter of it: shm.c, piece_for). Buffer (step & 1) is written again only at
 * step + 2, after a barrier every rank enters once it has finished reading step's data, so one
 * barrier per step suffices. all_reduce and reduce_scatter are split so each rank reduces 1/size
 * of every chunk in parallel; reduce on a small group is done by its root alone. Ops in the window
 * of direct reads skip the slots altogether (shm_direct.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "base/log.h"
#include "comm/shm_direct.h"
#include "comm/shm_internal.h"
#include "comm/shm_reduce.h"

static size_t min_sz(size_t a, size_t b) {
    return a < b ? a : b;
}

static void copy(void *dst, const void *src, size_t n) {
    if (n != 0 && dst != src) memcpy(dst, src, n);
}

#if defined(__x86_64__)
/* One 64-byte line from s to each of the nd d[j] + off with streaming stores (16-byte aligned). */
static inline void stream_line(uint8_t *const *d, int nd, size_t off, const uint8_t *s) {
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    for (int j = 0; j < nd; j++) {
        __m128i *o = (__m128i *)(d[j] + off);
        _mm_stream_si128(o, a);
        _mm_stream_si128(o + 1, b);
        _mm_stream_si128(o + 2, c);
        _mm_stream_si128(o + 3, e);
    }
}
#endif

/* Copy into outputs too large to stay in the caches: non-temporal stores skip the
 * read-for-ownership of every destination line, a third of a normal copy's memory traffic, and
 * each line of the source is read once for all the destinations. Four pages are copied side by
 * side, a line of each in turn, which keeps more of the memory's pages open at once than one
 * stream (measurements: docs/benchmarks.md, "Why these settings" and "Shared tensors"). The
 * source (a slot still in the cache, or a shared tensor) is read normally. */
void fsc_shm_copy_out_n(void *const *dsts, int nd, const void *src, size_t n, int streaming) {
#if defined(__x86_64__)
    size_t head = nd > 0 ? (16 - ((uintptr_t)dsts[0] & 15)) & 15 : 0;
    int same = 1;
    for (int j = 1; j < nd; j++) same &= ((16 - ((uintptr_t)dsts[j] & 15)) & 15) == head;
    if (streaming && n >= 4096 && same && nd <= FSC_SHM_MAX_RANKS && !(nd == 1 && dsts[0] == src)) {
        uint8_t *d[FSC_SHM_MAX_RANKS];
        const uint8_t *s = src;
        for (int j = 0; j < nd; j++) {
            memcpy(dsts[j], s, head);
            d[j] = (uint8_t *)dsts[j] + head;
        }
        s += head;
        n -= head;
        size_t i = 0;
        for (; i + 4 * 4096 <= n; i += 4 * 4096)
            for (size_t l = 0; l < 4096; l += 64)
                for (size_t k = 0; k < 4 * 4096; k += 4096) stream_line(d, nd, i + k + l, s + i + k + l);
        for (; i + 64 <= n; i += 64) stream_line(d, nd, i, s + i);
        _mm_sfence(); /* order the streaming stores before the barrier's release that follows */
        for (int j = 0; j < nd; j++) memcpy(d[j] + i, s + i, n - i);
        return;
    }
#endif
    for (int j = 0; j < nd; j++) copy(dsts[j], src, n);
}

void fsc_shm_copy_out(void *dst, const void *src, size_t n, int streaming) {
    fsc_shm_copy_out_n(&dst, 1, src, n, streaming);
}

/* Record what this rank is doing (error messages, peers' diagnostics) and start the op clock. */
static void begin_op(fsc_shm_group_t *g, const fsc_shm_args_t *a, uint64_t seq, fsc_comm_header_t *h) {
    memset(h, 0, sizeof(*h));
    h->op = (uint32_t)a->op;
    h->dtype = a->op == FSC_OP_BARRIER ? 0 : (uint32_t)a->dtype;
    h->redop = (a->op == FSC_OP_ALL_REDUCE || a->op == FSC_OP_REDUCE || a->op == FSC_OP_REDUCE_SCATTER)
                   ? (uint32_t)a->redop
                   : 0;
    int rooted = a->op == FSC_OP_BROADCAST || a->op == FSC_OP_REDUCE;
    h->root = rooted ? a->root : -1;
    h->count = a->op == FSC_OP_BARRIER ? 0 : (uint64_t)a->count;
    h->seq = seq;
    g->ranks[g->rank].cur = *h;
    g->cur_hdr = *h;
    g->deadline = fsc_comm_now() + g->timeout;
}

fsc_status_t fsc_shm_open_collective(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    fsc_comm_header_t h;
    uint64_t seq = g->coll_seq++;
    begin_op(g, a, seq, &h);
    g->ranks[g->rank].hdr[seq & 1] = h;
    FSC_CHECK(fsc_shm_arrive(g, 1));
    for (int p = 0; p < g->size; p++) {
        if (p == g->rank) continue;
        FSC_CHECK(fsc_comm_header_check(g->name, g->rank, &h, p, &g->ranks[p].hdr[seq & 1]));
    }
    return FSC_OK;
}

static fsc_status_t run_all_gather(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), per = g->piece / esz;
    const uint8_t *in = a->in;
    uint8_t *out = a->out;
    size_t count = a->count, row = count * esz;
    int streaming = row * (size_t)g->size >= FSC_SHM_STREAM_MIN;
    for (size_t off = 0, first = 1; first || off < count; off += per, first = 0) {
        size_t n = min_sz(per, count - off), nb = n * esz;
        const uint8_t *mine = in + off * esz;
        uint8_t *mine_out = out + (size_t)g->rank * row + off * esz;
        copy(fsc_shm_slot(g, g->rank, g->step), mine, nb);
        if (first)
            FSC_CHECK(fsc_shm_open_collective(g, a));
        else
            FSC_CHECK(fsc_shm_arrive(g, 1));
        /* The own block is skipped when the input already is that block of the output (in-place,
         * as FSDP calls it): one copy less per rank. (Copying it before the barrier instead was
         * tried; the difference stayed inside this machine's run-to-run noise.) */
        for (int p = 0; p < g->size; p++) {
            if (p != g->rank)
                fsc_shm_copy_out(out + (size_t)p * row + off * esz, fsc_shm_slot(g, p, g->step), nb, streaming);
            else if (mine_out != mine)
                fsc_shm_copy_out(mine_out, mine, nb, streaming);
        }
        g->step++;
    }
    return FSC_OK;
}

static fsc_status_t run_reduce_scatter(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), align = 64 / esz;
    size_t per = g->chunk / esz / (size_t)g->size / align * align; /* elements per block per step */
    if (per == 0) per = 1;
    const uint8_t *in = a->in;
    uint8_t *out = a->out;
    size_t count = a->count, row = count * esz;
    const void *srcs[FSC_SHM_MAX_RANKS];
    for (size_t off = 0, first = 1; first || off < count; off += per, first = 0) {
        size_t n = min_sz(per, count - off), nb = n * esz;
        uint8_t *slot = fsc_shm_slot(g, g->rank, g->step);
        for (int p = 0; p < g->size; p++)
            if (p != g->rank) copy(slot + (size_t)p * per * esz, in + (size_t)p * row + off * esz, nb);
        if (first)
            FSC_CHECK(fsc_shm_open_collective(g, a));
        else
            FSC_CHECK(fsc_shm_arrive(g, 1));
        /* own block first: `out` may alias it (in-place reduce-scatter) */
        srcs[0] = in + (size_t)g->rank * row + off * esz;
        for (int p = 0, k = 1; p < g->size; p++)
            if (p != g->rank) srcs[k++] = fsc_shm_slot(g, p, g->step) + (size_t)g->rank * per * esz;
        FSC_CHECK(fsc_shm_reduce(out + off * esz, srcs, g->size, n, a->dtype, a->redop, g->size));
        g->step++;
    }
    return FSC_OK;
}

/* An all_reduce whose ranks' inputs together are at most this many bytes takes one barrier
 * instead of two: every rank reduces all of it from the slots (a few hundred bytes of arithmetic
 * cost less than a round trip between ranks). */
#define FSC_SHM_ONE_BARRIER_MAX ((size_t)64 << 10)

/* Small all_reduce: post the input, barrier, every rank reduces every slot (in rank order, so every
 * rank computes the same bits) straight into its output. The slot is reused two ops later, after
 * a barrier every rank passes once it has read it, as in the pipelined ops. */
static fsc_status_t run_small_all_reduce(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    const void *srcs[FSC_SHM_MAX_RANKS];
    size_t nb = a->count * fsc_dtype_size(a->dtype);
    copy(fsc_shm_slot(g, g->rank, g->step), a->in, nb);
    FSC_CHECK(fsc_shm_open_collective(g, a));
    for (int p = 0; p < g->size; p++) srcs[p] = fsc_shm_slot(g, p, g->step);
    FSC_CHECK(fsc_shm_reduce(a->out, srcs, g->size, a->count, a->dtype, a->redop, g->size));
    g->step++;
    return FSC_OK;
}

/* all_reduce, and reduce on larger groups, software-pipelined with one barrier per chunk. Step k: post chunk k into
 * my slot (every part but my own, which is read straight from `in`); barrier; reduce my part of
 * chunk k over all ranks into the shared result buffer (step & 1); copy chunk k-1's result out
 * (reduce: root only). Chunk k-1's result is complete at step k's barrier: every rank reduced its
 * part of it before arriving there. One more barrier after the last chunk lets its result be
 * copied out. Reuse: a slot buffer is rewritten two steps later, after the barrier that its
 * readers enter once they have reduced from it; a result buffer is rewritten two steps later,
 * after the barrier (of this op or of the next) that its readers enter once they have copied it
 * out. Each element is reduced by one rank (its own input first, then the others in rank order)
 * and copied by all, so every rank receives the same bits. */
static fsc_status_t run_all_reduce(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    if (a->op == FSC_OP_ALL_REDUCE &&
        a->count * fsc_dtype_size(a->dtype) * (size_t)g->size <= FSC_SHM_ONE_BARRIER_MAX &&
        a->count * fsc_dtype_size(a->dtype) <= g->chunk)
        return run_small_all_reduce(g, a);
    size_t esz = fsc_dtype_size(a->dtype), per = g->chunk / esz, lo = 0, hi = 0;
    const uint8_t *in = a->in;
    uint8_t *out = a->out;
    int receives = a->op == FSC_OP_ALL_REDUCE || a->root == g->rank;
    int streaming = a->count * esz >= FSC_SHM_STREAM_MIN;
    size_t nchunks = a->count == 0 ? 1 : (a->count + per - 1) / per;
    const void *srcs[FSC_SHM_MAX_RANKS];
    for (size_t k = 0; k <= nchunks; k++) {
        size_t off = k * per, n = k < nchunks ? min_sz(per, a->count - off) : 0;
        if (k < nchunks) {
            fsc_shm_part(g, g->rank, n, esz, &lo, &hi);
            const uint8_t *src = in + off * esz;
            uint8_t *slot = fsc_shm_slot(g, g->rank, g->step);
            copy(slot, src, lo * esz);
            copy(slot + hi * esz, src + hi * esz, (n - hi) * esz);
        }
        if (k == 0)
            FSC_CHECK(fsc_shm_open_collective(g, a));
        else /* after the last chunk, a rank with nothing to copy out only says its part is done */
            FSC_CHECK(fsc_shm_arrive(g, k < nchunks || receives));
        /* reduce before copying out: the peers wait for this part at the next barrier */
        if (k < nchunks && hi > lo) {
            srcs[0] = in + (off + lo) * esz;
            for (int p = 0, j = 1; p < g->size; p++)
                if (p != g->rank) srcs[j++] = fsc_shm_slot(g, p, g->step) + lo * esz;
            FSC_CHECK(fsc_shm_reduce(fsc_shm_result(g, g->step) + lo * esz, srcs, g->size, hi - lo, a->dtype, a->redop,
                                     g->size));
        }
        if (k > 0 && receives) {
            size_t prev = off - per;
            fsc_shm_copy_out(out + prev * esz, fsc_shm_result(g, g->step - 1), min_sz(per, a->count - prev) * esz,
                             streaming);
        }
        if (k < nchunks) g->step++;
    }
    return FSC_OK;
}

/* reduce on a group of at most this many ranks: run_reduce_to_root. */
#define FSC_SHM_ROOT_REDUCE_MAX_RANKS 3

/* reduce on a small group: the other ranks post each piece into their slots, one barrier, and the
 * root reduces its own input and the slots (its own first, then the others in rank order) straight
 * into its output. Per n bytes the root reads size * n and writes n, and each other rank copies n;
 * the split reduction of run_all_reduce has the root also copy its share in and the whole result
 * out, with one more barrier per op. At 2 and 3 ranks the root, which every other rank waits for,
 * does less, and every rank moves fewer bytes. Slots are reused as in run_all_gather: buffer
 * (step & 1) is written again at step + 2, after a barrier the root enters once it has reduced
 * from it. */
static fsc_status_t run_reduce_to_root(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), per = g->piece / esz;
    int is_root = a->root == g->rank;
    const uint8_t *in = a->in;
    uint8_t *out = a->out;
    const void *srcs[FSC_SHM_MAX_RANKS];
    for (size_t off = 0, first = 1; first || off < a->count; off += per, first = 0) {
        size_t n = min_sz(per, a->count - off);
        if (!is_root) copy(fsc_shm_slot(g, g->rank, g->step), in + off * esz, n * esz);
        if (first)
            FSC_CHECK(fsc_shm_open_collective(g, a));
        else
            FSC_CHECK(fsc_shm_arrive(g, 1));
        if (is_root && n > 0) {
            srcs[0] = in + off * esz; /* `out` may alias it (in place) */
            for (int p = 0, j = 1; p < g->size; p++)
                if (p != g->rank) srcs[j++] = fsc_shm_slot(g, p, g->step);
            FSC_CHECK(fsc_shm_reduce(out + off * esz, srcs, g->size, n, a->dtype, a->redop, g->size));
        }
        g->step++;
    }
    return FSC_OK;
}

static fsc_status_t run_broadcast(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    size_t esz = fsc_dtype_size(a->dtype), per = g->piece / esz;
    int is_root = a->root == g->rank, streaming = a->count * esz >= FSC_SHM_STREAM_MIN;
    for (size_t off = 0, first = 1; first || off < a->count; off += per, first = 0) {
        size_t nb = min_sz(per, a->count - off) * esz;
        uint8_t *slot = fsc_shm_slot(g, a->root, g->step);
        if (is_root) {
            copy(slot, (const uint8_t *)a->in + off * esz, nb);
            copy((uint8_t *)a->out + off * esz, (const uint8_t *)a->in + off * esz, nb);
        }
        if (first)
            FSC_CHECK(fsc_shm_open_collective(g, a));
        else
            FSC_CHECK(fsc_shm_arrive(g, 1));
        if (!is_root) fsc_shm_copy_out((uint8_t *)a->out + off * esz, slot, nb, streaming);
        g->step++;
    }
    return FSC_OK;
}

static fsc_status_t run_slots(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    switch (a->op) {
        case FSC_OP_BARRIER: return fsc_shm_open_collective(g, a);
        case FSC_OP_ALL_GATHER: return run_all_gather(g, a);
        case FSC_OP_REDUCE_SCATTER: return run_reduce_scatter(g, a);
        case FSC_OP_ALL_REDUCE: return run_all_reduce(g, a);
        case FSC_OP_REDUCE:
            return g->size <= FSC_SHM_ROOT_REDUCE_MAX_RANKS ? run_reduce_to_root(g, a) : run_all_reduce(g, a);
        case FSC_OP_BROADCAST: return run_broadcast(g, a);
        default: break;
    }
    return fsc_error(FSC_ERR_INTERNAL, "shm: unknown op %d", (int)a->op);
}

static fsc_status_t dispatch(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    int ran = 0;
    if (a->op == FSC_OP_COPY) { /* local: no other rank takes part */
        size_t nb = a->count * fsc_dtype_size(a->dtype);
        if (nb) fsc_shm_copy_out(a->out, a->in, nb, nb >= FSC_SHM_STREAM_MIN);
        return FSC_OK;
    }
    double t0 = fsc_comm_now();
    FSC_CHECK(fsc_shm_direct_run(g, a, &ran));
    if (!ran) FSC_CHECK(run_slots(g, a));
    if (g->choice_pending != NULL) fsc_shm_direct_timed(g, fsc_comm_now() - t0);
    return FSC_OK;
}

fsc_status_t fsc_shm_check_usable(fsc_shm_group_t *g) {
    if (g->broken != FSC_OK) return fsc_error(g->broken, "%s", g->broken_msg);
    FSC_CHECK(fsc_shm_check_owner(g));
    FSC_CHECK(fsc_shm_check_gave_up(g, NULL));
    return fsc_shm_check_refused(g);
}

void fsc_shm_group_give_up(fsc_shm_group_t *g) {
    if (atomic_exchange(&g->ranks[g->rank].gave_up, 1) == 0) atomic_fetch_add(&g->seg->gave_up, 1);
}

fsc_status_t fsc_shm_check_gave_up(fsc_shm_group_t *g, const char *what) {
    if (atomic_load_explicit(&g->seg->gave_up, memory_order_acquire) == 0) return FSC_OK;
    const char *sep = what != NULL ? " on " : "";
    what = what != NULL ? what : "";
    if (atomic_load_explicit(&g->ranks[g->rank].gave_up, memory_order_acquire))
        return fsc_shm_fail(g, fsc_error(FSC_ERR_COMM,
                                         "%s%sgroup '%s' (rank %d of %d): this rank gave up on the group "
                                         "after an error; it is unusable",
                                         what, sep, g->name, g->rank, g->size));
    int quit = -1;
    for (int p = 0; p < g->size && quit < 0; p++)
        if (atomic_load_explicit(&g->ranks[p].gave_up, memory_order_acquire)) quit = p;
    if (quit < 0) return FSC_OK;
    /* A rank usually gives up because another died: name the dead one, the cause, first. */
    for (int p = 0; p < g->size; p++) {
        pid_t pid = (pid_t)atomic_load(&g->ranks[p].pid);
        if (p != g->rank && p != quit && fsc_shm_pid_dead(pid))
            return fsc_shm_fail(g, fsc_error(FSC_ERR_COMM,
                                             "%s%sgroup '%s' (rank %d of %d): rank %d (pid %d) exited, and rank %d "
                                             "gave up on the group after that; the group is unusable",
                                             what, sep, g->name, g->rank, g->size, p, (int)pid, quit));
    }
    return fsc_shm_fail(g,
                        fsc_error(FSC_ERR_COMM,
                                  "%s%sgroup '%s' (rank %d of %d): rank %d (pid %d) gave up on the group after an "
                                  "error there (see that rank's output); the group is unusable",
                                  what, sep, g->name, g->rank, g->size, quit, (int)atomic_load(&g->ranks[quit].pid)));
}

fsc_status_t fsc_shm_fail(fsc_shm_group_t *g, fsc_status_t st) {
    if (st != FSC_OK && st != FSC_ERR_VALUE && g->broken == FSC_OK) {
        g->broken = st;
        snprintf(g->broken_msg, sizeof(g->broken_msg), "%s", fsc_last_error());
        FSC_WARN("shm", "%s", g->broken_msg);
    }
    return st;
}

/* Ranks and dtypes were checked by the binding layer (fsc_comm_check_call); these guard the core
 * against a caller that skipped it. */
static fsc_status_t check_args(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    int p2p = a->op == FSC_OP_SEND || a->op == FSC_OP_RECV;
    if (a->op <= FSC_OP_NONE || a->op >= FSC_NUM_OPS) return fsc_error(FSC_ERR_INTERNAL, "shm: unknown op %d", a->op);
    if (a->op != FSC_OP_BARRIER && (unsigned)a->dtype >= FSC_NUM_DTYPES)
        return fsc_error(FSC_ERR_INTERNAL, "shm: bad dtype");
    if ((p2p || a->op == FSC_OP_BROADCAST || a->op == FSC_OP_REDUCE) &&
        (a->root < 0 || a->root >= g->size || (p2p && a->root == g->rank)))
        return fsc_error(FSC_ERR_VALUE, "%s on group '%s': %s %d is not a valid rank (group size %d%s)",
                         fsc_comm_op_name(a->op), g->name, p2p ? "peer" : "root", a->root, g->size,
                         p2p ? ", and not this rank" : "");
    return FSC_OK;
}

fsc_status_t fsc_shm_run_batch(fsc_shm_group_t *g, const fsc_shm_args_t *a, size_t n) {
    FSC_CHECK(fsc_shm_check_usable(g));
    for (size_t i = 0; i < n; i++) FSC_CHECK(check_args(g, &a[i]));
    fsc_shm_p2p_t one, *st = &one;
    if (n > 1 && (st = calloc(n, sizeof(*st))) == NULL)
        return fsc_error(FSC_ERR_NOMEM, "shm: out of memory for a batch of %zu ops", n);
    fsc_status_t s = fsc_shm_p2p_run(g, a, st, n);
    for (size_t i = 0; i < n && s == FSC_OK; i++)
        if (a[i].op != FSC_OP_SEND && a[i].op != FSC_OP_RECV) s = dispatch(g, &a[i]);
    if (st != &one) free(st);
    return fsc_shm_fail(g, s);
}

fsc_status_t fsc_shm_run(fsc_shm_group_t *g, const fsc_shm_args_t *a) {
    return fsc_shm_run_batch(g, a, 1);
}
