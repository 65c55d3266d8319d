/* kernels_cpu.c — CPU reference kernels; each mirrors one kernel in csrc/cuda/. */
#include "gpu/kernels_cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "base/half.h"
#include "base/simd.h"

/* ---- element access through float32 ------------------------------------------------------ */

/* Elements per block of the blocked kernels below: their float32 temporaries stay in L1. */
#define FS_BLOCK 512
#define FS_MAX_THREADS 64           /* the multi-parameter Adam step's threads, at most */
#define FS_MIN_PER_THREAD (1 << 17) /* elements a thread must have to be worth starting */

/* Blocks of any float dtype to and from float32 temporaries (vectorised per dtype). */
FSC_VECTOR_CLONES static void fs_load_block(float *restrict out, const void *src, fsc_dtype_t dt, int64_t off, int n) {
    if (dt == FSC_FLOAT16) {
        const uint16_t *restrict h = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) out[i] = fsc_half_to_float(h[i]);
    } else if (dt == FSC_BFLOAT16) {
        const uint16_t *restrict h = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) out[i] = fsc_bf16_to_float(h[i]);
    } else {
        const float *restrict f = (const float *)src + off;
        for (int i = 0; i < n; i++) out[i] = f[i];
    }
}

FSC_VECTOR_CLONES static void fs_store_block(void *dst, fsc_dtype_t dt, int64_t off, const float *restrict in, int n) {
    if (dt == FSC_FLOAT16) {
        uint16_t *restrict h = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) h[i] = fsc_float_to_half(in[i]);
    } else if (dt == FSC_BFLOAT16) {
        uint16_t *restrict h = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) h[i] = fsc_float_to_bf16(in[i]);
    } else {
        float *restrict f = (float *)dst + off;
        for (int i = 0; i < n; i++) f[i] = in[i];
    }
}

/* Whether any of the n values is inf or NaN. */
FSC_VECTOR_CLONES static int fs_nonfinite_block(const float *restrict x, int n) {
    int bad = 0;
    for (int i = 0; i < n; i++) bad |= (fsc_f32_bits(x[i]) & 0x7f800000u) == 0x7f800000u;
    return bad;
}

FSC_VECTOR_CLONES static void fs_mul_block(float *restrict x, int n, float by) {
    for (int i = 0; i < n; i++) x[i] = x[i] * by;
}

/* Sum of squares in double, over 8 lanes (element i goes to lane i % 8), then the lanes in order:
 * a fixed order, so the result does not depend on the vector width. */
FSC_VECTOR_CLONES static double fs_sumsq_block(const float *restrict x, int n) {
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += (double)x[i + k] * (double)x[i + k];
    for (; i < n; i++) lane[i % 8] += (double)x[i] * (double)x[i];
    double acc = 0.0;
    for (int k = 0; k < 8; k++) acc += lane[k];
    return acc;
}

