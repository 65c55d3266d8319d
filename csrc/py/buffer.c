/* buffer.c — _C.Buffer (C-owned host memory exported through DLPack) and host copy functions. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>
#include <unistd.h>

#include "base/dlpack.h"
#include "base/hostbuf.h"
#include "binding.h"
#include "comm/shm_shared.h"
#include "gpu/gpu.h"

typedef struct {
    PyObject_HEAD fsc_hostbuf_t *buf;
    fsc_dtype_t dtype;
    int ndim;
    int64_t shape[FSC_MAX_NDIM];
} BufferObject;

static const DLDataType dl_dtypes[FSC_NUM_DTYPES] = {
    [FSC_FLOAT16] = {kDLFloat, 16, 1}, [FSC_BFLOAT16] = {kDLBfloat, 16, 1}, [FSC_FLOAT32] = {kDLFloat, 32, 1},
    [FSC_FLOAT64] = {kDLFloat, 64, 1}, [FSC_INT8] = {kDLInt, 8, 1},         [FSC_INT16] = {kDLInt, 16, 1},
    [FSC_INT32] = {kDLInt, 32, 1},     [FSC_INT64] = {kDLInt, 64, 1},       [FSC_UINT8] = {kDLUInt, 8, 1},
    [FSC_BOOL] = {kDLBool, 8, 1},
};

static int parse_dtype(PyObject *obj, const char *argname, fsc_dtype_t *out) {
    /* Accept "float32" and str(torch.float32) == "torch.float32". */
    PyObject *s = PyObject_Str(obj);
    if (s == NULL) return -1;
    const char *name = PyUnicode_AsUTF8(s);
    if (name == NULL) {
        Py_DECREF(s);
        return -1;
    }
    if (strncmp(name, "torch.", 6) == 0) name += 6;
    for (int i = 0; i < FSC_NUM_DTYPES; i++) {
        if (strcmp(name, fsc_dtype_name((fsc_dtype_t)i)) == 0) {
            *out = (fsc_dtype_t)i;
            Py_DECREF(s);
            return 0;
        }
    }
    PyErr_Format(PyExc_TypeError,
                 "argument '%s': unsupported dtype %R; expected one of float16, bfloat16, float32, float64, int8, "
                 "int16, int32, int64, uint8, bool",
                 argname, obj);
    Py_DECREF(s);
    return -1;
}

static int parse_shape(PyObject *obj, int *ndim, int64_t *shape, int64_t *numel) {
    PyObject *seq = PySequence_Fast(obj, "argument 'shape': expected a sequence of non-negative ints");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > FSC_MAX_NDIM) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "argument 'shape': at most %d dims, got %zd", FSC_MAX_NDIM, n);
        return -1;
    }
    *numel = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "argument 'shape': dim %zd is %lld; expected a non-negative size", i, v);
            return -1;
        }
        if (v > 0 && *numel > INT64_MAX / v / 8) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "argument 'shape': %R has more elements than a buffer can hold", obj);
            return -1;
        }
        shape[i] = v;
        *numel *= v;
    }
    *ndim = (int)n;
    Py_DECREF(seq);
    return 0;
}

static PyObject *buffer_wrap(PyTypeObject *tp, fsc_hostbuf_t *buf, fsc_dtype_t dtype, int ndim, const int64_t *shape) {
    BufferObject *self = (BufferObject *)tp->tp_alloc(tp, 0);
    if (self == NULL) {
        fsc_hostbuf_release(buf);
        return NULL;
    }
    self->buf = buf;
    self->dtype = dtype;
    self->ndim = ndim;
    memcpy(self->shape, shape, sizeof(int64_t) * ndim);
    return (PyObject *)self;
}

static PyObject *buffer_new(PyTypeObject *tp, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"shape", "dtype", NULL};
    PyObject *shape_obj, *dtype_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Buffer", kwlist, &shape_obj, &dtype_obj)) return NULL;
    int ndim;
    int64_t shape[FSC_MAX_NDIM], numel;
    fsc_dtype_t dtype;
    if (parse_shape(shape_obj, &ndim, shape, &numel) < 0 || parse_dtype(dtype_obj, "dtype", &dtype) < 0) return NULL;
    fsc_hostbuf_t *buf;
    fsc_status_t st = fsc_hostbuf_alloc((size_t)numel * fsc_dtype_size(dtype), &buf);
    if (st != FSC_OK) return fsc_py_raise(NULL, st);
    return buffer_wrap(tp, buf, dtype, ndim, shape);
}

