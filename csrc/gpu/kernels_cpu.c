/* kernels_cpu.c — CPU reference kernels; each mirrors one kernel in csrc/cuda/. */
#include "gpu/kernels_cpu.h"

#include <math.h>

#include "base/half.h"

/* ---- element access through float32 ------------------------------------------------------ */

static float load_f32(const void *p, fsc_dtype_t dt, int64_t i) {
    switch (dt) {
        case FSC_FLOAT16: return fsc_half_to_float(((const uint16_t *)p)[i]);
        case FSC_BFLOAT16: return fsc_bf16_to_float(((const uint16_t *)p)[i]);
        default: return ((const float *)p)[i];
    }
}

static void store_f32(void *p, fsc_dtype_t dt, int64_t i, float v) {
    switch (dt) {
        case FSC_FLOAT16: ((uint16_t *)p)[i] = fsc_float_to_half(v); break;
        case FSC_BFLOAT16: ((uint16_t *)p)[i] = fsc_float_to_bf16(v); break;
        default: ((float *)p)[i] = v; break;
    }
}

/* ---- argument checks -------------------------------------------------------------------- */

fsc_status_t fsc_kernels_check(const fsc_tensor_t *t, const char *op, const char *arg, int device_type,
                               unsigned dtype_mask, int writable) {
    if (t->device_type != device_type)
        return fsc_error(FSC_ERR_VALUE, "%s: %s must be a %s tensor", op, arg,
                         device_type == FSC_DEV_CUDA ? "CUDA" : "CPU");
    if ((unsigned)t->dtype >= FSC_NUM_DTYPES || !(dtype_mask & FSC_DTYPE_BIT(t->dtype)))
        return fsc_error(FSC_ERR_TYPE, "%s: %s has unsupported dtype %s", op, arg,
                         (unsigned)t->dtype < FSC_NUM_DTYPES ? fsc_dtype_name(t->dtype) : "?");
    if (!fsc_tensor_is_contiguous(t)) return fsc_error(FSC_ERR_VALUE, "%s: %s must be contiguous", op, arg);
    if (writable && t->readonly) return fsc_error(FSC_ERR_VALUE, "%s: %s is read-only", op, arg);
    if (t->numel > 0 && t->data == NULL) return fsc_error(FSC_ERR_VALUE, "%s: %s has no data", op, arg);
    return FSC_OK;
}

/* ---- unscale + inf check ------------------------------------------------------------------ */

fsc_status_t fsc_cpu_unscale_inf_check(fsc_tensor_t *buf, float inv_scale, fsc_tensor_t *found_inf) {
    static const char *op = "unscale_inf_check";
    FSC_CHECK(fsc_kernels_check(buf, op, "buf", FSC_DEV_CPU, FSC_FLOAT_DTYPES, 1));
    FSC_CHECK(fsc_kernels_check(found_inf, op, "found_inf", FSC_DEV_CPU, FSC_DTYPE_BIT(FSC_FLOAT32), 1));
    if (found_inf->numel != 1)
        return fsc_error(FSC_ERR_VALUE, "%s: found_inf must have exactly 1 element, got %lld", op,
                         (long long)found_inf->numel);
    int any_bad = 0;
    for (int64_t i = 0; i < buf->numel; i++) {
        float v = load_f32(buf->data, buf->dtype, i);
        any_bad |= !isfinite(v);
        if (inv_scale != 1.0f) store_f32(buf->data, buf->dtype, i, v * inv_scale);
    }
    if (any_bad) *(float *)found_inf->data = 1.0f;
    return FSC_OK;
}

/* ---- norm ------------------------------------------------------------------------------- */

fsc_status_t fsc_cpu_norm(const fsc_tensor_t *x, fsc_norm_mode_t mode, float *out) {
    static const char *op = "norm";
    FSC_CHECK(fsc_kernels_check(x, op, "x", FSC_DEV_CPU, FSC_FLOAT_DTYPES, 0));
    if (mode != FSC_NORM_SUMSQ && mode != FSC_NORM_ABSMAX)
        return fsc_error(FSC_ERR_VALUE, "%s: mode must be FSC_NORM_SUMSQ or FSC_NORM_ABSMAX, got %d", op, (int)mode);
    double acc = 0.0;
    for (int64_t i = 0; i < x->numel; i++) {
        double v = load_f32(x->data, x->dtype, i);
        if (mode == FSC_NORM_SUMSQ) {
            acc += v * v;
        } else {
            double a = fabs(v);
            if (a > acc || isnan(a)) acc = a;
            if (isnan(acc)) break; /* NaN wins; nothing can change it */
        }
    }
    *out = (float)acc;
    return FSC_OK;
}