/* max |x| over the n values; NaN if any is NaN. */
FSC_VECTOR_CLONES static double fs_absmax_block(const float *restrict x, int n) {
    float m = 0.0f;
    int nan = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        m = a > m ? a : m;
    }
    return nan ? (double)NAN : (double)m;
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
    float tmp[FS_BLOCK];
    for (int64_t off = 0; off < buf->numel; off += FS_BLOCK) {
        int n = buf->numel - off < FS_BLOCK ? (int)(buf->numel - off) : FS_BLOCK;
        float *x = buf->dtype == FSC_FLOAT32 ? (float *)buf->data + off : tmp; /* float32: in place */
        if (x == tmp) fs_load_block(tmp, buf->data, buf->dtype, off, n);
        any_bad |= fs_nonfinite_block(x, n);
        if (inv_scale != 1.0f) {
            fs_mul_block(x, n, inv_scale);
            if (x == tmp) fs_store_block(buf->data, buf->dtype, off, tmp, n);
        }
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
    float tmp[FS_BLOCK];
    for (int64_t off = 0; off < x->numel; off += FS_BLOCK) {
        int n = x->numel - off < FS_BLOCK ? (int)(x->numel - off) : FS_BLOCK;
        const float *v = x->dtype == FSC_FLOAT32 ? (const float *)x->data + off : tmp;
        if (v == tmp) fs_load_block(tmp, x->data, x->dtype, off, n);
        if (mode == FSC_NORM_SUMSQ) {
            acc += fs_sumsq_block(v, n);
        } else {
            double a = fs_absmax_block(v, n);
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

/* ---- FairScale's fused Adam ------------------------------------------------------------- */

fsc_status_t fsc_fs_adam_prepare(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                                 int bias_correction, int eps_inside_sqrt, double grad_scale, double optim_scale,
                                 fsc_fs_adam_scalars_t *out) {
    static const char *op = "fs_adam_step";
    if (!(lr >= 0.0)) return fsc_error(FSC_ERR_VALUE, "%s: lr must be >= 0, got %g", op, lr);
    if (!(beta1 >= 0.0 && beta1 < 1.0))
        return fsc_error(FSC_ERR_VALUE, "%s: beta1 must be in [0, 1), got %g", op, beta1);
    if (!(beta2 >= 0.0 && beta2 < 1.0))
        return fsc_error(FSC_ERR_VALUE, "%s: beta2 must be in [0, 1), got %g", op, beta2);
    if (!(eps >= 0.0)) return fsc_error(FSC_ERR_VALUE, "%s: eps must be >= 0, got %g", op, eps);
    if (!(weight_decay >= 0.0))
        return fsc_error(FSC_ERR_VALUE, "%s: weight_decay must be >= 0, got %g", op, weight_decay);
    if (step < 1) return fsc_error(FSC_ERR_VALUE, "%s: step must be >= 1, got %lld", op, (long long)step);
    if (!(isfinite(grad_scale) && grad_scale > 0.0))
        return fsc_error(FSC_ERR_VALUE, "%s: grad_scale must be finite and > 0, got %g", op, grad_scale);
    if (!(isfinite(optim_scale) && optim_scale > 0.0))
        return fsc_error(FSC_ERR_VALUE, "%s: optim_scale must be finite and > 0, got %g", op, optim_scale);
    float b1 = (float)beta1, b2 = (float)beta2, lr_f = (float)lr;
    out->beta1 = b1;
    out->beta2 = b2;
    out->one_minus_b1 = 1.0f - b1;
    out->one_minus_b2 = 1.0f - b2;
    out->eps = (float)eps;
    out->grad_scale = (float)grad_scale;
    out->optim_scale = (float)optim_scale;
    out->decay = (float)weight_decay;
    out->eps_inside_sqrt = eps_inside_sqrt != 0;
    if (bias_correction) {
        /* FairScale's launcher: const float bc = 1 - std::pow(beta, step), whose pow of a float
         * and an int is computed in double */
        float bc1 = (float)(1.0 - pow((double)b1, (double)step));
        float bc2 = (float)(1.0 - pow((double)b2, (double)step));
        out->step_size = lr_f * sqrtf(bc2) / bc1;
    } else {
        out->step_size = lr_f;
    }
    return FSC_OK;
}

fsc_status_t fsc_fs_adam_check(const fsc_tensor_t *param, const fsc_tensor_t *grad, const fsc_tensor_t *exp_avg,
                               const fsc_tensor_t *exp_avg_sq, const fsc_tensor_t *param_copy, int device_type,
                               const char *op) {
    const unsigned state_mask = FSC_DTYPE_BIT(FSC_FLOAT32) | FSC_DTYPE_BIT(FSC_FLOAT16);
    const unsigned half_mask = FSC_DTYPE_BIT(FSC_FLOAT16) | FSC_DTYPE_BIT(FSC_BFLOAT16);
    FSC_CHECK(fsc_kernels_check(param, op, "param", device_type, FSC_FLOAT_DTYPES, 1));
    FSC_CHECK(fsc_kernels_check(grad, op, "grad", device_type, FSC_FLOAT_DTYPES, 0));
    FSC_CHECK(fsc_kernels_check(exp_avg, op, "exp_avg", device_type, state_mask, 1));
    FSC_CHECK(fsc_kernels_check(exp_avg_sq, op, "exp_avg_sq", device_type, state_mask, 1));
    if (param_copy) FSC_CHECK(fsc_kernels_check(param_copy, op, "param_copy", device_type, half_mask, 1));
    if (exp_avg_sq->dtype != exp_avg->dtype)
        return fsc_error(FSC_ERR_TYPE, "%s: exp_avg is %s and exp_avg_sq %s; expected one dtype", op,
                         fsc_dtype_name(exp_avg->dtype), fsc_dtype_name(exp_avg_sq->dtype));
    const fsc_tensor_t *ts[4] = {grad, exp_avg, exp_avg_sq, param_copy};
    static const char *names[4] = {"grad", "exp_avg", "exp_avg_sq", "param_copy"};
    for (int i = 0; i < 4; i++)
        if (ts[i] && ts[i]->numel != param->numel)
            return fsc_error(FSC_ERR_VALUE, "%s: %s has %lld elements, param has %lld", op, names[i],
                             (long long)ts[i]->numel, (long long)param->numel);
    return FSC_OK;
}

/* The step runs in blocks: each block's values are converted to float32 temporaries (float32
 * tensors are stepped in place), updated by plain loops over restrict pointers and converted back.
 * Vector add, multiply, divide and square root round like the scalar ones, so every clone gives
 * the same bits.
 * p, m, v in: the param and the stored moments (already divided by the state scale); out: the
 * new param, and the new moments (mom, vel) in m and v. g: the gradient. */
FSC_VECTOR_CLONES static void fs_adam_block(float *restrict p, const float *restrict g, float *restrict m,
                                            float *restrict v, int n, const fsc_fs_adam_scalars_t *sc) {
    const float b1 = sc->beta1, b2 = sc->beta2, omb1 = sc->one_minus_b1, omb2 = sc->one_minus_b2;
    const float eps = sc->eps, gs = sc->grad_scale, ss = sc->step_size, decay = sc->decay;
    if (sc->eps_inside_sqrt) {
        for (int i = 0; i < n; i++) {
            float gi = g[i] / gs;
            float mom = b1 * m[i] + omb1 * gi;
            float vel = b2 * v[i] + omb2 * gi * gi;
            float update = mom / __builtin_sqrtf(vel + eps) + decay * p[i];
            p[i] = p[i] - ss * update;
            m[i] = mom;
            v[i] = vel;
        }
    } else {
        for (int i = 0; i < n; i++) {
            float gi = g[i] / gs;
            float mom = b1 * m[i] + omb1 * gi;
            float vel = b2 * v[i] + omb2 * gi * gi;
            float update = mom / (__builtin_sqrtf(vel) + eps) + decay * p[i];
            p[i] = p[i] - ss * update;
            m[i] = mom;
            v[i] = vel;
        }
    }
}

FSC_VECTOR_CLONES static void fs_div_block(float *restrict x, int n, float by) {
    for (int i = 0; i < n; i++) x[i] = x[i] / by;
}

static fsc_status_t fs_adam_check_cpu(fsc_tensor_t *const *t, const char *op) {
    FSC_CHECK(fsc_fs_adam_check(t[0], t[1], t[2], t[3], t[4], FSC_DEV_CPU, op));
    return FSC_OK;
}

/* Elements [lo, hi) of one parameter (lo a multiple of FS_BLOCK); t = param, grad, exp_avg,
 * exp_avg_sq, param_copy (or NULL). Returns whether a stored float16 moment is not finite. */
static int fs_adam_range(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *s, int64_t lo, int64_t hi) {
    fsc_tensor_t *param = t[0], *exp_avg = t[2], *exp_avg_sq = t[3], *param_copy = t[4];
    const fsc_tensor_t *grad = t[1];
    const int scaled = exp_avg->dtype == FSC_FLOAT16;
    const fsc_dtype_t sdt = exp_avg->dtype;
    if (param->dtype == FSC_FLOAT32 && grad->dtype == FSC_FLOAT32 && sdt == FSC_FLOAT32 && !param_copy) {
        /* all float32: in place, no temporaries (the tensors do not overlap: each is its own) */
        float *pp = param->data, *mp = exp_avg->data, *vp = exp_avg_sq->data;
        const float *gp = grad->data;
        for (int64_t off = lo; off < hi; off += FS_BLOCK) {
            int n = hi - off < FS_BLOCK ? (int)(hi - off) : FS_BLOCK;
            fs_adam_block(pp + off, gp + off, mp + off, vp + off, n, s);
        }
        return 0;
    }
    float p[FS_BLOCK], g[FS_BLOCK], m[FS_BLOCK], v[FS_BLOCK];
    int any_bad = 0;
    for (int64_t off = lo; off < hi; off += FS_BLOCK) {
        int n = hi - off < FS_BLOCK ? (int)(hi - off) : FS_BLOCK;
        fs_load_block(p, param->data, param->dtype, off, n);
        fs_load_block(g, grad->data, grad->dtype, off, n);
        fs_load_block(m, exp_avg->data, sdt, off, n);
        fs_load_block(v, exp_avg_sq->data, sdt, off, n);
        if (scaled) {
            fs_div_block(m, n, s->optim_scale);
            fs_div_block(v, n, s->optim_scale);
        }
        fs_adam_block(p, g, m, v, n, s);
        if (scaled) {
            fs_mul_block(m, n, s->optim_scale);
            fs_mul_block(v, n, s->optim_scale);
        }
        fs_store_block(exp_avg->data, sdt, off, m, n);
        fs_store_block(exp_avg_sq->data, sdt, off, v, n);
        if (scaled) /* the stored float16 moments: any that is not finite overflowed */
            for (int i = 0; i < n; i++) {
                uint16_t hm = ((const uint16_t *)exp_avg->data)[off + i],
                         hv = ((const uint16_t *)exp_avg_sq->data)[off + i];
                any_bad |= (hm & 0x7c00u) == 0x7c00u || (hv & 0x7c00u) == 0x7c00u;
            }
        fs_store_block(param->data, param->dtype, off, p, n);
        if (param_copy) fs_store_block(param_copy->data, param_copy->dtype, off, p, n);
    }
    return any_bad;
}

static fsc_status_t check_found_inf(const fsc_tensor_t *found_inf, const char *op) {
    FSC_CHECK(fsc_kernels_check(found_inf, op, "found_inf", FSC_DEV_CPU, FSC_DTYPE_BIT(FSC_FLOAT32), 1));
    if (found_inf->numel != 1)
        return fsc_error(FSC_ERR_VALUE, "%s: found_inf must have exactly 1 element, got %lld", op,
                         (long long)found_inf->numel);
    return FSC_OK;
}

fsc_status_t fsc_cpu_fs_adam_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                  fsc_tensor_t *exp_avg_sq, fsc_tensor_t *param_copy, const fsc_fs_adam_scalars_t *s,
                                  fsc_tensor_t *found_inf) {
    static const char *op = "cpu_fs_adam_step";
    fsc_tensor_t *const t[5] = {param, (fsc_tensor_t *)grad, exp_avg, exp_avg_sq, param_copy};
    FSC_CHECK(fs_adam_check_cpu(t, op));
    FSC_CHECK(check_found_inf(found_inf, op));
    if (fs_adam_range(t, s, 0, param->numel)) *(float *)found_inf->data = 1.0f;
    return FSC_OK;
}

/* The multi-parameter step's work, shared by its threads: pieces of parameters, taken in order. */
typedef struct {
    fsc_tensor_t *const *t;
    const fsc_fs_adam_scalars_t *sc;
    const int64_t (*pieces)[3]; /* parameter, first element, end */
    int64_t npieces;
    _Atomic int64_t next;
    _Atomic int any_bad;
} fs_adam_work_t;

static void *fs_adam_worker(void *arg) {
    fs_adam_work_t *w = arg;
    int bad = 0;
    for (int64_t k; (k = atomic_fetch_add(&w->next, 1)) < w->npieces;) {
        int64_t i = w->pieces[k][0];
        bad |= fs_adam_range(&w->t[i * 5], &w->sc[i], w->pieces[k][1], w->pieces[k][2]);
    }
    if (bad) atomic_store(&w->any_bad, 1);
    return NULL;
}

fsc_status_t fsc_cpu_fs_adam_multi(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                   fsc_tensor_t *found_inf, int threads) {
    static const char *op = "cpu_fs_adam_multi";
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        FSC_CHECK(fs_adam_check_cpu(&t[i * 5], op));
        total += t[i * 5]->numel;
    }
    FSC_CHECK(check_found_inf(found_inf, op));
    if (threads < 1) return fsc_error(FSC_ERR_VALUE, "%s: threads must be >= 1, got %d", op, threads);
    if (threads > FS_MAX_THREADS) threads = FS_MAX_THREADS;
    if (total < (int64_t)threads * FS_MIN_PER_THREAD) threads = (int)(total / FS_MIN_PER_THREAD);
    int any_bad = 0;
    if (threads <= 1) {
        for (int64_t i = 0; i < n; i++) any_bad |= fs_adam_range(&t[i * 5], &sc[i], 0, t[i * 5]->numel);
    } else {
        /* pieces of about a quarter of a thread's share, whole blocks, so that the threads finish
         * together whatever the parameters' sizes */
        int64_t piece = total / ((int64_t)threads * 4);
        piece = (piece + FS_BLOCK - 1) / FS_BLOCK * FS_BLOCK;
        int64_t npieces = 0;
        for (int64_t i = 0; i < n; i++) npieces += (t[i * 5]->numel + piece - 1) / piece;
        int64_t(*pieces)[3] = malloc((size_t)npieces * sizeof(*pieces));
        pthread_t tid[FS_MAX_THREADS];
        if (pieces == NULL) return fsc_error(FSC_ERR_NOMEM, "%s: cannot allocate the work list", op);
        npieces = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t lo = 0; lo < t[i * 5]->numel; lo += piece) {
                pieces[npieces][0] = i;
                pieces[npieces][1] = lo;
                pieces[npieces][2] = lo + piece < t[i * 5]->numel ? lo + piece : t[i * 5]->numel;
                npieces++;
            }
        fs_adam_work_t w = {.t = t, .sc = sc, .pieces = (const int64_t(*)[3])pieces, .npieces = npieces};
        atomic_init(&w.next, 0);
        atomic_init(&w.any_bad, 0);
        int started = 0;
        /* a thread that cannot start leaves its share to the others: the calling thread works too */
        for (int k = 0; k < threads - 1; k++)
            if (pthread_create(&tid[started], NULL, fs_adam_worker, &w) == 0) started++;
        fs_adam_worker(&w);
        for (int k = 0; k < started; k++) pthread_join(tid[k], NULL);
        any_bad = atomic_load(&w.any_bad);
        free(pieces);
    }
    if (any_bad) *(float *)found_inf->data = 1.0f;
    return FSC_OK;
}

