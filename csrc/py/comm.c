/* comm.c — binding for the shm collective engine: _C.ShmGroup (one rank's handle on a group; its
 * async ops return a _C.Work, work.c). Arguments are validated here, before anything is sent;
 * blocking waits release the GIL and wake up periodically to honour Ctrl-C. */
#include "binding.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "comm/shm.h"

typedef struct {
    PyObject_HEAD fsc_shm_group_t *g;
    PyObject *pending; /* list of in-flight Work objects, oldest first */
    int joined;
    int inflight; /* threads inside an op with the GIL released (close() waits for them) */
} GroupObject;

/* Seconds an op nobody can wait for any more may still wait for a peer when its group is
 * deallocated; then it is abandoned (as the Python layer does at exit and when unwinding). */
#define FSC_DROP_GRACE_S 2.0

/* ---------------------------------------------------------------- ShmGroup lifecycle */

static PyObject *module_of(PyObject *self) {
    return PyType_GetModule(Py_TYPE(self));
}

/* The check a rendezvous makes while it waits (GIL released): take the GIL for a moment, run
 * Python's signal handlers, then `arg` (a callable or NULL). Nonzero when one of them raised
 * (Ctrl-C, or the callable's error); the exception then waits in this thread's state until the C
 * call returns. */
static int interrupted(void *arg) {
    PyGILState_STATE gs = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    if (!raised && arg != NULL) {
        PyObject *r = PyObject_CallNoArgs((PyObject *)arg);
        raised = r == NULL;
        Py_XDECREF(r);
    }
    PyGILState_Release(gs);
    return raised;
}

/* The groups whose ops this thread is running inline, innermost first: a signal handler run by
 * one op's wait may run an op of its own, on another group. */
typedef struct inline_frame {
    GroupObject *group;
    struct inline_frame *outer;
} inline_frame;
static _Thread_local inline_frame *inline_ops;

static int inside_own_op(GroupObject *self) {
    for (inline_frame *f = inline_ops; f != NULL; f = f->outer)
        if (f->group == self) return 1;
    return 0;
}

/* Install a thread-local interrupt check for a wait; the one it replaces (a signal handler's wait
 * may run inside another's) is put back with fsc_shm_set_interrupt_check(prev.fn, prev.arg). */
typedef struct {
    int (*fn)(void *);
    void *arg;
} interrupt_check;
static interrupt_check swap_interrupt_check(int (*fn)(void *), void *arg) {
    interrupt_check prev;
    fsc_shm_get_interrupt_check(&prev.fn, &prev.arg);
    fsc_shm_set_interrupt_check(fn, arg);
    return prev;
}

/* The check an op running inline on the calling thread makes while it waits: Python's signal
 * handlers (fsc_py_check_signals: only KeyboardInterrupt and SystemExit stop the op). */
static int op_interrupted(void *arg) {
    (void)arg;
    PyGILState_STATE gs = PyGILState_Ensure();
    int raised = fsc_py_check_signals() < 0;
    PyGILState_Release(gs);
    return raised;
}

static int Group_init(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "rank", "size", "segment", "create", "creator_pid", "poll", NULL};
    const char *name = NULL, *segment = NULL;
    int rank = 0, size = 0, create = -1, creator_pid = 0;
    PyObject *poll = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sii|z$piO:ShmGroup", kwlist, &name, &rank, &size, &segment, &create,
                                     &creator_pid, &poll))
        return -1;
    if (poll != Py_None && !PyCallable_Check(poll)) {
        PyErr_Format(PyExc_TypeError, "ShmGroup: argument 'poll' must be a callable or None, got %s",
                     Py_TYPE(poll)->tp_name);
        return -1;
    }
    if (self->pending != NULL) { /* open, or closed: either way it had its one life */
        PyErr_SetString(PyExc_RuntimeError, "ShmGroup is already initialised");
        return -1;
    }
    if (create < 0) create = segment == NULL; /* default: make one without a name, attach with one */
    fsc_status_t st;
    fsc_shm_group_t *g = NULL;
    Py_BEGIN_ALLOW_THREADS /* attaching waits for the creator: Ctrl-C and `poll` may end the wait */
    interrupt_check prev = swap_interrupt_check(interrupted, poll == Py_None ? NULL : poll);
    st = fsc_shm_group_open(name, segment, create, creator_pid, rank, size, &g);
    fsc_shm_set_interrupt_check(prev.fn, prev.arg);
    Py_END_ALLOW_THREADS
    self->g = g;
    if (st != FSC_OK) {
        if (!PyErr_Occurred()) fsc_py_raise(module_of((PyObject *)self), st); /* else: the check's error */
        return -1;
    }
    self->pending = PyList_New(0);
    return self->pending == NULL ? -1 : 0;
}

