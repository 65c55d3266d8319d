/* shm_reduce.c — reduction loops written so gcc -O3 vectorises them: restrict pointers, no
 * branches in the body, blocks of FSC_RED_BLOCK elements so the accumulator stays in L1.
 * Kernels are compiled twice (AVX2 and baseline) and picked at load time. */
#include "comm/shm_reduce.h"

#include <stdint.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "base/half.h"

#define FSC_RED_BLOCK 2048

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define FSC_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define FSC_MULTIVERSION
#endif

#define FSC_SUM(a, b) ((a) + (b))
/* max and min propagate NaN as torch.maximum/minimum do, whichever rank holds it: the first
 * operand when it is greater (or NaN), else the second (NaN when the second is). For integers the
 * self-comparison is always false and compiles away. */
#define FSC_MAX(a, b) ((a) > (b) || (a) != (a) ? (a) : (b))
#define FSC_MIN(a, b) ((a) < (b) || (a) != (a) ? (a) : (b))

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

#if defined(__x86_64__)
/* Streaming kernels: one 64-byte line of the result at a time, reduced from every source in SSE
 * registers and stored to every destination, so the sources' reads and the destinations' writes
 * stay interleaved: with non-temporal stores, except into a destination that is one of the
 * sources (in place), whose line the reduction has just brought into the cache and which a
 * streaming store would have to evict (docs/benchmarks.md, "Shared tensors"). addps and the
 * max/min below compute exactly FSC_SUM, FSC_MAX and FSC_MIN (maxps returns its second operand
 * unless the first is greater; a NaN first operand is then put back), so the results equal
 * fsc_shm_reduce's bit for bit.
 * Prefetching never faults, so reading ahead past the end is safe. */

/* How far ahead of the line being reduced each source is prefetched, in bytes: without it a rank's
 * reads are the bottleneck (the distance chosen: docs/benchmarks.md, "Shared tensors"). */
#define FSC_STREAM_PREFETCH 2048

/* maxps/minps, with a NaN in the first operand kept (the second's already comes through). */
#define FSC_DEFINE_NAN_KEEPING(NAME, V, OP, UNORD, AND, ANDNOT, OR) \
    static inline V NAME(V a, V b) {                                \
        V nan = UNORD(a, a);                                        \
        return OR(AND(nan, a), ANDNOT(nan, OP(a, b)));              \
    }
FSC_DEFINE_NAN_KEEPING(fsc_max_ps, __m128, _mm_max_ps, _mm_cmpunord_ps, _mm_and_ps, _mm_andnot_ps, _mm_or_ps)
FSC_DEFINE_NAN_KEEPING(fsc_min_ps, __m128, _mm_min_ps, _mm_cmpunord_ps, _mm_and_ps, _mm_andnot_ps, _mm_or_ps)
FSC_DEFINE_NAN_KEEPING(fsc_max_pd, __m128d, _mm_max_pd, _mm_cmpunord_pd, _mm_and_pd, _mm_andnot_pd, _mm_or_pd)
FSC_DEFINE_NAN_KEEPING(fsc_min_pd, __m128d, _mm_min_pd, _mm_cmpunord_pd, _mm_and_pd, _mm_andnot_pd, _mm_or_pd)

#define FSC_DEFINE_STREAM(NAME, T, V, LOADU, OP, DIV, SET1, CAST)                                                    \
    static void NAME(uint8_t *const *d, const uint8_t *nt, int nd, const T *const *s, int ns, size_t lines, int avg, \
                     T dv) {                                                                                         \
        enum { L = 16 / sizeof(T) };                                                                                 \
        const V div = SET1(dv);                                                                                      \
        for (size_t i = 0; i < lines * 4 * L; i += 4 * L) {                                                          \
            V v[4];                                                                                                  \
            for (int j = 0; j < ns; j++) _mm_prefetch((const char *)(s[j] + i) + FSC_STREAM_PREFETCH, _MM_HINT_T0);  \
            for (int q = 0; q < 4; q++) v[q] = OP(LOADU(s[0] + i + q * L), LOADU(s[1] + i + q * L));                 \
            for (int j = 2; j < ns; j++)                                                                             \
                for (int q = 0; q < 4; q++) v[q] = OP(v[q], LOADU(s[j] + i + q * L));                                \
            if (avg)                                                                                                 \
                for (int q = 0; q < 4; q++) v[q] = DIV(v[q], div);                                                   \
            for (int j = 0; j < nd; j++) {                                                                           \
                __m128i *o = (__m128i *)(d[j] + i * sizeof(T));                                                      \
                if (nt[j])                                                                                           \
                    for (int q = 0; q < 4; q++) _mm_stream_si128(o + q, CAST(v[q]));                                 \
                else                                                                                                 \
                    for (int q = 0; q < 4; q++) _mm_storeu_si128(o + q, CAST(v[q]));                                 \
            }                                                                                                        \
        }                                                                                                            \
    }

