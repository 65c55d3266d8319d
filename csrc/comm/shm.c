/* shm.c — shm segment lifecycle: create, attach, join, close, unlink, and the sweep of stale
 * segments. The waits on the segment's words are in shm_wait.c. */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "comm/shm_direct.h"
#include "comm/shm_internal.h"

#define FSC_SHM_MIN_CHUNK ((size_t)4096)
#define FSC_SHM_MAX_CHUNK ((size_t)1 << 30)
#define FSC_SHM_MAX_GRACE_S 1e9 /* a longer close() grace is no grace: wait for the queued ops */

static size_t round_up(size_t x, size_t a) {
    return (x + a - 1) / a * a;
}

static size_t chunk_from_env(void) {
    const char *s = getenv("FAIRSCALE_C_SHM_CHUNK");
    /* 1 MiB: a rank's slots stay in its caches, and the segment is a quarter of 4 MiB's size
     * (measurements: docs/benchmarks.md, "Why these settings"). */
    size_t def = (size_t)1 << 20;
    if (s == NULL || *s == '\0') return def;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end != '\0' || v < FSC_SHM_MIN_CHUNK || v > FSC_SHM_MAX_CHUNK) {
        FSC_WARN("shm", "FAIRSCALE_C_SHM_CHUNK='%s' must be a byte count in [4096, 2^30]; using %zu", s, def);
        return def;
    }
    return round_up((size_t)v, FSC_SHM_MIN_CHUNK);
}

/* Default FAIRSCALE_C_SHM_DIRECT_MAX: no limit. Above 16 MiB an op reads only where rank 0's timings
 * pick reads ("auto", shm_direct.c) or FAIRSCALE_C_SHM_DIRECT_READS is "on". */
#define FSC_SHM_DIRECT_MAX_DEFAULT SIZE_MAX

static size_t direct_max_from_env(void) {
    const char *s = getenv("FAIRSCALE_C_SHM_DIRECT_MAX");
    if (s == NULL || *s == '\0') return FSC_SHM_DIRECT_MAX_DEFAULT;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end != '\0' || s[0] == '-') {
        FSC_WARN("shm", "FAIRSCALE_C_SHM_DIRECT_MAX='%s' must be a byte count (0: off); using %zu", s,
                 FSC_SHM_DIRECT_MAX_DEFAULT);
        return FSC_SHM_DIRECT_MAX_DEFAULT;
    }
    return (size_t)v;
}

/* FAIRSCALE_C_SHM_DIRECT_READS: "auto" (default: rank 0 times both ways, shm_direct.c), "on", "off". */
static uint32_t reads_mode_from_env(void) {
    const char *s = getenv("FAIRSCALE_C_SHM_DIRECT_READS");
    if (s == NULL || *s == '\0' || strcmp(s, "auto") == 0) return 1;
    if (strcmp(s, "on") == 0 || strcmp(s, "1") == 0) return 2;
    if (strcmp(s, "off") == 0 || strcmp(s, "0") == 0) return 0;
    FSC_WARN("shm", "FAIRSCALE_C_SHM_DIRECT_READS='%s' must be auto, on or off; using auto", s);
    return 1;
}

/* Bytes per pipeline step of all_gather, broadcast and reduce (the creator's rule; attachers check
 * that it is chunk or chunk / 4). A quarter of the slot per step lets the readers of step k work
 * while the writer fills step k + 1 within a chunk-sized op; but each step is a barrier, and ranks
 * that share cores pay a context switch per barrier. So the quarter is used only when this process
 * may run on at least as many CPUs as the group has ranks (measurements: docs/benchmarks.md, "Why
 * these settings"). */
static size_t piece_for(size_t chunk, int size) {
    return fsc_shm_cpus_available() >= size ? chunk / 4 : chunk;
}

