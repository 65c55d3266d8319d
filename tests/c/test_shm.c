/* test_shm.c — fork()-based tests of the shm collective engine without Python: every op and a
 * few dtypes/sizes at 2, 3 and 4 ranks, async ordering, mismatches, dead and missing peers,
 * float16/bfloat16 conversions, and an empty /dev/shm afterwards. Exit status 0 = all passed. */
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/half.h"
#include "comm/shm_internal.h"
#include "comm/shm_reduce.h"
#include "expect.h"

/* ---- element access by dtype ---- */
static double get(const void *p, fsc_dtype_t dt, size_t i) {
    switch (dt) {
        case FSC_FLOAT16: return fsc_half_to_float(((const uint16_t *)p)[i]);
        case FSC_BFLOAT16: return fsc_bf16_to_float(((const uint16_t *)p)[i]);
        case FSC_FLOAT32: return ((const float *)p)[i];
        case FSC_FLOAT64: return ((const double *)p)[i];
        case FSC_INT32: return ((const int32_t *)p)[i];
        case FSC_INT64: return (double)((const int64_t *)p)[i];
        case FSC_UINT8: return ((const uint8_t *)p)[i];
        default: return NAN;
    }
}

static void set(void *p, fsc_dtype_t dt, size_t i, double v) {
    switch (dt) {
        case FSC_FLOAT16: ((uint16_t *)p)[i] = fsc_float_to_half((float)v); break;
        case FSC_BFLOAT16: ((uint16_t *)p)[i] = fsc_float_to_bf16((float)v); break;
        case FSC_FLOAT32: ((float *)p)[i] = (float)v; break;
        case FSC_FLOAT64: ((double *)p)[i] = v; break;
        case FSC_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
        case FSC_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
        case FSC_UINT8: ((uint8_t *)p)[i] = (uint8_t)(int)v; break;
        default: break;
    }
}

/* Small integers: exact in every dtype, sums of 4 stay exact in float16/bfloat16/uint8. */
static double val(int rank, size_t i) {
    return (double)((i * 7 + (size_t)rank * 13) % 17) + (rank == 1 ? 3 : 0);
}

static double red(fsc_reduce_op_t op, int size, size_t i) {
    double acc = val(0, i);
    for (int r = 1; r < size; r++) {
        double v = val(r, i);
        acc = op == FSC_RED_MAX ? fmax(acc, v) : op == FSC_RED_MIN ? fmin(acc, v) : acc + v;
    }
    return op == FSC_RED_AVG ? acc / size : acc;
}

static int close_to(double got, double want, fsc_dtype_t dt) {
    double tol = (dt == FSC_FLOAT16 || dt == FSC_BFLOAT16) ? 0.02 * fabs(want) + 1e-3 : 1e-6 * fabs(want) + 1e-9;
    return fabs(got - want) <= tol;
}

/* ---- spawning ---- */
typedef int (*rank_fn)(fsc_shm_group_t *g, void *ctx);

static int child(int rank, int size, int fd_r, int fd_w, rank_fn fn, void *ctx, int join) {
    fsc_shm_group_t *g = NULL;
    char name[64] = {0};
    fsc_status_t st;
    if (rank == 0) {
        st = fsc_shm_group_open("ctest", NULL, 1, 0, 0, size, &g);
        if (st != FSC_OK) {
            fprintf(stderr, "open: %s\n", fsc_last_error());
            return 2;
        }
        snprintf(name, sizeof(name), "%s", fsc_shm_group_segment_name(g));
        for (int r = 1; r < size; r++)
            if (write(fd_w, name, sizeof(name)) != (ssize_t)sizeof(name)) return 2;
    } else {
        if (read(fd_r, name, sizeof(name)) != (ssize_t)sizeof(name)) return 2;
        st = fsc_shm_group_open("ctest", name, 0, 0, rank, size, &g);
        if (st != FSC_OK) {
            fprintf(stderr, "attach: %s\n", fsc_last_error());
            return 2;
        }
    }
    if (join && (st = fsc_shm_group_join(g)) != FSC_OK) {
        int rc = fn ? fn(NULL, ctx) : 3; /* fn(NULL) lets a test inspect the join error */
        fsc_shm_group_close(g, -1);
        return rc;
    }
    int rc = fn(g, ctx);
    fsc_shm_group_close(g, -1);
    return rc;
}

/* Run fn on `size` forked ranks (only the first `nstart` start); returns the number of ranks
 * that did not exit 0. */