static int check_open(GroupObject *self) {
    if (self->g == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ShmGroup is closed");
        return -1;
    }
    return 0;
}

/* check_open, and the group has been joined (ops need its progress thread). */
static int check_ready(GroupObject *self) {
    if (check_open(self) < 0) return -1;
    if (!self->joined) {
        fsc_status_t st = fsc_shm_group_status(self->g); /* a failed join says why */
        if (st != FSC_OK) {
            fsc_py_raise(module_of((PyObject *)self), st);
            return -1;
        }
        PyErr_SetString(PyExc_RuntimeError, "ShmGroup has not been joined: call join() before issuing ops");
        return -1;
    }
    return 0;
}

static PyObject *Group_join(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    interrupt_check prev = swap_interrupt_check(interrupted, NULL);
    st = fsc_shm_group_join(self->g);
    fsc_shm_set_interrupt_check(prev.fn, prev.arg);
    if (st == FSC_OK) st = fsc_shm_engine_start(self->g);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return PyErr_Occurred() ? NULL : fsc_py_raise(module_of((PyObject *)self), st);
    self->joined = 1;
    Py_RETURN_NONE;
}

static PyObject *Group_unlink(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->g != NULL) fsc_shm_group_unlink(self->g);
    Py_RETURN_NONE;
}

static PyObject *Group_give_up(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->g != NULL) fsc_shm_group_give_up(self->g);
    Py_RETURN_NONE;
}

/* Close the engine group: drain the queue (every pending Work finishes), abandoning an op still
 * waiting for a peer after grace_s seconds when grace_s >= 0. */
static void group_close(GroupObject *self, double grace_s) {
    if (self->g == NULL) return;
    fsc_shm_group_t *g = self->g;
    self->g = NULL; /* new ops are refused from here on */
    fsc_shm_group_unlink(g);
    Py_BEGIN_ALLOW_THREADS
    fsc_shm_engine_stop(g, grace_s);
    Py_END_ALLOW_THREADS
    /* Another thread may be inside an op on `g` with the GIL released: once the engine has
     * stopped it either finished or is about to fail with "closed"; free `g` only after it left. */
    while (self->inflight > 0) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        Py_END_ALLOW_THREADS
    }
    Py_BEGIN_ALLOW_THREADS
    fsc_shm_group_close(g, -1);
    Py_END_ALLOW_THREADS
}

/* Closing stops the engine, which waits for the op running inline: not from inside it. */
static int check_closable(GroupObject *self) {
    if (self->g == NULL || !inside_own_op(self)) return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "ShmGroup '%s': close() or destroy() from inside an op of the group on the same thread (by a "
                 "signal handler?) would wait for that op forever; close it after the op returns (set a flag "
                 "in the handler)",
                 fsc_shm_group_name(self->g));
    return -1;
}

