/* amp.cu — the grad scaler's fused unscale + overflow check: one pass over a flat gradient
 * buffer instead of torch's separate isfinite / any / mul chain. */
#include "common.cuh"

/* In place over buf[0, n): x = x * inv_scale (skipped when inv_scale == 1, so an unscaled
 * pass is a pure check); if any x was non-finite before scaling, *found_inf = 1.0f.
 * found_inf (one float32 on the same device) is only ever set, never cleared, so one flag can
 * collect many buffers; racing threads all store the same value. Any grid;
 * FSC_CUDA_BLOCK threads per block. */
template <typename T>
static __device__ __forceinline__ void fsc_unscale_body(T *buf, long long n, float inv_scale, float *found_inf) {
    bool bad = false;
    FSC_GRID_STRIDE_LOOP(i, n) {
        float v = fsc_to_f32(buf[i]);
        bad |= !isfinite(v);
        if (inv_scale != 1.0f) fsc_from_f32(&buf[i], v * inv_scale);
    }
    if (bad) *found_inf = 1.0f;
}

extern "C" __global__ void fsc_unscale_inf_check_f32(float *buf, long long n, float inv_scale, float *found_inf) {
    fsc_unscale_body(buf, n, inv_scale, found_inf);
}

extern "C" __global__ void fsc_unscale_inf_check_f16(__half *buf, long long n, float inv_scale, float *found_inf) {
    fsc_unscale_body(buf, n, inv_scale, found_inf);
}

extern "C" __global__ void fsc_unscale_inf_check_bf16(__nv_bfloat16 *buf, long long n, float inv_scale,
                                                      float *found_inf) {
    fsc_unscale_body(buf, n, inv_scale, found_inf);
}