static int spawn(int size, int nstart, rank_fn fn, void *ctx) {
    int fds[2];
    if (pipe(fds) != 0) return size;
    pid_t pids[16];
    for (int r = 0; r < nstart; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            int rc = child(r, size, fds[0], fds[1], fn, ctx, 1);
            fflush(stderr);
            _exit(rc);
        }
    }
    close(fds[0]);
    close(fds[1]);
    int bad = 0;
    for (int r = 0; r < nstart; r++) {
        int status = 0;
        waitpid(pids[r], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "  rank %d of %d exited with status 0x%x\n", r, size, status);
            bad++;
        }
    }
    return bad;
}

static int shm_leftovers(void) {
    DIR *d = opendir("/dev/shm");
    if (d == NULL) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "fsc-", 4) == 0) n++;
    closedir(d);
    return n;
}

/* ---- correctness of every op ---- */
static const fsc_dtype_t DTYPES[] = {FSC_FLOAT32, FSC_FLOAT16, FSC_BFLOAT16, FSC_FLOAT64,
                                     FSC_INT32,   FSC_INT64,   FSC_UINT8};
/* Element counts per rank. The last spans several 1 MiB chunks and reaches the direct reads'
 * timed window (512 KiB and up) for every dtype at 2 ranks. At 3 and 4 ranks, which share the
 * cores, a quarter of it is used: several chunks for the 4- and 8-byte dtypes, and in the
 * gathered and scattered buffers (3 or 4 blocks of it) for every dtype. */
static const size_t SIZES[] = {0, 1, 1001, (3u << 20) / 2 + 17};
static size_t size_for(size_t s, int ranks) {
    return s == sizeof(SIZES) / sizeof(SIZES[0]) - 1 && ranks > 2 ? SIZES[s] / 4 : SIZES[s];
}

/* Bytes by which check_op misaligns its output buffer (0: as malloc returns it). */
static size_t out_shift = 0;

static int check_op(fsc_shm_group_t *g, fsc_comm_op_t op, fsc_reduce_op_t rop, fsc_dtype_t dt, size_t n, int async) {
    int rank = fsc_shm_group_rank(g), size = fsc_shm_group_size(g), bad = 0;
    size_t esz = fsc_dtype_size(dt);
    size_t nin = op == FSC_OP_REDUCE_SCATTER ? n * size : n, nout = op == FSC_OP_ALL_GATHER ? n * size : n;
    uint8_t *in = malloc(nin * esz + 1), *out_mem = malloc(nout * esz + 1 + out_shift), *out = out_mem + out_shift;
    for (size_t i = 0; i < nin; i++) set(in, dt, i, val(rank, i));
    for (size_t i = 0; i < nout; i++) set(out, dt, i, -1);
    int root = size - 1, peer = rank ^ 1;
    fsc_shm_args_t a = {op, rop, op == FSC_OP_SEND || op == FSC_OP_RECV ? peer : root, dt, n, in, out, 0};
    if (op == FSC_OP_SEND && (rank & 1)) a.op = FSC_OP_RECV;
    fsc_status_t st;
    if (async) {
        fsc_shm_work_t *w = NULL;
        st = fsc_shm_submit(g, &a, 1, &w);
        if (st == FSC_OK) st = fsc_shm_work_wait(w, -1);
        fsc_shm_work_release(w);
    } else {
        st = fsc_shm_run(g, &a);
    }
    if (st != FSC_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, fsc_last_error());
        return 1;
    }
    for (size_t i = 0; i < nout && bad < 3; i++) {
        double want, got = get(out, dt, i);
        switch (op) {
            case FSC_OP_ALL_GATHER: want = val((int)(i / (n ? n : 1)), i % (n ? n : 1)); break;
            case FSC_OP_REDUCE_SCATTER: want = red(rop, size, (size_t)rank * n + i); break;
            case FSC_OP_ALL_REDUCE: want = red(rop, size, i); break;
            case FSC_OP_REDUCE: want = rank == root ? red(rop, size, i) : -1; break;
            case FSC_OP_BROADCAST: want = val(root, i); break;
            default: want = a.op == FSC_OP_RECV ? val(peer, i) : -1; break;
        }
        if (dt == FSC_UINT8 && want < 0) want += 256;
        if (!close_to(got, want, dt)) {
            fprintf(stderr, "rank %d/%d %s %s dtype=%s n=%zu: out[%zu]=%g want %g\n", rank, size, fsc_comm_op_name(op),
                    fsc_reduce_op_name(rop), fsc_dtype_name(dt), n, i, got, want);
            bad++;
        }
    }
    free(in);
    free(out_mem);
    return bad;
}

