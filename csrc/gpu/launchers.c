/* launchers.c — the CUDA kernels' host side: each launcher checks its tensors (dtype, device,
 * shape, the same rules as the CPU references in kernels_cpu.c) and launches its kernel on the
 * caller's stream through fsc_gpu_launch. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "gpu/gpu.h"
#include "gpu/gpu_internal.h"

static unsigned int grid_for(int64_t n) {
    int64_t blocks = (n + FSC_GPU_BLOCK - 1) / FSC_GPU_BLOCK;
    if (blocks < 1) blocks = 1;
    return (unsigned int)(blocks < FSC_GPU_MAX_GRID ? blocks : FSC_GPU_MAX_GRID);
}

/* Common precondition for CUDA tensor arguments; also checks that `t` lives on `device`. */
static fsc_status_t check_cuda(const fsc_tensor_t *t, const char *op, const char *arg, unsigned dtypes, int writable,
                               int device) {
    FSC_CHECK(fsc_kernels_check(t, op, arg, FSC_DEV_CUDA, dtypes, writable));
    if (t->device_id != device)
        return fsc_error(FSC_ERR_VALUE, "%s: %s is on cuda:%d, expected cuda:%d like the other arguments", op, arg,
                         t->device_id, device);
    return FSC_OK;
}

static fsc_status_t check_one_float(const fsc_tensor_t *t, const char *op, const char *arg, int device) {
    FSC_CHECK(check_cuda(t, op, arg, FSC_DTYPE_BIT(FSC_FLOAT32), 1, device));
    if (t->numel != 1)
        return fsc_error(FSC_ERR_VALUE, "%s: %s must have exactly 1 element, got %lld", op, arg, (long long)t->numel);
    return FSC_OK;
}

fsc_status_t fsc_gpu_cast(fsc_tensor_t *dst, const fsc_tensor_t *src, fsc_stream_t stream) {
    static const char *op = "cuda_cast";
    int dev = src->device_id;
    FSC_CHECK(check_cuda(src, op, "src", FSC_FLOAT_DTYPES, 0, dev));
    FSC_CHECK(check_cuda(dst, op, "dst", FSC_FLOAT_DTYPES, 1, dev));
    if (dst->numel != src->numel)
        return fsc_error(FSC_ERR_VALUE, "%s: dst has %lld elements, src has %lld", op, (long long)dst->numel,
                         (long long)src->numel);
    fsc_gpu_kernel_t k;
    if (src->dtype == FSC_FLOAT32 && dst->dtype == FSC_FLOAT16)
        k = FSC_GPU_K_CAST_F32_F16;
    else if (src->dtype == FSC_FLOAT32 && dst->dtype == FSC_BFLOAT16)
        k = FSC_GPU_K_CAST_F32_BF16;
    else if (src->dtype == FSC_FLOAT16 && dst->dtype == FSC_FLOAT32)
        k = FSC_GPU_K_CAST_F16_F32;
    else if (src->dtype == FSC_BFLOAT16 && dst->dtype == FSC_FLOAT32)
        k = FSC_GPU_K_CAST_BF16_F32;
    else
        return fsc_error(FSC_ERR_TYPE, "%s: casts go between float32 and float16/bfloat16, got %s -> %s", op,
                         fsc_dtype_name(src->dtype), fsc_dtype_name(dst->dtype));
    if (src->numel == 0) return FSC_OK;
    long long n = (long long)src->numel;
    void *d = dst->data, *s = src->data;
    void *args[] = {&d, &s, &n};
    return fsc_gpu_launch(dev, k, grid_for(src->numel), stream, args, op);
}