static void buffer_dealloc(PyObject *obj) {
    BufferObject *self = (BufferObject *)obj;
    PyTypeObject *tp = Py_TYPE(obj);
    fsc_hostbuf_release(self->buf);
    tp->tp_free(obj);
    Py_DECREF(tp);
}

/* One allocation per export: the managed tensor followed by shape[ndim] and strides[ndim]. */
static void export_deleter_versioned(DLManagedTensorVersioned *self) {
    fsc_hostbuf_release(self->manager_ctx);
    free(self);
}

static void export_deleter_legacy(DLManagedTensor *self) {
    fsc_hostbuf_release(self->manager_ctx);
    free(self);
}

/* Capsule destructors run only for capsules nobody consumed (their name is still unused). */
static void capsule_destructor_versioned(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
    DLManagedTensorVersioned *v = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (v->deleter) v->deleter(v);
}

static void capsule_destructor_legacy(PyObject *cap) {
    if (!PyCapsule_IsValid(cap, "dltensor")) return;
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m->deleter) m->deleter(m);
}

static void fill_dltensor(DLTensor *t, const BufferObject *self, fsc_hostbuf_t *buf, int64_t *dims) {
    int64_t *strides = dims + self->ndim;
    memcpy(dims, self->shape, sizeof(int64_t) * self->ndim);
    int64_t s = 1;
    for (int i = self->ndim - 1; i >= 0; i--) {
        strides[i] = s;
        s *= self->shape[i] > 0 ? self->shape[i] : 1;
    }
    t->data = buf->data;
    t->device.device_type = kDLCPU;
    t->device.device_id = 0;
    t->ndim = self->ndim;
    t->dtype = dl_dtypes[self->dtype];
    t->shape = dims;
    t->strides = strides;
    t->byte_offset = 0;
}

static PyObject *export_capsule(BufferObject *self, int versioned, int copied) {
    fsc_hostbuf_t *buf = self->buf;
    if (copied) {
        fsc_status_t st = fsc_hostbuf_alloc(self->buf->nbytes, &buf);
        if (st != FSC_OK) return fsc_py_raise(NULL, st);
        if (buf->nbytes) memcpy(buf->data, self->buf->data, buf->nbytes);
    } else {
        fsc_hostbuf_retain(buf);
    }
    size_t head = versioned ? sizeof(DLManagedTensorVersioned) : sizeof(DLManagedTensor);
    void *mem = malloc(head + 2 * sizeof(int64_t) * (size_t)(self->ndim ? self->ndim : 1));
    if (mem == NULL) {
        fsc_hostbuf_release(buf);
        return PyErr_NoMemory();
    }
    int64_t *dims = (int64_t *)((char *)mem + head);
    PyObject *cap;
    if (versioned) {
        DLManagedTensorVersioned *v = mem;
        v->version.major = DLPACK_MAJOR_VERSION;
        v->version.minor = DLPACK_MINOR_VERSION;
        v->manager_ctx = buf;
        v->deleter = export_deleter_versioned;
        v->flags = copied ? DLPACK_FLAG_BITMASK_IS_COPIED : 0;
        fill_dltensor(&v->dl_tensor, self, buf, dims);
        cap = PyCapsule_New(v, "dltensor_versioned", capsule_destructor_versioned);
        if (cap == NULL) export_deleter_versioned(v);
    } else {
        DLManagedTensor *m = mem;
        m->manager_ctx = buf;
        m->deleter = export_deleter_legacy;
        fill_dltensor(&m->dl_tensor, self, buf, dims);
        cap = PyCapsule_New(m, "dltensor", capsule_destructor_legacy);
        if (cap == NULL) export_deleter_legacy(m);
    }
    return cap;
}

