/* comm.c — binding for the shm collective engine: _C.ShmGroup (one rank's handle on a group)
 * and _C.Work (an async op). Arguments are validated here, before anything is sent; blocking
 * waits release the GIL and wake up periodically to honour Ctrl-C. */
#include "binding.h"

#include "comm/comm.h"
#include "comm/shm.h"

#define FSC_WAIT_SLICE_S 0.2

typedef struct {
    PyObject_HEAD fsc_shm_work_t *work;
    PyObject *owners; /* tuple keeping the tensors' memory alive until the op finishes */
    PyObject *module;
} WorkObject;

typedef struct {
    PyObject_HEAD fsc_shm_group_t *g;
    PyObject *pending; /* list of in-flight Work objects, oldest first */
    int joined;
} GroupObject;

/* ---------------------------------------------------------------- Work */

/* Wait with the GIL released in slices, checking for signals between slices. Returns 0 when
 * the op finished OK, -1 with an exception set otherwise. timeout_s < 0: no limit. */
static int work_block(WorkObject *self, double timeout_s) {
    double deadline = timeout_s < 0 ? -1 : fsc_comm_now() + timeout_s;
    for (;;) {
        double slice = FSC_WAIT_SLICE_S;
        if (deadline >= 0) {
            double left = deadline - fsc_comm_now();
            slice = left < 0 ? 0 : (left < slice ? left : slice);
        }
        fsc_status_t st;
        Py_BEGIN_ALLOW_THREADS
        st = fsc_shm_work_wait(self->work, slice);
        Py_END_ALLOW_THREADS
        if (fsc_shm_work_done(self->work)) {
            if (st != FSC_OK) {
                fsc_py_raise(self->module, st);
                return -1;
            }
            return 0;
        }
        if (PyErr_CheckSignals() < 0) return -1;
        if (deadline >= 0 && fsc_comm_now() >= deadline) {
            fsc_py_raise(self->module, fsc_shm_work_wait(self->work, 0));
            return -1;
        }
    }
}

/* Parse the optional seconds argument `name` of `method` ("|O"): None -> -1 (no limit); else a
 * number >= 0. Returns -1 with ValueError/TypeError set on a bad value, else 0. */
static int parse_seconds(PyObject *args, PyObject *kwds, const char *method, char *name, double *out) {
    char *kwlist[] = {name, NULL};
    char fmt[64];
    PyObject *obj = Py_None;
    snprintf(fmt, sizeof(fmt), "|O:%s", method);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &obj)) return -1;
    *out = -1;
    if (obj == Py_None) return 0;
    *out = PyFloat_AsDouble(obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a number of seconds or None, got %s", method, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (*out < 0) { /* PyErr_Format has no %g: show the object */
        PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0 or None, got %R", method, name, obj);
        return -1;
    }
    return 0;
}

static PyObject *Work_wait(WorkObject *self, PyObject *args, PyObject *kwds) {
    double t;
    if (parse_seconds(args, kwds, "wait", "timeout", &t) < 0) return NULL;
    if (work_block(self, t) < 0) return NULL;
    Py_CLEAR(self->owners); /* done: the memory no longer needs pinning */
    Py_RETURN_TRUE;
}

static PyObject *Work_is_completed(WorkObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(fsc_shm_work_done(self->work));
}

static void Work_dealloc(WorkObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->work != NULL && !fsc_shm_work_done(self->work)) {
        /* the op still reads/writes the tensors: keep them alive until it has finished */
        Py_BEGIN_ALLOW_THREADS(void)
        fsc_shm_work_wait(self->work, -1);
        Py_END_ALLOW_THREADS
    }
    fsc_shm_work_release(self->work);
    Py_XDECREF(self->owners);
    Py_XDECREF(self->module);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef Work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> True. Block (GIL released) until the op finishes; raise its error, or "
     "DistributedError if `timeout` seconds pass first (the op keeps running)."},
    {"is_completed", (PyCFunction)Work_is_completed, METH_NOARGS, "True once the op has finished (ok or not)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Work_slots[] = {
    {Py_tp_dealloc, Work_dealloc},
    {Py_tp_methods, Work_methods},
    {Py_tp_doc, "Handle of an async collective; ops complete in issue order."},
    {0, NULL},
};

