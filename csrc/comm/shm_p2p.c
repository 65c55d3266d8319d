/* shm_p2p.c — point-to-point over a group's segment: every send/recv in flight on a rank is moved
 * by one loop that never blocks on a single channel, so sends and recvs issued in any order on
 * the ranks (a ring exchange where every rank sends first, say) complete. Each directed channel
 * carries its messages in order through two chunk buffers; a send completes once its last chunk
 * is in a buffer, a recv once it has copied its last chunk out.
 *
 * A message of more than two chunks whose data lies in a shared tensor (shm_shared.h) goes
 * direct when the group reads its peers' memory (shm.c, direct reads): the sender posts one chunk
 * holding only its buffer's address, the receiver copies the whole message from its own mapping of
 * that tensor (or, when it does not map it, reads it from the sender's memory) and acknowledges,
 * and the send completes at that acknowledgement. Each byte is copied once instead of twice, with
 * one handshake instead of one per chunk. Such a send would wait for its receiver anyway (only two
 * chunks fit the buffers), so which sends complete without their receiver does not change. The
 * sender decides; the receiver learns it from the message's first chunk. Sends from private
 * memory keep the buffers: there a copy in and a copy out run at once on the two ends, which
 * beat one process_vm_readv (docs/benchmarks.md, "Point-to-point"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "comm/shm_internal.h"
#include "comm/shm_shared.h"

#define FSC_P2P_ERR_JUMP 0x40000000u /* acked jump that releases a sender after a mismatch */

static size_t min_sz(size_t a, size_t b) {
    return a < b ? a : b;
}

/* What to add to a mismatch message whose headers differ only in their tags. */
static const char *tag_hint(const fsc_comm_header_t *sh, const fsc_comm_header_t *rh) {
    if (sh->tag == rh->tag || sh->count != rh->count || sh->dtype != rh->dtype) return "";
    return "; a recv takes the next message from its peer (messages between two ranks arrive in the order they were "
           "sent), whose tag must be the recv's";
}

static fsc_status_t mismatch(fsc_shm_group_t *g, int sender, const fsc_comm_header_t *sh, int receiver,
                             const fsc_comm_header_t *rh) {
    char ds[192], dr[192];
    fsc_comm_header_format(sh, ds, sizeof(ds));
    fsc_comm_header_format(rh, dr, sizeof(dr));
    return fsc_error(FSC_ERR_MISMATCH, "send/recv mismatch in group '%s': rank %d called %s but rank %d called %s%s",
                     g->name, sender, ds, receiver, dr, tag_hint(sh, rh));
}

/* Make `r` the message its channel carries next: sequence number, first chunk, header. */
static void start(fsc_shm_group_t *g, fsc_shm_p2p_t *r) {
    const fsc_shm_args_t *a = r->a;
    int send = a->op == FSC_OP_SEND, peer = a->root;
    size_t bytes = a->count * fsc_dtype_size(a->dtype);
    memset(&r->h, 0, sizeof(r->h));
    r->h.op = (uint32_t)a->op;
    r->h.dtype = (uint32_t)a->dtype;
    r->h.root = peer;
    r->h.tag = a->tag;
    r->h.count = (uint64_t)a->count;
    r->h.seq = send ? ++g->send_seq[peer] : ++g->recv_seq[peer];
    r->j0 = send ? g->send_next[peer] : g->recv_next[peer];
    /* A recv starts as chunked and turns direct when its first chunk says so (recv_step). */
    r->direct = 0;
    if (send && g->direct_max > 0 && bytes > 2 * g->p2p_chunk) {
        uint64_t id, off;
        fsc_shm_shared_locate(a->in, bytes, &id, &off);
        r->direct = id != 0;
    }
    r->nchunks = r->direct ? 1 : (uint32_t)(bytes == 0 ? 1 : (bytes + g->p2p_chunk - 1) / g->p2p_chunk);
    r->k = 0;
    r->started = 1;
}

/* Post a direct message's one chunk: its header and the sender's buffer. */
static void send_direct(fsc_shm_group_t *g, fsc_shm_p2p_t *r, fsc_shm_chan_t *c, uint32_t j) {
    const fsc_shm_args_t *a = r->a;
    size_t bytes = a->count * fsc_dtype_size(a->dtype);
    c->hdr[j & 1] = r->h;
    c->src[j & 1] = (uint64_t)(uintptr_t)a->in;
    fsc_shm_shared_locate(a->in, bytes, &c->src_shared_id[j & 1], &c->src_shared_off[j & 1]);
    fsc_shm_post(&c->sent, &c->sent_sleepers, j + 1);
    fsc_shm_ring(g, a->root);
}

/* Copy a direct message from the sender's buffer: mapped when this process maps its shared
 * tensor, else read from the sender's memory. */