fsc_status_t fsc_gpu_unscale_inf_check(fsc_tensor_t *buf, float inv_scale, fsc_tensor_t *found_inf,
                                       fsc_stream_t stream) {
    static const char *op = "cuda_unscale_inf_check";
    int dev = buf->device_id;
    FSC_CHECK(check_cuda(buf, op, "buf", FSC_FLOAT_DTYPES, 1, dev));
    FSC_CHECK(check_one_float(found_inf, op, "found_inf", dev));
    if (buf->numel == 0) return FSC_OK;
    fsc_gpu_kernel_t k = buf->dtype == FSC_FLOAT32   ? FSC_GPU_K_UNSCALE_F32
                         : buf->dtype == FSC_FLOAT16 ? FSC_GPU_K_UNSCALE_F16
                                                     : FSC_GPU_K_UNSCALE_BF16;
    long long n = (long long)buf->numel;
    void *b = buf->data, *fi = found_inf->data;
    void *args[] = {&b, &n, &inv_scale, &fi};
    return fsc_gpu_launch(dev, k, grid_for(buf->numel), stream, args, op);
}

fsc_status_t fsc_gpu_norm(const fsc_tensor_t *x, fsc_norm_mode_t mode, fsc_tensor_t *workspace, fsc_tensor_t *out,
                          fsc_stream_t stream) {
    static const char *op = "cuda_norm";
    int dev = x->device_id;
    FSC_CHECK(check_cuda(x, op, "x", FSC_FLOAT_DTYPES, 0, dev));
    FSC_CHECK(check_cuda(workspace, op, "workspace", FSC_DTYPE_BIT(FSC_FLOAT32), 1, dev));
    FSC_CHECK(check_one_float(out, op, "out", dev));
    if (workspace->numel < 1) return fsc_error(FSC_ERR_VALUE, "%s: workspace must have at least 1 element", op);
    if (mode != FSC_NORM_SUMSQ && mode != FSC_NORM_ABSMAX)
        return fsc_error(FSC_ERR_VALUE, "%s: mode must be FSC_NORM_SUMSQ or FSC_NORM_ABSMAX, got %d", op, (int)mode);
    int64_t limit = workspace->numel < FSC_GPU_MAX_PARTIALS ? workspace->numel : FSC_GPU_MAX_PARTIALS;
    unsigned int grid = grid_for(x->numel);
    if ((int64_t)grid > limit) grid = (unsigned int)limit;
    fsc_gpu_kernel_t k = x->dtype == FSC_FLOAT32   ? FSC_GPU_K_NORM_F32
                         : x->dtype == FSC_FLOAT16 ? FSC_GPU_K_NORM_F16
                                                   : FSC_GPU_K_NORM_BF16;
    long long n = (long long)x->numel;
    int m = (int)mode, np = (int)grid;
    void *xp = x->data, *wp = workspace->data, *op_ = out->data;
    void *args1[] = {&xp, &n, &m, &wp};
    FSC_CHECK(fsc_gpu_launch(dev, k, grid, stream, args1, op));
    void *args2[] = {&wp, &np, &m, &op_};
    return fsc_gpu_launch(dev, FSC_GPU_K_NORM_FINALIZE, 1, stream, args2, op);
}

static fsc_status_t check_shard(const fsc_tensor_t *t, const char *arg, int writable, const fsc_tensor_t *param) {
    FSC_CHECK(check_cuda(t, "cuda_adamw_step", arg, FSC_DTYPE_BIT(FSC_FLOAT32), writable, param->device_id));
    if (t->numel != param->numel)
        return fsc_error(FSC_ERR_VALUE, "cuda_adamw_step: %s has %lld elements, param has %lld", arg,
                         (long long)t->numel, (long long)param->numel);
    return FSC_OK;
}

fsc_status_t fsc_gpu_adamw_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                fsc_tensor_t *exp_avg_sq, const fsc_adamw_hparams_t *hp, fsc_stream_t stream) {
    fsc_adamw_scalars_t s;
    FSC_CHECK(check_shard(param, "param", 1, param));
    FSC_CHECK(check_shard(grad, "grad", 0, param));
    FSC_CHECK(check_shard(exp_avg, "exp_avg", 1, param));
    FSC_CHECK(check_shard(exp_avg_sq, "exp_avg_sq", 1, param));
    FSC_CHECK(fsc_adamw_prepare(hp, &s));
    if (param->numel == 0) return FSC_OK;
    long long n = (long long)param->numel;
    void *p = param->data, *g = grad->data, *m = exp_avg->data, *v = exp_avg_sq->data;
    void *args[] = {
        &p,    &g, &m, &v, &n, &s.decay, &s.one_minus_b1, &s.beta2, &s.one_minus_b2, &s.bc2_sqrt, &s.neg_step_size,
        &s.eps};
    return fsc_gpu_launch(param->device_id, FSC_GPU_K_ADAMW_F32, grid_for(param->numel), stream, args,
                          "cuda_adamw_step");
}