static PyType_Spec Work_spec = {"fairscale_c._C.Work", sizeof(WorkObject), 0, Py_TPFLAGS_DEFAULT, Work_slots};

/* ---------------------------------------------------------------- ShmGroup lifecycle */

static PyObject *module_of(PyObject *self) {
    return PyType_GetModule(Py_TYPE(self));
}

static int Group_init(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "rank", "size", "segment", "create", "creator_pid", NULL};
    const char *name = NULL, *segment = NULL;
    int rank = 0, size = 0, create = -1, creator_pid = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sii|z$pi:ShmGroup", kwlist, &name, &rank, &size, &segment, &create,
                                     &creator_pid))
        return -1;
    if (self->g != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ShmGroup is already initialised");
        return -1;
    }
    if (create < 0) create = segment == NULL; /* default: make one without a name, attach with one */
    fsc_status_t st;
    fsc_shm_group_t *g = NULL;
    Py_BEGIN_ALLOW_THREADS /* attaching waits for the creator */
    st = fsc_shm_group_open(name, segment, create, creator_pid, rank, size, &g);
    Py_END_ALLOW_THREADS
    self->g = g;
    if (st != FSC_OK) {
        fsc_py_raise(module_of((PyObject *)self), st);
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

static PyObject *Group_join(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_shm_group_join(self->g);
    if (st == FSC_OK) st = fsc_shm_engine_start(self->g);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module_of((PyObject *)self), st);
    self->joined = 1;
    Py_RETURN_NONE;
}

static PyObject *Group_unlink(GroupObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->g != NULL) fsc_shm_group_unlink(self->g);
    Py_RETURN_NONE;
}

/* Close the engine group: drain the queue (every pending Work finishes), abandoning an op still
 * waiting for a peer after grace_s seconds when grace_s >= 0. */
static void group_close(GroupObject *self, double grace_s) {
    if (self->g == NULL) return;
    fsc_shm_group_t *g = self->g;
    self->g = NULL;
    fsc_shm_group_unlink(g);
    Py_BEGIN_ALLOW_THREADS
    fsc_shm_group_close(g, grace_s);
    Py_END_ALLOW_THREADS
}

static PyObject *Group_close(GroupObject *self, PyObject *args, PyObject *kwds) {
    double grace_s;
    if (parse_seconds(args, kwds, "close", "grace", &grace_s) < 0) return NULL;
    group_close(self, grace_s);
    if (self->pending != NULL && PyList_SetSlice(self->pending, 0, PY_SSIZE_T_MAX, NULL) < 0) return NULL;
    Py_RETURN_NONE;
}

static void Group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    group_close(self, -1);
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

static PyObject *Group_get_closed(GroupObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->g == NULL);
}

/* ---------------------------------------------------------------- ops */

/* Imported arguments of one op. */
typedef struct {
    fsc_tensor_t t[2];
    PyObject *owner[2];
    int n;
} op_views;

static void views_clear(op_views *v) {
    for (int i = 0; i < v->n; i++) Py_CLEAR(v->owner[i]);
    v->n = 0;
}

static int import_arg(GroupObject *self, op_views *v, PyObject *obj, const char *argname, int writable) {
    int flags = FSC_IMPORT_CONTIGUOUS | FSC_IMPORT_CPU_ONLY | (writable ? FSC_IMPORT_WRITABLE : 0);
    if (fsc_py_import(module_of((PyObject *)self), obj, argname, flags, 0, &v->t[v->n], &v->owner[v->n]) < 0) return -1;
    v->n++;
    return 0;
}

