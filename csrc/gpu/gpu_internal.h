/* gpu_internal.h — private to csrc/gpu: the kernels of the embedded image and their launch. */
#ifndef FSC_GPU_INTERNAL_H
#define FSC_GPU_INTERNAL_H

#include "gpu/gpu.h"

/* The kernels in csrc/cuda; gpu.c maps each to its extern "C" name. */
typedef enum {
    FSC_GPU_K_CAST_F32_F16,
    FSC_GPU_K_CAST_F32_BF16,
    FSC_GPU_K_CAST_F16_F32,
    FSC_GPU_K_CAST_BF16_F32,
    FSC_GPU_K_UNSCALE_F32,
    FSC_GPU_K_UNSCALE_F16,
    FSC_GPU_K_UNSCALE_BF16,
    FSC_GPU_K_NORM_F32,
    FSC_GPU_K_NORM_F16,
    FSC_GPU_K_NORM_BF16,
    FSC_GPU_K_NORM_FINALIZE,
    FSC_GPU_K_ADAMW_F32,
    FSC_GPU_K_FS_ADAM,
    FSC_GPU_K_FS_ADAM_MULTI,
    FSC_GPU_K_COUNT
} fsc_gpu_kernel_t;

#define FSC_GPU_BLOCK 256     /* = FSC_CUDA_BLOCK in csrc/cuda/common.cuh */
#define FSC_GPU_MAX_GRID 4096 /* grid-stride kernels: enough blocks to fill any current GPU */
#define FSC_GPU_MAX_PARTIALS 1024

/* Enqueue kernel `k` on `stream` of `device` with `args` (pointers to each argument, exactly the
 * kernel's parameter types), `grid` blocks of FSC_GPU_BLOCK threads, and check that the launch was
 * accepted; the image is loaded into the device's context on first use. `op` names the caller in
 * errors. Does not block. */
fsc_status_t fsc_gpu_launch(int device, fsc_gpu_kernel_t k, unsigned int grid, fsc_stream_t stream, void **args,
                            const char *op);

#endif
