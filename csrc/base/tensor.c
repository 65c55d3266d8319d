/* tensor.c — dtype facts and the strided copy/cast that every host-side move goes through. */
#include "base/tensor.h"

#include <string.h>

#include "base/half.h"
#include "base/simd.h"

size_t fsc_dtype_size(fsc_dtype_t dt) {
    switch (dt) {
        case FSC_FLOAT16:
        case FSC_BFLOAT16:
        case FSC_INT16: return 2;
        case FSC_FLOAT32:
        case FSC_INT32: return 4;
        case FSC_FLOAT64:
        case FSC_INT64: return 8;
        case FSC_INT8:
        case FSC_UINT8:
        case FSC_BOOL: return 1;
        case FSC_NUM_DTYPES: break;
    }
    return 0;
}

const char *fsc_dtype_name(fsc_dtype_t dt) {
    static const char *names[FSC_NUM_DTYPES] = {"float16", "bfloat16", "float32", "float64", "int8",
                                                "int16",   "int32",    "int64",   "uint8",   "bool"};
    return (unsigned)dt < FSC_NUM_DTYPES ? names[dt] : "unknown";
}

int fsc_tensor_is_contiguous(const fsc_tensor_t *t) {
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] == 0) return 1; /* empty: nothing to lay out, whatever the strides */
    int64_t expected = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expected) return 0;
        expected *= t->shape[i];
    }
    return 1;
}

static int is_float(fsc_dtype_t dt) {
    return dt == FSC_FLOAT16 || dt == FSC_BFLOAT16 || dt == FSC_FLOAT32 || dt == FSC_FLOAT64;
}

/* Drop size-1 dims so [4,1] and [4] compare equal; returns the squeezed ndim. */
static int squeeze(const fsc_tensor_t *t, int64_t *shape, int64_t *strides) {
    int n = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 1) continue;
        shape[n] = t->shape[i];
        strides[n] = t->strides[i];
        n++;
    }
    return n;
}

static double load_float(const char *p, fsc_dtype_t dt) {
    switch (dt) {
        case FSC_FLOAT16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return fsc_half_to_float(h);
        }
        case FSC_BFLOAT16: {
            uint16_t h;
            memcpy(&h, p, 2);
            return fsc_bf16_to_float(h);
        }
        case FSC_FLOAT32: {
            float f;
            memcpy(&f, p, 4);
            return f;
        }
        default: {
            double d;
            memcpy(&d, p, 8);
            return d;
        }
    }
}

static void store_float(char *p, fsc_dtype_t dt, double v) {
    switch (dt) {
        case FSC_FLOAT16: {
            uint16_t h = fsc_float_to_half((float)v);
            memcpy(p, &h, 2);
            break;
        }
        case FSC_BFLOAT16: {
            uint16_t h = fsc_float_to_bf16((float)v);
            memcpy(p, &h, 2);
            break;
        }
        case FSC_FLOAT32: {
            float f = (float)v;
            memcpy(p, &f, 4);
            break;
        }
        default: memcpy(p, &v, 8); break;
    }
}

/* Contiguous casts through fp32: the hot ones (FSDP mixed precision) get loops gcc vectorises. */
FSC_VECTOR_CLONES static void cast_contiguous(void *dst, fsc_dtype_t ddt, const void *src, fsc_dtype_t sdt, int64_t n) {
    if (sdt == FSC_FLOAT32 && ddt == FSC_BFLOAT16) {
        const float *restrict s = src;
        uint16_t *restrict d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fsc_float_to_bf16(s[i]);
    } else if (sdt == FSC_BFLOAT16 && ddt == FSC_FLOAT32) {
        const uint16_t *restrict s = src;
        float *restrict d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fsc_bf16_to_float(s[i]);
    } else if (sdt == FSC_FLOAT32 && ddt == FSC_FLOAT16) {
        const float *restrict s = src;
        uint16_t *restrict d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fsc_float_to_half(s[i]);
    } else if (sdt == FSC_FLOAT16 && ddt == FSC_FLOAT32) {
        const uint16_t *restrict s = src;
        float *restrict d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fsc_half_to_float(s[i]);
    } else {
        size_t ds = fsc_dtype_size(ddt), ss = fsc_dtype_size(sdt);
        for (int64_t i = 0; i < n; i++)
            store_float((char *)dst + i * ds, ddt, load_float((const char *)src + i * ss, sdt));
    }
}

