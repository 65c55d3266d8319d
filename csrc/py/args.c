/* args.c — argument parsing the binding files share: streams, reduce ops, imported tensor
 * arguments, and lists of collective calls (batches) imported into the engine's call
 * descriptions. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "binding.h"

/* The stream in `obj`: 1 when it is an int in [0, 2**64), 0 when it is not an int, -1 when it is
 * out of range (no exception left set in either case). */
static int stream_value(PyObject *obj, uintptr_t *out) {
    if (!PyLong_Check(obj)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = (uintptr_t)v;
    return 1;
}

int fsc_py_stream_converter(PyObject *obj, void *out) {
    int r = stream_value(obj, (uintptr_t *)out);
    if (r == 0)
        PyErr_Format(PyExc_TypeError, "argument 'stream': expected an int (a cudaStream_t), got %s",
                     Py_TYPE(obj)->tp_name);
    else if (r < 0)
        PyErr_SetString(PyExc_ValueError, "argument 'stream': expected a non-negative int (a cudaStream_t)");
    return r > 0;
}

int fsc_py_parse_optional_stream(PyObject *obj, const char *fname, int *given, uintptr_t *out) {
    *given = obj != Py_None;
    if (!*given || stream_value(obj, out) > 0) return 0;
    PyErr_Format(PyExc_TypeError, "%s: argument 'stream' must be None or a non-negative int (a cudaStream_t), got %R",
                 fname, obj);
    return -1;
}

int fsc_py_parse_redop(PyObject *module, const char *name, fsc_reduce_op_t *op) {
    fsc_status_t st = fsc_reduce_op_parse(name, op);
    if (st == FSC_OK) return 0;
    fsc_py_raise(module, st);
    return -1;
}

/* `obj` as an integer in [lo, hi]: 0 with *out set; 1 when it is not an int (operator.index: a
 * Python int, a numpy integer, a one-element integer tensor), 2 when it is out of
 * range, neither with an exception set; -1 with one set (its __index__ raised). */
static int as_integer(PyObject *obj, long long lo, long long hi, long long *out) {
    if (!PyIndex_Check(obj)) return 1;
    PyObject *v = PyNumber_Index(obj);
    if (v == NULL) return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x < lo || x > hi) return 2;
    *out = x;
    return 0;
}

static int as_c_int(PyObject *obj, int *out) {
    long long x = 0;
    int rc = as_integer(obj, INT_MIN, INT_MAX, &x);
    if (rc == 0) *out = (int)x;
    return rc;
}

int fsc_py_parse_tag(PyObject *tag, const char *opname, int32_t *out) {
    *out = 0;
    if (tag == NULL) return 0;
    int t = 0, rc = as_c_int(tag, &t);
    if (rc == 1)
        PyErr_Format(PyExc_TypeError, "%s: argument 'tag' must be an int, got %s", opname, Py_TYPE(tag)->tp_name);
    else if (rc == 2)
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'tag' must fit a 32-bit signed int (-2147483648 to 2147483647), got %R", opname,
                     tag);
    if (rc != 0) return -1;
    *out = (int32_t)t;
    return 0;
}

int fsc_py_parse_rank(PyObject *v, const char *opname, const char *argname, int *out) {
    int rc = as_c_int(v, out);
    if (rc == 1)
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be an int (a group rank), got %s", opname, argname,
                     Py_TYPE(v)->tp_name);
    else if (rc == 2)
        PyErr_Format(PyExc_ValueError, "%s: %s=%R is not a valid group rank", opname, argname, v);
    return rc == 0 ? 0 : -1;
}

/* ---- imported tensor arguments ---------------------------------------------------------------- */