static int rank_all_ops(fsc_shm_group_t *g, void *ctx) {
    int async = *(int *)ctx, bad = 0;
    if (g == NULL) return 5;
    if (async && fsc_shm_engine_start(g) != FSC_OK) return 4;
    const fsc_comm_op_t ops[] = {FSC_OP_BARRIER,    FSC_OP_ALL_GATHER, FSC_OP_REDUCE_SCATTER,
                                 FSC_OP_ALL_REDUCE, FSC_OP_BROADCAST,  FSC_OP_REDUCE,
                                 FSC_OP_SEND};
    for (size_t d = 0; d < sizeof(DTYPES) / sizeof(DTYPES[0]); d++)
        for (size_t s = 0; s < sizeof(SIZES) / sizeof(SIZES[0]); s++)
            for (size_t o = 0; o < sizeof(ops) / sizeof(ops[0]); o++) {
                if (ops[o] == FSC_OP_SEND && (fsc_shm_group_size(g) & 1)) continue;
                int reduces = ops[o] == FSC_OP_ALL_REDUCE || ops[o] == FSC_OP_REDUCE || ops[o] == FSC_OP_REDUCE_SCATTER;
                for (int r = 0; r < (reduces ? FSC_NUM_REDS : 1); r++) {
                    int isfloat = DTYPES[d] <= FSC_FLOAT64;
                    if (r == FSC_RED_AVG && !isfloat) continue;
                    bad +=
                        check_op(g, ops[o], (fsc_reduce_op_t)r, DTYPES[d], size_for(s, fsc_shm_group_size(g)), async);
                    if (bad > 5) return 1;
                }
            }
    return bad ? 1 : 0;
}

/* A contiguous 2-D view (rows x cols) of `data`. */
static fsc_tensor_t view2d(void *data, fsc_dtype_t dt, int64_t rows, int64_t cols) {
    fsc_tensor_t t = {data, dt, FSC_DEV_CPU, 0, 2, rows * cols, {rows, cols}, {cols, 1}, 0};
    return t;
}

/* Rows rank `src` sends to rank `dst` in the uneven all-to-all (some 0). */
static int64_t a2a_rows(int src, int dst) {
    return (src * 3 + dst * 5 + 1) % 4;
}

/* The all-to-all plan run as one batch (sync, then through the queue): every rank's output blocks
 * hold what the others sent, with uneven and empty blocks; bad arguments are refused before
 * anything moves. */