FSC_DEFINE_STREAM(stream_sum_f32, float, __m128, _mm_loadu_ps, _mm_add_ps, _mm_div_ps, _mm_set1_ps, _mm_castps_si128)
FSC_DEFINE_STREAM(stream_max_f32, float, __m128, _mm_loadu_ps, fsc_max_ps, _mm_div_ps, _mm_set1_ps, _mm_castps_si128)
FSC_DEFINE_STREAM(stream_min_f32, float, __m128, _mm_loadu_ps, fsc_min_ps, _mm_div_ps, _mm_set1_ps, _mm_castps_si128)
FSC_DEFINE_STREAM(stream_sum_f64, double, __m128d, _mm_loadu_pd, _mm_add_pd, _mm_div_pd, _mm_set1_pd, _mm_castpd_si128)
FSC_DEFINE_STREAM(stream_max_f64, double, __m128d, _mm_loadu_pd, fsc_max_pd, _mm_div_pd, _mm_set1_pd, _mm_castpd_si128)
FSC_DEFINE_STREAM(stream_min_f64, double, __m128d, _mm_loadu_pd, fsc_min_pd, _mm_div_pd, _mm_set1_pd, _mm_castpd_si128)

#define FSC_PICK_STREAM(TN, CT, d, nt, nd, s, ns, lines, op, dv)                                    \
    do {                                                                                            \
        if ((op) == FSC_RED_MAX)                                                                    \
            stream_max_##TN(d, nt, nd, (const CT *const *)(s), ns, lines, 0, 1);                    \
        else if ((op) == FSC_RED_MIN)                                                               \
            stream_min_##TN(d, nt, nd, (const CT *const *)(s), ns, lines, 0, 1);                    \
        else                                                                                        \
            stream_sum_##TN(d, nt, nd, (const CT *const *)(s), ns, lines, (op) == FSC_RED_AVG, dv); \
    } while (0)
#endif

size_t fsc_shm_reduce_stream(void *const *dsts, int ndst, const void *const *srcs, int nsrc, size_t count,
                             fsc_dtype_t dt, fsc_reduce_op_t op, int divisor) {
#if defined(__x86_64__)
    size_t esz = dt == FSC_FLOAT32 ? 4 : dt == FSC_FLOAT64 ? 8 : 0;
    if (esz == 0 || nsrc < 2 || ndst < 1 || (unsigned)op >= FSC_NUM_REDS) return 0;
    for (int j = 0; j < ndst; j++)
        if ((uintptr_t)dsts[j] & 15) return 0;
    size_t lines = count * esz / 64;
    uint8_t *const *d = (uint8_t *const *)dsts;
    uint8_t nt[FSC_SHM_REDUCE_MAX_DSTS];
    if (ndst > FSC_SHM_REDUCE_MAX_DSTS) return 0;
    for (int j = 0; j < ndst; j++) { /* in place: the line was just read, so it is in the cache */
        nt[j] = 1;
        for (int k = 0; k < nsrc; k++) nt[j] &= dsts[j] != srcs[k];
    }
    if (dt == FSC_FLOAT32)
        FSC_PICK_STREAM(f32, float, d, nt, ndst, srcs, nsrc, lines, op, (float)divisor);
    else
        FSC_PICK_STREAM(f64, double, d, nt, ndst, srcs, nsrc, lines, op, (double)divisor);
    _mm_sfence(); /* the streaming stores reach memory before whatever the caller publishes next */
    return lines * 64 / esz;
#else
    (void)dsts, (void)ndst, (void)srcs, (void)nsrc, (void)count, (void)dt, (void)op, (void)divisor;
    return 0;
#endif
}
