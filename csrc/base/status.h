/* status.h — status codes, the thread-local last-error message, and CHECK macros. */
#ifndef FSC_STATUS_H
#define FSC_STATUS_H

#include <stdarg.h>

/* Every core function returns one of these. The binding layer maps them to Python exceptions
 * in exactly one place (csrc/py/errors.c). */
typedef enum {
    FSC_OK = 0,
    FSC_ERR_VALUE,       /* bad argument value                    -> ValueError */
    FSC_ERR_TYPE,        /* bad argument type / dtype             -> TypeError */
    FSC_ERR_DLPACK,      /* DLPack interop problem                -> BufferError */
    FSC_ERR_NOMEM,       /* allocation failed                     -> MemoryError */
    FSC_ERR_SYSTEM,      /* OS call failed (errno in message)     -> OSError */
    FSC_ERR_COMM,        /* peer failure, protocol error          -> DistributedError */
    FSC_ERR_TIMEOUT,     /* a wait exceeded its timeout           -> DistributedError */
    FSC_ERR_MISMATCH,    /* ranks issued different collectives    -> DistributedError */
    FSC_ERR_UNAVAILABLE, /* CUDA / NCCL not present at run time   -> RuntimeError */
    FSC_ERR_INTERNAL     /* a bug in fairscale_c                  -> RuntimeError */
} fsc_status_t;

/* Record `st` with a printf-style detail message for this thread and return `st`.
 * The message should name the operation, the argument and what was expected. */
fsc_status_t fsc_error(fsc_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The detail message recorded last on this thread ("" when none). Valid until the next
 * fsc_error on this thread. */
const char *fsc_last_error(void);

/* Human name of a status code, e.g. "FSC_ERR_TIMEOUT". */
const char *fsc_status_name(fsc_status_t st);

/* Propagate a non-OK status to the caller. */
#define FSC_CHECK(call)                                    \
    do {                                                   \
        fsc_status_t fsc_check_st_ = (call);               \
        if (fsc_check_st_ != FSC_OK) return fsc_check_st_; \
    } while (0)

/* Store a non-OK status in `st` and jump to `label` (cleanup path). */
#define FSC_CHECK_GOTO(call, st, label) \
    do {                                \
        (st) = (call);                  \
        if ((st) != FSC_OK) goto label; \
    } while (0)

#endif /* FSC_STATUS_H */
