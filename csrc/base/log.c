/* log.c — stderr logger; the level is cached in an atomic so the disabled path is one load. */
#include "base/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static atomic_int level_cache = -1; /* -1: not read yet */
static atomic_int log_rank = -1;

static int parse_level(const char *s) {
    if (s == NULL || *s == '\0') return FSC_LOG_NONE;
    if (strcasecmp(s, "WARN") == 0) return FSC_LOG_WARN;
    if (strcasecmp(s, "INFO") == 0) return FSC_LOG_INFO;
    if (strcasecmp(s, "TRACE") == 0) return FSC_LOG_TRACE;
    return FSC_LOG_NONE;
}

void fsc_log_reload(void) {
    atomic_store(&level_cache, parse_level(getenv("FAIRSCALE_C_DEBUG")));
}

fsc_log_level_t fsc_log_level(void) {
    int lv = atomic_load_explicit(&level_cache, memory_order_relaxed);
    if (lv < 0) {
        fsc_log_reload();
        lv = atomic_load(&level_cache);
    }
    return (fsc_log_level_t)lv;
}

void fsc_log_set_rank(int rank) {
    atomic_store(&log_rank, rank);
}

void fsc_log_write(fsc_log_level_t level, const char *subsys, const char *fmt, ...) {
    static const char *names[] = {"NONE", "WARN", "INFO", "TRACE"};
    char msg[1024];
    char rank[16];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    int r = atomic_load(&log_rank);
    if (r < 0)
        snprintf(rank, sizeof(rank), "-");
    else
        snprintf(rank, sizeof(rank), "%d", r);
    /* One fprintf per line so concurrent ranks do not interleave mid-line. */
    fprintf(stderr, "fairscale_c %s:%ld %s [%s] %s\n", rank, (long)getpid(), names[level], subsys, msg);
}