/* ---- AdamW ------------------------------------------------------------------------------ */

fsc_status_t fsc_adamw_prepare(const fsc_adamw_hparams_t *hp, fsc_adamw_scalars_t *out) {
    static const char *op = "adamw_step";
    if (!(hp->lr >= 0.0)) return fsc_error(FSC_ERR_VALUE, "%s: lr must be >= 0, got %g", op, hp->lr);
    if (!(hp->beta1 >= 0.0 && hp->beta1 < 1.0))
        return fsc_error(FSC_ERR_VALUE, "%s: beta1 must be in [0, 1), got %g", op, hp->beta1);
    if (!(hp->beta2 >= 0.0 && hp->beta2 < 1.0))
        return fsc_error(FSC_ERR_VALUE, "%s: beta2 must be in [0, 1), got %g", op, hp->beta2);
    if (!(hp->eps >= 0.0)) return fsc_error(FSC_ERR_VALUE, "%s: eps must be >= 0, got %g", op, hp->eps);
    if (!(hp->weight_decay >= 0.0))
        return fsc_error(FSC_ERR_VALUE, "%s: weight_decay must be >= 0, got %g", op, hp->weight_decay);
    if (hp->step < 1) return fsc_error(FSC_ERR_VALUE, "%s: step must be >= 1, got %lld", op, (long long)hp->step);
    /* torch computes these in Python floats (double) and each tensor op rounds its scalar
     * to float32; do the same so the reference matches operation by operation. */
    double bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
    double bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
    out->decay = (float)(1.0 - hp->lr * hp->weight_decay);
    out->one_minus_b1 = (float)(1.0 - hp->beta1);
    out->beta2 = (float)hp->beta2;
    out->one_minus_b2 = (float)(1.0 - hp->beta2);
    out->bc2_sqrt = (float)sqrt(bc2);
    out->neg_step_size = (float)(-(hp->lr / bc1));
    out->eps = (float)hp->eps;
    return FSC_OK;
}

static fsc_status_t check_shard(const fsc_tensor_t *t, const char *arg, int writable, int64_t numel) {
    FSC_CHECK(fsc_kernels_check(t, "adamw_step", arg, FSC_DEV_CPU, FSC_DTYPE_BIT(FSC_FLOAT32), writable));
    if (t->numel != numel)
        return fsc_error(FSC_ERR_VALUE, "adamw_step: %s has %lld elements, param has %lld", arg, (long long)t->numel,
                         (long long)numel);
    return FSC_OK;
}

fsc_status_t fsc_cpu_adamw_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                fsc_tensor_t *exp_avg_sq, const fsc_adamw_hparams_t *hp) {
    fsc_adamw_scalars_t s;
    int64_t n = param->numel;
    FSC_CHECK(check_shard(param, "param", 1, n));
    FSC_CHECK(check_shard(grad, "grad", 0, n));
    FSC_CHECK(check_shard(exp_avg, "exp_avg", 1, n));
    FSC_CHECK(check_shard(exp_avg_sq, "exp_avg_sq", 1, n));
    FSC_CHECK(fsc_adamw_prepare(hp, &s));

    float *p = param->data, *m = exp_avg->data, *v = exp_avg_sq->data;
    const float *g = grad->data;
    int lerp_small = fabsf(s.one_minus_b1) < 0.5f;
    for (int64_t i = 0; i < n; i++) {
        /* One float32 rounding per torch op, in torch's order:
         * param.mul_(decay); exp_avg.lerp_(grad, 1-b1); exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2);
         * denom = sqrt(exp_avg_sq) / bc2_sqrt + eps; param.addcdiv_(exp_avg, denom, -step_size). */
        float pi = p[i] * s.decay;
        float gi = g[i];
        float mi = lerp_small ? m[i] + s.one_minus_b1 * (gi - m[i]) : gi - (gi - m[i]) * (1.0f - s.one_minus_b1);
        float vi = v[i] * s.beta2;
        vi = vi + s.one_minus_b2 * gi * gi;
        float denom = sqrtf(vi) / s.bc2_sqrt + s.eps;
        p[i] = pi + s.neg_step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
    return FSC_OK;
}