/* `obj` as a 2-tuple of ints that fit a C int, or -1 with a TypeError/OverflowError naming `argname`. */
static int int_pair(PyObject *obj, const char *argname, int *a, int *b) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2 || !PyLong_Check(PyTuple_GET_ITEM(obj, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(obj, 1))) {
        PyErr_Format(PyExc_TypeError, "__dlpack__: argument '%s' must be a tuple of two ints, got %R", argname, obj);
        return -1;
    }
    int *out[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        long v = PyLong_AsLong(PyTuple_GET_ITEM(obj, i));
        if ((v == -1 && PyErr_Occurred()) || v < INT_MIN || v > INT_MAX) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "__dlpack__: argument '%s' holds an int out of range", argname);
            return -1;
        }
        *out[i] = (int)v;
    }
    return 0;
}

/* __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) per the array API. */
static PyObject *buffer_dlpack(PyObject *obj, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOO:__dlpack__", kwlist, &stream, &max_version, &dl_device,
                                     &copy))
        return NULL;
    if (stream != Py_None) {
        int overflow = 0;
        long long v = PyLong_Check(stream) ? PyLong_AsLongLongAndOverflow(stream, &overflow) : 0;
        if (!PyLong_Check(stream) || overflow || v != -1) {
            PyErr_SetString(PyExc_BufferError, "__dlpack__: argument 'stream' must be None for a CPU buffer");
            return NULL;
        }
    }
    if (dl_device != Py_None) {
        int type, id;
        if (int_pair(dl_device, "dl_device", &type, &id) < 0) return NULL;
        if (type != kDLCPU) {
            PyErr_Format(PyExc_BufferError,
                         "__dlpack__: argument 'dl_device': cannot export a CPU buffer to device type %d", type);
            return NULL;
        }
    }
    int versioned = 0;
    if (max_version != Py_None) {
        int major, minor;
        if (int_pair(max_version, "max_version", &major, &minor) < 0) return NULL;
        versioned = major >= 1;
    }
    int copied = 0;
    if (copy != Py_None && (copied = PyObject_IsTrue(copy)) < 0) return NULL;
    return export_capsule((BufferObject *)obj, versioned, copied);
}

static PyObject *buffer_dlpack_device(PyObject *obj, PyObject *Py_UNUSED(args)) {
    (void)obj;
    return Py_BuildValue("(ii)", kDLCPU, 0);
}