static int rank_all_to_all(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (g == NULL) return 5;
    int rank = fsc_shm_group_rank(g), size = fsc_shm_group_size(g), bad = 0;
    const int64_t cols = 3;
    int64_t out_rows[4], in_rows[4], nout = 0, nin = 0;
    for (int j = 0; j < size; j++) {
        in_rows[j] = a2a_rows(rank, j), out_rows[j] = a2a_rows(j, rank);
        nin += in_rows[j], nout += out_rows[j];
    }
    float *in = malloc((size_t)(nin * cols + 1) * sizeof(float)),
          *out = malloc((size_t)((nout + 1) * cols) * sizeof(float));
    for (int64_t i = 0; i < nin * cols; i++) in[i] = (float)(rank * 1000 + i);
    fsc_tensor_t tin = view2d(in, FSC_FLOAT32, nin, cols), tout = view2d(out, FSC_FLOAT32, nout, cols);
    fsc_tensor_t views[8];
    fsc_comm_call_t calls[7];
    fsc_shm_args_t args[7];
    size_t n = 0;
    for (int async = 0; async <= 1; async++) {
        for (int64_t i = 0; i < nout * cols; i++) out[i] = -1;
        if (fsc_comm_all_to_all_plan(&tout, &tin, out_rows, in_rows, rank, size, FSC_DEV_CPU, -1, views, calls, &n) !=
            FSC_OK) {
            fprintf(stderr, "rank %d plan: %s\n", rank, fsc_last_error());
            return 1;
        }
        if (n != 2 * (size_t)size - 1) return 2;
        for (size_t i = 0; i < n; i++) {
            const fsc_comm_call_t *c = &calls[i];
            fsc_shm_args_t a = {c->op,
                                FSC_RED_SUM,
                                c->peer,
                                c->tensor->dtype,
                                (size_t)c->tensor->numel,
                                c->input ? c->input->data : c->tensor->data,
                                c->tensor->data,
                                0};
            args[i] = a;
        }
        fsc_status_t st;
        if (async) {
            fsc_shm_work_t *w = NULL;
            if (fsc_shm_engine_start(g) != FSC_OK) return 4;
            st = fsc_shm_submit(g, args, n, &w);
            if (st == FSC_OK) st = fsc_shm_work_wait(w, -1);
            fsc_shm_work_release(w);
        } else {
            st = fsc_shm_run_batch(g, args, n);
        }
        if (st != FSC_OK) {
            fprintf(stderr, "rank %d all_to_all: %s\n", rank, fsc_last_error());
            return 1;
        }
        int64_t at = 0;
        for (int src = 0; src < size; src++) {
            int64_t start = 0; /* where src's block for this rank starts in src's input */
            for (int j = 0; j < rank; j++) start += a2a_rows(src, j);
            for (int64_t i = 0; i < out_rows[src] * cols && bad < 3; i++)
                if (out[at + i] != (float)(src * 1000 + start * cols + i)) {
                    fprintf(stderr, "rank %d all_to_all async=%d: from %d element %lld is %g\n", rank, async, src,
                            (long long)i, out[at + i]);
                    bad++;
                }
            at += out_rows[src] * cols;
        }
    }
    /* refused: rows that do not sum to dim 0, a negative row count, an own block of two sizes,
     * output overlapping input, rows of different lengths, equal blocks that do not divide */
    int64_t wrong[4], neg[4], own[4];
    for (int j = 0; j < size; j++) wrong[j] = in_rows[j], neg[j] = in_rows[j], own[j] = out_rows[j];
    wrong[0] += 1, neg[size - 1] = -1, own[rank] += 1;
    fsc_tensor_t shifted = view2d(in + 1, FSC_FLOAT32, nin, cols), narrow = view2d(out, FSC_FLOAT32, nout, cols - 1);
    fsc_tensor_t odd = view2d(out, FSC_FLOAT32, size + 1, 1), odd_in = view2d(in, FSC_FLOAT32, size + 1, 1);
    fsc_tensor_t longer = view2d(out, FSC_FLOAT32, nout + 1, cols);
    struct {
        fsc_tensor_t *out;
        const fsc_tensor_t *in;
        const int64_t *orows, *irows;
        const char *words;
    } refused[] = {
        {&tout, &tin, out_rows, wrong, "'input_split_sizes' sums to"},
        {&tout, &tin, out_rows, neg, "'input_split_sizes' must hold"},
        {&longer, &tin, own, in_rows, "own block"},
        {&shifted, &tin, out_rows, in_rows, "overlaps"},
        {&narrow, &tin, NULL, NULL, "a row of output"},
        {&odd, &odd_in, NULL, NULL, "divide evenly"},
    };
    for (size_t k = 0; k < sizeof(refused) / sizeof(refused[0]); k++) {
        fsc_status_t st = fsc_comm_all_to_all_plan(refused[k].out, refused[k].in, refused[k].orows, refused[k].irows,
                                                   rank, size, FSC_DEV_CPU, -1, views, calls, &n);
        if (st != FSC_ERR_VALUE || strstr(fsc_last_error(), refused[k].words) == NULL) {
            fprintf(stderr, "rank %d: expected '%s', got %d: %s\n", rank, refused[k].words, (int)st, fsc_last_error());
            bad++;
        }
    }
    free(in);
    free(out);
    return bad ? 1 : 0;
}

/* Outputs of 16 MiB and more are written with streaming stores: check them, on an output that
 * is not 16-byte aligned and an element count that leaves a tail. */
static int rank_large_outputs(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (g == NULL) return 5;
    const fsc_comm_op_t ops[] = {FSC_OP_ALL_GATHER, FSC_OP_ALL_REDUCE, FSC_OP_BROADCAST};
    size_t n = ((size_t)17 << 20) / 4 + 3;
    int bad = 0;
    for (out_shift = 0; out_shift <= 4; out_shift += 4)
        for (size_t o = 0; o < sizeof(ops) / sizeof(ops[0]); o++)
            bad += check_op(g, ops[o], FSC_RED_SUM, FSC_FLOAT32, n, 0);
    out_shift = 0;
    return bad ? 1 : 0;
}

/* A fork() child of a rank (the progress thread running) gets an error from every op instead of
 * hanging on a queue nobody serves, and closing the group there returns at once; the parent's
 * group keeps working. */
static int rank_fork_child(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (g == NULL || fsc_shm_engine_start(g) != FSC_OK) return 5;
    float buf[4] = {1, 2, 3, 4};
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, 4, buf, buf, 0};
    fsc_shm_args_t b = {FSC_OP_BARRIER, FSC_RED_SUM, -1, FSC_FLOAT32, 0, NULL, NULL, 0};
    pid_t child = fork();
    if (child == 0) {
        fsc_shm_work_t *w = NULL;
        int ok = fsc_shm_submit(g, &a, 1, &w) == FSC_ERR_COMM && strstr(fsc_last_error(), "fork() child") && w == NULL;
        ok = ok && fsc_shm_run(g, &a) == FSC_ERR_COMM;
        if (!ok) fprintf(stderr, "forked child: %s\n", fsc_last_error());
        fsc_shm_group_close(g, -1);
        _exit(ok ? 0 : 1);
    }
    int status = wait_or_kill(child, 5.0);
    if (status == -1) {
        fprintf(stderr, "forked child did not exit within 5 s\n");
        return 1;
    }
    fsc_shm_work_t *w = NULL;
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && fsc_shm_submit(g, &b, 1, &w) == FSC_OK &&
             fsc_shm_work_wait(w, 10) == FSC_OK;
    fsc_shm_work_release(w);
    return ok ? 0 : 1;
}

