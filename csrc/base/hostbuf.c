/* hostbuf.c — aligned, zeroed, atomically reference-counted host allocations. */
#include "base/hostbuf.h"

#include <stdlib.h>
#include <string.h>

static atomic_long live_buffers;

static void hostbuf_free(fsc_hostbuf_t *self) {
    free(self->data);
    free(self);
    atomic_fetch_sub(&live_buffers, 1);
}

fsc_status_t fsc_hostbuf_alloc(size_t nbytes, fsc_hostbuf_t **out) {
    *out = NULL;
    fsc_hostbuf_t *buf = calloc(1, sizeof(*buf));
    if (buf == NULL) return fsc_error(FSC_ERR_NOMEM, "host buffer: cannot allocate its header");
    if (nbytes > 0) {
        /* aligned_alloc wants a size that is a multiple of the alignment. */
        size_t rounded = (nbytes + FSC_HOSTBUF_ALIGN - 1) / FSC_HOSTBUF_ALIGN * FSC_HOSTBUF_ALIGN;
        if (rounded < nbytes || (buf->data = aligned_alloc(FSC_HOSTBUF_ALIGN, rounded)) == NULL) {
            free(buf);
            return fsc_error(FSC_ERR_NOMEM, "host buffer: cannot allocate %zu bytes", nbytes);
        }
        memset(buf->data, 0, rounded);
    }
    atomic_init(&buf->refs, 1);
    buf->nbytes = nbytes;
    buf->release = hostbuf_free;
    atomic_fetch_add(&live_buffers, 1);
    *out = buf;
    return FSC_OK;
}

void fsc_hostbuf_retain(fsc_hostbuf_t *buf) {
    atomic_fetch_add_explicit(&buf->refs, 1, memory_order_relaxed);
}

void fsc_hostbuf_release(fsc_hostbuf_t *buf) {
    if (buf == NULL) return;
    if (atomic_fetch_sub_explicit(&buf->refs, 1, memory_order_acq_rel) == 1) buf->release(buf);
}

long fsc_hostbuf_live(void) {
    return atomic_load(&live_buffers);
}