static PyObject *buffer_get_shape(PyObject *obj, void *closure) {
    (void)closure;
    BufferObject *self = (BufferObject *)obj;
    PyObject *t = PyTuple_New(self->ndim);
    for (int i = 0; t != NULL && i < self->ndim; i++) {
        PyObject *v = PyLong_FromLongLong(self->shape[i]);
        if (v == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject *buffer_get_dtype(PyObject *obj, void *closure) {
    (void)closure;
    return PyUnicode_FromString(fsc_dtype_name(((BufferObject *)obj)->dtype));
}

static PyObject *buffer_get_nbytes(PyObject *obj, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(((BufferObject *)obj)->buf->nbytes);
}

static PyMethodDef buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "Export as a DLPack capsule (versioned when max_version >= (1, 0))."},
    {"__dlpack_device__", buffer_dlpack_device, METH_NOARGS, "(device_type, device_id) = (kDLCPU, 0)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef buffer_getset[] = {
    {"shape", buffer_get_shape, NULL, "Shape as a tuple of ints.", NULL},
    {"dtype", buffer_get_dtype, NULL, "dtype name, e.g. 'float32'.", NULL},
    {"nbytes", buffer_get_nbytes, NULL, "Size in bytes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_new, buffer_new},
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_methods, buffer_methods},
    {Py_tp_getset, buffer_getset},
    {Py_tp_doc,
     "Buffer(shape, dtype): zeroed, 64-byte aligned host memory owned by the C core, "
     "shared zero-copy with torch/numpy through DLPack."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {
    .name = "fairscale_c._C.Buffer",
    .basicsize = sizeof(BufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = buffer_slots,
};

/* copy_(dst, src): element-wise strided copy/cast in C; the GIL is released while copying. */
static PyObject *py_copy(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "src", NULL};
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:copy_", kwlist, &dst_obj, &src_obj)) return NULL;
    fsc_py_imports_t im;
    fsc_tensor_t *dst, *src;
    fsc_py_imports_init(&im, 2); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, dst_obj, "dst", FSC_IMPORT_WRITABLE | FSC_IMPORT_CPU_ONLY, 0, &dst) < 0 ||
        fsc_py_import_arg(&im, module, src_obj, "src", FSC_IMPORT_CPU_ONLY, 0, &src) < 0)
        return fsc_py_imports_fail(&im);
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_tensor_copy(dst, src);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

/* clone(src) -> Buffer: a contiguous C-owned copy of any DLPack CPU tensor. */
static PyObject *py_clone(PyObject *module, PyObject *src_obj) {
    PyObject *owner;
    fsc_tensor_t src;
    if (fsc_py_import(module, src_obj, "src", FSC_IMPORT_CPU_ONLY, 0, &src, &owner) < 0) return NULL;
    fsc_hostbuf_t *buf;
    fsc_status_t st = fsc_hostbuf_alloc((size_t)src.numel * fsc_dtype_size(src.dtype), &buf);
    if (st != FSC_OK) {
        Py_DECREF(owner);
        return fsc_py_raise(module, st);
    }
    fsc_tensor_t dst = src;
    dst.data = buf->data;
    dst.readonly = 0;
    for (int64_t i = src.ndim - 1, s = 1; i >= 0; i--) {
        dst.strides[i] = s;
        s *= src.shape[i] > 0 ? src.shape[i] : 1;
    }
    Py_BEGIN_ALLOW_THREADS
    st = fsc_tensor_copy(&dst, &src);
    Py_END_ALLOW_THREADS
    Py_DECREF(owner);
    if (st != FSC_OK) {
        fsc_hostbuf_release(buf);
        return fsc_py_raise(module, st);
    }
    return buffer_wrap(fsc_py_state(module)->BufferType, buf, src.dtype, src.ndim, src.shape);
}

static PyObject *int64_tuple(const int64_t *v, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* describe(obj, *, contiguous=False, writable=False, cpu_only=False) -> dict of the view C sees. */
static PyObject *py_describe(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"obj", "contiguous", "writable", "cpu_only", NULL};
    PyObject *obj, *owner;
    int contiguous = 0, writable = 0, cpu_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$ppp:describe", kwlist, &obj, &contiguous, &writable, &cpu_only))
        return NULL;
    int flags = (contiguous ? FSC_IMPORT_CONTIGUOUS : 0) | (writable ? FSC_IMPORT_WRITABLE : 0) |
                (cpu_only ? FSC_IMPORT_CPU_ONLY : 0);
    fsc_tensor_t t;
    if (fsc_py_import(module, obj, "obj", flags, 0, &t, &owner) < 0) return NULL;
    PyObject *shape = int64_tuple(t.shape, t.ndim), *strides = int64_tuple(t.strides, t.ndim);
    PyObject *d = NULL;
    if (shape && strides)
        d = Py_BuildValue("{s:O, s:O, s:s, s:s, s:i, s:L, s:K, s:O, s:O}", "shape", shape, "strides", strides, "dtype",
                          fsc_dtype_name(t.dtype), "device", t.device_type == FSC_DEV_CPU ? "cpu" : "cuda", "device_id",
                          t.device_id, "numel", (long long)t.numel, "data_ptr", (unsigned long long)(uintptr_t)t.data,
                          "readonly", t.readonly ? Py_True : Py_False, "contiguous",
                          fsc_tensor_is_contiguous(&t) ? Py_True : Py_False);
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_DECREF(owner);
    return d;
}

static PyObject *py_live_host_buffers(PyObject *module, PyObject *Py_UNUSED(args)) {
    (void)module;
    return PyLong_FromLong(fsc_hostbuf_live());
}

/* pack_blocks(dst, srcs, world, stream=None): see fsc_tensor_pack_blocks; with a stream (an int,
 * a cudaStream_t) the tensors are CUDA tensors and the copies are enqueued on it
 * (fsc_gpu_pack_blocks). The GIL is released while copying / enqueueing. */
static PyObject *py_pack_blocks(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "srcs", "world", "stream", NULL};
    PyObject *dst_obj, *srcs_obj, *stream_obj = Py_None, *result = NULL;
    int world, cuda;
    fsc_stream_t stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi|O:pack_blocks", kwlist, &dst_obj, &srcs_obj, &world,
                                     &stream_obj) ||
        fsc_py_parse_optional_stream(stream_obj, "pack_blocks", &cuda, &stream) < 0)
        return NULL;
    int flags = FSC_IMPORT_CONTIGUOUS | (cuda ? 0 : FSC_IMPORT_CPU_ONLY);
    PyObject *seq = PySequence_Fast(srcs_obj, "pack_blocks: argument 'srcs' must be a sequence of tensors");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fsc_py_imports_t im; /* dst, then the sources in order: tensors + 1 is the array of sources */
    fsc_tensor_t *dst, *src;
    if (fsc_py_imports_init(&im, (size_t)n + 1) < 0) goto exit;
    if (fsc_py_import_arg(&im, module, dst_obj, "dst", flags | FSC_IMPORT_WRITABLE, (intptr_t)stream, &dst) < 0)
        goto exit;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PySequence_Fast_GET_ITEM(seq, i);
        if (fsc_py_import_arg(&im, module, obj, "srcs[i]", flags, (intptr_t)stream, &src) < 0) goto exit;
    }
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cuda ? fsc_gpu_pack_blocks(dst, im.tensors + 1, (int)n, world, stream)
              : fsc_tensor_pack_blocks(dst, im.tensors + 1, (int)n, world);
    Py_END_ALLOW_THREADS
    result = fsc_py_imports_finish(module, &im, st);
