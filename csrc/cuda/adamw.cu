/* adamw.cu — fused AdamW step over flat float32 shards (param, grad, exp_avg, exp_avg_sq), the
 * optimizer step FSDP runs on each rank's shard: one read of four arrays and three writes
 * instead of torch's chain of ~8 elementwise kernels. */
#include "common.cuh"

/* For i in [0, n), in place:
 *   p  = p * decay
 *   m  = lerp(m, g, omb1)                 (torch's two-branch lerp formula)
 *   v  = v * beta2 + omb2 * g * g
 *   p  = p + neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * The scalars come from fsc_adamw_prepare (csrc/gpu/kernels_cpu.c). Every operation is an
 * explicitly rounded intrinsic so nvcc cannot contract pairs into FMAs: the result is then
 * bit-identical to the CPU reference, which rounds once per torch op. Any grid;
 * FSC_CUDA_BLOCK threads per block. */
extern "C" __global__ void fsc_adamw_f32(float *p, const float *g, float *m, float *v, long long n, float decay,
                                         float omb1, float beta2, float omb2, float bc2_sqrt, float neg_step_size,
                                         float eps) {
    const bool lerp_small = fabsf(omb1) < 0.5f;
    FSC_GRID_STRIDE_LOOP(i, n) {
        float gi = g[i];
        float mi = m[i];
        float pi = __fmul_rn(p[i], decay);
        mi = lerp_small ? __fadd_rn(mi, __fmul_rn(omb1, __fsub_rn(gi, mi)))
                        : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, mi), __fsub_rn(1.0f, omb1)));
        float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(omb2, gi), gi));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(neg_step_size, mi), denom));
        m[i] = mi;
        v[i] = vi;
    }
}
