/* kernels_cpu.h — CPU reference kernels (unscale + inf check, norm partials, AdamW) that the CPU
 * path runs and the CUDA kernels in csrc/cuda are tested against. */
#ifndef FSC_KERNELS_CPU_H
#define FSC_KERNELS_CPU_H

#include <stdint.h>

#include "base/status.h"
#include "base/tensor.h"

/* Hyper-parameters of one AdamW step, as torch.optim.AdamW takes them (amsgrad=False,
 * maximize=False). `step` is the 1-based step count after incrementing, like the `step`
 * entry in torch's optimizer state. */
typedef struct {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    int64_t step;
} fsc_adamw_hparams_t;

/* The per-step scalars of AdamW, rounded to float32 exactly as torch's single-tensor path
 * rounds its Python-float scalars when it hands them to float32 tensor ops. Computed once on
 * the host and shared by the CPU reference and the CUDA kernel so both use identical
 * constants. */
typedef struct {
    float decay;        /* 1 - lr * weight_decay */
    float one_minus_b1; /* lerp weight for exp_avg */
    float beta2;
    float one_minus_b2;
    float bc2_sqrt;      /* sqrt(1 - beta2^step) */
    float neg_step_size; /* -lr / (1 - beta1^step) */
    float eps;
} fsc_adamw_scalars_t;

/* Bit for `dtype` in the dtype masks below. */
#define FSC_DTYPE_BIT(dt) (1u << (unsigned)(dt))
#define FSC_FLOAT_DTYPES (FSC_DTYPE_BIT(FSC_FLOAT32) | FSC_DTYPE_BIT(FSC_FLOAT16) | FSC_DTYPE_BIT(FSC_BFLOAT16))

/* The precondition check every kernel entry point (CPU and CUDA) runs on each tensor argument:
 * `t` must be on `device_type` (fsc_device_type_t), C-contiguous, of a dtype in `dtype_mask`,
 * and writable when `writable` is set. On failure returns FSC_ERR_VALUE (FSC_ERR_TYPE for the
 * dtype) with a message "<op>: <arg> ..." saying what was expected. */
fsc_status_t fsc_kernels_check(const fsc_tensor_t *t, const char *op, const char *arg, int device_type,
                               unsigned dtype_mask, int writable);

/* Check the hyper-parameters (lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0, step >= 1;
 * FSC_ERR_VALUE naming the field otherwise) and fill *out. Pure; does not block. */
fsc_status_t fsc_adamw_prepare(const fsc_adamw_hparams_t *hp, fsc_adamw_scalars_t *out);

/* The combining rule of a norm reduction. */
typedef enum {
    FSC_NORM_SUMSQ = 0, /* sum of x^2: the square of the 2-norm */
    FSC_NORM_ABSMAX = 1 /* max |x|: the inf-norm; NaN propagates */
} fsc_norm_mode_t;

/* Grad-scaler unscale with overflow detection, in place over a contiguous CPU buffer `buf`
 * (float32, float16 or bfloat16, any shape, numel >= 0): every element x becomes x * inv_scale
 * (computed in float32, rounded back to buf's dtype; skipped when inv_scale == 1), and if any
 * element was non-finite *before* scaling, found_inf (a one-element float32 CPU tensor) is set
 * to 1.0. found_inf is never cleared, so one flag can collect several buffers, like
 * torch._amp_foreach_non_finite_check_and_unscale_. Blocks the calling thread. */
fsc_status_t fsc_cpu_unscale_inf_check(fsc_tensor_t *buf, float inv_scale, fsc_tensor_t *found_inf);

/* Norm reduction of a contiguous CPU tensor `x` (float32, float16 or bfloat16, any shape)
 * into *out: sum of squares or max |x| depending on `mode`. Accumulates in double (this is the
 * reference the float32-accumulating CUDA kernel is compared with). numel == 0 gives 0.
 * NaN/inf in x propagate to *out as torch.linalg.vector_norm does. Blocks the calling thread. */
fsc_status_t fsc_cpu_norm(const fsc_tensor_t *x, fsc_norm_mode_t mode, float *out);

/* One AdamW step over flat float32 CPU shards of equal numel, all contiguous, updated in
 * place: param, exp_avg, exp_avg_sq written; grad read. Matches torch.optim.AdamW's
 * single-tensor math (decoupled weight decay, bias correction from hp->step) operation by
 * operation in float32. Blocks the calling thread. */
fsc_status_t fsc_cpu_adamw_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                fsc_tensor_t *exp_avg_sq, const fsc_adamw_hparams_t *hp);