static PyObject *Group_check_closable(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_closable(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Group_close(GroupObject *self, PyObject *args, PyObject *kwds) {
    double grace_s;
    if (fsc_py_parse_seconds(args, kwds, "close", "grace", &grace_s) < 0) return NULL;
    if (check_closable(self) < 0) return NULL;
    group_close(self, grace_s);
    if (self->pending != NULL && PyList_SetSlice(self->pending, 0, PY_SSIZE_T_MAX, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

static void Group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    /* Ops whose Work someone still holds are waited for; ops nobody can wait for any more (their
     * Work was dropped) get a grace period, then are abandoned, instead of FAIRSCALE_C_TIMEOUT. */
    double grace_s = FSC_DROP_GRACE_S;
    Py_ssize_t n = self->pending != NULL ? PyList_GET_SIZE(self->pending) : 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (Py_REFCNT(PyList_GET_ITEM(self->pending, i)) > 1) grace_s = -1;
    group_close(self, grace_s);
    Py_XDECREF(self->pending);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Group_get_segment(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyUnicode_FromString(fsc_shm_group_segment_name(self->g));
}

static PyObject *Group_get_rank(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromLong(fsc_shm_group_rank(self->g));
}

static PyObject *Group_get_size(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromLong(fsc_shm_group_size(self->g));
}

static PyObject *Group_get_direct_max(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromSize_t(fsc_shm_group_direct_max(self->g));
}

static PyObject *Group_get_read_max(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromSize_t(fsc_shm_group_read_max(self->g));
}

static PyObject *Group_get_mapped_ops(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(fsc_shm_group_mapped_ops(self->g));
}

static PyObject *Group_get_read_ops(GroupObject *self, void *Py_UNUSED(c)) {
    if (check_open(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(fsc_shm_group_read_ops(self->g));
}

static PyObject *Group_get_closed(GroupObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->g == NULL);
}

/* ---------------------------------------------------------------- ops */

/* The engine's arguments for a checked call. */
static fsc_shm_args_t shm_args(const fsc_comm_call_t *c) {
    fsc_shm_args_t a = {c->op, c->redop, -1, FSC_FLOAT32, 0, NULL, NULL, 0};
    if (c->op == FSC_OP_BARRIER) return a;
    const fsc_tensor_t *t = c->tensor;
    a.dtype = t->dtype;
    switch (c->op) {
        case FSC_OP_ALL_GATHER:
            a.count = (size_t)c->input->numel;
            a.in = c->input->data;
            a.out = t->data;
            break;
        case FSC_OP_REDUCE_SCATTER:
        case FSC_OP_COPY:
            a.count = (size_t)t->numel;
            a.in = c->input->data;
            a.out = t->data;
            break;
        default:
            a.root = c->peer;
            a.tag = c->tag;
            a.count = (size_t)t->numel;
            a.in = t->data;
            a.out = t->data;
            break;
    }
    return a;
}

/* Drop finished Works from the front of the pending list (they complete in order). */
static int prune_pending(GroupObject *self) {
    Py_ssize_t n = PyList_GET_SIZE(self->pending), k = 0;
    while (k < n && fsc_shm_work_done(((fsc_py_work_t *)PyList_GET_ITEM(self->pending, k))->work)) k++;
    return k ? PyList_SetSlice(self->pending, 0, k, NULL) : 0;
}

/* Queue `args` for the progress thread; the Work keeps the tensors' owners. */
static PyObject *queue(GroupObject *self, const fsc_shm_args_t *args, size_t n, fsc_py_calls_t *c, int async_op) {
    PyObject *module = module_of((PyObject *)self);
    fsc_module_state *state = fsc_py_state(module);
    fsc_py_work_t *w = PyObject_New(fsc_py_work_t, state->WorkType);
    if (w == NULL) return NULL;
    w->work = NULL;
    w->module = Py_NewRef(module);
    w->owners = fsc_py_imports_owners(&c->args);
    if (w->owners == NULL) {
        Py_DECREF(w);
        return NULL;
    }
    fsc_status_t st = fsc_shm_submit(self->g, args, n, &w->work);
    if (st != FSC_OK) {
        Py_DECREF(w);
        return fsc_py_raise(module, st);
    }
    if (async_op) {
        if (PyList_Append(self->pending, (PyObject *)w) < 0) {
            Py_DECREF(w);
            return NULL;
        }
        return (PyObject *)w;
    }
    if (fsc_py_work_block(w, -1) < 0) {
        /* interrupted or failed: if still running, keep it (and the tensors) alive */
        if (!fsc_shm_work_done(w->work)) {
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            if (PyList_Append(self->pending, (PyObject *)w) < 0) PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
        Py_DECREF(w);
        return NULL;
    }
    Py_DECREF(w);
    Py_RETURN_NONE;
}

/* Run calls that passed the engine's argument rules: a synchronous op on this thread when nothing
 * is queued (no hand-off), else through the queue. Consumes `c`. */
static PyObject *run_checked(GroupObject *self, fsc_py_calls_t *c, int async_op) {
    PyObject *module = module_of((PyObject *)self), *result = NULL;
    size_t n = c->ncalls;
    fsc_shm_args_t stack[4], *args = stack;
    fsc_status_t st;
    if (n > sizeof(stack) / sizeof(stack[0]) && (args = PyMem_Malloc(n * sizeof(*args))) == NULL) {
        PyErr_NoMemory();
        goto exit;
    }
    for (size_t i = 0; i < n; i++) args[i] = shm_args(&c->calls[i]);
    /* importing the tensors or dropping finished Works ran Python code, which may have closed us */
    if (prune_pending(self) < 0 || check_open(self) < 0) goto exit;
    if (inside_own_op(self)) {
        /* a signal handler run by that op's wait: queued, this op would wait for it forever */
        PyErr_Format(PyExc_RuntimeError,
                     "ShmGroup '%s': an op was issued from inside another op of the group on the same thread (by "
                     "a signal handler?), which cannot finish before it returns; issue it after that op (set a "
                     "flag in the handler)",
                     fsc_shm_group_name(self->g));
        goto exit;
    }
    if (!async_op) {
        int ran = 0;
        fsc_shm_group_t *g = self->g;
        inline_frame frame = {self, inline_ops};
        self->inflight++;
        inline_ops = &frame;
        fsc_py_wait_begin();
        Py_BEGIN_ALLOW_THREADS
        interrupt_check prev = swap_interrupt_check(op_interrupted, NULL);
        st = fsc_shm_try_inline(g, args, n, &ran);
        fsc_shm_set_interrupt_check(prev.fn, prev.arg);
        Py_END_ALLOW_THREADS
        inline_ops = frame.outer;
        self->inflight--;
        if (st != FSC_OK && !PyErr_Occurred()) fsc_py_raise(module, st); /* else: KeyboardInterrupt */
        if (fsc_py_wait_end() < 0) goto exit; /* its error, or a handler's now that it has finished */
        if (ran) {
            result = Py_NewRef(Py_None);
            goto exit;
        }
        if (check_open(self) < 0) goto exit; /* closed by another thread meanwhile */
    }
    result = queue(self, args, n, c, async_op);
exit:
    if (args != stack) PyMem_Free(args);
    fsc_py_calls_clear(c);
    return result;
}

/* Check the calls (the engine's rules, one C function for every backend), then run them.
 * Consumes `c`. */
static PyObject *run_calls(GroupObject *self, fsc_py_calls_t *c, int async_op) {
    if (check_ready(self) < 0) { /* an argument's __dlpack__ may have closed the group */
        fsc_py_calls_clear(c);
        return NULL;
    }
    int rank = fsc_shm_group_rank(self->g), size = fsc_shm_group_size(self->g);
    fsc_status_t st = c->ncalls == 1 ? fsc_comm_check_call(&c->calls[0], rank, size, FSC_DEV_CPU, -1)
                                     : fsc_comm_check_batch(c->calls, c->ncalls, rank, size, FSC_DEV_CPU, -1);
    if (st != FSC_OK) {
        fsc_py_calls_clear(c);
        return fsc_py_raise(module_of((PyObject *)self), st);
    }
    return run_checked(self, c, async_op);
}

/* One call with up to two tensors (CPU memory; `tensor` is written unless it is a send). */
static PyObject *one_call(GroupObject *self, fsc_comm_op_t op, PyObject *tensor, PyObject *input, int peer,
                          const char *redop, int32_t tag, int async_op) {
    if (check_ready(self) < 0) return NULL;
    PyObject *module = module_of((PyObject *)self);
    fsc_py_calls_t c;
    fsc_py_calls_init(&c, 1); /* inline storage: cannot fail */
    fsc_comm_call_t *call = &c.calls[0];
    memset(call, 0, sizeof(*call));
    call->op = op;
    call->peer = peer;
    call->tag = tag;
    c.ncalls = 1;
    if (redop != NULL && fsc_py_parse_redop(module, redop, &call->redop) < 0) goto fail;
    int two = input != NULL;
    if (tensor != NULL &&
        fsc_py_import_arg(&c.args, module, tensor, two ? "output" : "tensor",
                          FSC_IMPORT_CPU_ONLY | (op != FSC_OP_SEND ? FSC_IMPORT_WRITABLE : 0), 0, &call->tensor) < 0)
        goto fail;
    fsc_tensor_t *in = NULL;
    if (two && fsc_py_import_arg(&c.args, module, input, "input", FSC_IMPORT_CPU_ONLY, 0, &in) < 0) goto fail;
    call->input = in;
    return run_calls(self, &c, async_op);
fail:
    fsc_py_calls_clear(&c);
    return NULL;
}

static PyObject *Group_all_gather(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "async_op", NULL};
    PyObject *out, *in;
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|p:all_gather", kwlist, &out, &in, &async_op)) return NULL;
    return one_call(self, FSC_OP_ALL_GATHER, out, in, -1, NULL, 0, async_op);
}

static PyObject *Group_reduce_scatter(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "op", "async_op", NULL};
    PyObject *out, *in;
    const char *op = "sum";
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|sp:reduce_scatter", kwlist, &out, &in, &op, &async_op))
        return NULL;
    return one_call(self, FSC_OP_REDUCE_SCATTER, out, in, -1, op, 0, async_op);
}

static PyObject *Group_all_reduce(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "op", "async_op", NULL};
    PyObject *t;
    const char *op = "sum";
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|sp:all_reduce", kwlist, &t, &op, &async_op)) return NULL;
    return one_call(self, FSC_OP_ALL_REDUCE, t, NULL, -1, op, 0, async_op);
}

static PyObject *Group_broadcast(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "root", "async_op", NULL};
    PyObject *t, *root_obj;
    int root = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|p:broadcast", kwlist, &t, &root_obj, &async_op) ||
        fsc_py_parse_rank(root_obj, "broadcast", "root", &root) < 0)
        return NULL;
    return one_call(self, FSC_OP_BROADCAST, t, NULL, root, NULL, 0, async_op);
}

static PyObject *Group_reduce(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "root", "op", "async_op", NULL};
    PyObject *t, *root_obj;
    const char *op = "sum";
    int root = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|sp:reduce", kwlist, &t, &root_obj, &op, &async_op) ||
        fsc_py_parse_rank(root_obj, "reduce", "root", &root) < 0)
        return NULL;
    return one_call(self, FSC_OP_REDUCE, t, NULL, root, op, 0, async_op);
}