/* ---- SyncBatchNorm's per-channel arithmetic ----------------------------------------------- */

static double load_stat(const fsc_tensor_t *t, int64_t i) {
    switch (t->dtype) {
        case FSC_FLOAT64: return ((const double *)t->data)[i];
        case FSC_FLOAT16: return fsc_half_to_float(((const uint16_t *)t->data)[i]);
        case FSC_BFLOAT16: return fsc_bf16_to_float(((const uint16_t *)t->data)[i]);
        default: return ((const float *)t->data)[i];
    }
}

static void store_stat(fsc_tensor_t *t, int64_t i, double v) {
    if (t->dtype == FSC_FLOAT64)
        ((double *)t->data)[i] = v;
    else
        ((float *)t->data)[i] = (float)v;
}

#define FSC_STAT_DTYPES (FSC_DTYPE_BIT(FSC_FLOAT32) | FSC_DTYPE_BIT(FSC_FLOAT64))

fsc_status_t fsc_cpu_bn_combine(const fsc_tensor_t *gathered, int world, double eps, fsc_tensor_t *out) {
    static const char *op = "bn_combine";
    FSC_CHECK(fsc_kernels_check(gathered, op, "gathered", FSC_DEV_CPU, FSC_STAT_DTYPES, 0));
    FSC_CHECK(fsc_kernels_check(out, op, "out", FSC_DEV_CPU, FSC_DTYPE_BIT(gathered->dtype), 1));
    if (world < 1 || gathered->numel % world != 0 || (gathered->numel / world) % 2 != 1)
        return fsc_error(FSC_ERR_VALUE, "%s: gathered has %lld elements; expected world=%d rows of 2C + 1", op,
                         (long long)gathered->numel, world);
    int64_t row = gathered->numel / world, c = (row - 1) / 2;
    if (out->numel != 3 * c + 1)
        return fsc_error(FSC_ERR_VALUE, "%s: out has %lld elements; expected 3C + 1 = %lld", op, (long long)out->numel,
                         (long long)(3 * c + 1));
    double total = 0.0;
    for (int r = 0; r < world; r++) total += load_stat(gathered, r * row + 2 * c);
    for (int64_t k = 0; k < c; k++) {
        double mean = 0.0, var = 0.0;
        for (int r = 0; r < world; r++) mean += load_stat(gathered, r * row + 2 * c) * load_stat(gathered, r * row + k);
        mean /= total;
        for (int r = 0; r < world; r++) {
            double d = load_stat(gathered, r * row + k) - mean;
            var += load_stat(gathered, r * row + 2 * c) * (load_stat(gathered, r * row + c + k) + d * d);
        }
        var /= total;
        store_stat(out, k, mean);
        store_stat(out, c + k, var);
        store_stat(out, 2 * c + k, 1.0 / sqrt(var + eps));
    }
    store_stat(out, 3 * c, total);
    return FSC_OK;
}