/* Bytes per send/recv buffer for a given slot chunk (the creator's rule; attachers check it). */
static size_t p2p_chunk_for(size_t chunk) {
    return chunk / 4 < 65536 ? 65536 : chunk / 4;
}

/* The pid namespace of this process (the inode of /proc/self/ns/pid), 0 when unknown. Segment
 * names carry it, so a sweep judges a creator's pid only in the namespace it belongs to. */
static unsigned long long pid_namespace(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

/* Offsets of every region for `size` ranks; returns the total byte count. */
static size_t layout(fsc_shm_seg_t *s, int size, size_t chunk, size_t p2p_chunk, size_t piece) {
    size_t n = (size_t)size, off = round_up(sizeof(fsc_shm_seg_t), 4096);
    s->off_ranks = off;
    off = round_up(off + n * sizeof(fsc_shm_rank_ctrl_t), 4096);
    s->off_chans = off;
    off = round_up(off + n * n * sizeof(fsc_shm_chan_t), 4096);
    s->off_slots = off;
    off += n * 2 * chunk;
    s->off_result = off;
    off += 2 * chunk;
    s->off_p2p = off;
    off += n * n * 2 * p2p_chunk;
    s->chunk = chunk;
    s->p2p_chunk = p2p_chunk;
    s->piece = piece;
    s->size = size;
    s->total = off;
    return off;
}

/* Point the group at the regions of layout `l` (computed by this rank, or validated by
 * check_layout): from here on the offsets are never read from shared memory again. */
static void use_layout(fsc_shm_group_t *g, const fsc_shm_seg_t *l) {
    g->chunk = (size_t)l->chunk;
    g->p2p_chunk = (size_t)l->p2p_chunk;
    g->piece = (size_t)l->piece;
    g->off_slots = (size_t)l->off_slots;
    g->off_result = (size_t)l->off_result;
    g->off_p2p = (size_t)l->off_p2p;
    g->ranks = (fsc_shm_rank_ctrl_t *)(g->base + l->off_ranks);
    g->chans = (fsc_shm_chan_t *)(g->base + l->off_chans);
}

static fsc_status_t bad_layout(const fsc_shm_group_t *g, const char *what) {
    return fsc_error(FSC_ERR_COMM,
                     "group '%s' (rank %d of %d): shared memory %s has an invalid layout (%s); refusing to attach",
                     g->name, g->rank, g->size, g->seg_name, what);
}

/* Attaching side: the creator's header, copied once into `out` (a peer could rewrite the shared
 * one at any time) and checked against the layout this group's size and the header's chunk sizes
 * imply: every region inside the mapping, nothing overlapping, chunks the algorithms can step
 * through. A planted or corrupted header is an error here instead of a crash later. */
static fsc_status_t check_layout(const fsc_shm_group_t *g, fsc_shm_seg_t *out) {
    char what[256];
    fsc_shm_seg_t h, want;
    memcpy(&h, (const void *)g->seg, sizeof(h));
    if (atomic_load_explicit(&g->seg->magic, memory_order_acquire) != FSC_SHM_MAGIC || h.version != FSC_SHM_VERSION) {
        snprintf(what, sizeof(what), "version %u, expected a fairscale_c segment of version %u", (unsigned)h.version,
                 FSC_SHM_VERSION);
        return bad_layout(g, what);
    }
    if (h.size != g->size) {
        snprintf(what, sizeof(what), "made for %d ranks, expected %d", (int)h.size, g->size);
        return bad_layout(g, what);
    }
    if (h.chunk < FSC_SHM_MIN_CHUNK || h.chunk > FSC_SHM_MAX_CHUNK || h.chunk % FSC_SHM_MIN_CHUNK != 0 ||
        h.p2p_chunk != p2p_chunk_for((size_t)h.chunk) || (h.piece != h.chunk && h.piece != h.chunk / 4)) {
        snprintf(what, sizeof(what),
                 "chunk=%llu, p2p_chunk=%llu, piece=%llu bytes; expected a chunk that is a multiple of 4096 in "
                 "[4096, 2^30], p2p_chunk=max(chunk/4, 65536) and piece=chunk or chunk/4",
                 (unsigned long long)h.chunk, (unsigned long long)h.p2p_chunk, (unsigned long long)h.piece);
        return bad_layout(g, what);
    }
    layout(&want, g->size, (size_t)h.chunk, (size_t)h.p2p_chunk, (size_t)h.piece);
    if (h.off_ranks != want.off_ranks || h.off_chans != want.off_chans || h.off_slots != want.off_slots ||
        h.off_result != want.off_result || h.off_p2p != want.off_p2p || h.total != want.total) {
        snprintf(what, sizeof(what), "region offsets or total size differ from the layout of %d ranks with chunk=%llu",
                 g->size, (unsigned long long)h.chunk);
        return bad_layout(g, what);
    }
    if (want.total > g->bytes) {
        snprintf(what, sizeof(what), "%zu bytes, the layout needs %llu", g->bytes, (unsigned long long)want.total);
        return bad_layout(g, what);
    }
    *out = want;
    return FSC_OK;
}

/* Attach only to a segment this user made for this purpose: owned by our effective uid, with no
 * group or other permission bits (the creator makes it O_EXCL with 0600). Anything else was
 * planted, or is another user's: FSC_ERR_COMM naming the owner. */
static fsc_status_t check_owner(const fsc_shm_group_t *g, const struct stat *sb) {
    if (sb->st_uid == geteuid() && (sb->st_mode & 077) == 0 && S_ISREG(sb->st_mode)) return FSC_OK;
    char who[64] = "";
    struct passwd pw, *found = NULL;
    char pwbuf[1024];
    if (getpwuid_r(sb->st_uid, &pw, pwbuf, sizeof(pwbuf), &found) == 0 && found != NULL)
        snprintf(who, sizeof(who), " (%s)", found->pw_name);
    return fsc_error(FSC_ERR_COMM,
                     "group '%s' (rank %d of %d): shared memory %s belongs to uid %u%s with mode %04o; expected this "
                     "process's uid %u and mode 0600 (no group or other access): refusing to attach",
                     g->name, g->rank, g->size, g->seg_name, (unsigned)sb->st_uid, who, (unsigned)(sb->st_mode & 07777),
                     (unsigned)geteuid());
}

/* Attaching side: wait (up to the timeout, 1 ms naps) until the creator has made the segment
 * and published its layout, i.e. until it is at least header-sized and carries the magic. A
 * creator that exits first (its pid is known from the rendezvous) ends the wait at once; either
 * way the half-made name is removed, so a creator that died between creating the segment and
 * attaching to it leaves nothing in /dev/shm as long as one peer is alive. */
static fsc_status_t attach_when_ready(fsc_shm_group_t *g, pid_t creator_pid, int *fd_out) {
    double deadline = fsc_comm_now() + g->timeout, polled = fsc_comm_now();
    const char *why = "did not create";
    for (;;) {
        int fd = shm_open(g->seg_name, O_RDWR, 0600);
        if (fd < 0 && errno == EACCES) { /* someone else's: say whose */
            char path[96];
            struct stat sb;
            snprintf(path, sizeof(path), "/dev/shm%s", g->seg_name);
            if (stat(path, &sb) == 0) return check_owner(g, &sb);
            errno = EACCES;
        }
        if (fd >= 0) {
            struct stat sb;
            if (fstat(fd, &sb) != 0) {
                fsc_status_t st =
                    fsc_error(FSC_ERR_SYSTEM, "group '%s': fstat(%s): %s", g->name, g->seg_name, strerror(errno));
                close(fd);
                return st;
            }
            fsc_status_t st = check_owner(g, &sb);
            if (st != FSC_OK) {
                close(fd);
                return st;
            }
            if ((size_t)sb.st_size >= sizeof(fsc_shm_seg_t)) {
                fsc_shm_seg_t *hdr = mmap(NULL, sizeof(fsc_shm_seg_t), PROT_READ, MAP_SHARED, fd, 0);
                int ready = hdr != MAP_FAILED && atomic_load_explicit(&hdr->magic, memory_order_acquire) != 0;
                if (hdr != MAP_FAILED) munmap(hdr, sizeof(fsc_shm_seg_t));
                if (ready) {
                    g->bytes = (size_t)sb.st_size;
                    *fd_out = fd;
                    return FSC_OK;
                }
            }
            close(fd);
            why = "did not finish setting up";
        } else if (errno != ENOENT) {
            return fsc_error(FSC_ERR_COMM, "group '%s': cannot attach shared memory %s: %s", g->name, g->seg_name,
                             strerror(errno));
        }
        if (fsc_shm_pid_dead(creator_pid)) {
            shm_unlink(g->seg_name);
            return fsc_error(FSC_ERR_COMM,
                             "rendezvous of group '%s' (rank %d of %d): rank 0 (pid %d) exited and %s shared "
                             "memory %s",
                             g->name, g->rank, g->size, (int)creator_pid, why, g->seg_name);
        }
        if (fsc_comm_now() > deadline) {
            shm_unlink(g->seg_name);
            return fsc_error(FSC_ERR_TIMEOUT,
                             "rendezvous of group '%s' (rank %d of %d): rank 0 %s shared memory %s within %g s "
                             "(FAIRSCALE_C_TIMEOUT)",
                             g->name, g->rank, g->size, why, g->seg_name, g->timeout);
        }
        if (fsc_comm_now() - polled > 0.05) { /* Ctrl-C, or rank 0 said it failed (the caller's check) */
            polled = fsc_comm_now();
            if (fsc_shm_interrupted())
                return fsc_error(FSC_ERR_COMM,
                                 "rendezvous of group '%s' (rank %d of %d): interrupted while waiting "
                                 "for rank 0 to create shared memory %s",
                                 g->name, g->rank, g->size, g->seg_name);
        }
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
}

static fsc_status_t map_segment(fsc_shm_group_t *g, int create, pid_t creator_pid) {
    int fd = -1;
    fsc_status_t st = FSC_OK;
    if (create) {
        if (g->seg_name[0] == '\0') fsc_shm_segment_name(g->seg_name, sizeof(g->seg_name));
        fsc_shm_seg_t tmp;
        memset(&tmp, 0, sizeof(tmp));
        g->chunk = chunk_from_env();
        g->p2p_chunk = p2p_chunk_for(g->chunk);
        g->piece = piece_for(g->chunk, g->size);
        g->bytes = layout(&tmp, g->size, g->chunk, g->p2p_chunk, g->piece);
        fd = shm_open(g->seg_name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) return fsc_error(FSC_ERR_SYSTEM, "shm_open(%s): %s", g->seg_name, strerror(errno));
        /* the umask may have taken bits of 0600 away: the peers (same uid) need read and write */
        if (fchmod(fd, 0600) != 0) {
            st = fsc_error(FSC_ERR_SYSTEM, "fchmod(%s, 0600): %s", g->seg_name, strerror(errno));
            shm_unlink(g->seg_name);
            goto exit;
        }
        /* Reserve the pages now: a tmpfs that is too small then fails here, with an error,
         * instead of killing the process with SIGBUS at the first write to a page it cannot back. */
        int rc = posix_fallocate(fd, 0, (off_t)g->bytes);
        if (rc != 0) {
            st = fsc_error(FSC_ERR_SYSTEM,
                           "group '%s': cannot reserve %zu bytes of shared memory %s: %s (is /dev/shm large "
                           "enough? FAIRSCALE_C_SHM_CHUNK makes the segment smaller)",
                           g->name, g->bytes, g->seg_name, strerror(rc));
            shm_unlink(g->seg_name);
            goto exit;
        }
    } else {
        FSC_CHECK(attach_when_ready(g, creator_pid, &fd));
    }
    void *p = mmap(NULL, g->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        st = fsc_error(FSC_ERR_SYSTEM, "mmap(%s, %zu): %s", g->seg_name, g->bytes, strerror(errno));
        if (create) shm_unlink(g->seg_name);
        goto exit;
    }
    g->base = (uint8_t *)p;
    g->seg = (fsc_shm_seg_t *)p;
exit:
    if (fd >= 0) close(fd);
    return st;
}

static fsc_status_t init_or_check(fsc_shm_group_t *g, int create) {
    fsc_shm_seg_t l;
    memset(&l, 0, sizeof(l));
    if (create) {
        fsc_shm_seg_t *s = g->seg;
        layout(&l, g->size, g->chunk, g->p2p_chunk, g->piece);
        layout(s, g->size, g->chunk, g->p2p_chunk, g->piece);
        s->version = FSC_SHM_VERSION;
        atomic_store(&s->nattached, 0);
        atomic_store_explicit(&s->magic, FSC_SHM_MAGIC, memory_order_release);
    } else {
        FSC_CHECK(check_layout(g, &l));
    }
    use_layout(g, &l);
    fsc_shm_wait_budget(g);
    return FSC_OK;
}

fsc_status_t fsc_shm_group_open(const char *group_name, const char *seg_name, int create, int creator_pid, int rank,
                                int size, fsc_shm_group_t **out) {
    *out = NULL;
    if (!create && seg_name == NULL)
        return fsc_error(FSC_ERR_VALUE, "shm group: attaching needs the segment name that rank 0 published");
    if (seg_name != NULL && (seg_name[0] != '/' || strlen(seg_name) >= 64 || strchr(seg_name + 1, '/') != NULL))
        return fsc_error(FSC_ERR_VALUE, "shm group: segment name '%s' must be '/name' (no other '/', under 64 chars)",
                         seg_name);
    if (size < 1 || size > FSC_SHM_MAX_RANKS || rank < 0 || rank >= size)
        return fsc_error(FSC_ERR_VALUE, "shm group: rank %d / size %d out of range (size 1..%d)", rank, size,
                         FSC_SHM_MAX_RANKS);
    fsc_status_t st = FSC_OK;
    fsc_shm_group_t *g = calloc(1, sizeof(*g));
    if (g == NULL) return fsc_error(FSC_ERR_NOMEM, "shm group: out of memory");
    snprintf(g->name, sizeof(g->name), "%s", group_name ? group_name : "?");
    if (seg_name != NULL) snprintf(g->seg_name, sizeof(g->seg_name), "%s", seg_name);
    g->rank = rank;
    g->size = size;
    g->owner_pid = (int)getpid();
    g->unlinked = 0;
    FSC_CHECK_GOTO(fsc_comm_timeout_get(&g->timeout), st, fail);
    if (create) fsc_shm_sweep_stale();
    g->send_seq = calloc((size_t)size, sizeof(uint64_t));
    g->recv_seq = calloc((size_t)size, sizeof(uint64_t));
    g->send_next = calloc((size_t)size, sizeof(uint32_t));
    g->recv_next = calloc((size_t)size, sizeof(uint32_t));
    g->send_busy = calloc((size_t)size, 1);
    g->recv_busy = calloc((size_t)size, 1);
    if (g->send_seq == NULL || g->recv_seq == NULL || g->send_next == NULL || g->recv_next == NULL ||
        g->send_busy == NULL || g->recv_busy == NULL) {
        st = fsc_error(FSC_ERR_NOMEM, "shm group: out of memory");
        goto fail;
    }
    FSC_CHECK_GOTO(map_segment(g, create, (pid_t)creator_pid), st, fail);
    FSC_CHECK_GOTO(init_or_check(g, create), st, fail);
    fsc_shm_rank_ctrl_t *me = &g->ranks[rank];
    if (getrandom(&g->direct_cookie, sizeof(g->direct_cookie), GRND_NONBLOCK) != (ssize_t)sizeof(g->direct_cookie))
        g->direct_cookie = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)(fsc_comm_now() * 1e9);
    me->direct_cookie = g->direct_cookie;
    me->direct_cookie_addr = (uint64_t)(uintptr_t)&g->direct_cookie;
    me->direct_max = direct_max_from_env();
    me->reads_mode = reads_mode_from_env();
    atomic_store(&me->direct_ok, 0);
    atomic_store(&me->where, 0);
    atomic_store(&me->pid, (int32_t)getpid());
    atomic_store(&me->attached, 1);
    g->epoch = atomic_load(&me->arrive);
    if (atomic_fetch_add(&g->seg->nattached, 1) + 1 == (uint32_t)size) fsc_shm_group_unlink(g);
    FSC_INFO("shm", "group '%s' rank %d/%d %s %s (%zu bytes)", g->name, rank, size, create ? "created" : "attached",
             g->seg_name, g->bytes);
    *out = g;
    return FSC_OK;
fail:
    if (create && g->base != NULL) shm_unlink(g->seg_name);
    fsc_shm_group_close(g, -1);
    return st;
}

fsc_status_t fsc_shm_group_status(const fsc_shm_group_t *g) {
    if (g->broken == FSC_OK) return FSC_OK;
    return fsc_error(g->broken, "%s", g->broken_msg);
}

fsc_status_t fsc_shm_check_owner(const fsc_shm_group_t *g) {
    if ((int)getpid() == g->owner_pid) return FSC_OK;
    return fsc_error(FSC_ERR_COMM,
                     "group '%s' was opened by pid %d; this process (pid %d) is a fork() child of it and cannot "
                     "use it: build a new group in the child",
                     g->name, g->owner_pid, (int)getpid());
}

const char *fsc_shm_group_segment_name(const fsc_shm_group_t *g) {
    return g->seg_name;
}
int fsc_shm_group_rank(const fsc_shm_group_t *g) {
    return g->rank;
}
size_t fsc_shm_group_direct_max(const fsc_shm_group_t *g) {
    return g->direct_max;
}
size_t fsc_shm_group_read_max(const fsc_shm_group_t *g) {
    return g->reads_mode == 0 ? 0 : g->direct_max;
}

uint64_t fsc_shm_group_mapped_ops(const fsc_shm_group_t *g) {
    return atomic_load_explicit(&g->mapped_ops, memory_order_relaxed);
}
uint64_t fsc_shm_group_read_ops(const fsc_shm_group_t *g) {
    return atomic_load_explicit(&g->read_ops, memory_order_relaxed);
}
int fsc_shm_group_size(const fsc_shm_group_t *g) {
    return g->size;
}
const char *fsc_shm_group_name(const fsc_shm_group_t *g) {
    return g->name;
}

void fsc_shm_group_unlink(fsc_shm_group_t *g) {
    if (g == NULL || g->unlinked || g->seg_name[0] == '\0') return;
    g->unlinked = 1;
    if (shm_unlink(g->seg_name) != 0 && errno != ENOENT)
        FSC_WARN("shm", "shm_unlink(%s): %s", g->seg_name, strerror(errno));
}

void fsc_shm_segment_name(char *buf, size_t cap) {
    uint32_t rnd = 0;
    if (getrandom(&rnd, sizeof(rnd), GRND_NONBLOCK) != (ssize_t)sizeof(rnd))
        rnd = (uint32_t)time(NULL) ^ (uint32_t)(uintptr_t)buf ^ ((uint32_t)getpid() << 16);
    snprintf(buf, cap, "/fsc-%d-%llx-%08x", (int)getpid(), pid_namespace(), rnd);
}

/* "fsc-<pid>-<pid namespace, hex>-<8 hex digits>" (a /dev/shm entry): 1 and its fields, or 0 when
 * the name has another form (another program's, or one made before names carried the namespace). */
static int parse_segment_name(const char *name, long *pid, unsigned long long *ns) {
    char *end;
    if (strncmp(name, "fsc-", 4) != 0 || !isdigit((unsigned char)name[4])) return 0;
    errno = 0;
    long p = strtol(name + 4, &end, 10);
    if (errno != 0 || *end != '-' || p <= 0 || p > INT_MAX || !isxdigit((unsigned char)end[1])) return 0;
    unsigned long long n = strtoull(end + 1, &end, 16);
    if (errno != 0 || *end != '-' || strlen(end + 1) != 8 || strspn(end + 1, "0123456789abcdef") != 8) return 0;
    *pid = p;
    *ns = n;
    return 1;
}

int fsc_shm_sweep_stale(void) {
    unsigned long long mine = pid_namespace();
    DIR *d = mine != 0 ? opendir("/dev/shm") : NULL;
    if (d == NULL) return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long pid;
        unsigned long long ns;
        struct stat st;
        char path[300];
        if (!parse_segment_name(e->d_name, &pid, &ns) || ns != mine || pid == (long)getpid()) continue;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
            st.st_uid != geteuid() || !fsc_shm_pid_dead((pid_t)pid))
            continue;
        snprintf(path, sizeof(path), "/%s", e->d_name);
        if (shm_unlink(path) == 0) {
            removed++;
            FSC_INFO("shm", "removed %s, left by pid %ld, which has exited", path, pid);
        }
    }
    closedir(d);
    return removed;
}