static int value_error(GroupObject *self, fsc_status_t st) {
    fsc_py_raise(module_of((PyObject *)self), st);
    return -1;
}

/* Drop finished Works from the front of the pending list (they complete in order). */
static int prune_pending(GroupObject *self) {
    Py_ssize_t n = PyList_GET_SIZE(self->pending), k = 0;
    while (k < n && fsc_shm_work_done(((WorkObject *)PyList_GET_ITEM(self->pending, k))->work)) k++;
    return k ? PyList_SetSlice(self->pending, 0, k, NULL) : 0;
}

/* Queue `a`; the Work keeps the views' owners. Sync: wait here and return None. */
static PyObject *submit(GroupObject *self, const fsc_shm_args_t *a, op_views *v, int async_op) {
    PyObject *module = module_of((PyObject *)self);
    fsc_module_state *state = fsc_py_state(module);
    if (prune_pending(self) < 0) goto fail;
    WorkObject *w = PyObject_New(WorkObject, state->WorkType);
    if (w == NULL) goto fail;
    w->work = NULL;
    w->module = Py_NewRef(module);
    w->owners = PyTuple_New(v->n);
    if (w->owners == NULL) {
        Py_DECREF(w);
        goto fail;
    }
    for (int i = 0; i < v->n; i++) {
        PyTuple_SET_ITEM(w->owners, i, v->owner[i]); /* steals */
        v->owner[i] = NULL;
    }
    v->n = 0;
    fsc_status_t st = fsc_shm_submit(self->g, a, &w->work);
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
    if (work_block(w, -1) < 0) {
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
fail:
    views_clear(v);
    return NULL;
}

static int parse_redop(GroupObject *self, const char *name, fsc_reduce_op_t *out) {
    fsc_status_t st = fsc_reduce_op_parse(name, out);
    return st == FSC_OK ? 0 : value_error(self, st);
}

static int check_rank_arg(GroupObject *self, const char *opname, const char *argname, int r, int allow_self) {
    int size = fsc_shm_group_size(self->g), me = fsc_shm_group_rank(self->g);
    if (r < 0 || r >= size || (!allow_self && r == me)) {
        PyErr_Format(PyExc_ValueError, "%s: %s=%d is not a valid group rank (expected 0 <= %s < %d%s)", opname, argname,
                     r, argname, size, allow_self ? "" : " and not this rank");
        return -1;
    }
    return 0;
}

static int same_dtype(GroupObject *self, const char *opname, const fsc_tensor_t *out, const fsc_tensor_t *in) {
    if (out->dtype == in->dtype) return 0;
    return value_error(self, fsc_error(FSC_ERR_VALUE,
                                       "%s: output has dtype %s but input has dtype %s; expected the "
                                       "same dtype",
                                       opname, fsc_dtype_name(out->dtype), fsc_dtype_name(in->dtype)));
}

static PyObject *Group_all_gather(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "async_op", NULL};
    PyObject *out_obj, *in_obj;
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|p:all_gather", kwlist, &out_obj, &in_obj, &async_op)) return NULL;
    if (check_open(self) < 0) return NULL;
    op_views v = {.n = 0};
    if (import_arg(self, &v, out_obj, "output", 1) < 0 || import_arg(self, &v, in_obj, "input", 0) < 0) goto fail;
    fsc_tensor_t *o = &v.t[0], *i = &v.t[1];
    int size = fsc_shm_group_size(self->g);
    if (same_dtype(self, "all_gather", o, i) < 0) goto fail;
    if (fsc_comm_check_dtype(i->dtype, -1, "all_gather", "input") != FSC_OK) {
        value_error(self, FSC_ERR_VALUE);
        goto fail;
    }
    if (o->numel != (int64_t)size * i->numel) {
        PyErr_Format(PyExc_ValueError,
                     "all_gather: output has %lld elements; expected group size (%d) x input "
                     "elements (%lld) = %lld",
                     (long long)o->numel, size, (long long)i->numel, (long long)size * (long long)i->numel);
        goto fail;
    }
    {
        /* In place is allowed only as this rank's block of the output; any other overlap would be
         * overwritten while it is still being read. */
        const uint8_t *ib = i->data, *ob = o->data;
        size_t inb = fsc_tensor_nbytes(i), onb = fsc_tensor_nbytes(o);
        const uint8_t *own = ob + (size_t)fsc_shm_group_rank(self->g) * inb;
        if (inb > 0 && ib < ob + onb && ob < ib + inb && ib != own) {
            PyErr_Format(PyExc_ValueError,
                         "all_gather: input overlaps output but is not this rank's block of it; for an "
                         "in-place all_gather pass input = output[rank * n:(rank + 1) * n] (rank %d)",
                         fsc_shm_group_rank(self->g));
            goto fail;
        }
    }
    fsc_shm_args_t a = {FSC_OP_ALL_GATHER, FSC_RED_SUM, -1, i->dtype, (size_t)i->numel, i->data, o->data};
    return submit(self, &a, &v, async_op);
fail:
    views_clear(&v);
    return NULL;
}