fsc_status_t fsc_cpu_bn_coeffs(const fsc_tensor_t *sums, double total, const fsc_tensor_t *invstd,
                               const fsc_tensor_t *weight, fsc_tensor_t *out) {
    static const char *op = "bn_coeffs";
    FSC_CHECK(fsc_kernels_check(sums, op, "sums", FSC_DEV_CPU, FSC_STAT_DTYPES, 0));
    FSC_CHECK(fsc_kernels_check(invstd, op, "invstd", FSC_DEV_CPU, FSC_DTYPE_BIT(sums->dtype), 0));
    FSC_CHECK(fsc_kernels_check(out, op, "out", FSC_DEV_CPU, FSC_DTYPE_BIT(sums->dtype), 1));
    if (weight)
        FSC_CHECK(
            fsc_kernels_check(weight, op, "weight", FSC_DEV_CPU, FSC_FLOAT_DTYPES | FSC_DTYPE_BIT(FSC_FLOAT64), 0));
    int64_t c = invstd->numel;
    if (sums->numel != 2 * c || out->numel != 3 * c || (weight && weight->numel != c))
        return fsc_error(FSC_ERR_VALUE, "%s: expected sums of 2C, out of 3C and weight of C elements for C = %lld", op,
                         (long long)c);
    for (int64_t k = 0; k < c; k++) {
        double is = load_stat(invstd, k);
        double a = weight ? is * load_stat(weight, k) : is;
        store_stat(out, k, a);
        store_stat(out, c + k, -a * is * (load_stat(sums, c + k) / total));
        store_stat(out, 2 * c + k, -a * (load_stat(sums, k) / total));
    }
    return FSC_OK;
}
