/* simd.h — FSC_VECTOR_CLONES: compile a function for AVX-512, AVX2 and the baseline, the best
 * clone picked at load time (gcc's target_clones). For the element-wise kernels whose loops gcc
 * vectorises; wider vectors round each operation exactly as the scalar code does. Off under the
 * sanitizers and other compilers. */
#ifndef FSC_SIMD_H
#define FSC_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define FSC_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FSC_VECTOR_CLONES
#endif

#endif /* FSC_SIMD_H */
