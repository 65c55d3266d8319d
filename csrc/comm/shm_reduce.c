/* shm_reduce.c — reduction loops written so gcc -O3 vectorises them: restrict pointers, no
 * branches in the body, blocks of FSC_RED_BLOCK elements so the accumulator stays in L1.
 * Kernels are compiled twice (AVX2 and baseline) and picked at load time. */
#include "comm/shm_reduce.h"

#include <stdint.h>

#include "base/half.h"

#define FSC_RED_BLOCK 2048

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define FSC_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define FSC_MULTIVERSION
#endif

#define FSC_SUM(a, b) ((a) + (b))
#define FSC_MAX(a, b) ((a) > (b) ? (a) : (b))
#define FSC_MIN(a, b) ((a) < (b) ? (a) : (b))

/* Native-dtype kernels: d = s0 (op) s1 (or d (op)= s1 when d is s0), then d (op)= sj. */
#define FSC_DEFINE_NATIVE(NAME, T, OP)                                                               \
    static inline void NAME##_2(T *restrict d, const T *restrict a, const T *restrict b, size_t n) { \
        for (size_t i = 0; i < n; i++) d[i] = OP(a[i], b[i]);                                        \
    }                                                                                                \
    static inline void NAME##_acc(T *restrict d, const T *restrict s, size_t n) {                    \
        for (size_t i = 0; i < n; i++) d[i] = OP(d[i], s[i]);                                        \
    }                                                                                                \
    FSC_MULTIVERSION static void NAME(T *d, const T *const *s, int ns, size_t count) {               \
        for (size_t off = 0; off < count; off += FSC_RED_BLOCK) {                                    \
            size_t n = count - off < FSC_RED_BLOCK ? count - off : FSC_RED_BLOCK;                    \
            int j = 1;                                                                               \
            if (d != s[0]) {                                                                         \
                if (ns == 1) {                                                                       \
                    for (size_t i = 0; i < n; i++) d[off + i] = s[0][off + i];                       \
                } else {                                                                             \
                    NAME##_2(d + off, s[0] + off, s[1] + off, n);                                    \
                    j = 2;                                                                           \
                }                                                                                    \
            }                                                                                        \
            for (; j < ns; j++) NAME##_acc(d + off, s[j] + off, n);                                  \
        }                                                                                            \
    }

#define FSC_DEFINE_NATIVE_ALL(TN, T)            \
    FSC_DEFINE_NATIVE(red_sum_##TN, T, FSC_SUM) \
    FSC_DEFINE_NATIVE(red_max_##TN, T, FSC_MAX) \
    FSC_DEFINE_NATIVE(red_min_##TN, T, FSC_MIN)

FSC_DEFINE_NATIVE_ALL(f32, float)
FSC_DEFINE_NATIVE_ALL(f64, double)
FSC_DEFINE_NATIVE_ALL(i32, int32_t)
FSC_DEFINE_NATIVE_ALL(i64, int64_t)
FSC_DEFINE_NATIVE_ALL(u8, uint8_t)

/* Integer sums wrap: do them in the unsigned type so overflow is defined. */
#define red_sum_i32_u(d, s, ns, n) red_sum_u32((uint32_t *)(d), (const uint32_t *const *)(s), ns, n)
#define red_sum_i64_u(d, s, ns, n) red_sum_u64((uint64_t *)(d), (const uint64_t *const *)(s), ns, n)
FSC_DEFINE_NATIVE(red_sum_u32, uint32_t, FSC_SUM)
FSC_DEFINE_NATIVE(red_sum_u64, uint64_t, FSC_SUM)

FSC_MULTIVERSION static void div_f32(float *restrict d, size_t n, float div) {
    for (size_t i = 0; i < n; i++) d[i] = d[i] / div;
}

FSC_MULTIVERSION static void div_f64(double *restrict d, size_t n, double div) {
    for (size_t i = 0; i < n; i++) d[i] = d[i] / div;
}

/* 16-bit floating kernels: widen a block into a float32 accumulator, reduce, round once. */
#define FSC_DEFINE_HALF(NAME, TO_F, FROM_F, OP)                                                                \
    static inline void NAME##_load(float *restrict acc, const uint16_t *restrict s, size_t n) {                \
        for (size_t i = 0; i < n; i++) acc[i] = TO_F(s[i]);                                                    \
    }                                                                                                          \
    static inline void NAME##_acc(float *restrict acc, const uint16_t *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) acc[i] = OP(acc[i], TO_F(s[i]));                                        \
    }                                                                                                          \
    static inline void NAME##_store(uint16_t *restrict d, const float *restrict acc, size_t n, float dv) {     \
        for (size_t i = 0; i < n; i++) d[i] = FROM_F(acc[i] / dv);                                             \
    }                                                                                                          \
    FSC_MULTIVERSION static void NAME(uint16_t *d, const uint16_t *const *s, int ns, size_t count, float dv) { \
        float acc[FSC_RED_BLOCK];                                                                              \
        for (size_t off = 0; off < count; off += FSC_RED_BLOCK) {                                              \
            size_t n = count - off < FSC_RED_BLOCK ? count - off : FSC_RED_BLOCK;                              \
            NAME##_load(acc, s[0] + off, n);                                                                   \
            for (int j = 1; j < ns; j++) NAME##_acc(acc, s[j] + off, n);                                       \
            NAME##_store(d + off, acc, n, dv);                                                                 \
        }                                                                                                      \
    }

