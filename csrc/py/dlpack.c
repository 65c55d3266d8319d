/* dlpack.c — importing any DLPack producer (torch, numpy, capsules) as an fsc_tensor_t view. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/dlpack.h"
#include "binding.h"

#define OWNER_CAPSULE "fairscale_c.dlpack_owner"
#define OWNER_CAPSULE_LEGACY "fairscale_c.dlpack_owner_legacy"

/* The consumer side of a capsule we renamed: calls the producer's deleter exactly once. Owners
 * are often released on an error path, with an exception set; a deleter may run Python code
 * (ctypes producers do), which must not see it, so the error indicator is set aside meanwhile. */
static void owner_destructor(PyObject *capsule) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    DLManagedTensorVersioned *v = PyCapsule_GetPointer(capsule, OWNER_CAPSULE);
    if (v != NULL && v->deleter != NULL) v->deleter(v);
    PyErr_Restore(type, value, tb);
}

static void owner_destructor_legacy(PyObject *capsule) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, OWNER_CAPSULE_LEGACY);
    if (m != NULL && m->deleter != NULL) m->deleter(m);
    PyErr_Restore(type, value, tb);
}

static int dtype_from_dl(DLDataType dt, fsc_dtype_t *out) {
    if (dt.lanes != 1) return -1;
    switch (dt.code) {
        case kDLFloat:
            if (dt.bits == 16)
                *out = FSC_FLOAT16;
            else if (dt.bits == 32)
                *out = FSC_FLOAT32;
            else if (dt.bits == 64)
                *out = FSC_FLOAT64;
            else
                return -1;
            return 0;
        case kDLBfloat:
            if (dt.bits != 16) return -1;
            *out = FSC_BFLOAT16;
            return 0;
        case kDLInt:
            if (dt.bits == 8)
                *out = FSC_INT8;
            else if (dt.bits == 16)
                *out = FSC_INT16;
            else if (dt.bits == 32)
                *out = FSC_INT32;
            else if (dt.bits == 64)
                *out = FSC_INT64;
            else
                return -1;
            return 0;
        case kDLUInt:
            if (dt.bits != 8) return -1;
            *out = FSC_UINT8;
            return 0;
        case kDLBool:
            if (dt.bits != 8) return -1;
            *out = FSC_BOOL;
            return 0;
        default: return -1;
    }
}

/* The bytes a view spans must be addressable: every byte count and offset below fits in
 * ptrdiff_t, so no later `numel * itemsize`, pointer offset or strided walk can wrap. On success
 * fills out->numel and out->data; otherwise raises BufferError naming `argname`. */
static int check_extent(const DLTensor *t, const char *argname, fsc_tensor_t *out) {
    int64_t esz = (int64_t)fsc_dtype_size(out->dtype);
    int64_t numel = 1;
    for (int i = 0; i < out->ndim; i++) {
        int64_t n = out->shape[i];
        if (n != 0 && numel > INT64_MAX / n) {
            PyErr_Format(PyExc_BufferError, "argument '%s': element count overflows int64 (shape has %d dims)", argname,
                         out->ndim);
            return -1;
        }
        numel *= n;
    }
    if (numel > PTRDIFF_MAX / esz) {
        PyErr_Format(PyExc_BufferError,
                     "argument '%s': %lld elements of %lld bytes do not fit in the address space; expected at most "
                     "%lld bytes",
                     argname, (long long)numel, (long long)esz, (long long)PTRDIFF_MAX);
        return -1;
    }
    out->numel = numel;
    if (t->byte_offset > (uint64_t)PTRDIFF_MAX ||
        (t->data != NULL && (uintptr_t)t->data > UINTPTR_MAX - (uintptr_t)t->byte_offset)) {
        PyErr_Format(PyExc_BufferError,
                     "argument '%s': byte_offset %llu moves the data pointer out of the address space", argname,
                     (unsigned long long)t->byte_offset);
        return -1;
    }
    out->data = t->data == NULL ? NULL : (char *)t->data + t->byte_offset;
    if (numel == 0) return 0;
    if (out->data == NULL) {
        PyErr_Format(PyExc_BufferError, "argument '%s': NULL data pointer for a tensor of %lld elements", argname,
                     (long long)numel);
        return -1;
    }
    /* Elements reachable above (hi) and below (lo) the first one, through the strides. */
    int64_t hi = 0, lo = 0;
    for (int i = 0; i < out->ndim; i++) {
        int64_t s = out->strides[i], reach;
        if (s == INT64_MIN || __builtin_mul_overflow(out->shape[i] - 1, s < 0 ? -s : s, &reach) ||
            __builtin_add_overflow(s < 0 ? lo : hi, reach, s < 0 ? &lo : &hi))
            goto too_far;
    }
    int64_t span;
    if (__builtin_add_overflow(hi, lo, &span) || span >= PTRDIFF_MAX / esz) goto too_far;
    uintptr_t start = (uintptr_t)out->data, below = (uintptr_t)(lo * esz), above = (uintptr_t)((hi + 1) * esz);
    if (start < below || start > UINTPTR_MAX - above) goto too_far;
    return 0;
too_far:
    PyErr_Format(PyExc_BufferError,
                 "argument '%s': the strides reach outside the address space (extent of %lld elements of %lld "
                 "bytes from the data pointer); expected a view that fits in ptrdiff_t",
                 argname, (long long)numel, (long long)esz);
    return -1;
}