/* One step of FairScale's fused Adam (fairscale.optim.Adam, the fairseq/apex kernel), whose
 * arithmetic differs from torch's Adam: eps is added to sqrt(v) (or, with eps_inside_sqrt, to v
 * under the root) without bias correction, the bias corrections fold into one step size, and
 * the weight decay joins the update:
 *   g' = g / grad_scale
 *   m' = b1 * m + (1 - b1) * g'            v' = b2 * v + (1 - b2) * g' * g'
 *   p' = p - step_size * (m' / (sqrt(v') + eps) + decay * p)
 * with step_size = lr * sqrt(1 - b2^step) / (1 - b1^step) (lr without bias correction). When the
 * state is float16 it holds m' and v' times optim_scale (read back divided by it), and a stored
 * value that is not finite sets *found_inf. Each operation rounds to float32 in that order, so
 * the CUDA kernel (csrc/cuda/fs_adam.cu) gives the same bits. */
typedef struct {
    float beta1, beta2;
    float one_minus_b1, one_minus_b2;
    float eps;
    float grad_scale;
    float optim_scale; /* used when the state is float16 */
    float step_size;
    float decay;
    int eps_inside_sqrt;
} fsc_fs_adam_scalars_t;

/* Check the hyper-parameters (lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0, step >= 1,
 * grad_scale and optim_scale finite and > 0; FSC_ERR_VALUE naming the field otherwise) and fill
 * *out: step_size as FairScale's launcher computes it (float32 bias corrections from
 * std::pow(float, int)). */
fsc_status_t fsc_fs_adam_prepare(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                                 int bias_correction, int eps_inside_sqrt, double grad_scale, double optim_scale,
                                 fsc_fs_adam_scalars_t *out);

/* The tensors of one step, on either device: param float32/float16/bfloat16; grad
 * float32/float16/bfloat16; exp_avg and exp_avg_sq one dtype, float32 or float16; param_copy
 * (NULL for none) float16/bfloat16, written with the updated param (MIXED_PRECISION's model
 * weights); every numel equal. `op` names the caller in messages. */
fsc_status_t fsc_fs_adam_check(const fsc_tensor_t *param, const fsc_tensor_t *grad, const fsc_tensor_t *exp_avg,
                               const fsc_tensor_t *exp_avg_sq, const fsc_tensor_t *param_copy, int device_type,
                               const char *op);

/* fairscale.optim.Adam's step on contiguous CPU tensors, in place (see above); found_inf is a
 * one-element float32 CPU tensor, set to 1 when float16 state overflowed, never cleared. Blocks
 * the calling thread. */
fsc_status_t fsc_cpu_fs_adam_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                  fsc_tensor_t *exp_avg_sq, fsc_tensor_t *param_copy, const fsc_fs_adam_scalars_t *s,
                                  fsc_tensor_t *found_inf);

/* fsc_cpu_fs_adam_step over n parameters: t holds five tensors per parameter (param, grad,
 * exp_avg, exp_avg_sq, param_copy or NULL), sc the scalars of each (their step counts may
 * differ). Every parameter is checked before any is stepped. Large steps are split over up to
 * `threads` threads (the calling one included), in pieces of whole blocks, with the same bits. */
fsc_status_t fsc_cpu_fs_adam_multi(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                   fsc_tensor_t *found_inf, int threads);

/* SyncBatchNorm's statistics combination. `gathered` holds `world` rows of 2C + 1 values, each
 * rank's [mean (C) | biased variance (C) | row count]; `out` (3C + 1 values) receives [mean |
 * biased variance | 1 / sqrt(variance + eps) | total count] over every rank, combined without
 * E[x^2] - E[x]^2 cancellation: var = sum_r n_r (var_r + (mean_r - mean)^2) / total. Both
 * contiguous CPU tensors of one dtype, float32 or float64; computed in double. A total of 0 gives
 * NaN statistics. */
fsc_status_t fsc_cpu_bn_combine(const fsc_tensor_t *gathered, int world, double eps, fsc_tensor_t *out);

/* SyncBatchNorm's input-gradient coefficients, dx = a * dy + b * (x - mean) + c per channel:
 * from `sums` = [sum dy | sum dy * xhat] over every rank (2C), the total count, `invstd` (C) and
 * `weight` (C, or NULL for none): a = invstd * weight, b = -a * invstd * mean(dy * xhat),
 * c = -a * mean(dy), written to `out` as [a | b | c] (3C). Contiguous CPU tensors of one dtype,
 * float32 or float64 (weight: any float dtype); computed in double. */
fsc_status_t fsc_cpu_bn_coeffs(const fsc_tensor_t *sums, double total, const fsc_tensor_t *invstd,
                               const fsc_tensor_t *weight, fsc_tensor_t *out);

#endif /* FSC_KERNELS_CPU_H */
