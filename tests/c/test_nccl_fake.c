/* test_nccl_fake.c — the NCCL backend's control paths against fake_cuda_nccl.c (no GPU needed):
 * blocking and non-blocking init, enqueue (a blocking one on the submitter thread) and wait, and
 * the watchdog: a collective that never completes, or an asynchronous NCCL error, aborts the
 * communicator without any host wait, unblocks a host synchronize, and makes the next call fail
 * with the reason. Run with the fake on LD_LIBRARY_PATH and FAIRSCALE_C_TIMEOUT=1 (the Makefile
 * does). Exit status 0 = all passed. */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/nccl.h"
#include "expect.h"
#include "gpu/gpu.h"

enum { FAKE_OK = 0, FAKE_HANG = 1, FAKE_ASYNC_ERROR = 2, FAKE_ENQUEUE_HANG = 3 };
static void (*fake_set_mode)(int);
static int (*fake_last_blocking)(void);
static int (*fake_aborts)(void);
static int (*fake_live_events)(void);
static int (*fake_copies)(int);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nap(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static fsc_tensor_t cuda_view(float *data, int64_t n) {
    fsc_tensor_t t;
    memset(&t, 0, sizeof(t));
    t.data = data;
    t.dtype = FSC_FLOAT32;
    t.device_type = FSC_DEV_CUDA;
    t.device_id = 0;
    t.ndim = 1;
    t.numel = n;
    t.shape[0] = n;
    t.strides[0] = 1;
    return t;
}

static fsc_nccl_comm_t *new_comm(double timeout_s) {
    unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES];
    fsc_nccl_comm_t *c = NULL;
    fsc_status_t st = fsc_nccl_get_unique_id(id);
    EXPECT(st == FSC_OK, "unique id: %s", fsc_last_error());
    st = fsc_nccl_comm_init(id, 0, 1, 0, timeout_s, &c);
    EXPECT(st == FSC_OK && c != NULL, "init: %s", fsc_last_error());
    return c;
}

/* Poll until the fake has seen `n` aborts, up to `limit` seconds; returns the seconds taken. */
static double wait_for_aborts(int n, double limit) {
    double t0 = now();
    while (fake_aborts() < n && now() - t0 < limit) nap(0.01);
    return now() - t0;
}