int fsc_shm_peer_read(const fsc_shm_group_t *g, int peer, void *dst, uint64_t src, size_t n) {
    pid_t pid = (pid_t)atomic_load(&g->ranks[peer].pid);
    size_t done = 0;
    while (done < n) {
        struct iovec l = {(uint8_t *)dst + done, n - done}, r = {(void *)(uintptr_t)(src + done), n - done};
        ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return got < 0 ? errno : EIO;
        done += (size_t)got;
    }
    return 0;
}

/* Decide with the peers whether this group uses direct reads: every rank reads every peer's
 * cookie through process_vm_readv (which the kernel allows only where this process may trace the
 * peer: same user, and no stricter ptrace policy) and publishes whether all matched. Direct
 * reads are on when every rank could, up to the smallest FAIRSCALE_C_SHM_DIRECT_MAX of any
 * rank. A peer in another pid namespace, or a kernel that refuses, turns them off for the whole
 * group; nothing else changes. When any rank's limit is 0 nobody probes: no process_vm_readv is
 * made at all. */
static fsc_status_t agree_direct(fsc_shm_group_t *g, double deadline) {
    fsc_shm_rank_ctrl_t *me = &g->ranks[g->rank];
    uint64_t max = UINT64_MAX;
    for (int p = 0; p < g->size; p++)
        if (g->ranks[p].direct_max < max) max = g->ranks[p].direct_max;
    int ok = g->size > 1 && max > 0; /* no rank reads any peer when one of them turned it off */
    for (int p = 0; p < g->size && ok; p++) {
        if (p == g->rank) continue;
        uint64_t v = 0;
        int err = fsc_shm_peer_read(g, p, &v, g->ranks[p].direct_cookie_addr, sizeof(v));
        if (err != 0 || v != g->ranks[p].direct_cookie) {
            FSC_INFO("shm", "group '%s' rank %d: cannot read rank %d's memory (%s); direct reads off", g->name, g->rank,
                     p, err != 0 ? strerror(err) : "cookie differs");
            ok = 0;
        }
    }
    atomic_store_explicit(&me->direct_ok, ok ? 1u : 2u, memory_order_release);
    for (int p = 0; p < g->size; p++) {
        uint32_t v;
        while ((v = atomic_load_explicit(&g->ranks[p].direct_ok, memory_order_acquire)) == 0) {
            if (fsc_shm_pid_dead((pid_t)atomic_load(&g->ranks[p].pid)))
                return fsc_shm_fail(g, fsc_error(FSC_ERR_COMM,
                                                 "rendezvous of group '%s' (rank %d of %d): rank %d (pid %d) exited "
                                                 "while joining",
                                                 g->name, g->rank, g->size, p, (int)atomic_load(&g->ranks[p].pid)));
            if (fsc_comm_now() > deadline)
                return fsc_shm_fail(g, fsc_error(FSC_ERR_TIMEOUT,
                                                 "rendezvous of group '%s' (rank %d of %d): rank %d did not finish "
                                                 "joining within FAIRSCALE_C_TIMEOUT=%g s",
                                                 g->name, g->rank, g->size, p, g->timeout));
            struct timespec ts = {0, 100000};
            nanosleep(&ts, NULL);
        }
        if (v != 1) ok = 0;
    }
    g->direct_max = ok ? (size_t)max : 0;
    uint32_t mode = 2; /* FAIRSCALE_C_SHM_DIRECT_READS: "off" on any rank wins, then "auto" */
    for (int p = 0; p < g->size; p++)
        if (g->ranks[p].reads_mode < mode) mode = g->ranks[p].reads_mode;
    g->reads_mode = mode;
    FSC_INFO("shm", "group '%s' rank %d: direct reads %s (up to %zu bytes; private buffers: %s)", g->name, g->rank,
             ok ? "on" : "off", g->direct_max,
             mode == 0   ? "off"
             : mode == 1 ? "auto"
                         : "on");
    return FSC_OK;
}

