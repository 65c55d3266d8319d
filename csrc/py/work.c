/* work.c — _C.Work, the handle of an op queued on a shm group's progress thread: wait(timeout)
 * with the GIL released in slices (Ctrl-C is honoured between them), is_completed(); a Work that
 * is dropped while its op still runs waits for it, since the op uses the tensors it keeps. */
#include "binding.h"

#include <math.h>
#include <stdio.h>

#define FSC_WAIT_SLICE_S 0.2

/* The exception a signal handler raised during an op, until that op has finished: the op this
 * thread was waiting in (`depth` deep: a handler's own op nests) when the handler ran. Only the
 * main thread runs handlers; other threads' ops never see it. */
static PyObject *deferred_type, *deferred_value, *deferred_tb;
static unsigned long deferred_thread;
static int deferred_depth;
static _Thread_local int wait_depth; /* ops this thread is waiting in */

void fsc_py_wait_begin(void) {
    wait_depth++;
}

int fsc_py_check_signals(void) {
    if (PyErr_CheckSignals() == 0) return 0;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1; /* KeyboardInterrupt, SystemExit */
    if (deferred_type != NULL) {
        PyErr_Clear(); /* a second one while the first waits: the first is raised */
        return 0;
    }
    PyErr_Fetch(&deferred_type, &deferred_value, &deferred_tb);
    deferred_thread = PyThread_get_thread_ident();
    deferred_depth = wait_depth;
    return 0;
}

int fsc_py_wait_end(void) {
    int mine = deferred_type != NULL && deferred_thread == PyThread_get_thread_ident() && deferred_depth == wait_depth;
    wait_depth--;
    if (!mine) return PyErr_Occurred() ? -1 : 0;
    PyObject *t = deferred_type, *v = deferred_value, *tb = deferred_tb;
    deferred_type = deferred_value = deferred_tb = NULL;
    if (!PyErr_Occurred()) {
        PyErr_Restore(t, v, tb);
        return -1;
    }
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL) PyException_SetTraceback(v, tb);
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    PyException_SetContext(ev, v); /* steals v */
    Py_XDECREF(t);
    Py_XDECREF(tb);
    PyErr_Restore(et, ev, etb);
    return -1;
}

static int work_block(fsc_py_work_t *self, double timeout_s);

int fsc_py_work_block(fsc_py_work_t *self, double timeout_s) {
    fsc_py_wait_begin();
    work_block(self, timeout_s);
    return fsc_py_wait_end();
}

static int work_block(fsc_py_work_t *self, double timeout_s) {
    if (fsc_shm_work_check_owner(self->work) != FSC_OK) {
        fsc_py_raise(self->module, FSC_ERR_COMM);
        return -1;
    }
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
            /* the slice may have timed out just before the op finished: take the op's own status */
            st = fsc_shm_work_wait(self->work, 0);
            if (st != FSC_OK) fsc_py_raise(self->module, st);
            return st == FSC_OK ? 0 : -1;
        }
        if (fsc_py_check_signals() < 0) return -1;
        if (deadline >= 0 && fsc_comm_now() >= deadline) {
            st = fsc_shm_work_wait(self->work, 0); /* OK if it has just finished */
            if (st == FSC_OK) return 0;
            if (!fsc_shm_work_done(self->work)) st = fsc_shm_work_timed_out(self->work, timeout_s);
            fsc_py_raise(self->module, st);
            return -1;
        }
    }
}

int fsc_py_parse_seconds(PyObject *args, PyObject *kwds, const char *method, char *name, double *out) {
    char *kwlist[] = {name, NULL};
    char fmt[64];
    PyObject *obj = Py_None;
    snprintf(fmt, sizeof(fmt), "|O:%s", method);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &obj)) return -1;
    *out = -1;
    if (obj == Py_None) return 0;
    if (!PyNumber_Check(obj) && PyObject_HasAttrString(obj, "total_seconds")) { /* a datetime.timedelta */
        PyObject *secs = PyObject_CallMethod(obj, "total_seconds", NULL);
        if (secs == NULL) return -1;
        *out = PyFloat_AsDouble(secs);
        Py_DECREF(secs);
        if (*out == -1 && PyErr_Occurred()) return -1;
    } else {
        *out = PyFloat_AsDouble(obj);
    }
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a number of seconds or None, got %s", method, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (isinf(*out) && *out > 0) { /* an infinite limit is no limit */
        *out = -1;
        return 0;
    }
    if (!(*out >= 0)) { /* negative or NaN; PyErr_Format has no %g: show the object */
        PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0 or None, got %R", method, name, obj);
        return -1;
    }
    return 0;
}

static PyObject *Work_wait(fsc_py_work_t *self, PyObject *args, PyObject *kwds) {
    double t;
    if (fsc_py_parse_seconds(args, kwds, "wait", "timeout", &t) < 0) return NULL;
    if (fsc_py_work_block(self, t) < 0) return NULL;
    Py_CLEAR(self->owners); /* done: the memory no longer needs pinning */
    Py_RETURN_TRUE;
}

static PyObject *Work_is_completed(fsc_py_work_t *self, PyObject *Py_UNUSED(ignored)) {
    if (fsc_shm_work_check_owner(self->work) != FSC_OK) return fsc_py_raise(self->module, FSC_ERR_COMM);
    return PyBool_FromLong(fsc_shm_work_done(self->work));
}

static void Work_dealloc(fsc_py_work_t *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->work != NULL && !fsc_shm_work_owned(self->work)) {
        /* a fork() child's copy: the op runs in the parent, and the lock of this copy may have
         * been held there at the fork: left as it is */
        self->work = NULL;
    }
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

/* made only by ops (comm.c): Python cannot create one */
static PyType_Spec Work_spec = {"fairscale_c._C.Work", sizeof(fsc_py_work_t), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, Work_slots};

int fsc_py_work_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    state->WorkType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Work_spec, NULL);
    if (state->WorkType == NULL || PyModule_AddType(module, state->WorkType) < 0) return -1;
    return 0;
}