static PyObject *Group_reduce_scatter(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"output", "input", "op", "async_op", NULL};
    PyObject *out_obj, *in_obj;
    const char *opname = "sum";
    int async_op = 0;
    fsc_reduce_op_t rop;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|sp:reduce_scatter", kwlist, &out_obj, &in_obj, &opname, &async_op))
        return NULL;
    if (check_open(self) < 0 || parse_redop(self, opname, &rop) < 0) return NULL;
    op_views v = {.n = 0};
    if (import_arg(self, &v, out_obj, "output", 1) < 0 || import_arg(self, &v, in_obj, "input", 0) < 0) goto fail;
    fsc_tensor_t *o = &v.t[0], *i = &v.t[1];
    int size = fsc_shm_group_size(self->g);
    if (same_dtype(self, "reduce_scatter", o, i) < 0) goto fail;
    if (fsc_comm_check_dtype(i->dtype, (int)rop, "reduce_scatter", "input") != FSC_OK) {
        value_error(self, FSC_ERR_VALUE);
        goto fail;
    }
    if (i->numel != (int64_t)size * o->numel) {
        PyErr_Format(PyExc_ValueError,
                     "reduce_scatter: input has %lld elements; expected group size (%d) x output "
                     "elements (%lld) = %lld",
                     (long long)i->numel, size, (long long)o->numel, (long long)size * (long long)o->numel);
        goto fail;
    }
    fsc_shm_args_t a = {FSC_OP_REDUCE_SCATTER, rop, -1, i->dtype, (size_t)o->numel, i->data, o->data};
    return submit(self, &a, &v, async_op);
fail:
    views_clear(&v);
    return NULL;
}

/* all_reduce, broadcast, reduce, send, recv: one tensor, optional root/peer and reduce op. */
static PyObject *one_tensor_op(GroupObject *self, fsc_comm_op_t op, PyObject *tensor, int root, const char *opname,
                               int async_op) {
    const char *name = fsc_comm_op_name(op);
    fsc_reduce_op_t rop = FSC_RED_SUM;
    int reduces = op == FSC_OP_ALL_REDUCE || op == FSC_OP_REDUCE;
    if (check_open(self) < 0 || (reduces && parse_redop(self, opname, &rop) < 0)) return NULL;
    if (op == FSC_OP_BROADCAST || op == FSC_OP_REDUCE) {
        if (check_rank_arg(self, name, "root", root, 1) < 0) return NULL;
    } else if (op == FSC_OP_SEND) {
        if (check_rank_arg(self, name, "dst", root, 0) < 0) return NULL;
    } else if (op == FSC_OP_RECV) {
        if (check_rank_arg(self, name, "src", root, 0) < 0) return NULL;
    }
    op_views v = {.n = 0};
    if (import_arg(self, &v, tensor, "tensor", op != FSC_OP_SEND) < 0) goto fail;
    fsc_tensor_t *t = &v.t[0];
    if (fsc_comm_check_dtype(t->dtype, reduces ? (int)rop : -1, name, "tensor") != FSC_OK) {
        value_error(self, FSC_ERR_VALUE);
        goto fail;
    }
    fsc_shm_args_t a = {op, rop, root, t->dtype, (size_t)t->numel, t->data, t->data};
    return submit(self, &a, &v, async_op);
fail:
    views_clear(&v);
    return NULL;
}