static void test_ops_and_wait(void) {
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(0);
    if (c == NULL) return;
    float in[4] = {1, 2, 3, 4}, out[4] = {0};
    fsc_tensor_t ti = cuda_view(in, 4), to = cuda_view(out, 4);
    EXPECT(fsc_nccl_all_gather(c, &to, &ti, 0) == FSC_OK, "all_gather: %s", fsc_last_error());
    EXPECT(out[3] == 4.0f, "all_gather copied %g", out[3]);
    EXPECT(fsc_nccl_all_reduce(c, &to, FSC_RED_SUM, 0) == FSC_OK, "all_reduce: %s", fsc_last_error());
    EXPECT(fsc_nccl_wait(c, 0, 1.0) == FSC_OK, "wait: %s", fsc_last_error());
    fsc_tensor_t short_out = cuda_view(out, 3);
    EXPECT(fsc_nccl_all_gather(c, &short_out, &ti, 0) == FSC_ERR_VALUE, "bad output size accepted");
    EXPECT(
        strstr(fsc_last_error(), "all_gather: output has 3 elements; expected") && !strstr(fsc_last_error(), "batch"),
        "single-op message: %s", fsc_last_error());
    EXPECT(fsc_nccl_reduce(c, &to, FSC_RED_MAX, 0, 0) == FSC_OK, "reduce: %s", fsc_last_error());
    EXPECT(fsc_nccl_reduce(c, &to, FSC_RED_MAX, 1, 0) == FSC_ERR_VALUE, "root 1 of 1 accepted");
    EXPECT(fsc_nccl_send(c, &ti, 0, 0, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "not this rank"),
           "send to self: %s", fsc_last_error());
    /* NCCL has no message tags: a nonzero tag is refused before anything is enqueued */
    EXPECT(fsc_nccl_recv(c, &to, 0, 7, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "recv: tag=7 is not supported"),
           "recv with a tag: %s", fsc_last_error());
    /* a batch: checked as a whole first, then enqueued as one group */
    float b_in[2] = {5, 6}, b_out[2] = {0}, b_ar[3] = {1, 1, 1};
    fsc_tensor_t bi = cuda_view(b_in, 2), bo = cuda_view(b_out, 2), bar = cuda_view(b_ar, 3);
    fsc_nccl_op_t ops[3] = {{FSC_OP_ALL_GATHER, &bo, &bi, FSC_RED_SUM, 0, 0},
                            {FSC_OP_ALL_REDUCE, &bar, NULL, FSC_RED_SUM, 0, 0},
                            {FSC_OP_BROADCAST, &bar, NULL, FSC_RED_SUM, 0, 0}};
    EXPECT(fsc_nccl_batch(c, ops, 3, 0) == FSC_OK, "batch: %s", fsc_last_error());
    EXPECT(b_out[1] == 6.0f, "batched all_gather copied %g", b_out[1]);
    ops[1].tensor = &short_out;
    ops[1].op = FSC_OP_ALL_GATHER; /* no input: refused, and nothing of the batch is enqueued */
    b_out[1] = 0;
    EXPECT(fsc_nccl_batch(c, ops, 3, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "batch operation 1"),
           "bad batch: %s", fsc_last_error());
    EXPECT(b_out[1] == 0.0f, "a refused batch enqueued its first operation");
    /* a copy in a batch is a send to this rank and a recv from it */
    float c_in[3] = {7, 8, 9}, c_out[3] = {0};
    fsc_tensor_t ci = cuda_view(c_in, 3), co = cuda_view(c_out, 3);
    fsc_nccl_op_t copy[2] = {{FSC_OP_ALL_REDUCE, &bar, NULL, FSC_RED_SUM, 0, 0},
                             {FSC_OP_COPY, &co, &ci, FSC_RED_SUM, -1, 0}};
    EXPECT(fsc_nccl_batch(c, copy, 2, 0) == FSC_OK, "batch with a copy: %s", fsc_last_error());
    EXPECT(c_out[0] == 7.0f && c_out[2] == 9.0f, "batched copy gave %g %g", c_out[0], c_out[2]);
    copy[1].tensor = &to;
    EXPECT(fsc_nccl_batch(c, copy, 2, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "copy: output has 4 elements"),
           "copy of unequal sizes: %s", fsc_last_error());
    /* an all-to-all of one rank: its plan is the own block's copy */
    float a_in[6] = {1, 2, 3, 4, 5, 6}, a_out[6] = {0};
    fsc_tensor_t ai = cuda_view(a_in, 6), ao = cuda_view(a_out, 6), views[2];
    fsc_nccl_op_t plan[1];
    size_t n = 0;
    EXPECT(fsc_comm_all_to_all_plan(&ao, &ai, NULL, NULL, 0, 1, FSC_DEV_CUDA, 0, views, plan, &n) == FSC_OK && n == 1,
           "plan: %s", fsc_last_error());
    EXPECT(fsc_nccl_all_to_all(c, plan, n, 0) == FSC_OK, "all_to_all: %s", fsc_last_error());
    EXPECT(a_out[0] == 1.0f && a_out[5] == 6.0f, "all_to_all copied %g %g", a_out[0], a_out[5]);
    EXPECT(fsc_comm_all_to_all_plan(&ao, &ai, NULL, NULL, 0, 1, FSC_DEV_CPU, -1, views, plan, &n) == FSC_ERR_VALUE &&
               strstr(fsc_last_error(), "all_to_all_single: output is on cuda; expected a cpu tensor"),
           "plan on the wrong device: %s", fsc_last_error());
    nap(0.3); /* the watchdog reaps the completed operations */
    EXPECT(fsc_nccl_comm_destroy(c, 1.0) == FSC_OK, "destroy: %s", fsc_last_error());
    fsc_nccl_comm_free(c);
    EXPECT(fake_live_events() == 0, "%d events leaked", fake_live_events());
}

/* FAIRSCALE_C_NCCL_BLOCKING picks the communicator's mode: unset or 1 blocking, 0 non-blocking;
 * anything else is refused before NCCL is called. */
