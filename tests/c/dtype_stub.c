/* dtype_stub.c — fsc_dtype_size / fsc_dtype_name for building the C tests while csrc/tensor.c
 * is absent (the Makefile uses the real file when it exists). */
#include "../../csrc/tensor.h"

size_t fsc_dtype_size(fsc_dtype_t dt) {
    static const size_t sizes[FSC_NUM_DTYPES] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 1};
    return (unsigned)dt < FSC_NUM_DTYPES ? sizes[dt] : 0;
}

const char *fsc_dtype_name(fsc_dtype_t dt) {
    static const char *names[FSC_NUM_DTYPES] = {"float16", "bfloat16", "float32", "float64", "int8",
                                                "int16",   "int32",    "int64",   "uint8",   "bool"};
    return (unsigned)dt < FSC_NUM_DTYPES ? names[dt] : "?";
}
