/* nccl.c — Python binding for csrc/comm/nccl.h: loading libnccl, unique ids, and _C.NcclComm
 * (one rank's communicator; collectives enqueued on a caller's stream). */
#include <string.h>

#include "binding.h"
#include "comm/nccl.h"
#include "gpu/gpu.h"

/* Import flags of the collectives' tensors: contiguous views, writable where the op writes. */
#define ARG_IN FSC_IMPORT_CONTIGUOUS
#define ARG_OUT (FSC_IMPORT_CONTIGUOUS | FSC_IMPORT_WRITABLE)

/* nccl_load(paths=()) -> int: load libnccl (see fsc_nccl_load) and return its version code. */
static PyObject *py_nccl_load(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"paths", NULL};
    PyObject *paths_obj = NULL, *seq = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:nccl_load", kwlist, &paths_obj)) return NULL;
    const char *paths[16];
    Py_ssize_t n = 0;
    if (paths_obj != NULL && paths_obj != Py_None) {
        if (PyUnicode_Check(paths_obj) || PyBytes_Check(paths_obj)) {
            PyErr_SetString(PyExc_TypeError, "argument 'paths': expected a sequence of str, got one string");
            return NULL;
        }
        seq = PySequence_Fast(paths_obj, "argument 'paths': expected a sequence of str");
        if (seq == NULL) return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
        if (n > 16) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "argument 'paths': at most 16 candidates, got %zd", n);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            Py_ssize_t len = 0;
            paths[i] = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, &len) : NULL;
            if (paths[i] == NULL || strlen(paths[i]) != (size_t)len) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "argument 'paths': item %zd must be a str without NUL characters, got %R",
                             i, item);
                Py_DECREF(seq);
                return NULL;
            }
        }
    }
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_load(paths, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_XDECREF(seq);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return PyLong_FromLong(fsc_nccl_version());
}

static PyObject *py_nccl_unique_id(PyObject *module, PyObject *Py_UNUSED(args)) {
    unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES];
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_get_unique_id(id);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return PyBytes_FromStringAndSize((const char *)id, FSC_NCCL_UNIQUE_ID_BYTES);
}

typedef struct {
    PyObject_HEAD fsc_nccl_comm_t *comm;
} NcclCommObject;

/* The module object (borrowed) for an instance's methods. */
static PyObject *comm_module(PyObject *self) {
    return PyType_GetModuleByDef(Py_TYPE(self), &fsc_module_def);
}

static PyObject *comm_new(PyTypeObject *tp, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"unique_id", "rank", "size", "device", "timeout", NULL};
    Py_buffer uid;
    int rank, size, device;
    double timeout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*iii|d:NcclComm", kwlist, &uid, &rank, &size, &device, &timeout))
        return NULL;
    if (uid.len != FSC_NCCL_UNIQUE_ID_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "NcclComm: argument 'unique_id' must be %d bytes (from nccl_unique_id()), got %zd",
                     FSC_NCCL_UNIQUE_ID_BYTES, uid.len);
        PyBuffer_Release(&uid);
        return NULL;
    }
    unsigned char id[FSC_NCCL_UNIQUE_ID_BYTES];
    memcpy(id, uid.buf, sizeof(id));
    PyBuffer_Release(&uid);
    PyObject *module = PyType_GetModuleByDef(tp, &fsc_module_def);
    if (module == NULL) return NULL;
    fsc_nccl_comm_t *comm = NULL;
    fsc_status_t st;
    /* Blocks until every rank has joined: the other ranks' Python threads must keep running. */
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_comm_init(id, rank, size, device, timeout, &comm);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    NcclCommObject *self = (NcclCommObject *)tp->tp_alloc(tp, 0);
    if (self == NULL) {
        fsc_nccl_comm_free(comm);
        return NULL;
    }
    self->comm = comm;
    return (PyObject *)self;
}