fsc_status_t fsc_tensor_copy(fsc_tensor_t *dst, const fsc_tensor_t *src) {
    if (dst->device_type != FSC_DEV_CPU || src->device_type != FSC_DEV_CPU)
        return fsc_error(FSC_ERR_VALUE, "copy: expected CPU tensors for 'dst' and 'src'");
    if (dst->readonly) return fsc_error(FSC_ERR_VALUE, "copy: argument 'dst' is read-only");
    if (dst->dtype != src->dtype && !(is_float(dst->dtype) && is_float(src->dtype)))
        return fsc_error(FSC_ERR_TYPE, "copy: cannot convert %s to %s; expected equal dtypes or two floating dtypes",
                         fsc_dtype_name(src->dtype), fsc_dtype_name(dst->dtype));
    int64_t dshape[FSC_MAX_NDIM], dstr[FSC_MAX_NDIM], sshape[FSC_MAX_NDIM], sstr[FSC_MAX_NDIM];
    int dn = squeeze(dst, dshape, dstr), sn = squeeze(src, sshape, sstr);
    if (dst->numel != src->numel || (dst->numel > 0 && (dn != sn || memcmp(dshape, sshape, sizeof(int64_t) * dn) != 0)))
        return fsc_error(FSC_ERR_VALUE, "copy: 'dst' (%lld elements) and 'src' (%lld elements) have different shapes",
                         (long long)dst->numel, (long long)src->numel);
    if (dst->numel == 0) return FSC_OK;
    size_t ds = fsc_dtype_size(dst->dtype), ss = fsc_dtype_size(src->dtype);
    if (fsc_tensor_is_contiguous(dst) && fsc_tensor_is_contiguous(src)) {
        if (dst->dtype == src->dtype)
            memmove(dst->data, src->data, (size_t)dst->numel * ds);
        else
            cast_contiguous(dst->data, dst->dtype, src->data, src->dtype, dst->numel);
        return FSC_OK;
    }
    /* General strided walk: an odometer over the squeezed shape. */
    int64_t idx[FSC_MAX_NDIM] = {0};
    char *d = dst->data;
    const char *s = src->data;
    for (int64_t i = 0; i < dst->numel; i++) {
        if (dst->dtype == src->dtype)
            memcpy(d, s, ds);
        else
            store_float(d, dst->dtype, load_float(s, src->dtype));
        for (int k = dn - 1; k >= 0; k--) {
            d += dstr[k] * (int64_t)ds;
            s += sstr[k] * (int64_t)ss;
            if (++idx[k] < dshape[k]) break;
            d -= dstr[k] * dshape[k] * (int64_t)ds;
            s -= sstr[k] * sshape[k] * (int64_t)ss;
            idx[k] = 0;
        }
    }
    return FSC_OK;
}

fsc_status_t fsc_tensor_pack_check(const fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world,
                                   fsc_device_type_t dev, const char *op) {
    const char *where = dev == FSC_DEV_CUDA ? "CUDA" : "CPU";
    if (world < 1) return fsc_error(FSC_ERR_VALUE, "%s: argument 'world' must be >= 1, got %d", op, world);
    if (!fsc_tensor_is_contiguous(dst) || dst->device_type != (int)dev || dst->readonly)
        return fsc_error(FSC_ERR_VALUE, "%s: argument 'dst' must be a writable contiguous %s tensor", op, where);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        const fsc_tensor_t *s = &srcs[i];
        if (s->dtype != dst->dtype)
            return fsc_error(FSC_ERR_VALUE, "%s: srcs[%d] is %s but 'dst' is %s; expected one dtype", op, i,
                             fsc_dtype_name(s->dtype), fsc_dtype_name(dst->dtype));
        if (!fsc_tensor_is_contiguous(s) || s->device_type != (int)dev || s->device_id != dst->device_id)
            return fsc_error(FSC_ERR_VALUE, "%s: srcs[%d] must be a contiguous %s tensor on dst's device", op, i,
                             where);
        if (s->numel % world != 0)
            return fsc_error(FSC_ERR_VALUE, "%s: srcs[%d] has %lld elements, not a multiple of world=%d", op, i,
                             (long long)s->numel, world);
        if (__builtin_add_overflow(total, s->numel, &total))
            return fsc_error(FSC_ERR_VALUE, "%s: the element count of srcs[0..%d] together overflows int64", op, i);
    }
    if (total != dst->numel)
        return fsc_error(FSC_ERR_VALUE, "%s: 'dst' has %lld elements, the sources %lld; expected equal", op,
                         (long long)dst->numel, (long long)total);
    return FSC_OK;
}

fsc_status_t fsc_tensor_pack_blocks(fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world) {
    FSC_CHECK(fsc_tensor_pack_check(dst, srcs, n, world, FSC_DEV_CPU, "pack_blocks"));
    size_t esz = fsc_dtype_size(dst->dtype);
    char *out = dst->data;
    if (dst->numel == 0) return FSC_OK; /* nothing to move, however many (empty) blocks */
    for (int r = 0; r < world; r++) {
        for (int i = 0; i < n; i++) {
            size_t block = (size_t)(srcs[i].numel / world) * esz;
            if (block == 0) continue;
            memcpy(out, (const char *)srcs[i].data + (size_t)r * block, block);
            out += block;
        }
    }
    return FSC_OK;
}