/* Fill `out` from a DLTensor; sets an exception naming `argname` and returns -1 on failure. */
static int view_from_dl(const DLTensor *t, int readonly, const char *argname, int flags, fsc_tensor_t *out) {
    memset(out, 0, sizeof(*out));
    if (t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost) {
        out->device_type = FSC_DEV_CPU; /* pinned host memory is host-addressable */
    } else if (t->device.device_type == kDLCUDA) {
        out->device_type = FSC_DEV_CUDA;
    } else {
        PyErr_Format(PyExc_ValueError,
                     "argument '%s': unsupported device (DLPack device type %d); expected a CPU or CUDA tensor",
                     argname, (int)t->device.device_type);
        return -1;
    }
    if ((flags & FSC_IMPORT_CPU_ONLY) && out->device_type != FSC_DEV_CPU) {
        PyErr_Format(PyExc_ValueError, "argument '%s': expected a CPU tensor, got a CUDA tensor", argname);
        return -1;
    }
    out->device_id = t->device.device_id;
    if (dtype_from_dl(t->dtype, &out->dtype) < 0) {
        static const char *kinds[] = {"int", "uint", "float", "opaque handle", "bfloat", "complex", "bool"};
        const char *kind = t->dtype.code < sizeof(kinds) / sizeof(kinds[0]) ? kinds[t->dtype.code] : "unknown";
        PyErr_Format(PyExc_TypeError,
                     "argument '%s': unsupported dtype %s%u (DLPack code %u, %u lanes); expected one of "
                     "float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, bool",
                     argname, kind, (unsigned)t->dtype.bits, (unsigned)t->dtype.code, (unsigned)t->dtype.lanes);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > FSC_MAX_NDIM) {
        PyErr_Format(PyExc_BufferError, "argument '%s': ndim %d outside [0, %d]", argname, (int)t->ndim, FSC_MAX_NDIM);
        return -1;
    }
    if (t->ndim > 0 && t->shape == NULL) {
        PyErr_Format(PyExc_BufferError, "argument '%s': DLPack tensor has ndim %d but a NULL shape", argname,
                     (int)t->ndim);
        return -1;
    }
    out->ndim = t->ndim;
    for (int i = t->ndim - 1; i >= 0; i--) {
        int64_t n = t->shape[i];
        if (n < 0) {
            PyErr_Format(PyExc_BufferError, "argument '%s': negative extent %lld in dim %d", argname, (long long)n, i);
            return -1;
        }
        out->shape[i] = n;
    }
    /* NULL strides mean compact row-major; strides count elements. A size-0 dim makes every
     * stride irrelevant; otherwise each compact stride is a product of later extents, which
     * check_extent bounds by the element count. */
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->strides != NULL) {
            out->strides[i] = t->strides[i];
        } else if (i == t->ndim - 1) {
            out->strides[i] = 1;
        } else if (__builtin_mul_overflow(out->strides[i + 1], out->shape[i + 1], &out->strides[i])) {
            out->strides[i] = 0; /* only reachable with an element count that check_extent refuses */
        }
    }
    if (check_extent(t, argname, out) < 0) return -1;
    out->readonly = readonly;
    if ((flags & FSC_IMPORT_WRITABLE) && readonly) {
        PyErr_Format(PyExc_ValueError, "argument '%s': the tensor is read-only; expected writable memory", argname);
        return -1;
    }
    for (int i = 0; (flags & FSC_IMPORT_WRITABLE) && i < out->ndim; i++)
        if (out->strides[i] == 0 && out->shape[i] > 1) { /* torch refuses such an output too */
            PyErr_Format(PyExc_ValueError,
                         "argument '%s': more than one element refers to the same memory (a stride of 0, as in "
                         "an expanded tensor); expected an output whose elements are distinct (clone it first)",
                         argname);
            return -1;
        }
    if ((flags & FSC_IMPORT_CONTIGUOUS) && !fsc_tensor_is_contiguous(out)) {
        PyErr_Format(PyExc_ValueError, "argument '%s': expected a contiguous tensor (call .contiguous() first)",
                     argname);
        return -1;
    }
    return 0;
}