static void comm_dealloc(PyObject *obj) {
    NcclCommObject *self = (NcclCommObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    fsc_nccl_comm_free(self->comm); /* aborts a communicator nobody destroyed */
    tp->tp_free(obj);
    Py_DECREF(tp);
}

/* Enqueue one operation on `stream` with the GIL released. `tensor` is written (read for a send)
 * and `input`, when not NULL, read; `opname`, when not NULL, names the reduce op; `who` is the
 * root or the peer. */
static PyObject *enqueue(PyObject *self, PyObject *module, fsc_comm_op_t kind, PyObject *tensor, PyObject *input,
                         const char *opname, int who, int32_t tag, fsc_stream_t stream) {
    fsc_reduce_op_t op = FSC_RED_SUM;
    fsc_py_imports_t im;
    fsc_tensor_t *t, *in = NULL;
    fsc_status_t st;
    if (opname != NULL && fsc_py_parse_redop(module, opname, &op) < 0) return NULL;
    fsc_py_imports_init(&im, 2); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, tensor, input ? "output" : "tensor", kind == FSC_OP_SEND ? ARG_IN : ARG_OUT,
                          stream, &t) < 0 ||
        (input != NULL && fsc_py_import_arg(&im, module, input, "input", ARG_IN, stream, &in) < 0))
        return fsc_py_imports_fail(&im);
    fsc_nccl_comm_t *c = ((NcclCommObject *)self)->comm;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
        case FSC_OP_ALL_GATHER: st = fsc_nccl_all_gather(c, t, in, stream); break;
        case FSC_OP_REDUCE_SCATTER: st = fsc_nccl_reduce_scatter(c, t, in, op, stream); break;
        case FSC_OP_ALL_REDUCE: st = fsc_nccl_all_reduce(c, t, op, stream); break;
        case FSC_OP_REDUCE: st = fsc_nccl_reduce(c, t, op, who, stream); break;
        case FSC_OP_BROADCAST: st = fsc_nccl_broadcast(c, t, who, stream); break;
        case FSC_OP_SEND: st = fsc_nccl_send(c, t, who, tag, stream); break;
        default: st = fsc_nccl_recv(c, t, who, tag, stream); break;
    }
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

/* all_gather(output, input, stream) */
static PyObject *comm_all_gather(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"output", "input", "stream", NULL};
    PyObject *module = comm_module(self), *out, *in;
    fsc_stream_t stream;
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "OOO&:all_gather", kwlist, &out, &in,
                                                       fsc_py_stream_converter, &stream))
        return NULL;
    return enqueue(self, module, FSC_OP_ALL_GATHER, out, in, NULL, 0, 0, stream);
}

/* reduce_scatter(output, input, op, stream) */
static PyObject *comm_reduce_scatter(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"output", "input", "op", "stream", NULL};
    PyObject *module = comm_module(self), *out, *in;
    const char *op;
    fsc_stream_t stream;
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "OOsO&:reduce_scatter", kwlist, &out, &in, &op,
                                                       fsc_py_stream_converter, &stream))
        return NULL;
    return enqueue(self, module, FSC_OP_REDUCE_SCATTER, out, in, op, 0, 0, stream);
}

/* all_reduce(tensor, op, stream) */
static PyObject *comm_all_reduce(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tensor", "op", "stream", NULL};
    PyObject *module = comm_module(self), *t;
    const char *op;
    fsc_stream_t stream;
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "OsO&:all_reduce", kwlist, &t, &op,
                                                       fsc_py_stream_converter, &stream))
        return NULL;
    return enqueue(self, module, FSC_OP_ALL_REDUCE, t, NULL, op, 0, 0, stream);
}

/* reduce(tensor, op, root, stream) */
static PyObject *comm_reduce(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tensor", "op", "root", "stream", NULL};
    PyObject *module = comm_module(self), *t, *root_obj;
    const char *op;
    int root;
    fsc_stream_t stream;
    if (module == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OsOO&:reduce", kwlist, &t, &op, &root_obj, fsc_py_stream_converter,
                                     &stream) ||
        fsc_py_parse_rank(root_obj, "reduce", "root", &root) < 0)
        return NULL;
    return enqueue(self, module, FSC_OP_REDUCE, t, NULL, op, root, 0, stream);
}

/* broadcast(tensor, root, stream), send(tensor, peer, stream, tag=0), recv(tensor, peer, stream, tag=0);
 * NCCL has no tags, so a nonzero tag is refused (fsc_comm_check_call) */
