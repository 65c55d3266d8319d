/* expect.h — the check macro of the C test programs (one translation unit each): EXPECT(cond,
 * fmt, ...) prints "FAIL file:line: message" and counts the failure in `failures`. */
#ifndef FSC_TEST_EXPECT_H
#define FSC_TEST_EXPECT_H

#include <stdio.h>

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

#endif /* FSC_TEST_EXPECT_H */
