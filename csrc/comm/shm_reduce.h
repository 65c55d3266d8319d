/* shm_reduce.h — element-wise reduction of N same-shaped buffers (sum/avg/max/min), the compute
 * kernel of the shm collectives; float16/bfloat16 accumulate in float32. */
#ifndef FSC_SHM_REDUCE_H
#define FSC_SHM_REDUCE_H

#include <stddef.h>

#include "base/tensor.h"
#include "comm/comm.h"

/* dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... (op) srcs[nsrc-1][i] for i < count, all buffers of
 * dtype `dt`, nsrc >= 1. For FSC_RED_AVG the result is divided by `divisor` (normally the group
 * size) before rounding. `dst` may be the same pointer as srcs[0] but must not otherwise overlap
 * a source. float16/bfloat16 are widened to float32, reduced there and rounded once (nearest
 * even). Integer sums wrap like torch's. CPU only; blocks the calling thread; never allocates.
 * Returns FSC_ERR_VALUE for a dtype/op the collectives do not support. */
fsc_status_t fsc_shm_reduce(void *dst, const void *const *srcs, int nsrc, size_t count, fsc_dtype_t dt,
                            fsc_reduce_op_t op, int divisor);

#define FSC_SHM_REDUCE_MAX_DSTS 256

/* The same reduction of nsrc >= 2 sources, stored to each of `ndst` (<= FSC_SHM_REDUCE_MAX_DSTS)
 * destinations with streaming (non-temporal) stores, or normal ones into a destination that is
 * also a source (in place), for outputs too large to stay in the caches: the leading elements that
 * fill whole 64-byte lines, for float32 and float64 with 16-byte aligned destinations (x86-64).
 * Returns how many leading elements it wrote (0 when it does not apply); the caller reduces the
 * rest. Bit-identical to fsc_shm_reduce over the same sources in the same order. */
size_t fsc_shm_reduce_stream(void *const *dsts, int ndst, const void *const *srcs, int nsrc, size_t count,
                             fsc_dtype_t dt, fsc_reduce_op_t op, int divisor);

#endif /* FSC_SHM_REDUCE_H */