static PyObject *ranked(PyObject *self, PyObject *args, PyObject *kwargs, fsc_comm_op_t kind) {
    static char *kwlist_root[] = {"tensor", "root", "stream", NULL};
    static char *kwlist_peer[] = {"tensor", "peer", "stream", "tag", NULL};
    const char *format = kind == FSC_OP_BROADCAST ? "OOO&:broadcast"
                         : kind == FSC_OP_SEND    ? "OOO&|O:send"
                                                  : "OOO&|O:recv";
    PyObject *module = comm_module(self), *t, *who_obj, *tag_obj = NULL;
    int who;
    int32_t tag = 0;
    fsc_stream_t stream;
    if (module == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, format, kind == FSC_OP_BROADCAST ? kwlist_root : kwlist_peer, &t,
                                     &who_obj, fsc_py_stream_converter, &stream, &tag_obj) ||
        fsc_py_parse_rank(who_obj, fsc_comm_op_name(kind), kind == FSC_OP_BROADCAST ? "root" : "peer", &who) < 0 ||
        fsc_py_parse_tag(tag_obj, fsc_comm_op_name(kind), &tag) < 0)
        return NULL;
    return enqueue(self, module, kind, t, NULL, NULL, who, tag, stream);
}

static PyObject *comm_broadcast(PyObject *self, PyObject *args, PyObject *kwargs) {
    return ranked(self, args, kwargs, FSC_OP_BROADCAST);
}

static PyObject *comm_send(PyObject *self, PyObject *args, PyObject *kwargs) {
    return ranked(self, args, kwargs, FSC_OP_SEND);
}

static PyObject *comm_recv(PyObject *self, PyObject *args, PyObject *kwargs) {
    return ranked(self, args, kwargs, FSC_OP_RECV);
}

/* wait(stream, timeout=0.0): block (GIL released) until `stream`'s work is done. */
static PyObject *comm_wait(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"stream", "timeout", NULL};
    PyObject *module = comm_module(self);
    fsc_stream_t stream;
    double timeout = 0.0;
    fsc_status_t st;
    if (module == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O&|d:wait", kwlist, fsc_py_stream_converter, &stream, &timeout))
        return NULL;
    fsc_nccl_comm_t *c = ((NcclCommObject *)self)->comm;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_wait(c, stream, timeout);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

/* batch(ops, stream): the ops (fsc_py_parse_calls' format) enqueued as one NCCL group. */
static PyObject *comm_batch(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ops", "stream", NULL};
    PyObject *module = comm_module(self), *ops_obj;
    fsc_stream_t stream;
    fsc_py_calls_t c;
    if (module == NULL ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO&:batch", kwlist, &ops_obj, fsc_py_stream_converter, &stream))
        return NULL;
    if (fsc_py_parse_calls(&c, module, ops_obj, FSC_NCCL_MAX_BATCH, FSC_IMPORT_CONTIGUOUS, (intptr_t)stream) < 0)
        return NULL;
    fsc_nccl_comm_t *comm = ((NcclCommObject *)self)->comm;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_batch(comm, c.calls, c.ncalls, stream);
    Py_END_ALLOW_THREADS
    fsc_py_calls_clear(&c); /* NCCL has the pointers; the caller keeps the tensors alive */
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

/* all_to_all_single(output, input, output_split_sizes, input_split_sizes, stream): the
 * all-to-all (fsc_py_parse_all_to_all) enqueued as one NCCL group. */
static PyObject *comm_all_to_all_single(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"output", "input", "output_split_sizes", "input_split_sizes", "stream", NULL};
    PyObject *module = comm_module(self), *out, *in, *out_splits, *in_splits;
    fsc_stream_t stream;
    fsc_py_calls_t c;
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO&:all_to_all_single", kwlist, &out, &in,
                                                       &out_splits, &in_splits, fsc_py_stream_converter, &stream))
        return NULL;
    fsc_nccl_comm_t *comm = ((NcclCommObject *)self)->comm;
    if (fsc_py_parse_all_to_all(&c, module, out, in, out_splits, in_splits, fsc_nccl_comm_rank(comm),
                                fsc_nccl_comm_size(comm), FSC_IMPORT_CONTIGUOUS, (intptr_t)stream, FSC_DEV_CUDA,
                                fsc_nccl_comm_device(comm)) < 0)
        return NULL;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_all_to_all(comm, c.calls, c.ncalls, stream);
    Py_END_ALLOW_THREADS
    fsc_py_calls_clear(&c); /* NCCL has the pointers; the caller keeps the tensors alive */
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

static PyObject *comm_abort(PyObject *self, PyObject *Py_UNUSED(args)) {
    fsc_nccl_comm_t *c = ((NcclCommObject *)self)->comm;
    Py_BEGIN_ALLOW_THREADS
    fsc_nccl_comm_abort(c);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *comm_destroy(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *module = comm_module(self);
    double timeout = 0.0;
    fsc_status_t st;
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "|d:destroy", kwlist, &timeout)) return NULL;
    fsc_nccl_comm_t *c = ((NcclCommObject *)self)->comm;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_nccl_comm_destroy(c, timeout);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    Py_RETURN_NONE;
}