FSC_DEFINE_HALF(red_sum_f16, fsc_half_to_float, fsc_float_to_half, FSC_SUM)
FSC_DEFINE_HALF(red_max_f16, fsc_half_to_float, fsc_float_to_half, FSC_MAX)
FSC_DEFINE_HALF(red_min_f16, fsc_half_to_float, fsc_float_to_half, FSC_MIN)
FSC_DEFINE_HALF(red_sum_bf16, fsc_bf16_to_float, fsc_float_to_bf16, FSC_SUM)
FSC_DEFINE_HALF(red_max_bf16, fsc_bf16_to_float, fsc_float_to_bf16, FSC_MAX)
FSC_DEFINE_HALF(red_min_bf16, fsc_bf16_to_float, fsc_float_to_bf16, FSC_MIN)

/* Dispatch helpers: pick the sum/max/min kernel of one dtype. */
#define FSC_PICK(TN, CT, d, s, ns, n, op)                           \
    do {                                                            \
        if ((op) == FSC_RED_MAX)                                    \
            red_max_##TN((CT *)(d), (const CT *const *)(s), ns, n); \
        else if ((op) == FSC_RED_MIN)                               \
            red_min_##TN((CT *)(d), (const CT *const *)(s), ns, n); \
        else                                                        \
            red_sum_##TN((CT *)(d), (const CT *const *)(s), ns, n); \
    } while (0)

#define FSC_PICK_HALF(TN, d, s, ns, n, op, dv)                                        \
    do {                                                                              \
        if ((op) == FSC_RED_MAX)                                                      \
            red_max_##TN((uint16_t *)(d), (const uint16_t *const *)(s), ns, n, 1.0f); \
        else if ((op) == FSC_RED_MIN)                                                 \
            red_min_##TN((uint16_t *)(d), (const uint16_t *const *)(s), ns, n, 1.0f); \
        else                                                                          \
            red_sum_##TN((uint16_t *)(d), (const uint16_t *const *)(s), ns, n, dv);   \
    } while (0)

fsc_status_t fsc_shm_reduce(void *dst, const void *const *srcs, int nsrc, size_t count, fsc_dtype_t dt,
                            fsc_reduce_op_t op, int divisor) {
    if (nsrc < 1 || (unsigned)op >= FSC_NUM_REDS)
        return fsc_error(FSC_ERR_INTERNAL, "fsc_shm_reduce: nsrc=%d op=%d", nsrc, (int)op);
    int avg = op == FSC_RED_AVG;
    switch (dt) {
        case FSC_FLOAT32:
            FSC_PICK(f32, float, dst, srcs, nsrc, count, op);
            if (avg) div_f32((float *)dst, count, (float)divisor);
            return FSC_OK;
        case FSC_FLOAT64:
            FSC_PICK(f64, double, dst, srcs, nsrc, count, op);
            if (avg) div_f64((double *)dst, count, (double)divisor);
            return FSC_OK;
        case FSC_FLOAT16: FSC_PICK_HALF(f16, dst, srcs, nsrc, count, op, avg ? (float)divisor : 1.0f); return FSC_OK;
        case FSC_BFLOAT16: FSC_PICK_HALF(bf16, dst, srcs, nsrc, count, op, avg ? (float)divisor : 1.0f); return FSC_OK;
        default: break;
    }
    if (avg) return fsc_error(FSC_ERR_VALUE, "op='avg' needs a floating dtype, got %s", fsc_dtype_name(dt));
    switch (dt) {
        case FSC_INT32:
            if (op == FSC_RED_SUM)
                red_sum_i32_u(dst, srcs, nsrc, count);
            else
                FSC_PICK(i32, int32_t, dst, srcs, nsrc, count, op);
            return FSC_OK;
        case FSC_INT64:
            if (op == FSC_RED_SUM)
                red_sum_i64_u(dst, srcs, nsrc, count);
            else
                FSC_PICK(i64, int64_t, dst, srcs, nsrc, count, op);
            return FSC_OK;
        case FSC_UINT8: FSC_PICK(u8, uint8_t, dst, srcs, nsrc, count, op); return FSC_OK;
        default: break;
    }
    return fsc_error(FSC_ERR_VALUE, "reduction does not support dtype %s",
                     (unsigned)dt < FSC_NUM_DTYPES ? fsc_dtype_name(dt) : "?");
}