fsc_status_t fsc_shm_group_join(fsc_shm_group_t *g) {
    double deadline = fsc_comm_now() + g->timeout, polled = fsc_comm_now();
    while (atomic_load(&g->seg->nattached) < (uint32_t)g->size) {
        if (fsc_comm_now() - polled > 0.05) {
            polled = fsc_comm_now();
            if (fsc_shm_interrupted())
                return fsc_shm_fail(g, fsc_error(FSC_ERR_COMM,
                                                 "rendezvous of group '%s' (rank %d of %d): interrupted while "
                                                 "waiting for the other ranks to attach",
                                                 g->name, g->rank, g->size));
        }
        if (fsc_comm_now() > deadline) {
            fsc_shm_group_unlink(g);
            char missing[512] = "";
            size_t n = 0;
            for (int r = 0; r < g->size && n < sizeof(missing) - 16; r++)
                if (!atomic_load(&g->ranks[r].attached))
                    n += (size_t)snprintf(missing + n, sizeof(missing) - n, "%s%d", n ? ", " : "", r);
            return fsc_shm_fail(g, fsc_error(FSC_ERR_TIMEOUT,
                                             "rendezvous of group '%s' (rank %d of %d): rank(s) %s did not join "
                                             "within FAIRSCALE_C_TIMEOUT=%g s",
                                             g->name, g->rank, g->size, missing, g->timeout));
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    fsc_shm_group_unlink(g);
    return agree_direct(g, deadline);
}

void fsc_shm_group_close(fsc_shm_group_t *g, double grace_s) {
    if (g == NULL) return;
    /* NaN, infinite or astronomically long: no grace (the conversion to time_t would be undefined) */
    if (!(grace_s <= FSC_SHM_MAX_GRACE_S)) grace_s = -1;
    fsc_shm_engine_stop(g, grace_s);
    fsc_shm_engine_free(g);
    if (g->base != NULL) munmap(g->base, g->bytes);
    free(g->send_seq);
    free(g->recv_seq);
    free(g->send_next);
    free(g->recv_next);
    free(g->send_busy);
    free(g->recv_busy);
    free(g->direct_scratch);
    free(g);
}
