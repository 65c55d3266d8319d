/* gpu.h — the CUDA driver and runtime loaded at run time (dlopen, never linked), device
 * contexts, streams and events, and launchers for the kernels in csrc/cuda. */
#ifndef FSC_GPU_H
#define FSC_GPU_H

#include <stdint.h>

#include "base/status.h"
#include "base/tensor.h"
#include "gpu/fs_adam_table.h"
#include "gpu/kernels_cpu.h"

/* A CUstream / cudaStream_t (the same handle) as an integer, e.g. torch's
 * `torch.cuda.current_stream().cuda_stream`. 0 is the legacy default stream. */
typedef uintptr_t fsc_stream_t;

/* A CUevent / cudaEvent_t. */
typedef void *fsc_gpu_event_t;

/* What fsc_gpu_info found. */
typedef struct {
    int driver_found;       /* libcuda.so.1 opened and its symbols resolved */
    int driver_version;     /* cuDriverGetVersion, e.g. 12080 for 12.8; 0 when not found */
    char driver_path[512];  /* file libcuda.so.1 was loaded from; "" when not found */
    int runtime_found;      /* a libcudart was found (the one torch loaded, if any) */
    int runtime_version;    /* cudaRuntimeGetVersion; 0 when not found */
    char runtime_path[512]; /* file the runtime was loaded from; "" when not found */
    int kernels_built;      /* the CUDA kernels were compiled into this build */
    int device_count;       /* devices the driver sees; 0 without a driver or device */
    char error[256];        /* why the driver is unusable ("" when it is usable) */
} fsc_gpu_info_t;

/* Open libcuda.so.1, resolve the driver entry points and call cuInit, once per process
 * (thread-safe; later calls return the first result). FSC_ERR_UNAVAILABLE when there is no
 * driver or no device. Calling it initialises CUDA in this process, so call it after any
 * fork. Blocks while the driver initialises (first call only). */
fsc_status_t fsc_gpu_load(void);

/* Fill *out. Never fails: a missing driver or runtime is reported in the fields. Calls
 * fsc_gpu_load (so it initialises the driver when there is one). */
void fsc_gpu_info(fsc_gpu_info_t *out);

/* Make `device`'s primary context (the one torch's runtime uses) current on this thread for
 * the duration of a driver call, restoring the previous one afterwards. Use as
 *     fsc_gpu_ctx_t g; FSC_CHECK(fsc_gpu_ctx_enter(dev, &g)); ...; fsc_gpu_ctx_exit(&g);
 * fsc_gpu_ctx_exit must be called on the same thread iff enter returned FSC_OK. */
typedef struct {
    int pushed;
} fsc_gpu_ctx_t;
fsc_status_t fsc_gpu_ctx_enter(int device, fsc_gpu_ctx_t *g);
void fsc_gpu_ctx_exit(fsc_gpu_ctx_t *g);

/* Events: create one on `device` (timing disabled) and record it on `stream`; query whether
 * the work before it has finished (*done = 1) without blocking; destroy it (safe to call
 * while it is still pending). */
fsc_status_t fsc_gpu_event_record(int device, fsc_stream_t stream, fsc_gpu_event_t *ev);
fsc_status_t fsc_gpu_event_query(int device, fsc_gpu_event_t ev, int *done);
void fsc_gpu_event_destroy(int device, fsc_gpu_event_t ev);

/* Block until all work on `stream` (a stream of `device`) has finished. Streams belong to
 * torch; the core creates none. */
fsc_status_t fsc_gpu_stream_synchronize(int device, fsc_stream_t stream);

/* ---- kernel launchers ---------------------------------------------------------------------
 * All tensors are contiguous CUDA views on one device; the kernel is enqueued on `stream`
 * (which must belong to that device) and the call returns without waiting for it. The first
 * launch on a device loads the embedded kernel image into its primary context. Without
 * CUDA kernels in the build each returns FSC_ERR_UNAVAILABLE; bad arguments give
 * FSC_ERR_VALUE / FSC_ERR_TYPE before anything is enqueued. The caller keeps the memory alive
 * until the stream has passed the kernel. */