static PyObject *Group_all_reduce(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "op", "async_op", NULL};
    PyObject *t;
    const char *op = "sum";
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|sp:all_reduce", kwlist, &t, &op, &async_op)) return NULL;
    return one_tensor_op(self, FSC_OP_ALL_REDUCE, t, -1, op, async_op);
}

static PyObject *Group_broadcast(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "root", "async_op", NULL};
    PyObject *t;
    int root = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|p:broadcast", kwlist, &t, &root, &async_op)) return NULL;
    return one_tensor_op(self, FSC_OP_BROADCAST, t, root, NULL, async_op);
}

static PyObject *Group_reduce(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "root", "op", "async_op", NULL};
    PyObject *t;
    const char *op = "sum";
    int root = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|sp:reduce", kwlist, &t, &root, &op, &async_op)) return NULL;
    return one_tensor_op(self, FSC_OP_REDUCE, t, root, op, async_op);
}

static PyObject *Group_send(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "dst", "async_op", NULL};
    PyObject *t;
    int peer = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|p:send", kwlist, &t, &peer, &async_op)) return NULL;
    return one_tensor_op(self, FSC_OP_SEND, t, peer, NULL, async_op);
}

static PyObject *Group_recv(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tensor", "src", "async_op", NULL};
    PyObject *t;
    int peer = 0, async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi|p:recv", kwlist, &t, &peer, &async_op)) return NULL;
    return one_tensor_op(self, FSC_OP_RECV, t, peer, NULL, async_op);
}

static PyObject *Group_barrier(GroupObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"async_op", NULL};
    int async_op = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:barrier", kwlist, &async_op)) return NULL;
    if (check_open(self) < 0) return NULL;
    op_views v = {.n = 0};
    fsc_shm_args_t a = {FSC_OP_BARRIER, FSC_RED_SUM, -1, FSC_FLOAT32, 0, NULL, NULL};
    return submit(self, &a, &v, async_op);
}

#define KW_METHOD(name, doc) \
    { #name, (PyCFunction)(void (*)(void))Group_##name, METH_VARARGS | METH_KEYWORDS, doc }

static PyMethodDef Group_methods[] = {
    {"join", (PyCFunction)Group_join, METH_NOARGS,
     "Block (GIL released) until every rank has attached, remove the segment's name, start the progress thread."},
    {"unlink", (PyCFunction)Group_unlink, METH_NOARGS, "Remove the segment's name now (idempotent)."},
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
    KW_METHOD(send, "send(tensor, dst, async_op=False): returns when dst has received it."),
    KW_METHOD(recv, "recv(tensor, src, async_op=False)."),
    KW_METHOD(barrier, "barrier(async_op=False)."),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Group_getset[] = {
    {"segment", (getter)Group_get_segment, NULL, "Name of the shm segment (for rendezvous).", NULL},
    {"rank", (getter)Group_get_rank, NULL, "This process's rank in the group.", NULL},
    {"size", (getter)Group_get_size, NULL, "Number of ranks.", NULL},
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

int fsc_py_comm_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    state->WorkType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Work_spec, NULL);
    if (state->WorkType == NULL || PyModule_AddType(module, state->WorkType) < 0) return -1;
    state->GroupType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Group_spec, NULL);
    if (state->GroupType == NULL || PyModule_AddType(module, state->GroupType) < 0) return -1;
    return 0;
}