/* Consume a capsule: check its name and version, rename it, and wrap ownership of the managed
 * tensor in a new owner capsule. Returns the owner or NULL with an exception set. */
static PyObject *consume_capsule(PyObject *capsule, const char *argname, int flags, fsc_tensor_t *out) {
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL && PyErr_Occurred()) return NULL;
    if (name != NULL && strcmp(name, "dltensor_versioned") == 0) {
        DLManagedTensorVersioned *v = PyCapsule_GetPointer(capsule, name);
        if (v == NULL) return NULL;
        if (v->version.major > DLPACK_MAJOR_VERSION) {
            /* Per the spec the only thing we may do now is leave the deleter to the producer. */
            PyErr_Format(PyExc_BufferError,
                         "argument '%s': DLPack version %u.%u is not supported; expected major version <= %d", argname,
                         v->version.major, v->version.minor, DLPACK_MAJOR_VERSION);
            return NULL;
        }
        int readonly = (v->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        if (view_from_dl(&v->dl_tensor, readonly, argname, flags, out) < 0) return NULL;
        PyObject *owner = PyCapsule_New(v, OWNER_CAPSULE, owner_destructor);
        if (owner == NULL) return NULL;
        if (PyCapsule_SetName(capsule, "used_dltensor_versioned") < 0) {
            /* Give ownership back: the producer's capsule still deletes it. */
            PyCapsule_SetDestructor(owner, NULL);
            Py_DECREF(owner);
            return NULL;
        }
        return owner;
    }
    if (name != NULL && strcmp(name, "dltensor") == 0) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, name);
        if (m == NULL) return NULL;
        if (view_from_dl(&m->dl_tensor, 0, argname, flags, out) < 0) return NULL;
        PyObject *owner = PyCapsule_New(m, OWNER_CAPSULE_LEGACY, owner_destructor_legacy);
        if (owner == NULL) return NULL;
        if (PyCapsule_SetName(capsule, "used_dltensor") < 0) {
            PyCapsule_SetDestructor(owner, NULL);
            Py_DECREF(owner);
            return NULL;
        }
        return owner;
    }
    if (name != NULL && (strcmp(name, "used_dltensor") == 0 || strcmp(name, "used_dltensor_versioned") == 0)) {
        PyErr_Format(PyExc_BufferError, "argument '%s': this DLPack capsule was already consumed", argname);
        return NULL;
    }
    PyErr_Format(PyExc_BufferError,
                 "argument '%s': capsule named '%s' is not a DLPack tensor; expected 'dltensor' or "
                 "'dltensor_versioned'",
                 argname, name ? name : "(null)");
    return NULL;
}

/* obj.__dlpack__(max_version=(1, minor)[, stream=s]); falls back to no max_version on TypeError. */
static PyObject *call_dlpack(PyObject *obj, int is_cuda, intptr_t cuda_stream) {
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL) return NULL;
    PyObject *kwargs = PyDict_New();
    PyObject *capsule = NULL;
    if (kwargs == NULL) goto exit;
    if (is_cuda) {
        /* 0 is disallowed by the protocol; 1 means the legacy default stream. */
        PyObject *s = PyLong_FromSsize_t(cuda_stream == 0 ? 1 : (Py_ssize_t)cuda_stream);
        if (s == NULL || PyDict_SetItemString(kwargs, "stream", s) < 0) {
            Py_XDECREF(s);
            goto exit;
        }
        Py_DECREF(s);
    }
    PyObject *version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
    if (version == NULL || PyDict_SetItemString(kwargs, "max_version", version) < 0) {
        Py_XDECREF(version);
        goto exit;
    }
    Py_DECREF(version);
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) goto exit;
    capsule = PyObject_Call(meth, empty, kwargs);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* A producer that predates DLPack 1.0 does not know max_version. */
        PyErr_Clear();
        if (PyDict_DelItemString(kwargs, "max_version") == 0) capsule = PyObject_Call(meth, empty, kwargs);
    }
    Py_DECREF(empty);