int fsc_py_imports_init(fsc_py_imports_t *im, size_t n) {
    im->n = 0;
    if (n <= FSC_PY_IMPORTS_INLINE) {
        im->cap = FSC_PY_IMPORTS_INLINE;
        im->tensors = im->tensors_inline;
        im->owners = im->owners_inline;
        return 0;
    }
    im->cap = n;
    im->tensors = PyMem_Calloc(n, sizeof(*im->tensors));
    im->owners = PyMem_Calloc(n, sizeof(*im->owners));
    if (im->tensors == NULL || im->owners == NULL) {
        fsc_py_imports_clear(im);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int fsc_py_import_arg(fsc_py_imports_t *im, PyObject *module, PyObject *obj, const char *argname, int flags,
                      intptr_t stream, fsc_tensor_t **out) {
    if (im->n >= im->cap) {
        PyErr_SetString(PyExc_RuntimeError, "fairscale_c: too many tensor arguments in one call");
        return -1;
    }
    fsc_tensor_t *t = &im->tensors[im->n];
    PyObject *owner;
    if (fsc_py_import(module, obj, argname, flags, stream, t, &owner) < 0) return -1;
    im->owners[im->n++] = owner;
    *out = t;
    return 0;
}

void fsc_py_imports_clear(fsc_py_imports_t *im) {
    for (size_t i = 0; i < im->n; i++) Py_CLEAR(im->owners[i]);
    im->n = 0;
    if (im->tensors != im->tensors_inline) {
        PyMem_Free(im->tensors);
        PyMem_Free(im->owners);
    }
    im->tensors = im->tensors_inline;
    im->owners = im->owners_inline;
    im->cap = FSC_PY_IMPORTS_INLINE;
}

PyObject *fsc_py_imports_owners(fsc_py_imports_t *im) {
    PyObject *tuple = PyTuple_New((Py_ssize_t)im->n);
    if (tuple == NULL) return NULL;
    for (size_t i = 0; i < im->n; i++) {
        PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, im->owners[i]); /* steals */
        im->owners[i] = NULL;
    }
    im->n = 0;
    return tuple;
}

PyObject *fsc_py_imports_finish(PyObject *module, fsc_py_imports_t *im, fsc_status_t st) {
    fsc_py_imports_clear(im);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

PyObject *fsc_py_imports_fail(fsc_py_imports_t *im) {
    fsc_py_imports_clear(im);
    return NULL;
}

/* ---- collective calls and batches ------------------------------------------------------------- */

int fsc_py_calls_init(fsc_py_calls_t *c, size_t ncalls) {
    c->ncalls = 0;
    c->cap_calls = ncalls ? ncalls : 1;
    c->calls = c->calls_inline;
    c->views = NULL;
    if (fsc_py_imports_init(&c->args, 2 * c->cap_calls) < 0) return -1;
    if (c->cap_calls > FSC_PY_CALLS_INLINE && (c->calls = PyMem_Calloc(c->cap_calls, sizeof(*c->calls))) == NULL) {
        fsc_py_calls_clear(c);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

void fsc_py_calls_clear(fsc_py_calls_t *c) {
    fsc_py_imports_clear(&c->args);
    if (c->calls != c->calls_inline) PyMem_Free(c->calls);
    PyMem_Free(c->views);
    c->views = NULL;
    c->calls = c->calls_inline;
    c->ncalls = 0;
}

/* One item of a batch: (name, *args) with the arguments of the single-op method of that name. */
static int parse_item(fsc_py_calls_t *c, PyObject *module, PyObject *item, Py_ssize_t i, int flags, intptr_t stream) {
    static const struct {
        const char *name;
        fsc_comm_op_t op;
        const char *format; /* after the name: O = tensor, s = reduce op, i = rank, t = optional tag */
    } kinds[] = {
        {"all_gather", FSC_OP_ALL_GATHER, "OO"},
        {"reduce_scatter", FSC_OP_REDUCE_SCATTER, "OOs"},
        {"all_reduce", FSC_OP_ALL_REDUCE, "Os"},
        {"broadcast", FSC_OP_BROADCAST, "Oi"},
        {"reduce", FSC_OP_REDUCE, "Osi"},
        {"send", FSC_OP_SEND, "Oit"},
        {"recv", FSC_OP_RECV, "Oit"},
        {"copy", FSC_OP_COPY, "OO"},
    };
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) < 1 || !PyUnicode_Check(PyTuple_GET_ITEM(item, 0))) {
        PyErr_Format(PyExc_TypeError, "argument 'ops': item %zd must be a tuple whose first value names the op, got %R",
                     i, item);
        return -1;
    }
    const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(item, 0));
    if (name == NULL) return -1;
    size_t k = 0, nkinds = sizeof(kinds) / sizeof(kinds[0]);
    while (k < nkinds && strcmp(kinds[k].name, name) != 0) k++;
    if (k == nkinds) {
        PyErr_Format(PyExc_ValueError,
                     "argument 'ops': item %zd names '%s'; expected all_gather, reduce_scatter, all_reduce, broadcast, "
                     "reduce, send, recv or copy",
                     i, name);
        return -1;
    }
    const char *fmt = kinds[k].format;
    size_t nfmt = strlen(fmt), given = (size_t)PyTuple_GET_SIZE(item) - 1, optional = fmt[nfmt - 1] == 't';
    if (given != nfmt && !(optional && given == nfmt - 1)) {
        if (optional)
            PyErr_Format(PyExc_TypeError,
                         "argument 'ops': item %zd (%s) takes %zu or %zu values after the name (tensor, peer[, tag]), "
                         "got %zd",
                         i, name, nfmt - 1, nfmt, (Py_ssize_t)given);
        else
            PyErr_Format(PyExc_TypeError, "argument 'ops': item %zd (%s) takes %zu values after the name, got %zd", i,
                         name, nfmt, (Py_ssize_t)given);
        return -1;
    }
    fsc_comm_call_t *o = &c->calls[c->ncalls];
    memset(o, 0, sizeof(*o));
    o->op = kinds[k].op;
    for (size_t a = 0; a < given; a++) {
        PyObject *v = PyTuple_GET_ITEM(item, (Py_ssize_t)a + 1);
        if (fmt[a] == 'O') {
            /* first tensor: written (read for send); second: the collective's input */
            int writable = a == 0 && o->op != FSC_OP_SEND;
            fsc_tensor_t *t;
            const char *argname = a ? "input" : o->op == FSC_OP_COPY ? "output" : "tensor";
            if (fsc_py_import_arg(&c->args, module, v, argname, flags | (writable ? FSC_IMPORT_WRITABLE : 0), stream,
                                  &t) < 0)
                return -1;
            if (a == 0)
                o->tensor = t;
            else
                o->input = t;
        } else if (fmt[a] == 's') {
            const char *opname = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
            if (opname == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "argument 'ops': item %zd (%s): op must be a str", i, name);
                return -1;
            }
            if (fsc_py_parse_redop(module, opname, &o->redop) < 0) return -1;
        } else if (fmt[a] == 't') {
            char what[64];
            snprintf(what, sizeof(what), "argument 'ops': item %zd (%s)", i, name);
            if (fsc_py_parse_tag(v, what, &o->tag) < 0) return -1;
        } else {
            char what[64];
            snprintf(what, sizeof(what), "argument 'ops': item %zd (%s)", i, name);
            const char *argname = o->op == FSC_OP_SEND ? "dst" : o->op == FSC_OP_RECV ? "src" : "root";
            if (fsc_py_parse_rank(v, what, argname, &o->peer) < 0) return -1;
        }
    }
    c->ncalls++;
    return 0;
}

