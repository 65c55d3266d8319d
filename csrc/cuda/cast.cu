/* cast.cu — dtype casts between float32 and float16/bfloat16 for FSDP mixed precision:
 * the fp32 shard is cast to the compute dtype before its all-gather, and reduced low-precision
 * gradients are cast back to fp32 shards. */
#include "common.cuh"

/* dst[i] = src[i] converted, i in [0, n). src and dst are distinct, contiguous, on one
 * device. Narrowing rounds to nearest even (inf/NaN preserved, overflow -> inf), matching
 * torch's Tensor.to(). Any grid; FSC_CUDA_BLOCK threads per block. */
template <typename Dst, typename Src>
static __device__ __forceinline__ void fsc_cast_body(Dst *dst, const Src *src, long long n) {
    FSC_GRID_STRIDE_LOOP(i, n) {
        fsc_from_f32(&dst[i], fsc_to_f32(src[i]));
    }
}

extern "C" __global__ void fsc_cast_f32_to_f16(__half *dst, const float *src, long long n) {
    fsc_cast_body(dst, src, n);
}

extern "C" __global__ void fsc_cast_f32_to_bf16(__nv_bfloat16 *dst, const float *src, long long n) {
    fsc_cast_body(dst, src, n);
}

extern "C" __global__ void fsc_cast_f16_to_f32(float *dst, const __half *src, long long n) {
    fsc_cast_body(dst, src, n);
}

extern "C" __global__ void fsc_cast_bf16_to_f32(float *dst, const __nv_bfloat16 *src, long long n) {
    fsc_cast_body(dst, src, n);
}