static fsc_status_t recv_direct(fsc_shm_group_t *g, fsc_shm_p2p_t *r, const fsc_shm_chan_t *c, uint32_t j) {
    const fsc_shm_args_t *a = r->a;
    int peer = a->root;
    size_t bytes = a->count * fsc_dtype_size(a->dtype);
    uint8_t *mapped =
        c->src_shared_id[j & 1] ? fsc_shm_shared_addr(c->src_shared_id[j & 1], c->src_shared_off[j & 1], bytes) : NULL;
    if (mapped != NULL) {
        fsc_shm_copy_out(a->out, mapped, bytes, bytes >= FSC_SHM_STREAM_MIN);
        return FSC_OK;
    }
    int err = fsc_shm_peer_read(g, peer, a->out, c->src[j & 1], bytes);
    if (err == 0) return FSC_OK;
    return fsc_error(FSC_ERR_COMM,
                     "recv from rank %d on group '%s' (rank %d of %d): reading the sender's buffer (pid %d) failed: %s",
                     peer, g->name, g->rank, g->size, (int)atomic_load(&g->ranks[peer].pid), strerror(err));
}

/* Post every chunk whose buffer is free. */
static fsc_status_t send_step(fsc_shm_group_t *g, fsc_shm_p2p_t *r, int *progressed) {
    const fsc_shm_args_t *a = r->a;
    int peer = a->root;
    fsc_shm_chan_t *c = fsc_shm_chan(g, g->rank, peer);
    size_t bytes = a->count * fsc_dtype_size(a->dtype), per = g->p2p_chunk;
    if (r->direct) { /* posted once, complete (k = 1) when the receiver has copied it */
        if (atomic_load_explicit(&c->err, memory_order_acquire)) return mismatch(g, g->rank, &r->h, peer, &c->rhdr);
        if (!r->posted && fsc_shm_reached(&c->acked, r->j0 - 1)) { /* slot j0 & 1 is free */
            send_direct(g, r, c, r->j0);
            r->posted = 1;
            *progressed = 1;
        }
        if (r->posted && fsc_shm_reached(&c->acked, r->j0 + 1)) {
            /* a refusal also moves `acked` (by FSC_P2P_ERR_JUMP), after setting err */
            if (atomic_load_explicit(&c->err, memory_order_acquire)) return mismatch(g, g->rank, &r->h, peer, &c->rhdr);
            r->k = 1;
            *progressed = 1;
        }
        return FSC_OK;
    }
    while (r->k < r->nchunks) {
        if (atomic_load_explicit(&c->err, memory_order_acquire)) return mismatch(g, g->rank, &r->h, peer, &c->rhdr);
        uint32_t j = r->j0 + r->k;
        if (!fsc_shm_reached(&c->acked, j - 1)) break; /* buffer j & 1 still holds chunk j - 2 */
        size_t off = (size_t)r->k * per, n = bytes > off ? min_sz(per, bytes - off) : 0;
        c->hdr[j & 1] = r->h;
        c->src[j & 1] = 0; /* not direct */
        if (n) memcpy(fsc_shm_p2p_buf(g, g->rank, peer, j), (const uint8_t *)a->in + off, n);
        fsc_shm_post(&c->sent, &c->sent_sleepers, j + 1);
        fsc_shm_ring(g, peer);
        r->k++;
        *progressed = 1;
    }
    return FSC_OK;
}

/* Take every chunk that has arrived; the first one's header must match this recv. */
static fsc_status_t recv_step(fsc_shm_group_t *g, fsc_shm_p2p_t *r, int *progressed) {
    const fsc_shm_args_t *a = r->a;
    int peer = a->root;
    fsc_shm_chan_t *c = fsc_shm_chan(g, peer, g->rank);
    size_t bytes = a->count * fsc_dtype_size(a->dtype), per = g->p2p_chunk;
    while (r->k < r->nchunks) {
        uint32_t j = r->j0 + r->k;
        if (!fsc_shm_reached(&c->sent, j + 1)) break;
        if (r->k == 0) {
            fsc_comm_header_t sh = c->hdr[j & 1];
            if (sh.op != FSC_OP_SEND || sh.count != r->h.count || sh.dtype != r->h.dtype || sh.tag != r->h.tag ||
                sh.seq != r->h.seq || sh.root != g->rank) {
                c->rhdr = r->h;
                c->shdr = sh;
                atomic_store(&c->err, 1);
                fsc_shm_post(&c->acked, &c->acked_sleepers, j + FSC_P2P_ERR_JUMP);
                fsc_shm_ring(g, peer);
                return mismatch(g, peer, &sh, g->rank, &r->h);
            }
            if (c->src[j & 1] != 0) { /* the sender posted its buffer's address: one chunk */
                r->direct = 1;
                r->nchunks = 1;
            }
        }
        if (r->direct) {
            FSC_CHECK(recv_direct(g, r, c, j));
        } else {
            size_t off = (size_t)r->k * per, n = bytes > off ? min_sz(per, bytes - off) : 0;
            if (n) memcpy((uint8_t *)a->out + off, fsc_shm_p2p_buf(g, peer, g->rank, j), n);
        }
        fsc_shm_post(&c->acked, &c->acked_sleepers, j + 1);
        fsc_shm_ring(g, peer);
        r->k++;
        *progressed = 1;
    }
    return FSC_OK;
}

