/* hostbuf.h — C-owned, reference-counted host memory (staging buffers, exports to DLPack). */
#ifndef FSC_HOSTBUF_H
#define FSC_HOSTBUF_H

#include <stdatomic.h>
#include <stddef.h>

#include "base/status.h"

typedef struct fsc_hostbuf fsc_hostbuf_t;

struct fsc_hostbuf {
    atomic_long refs;
    void *data; /* FSC_HOSTBUF_ALIGN-aligned; NULL when nbytes == 0 */
    size_t nbytes;
    void (*release)(fsc_hostbuf_t *self); /* frees data and self; never touches Python */
};

#define FSC_HOSTBUF_ALIGN 64

/* Allocate `nbytes` of zeroed host memory with one reference. Never blocks on Python. */
fsc_status_t fsc_hostbuf_alloc(size_t nbytes, fsc_hostbuf_t **out);

/* Take / drop a reference. The last release frees the memory. Thread-safe and needs no GIL,
 * so DLPack deleters may run from any thread or at interpreter shutdown. */
void fsc_hostbuf_retain(fsc_hostbuf_t *buf);
void fsc_hostbuf_release(fsc_hostbuf_t *buf);

/* Number of host buffers alive in this process (leak checks in tests). */
long fsc_hostbuf_live(void);

#endif /* FSC_HOSTBUF_H */
