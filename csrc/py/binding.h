/* binding.h — what binding-layer files share: module state, error mapping, DLPack import. */
#ifndef FSC_PY_BINDING_H
#define FSC_PY_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "base/status.h"
#include "base/tensor.h"

/* Per-module state (PEP 489). Each subsystem's exec function fills its own fields. */
typedef struct {
    PyObject *DistributedError; /* fairscale_c.DistributedError, a RuntimeError subclass */
    PyTypeObject *BufferType;   /* _C.Buffer: C-owned host memory exported through DLPack */
    PyTypeObject *GroupType;    /* _C.ShmGroup (collective engine, shm backend) */
    PyTypeObject *WorkType;     /* _C.Work (async collective handle) */
    PyTypeObject *NcclCommType; /* _C.NcclComm (collective engine, nccl backend) */
} fsc_module_state;

extern PyModuleDef fsc_module_def;

/* The module's state, from the module object or from an instance of one of its heap types. */
fsc_module_state *fsc_py_state(PyObject *module);
fsc_module_state *fsc_py_state_of(PyObject *self);

/* Raise the Python exception for `st` with fsc_last_error() as message; returns NULL.
 * This is the only place statuses become exceptions. `module` may be NULL (then
 * DistributedError degrades to RuntimeError). */
PyObject *fsc_py_raise(PyObject *module, fsc_status_t st);

/* Flags for fsc_py_import. */
#define FSC_IMPORT_CONTIGUOUS 0x1 /* refuse non-C-contiguous views (ValueError) */
#define FSC_IMPORT_WRITABLE 0x2   /* refuse read-only views and tensors that require grad */
#define FSC_IMPORT_CPU_ONLY 0x4   /* refuse non-CPU devices (ValueError) */

/* Import `obj` — an object with __dlpack__/__dlpack_device__ (torch, numpy, _C.Buffer) or a
 * raw "dltensor"/"dltensor_versioned" capsule — as a view in *out. For CUDA tensors
 * `cuda_stream` is passed to __dlpack__ as the consumer stream (0 = let the producer pick
 * the legacy default stream, i.e. 1). On success returns 0 and a new reference in *owner
 * that keeps the memory alive (Py_DECREF it when done with the view). On failure sets an
 * exception naming `argname` (TypeError, ValueError or BufferError) and returns -1. */
int fsc_py_import(PyObject *module, PyObject *obj, const char *argname, int flags, intptr_t cuda_stream,
                  fsc_tensor_t *out, PyObject **owner);

/* Subsystem hooks called from the module's exec slot, in this order. Each adds its
 * functions/types to `module`, fills its state fields, and returns 0 or -1 with an
 * exception set. A subsystem that is not built simply is not listed in module.c. */
int fsc_py_errors_exec(PyObject *module);
int fsc_py_dlpack_exec(PyObject *module);
int fsc_py_buffer_exec(PyObject *module); /* called by fsc_py_dlpack_exec */
int fsc_py_comm_exec(PyObject *module);
int fsc_py_rendezvous_exec(PyObject *module); /* with comm: timeout parsing, segment names */
int fsc_py_gpu_exec(PyObject *module);

#endif /* FSC_PY_BINDING_H */