static void test_blocking_mode(void) {
    fake_set_mode(FAKE_OK);
    setenv("FAIRSCALE_C_NCCL_BLOCKING", "0", 1);
    fsc_nccl_comm_t *c = new_comm(0);
    EXPECT(fake_last_blocking() == 0, "FAIRSCALE_C_NCCL_BLOCKING=0: config.blocking=%d", fake_last_blocking());
    if (c) fsc_nccl_comm_free(c);
    unsetenv("FAIRSCALE_C_NCCL_BLOCKING");
    c = new_comm(0);
    EXPECT(fake_last_blocking() == 1, "unset: config.blocking=%d", fake_last_blocking());
    if (c != NULL) {
        float in[2] = {1, 2}, out[2] = {0};
        fsc_tensor_t ti = cuda_view(in, 2), to = cuda_view(out, 2);
        EXPECT(fsc_nccl_all_gather(c, &to, &ti, 0) == FSC_OK && fsc_nccl_wait(c, 0, 1.0) == FSC_OK,
               "all_gather on a blocking communicator: %s", fsc_last_error());
        EXPECT(out[1] == 2.0f, "all_gather copied %g", out[1]);
        /* destroy releases it locally (a blocking finalize would wait for peers without a bound) */
        int before = fake_aborts();
        EXPECT(fsc_nccl_comm_destroy(c, 1.0) == FSC_OK, "destroy: %s", fsc_last_error());
        EXPECT(fake_aborts() == before + 1, "destroy of a blocking communicator did not release it");
        fsc_nccl_comm_free(c);
    }
    /* ... and a destroy while one of its operations never completes ends at its timeout */
    c = new_comm(0);
    if (c != NULL) {
        float x[2] = {1, 2};
        fsc_tensor_t tx = cuda_view(x, 2);
        fake_set_mode(FAKE_HANG);
        EXPECT(fsc_nccl_all_reduce(c, &tx, FSC_RED_SUM, 0) == FSC_OK, "all_reduce: %s", fsc_last_error());
        double t = now();
        fsc_status_t dst = fsc_nccl_comm_destroy(c, 0.3);
        double waited = now() - t;
        EXPECT(dst == FSC_ERR_TIMEOUT && strstr(fsc_last_error(), "1 operation(s) still running"),
               "destroy with a hung operation: status %d, %s", (int)dst, fsc_last_error());
        EXPECT(waited < 2.0, "destroy with a hung operation took %.2f s (timeout 0.3 s)", waited);
        fake_set_mode(FAKE_OK);
        fsc_nccl_comm_free(c);
    }
    /* A blocking init whose peers never join: the caller gets FSC_ERR_TIMEOUT at the deadline, and
     * the init thread it leaves behind aborts the communicator once NCCL's call returns. */
    unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES];
    fsc_nccl_comm_t *bad = NULL;
    EXPECT(fsc_nccl_get_unique_id(id) == FSC_OK, "unique id: %s", fsc_last_error());
    fake_set_mode(FAKE_HANG);
    int aborts = fake_aborts();
    double t0 = now();
    fsc_status_t st = fsc_nccl_comm_init(id, 0, 1, 0, 0.3, &bad);
    double took = now() - t0;
    EXPECT(st == FSC_ERR_TIMEOUT && bad == NULL && strstr(fsc_last_error(), "not every rank joined the blocking"),
           "blocking init without peers: status %d, %s", (int)st, fsc_last_error());
    EXPECT(took >= 0.25 && took < 2.0, "blocking init gave up after %.2f s (timeout 0.3 s)", took);
    EXPECT(fake_aborts() == aborts, "aborted before NCCL's init returned");
    fake_set_mode(FAKE_OK);
    EXPECT(wait_for_aborts(aborts + 1, 2.0) < 2.0, "the abandoned blocking communicator was not aborted");
    setenv("FAIRSCALE_C_NCCL_BLOCKING", "yes", 1);
    EXPECT(fsc_nccl_comm_init(id, 0, 1, 0, 0, &bad) == FSC_ERR_VALUE && bad == NULL &&
               strstr(fsc_last_error(), "FAIRSCALE_C_NCCL_BLOCKING='yes': expected 1 (default) or 0"),
           "FAIRSCALE_C_NCCL_BLOCKING=yes: %s", fsc_last_error());
    unsetenv("FAIRSCALE_C_NCCL_BLOCKING");
}

/* A blocking communicator's enqueue that never returns (a peer that never connects): the caller
 * gets FSC_ERR_TIMEOUT at its deadline, the communicator is dead for the next call, and once
 * NCCL's call returns the submitter thread aborts it, also after the communicator was freed. */