int fsc_py_parse_calls(fsc_py_calls_t *c, PyObject *module, PyObject *ops, size_t max, int flags, intptr_t stream) {
    PyObject *seq = PySequence_Fast(ops, "argument 'ops': expected a sequence of tuples");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = -1;
    if (n < 1 || (size_t)n > max) {
        PyErr_Format(PyExc_ValueError, "argument 'ops': expected 1 to %zu operations, got %zd", max, n);
        goto exit;
    }
    if (fsc_py_calls_init(c, (size_t)n) < 0) goto exit;
    for (Py_ssize_t i = 0; i < n; i++)
        if (parse_item(c, module, PySequence_Fast_GET_ITEM(seq, i), i, flags, stream) < 0) {
            fsc_py_calls_clear(c);
            goto exit;
        }
    rc = 0;
exit:
    Py_DECREF(seq);
    return rc;
}

/* ---- all-to-all ------------------------------------------------------------------------------- */

/* One split-size argument: *rows = NULL for None or an empty sequence (equal blocks), else the
 * `size` ints it holds, in `buf`. */
static int parse_splits(PyObject *obj, const char *argname, int size, int64_t *buf, const int64_t **rows) {
    *rows = NULL;
    if (obj == Py_None) return 0;
    PyObject *seq = PySequence_Check(obj) ? PySequence_Fast(obj, "") : NULL;
    if (seq == NULL) PyErr_Clear();
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : -1;
    int ok = n == 0 || n == size;
    for (Py_ssize_t j = 0; ok && j < n; j++) {
        PyObject *v = PySequence_Fast_GET_ITEM(seq, j);
        long long x = 0;
        int rc = PyBool_Check(v) ? 1 : as_integer(v, INT64_MIN, INT64_MAX, &x);
        if (rc < 0) {
            Py_XDECREF(seq);
            return -1; /* an __index__ raised: that error says more than ours */
        }
        ok = rc == 0;
        buf[j] = (int64_t)x;
    }
    Py_XDECREF(seq);
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "all_to_all_single: argument '%s' must hold %d ints >= 0 (one per rank of the group), got %R",
                     argname, size, obj);
        return -1;
    }
    if (n) *rows = buf;
    return 0;
}