static PyObject *comm_get_rank(PyObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromLong(fsc_nccl_comm_rank(((NcclCommObject *)self)->comm));
}

static PyObject *comm_get_size(PyObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromLong(fsc_nccl_comm_size(((NcclCommObject *)self)->comm));
}

static PyObject *comm_get_device(PyObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromLong(fsc_nccl_comm_device(((NcclCommObject *)self)->comm));
}

static PyObject *comm_get_version(PyObject *self, void *Py_UNUSED(c)) {
    (void)self;
    return PyLong_FromLong(fsc_nccl_version());
}

static PyMethodDef comm_methods[] = {
    FSC_PY_KW_METHOD(
        "all_gather", comm_all_gather,
        "all_gather(output, input, stream): output (size * input.numel) = every rank's input, rank order."),
    FSC_PY_KW_METHOD(
        "reduce_scatter", comm_reduce_scatter,
        "reduce_scatter(output, input, op, stream): output = this rank's block of the reduction of input."),
    FSC_PY_KW_METHOD("all_reduce", comm_all_reduce,
                     "all_reduce(tensor, op, stream): in-place reduction on every rank."),
    FSC_PY_KW_METHOD("broadcast", comm_broadcast, "broadcast(tensor, root, stream): tensor = root's tensor."),
    FSC_PY_KW_METHOD("reduce", comm_reduce, "reduce(tensor, op, root, stream): root's tensor = the reduction."),
    FSC_PY_KW_METHOD("send", comm_send, "send(tensor, peer, stream)."),
    FSC_PY_KW_METHOD("recv", comm_recv, "recv(tensor, peer, stream)."),
    FSC_PY_KW_METHOD(
        "batch", comm_batch,
        "batch(ops, stream): enqueue several operations as one NCCL group; ops are tuples like "
        "('all_gather', output, input), ('reduce_scatter', output, input, op), ('all_reduce', tensor, op), "
        "('broadcast', tensor, root), ('reduce', tensor, op, root), ('send', tensor, peer), "
        "('recv', tensor, peer), ('copy', output, input)."),
    FSC_PY_KW_METHOD("all_to_all_single", comm_all_to_all_single,
                     "all_to_all_single(output, input, output_split_sizes, input_split_sizes, stream): input's dim-0 "
                     "block j goes to rank j, output's block i comes from rank i (split sizes in rows; None: equal "
                     "blocks)."),
    FSC_PY_KW_METHOD("wait", comm_wait,
                     "wait(stream, timeout=0.0): block until stream's work is done, polling NCCL errors; aborts on "
                     "error or timeout (0 = FAIRSCALE_C_TIMEOUT)."),
    {"abort", comm_abort, METH_NOARGS, "abort(): stop pending work and free the communicator now."},
    FSC_PY_KW_METHOD("destroy", comm_destroy, "destroy(timeout=0.0): orderly teardown (finalize + destroy)."),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef comm_getset[] = {
    {"rank", comm_get_rank, NULL, "This rank in the communicator.", NULL},
    {"size", comm_get_size, NULL, "Number of ranks.", NULL},
    {"device", comm_get_device, NULL, "CUDA device index the communicator is bound to.", NULL},
    {"version", comm_get_version, NULL, "NCCL_VERSION_CODE of the loaded libnccl (e.g. 22703).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc,
     "NcclComm(unique_id, rank, size, device, timeout=0.0): one rank's NCCL communicator. Blocks "
     "until all ranks joined. Collectives take DLPack CUDA tensors and an int cudaStream_t and are "
     "enqueued without waiting."},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "fairscale_c._C.NcclComm",
    .basicsize = sizeof(NcclCommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = comm_slots,
};

static PyMethodDef nccl_functions[] = {
    FSC_PY_KW_METHOD("nccl_load", py_nccl_load, "nccl_load(paths=()) -> int: load libnccl, return its version code."),
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> bytes: a fresh 128-byte ncclUniqueId."},
    {NULL, NULL, 0, NULL},
};

int fsc_py_nccl_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    state->NcclCommType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &comm_spec, NULL);
    if (state->NcclCommType == NULL) return -1;
    if (PyModule_AddType(module, state->NcclCommType) < 0) return -1;
    return PyModule_AddFunctions(module, nccl_functions);
}
