/* log.h — FAIRSCALE_C_DEBUG-controlled logging to stderr with a "rank:pid" prefix. */
#ifndef FSC_LOG_H
#define FSC_LOG_H

typedef enum { FSC_LOG_NONE = 0, FSC_LOG_WARN = 1, FSC_LOG_INFO = 2, FSC_LOG_TRACE = 3 } fsc_log_level_t;

/* Current level, read once from FAIRSCALE_C_DEBUG (WARN|INFO|TRACE; unset = NONE). */
fsc_log_level_t fsc_log_level(void);

/* Re-read FAIRSCALE_C_DEBUG (tests change it at run time). */
void fsc_log_reload(void);

/* Rank shown in the prefix; -1 (default) prints "-". */
void fsc_log_set_rank(int rank);

/* Write one line "fairscale_c <rank>:<pid> <LEVEL> [subsys] message" to stderr. */
void fsc_log_write(fsc_log_level_t level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FSC_LOG(level, subsys, ...)                                                    \
    do {                                                                               \
        if (fsc_log_level() >= (level)) fsc_log_write((level), (subsys), __VA_ARGS__); \
    } while (0)
#define FSC_WARN(subsys, ...) FSC_LOG(FSC_LOG_WARN, subsys, __VA_ARGS__)
#define FSC_INFO(subsys, ...) FSC_LOG(FSC_LOG_INFO, subsys, __VA_ARGS__)
#define FSC_TRACE(subsys, ...) FSC_LOG(FSC_LOG_TRACE, subsys, __VA_ARGS__)

#endif /* FSC_LOG_H */