int fsc_py_parse_all_to_all(fsc_py_calls_t *c, PyObject *module, PyObject *output, PyObject *input,
                            PyObject *output_split_sizes, PyObject *input_split_sizes, int rank, int size, int flags,
                            intptr_t stream, int device_type, int device_id) {
    size_t ncalls = 2 * (size_t)size - 1;
    int64_t stack[16], *rows = stack;
    const int64_t *orows, *irows;
    fsc_py_calls_init(c, 1); /* two tensors: inline storage, cannot fail */
    if (ncalls > FSC_PY_CALLS_INLINE) {
        if ((c->calls = PyMem_Calloc(ncalls, sizeof(*c->calls))) == NULL) {
            c->calls = c->calls_inline;
            PyErr_NoMemory();
            goto fail;
        }
        c->cap_calls = ncalls;
    }
    if (2 * (size_t)size > sizeof(stack) / sizeof(stack[0]) &&
        (rows = PyMem_Malloc(2 * (size_t)size * sizeof(*rows))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    c->views = PyMem_Malloc(2 * (size_t)size * sizeof(*c->views));
    if (c->views == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    fsc_tensor_t *out, *in;
    if (fsc_py_import_arg(&c->args, module, output, "output", flags | FSC_IMPORT_WRITABLE, stream, &out) < 0 ||
        fsc_py_import_arg(&c->args, module, input, "input", flags, stream, &in) < 0 ||
        parse_splits(output_split_sizes, "output_split_sizes", size, rows, &orows) < 0 ||
        parse_splits(input_split_sizes, "input_split_sizes", size, rows + size, &irows) < 0)
        goto fail;
    if (device_type < 0) device_type = out->device_type;
    fsc_status_t st = fsc_comm_all_to_all_plan(out, in, orows, irows, rank, size, device_type, device_id, c->views,
                                               c->calls, &c->ncalls);
    if (st != FSC_OK) {
        fsc_py_raise(module, st);
        goto fail;
    }
    if (rows != stack) PyMem_Free(rows);
    return 0;
fail:
    if (rows != stack) PyMem_Free(rows);
    fsc_py_calls_clear(c);
    return -1;
}