static void test_blocking_enqueue_timeout(void) {
    setenv("FAIRSCALE_C_NCCL_BLOCKING", "1", 1);
    for (int free_first = 0; free_first < 2; free_first++) {
        fake_set_mode(FAKE_OK);
        fsc_nccl_comm_t *c = new_comm(0.3);
        if (c == NULL) break;
        float x[2] = {1, 2}, y[2] = {0};
        fsc_tensor_t tx = cuda_view(x, 2), ty = cuda_view(y, 2);
        fsc_nccl_op_t ops[2] = {{FSC_OP_ALL_GATHER, &ty, &tx, FSC_RED_SUM, 0, 0},
                                {FSC_OP_ALL_REDUCE, &tx, NULL, FSC_RED_SUM, 0, 0}};
        EXPECT(fsc_nccl_batch(c, ops, 2, 0) == FSC_OK && y[1] == 2.0f, "batch on the submitter: %s, y[1]=%g",
               fsc_last_error(), y[1]);
        int aborts = fake_aborts();
        fake_set_mode(FAKE_ENQUEUE_HANG);
        double t0 = now();
        fsc_status_t st = fsc_nccl_all_reduce(c, &tx, FSC_RED_SUM, 0);
        double took = now() - t0;
        EXPECT(st == FSC_ERR_TIMEOUT && strstr(fsc_last_error(),
                                               "all_reduce #2 on rank 0 of 1 (cuda:0): NCCL's enqueue "
                                               "did not return within 0.3 s"),
               "stuck enqueue: status %d, %s", (int)st, fsc_last_error());
        EXPECT(took >= 0.25 && took < 0.9, "stuck enqueue gave up after %.2f s (timeout 0.3 s)", took);
        st = fsc_nccl_all_reduce(c, &tx, FSC_RED_SUM, 0);
        EXPECT(st == FSC_ERR_COMM && strstr(fsc_last_error(), "aborted earlier") &&
                   strstr(fsc_last_error(), "enqueue did not return"),
               "the call after a stuck enqueue: status %d, %s", (int)st, fsc_last_error());
        EXPECT(fake_aborts() == aborts, "aborted while NCCL's call was still running");
        if (free_first) fsc_nccl_comm_free(c); /* returns at once; the thread is still inside NCCL */
        fake_set_mode(FAKE_OK);
        EXPECT(wait_for_aborts(aborts + 1, 2.0) < 2.0, "the abandoned communicator was not aborted");
        nap(0.05);
        EXPECT(fake_aborts() == aborts + 1, "aborted %d times", fake_aborts() - aborts);
        if (!free_first) {
            EXPECT(fsc_nccl_comm_destroy(c, 1.0) == FSC_OK, "destroy after abandon: %s", fsc_last_error());
            fsc_nccl_comm_free(c);
        }
    }
    unsetenv("FAIRSCALE_C_NCCL_BLOCKING");
}

/* The hand-over to the submitter thread, whether it is still polling (the next call comes at
 * once) or asleep (gaps past its 200 us of polling): no call is lost or late. A lost wake-up would
 * show as FSC_ERR_TIMEOUT after the 1 s timeout. */
static void test_submitter_handoff(void) {
    setenv("FAIRSCALE_C_NCCL_BLOCKING", "1", 1);
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(1.0);
    if (c != NULL) {
        float x[4] = {0}, y[4] = {0};
        fsc_tensor_t tx = cuda_view(x, 4), ty = cuda_view(y, 4);
        unsigned seed = 12345;
        double worst = 0;
        for (int i = 0; i < 2000 && failures == 0; i++) {
            seed = seed * 1103515245u + 12345u;
            double gap = (double)((seed >> 16) % 400) * 1e-6; /* 0-399 us */
            if (gap > 0) nap(gap);
            x[0] = (float)i;
            double t0 = now();
            fsc_status_t st = fsc_nccl_all_gather(c, &ty, &tx, 0);
            double took = now() - t0;
            worst = took > worst ? took : worst;
            EXPECT(st == FSC_OK && y[0] == (float)i, "call %d after a %.0f us gap: status %d, y[0]=%g, %s", i,
                   gap * 1e6, (int)st, y[0], fsc_last_error());
        }
        EXPECT(worst < 0.5, "slowest hand-over %.3f s", worst);
        fsc_nccl_comm_free(c);
    }
    unsetenv("FAIRSCALE_C_NCCL_BLOCKING");
}

/* Block counts whose product with the group size overflows int64 are refused, not wrapped: at 4
 * ranks an input of 2^62 float32 elements would "match" an empty output (4 x 2^62 wraps to 0),
 * and the copy would write 2^64 bytes into it. */