/* ---- failures ---- */
static int rank_mismatch(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    float buf[16] = {0};
    int rank = fsc_shm_group_rank(g);
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, rank == 0 ? 10 : 12, buf, buf, 0};
    fsc_status_t st = fsc_shm_run(g, &a);
    int ok = st == FSC_ERR_MISMATCH && strstr(fsc_last_error(), "count=10") && strstr(fsc_last_error(), "count=12");
    if (!ok) fprintf(stderr, "rank %d: mismatch not reported: %d %s\n", rank, st, fsc_last_error());
    /* the group is now unusable and says so with the same message */
    fsc_shm_args_t b = {FSC_OP_BARRIER, FSC_RED_SUM, -1, FSC_FLOAT32, 0, NULL, NULL, 0};
    fsc_status_t st2 = fsc_shm_run(g, &b);
    ok = ok && st2 == FSC_ERR_MISMATCH && strstr(fsc_last_error(), "count=12");
    return ok ? 0 : 1;
}

/* ctx NULL: the counts differ (10 sent, 12 expected); else the tags do (3 sent, 4 expected). */
static int rank_p2p_mismatch(fsc_shm_group_t *g, void *ctx) {
    float buf[16] = {0};
    int rank = fsc_shm_group_rank(g), tags = ctx != NULL;
    size_t count = tags ? 10 : (rank == 0 ? 10 : 12);
    fsc_shm_args_t a = {rank == 0 ? FSC_OP_SEND : FSC_OP_RECV,
                        FSC_RED_SUM,
                        1 - rank,
                        FSC_FLOAT32,
                        count,
                        buf,
                        buf,
                        tags ? 3 + rank : 0};
    const char *sent = tags ? "tag=3" : "send(count=10", *wanted = tags ? "tag=4" : "recv(count=12";
    fsc_status_t st = fsc_shm_run(g, &a);
    int ok;
    if (rank == 1) {
        ok = st == FSC_ERR_MISMATCH && strstr(fsc_last_error(), sent) && strstr(fsc_last_error(), wanted);
        usleep(500000); /* alive while the sender finds out */
    } else {
        /* the send completed when its data was in the buffer; the receiver's refusal reaches the
         * sender at its next op, which then fails naming the recv and the refused message */
        ok = st == FSC_OK;
        fsc_shm_args_t b = {FSC_OP_BARRIER, FSC_RED_SUM, -1, FSC_FLOAT32, 0, NULL, NULL, 0};
        double t0 = fsc_comm_now();
        do st = fsc_shm_run(g, &b);
        while (st == FSC_OK && fsc_comm_now() - t0 < 5);
        ok = ok && st == FSC_ERR_MISMATCH && strstr(fsc_last_error(), wanted) && strstr(fsc_last_error(), sent);
    }
    if (!ok) fprintf(stderr, "rank %d: p2p mismatch not reported: %d %s\n", rank, st, fsc_last_error());
    return ok ? 0 : 1;
}

static int rank_dead_peer(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (fsc_shm_group_rank(g) == 1) _exit(0); /* dies without taking part */
    float buf[4] = {0};
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, 4, buf, buf, 0};
    double t0 = fsc_comm_now();
    fsc_status_t st = fsc_shm_run(g, &a);
    double dt = fsc_comm_now() - t0;
    int ok = st == FSC_ERR_COMM && strstr(fsc_last_error(), "rank 1") && strstr(fsc_last_error(), "all_reduce") &&
             strstr(fsc_last_error(), "ctest") && dt < 5.0;
    if (!ok) fprintf(stderr, "dead peer: st=%d after %.2fs: %s\n", st, dt, fsc_last_error());
    return ok ? 0 : 1;
}

static int rank_missing(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (g != NULL) return 1; /* join must have failed */
    int ok = strstr(fsc_last_error(), "rank(s) 2") != NULL && strstr(fsc_last_error(), "ctest") != NULL;
    if (!ok) fprintf(stderr, "missing rank: %s\n", fsc_last_error());
    return ok ? 0 : 1;
}

static int rank_timeout(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (fsc_shm_group_rank(g) == 1) {
        sleep(2);
        return 0;
    } /* alive but never calls (past the 1 s timeout) */
    float buf[4] = {0};
    fsc_shm_args_t a = {FSC_OP_BROADCAST, FSC_RED_SUM, 0, FSC_FLOAT32, 4, buf, buf, 0};
    fsc_status_t st = fsc_shm_run(g, &a);
    int ok = st == FSC_ERR_TIMEOUT && strstr(fsc_last_error(), "rank 1 did not arrive");
    if (!ok) fprintf(stderr, "timeout: %d %s\n", st, fsc_last_error());
    return ok ? 0 : 1;
}

