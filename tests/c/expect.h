/* expect.h — helpers of the C test programs (one translation unit each): EXPECT(cond, fmt, ...)
 * prints "FAIL file:line: message" and counts the failure in `failures`; wait_or_kill() bounds
 * the wait for a forked child. */
#ifndef FSC_TEST_EXPECT_H
#define FSC_TEST_EXPECT_H

#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures = 0;
#define EXPECT(cond, ...)                                        \
    do {                                                         \
        if (!(cond)) {                                           \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                        \
            fprintf(stderr, "\n");                               \
            failures++;                                          \
        }                                                        \
    } while (0)

/* Wait up to `seconds` for the child `pid` to exit; returns its wait status, or -1 when it was
 * still running then (it is killed and reaped, so a hang fails the test instead of blocking it). */
static inline int wait_or_kill(pid_t pid, double seconds) {
    int status = 0;
    struct timespec nap = {0, 10000000};
    for (double waited = 0; waited < seconds; waited += 0.01) {
        if (waitpid(pid, &status, WNOHANG) == pid) return status;
        nanosleep(&nap, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

#endif /* FSC_TEST_EXPECT_H */