static void test_block_count_overflow(void) {
    unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES];
    fsc_nccl_comm_t *c = NULL;
    EXPECT(fsc_nccl_get_unique_id(id) == FSC_OK && fsc_nccl_comm_init(id, 0, 4, 0, 1.0, &c) == FSC_OK,
           "init at 4 ranks: %s", fsc_last_error());
    if (c == NULL) return;
    float x[4] = {0};
    fsc_tensor_t huge = cuda_view(x, (int64_t)1 << 62), empty = cuda_view(x, 0);
    EXPECT(fsc_nccl_all_gather(c, &empty, &huge, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "overflows int64"),
           "all_gather with a wrapping output count: %s", fsc_last_error());
    EXPECT(fsc_nccl_reduce_scatter(c, &huge, &empty, FSC_RED_SUM, 0) == FSC_ERR_VALUE &&
               strstr(fsc_last_error(), "overflows int64"),
           "reduce_scatter with a wrapping input count: %s", fsc_last_error());
    EXPECT(fsc_comm_check_blocks("all_gather", "output", 12, "input", 3, 4) == FSC_OK, "12 = 4 x 3 refused");
    EXPECT(fsc_comm_check_blocks("all_gather", "output", 11, "input", 3, 4) == FSC_ERR_VALUE &&
               strstr(fsc_last_error(), "output has 11 elements; expected group size (4) x input elements (3) = 12"),
           "message: %s", fsc_last_error());
    fsc_nccl_comm_abort(c);
    fsc_nccl_comm_free(c);
}

/* What fsc_gpu_fs_adam_plan handed its visitor, checked as it comes. */
typedef struct {
    fsc_tensor_t *const *t;
    const fsc_fs_adam_scalars_t *sc;
    int64_t n, next; /* the next non-empty parameter a table or a single launch must start at */
    int tables, singles, full_tables;
} plan_seen_t;

static int64_t next_nonempty(plan_seen_t *p, int64_t i) {
    while (i < p->n && p->t[i * 5]->numel == 0) i++;
    return i;
}

static fsc_status_t plan_visit(void *ctx, const fsc_fs_adam_table_t *tab, const int codes[4], int64_t first,
                               int64_t single) {
    plan_seen_t *p = ctx;
    EXPECT(first == next_nonempty(p, p->next), "launch starts at parameter %lld, expected %lld", (long long)first,
           (long long)next_nonempty(p, p->next));
    if (single >= 0) {
        EXPECT(tab == NULL && single == first, "a single launch: table %p, single %lld", (const void *)tab,
               (long long)single);
        p->singles++;
        p->next = single + 1;
        return FSC_OK;
    }
    EXPECT(tab->count >= 1 && tab->count <= FSC_FS_ADAM_TABLE, "table of %d parameters", tab->count);
    EXPECT(tab->first_block[0] == 0, "first block %d", tab->first_block[0]);
    int64_t i = first;
    for (int c = 0; c < tab->count; c++, i++) {
        i = next_nonempty(p, i);
        fsc_tensor_t *const *ti = &p->t[i * 5];
        int blocks = tab->first_block[c + 1] - tab->first_block[c];
        EXPECT(tab->param[c] == ti[0]->data && tab->grad[c] == ti[1]->data && tab->exp_avg[c] == ti[2]->data &&
                   tab->exp_avg_sq[c] == ti[3]->data && tab->copy[c] == (ti[4] ? ti[4]->data : NULL),
               "table entry %d is not parameter %lld", c, (long long)i);
        EXPECT(tab->step_size[c] == p->sc[i].step_size, "parameter %lld: step size %g, expected %g", (long long)i,
               tab->step_size[c], p->sc[i].step_size);
        EXPECT(tab->numel[c] == ti[0]->numel && (int64_t)blocks == (ti[0]->numel + 4095) / 4096,
               "parameter %lld: %lld elements in %d blocks", (long long)i, tab->numel[c], blocks);
        int mine[4] = {ti[0]->dtype == FSC_FLOAT16    ? 1
                       : ti[0]->dtype == FSC_BFLOAT16 ? 2
                                                      : 0,
                       ti[1]->dtype == FSC_FLOAT16    ? 1
                       : ti[1]->dtype == FSC_BFLOAT16 ? 2
                                                      : 0,
                       ti[2]->dtype == FSC_FLOAT16 ? 1 : 0, ti[4] ? 1 : -1};
        EXPECT(memcmp(mine, codes, sizeof(mine)) == 0, "parameter %lld's dtypes differ from its table's", (long long)i);
    }
    /* a table ends only where it must: full, the end, or a parameter that cannot join it */
    int64_t after = next_nonempty(p, i);
    if (tab->count < FSC_FS_ADAM_TABLE && after < p->n) {
        fsc_tensor_t *const *ta = &p->t[after * 5];
        fsc_tensor_t *const *tl = &p->t[(i - 1) * 5]; /* the table's last parameter */
        int joins = ta[0]->dtype == tl[0]->dtype && ta[1]->dtype == tl[1]->dtype && ta[2]->dtype == tl[2]->dtype &&
                    (ta[4] != NULL) == (tl[4] != NULL) && ta[0]->numel < ((int64_t)1 << 40);
        EXPECT(!joins, "table of %d ended before parameter %lld, which could join it", tab->count, (long long)after);
    }
    p->full_tables += tab->count == FSC_FS_ADAM_TABLE;
    p->tables++;
    p->next = i;
    return FSC_OK;
}