/* Closing with a grace period: an op whose peer arrives within it completes; one whose peer
 * never comes is abandoned after it (FSC_ERR_COMM "abandoned"), instead of holding the close for
 * the whole timeout (20 s here). *ctx: seconds rank 1 waits before joining, or -1 for never. */
static int rank_close_with_grace(fsc_shm_group_t *g, void *ctx) {
    double late = *(double *)ctx;
    float buf[4] = {1, 2, 3, 4};
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, 4, buf, buf, 0};
    if (fsc_shm_group_rank(g) == 1) {
        if (late < 0) {
            sleep(3); /* outlives the 1 s grace: missing, not dead */
            return 0;
        }
        usleep((useconds_t)(late * 1e6));
        return fsc_shm_run(g, &a) == FSC_OK ? 0 : 1;
    }
    fsc_shm_work_t *w = NULL;
    if (fsc_shm_engine_start(g) != FSC_OK || fsc_shm_submit(g, &a, 1, &w) != FSC_OK) _exit(5);
    double t0 = fsc_comm_now();
    fsc_shm_group_close(g, 1.0);
    double dt = fsc_comm_now() - t0;
    fsc_status_t st = fsc_shm_work_wait(w, 0);
    int ok = late < 0 ? st == FSC_ERR_COMM && strstr(fsc_last_error(), "abandoned while waiting for rank 1") && dt < 2.5
                      : st == FSC_OK && buf[3] == 8.0f;
    if (!ok)
        fprintf(stderr, "close with grace (peer late %g s): st=%d after %.2f s: %s\n", late, st, dt, fsc_last_error());
    fsc_shm_work_release(w);
    _exit(ok ? 0 : 1); /* the group is closed: skip the harness's close */
}

/* A peer that rewrites the segment's header after joining (offsets far outside the mapping, a
 * chunk smaller than an element) moves nothing: each rank uses the layout it validated at attach. */
static int rank_rewritten_header(fsc_shm_group_t *g, void *ctx) {
    (void)ctx;
    if (g == NULL) return 5;
    int rank = fsc_shm_group_rank(g);
    fsc_shm_args_t bar = {FSC_OP_BARRIER, FSC_RED_SUM, -1, FSC_FLOAT32, 0, NULL, NULL, 0};
    if (rank == 1) {
        g->seg->off_slots = g->seg->off_result = g->seg->off_p2p = (uint64_t)1 << 60;
        g->seg->chunk = g->seg->p2p_chunk = 1;
    }
    if (fsc_shm_run(g, &bar) != FSC_OK) return 2;
    enum { N = 100001 };
    static float buf[N];
    for (size_t i = 0; i < N; i++) buf[i] = (float)(i % 7) + (float)rank;
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, N, buf, buf, 0};
    fsc_shm_args_t p2p = {rank == 0 ? FSC_OP_SEND : FSC_OP_RECV, FSC_RED_SUM, 1 - rank, FSC_FLOAT32, N, buf, buf, 0};
    if (fsc_shm_run(g, &a) != FSC_OK || fsc_shm_run(g, &p2p) != FSC_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, fsc_last_error());
        return 1;
    }
    for (size_t i = 0; i < N; i++)
        if (buf[i] != 2.0f * (float)(i % 7) + 1.0f) return 1;
    return 0;
}

/* close() with a grace too long (or not a number) to convert to a time: no grace, so the late
 * peer's op completes (instead of being abandoned at once). */
static int rank_close_with_huge_grace(fsc_shm_group_t *g, void *ctx) {
    double grace = *(double *)ctx;
    float buf[4] = {1, 2, 3, 4};
    fsc_shm_args_t a = {FSC_OP_ALL_REDUCE, FSC_RED_SUM, -1, FSC_FLOAT32, 4, buf, buf, 0};
    if (fsc_shm_group_rank(g) == 1) {
        usleep(300000);
        return fsc_shm_run(g, &a) == FSC_OK ? 0 : 1;
    }
    fsc_shm_work_t *w = NULL;
    if (fsc_shm_engine_start(g) != FSC_OK || fsc_shm_submit(g, &a, 1, &w) != FSC_OK) _exit(5);
    fsc_shm_group_close(g, grace);
    fsc_status_t st = fsc_shm_work_wait(w, 0);
    int ok = st == FSC_OK && buf[3] == 8.0f;
    if (!ok) fprintf(stderr, "close(grace=%g): st=%d: %s\n", grace, st, fsc_last_error());
    fsc_shm_work_release(w);
    _exit(ok ? 0 : 1);
}

