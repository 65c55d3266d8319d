/* fs_adam.cu — one step of FairScale's fused Adam (fairscale.optim.Adam) over one parameter:
 * param, grad, exp_avg, exp_avg_sq and an optional half-precision copy of the param, each of
 * the dtypes fsc_fs_adam_check (csrc/gpu/kernels_cpu.c) allows. The math and its order are those
 * of fsc_cpu_fs_adam_step; every operation is an explicitly rounded intrinsic so nvcc cannot
 * contract pairs into FMAs, and the result is bit-identical to the CPU kernel. */
#include "../gpu/fs_adam_table.h"
#include "common.cuh"

/* Dtype codes of this kernel's arguments (the launcher in csrc/gpu/launchers.c maps to them). */
#define FSC_FS_ADAM_F32 0
#define FSC_FS_ADAM_F16 1
#define FSC_FS_ADAM_BF16 2

static __device__ __forceinline__ float fs_load(const void *p, int dt, long long i) {
    if (dt == FSC_FS_ADAM_F16) return fsc_to_f32(((const __half *)p)[i]);
    if (dt == FSC_FS_ADAM_BF16) return fsc_to_f32(((const __nv_bfloat16 *)p)[i]);
    return ((const float *)p)[i];
}

static __device__ __forceinline__ void fs_store(void *p, int dt, long long i, float v) {
    if (dt == FSC_FS_ADAM_F16)
        fsc_from_f32(&((__half *)p)[i], v);
    else if (dt == FSC_FS_ADAM_BF16)
        fsc_from_f32(&((__nv_bfloat16 *)p)[i], v);
    else
        ((float *)p)[i] = v;
}

/* Element i of one parameter: the update of fsc_cpu_fs_adam_step. copy may be NULL (cdt ignored
 * then). Float16 state (sdt) holds the moments times optim_scale; a stored moment that is not
 * finite sets *found_inf to 1. */
static __device__ __forceinline__ void fs_adam_elem(void *param, int pdt, const void *grad, int gdt, void *exp_avg,
                                                    void *exp_avg_sq, int sdt, void *copy, int cdt, long long i,
                                                    float beta1, float beta2, float omb1, float omb2, float eps,
                                                    float grad_scale, float optim_scale, float step_size, float decay,
                                                    int eps_inside_sqrt, float *found_inf) {
    const bool scaled = sdt == FSC_FS_ADAM_F16;
    float p = fs_load(param, pdt, i);
    float g = __fdiv_rn(fs_load(grad, gdt, i), grad_scale);
    float m = fs_load(exp_avg, sdt, i), v = fs_load(exp_avg_sq, sdt, i);
    if (scaled) {
        m = __fdiv_rn(m, optim_scale);
        v = __fdiv_rn(v, optim_scale);
    }
    float mom = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
    float vel = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(omb2, g), g));
    if (scaled) {
        fs_store(exp_avg, sdt, i, __fmul_rn(mom, optim_scale));
        fs_store(exp_avg_sq, sdt, i, __fmul_rn(vel, optim_scale));
        if (!isfinite(fs_load(exp_avg, sdt, i)) || !isfinite(fs_load(exp_avg_sq, sdt, i))) *found_inf = 1.0f;
    } else {
        fs_store(exp_avg, sdt, i, mom);
        fs_store(exp_avg_sq, sdt, i, vel);
    }
    float denom = eps_inside_sqrt ? __fsqrt_rn(__fadd_rn(vel, eps)) : __fadd_rn(__fsqrt_rn(vel), eps);
    float update = __fadd_rn(__fdiv_rn(mom, denom), __fmul_rn(decay, p));
    p = __fsub_rn(p, __fmul_rn(step_size, update));
    fs_store(param, pdt, i, p);
    if (copy) fs_store(copy, cdt, i, p);
}

/* One parameter. Any grid; FSC_CUDA_BLOCK threads. */
extern "C" __global__ void fsc_fs_adam(void *param, int pdt, const void *grad, int gdt, void *exp_avg, void *exp_avg_sq,
                                       int sdt, void *copy, int cdt, long long n, float beta1, float beta2, float omb1,
                                       float omb2, float eps, float grad_scale, float optim_scale, float step_size,
                                       float decay, int eps_inside_sqrt, float *found_inf) {
    FSC_GRID_STRIDE_LOOP(i, n) {
        fs_adam_elem(param, pdt, grad, gdt, exp_avg, exp_avg_sq, sdt, copy, cdt, i, beta1, beta2, omb1, omb2, eps,
                     grad_scale, optim_scale, step_size, decay, eps_inside_sqrt, found_inf);
    }
}

/* The parameters of a table (one dtype combination, each with its own step size): block b steps
 * chunk b - first_block[t] of the parameter t it falls in. Grid: first_block[count] blocks of
 * FSC_CUDA_BLOCK threads. */
extern "C" __global__ void fsc_fs_adam_multi(fsc_fs_adam_table_t tab, int pdt, int gdt, int sdt, int cdt, float beta1,
                                             float beta2, float omb1, float omb2, float eps, float grad_scale,
                                             float optim_scale, float decay, int eps_inside_sqrt, float *found_inf) {
    const int b = (int)blockIdx.x;
    int t = 0;
    while (t + 1 < tab.count && b >= tab.first_block[t + 1]) t++;
    const long long lo = (long long)(b - tab.first_block[t]) * FSC_FS_ADAM_CHUNK;
    const long long hi = lo + FSC_FS_ADAM_CHUNK < tab.numel[t] ? lo + FSC_FS_ADAM_CHUNK : tab.numel[t];
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x)
        fs_adam_elem(tab.param[t], pdt, tab.grad[t], gdt, tab.exp_avg[t], tab.exp_avg_sq[t], sdt, tab.copy[t], cdt, i,
                     beta1, beta2, omb1, omb2, eps, grad_scale, optim_scale, tab.step_size[t], decay, eps_inside_sqrt,
                     found_inf);
}