/* fsc_gpu_fs_adam_plan (Adam's CUDA launches, planned on the host): every non-empty parameter in
 * exactly one launch, in order; tables of at most 24 parameters of one dtype combination with
 * one block per 4096 elements; a parameter too large for a table's block count alone. */
static void test_fs_adam_plan(void) {
    enum { N = 70 };
    static float mem[5][N]; /* distinct addresses; the plan never touches the data */
    static uint16_t half[N];
    fsc_tensor_t ts[N][5], *t[N * 5];
    fsc_fs_adam_scalars_t sc[N];
    memset(sc, 0, sizeof(sc));
    for (int i = 0; i < N; i++) {
        sc[i].step_size = 1.0f + (float)i; /* each parameter its own */
        int64_t numel = i % 9 == 4 ? 0 : (int64_t)((i * 7919) % 30000) + 1;
        if (i == 10 || i == 11) numel = 4096 * (i - 9); /* whole chunks */
        if (i == 40) numel = (int64_t)1 << 45;          /* more chunks than INT32_MAX / 2 */
        for (int k = 0; k < 5; k++) {
            ts[i][k] = cuda_view(&mem[k][i], numel);
            t[i * 5 + k] = &ts[i][k];
        }
        if (i >= 50 && i < 60) { /* float16 parameters and gradients, float16 then float32 state */
            for (int k = 0; k < 4; k++) ts[i][k].dtype = k < 2 || i < 55 ? FSC_FLOAT16 : FSC_FLOAT32;
        }
        if (i >= 60) { /* MIXED_PRECISION's master step: float16 gradient and a float16 copy */
            ts[i][1].dtype = FSC_FLOAT16;
            ts[i][4].dtype = FSC_FLOAT16;
            ts[i][4].data = &half[i];
        } else {
            t[i * 5 + 4] = NULL;
        }
    }
    plan_seen_t seen = {.t = t, .sc = sc, .n = N};
    EXPECT(fsc_gpu_fs_adam_plan(t, sc, N, plan_visit, &seen) == FSC_OK, "plan: %s", fsc_last_error());
    EXPECT(next_nonempty(&seen, seen.next) == N, "the plan stopped at parameter %lld", (long long)seen.next);
    EXPECT(seen.singles == 1, "%d single launches, expected 1 (parameter 40)", seen.singles);
    EXPECT(seen.full_tables >= 1, "no table of %d parameters", FSC_FS_ADAM_TABLE);
    seen = (plan_seen_t){.t = t, .sc = sc, .n = 0};
    EXPECT(fsc_gpu_fs_adam_plan(t, sc, 0, plan_visit, &seen) == FSC_OK && seen.tables == 0, "no parameters: %d tables",
           seen.tables);
}

/* fsc_gpu_pack_blocks: the CPU layout (block r of every source, in order, for r = 0..world-1),
 * one 2D copy per non-empty source, and the CPU version's argument checks. */
static void test_pack_blocks(void) {
    float a[6] = {0, 1, 2, 3, 4, 5}, b[3] = {10, 11, 12}, c[9] = {20, 21, 22, 23, 24, 25, 26, 27, 28}, out[18];
    float cpu_out[18];
    fsc_tensor_t srcs[4] = {cuda_view(a, 6), cuda_view(b, 0), cuda_view(c, 9), cuda_view(b, 3)};
    fsc_tensor_t dst = cuda_view(out, 18), cpu_dst = cuda_view(cpu_out, 18), cpu_srcs[4];
    memset(out, 0, sizeof(out));
    int before = fake_copies(1);
    EXPECT(fsc_gpu_pack_blocks(&dst, srcs, 4, 3, 0) == FSC_OK, "pack: %s", fsc_last_error());
    EXPECT(fake_copies(1) - before == 3, "%d 2D copies for 3 non-empty sources", fake_copies(1) - before);
    cpu_dst.device_type = FSC_DEV_CPU;
    for (int i = 0; i < 4; i++) cpu_srcs[i] = srcs[i], cpu_srcs[i].device_type = FSC_DEV_CPU;
    EXPECT(fsc_tensor_pack_blocks(&cpu_dst, cpu_srcs, 4, 3) == FSC_OK, "cpu pack: %s", fsc_last_error());
    EXPECT(memcmp(out, cpu_out, sizeof(out)) == 0, "CUDA and CPU packing differ");
    /* rank 1's row: a[2:4], c[3:6], b[1:2] */
    EXPECT(out[6] == 2 && out[7] == 3 && out[8] == 23 && out[10] == 25 && out[11] == 11, "row 1: %g %g %g %g %g",
           out[6], out[7], out[8], out[10], out[11]);
    fsc_tensor_t short_dst = cuda_view(out, 17);
    EXPECT(fsc_gpu_pack_blocks(&short_dst, srcs, 4, 3, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "'dst' has 17"),
           "short dst: %s", fsc_last_error());
    EXPECT(fsc_gpu_pack_blocks(&dst, srcs, 4, 4, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "world=4"),
           "indivisible: %s", fsc_last_error());
    EXPECT(fsc_gpu_pack_blocks(&cpu_dst, srcs, 4, 3, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "CUDA tensor"),
           "CPU dst: %s", fsc_last_error());
    srcs[2].device_id = 1;
    EXPECT(fsc_gpu_pack_blocks(&dst, srcs, 4, 3, 0) == FSC_ERR_VALUE && strstr(fsc_last_error(), "dst's device"),
           "other device: %s", fsc_last_error());
}

