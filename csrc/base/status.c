/* status.c — thread-local last-error storage. */
#include "base/status.h"

#include <stdio.h>

#include "base/log.h"

static _Thread_local char last_error[1024];

fsc_status_t fsc_error(fsc_status_t st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    FSC_LOG(FSC_LOG_INFO, "error", "%s: %s", fsc_status_name(st), last_error);
    return st;
}

const char *fsc_last_error(void) {
    return last_error;
}

const char *fsc_status_name(fsc_status_t st) {
    switch (st) {
        case FSC_OK: return "FSC_OK";
        case FSC_ERR_VALUE: return "FSC_ERR_VALUE";
        case FSC_ERR_TYPE: return "FSC_ERR_TYPE";
        case FSC_ERR_DLPACK: return "FSC_ERR_DLPACK";
        case FSC_ERR_NOMEM: return "FSC_ERR_NOMEM";
        case FSC_ERR_SYSTEM: return "FSC_ERR_SYSTEM";
        case FSC_ERR_COMM: return "FSC_ERR_COMM";
        case FSC_ERR_TIMEOUT: return "FSC_ERR_TIMEOUT";
        case FSC_ERR_MISMATCH: return "FSC_ERR_MISMATCH";
        case FSC_ERR_UNAVAILABLE: return "FSC_ERR_UNAVAILABLE";
        case FSC_ERR_INTERNAL: return "FSC_ERR_INTERNAL";
    }
    return "FSC_ERR_UNKNOWN";
}