/* dst[i] = src[i] for equal-numel float32 -> float16/bfloat16 or float16/bfloat16 -> float32,
 * rounding to nearest even (bit-identical to torch's Tensor.to()). dst and src must not
 * overlap. */
fsc_status_t fsc_gpu_cast(fsc_tensor_t *dst, const fsc_tensor_t *src, fsc_stream_t stream);

/* CUDA twin of fsc_cpu_unscale_inf_check: buf (float32/float16/bfloat16) *= inv_scale in
 * place and found_inf (one float32 element) is set to 1.0 if any element was non-finite. */
fsc_status_t fsc_gpu_unscale_inf_check(fsc_tensor_t *buf, float inv_scale, fsc_tensor_t *found_inf,
                                       fsc_stream_t stream);

/* CUDA twin of fsc_cpu_norm with float32 accumulation: out (one float32 element) = sum of x^2
 * or max |x| over x (float32/float16/bfloat16). `workspace` is float32 scratch of at least one
 * element; its numel bounds the number of blocks of the first pass (at most 1024 are used).
 * Two kernels, deterministic for a given workspace size. out and workspace must not
 * overlap x or each other. */
fsc_status_t fsc_gpu_norm(const fsc_tensor_t *x, fsc_norm_mode_t mode, fsc_tensor_t *workspace, fsc_tensor_t *out,
                          fsc_stream_t stream);

/* CUDA twin of fsc_cpu_adamw_step (flat float32 shards of equal numel, updated in place);
 * bit-identical to it. */
fsc_status_t fsc_gpu_adamw_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                fsc_tensor_t *exp_avg_sq, const fsc_adamw_hparams_t *hp, fsc_stream_t stream);

/* CUDA twin of fsc_cpu_fs_adam_step (csrc/gpu/kernels_cpu.h): the same tensors on one device,
 * found_inf a one-element float32 tensor there; bit-identical results. Enqueued on `stream`. */
fsc_status_t fsc_gpu_fs_adam_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                  fsc_tensor_t *exp_avg_sq, fsc_tensor_t *param_copy, const fsc_fs_adam_scalars_t *s,
                                  fsc_tensor_t *found_inf, fsc_stream_t stream);

/* fsc_gpu_fs_adam_step over n parameters (t: five tensors per parameter as
 * fsc_cpu_fs_adam_multi takes them; sc: each one's scalars, which differ only in step_size),
 * every one checked before any is stepped; one launch per run of up to FSC_FS_ADAM_TABLE
 * parameters of one dtype combination, same bits. Enqueued on `stream`. */
fsc_status_t fsc_gpu_fs_adam_multi(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                   fsc_tensor_t *found_inf, fsc_stream_t stream);

/* How fsc_gpu_fs_adam_multi groups parameters into launches, without launching: `visit` gets
 * each table in order (codes: the param, grad, state and copy dtype codes, -1 for no copy; first:
 * the index of its first parameter, whose scalars but step_size hold for the whole table;
 * single: -1), or, for a parameter with more chunks than a table counts, NULL and that
 * parameter's index as `first` and `single`. Empty parameters are skipped. Stops at the first
 * status `visit` returns that is not FSC_OK. */
typedef fsc_status_t (*fsc_fs_adam_visit_t)(void *ctx, const fsc_fs_adam_table_t *tab, const int codes[4],
                                            int64_t first, int64_t single);
fsc_status_t fsc_gpu_fs_adam_plan(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                  fsc_fs_adam_visit_t visit, void *ctx);

/* CUDA twin of fsc_tensor_pack_blocks (same layout and checks), enqueued on `stream` as one
 * 2D device-to-device copy per source; no kernel, so it works without CUDA kernels in the
 * build. */
fsc_status_t fsc_gpu_pack_blocks(fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world, fsc_stream_t stream);

#endif /* FSC_GPU_H */