/* A collective that never completes (a peer died mid-operation), and the host never waits on
 * the communicator: the watchdog aborts it after the timeout, and a host synchronize that was
 * blocked behind the collective returns. */
static void test_watchdog_timeout(void) {
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(1.0);
    if (c == NULL) return;
    int aborts0 = fake_aborts();
    float buf[8] = {0};
    fsc_tensor_t t = cuda_view(buf, 8);
    EXPECT(fsc_nccl_all_reduce(c, &t, FSC_RED_SUM, 0) == FSC_OK, "all_reduce: %s", fsc_last_error());
    fake_set_mode(FAKE_HANG);
    EXPECT(fsc_nccl_all_gather(c, &t, &(fsc_tensor_t){0}, 0) == FSC_ERR_VALUE, "bad input accepted");
    fsc_tensor_t half = cuda_view(buf, 8);
    EXPECT(fsc_nccl_all_reduce(c, &half, FSC_RED_SUM, 0) == FSC_OK, "hung all_reduce enqueue: %s", fsc_last_error());
    fake_set_mode(FAKE_OK);
    /* like loss.item() after a step: blocks until the watchdog aborts the communicator */
    double t0 = now();
    fsc_status_t st = fsc_gpu_stream_synchronize(0, 0);
    double took = now() - t0;
    EXPECT(st == FSC_OK, "synchronize: %s", fsc_last_error());
    EXPECT(took > 0.8 && took < 5.0, "synchronize returned after %.2f s (timeout 1 s)", took);
    EXPECT(fake_aborts() == aborts0 + 1, "communicator not aborted (%d aborts)", fake_aborts() - aborts0);
    st = fsc_nccl_all_reduce(c, &t, FSC_RED_SUM, 0);
    const char *msg = fsc_last_error();
    EXPECT(st == FSC_ERR_COMM, "op after watchdog abort returned %d", (int)st);
    EXPECT(strstr(msg, "watchdog") && strstr(msg, "all_reduce #2") && strstr(msg, "FAIRSCALE_C_TIMEOUT"),
           "message does not name the watchdog, the op and the timeout: %s", msg);
    EXPECT(fsc_nccl_wait(c, 0, 1.0) == FSC_ERR_COMM, "wait after abort did not fail");
    fsc_nccl_comm_free(c);
    EXPECT(fake_live_events() == 0, "%d events leaked", fake_live_events());
}

/* NCCL reports an asynchronous error (a peer's process exited): the watchdog aborts at once,
 * long before the timeout. */
static void test_watchdog_async_error(void) {
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(30.0);
    if (c == NULL) return;
    int aborts0 = fake_aborts();
    float in[2] = {1, 2}, out[4] = {0};
    fsc_tensor_t ti = cuda_view(in, 2), to = cuda_view(out, 2);
    fake_set_mode(FAKE_ASYNC_ERROR);
    EXPECT(fsc_nccl_reduce_scatter(c, &to, &ti, FSC_RED_SUM, 0) == FSC_OK, "enqueue: %s", fsc_last_error());
    fake_set_mode(FAKE_OK);
    double took = wait_for_aborts(aborts0 + 1, 10.0);
    EXPECT(fake_aborts() == aborts0 + 1 && took < 2.0, "async error not acted on (%.2f s)", took);
    fsc_status_t st = fsc_nccl_broadcast(c, &to, 0, 0);
    const char *msg = fsc_last_error();
    EXPECT(st == FSC_ERR_COMM, "op after async error returned %d", (int)st);
    EXPECT(strstr(msg, "watchdog") && strstr(msg, "remote process exited") && strstr(msg, "reduce_scatter #1"),
           "message does not carry the NCCL error and the op: %s", msg);
    fsc_nccl_comm_free(c);
}

