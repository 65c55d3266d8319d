/* common.cuh — what every kernel file shares: dtype loads/stores through float32 and the
 * block-level reductions used by the norm kernels. Included once per translation unit (all
 * kernel files are compiled together into one fatbin, see tools/build_cuda.py). */
#ifndef FSC_CUDA_COMMON_CUH
#define FSC_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

/* Threads per block for every kernel here; the launchers in csrc/gpu.c use the same value
 * (FSC_GPU_BLOCK). The block reductions below rely on it being a multiple of 32, <= 1024. */
#define FSC_CUDA_BLOCK 256

/* Modes of the norm kernels; the values match fsc_norm_mode_t in csrc/kernels_cpu.h. */
#define FSC_CUDA_NORM_SUMSQ 0
#define FSC_CUDA_NORM_ABSMAX 1

/* Every kernel is a grid-stride loop over a flat int64 index, so the launcher may cap the
 * grid at any size without affecting results (except the norm partials, whose count is the
 * grid size). */
#define FSC_GRID_STRIDE_LOOP(i, n)                                                \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

static __device__ __forceinline__ float fsc_to_f32(float x) {
    return x;
}
static __device__ __forceinline__ float fsc_to_f32(__half x) {
    return __half2float(x);
}
static __device__ __forceinline__ float fsc_to_f32(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

/* Round-to-nearest-even stores, the same rounding the CPU reference and torch's .to() use. */
static __device__ __forceinline__ void fsc_from_f32(float *dst, float v) {
    *dst = v;
}
static __device__ __forceinline__ void fsc_from_f32(__half *dst, float v) {
    *dst = __float2half_rn(v);
}
static __device__ __forceinline__ void fsc_from_f32(__nv_bfloat16 *dst, float v) {
    *dst = __float2bfloat16_rn(v);
}

/* max that propagates NaN from either side, like torch's max reductions. */
static __device__ __forceinline__ float fsc_nanmax(float a, float b) {
    return (a > b || a != a) ? a : b;
}

static __device__ __forceinline__ float fsc_combine(float a, float b, int mode) {
    return mode == FSC_CUDA_NORM_ABSMAX ? fsc_nanmax(a, b) : a + b;
}

/* Reduce one float per thread across the block; the result is valid in thread 0. Two stages:
 * a shuffle tree inside each warp, then warp 0 combines the per-warp results from shared
 * memory. Every thread of the block must call it. */
static __device__ float fsc_block_reduce(float v, int mode) {
    __shared__ float warp_vals[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    for (int off = 16; off > 0; off >>= 1) v = fsc_combine(v, __shfl_down_sync(0xffffffffu, v, off), mode);
    if (lane == 0) warp_vals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? warp_vals[lane] : 0.0f; /* 0 is the identity of both modes */
        for (int off = 16; off > 0; off >>= 1) v = fsc_combine(v, __shfl_down_sync(0xffffffffu, v, off), mode);
    }
    return v;
}

#endif /* FSC_CUDA_COMMON_CUH */