/* The dtype codes of fsc_fs_adam (csrc/cuda/fs_adam.cu). */
static int fs_adam_code(fsc_dtype_t dt) {
    return dt == FSC_FLOAT16 ? 1 : dt == FSC_BFLOAT16 ? 2 : 0;
}

fsc_status_t fsc_gpu_fs_adam_step(fsc_tensor_t *param, const fsc_tensor_t *grad, fsc_tensor_t *exp_avg,
                                  fsc_tensor_t *exp_avg_sq, fsc_tensor_t *param_copy, const fsc_fs_adam_scalars_t *s,
                                  fsc_tensor_t *found_inf, fsc_stream_t stream) {
    static const char *op = "cuda_fs_adam_step";
    int dev = param->device_id;
    FSC_CHECK(fsc_fs_adam_check(param, grad, exp_avg, exp_avg_sq, param_copy, FSC_DEV_CUDA, op));
    const fsc_tensor_t *ts[4] = {grad, exp_avg, exp_avg_sq, param_copy};
    static const char *names[4] = {"grad", "exp_avg", "exp_avg_sq", "param_copy"};
    for (int i = 0; i < 4; i++)
        if (ts[i] && ts[i]->device_id != dev)
            return fsc_error(FSC_ERR_VALUE, "%s: %s is on cuda:%d, expected cuda:%d like param", op, names[i],
                             ts[i]->device_id, dev);
    FSC_CHECK(check_one_float(found_inf, op, "found_inf", dev));
    if (param->numel == 0) return FSC_OK;
    long long n = (long long)param->numel;
    void *p = param->data, *g = grad->data, *m = exp_avg->data, *v = exp_avg_sq->data;
    void *c = param_copy ? param_copy->data : NULL, *fi = found_inf->data;
    int pdt = fs_adam_code(param->dtype), gdt = fs_adam_code(grad->dtype), sdt = fs_adam_code(exp_avg->dtype);
    int cdt = param_copy ? fs_adam_code(param_copy->dtype) : 0, inside = s->eps_inside_sqrt;
    float b1 = s->beta1, b2 = s->beta2, omb1 = s->one_minus_b1, omb2 = s->one_minus_b2, eps = s->eps;
    float gs = s->grad_scale, os = s->optim_scale, ss = s->step_size, decay = s->decay;
    void *args[] = {&p,  &pdt,  &g,    &gdt, &m,  &v,  &sdt, &c,     &cdt,    &n, &b1,
                    &b2, &omb1, &omb2, &eps, &gs, &os, &ss,  &decay, &inside, &fi};
    return fsc_gpu_launch(dev, FSC_GPU_K_FS_ADAM, grid_for(param->numel), stream, args, op);
}

fsc_status_t fsc_gpu_fs_adam_plan(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                  fsc_fs_adam_visit_t visit, void *ctx) {
    fsc_fs_adam_table_t tab;
    memset(&tab, 0, sizeof(tab));
    int codes[4] = {-1, -1, -1, -1};
    int64_t first = 0; /* the table's first parameter */
    for (int64_t i = 0; i < n; i++) {
        fsc_tensor_t *const *ti = &t[i * 5];
        if (ti[0]->numel == 0) continue;
        int64_t blocks = (ti[0]->numel + FSC_FS_ADAM_CHUNK - 1) / FSC_FS_ADAM_CHUNK;
        int mine[4] = {fs_adam_code(ti[0]->dtype), fs_adam_code(ti[1]->dtype), fs_adam_code(ti[2]->dtype),
                       ti[4] ? fs_adam_code(ti[4]->dtype) : -1};
        int alone = blocks > INT32_MAX / 2; /* more blocks than a table counts: the one-parameter kernel */
        if (tab.count > 0 && (alone || memcmp(mine, codes, sizeof(mine)) != 0 || tab.count == FSC_FS_ADAM_TABLE ||
                              blocks > INT32_MAX - tab.first_block[tab.count])) {
            FSC_CHECK(visit(ctx, &tab, codes, first, -1));
            tab.count = 0;
        }
        if (alone) {
            FSC_CHECK(visit(ctx, NULL, mine, i, i));
            continue;
        }
        if (tab.count == 0) first = i;
        memcpy(codes, mine, sizeof(codes));
        int c = tab.count;
        tab.param[c] = ti[0]->data;
        tab.grad[c] = ti[1]->data;
        tab.exp_avg[c] = ti[2]->data;
        tab.exp_avg_sq[c] = ti[3]->data;
        tab.copy[c] = ti[4] ? ti[4]->data : NULL;
        tab.numel[c] = (long long)ti[0]->numel;
        tab.step_size[c] = sc[i].step_size;
        tab.first_block[c + 1] = tab.first_block[c] + (int)blocks;
        tab.count = c + 1;
    }
    return tab.count > 0 ? visit(ctx, &tab, codes, first, -1) : FSC_OK;
}