/* Releasing a communicator with a hung operation and a live watchdog: returns promptly. */
static void test_free_while_pending(void) {
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(60.0);
    if (c == NULL) return;
    float buf[4] = {0};
    fsc_tensor_t t = cuda_view(buf, 4);
    fake_set_mode(FAKE_HANG);
    for (int i = 0; i < 5; i++) EXPECT(fsc_nccl_all_reduce(c, &t, FSC_RED_MAX, 0) == FSC_OK, "enqueue %d", i);
    fake_set_mode(FAKE_OK);
    double t0 = now();
    fsc_nccl_comm_free(c);
    EXPECT(now() - t0 < 1.0, "free took %.2f s", now() - t0);
    EXPECT(fake_live_events() == 0, "%d events leaked", fake_live_events());
}

/* A fork() child: every call refuses (no NCCL, no lock), and releasing the communicator returns at
 * once without aborting the parent's; the parent's communicator keeps working. */
static void test_fork_child(void) {
    fake_set_mode(FAKE_OK);
    fsc_nccl_comm_t *c = new_comm(0);
    if (c == NULL) return;
    float buf[4] = {0};
    fsc_tensor_t t = cuda_view(buf, 4);
    pid_t child = fork();
    if (child == 0) {
        int aborts0 = fake_aborts();
        int ok = fsc_nccl_all_reduce(c, &t, FSC_RED_SUM, 0) == FSC_ERR_COMM && strstr(fsc_last_error(), "fork()");
        ok = ok && fsc_nccl_wait(c, 0, 1.0) == FSC_ERR_COMM && fsc_nccl_comm_destroy(c, 1.0) == FSC_ERR_COMM;
        fsc_nccl_comm_free(c);
        ok = ok && fake_aborts() == aborts0;
        _exit(ok ? 0 : 1);
    }
    int status = wait_or_kill(child, 5.0);
    EXPECT(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "fork() child: status 0x%x", status);
    EXPECT(fsc_nccl_all_reduce(c, &t, FSC_RED_SUM, 0) == FSC_OK && fsc_nccl_wait(c, 0, 1.0) == FSC_OK,
           "parent after the child: %s", fsc_last_error());
    fsc_nccl_comm_free(c);
}

int main(void) {
    void *fake = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (fake == NULL || dlsym(fake, "fake_set_mode") == NULL) {
        fprintf(stderr, "test_nccl_fake: the fake libnccl.so.2 is not on LD_LIBRARY_PATH (%s)\n", dlerror());
        return 2;
    }
    *(void **)&fake_set_mode = dlsym(fake, "fake_set_mode");
    *(void **)&fake_aborts = dlsym(fake, "fake_aborts");
    *(void **)&fake_live_events = dlsym(fake, "fake_live_events");
    *(void **)&fake_copies = dlsym(fake, "fake_copies");
    *(void **)&fake_last_blocking = dlsym(fake, "fake_last_blocking");
    EXPECT(fsc_nccl_load(NULL, 0) == FSC_OK, "load: %s", fsc_last_error());
    EXPECT(fsc_nccl_version() == 23102, "version %d", fsc_nccl_version());
    EXPECT(fsc_gpu_load() == FSC_OK, "driver: %s", fsc_last_error());
    test_pack_blocks();
    test_fs_adam_plan();
    test_block_count_overflow();
    test_blocking_mode();
    test_blocking_enqueue_timeout();
    test_submitter_handoff();
    /* the rest in both modes: blocking (the default, calls on the submitter thread), non-blocking */
    for (int blocking = 1; blocking >= 0; blocking--) {
        setenv("FAIRSCALE_C_NCCL_BLOCKING", blocking ? "1" : "0", 1);
        int before = failures;
        test_ops_and_wait();
        test_watchdog_timeout();
        test_watchdog_async_error();
        test_free_while_pending();
        test_fork_child();
        if (failures > before) fprintf(stderr, "(the failures above: FAIRSCALE_C_NCCL_BLOCKING=%d)\n", blocking);
    }
    unsetenv("FAIRSCALE_C_NCCL_BLOCKING");
    if (failures) {
        fprintf(stderr, "test_nccl_fake: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_nccl_fake: all passed\n");
    return 0;
}