exit:
    Py_XDECREF(kwargs);
    Py_DECREF(meth);
    return capsule;
}

/* torch refuses to export tensors that require grad; say so in our words, naming the argument. */
static int check_requires_grad(PyObject *obj, const char *argname) {
    PyObject *rg = PyObject_GetAttrString(obj, "requires_grad");
    if (rg == NULL) {
        PyErr_Clear();
        return 0;
    }
    int truth = PyObject_IsTrue(rg);
    Py_DECREF(rg);
    if (truth < 0) return -1;
    if (truth) {
        PyErr_Format(PyExc_ValueError,
                     "argument '%s': the tensor requires grad; expected a tensor without autograd history "
                     "(pass %s.detach())",
                     argname, argname);
        return -1;
    }
    return 0;
}

static int device_is_cuda(PyObject *obj, const char *argname, int *is_cuda) {
    *is_cuda = 0;
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (dev == NULL) {
        /* __dlpack_device__ is optional for CPU-only producers. */
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int type = 0, id = 0;
    if (!PyArg_ParseTuple(dev, "ii", &type, &id)) {
        Py_DECREF(dev);
        PyErr_Format(PyExc_BufferError, "argument '%s': __dlpack_device__() must return (device_type, device_id)",
                     argname);
        return -1;
    }
    Py_DECREF(dev);
    *is_cuda = type == kDLCUDA;
    return 0;
}

/* The type in `type`'s MRO whose own dict defines `__dlpack_c_exchange_api__` (borrowed), or NULL. */
static PyTypeObject *exchange_api_owner(PyTypeObject *type) {
    PyObject *mro = type->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (base->tp_dict != NULL && PyDict_GetItemString(base->tp_dict, "__dlpack_c_exchange_api__") != NULL)
            return base;
    }
    return NULL;
}

/* The exchange API of `type` (DLPack >= 1.2, `__dlpack_c_exchange_api__`), or NULL. Found once per
 * process and remembered for the type that defines it, so that every subclass of it (torch.Tensor,
 * nn.Parameter, a user's subclass) takes it whichever is imported first; a type without it is
 * remembered so that the probe is not repeated for every call. */
static const DLPackExchangeAPI *exchange_api_of(fsc_module_state *st, PyTypeObject *type) {
    if (st->xtype != NULL && (type == (PyTypeObject *)st->xtype || PyType_IsSubtype(type, (PyTypeObject *)st->xtype)))
        return st->xapi;
    if (st->xtype != NULL || type == (PyTypeObject *)st->xnone) return NULL;
    PyTypeObject *owner = exchange_api_owner(type);
    PyObject *cap = owner == NULL ? NULL : PyObject_GetAttrString((PyObject *)owner, "__dlpack_c_exchange_api__");
    const DLPackExchangeAPI *api = NULL;
    if (cap != NULL && PyCapsule_IsValid(cap, "dlpack_exchange_api"))
        api = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    PyErr_Clear();
    if (api == NULL || api->header.version.major != 1 || api->header.version.minor < 2 ||
        api->dltensor_from_py_object_no_sync == NULL) {
        Py_XDECREF(cap);
        Py_XSETREF(st->xnone, Py_NewRef((PyObject *)type));
        return NULL;
    }
    st->xtype = Py_NewRef((PyObject *)owner);
    st->xcapsule = cap;
    st->xapi = api;
    return api;
}

/* Whether CUDA memory exported without synchronisation may be used from `stream`: when it is the
 * producer's current work stream on the device, as __dlpack__(stream=) would not synchronise
 * then either. */
static int on_current_work_stream(const DLPackExchangeAPI *api, int32_t device_id, intptr_t stream) {
    void *cur = NULL;
    if (api->current_work_stream == NULL) return 0;
    if (api->current_work_stream(kDLCUDA, device_id, &cur) != 0) {
        PyErr_Clear();
        return 0;
    }
    return (intptr_t)cur == stream;
}

