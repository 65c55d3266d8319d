/* norm.cu — gradient-norm reductions for clip_grad_norm_: sum of squares (2-norm) or max |x|
 * (inf-norm) of a flat shard, accumulated in float32, in two deterministic passes (no atomics,
 * so the same input always gives the same bits). */
#include "common.cuh"

/* Pass 1. partials[blockIdx.x] = the combination (mode: FSC_CUDA_NORM_SUMSQ or _ABSMAX) of the
 * x[i] this block's threads visit in the grid-stride loop. partials holds gridDim.x floats.
 * blockDim.x must be a multiple of 32 and <= 1024 (the launcher uses FSC_CUDA_BLOCK). */
template <typename T>
static __device__ __forceinline__ void fsc_norm_partials_body(const T *x, long long n, int mode, float *partials) {
    float acc = 0.0f;
    FSC_GRID_STRIDE_LOOP(i, n) {
        float v = fsc_to_f32(x[i]);
        acc = mode == FSC_CUDA_NORM_ABSMAX ? fsc_nanmax(acc, fabsf(v)) : acc + v * v;
    }
    acc = fsc_block_reduce(acc, mode);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

extern "C" __global__ void fsc_norm_partials_f32(const float *x, long long n, int mode, float *partials) {
    fsc_norm_partials_body(x, n, mode, partials);
}

extern "C" __global__ void fsc_norm_partials_f16(const __half *x, long long n, int mode, float *partials) {
    fsc_norm_partials_body(x, n, mode, partials);
}

extern "C" __global__ void fsc_norm_partials_bf16(const __nv_bfloat16 *x, long long n, int mode, float *partials) {
    fsc_norm_partials_body(x, n, mode, partials);
}

/* Pass 2, launched as a single block: out[0] = the combination of partials[0, npartials).
 * Kept on the device so the caller can chain it (e.g. into the clip coefficient) without a
 * host synchronisation. */
extern "C" __global__ void fsc_norm_finalize(const float *partials, int npartials, int mode, float *out) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < npartials; i += blockDim.x) acc = fsc_combine(acc, partials[i], mode);
    acc = fsc_block_reduce(acc, mode);
    if (threadIdx.x == 0) out[0] = acc;
}