fsc_status_t fsc_shm_p2p_pass(fsc_shm_group_t *g, fsc_shm_p2p_t *const *recs, size_t n, int *progressed, size_t *left) {
    memset(g->send_busy, 0, (size_t)g->size);
    memset(g->recv_busy, 0, (size_t)g->size);
    *left = 0;
    for (size_t i = 0; i < n; i++) {
        fsc_shm_p2p_t *r = recs[i];
        if (r->done) continue;
        int send = r->a->op == FSC_OP_SEND, peer = r->a->root;
        uint8_t *busy = send ? &g->send_busy[peer] : &g->recv_busy[peer];
        if (*busy) { /* an earlier message on this channel is still moving */
            (*left)++;
            continue;
        }
        if (!r->started) start(g, r);
        g->cur_hdr = r->h;
        g->ranks[g->rank].cur = r->h;
        FSC_CHECK(send ? send_step(g, r, progressed) : recv_step(g, r, progressed));
        if (r->k == r->nchunks) {
            r->done = 1;
            if (send)
                g->send_next[peer] = r->j0 + r->nchunks;
            else
                g->recv_next[peer] = r->j0 + r->nchunks;
        } else {
            *busy = 1;
            (*left)++;
        }
    }
    return FSC_OK;
}

fsc_status_t fsc_shm_p2p_backoff(fsc_shm_group_t *g, fsc_shm_backoff_t *b, fsc_shm_p2p_t *const *recs, size_t n,
                                 uint32_t seen) {
    /* One unfinished record names the op and the peer whose liveness is checked (and who is
     * blamed on a timeout); successive calls take them in turn, so every peer is watched. */
    size_t unfinished = 0;
    for (size_t i = 0; i < n; i++) unfinished += recs[i]->started && !recs[i]->done;
    if (unfinished == 0) return FSC_OK;
    size_t pick = g->p2p_probe++ % unfinished;
    const fsc_shm_p2p_t *r = NULL;
    for (size_t i = 0; i < n && r == NULL; i++)
        if (recs[i]->started && !recs[i]->done && pick-- == 0) r = recs[i];
    g->cur_hdr = r->h;
    fsc_shm_rank_ctrl_t *me = &g->ranks[g->rank];
    return fsc_shm_backoff(g, b, &me->bell, &me->bell_sleepers, seen, r->a->root);
}

fsc_status_t fsc_shm_p2p_run(fsc_shm_group_t *g, const fsc_shm_args_t *ops, fsc_shm_p2p_t *st, size_t n) {
    enum { MAX_STACK = 64 };
    fsc_shm_p2p_t *stack[MAX_STACK], **recs = stack;
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (ops[i].op == FSC_OP_SEND || ops[i].op == FSC_OP_RECV) m++;
    if (m == 0) return FSC_OK;
    if (m > MAX_STACK && (recs = malloc(m * sizeof(*recs))) == NULL)
        return fsc_error(FSC_ERR_NOMEM, "shm: out of memory for %zu point-to-point ops", m);
    for (size_t i = 0, k = 0; i < n; i++) {
        if (ops[i].op != FSC_OP_SEND && ops[i].op != FSC_OP_RECV) continue;
        memset(&st[i], 0, sizeof(st[i]));
        st[i].a = &ops[i];
        recs[k++] = &st[i];
    }
    fsc_status_t s = FSC_OK;
    fsc_shm_backoff_t b = {0};
    g->deadline = fsc_comm_now() + g->timeout;
    for (;;) {
        uint32_t seen = atomic_load_explicit(&g->ranks[g->rank].bell, memory_order_acquire);
        int progressed = 0;
        size_t left = 0;
        s = fsc_shm_p2p_pass(g, recs, m, &progressed, &left);
        if (s != FSC_OK || left == 0) break;
        if (progressed) {
            memset(&b, 0, sizeof(b));
            g->deadline = fsc_comm_now() + g->timeout;
            continue;
        }
        s = fsc_shm_p2p_backoff(g, &b, recs, m, seen);
        if (s != FSC_OK) break;
    }
    if (recs != stack) free(recs);
    return s;
}

fsc_status_t fsc_shm_check_refused(fsc_shm_group_t *g) {
    for (int p = 0; p < g->size; p++) {
        fsc_shm_chan_t *c = fsc_shm_chan(g, g->rank, p);
        if (p == g->rank || !atomic_load_explicit(&c->err, memory_order_acquire)) continue;
        char ds[192], dr[192];
        fsc_comm_header_t sh = c->shdr, rh = c->rhdr;
        fsc_comm_header_format(&sh, ds, sizeof(ds));
        fsc_comm_header_format(&rh, dr, sizeof(dr));
        return fsc_shm_fail(g, fsc_error(FSC_ERR_MISMATCH,
                                         "send/recv mismatch in group '%s': rank %d refused a message rank %d sent "
                                         "it, %s, because it called %s%s",
                                         g->name, p, g->rank, ds, dr, tag_hint(&sh, &rh)));
    }
    return FSC_OK;
}