/* A tensor of a producer with an exchange API (torch): a non-owning view, no capsule, no
 * Python-level __dlpack__ call; the owner is the tensor itself. Host memory always; CUDA memory
 * when the consumer's `cuda_stream` is the producer's current stream on that device. Returns 1
 * when it handled `obj` (*rc: 0, or -1 with an exception set), 0 to take the __dlpack__ path (no
 * API, or CUDA memory for another stream, which the producer must first order its work before). */
static int import_exchange(PyObject *module, PyObject *obj, const char *argname, int flags, intptr_t cuda_stream,
                           fsc_tensor_t *out, PyObject **owner, int *rc) {
    const DLPackExchangeAPI *api = exchange_api_of(fsc_py_state(module), Py_TYPE(obj));
    if (api == NULL) return 0;
    *rc = -1;
    if (check_requires_grad(obj, argname) < 0) return 1;
    DLTensor t;
    if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(PyExc_BufferError, "argument '%s': cannot export through DLPack: %S", argname,
                     value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return 1;
    }
    if (t.device.device_type != kDLCPU &&
        !(t.device.device_type == kDLCUDA && on_current_work_stream(api, t.device.device_id, cuda_stream)))
        return 0; /* let __dlpack__(stream=) order it */
    if (view_from_dl(&t, 0, argname, flags, out) < 0) return 1;
    *owner = Py_NewRef(obj);
    *rc = 0;
    return 1;
}

int fsc_py_import(PyObject *module, PyObject *obj, const char *argname, int flags, intptr_t cuda_stream,
                  fsc_tensor_t *out, PyObject **owner) {
    *owner = NULL;
    if (PyCapsule_CheckExact(obj)) {
        *owner = consume_capsule(obj, argname, flags, out);
        return *owner == NULL ? -1 : 0;
    }
    int rc;
    if (module != NULL && import_exchange(module, obj, argname, flags, cuda_stream, out, owner, &rc)) return rc;
    if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        PyErr_Format(PyExc_TypeError,
                     "argument '%s': expected an object supporting the DLPack protocol (__dlpack__), e.g. a "
                     "torch.Tensor or numpy.ndarray; got '%.200s'",
                     argname, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (check_requires_grad(obj, argname) < 0) return -1;
    int is_cuda;
    if (device_is_cuda(obj, argname, &is_cuda) < 0) return -1;
    if (is_cuda && (flags & FSC_IMPORT_CPU_ONLY)) {
        PyErr_Format(PyExc_ValueError, "argument '%s': expected a CPU tensor, got a CUDA tensor", argname);
        return -1;
    }
    PyObject *capsule = call_dlpack(obj, is_cuda, cuda_stream);
    if (capsule == NULL) {
        /* Re-raise the producer's complaint as a BufferError that names the argument. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (PyErr_GivenExceptionMatches(type, PyExc_BufferError) ||
            PyErr_GivenExceptionMatches(type, PyExc_RuntimeError) ||
            PyErr_GivenExceptionMatches(type, PyExc_TypeError)) {
            PyErr_Format(PyExc_BufferError, "argument '%s': cannot export through DLPack: %S", argname, value);
            PyObject *t2, *v2, *tb2;
            PyErr_Fetch(&t2, &v2, &tb2);
            PyErr_NormalizeException(&t2, &v2, &tb2);
            PyException_SetCause(v2, value); /* steals value */
            Py_DECREF(type);
            Py_XDECREF(tb);
            PyErr_Restore(t2, v2, tb2);
        } else {
            PyErr_Restore(type, value, tb);
        }
        return -1;
    }
    if (!PyCapsule_CheckExact(capsule)) {
        PyErr_Format(PyExc_BufferError, "argument '%s': __dlpack__() returned '%.200s', expected a capsule", argname,
                     Py_TYPE(capsule)->tp_name);
        Py_DECREF(capsule);
        return -1;
    }
    *owner = consume_capsule(capsule, argname, flags, out);
    Py_DECREF(capsule);
    return *owner == NULL ? -1 : 0;
}

int fsc_py_dlpack_exec(PyObject *module) {
    return fsc_py_buffer_exec(module);
}