static PyObject *Group_send(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "dst", "async_op", "tag", NULL};
    PyObject *t, *peer_obj, *tag_obj = NULL;
    int peer = 0, async_op = 0;
    int32_t tag;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|pO:send", kwlist, &t, &peer_obj, &async_op, &tag_obj) ||
        fsc_py_parse_rank(peer_obj, "send", "dst", &peer) < 0 || fsc_py_parse_tag(tag_obj, "send", &tag) < 0)
        return NULL;
    return one_call(self, FSC_OP_SEND, t, NULL, peer, NULL, tag, async_op);
}

static PyObject *Group_recv(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "src", "async_op", "tag", NULL};
    PyObject *t, *peer_obj, *tag_obj = NULL;
    int peer = 0, async_op = 0;
    int32_t tag;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|pO:recv", kwlist, &t, &peer_obj, &async_op, &tag_obj) ||
        fsc_py_parse_rank(peer_obj, "recv", "src", &peer) < 0 || fsc_py_parse_tag(tag_obj, "recv", &tag) < 0)
        return NULL;
    return one_call(self, FSC_OP_RECV, t, NULL, peer, NULL, tag, async_op);
}

static PyObject *Group_barrier(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"async_op", NULL};
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:barrier", kwlist, &async_op)) return NULL;
    return one_call(self, FSC_OP_BARRIER, NULL, NULL, -1, NULL, 0, async_op);
}

