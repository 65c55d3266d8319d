/* tensor.h — the plain C tensor view the core works on (no Python), and dtype helpers. */
#ifndef FSC_TENSOR_H
#define FSC_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef enum {
    FSC_FLOAT16 = 0,
    FSC_BFLOAT16,
    FSC_FLOAT32,
    FSC_FLOAT64,
    FSC_INT8,
    FSC_INT16,
    FSC_INT32,
    FSC_INT64,
    FSC_UINT8,
    FSC_BOOL,
    FSC_NUM_DTYPES
} fsc_dtype_t;

typedef enum { FSC_DEV_CPU = 1, FSC_DEV_CUDA = 2 } fsc_device_type_t;

#define FSC_MAX_NDIM 16

/* A strided view of memory owned by someone else (torch, numpy, or a C buffer).
 * `data` already includes DLPack's byte_offset. Strides count elements. A view with
 * numel == 0 may have data == NULL. */
typedef struct {
    void *data;
    fsc_dtype_t dtype;
    int device_type; /* fsc_device_type_t */
    int device_id;
    int ndim;
    int64_t numel;
    int64_t shape[FSC_MAX_NDIM];
    int64_t strides[FSC_MAX_NDIM];
    int readonly; /* the producer said the memory must not be written */
} fsc_tensor_t;

/* Bytes per element (bool is 1 byte). */
size_t fsc_dtype_size(fsc_dtype_t dt);

/* "float32", "bfloat16", ... as torch spells them. */
const char *fsc_dtype_name(fsc_dtype_t dt);

/* 1 when the view is C-contiguous (size-0 and size-1 dims ignore strides), else 0. */
int fsc_tensor_is_contiguous(const fsc_tensor_t *t);

/* Bytes spanned by a contiguous view. */
static inline size_t fsc_tensor_nbytes(const fsc_tensor_t *t) {
    return (size_t)t->numel * fsc_dtype_size(t->dtype);
}

/* Copy src into dst element by element, honouring both views' strides, converting dtype
 * between any of the floating types (fp16/bf16 round to nearest even) or copying bytes when
 * the dtypes match. Shapes must match (numel and ndim after dropping size-1 dims). CPU only;
 * blocks the calling thread. */
fsc_status_t fsc_tensor_copy(fsc_tensor_t *dst, const fsc_tensor_t *src);

/* Interleave `n` flat sources, each made of `world` equal blocks, into `dst` so that dst holds
 * block 0 of every source (in order), then block 1 of every source, and so on: the layout one
 * reduce-scatter of several flat gradients needs (rank r then receives block r of each, packed).
 * Contiguous CPU tensors of one dtype; dst->numel == sum of the sources' numel, each a multiple
 * of `world`. Blocks the calling thread. */
fsc_status_t fsc_tensor_pack_blocks(fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world);

/* The argument checks of fsc_tensor_pack_blocks, for tensors of device type `dev` (all on
 * dst's device), shared with its CUDA twin fsc_gpu_pack_blocks; errors name `op`. */
fsc_status_t fsc_tensor_pack_check(const fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world,
                                   fsc_device_type_t dev, const char *op);

#endif /* FSC_TENSOR_H */