static int dev_shm_has(const char *name) {
    char path[128];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    return access(path, F_OK) == 0;
}

/* Segments of dead creators of this uid and pid namespace are swept; those of live processes,
 * of other pid namespaces and of other name forms stay. */
static void test_sweep(void) {
    int fds[2];
    char name[64] = "";
    if (pipe(fds) != 0) return;
    pid_t pid = fork();
    if (pid == 0) { /* creates a 2-rank segment nobody joins, then dies without cleaning up */
        fsc_shm_group_t *g = NULL;
        if (fsc_shm_group_open("sweep", NULL, 1, 0, 0, 2, &g) != FSC_OK) _exit(2);
        snprintf(name, sizeof(name), "%s", fsc_shm_group_segment_name(g));
        if (write(fds[1], name, sizeof(name)) != (ssize_t)sizeof(name)) _exit(2);
        _exit(0);
    }
    EXPECT(read(fds[0], name, sizeof(name)) == (ssize_t)sizeof(name), "no name from the child");
    close(fds[0]);
    close(fds[1]);
    waitpid(pid, NULL, 0);
    char other_ns[64], old_form[64], live[64];
    snprintf(other_ns, sizeof(other_ns), "/fsc-%d-1-0badc0de", (int)pid);
    snprintf(old_form, sizeof(old_form), "/fsc-%d-0badc0de", (int)pid);
    fsc_shm_segment_name(live, sizeof(live)); /* this process: alive */
    const char *keep[] = {other_ns, old_form, live};
    for (int i = 0; i < 3; i++) close(shm_open(keep[i], O_CREAT | O_RDWR, 0600));
    EXPECT(dev_shm_has(name), "the dead creator's segment %s is not there to sweep", name);
    EXPECT(fsc_shm_sweep_stale() >= 1, "nothing swept");
    EXPECT(!dev_shm_has(name), "%s of exited pid %d was not swept", name, (int)pid);
    for (int i = 0; i < 3; i++) {
        EXPECT(dev_shm_has(keep[i]), "%s was swept", keep[i]);
        shm_unlink(keep[i]);
    }
}

/* ---- conversions ---- */
static void test_half(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fsc_half_to_float((uint16_t)h);
        uint16_t back = fsc_float_to_half(f);
        int nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        EXPECT(nan ? (back & 0x7c00) == 0x7c00 && (back & 0x3ff) : back == h, "half roundtrip %04x -> %g -> %04x", h, f,
               back);
        float b = fsc_bf16_to_float((uint16_t)h);
        uint16_t bb = fsc_float_to_bf16(b);
        int bnan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        EXPECT(bnan ? (bb & 0x7f80) == 0x7f80 && (bb & 0x7f) : bb == h, "bf16 roundtrip %04x -> %04x", h, bb);
    }
    EXPECT(fsc_float_to_half(65520.0f) == 0x7c00, "65520 rounds to inf");
    EXPECT(fsc_float_to_half(65519.0f) == 0x7bff, "65519 rounds to max");
    EXPECT(fsc_float_to_half(1.0f + 0x1p-11f) == 0x3c00, "tie rounds to even (down)");
    EXPECT(fsc_float_to_half(1.0f + 3 * 0x1p-11f) == 0x3c02, "tie rounds to even (up)");
    EXPECT(fsc_float_to_half(0x1p-25f) == 0, "half of smallest subnormal rounds to 0");
    EXPECT(fsc_float_to_half(0x1p-24f * 1.5f) == 2, "1.5 subnormal steps round to even 2");
    EXPECT(fsc_float_to_bf16(1.0f + 0x1p-8f) == 0x3f80, "bf16 tie to even");
    /* fp32 accumulation: 2048 + 1 + 1 in float16 is 2050 only if accumulated wider */
    uint16_t a[1] = {fsc_float_to_half(2048.0f)}, b[1] = {fsc_float_to_half(1.0f)}, d[1];
    const void *srcs[3] = {a, b, b};
    fsc_shm_reduce(d, srcs, 3, 1, FSC_FLOAT16, FSC_RED_SUM, 3);
    EXPECT(fsc_half_to_float(d[0]) == 2050.0f, "fp16 sum accumulates in fp32: got %g", fsc_half_to_float(d[0]));
}