static PyObject *Group_batch(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ops", "async_op", NULL};
    PyObject *ops;
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:batch", kwlist, &ops, &async_op)) return NULL;
    if (check_ready(self) < 0) return NULL;
    fsc_py_calls_t c;
    if (fsc_py_parse_calls(&c, module_of((PyObject *)self), ops, 256, FSC_IMPORT_CPU_ONLY, 0) < 0) return NULL;
    return run_calls(self, &c, async_op);
}

static PyObject *Group_all_to_all_single(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "output_split_sizes", "input_split_sizes", "async_op", NULL};
    PyObject *out, *in, *out_splits = Py_None, *in_splits = Py_None;
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOp:all_to_all_single", kwlist, &out, &in, &out_splits, &in_splits,
                                     &async_op))
        return NULL;
    if (check_ready(self) < 0) return NULL;
    fsc_py_calls_t c;
    if (fsc_py_parse_all_to_all(&c, module_of((PyObject *)self), out, in, out_splits, in_splits,
                                fsc_shm_group_rank(self->g), fsc_shm_group_size(self->g), FSC_IMPORT_CPU_ONLY, 0,
                                FSC_DEV_CPU, -1) < 0)
        return NULL;
    return run_checked(self, &c, async_op);
}

#define KW_METHOD(name, doc) \
    { #name, (PyCFunction)(void (*)(void))Group_##name, METH_VARARGS | METH_KEYWORDS, doc }

static PyMethodDef Group_methods[] = {
    {"join", (PyCFunction)Group_join, METH_NOARGS,
     "Block (GIL released) until every rank has attached, remove the segment's name, start the progress thread."},
    {"unlink", (PyCFunction)Group_unlink, METH_NOARGS, "Remove the segment's name now (idempotent)."},
    {"give_up", (PyCFunction)Group_give_up, METH_NOARGS,
     "give_up(): every rank's ops on the group, this rank's included, fail from now on (a DistributedError "
     "naming this rank; ops already waiting within about 50 ms). Idempotent; no-op once closed."},
    {"check_closable", (PyCFunction)Group_check_closable, METH_NOARGS,
     "check_closable(): RuntimeError when this thread is inside an op of the group (a signal handler's "
     "call), which a close would wait for forever."},
    {"close", (PyCFunction)(void (*)(void))Group_close, METH_VARARGS | METH_KEYWORDS,
     "close(grace=None): finish queued ops, stop the progress thread, unmap. With grace (seconds), an op "
     "still waiting for a peer after that long is abandoned (it and the ops behind it fail)."},
    KW_METHOD(all_gather, "all_gather(output, input, async_op=False): output = concat of every rank's input."),
    KW_METHOD(reduce_scatter,
              "reduce_scatter(output, input, op='sum', async_op=False): output = block `rank` of "
              "the reduction of every rank's input."),
    KW_METHOD(all_reduce, "all_reduce(tensor, op='sum', async_op=False): in place."),
    KW_METHOD(broadcast, "broadcast(tensor, root, async_op=False): root's tensor to every rank (in place)."),
    KW_METHOD(reduce, "reduce(tensor, root, op='sum', async_op=False): reduction lands in root's tensor."),
    KW_METHOD(send,
              "send(tensor, dst, async_op=False, tag=0): returns once the data is in the shared buffers; dst's recv "
              "must give the same tag."),
    KW_METHOD(recv, "recv(tensor, src, async_op=False, tag=0): the next message from src, which must carry `tag`."),
    KW_METHOD(barrier, "barrier(async_op=False)."),
    KW_METHOD(all_to_all_single,
              "all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, async_op=False): "
              "input's dim-0 block j goes to rank j, output's block i comes from rank i (split sizes in rows; "
              "None: equal blocks)."),
    KW_METHOD(batch,
              "batch(ops, async_op=False): run the ops together, each a tuple (name, *args) as the single-op "
              "methods take them, e.g. ('send', t, dst), ('recv', t, src), ('all_reduce', t, 'sum'), ('copy', output, "
              "input). Sends and recvs move at once (no order of issue can deadlock), then collectives in list order."),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Group_getset[] = {
    {"segment", (getter)Group_get_segment, NULL, "Name of the shm segment (for rendezvous).", NULL},
    {"rank", (getter)Group_get_rank, NULL, "This process's rank in the group.", NULL},
    {"size", (getter)Group_get_size, NULL, "Number of ranks.", NULL},
    {"direct_max", (getter)Group_get_direct_max, NULL,
     "Largest op, in bytes, whose data ranks may read straight from each other's memory "
     "(agreed at join; 0: never).",
     NULL},
    {"read_max", (getter)Group_get_read_max, NULL,
     "Largest collective, in bytes, that may read the peers' private buffers: direct_max, or 0 where the group "
     "keeps them on the slots (FAIRSCALE_C_SHM_DIRECT_READS; auto: rank 0 times both ways).",
     NULL},
    {"mapped_ops", (getter)Group_get_mapped_ops, NULL,
     "Collectives run so far that copied straight between the ranks' shared tensors (shared_empty).", NULL},
    {"read_ops", (getter)Group_get_read_ops, NULL,
     "Collectives this rank has run so far by reading its peers' private buffers (process_vm_readv).", NULL},
    {"closed", (getter)Group_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Group_slots[] = {
    {Py_tp_init, Group_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Group_dealloc},
    {Py_tp_methods, Group_methods},
    {Py_tp_getset, Group_getset},
    {Py_tp_doc,
     "ShmGroup(name, rank, size, segment=None): one rank's handle on a shared-memory group. "
     "segment=None creates the segment (send .segment to the others), else attaches it. "
     "Call join() on every rank before the first op. Group ranks are 0..size-1."},
    {0, NULL},
};

static PyType_Spec Group_spec = {"fairscale_c._C.ShmGroup", sizeof(GroupObject), 0, Py_TPFLAGS_DEFAULT, Group_slots};

/* all_to_all_check(output, input, output_split_sizes, input_split_sizes, rank, size): the
 * all-to-all's argument rules for a group that runs it without the engine (one rank). */
static PyObject *py_all_to_all_check(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "output_split_sizes", "input_split_sizes", "rank", "size", NULL};
    PyObject *out, *in, *out_splits, *in_splits;
    int rank, size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOii:all_to_all_check", kwlist, &out, &in, &out_splits, &in_splits,
                                     &rank, &size))
        return NULL;
    if (size < 1 || rank < 0 || rank >= size)
        return PyErr_Format(PyExc_ValueError, "all_to_all_check: rank %d of size %d is not a group rank", rank, size);
    fsc_py_calls_t c;
    if (fsc_py_parse_all_to_all(&c, module, out, in, out_splits, in_splits, rank, size, 0, 0, -1, -1) < 0) return NULL;
    fsc_py_calls_clear(&c);
    Py_RETURN_NONE;
}

/* check_calls(ops, rank, size): the engine's argument rules for `ops` (a batch's tuples, CPU or
 * CUDA tensors) on a group of `size` ranks, for a group that runs them without the engine (one
 * rank, or torch's collectives across hosts), so that it refuses what the engine refuses, with
 * the same messages. */
static PyObject *py_check_calls(PyObject *module, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ops", "rank", "size", NULL};
    PyObject *ops;
    int rank, size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oii:check_calls", kwlist, &ops, &rank, &size)) return NULL;
    if (size < 1 || rank < 0 || rank >= size)
        return PyErr_Format(PyExc_ValueError, "check_calls: rank %d of size %d is not a group rank", rank, size);
    fsc_py_calls_t c; /* CUDA tensors with stream -1: nothing runs, so nothing to order */
    if (fsc_py_parse_calls(&c, module, ops, 256, 0, -1) < 0) return NULL;
    const fsc_tensor_t *first = c.calls[0].tensor;
    int device_type = first ? first->device_type : FSC_DEV_CPU, device_id = first ? first->device_id : -1;
    fsc_status_t st = c.ncalls == 1 ? fsc_comm_check_call(&c.calls[0], rank, size, device_type, device_id)
                                    : fsc_comm_check_batch(c.calls, c.ncalls, rank, size, device_type, device_id);
    fsc_py_calls_clear(&c);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

static PyMethodDef comm_functions[] = {
    FSC_PY_KW_METHOD("check_calls", py_check_calls,
                     "check_calls(ops, rank, size): raise ValueError/TypeError when one of `ops` (tuples as "
                     "ShmGroup.batch takes them) breaks an argument rule of the engine."),
    FSC_PY_KW_METHOD("all_to_all_check", py_all_to_all_check,
                     "all_to_all_check(output, input, output_split_sizes, input_split_sizes, rank, size): raise "
                     "ValueError/TypeError when an all_to_all_single with these arguments breaks a rule."),
    {NULL, NULL, 0, NULL},
};

int fsc_py_comm_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    if (fsc_py_work_exec(module) < 0) return -1;
    state->GroupType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Group_spec, NULL);
    if (state->GroupType == NULL || PyModule_AddType(module, state->GroupType) < 0) return -1;
    return PyModule_AddFunctions(module, comm_functions);
}
