/* shm_shared.c — shared host tensors (shm_shared.h): memfd allocations every rank maps, and the
 * process-wide registry of those mappings. */
#include "comm/shm_shared.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define NAME_PREFIX "fairscale_c-shared-"

typedef struct {
    uint64_t id;
    uint8_t *base;
    size_t total;
} mapping_t;

typedef struct {
    fsc_hostbuf_t buf; /* first: the release callback gets this pointer */
    mapping_t map;
} shared_buf_t;

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static mapping_t *reg;
static size_t reg_n, reg_cap;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;

/* A fork() while another thread holds the registry's lock must not leave the child's copy locked
 * forever (the child may still ask is_shared). */
static void reg_lock(void) {
    pthread_mutex_lock(&reg_mu);
}
static void reg_unlock(void) {
    pthread_mutex_unlock(&reg_mu);
}
static void reg_init(void) {
    pthread_atfork(reg_lock, reg_unlock, reg_unlock);
}

static fsc_status_t map_fd(int fd, size_t total, uint8_t **base) {
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return fsc_error(FSC_ERR_NOMEM, "shared tensor: cannot map %zu bytes: %s", total, strerror(errno));
    *base = p;
    return FSC_OK;
}

fsc_status_t fsc_shm_shared_create(size_t total, int *fd, uint64_t *id, uint8_t **base) {
    *fd = -1;
    *base = NULL;
    *id = 0;
    while (*id == 0)
        if (getrandom(id, sizeof(*id), 0) != (ssize_t)sizeof(*id))
            return fsc_error(FSC_ERR_SYSTEM, "shared tensor: getrandom failed: %s", strerror(errno));
    char name[64];
    snprintf(name, sizeof(name), NAME_PREFIX "%016" PRIx64, *id);
    int f = memfd_create(name, MFD_CLOEXEC);
    if (f < 0) return fsc_error(FSC_ERR_SYSTEM, "shared tensor: memfd_create failed: %s", strerror(errno));
    if (ftruncate(f, (off_t)total) != 0) {
        int e = errno;
        close(f);
        return fsc_error(FSC_ERR_NOMEM, "shared tensor: cannot size %zu bytes: %s", total, strerror(e));
    }
    fsc_status_t st = map_fd(f, total, base);
    if (st != FSC_OK) {
        close(f);
        return st;
    }
    *fd = f;
    return FSC_OK;
}

fsc_status_t fsc_shm_shared_open(int pid, int fd, size_t total, uint64_t id, uint8_t **base) {
    *base = NULL;
    char path[64], want[64], link[128];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, fd);
    snprintf(want, sizeof(want), "/memfd:" NAME_PREFIX "%016" PRIx64, id);
    /* the descriptor must still be the allocation that was announced, not one that reused its number */
    ssize_t k = readlink(path, link, sizeof(link) - 1);
    if (k < 0) return fsc_error(FSC_ERR_SYSTEM, "shared tensor: cannot look at %s: %s", path, strerror(errno));
    link[k] = '\0';
    if (strncmp(link, want, strlen(want)) != 0)
        return fsc_error(FSC_ERR_SYSTEM, "shared tensor: %s is '%s', not allocation %016" PRIx64, path, link, id);
    int f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) return fsc_error(FSC_ERR_SYSTEM, "shared tensor: cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    fsc_status_t st = FSC_OK;
    if (fstat(f, &sb) != 0 || (size_t)sb.st_size != total)
        st = fsc_error(FSC_ERR_SYSTEM, "shared tensor: %s holds %lld bytes, expected %zu", path, (long long)sb.st_size,
                       total);
    else
        st = map_fd(f, total, base);
    close(f); /* the mapping keeps the file */
    return st;
}

static void unregister(const uint8_t *base) {
    pthread_mutex_lock(&reg_mu);
    for (size_t i = 0; i < reg_n; i++)
        if (reg[i].base == base) {
            reg[i] = reg[--reg_n];
            break;
        }
    pthread_mutex_unlock(&reg_mu);
}

static void shared_release(fsc_hostbuf_t *self) {
    shared_buf_t *s = (shared_buf_t *)self;
    unregister(s->map.base);
    munmap(s->map.base, s->map.total);
    free(s);
}

fsc_status_t fsc_shm_shared_slice(uint8_t *base, size_t total, uint64_t id, size_t off, size_t nbytes,
                                  fsc_hostbuf_t **out) {
    *out = NULL;
    shared_buf_t *s = NULL;
    fsc_status_t st = FSC_OK;
    if (off > total || nbytes > total - off)
        st = fsc_error(FSC_ERR_INTERNAL, "shared tensor: slice [%zu, +%zu) outside %zu bytes", off, nbytes, total);
    else if ((s = calloc(1, sizeof(*s))) == NULL)
        st = fsc_error(FSC_ERR_NOMEM, "shared tensor: out of memory");
    pthread_once(&reg_once, reg_init);
    pthread_mutex_lock(&reg_mu);
    if (st == FSC_OK && reg_n == reg_cap) {
        size_t cap = reg_cap ? reg_cap * 2 : 16;
        mapping_t *r = realloc(reg, cap * sizeof(*r));
        if (r == NULL)
            st = fsc_error(FSC_ERR_NOMEM, "shared tensor: out of memory");
        else
            reg = r, reg_cap = cap;
    }
    if (st == FSC_OK) reg[reg_n++] = (mapping_t){id, base, total};
    pthread_mutex_unlock(&reg_mu);
    if (st != FSC_OK) {
        free(s);
        munmap(base, total);
        return st;
    }
    s->map = (mapping_t){id, base, total};
    atomic_init(&s->buf.refs, 1);
    s->buf.data = base + off;
    s->buf.nbytes = nbytes;
    s->buf.release = shared_release;
    *out = &s->buf;
    return FSC_OK;
}

void fsc_shm_shared_locate(const void *ptr, size_t n, uint64_t *id, uint64_t *off) {
    const uint8_t *p = ptr;
    *id = 0;
    *off = 0;
    pthread_mutex_lock(&reg_mu);
    for (size_t i = 0; i < reg_n; i++)
        if (p >= reg[i].base && (size_t)(p - reg[i].base) <= reg[i].total &&
            n <= reg[i].total - (size_t)(p - reg[i].base)) {
            *id = reg[i].id;
            *off = (uint64_t)(p - reg[i].base);
            break;
        }
    pthread_mutex_unlock(&reg_mu);
}

uint8_t *fsc_shm_shared_addr(uint64_t id, uint64_t off, size_t n) {
    uint8_t *a = NULL;
    if (id == 0) return NULL;
    pthread_mutex_lock(&reg_mu);
    for (size_t i = 0; i < reg_n; i++)
        if (reg[i].id == id && off <= reg[i].total && n <= reg[i].total - off) {
            a = reg[i].base + off;
            break;
        }
    pthread_mutex_unlock(&reg_mu);
    return a;
}

long fsc_shm_shared_live(void) {
    pthread_mutex_lock(&reg_mu);
    long n = (long)reg_n;
    pthread_mutex_unlock(&reg_mu);
    return n;
}
