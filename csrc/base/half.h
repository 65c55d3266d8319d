/* half.h — float16 / bfloat16 <-> float32 conversions (round to nearest even), branch-free so
 * loops over them vectorise. */
#ifndef FSC_HALF_H
#define FSC_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t fsc_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float fsc_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* `cond ? a : b` with both computed, by masks: a conditional expression lets the compiler move
 * a floating-point operation into one arm (it may trap, so it is not evaluated speculatively),
 * and the branch left in the loop keeps it from vectorising. */
static inline uint32_t fsc_select_u32(int cond, uint32_t a, uint32_t b) {
    uint32_t mask = 0u - (uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

/* IEEE binary16 -> float32, exact for every input (subnormals, inf, NaN payloads kept).
 * The exponent is re-biased by a multiplication with 2^112, which also normalises subnormals. */
static inline float fsc_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t shifted = em << 13;
    uint32_t scaled = fsc_f32_bits(fsc_bits_f32(shifted) * 0x1p112f);
    uint32_t special = shifted | 0x7f800000u; /* inf / NaN: all-ones exponent, payload kept */
    return fsc_bits_f32(fsc_select_u32(em >= 0x7c00u, special, scaled) | sign);
}

/* float32 -> IEEE binary16, round to nearest even; overflow gives inf, NaN stays a (quiet) NaN.
 * All three paths are computed and one is selected, so the function has no branches. */
static inline uint16_t fsc_float_to_half(float f) {
    uint32_t x = fsc_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    /* normal range: re-bias the exponent by -112 and round the 13 dropped bits to even */
    uint32_t normal = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5 makes the FPU round at the half subnormal step (2^-24) */
    uint32_t sub = fsc_f32_bits(fsc_bits_f32(ax) + 0.5f) - 0x3f000000u;
    uint32_t big = fsc_select_u32(ax > 0x7f800000u, 0x7e00u | ((ax >> 13) & 0x3ffu), 0x7c00u);
    uint32_t r = fsc_select_u32(ax < 0x38800000u, sub, fsc_select_u32(ax >= 0x47800000u, big, normal));
    return (uint16_t)(r | sign);
}

/* bfloat16 -> float32 (exact). */
static inline float fsc_bf16_to_float(uint16_t b) {
    return fsc_bits_f32((uint32_t)b << 16);
}

/* float32 -> bfloat16, round to nearest even; NaN stays a quiet NaN. */
static inline uint16_t fsc_float_to_bf16(float f) {
    uint32_t x = fsc_f32_bits(f);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#endif /* FSC_HALF_H */