/* ---- streaming reductions: the same bits as fsc_shm_reduce ---- */
static void test_reduce_stream(void) {
    enum { N = 3 * 1024 + 7 }; /* whole lines and a tail the caller reduces */
    static double a[N], b[N], c[N], in_place[N], want[N], out[N];
    srand(7);
    for (int i = 0; i < N; i++) {
        a[i] = (rand() - RAND_MAX / 2) * 1e-3;
        b[i] = i % 97 == 0 ? NAN : (rand() - RAND_MAX / 2) * 1e-5;
        c[i] = (rand() - RAND_MAX / 2) * 1e-7;
    }
    for (int dt = 0; dt < 2; dt++)
        for (int op = 0; op < FSC_NUM_REDS; op++) {
            fsc_dtype_t t = dt ? FSC_FLOAT64 : FSC_FLOAT32;
            size_t esz = dt ? 8 : 4, n = N * 8 / esz;
            memcpy(in_place, a, sizeof(a));
            const void *srcs[3] = {a, b, c};
            fsc_shm_reduce(want, srcs, 3, n, t, (fsc_reduce_op_t)op, 3);
            const void *srcs2[3] = {in_place, b, c}; /* the second destination is a source: normal stores */
            void *dsts[2] = {out, in_place};
            size_t done = fsc_shm_reduce_stream(dsts, 2, srcs2, 3, n, t, (fsc_reduce_op_t)op, 3);
            EXPECT(done == n / (64 / esz) * (64 / esz), "dtype %d op %d: %zu of %zu elements streamed", dt, op, done,
                   n);
            EXPECT(memcmp(out, want, done * esz) == 0 && memcmp(in_place, want, done * esz) == 0,
                   "dtype %d op %d: streamed bits differ from fsc_shm_reduce's", dt, op);
        }
    void *odd[1] = {(uint8_t *)out + 4};
    const void *srcs[2] = {a, b};
    EXPECT(fsc_shm_reduce_stream(odd, 1, srcs, 2, 64, FSC_FLOAT32, FSC_RED_SUM, 2) == 0, "misaligned output refused");
    EXPECT(fsc_shm_reduce_stream((void *[]){out}, 1, srcs, 2, 64, FSC_BFLOAT16, FSC_RED_SUM, 2) == 0,
           "bfloat16 left to the caller");
}

int main(void) {
    setenv("FAIRSCALE_C_TIMEOUT", "20", 1);
    test_half();
    test_reduce_stream();
    for (int size = 2; size <= 4; size++)
        for (int async = 0; async <= 1; async++) {
            if (size == 3 && async) continue;
            double t0 = fsc_comm_now();
            EXPECT(spawn(size, size, rank_all_ops, &async) == 0, "all ops at size %d (async=%d)", size, async);
            fprintf(stderr, "all ops, %d ranks, async=%d: %.2f s\n", size, async, fsc_comm_now() - t0);
        }
    for (int size = 2; size <= 4; size++)
        EXPECT(spawn(size, size, rank_all_to_all, NULL) == 0, "all-to-all at size %d", size);
    EXPECT(spawn(2, 2, rank_large_outputs, NULL) == 0, "outputs of 16 MiB and more (streaming stores)");
    EXPECT(spawn(2, 2, rank_fork_child, NULL) == 0, "a fork() child neither uses nor hangs on the group");
    EXPECT(spawn(2, 2, rank_mismatch, NULL) == 0, "collective mismatch reported on both ranks");
    EXPECT(spawn(2, 2, rank_p2p_mismatch, NULL) == 0, "send/recv mismatch reported on both ranks");
    static int tags = 1;
    EXPECT(spawn(2, 2, rank_p2p_mismatch, &tags) == 0, "send/recv tag mismatch reported on both ranks");
    EXPECT(spawn(2, 2, rank_dead_peer, NULL) == 0, "dead peer detected");
    double late = 0.3, never = -1;
    EXPECT(spawn(2, 2, rank_close_with_grace, &late) == 0, "close with a grace period lets a late peer finish");
    EXPECT(spawn(2, 2, rank_close_with_grace, &never) == 0, "close with a grace period abandons a missing peer");
    double huge[] = {1e300, INFINITY, NAN};
    for (int i = 0; i < 3; i++)
        EXPECT(spawn(2, 2, rank_close_with_huge_grace, &huge[i]) == 0, "close(grace=%g) waits for the op", huge[i]);
    EXPECT(spawn(2, 2, rank_rewritten_header, NULL) == 0, "a header rewritten after joining moves nothing");
    test_sweep();
    setenv("FAIRSCALE_C_TIMEOUT", "1", 1);
    EXPECT(spawn(3, 2, rank_missing, NULL) == 0, "rank that never joins reported");
    EXPECT(spawn(2, 2, rank_timeout, NULL) == 0, "stalled peer times out");
    EXPECT(shm_leftovers() == 0, "%d fsc-* segments left in /dev/shm", shm_leftovers());
    fprintf(stderr, "%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
    return failures ? 1 : 0;
}