exit:
    fsc_py_imports_clear(&im);
    Py_DECREF(seq);
    return result;
}

/* ---- shared tensors (comm/shm_shared.h): fairscale_c.distributed.shared_empty drives these ---- */

#define MAPPING_CAPSULE "fairscale_c._C.shared_mapping"

typedef struct {
    uint8_t *base; /* NULL once a slice owns the mapping */
    size_t total;
    uint64_t id;
} mapping_t;

static void mapping_destructor(PyObject *cap) {
    mapping_t *m = PyCapsule_GetPointer(cap, MAPPING_CAPSULE);
    if (m == NULL) return;
    if (m->base != NULL) munmap(m->base, m->total);
    free(m);
}

static PyObject *mapping_wrap(PyObject *module, uint8_t *base, size_t total, uint64_t id) {
    mapping_t *m = malloc(sizeof(*m));
    PyObject *cap = m == NULL ? NULL : PyCapsule_New(m, MAPPING_CAPSULE, mapping_destructor);
    if (cap == NULL) {
        free(m);
        munmap(base, total);
        return m == NULL ? fsc_py_raise(module, fsc_error(FSC_ERR_NOMEM, "shared tensor: out of memory")) : NULL;
    }
    *m = (mapping_t){base, total, id};
    return cap;
}

static int parse_total(PyObject *obj, size_t *total) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (v == 0 || v > SIZE_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "argument 'total': expected a positive byte count, got %llu", v);
        return -1;
    }
    *total = (size_t)v;
    return 0;
}

/* _shared_create(total) -> (fd, id, mapping): a new allocation, mapped here. */
static PyObject *py_shared_create(PyObject *module, PyObject *total_obj) {
    size_t total;
    if (parse_total(total_obj, &total) < 0) return NULL;
    int fd;
    uint64_t id;
    uint8_t *base;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_shm_shared_create(total, &fd, &id, &base);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    PyObject *cap = mapping_wrap(module, base, total, id);
    if (cap == NULL) {
        close(fd);
        return NULL;
    }
    return Py_BuildValue("iKN", fd, (unsigned long long)id, cap);
}

/* _shared_open(pid, fd, total, id) -> mapping: map the allocation another process announced. */
static PyObject *py_shared_open(PyObject *module, PyObject *args) {
    int pid, fd;
    PyObject *total_obj;
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "iiOK:_shared_open", &pid, &fd, &total_obj, &id)) return NULL;
    size_t total;
    if (parse_total(total_obj, &total) < 0) return NULL;
    uint8_t *base;
    fsc_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fsc_shm_shared_open(pid, fd, total, (uint64_t)id, &base);
    Py_END_ALLOW_THREADS
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return mapping_wrap(module, base, total, (uint64_t)id);
}

/* _shared_slice(mapping, offset, shape, dtype) -> Buffer: this rank's tensor in the allocation; the
 * Buffer (and every tensor made from it) now owns the mapping. */