typedef struct {
    int dev;
    fsc_tensor_t *const *t;
    const fsc_fs_adam_scalars_t *sc;
    fsc_tensor_t *found_inf;
    fsc_stream_t stream;
} fs_adam_launch_t;

/* The launching visitor of fsc_gpu_fs_adam_plan: one kernel per table, or the one-parameter
 * kernel. */
static fsc_status_t fs_adam_launch(void *ctx, const fsc_fs_adam_table_t *tab, const int codes[4], int64_t first,
                                   int64_t single) {
    static const char *op = "cuda_fs_adam_multi";
    fs_adam_launch_t *l = ctx;
    if (single >= 0) {
        fsc_tensor_t *const *ti = &l->t[single * 5];
        return fsc_gpu_fs_adam_step(ti[0], ti[1], ti[2], ti[3], ti[4], &l->sc[single], l->found_inf, l->stream);
    }
    const fsc_fs_adam_scalars_t *s = &l->sc[first];
    int pdt = codes[0], gdt = codes[1], sdt = codes[2], cdt = codes[3], inside = s->eps_inside_sqrt;
    float b1 = s->beta1, b2 = s->beta2, omb1 = s->one_minus_b1, omb2 = s->one_minus_b2, eps = s->eps;
    float gs = s->grad_scale, os = s->optim_scale, decay = s->decay;
    void *found = l->found_inf->data;
    void *args[] = {(void *)tab, &pdt, &gdt, &sdt, &cdt,   &b1,     &b2,   &omb1,
                    &omb2,       &eps, &gs,  &os,  &decay, &inside, &found};
    return fsc_gpu_launch(l->dev, FSC_GPU_K_FS_ADAM_MULTI, (unsigned int)tab->first_block[tab->count], l->stream, args,
                          op);
}

fsc_status_t fsc_gpu_fs_adam_multi(fsc_tensor_t *const *t, const fsc_fs_adam_scalars_t *sc, int64_t n,
                                   fsc_tensor_t *found_inf, fsc_stream_t stream) {
    static const char *op = "cuda_fs_adam_multi";
    static const char *names[5] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy"};
    if (n == 0) return FSC_OK;
    int dev = found_inf->device_id;
    FSC_CHECK(check_one_float(found_inf, op, "found_inf", dev));
    for (int64_t i = 0; i < n; i++) {
        fsc_tensor_t *const *ti = &t[i * 5];
        FSC_CHECK(fsc_fs_adam_check(ti[0], ti[1], ti[2], ti[3], ti[4], FSC_DEV_CUDA, op));
        for (int k = 0; k < 5; k++)
            if (ti[k] && ti[k]->device_id != dev)
                return fsc_error(FSC_ERR_VALUE,
                                 "%s: parameter %lld's %s is on cuda:%d, expected cuda:%d like found_inf", op,
                                 (long long)i, names[k], ti[k]->device_id, dev);
    }
    fs_adam_launch_t l = {.dev = dev, .t = t, .sc = sc, .found_inf = found_inf, .stream = stream};
    return fsc_gpu_fs_adam_plan(t, sc, n, fs_adam_launch, &l);
}
