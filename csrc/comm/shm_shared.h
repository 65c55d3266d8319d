/* shm_shared.h — shared host tensors: memory that every rank of a group maps, so that a collective
 * whose buffers all live in it moves each byte with one plain copy from the owner's memory (no
 * slots, no system call). One allocation is one memfd holding one slice per rank; every rank maps
 * the whole file. A process-wide registry translates between addresses and (file id, offset). */
#ifndef FSC_SHM_SHARED_H
#define FSC_SHM_SHARED_H

#include <stddef.h>
#include <stdint.h>

#include "base/hostbuf.h"
#include "base/status.h"

/* Create an allocation of `total` bytes (zeroed) and map it: *fd stays open for the peers to open
 * (fsc_shm_shared_open) until the caller closes it; *id is a random non-zero 64-bit name. */
fsc_status_t fsc_shm_shared_create(size_t total, int *fd, uint64_t *id, uint8_t **base);

/* Map the allocation `id` of `total` bytes that process `pid` holds open as descriptor `fd`
 * (through /proc/<pid>/fd; the kernel checks that this process may). */
fsc_status_t fsc_shm_shared_open(int pid, int fd, size_t total, uint64_t id, uint8_t **base);

/* A host buffer of `nbytes` at byte `off` of the mapping `base` (`total` bytes, allocation `id`):
 * registers the mapping, and its last release unregisters and unmaps it. On failure the mapping
 * is unmapped. */
fsc_status_t fsc_shm_shared_slice(uint8_t *base, size_t total, uint64_t id, size_t off, size_t nbytes,
                                  fsc_hostbuf_t **out);

/* Where [ptr, ptr + n) lies: in a registered allocation (*id != 0, *off = its byte offset there)
 * or not (*id = 0). */
void fsc_shm_shared_locate(const void *ptr, size_t n, uint64_t *id, uint64_t *off);

/* This process's address of bytes [off, off + n) of allocation `id`, or NULL when it has no
 * mapping of it. The caller must keep one of its own buffers in that allocation alive while it
 * uses the address (an op's own tensor does). */
uint8_t *fsc_shm_shared_addr(uint64_t id, uint64_t off, size_t n);

/* Number of shared allocations this process maps (leak checks in tests). */
long fsc_shm_shared_live(void);

#endif /* FSC_SHM_SHARED_H */