static PyObject *py_shared_slice(PyObject *module, PyObject *args) {
    PyObject *cap, *off_obj, *shape_obj, *dtype_obj;
    if (!PyArg_ParseTuple(args, "O!OOO:_shared_slice", &PyCapsule_Type, &cap, &off_obj, &shape_obj, &dtype_obj))
        return NULL;
    mapping_t *m = PyCapsule_GetPointer(cap, MAPPING_CAPSULE);
    if (m == NULL) return NULL;
    if (m->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "argument 'mapping': already given to a slice");
        return NULL;
    }
    size_t off = PyLong_AsSize_t(off_obj);
    if (off == (size_t)-1 && PyErr_Occurred()) return NULL;
    int ndim;
    int64_t shape[FSC_MAX_NDIM], numel;
    fsc_dtype_t dtype;
    if (parse_shape(shape_obj, &ndim, shape, &numel) < 0 || parse_dtype(dtype_obj, "dtype", &dtype) < 0) return NULL;
    fsc_hostbuf_t *buf;
    uint8_t *base = m->base;
    m->base = NULL; /* the slice unmaps it, also on failure */
    fsc_status_t st = fsc_shm_shared_slice(base, m->total, m->id, off, (size_t)numel * fsc_dtype_size(dtype), &buf);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return buffer_wrap(fsc_py_state(module)->BufferType, buf, dtype, ndim, shape);
}

/* _shared_contains(address, nbytes) -> bool: whether those bytes lie in a shared allocation. */
static PyObject *py_shared_contains(PyObject *module, PyObject *args) {
    (void)module;
    unsigned long long addr, n;
    if (!PyArg_ParseTuple(args, "KK:_shared_contains", &addr, &n)) return NULL;
    uint64_t id, off;
    fsc_shm_shared_locate((const void *)(uintptr_t)addr, (size_t)n, &id, &off);
    return PyBool_FromLong(id != 0);
}

static PyObject *py_shared_live(PyObject *module, PyObject *Py_UNUSED(args)) {
    (void)module;
    return PyLong_FromLong(fsc_shm_shared_live());
}

static PyMethodDef buffer_functions[] = {
    {"pack_blocks", (PyCFunction)(void (*)(void))py_pack_blocks, METH_VARARGS | METH_KEYWORDS,
     "pack_blocks(dst, srcs, world, stream=None): dst = block 0 of every src, then block 1 of every src, ... (C "
     "copy); with a stream (a cudaStream_t) on CUDA tensors, enqueued there as device copies."},
    {"copy_", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     "copy_(dst, src): copy (and cast between floating dtypes) CPU tensor src into dst, honouring strides."},
    {"clone", py_clone, METH_O, "clone(src) -> Buffer: a contiguous C-owned copy of a CPU tensor."},
    {"describe", (PyCFunction)(void (*)(void))py_describe, METH_VARARGS | METH_KEYWORDS,
     "describe(obj, *, contiguous=False, writable=False, cpu_only=False) -> dict: the view the C core sees."},
    {"_live_host_buffers", py_live_host_buffers, METH_NOARGS, "Number of C-owned host buffers alive."},
    {"_shared_create", py_shared_create, METH_O,
     "_shared_create(total) -> (fd, id, mapping): a new shared tensor allocation of `total` bytes, mapped here."},
    {"_shared_open", py_shared_open, METH_VARARGS,
     "_shared_open(pid, fd, total, id) -> mapping: map allocation `id` that process `pid` holds as descriptor `fd`."},
    {"_shared_slice", py_shared_slice, METH_VARARGS,
     "_shared_slice(mapping, offset, shape, dtype) -> Buffer over bytes of the mapping; the Buffer owns the mapping."},
    {"_shared_contains", py_shared_contains, METH_VARARGS,
     "_shared_contains(address, nbytes) -> bool: whether those bytes lie in a shared tensor allocation."},
    {"_shared_live", py_shared_live, METH_NOARGS, "Number of shared tensor allocations this process maps."},
    {NULL, NULL, 0, NULL},
};

int fsc_py_buffer_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    state->BufferType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &buffer_spec, NULL);
    if (state->BufferType == NULL) return -1;
    if (PyModule_AddType(module, state->BufferType) < 0) return -1;
    return PyModule_AddFunctions(module, buffer_functions);
}
