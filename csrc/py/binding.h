/* binding.h — what binding-layer files share: module state, error mapping, DLPack import. */
#ifndef FSC_PY_BINDING_H
#define FSC_PY_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "base/status.h"
#include "base/tensor.h"
#include "comm/comm.h"
#include "comm/shm.h"

/* Per-module state (PEP 489). Each subsystem's exec function fills its own fields. */
typedef struct {
    PyObject *DistributedError; /* fairscale_c.DistributedError, a RuntimeError subclass */
    PyTypeObject *BufferType;   /* _C.Buffer: C-owned host memory exported through DLPack */
    PyTypeObject *GroupType;    /* _C.ShmGroup (collective engine, shm backend) */
    PyTypeObject *WorkType;     /* _C.Work (async collective handle) */
    PyTypeObject *NcclCommType; /* _C.NcclComm (collective engine, nccl backend) */
    /* DLPack C exchange API of the tensor type that has one (torch.Tensor), found at first use */
    PyObject *xtype;    /* the type that defines it (its subclasses use it too) */
    PyObject *xcapsule; /* its __dlpack_c_exchange_api__ capsule (keeps the API alive) */
    const void *xapi;   /* const DLPackExchangeAPI * */
    PyObject *xnone;    /* the last type found without one (probed once, not every call) */
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

/* ---- shared argument parsing (args.c) ---- */

/* "O&" converter for a stream argument: a non-negative int (a cudaStream_t; 0 = legacy default),
 * stored as uintptr_t. */
int fsc_py_stream_converter(PyObject *obj, void *out);

/* The optional stream argument `obj` of `fname`: None (*given = 0; the tensors are CPU tensors)
 * or a stream as fsc_py_stream_converter takes it (*given = 1, *out = the stream). Returns 0, or
 * -1 with a TypeError naming `fname` and the value. */
int fsc_py_parse_optional_stream(PyObject *obj, const char *fname, int *given, uintptr_t *out);

/* Parse "sum" | "avg" | "max" | "min"; ValueError naming the accepted values otherwise. */
int fsc_py_parse_redop(PyObject *module, const char *name, fsc_reduce_op_t *op);

/* A send / recv's message tag: `tag` (NULL: 0) must be an int (operator.index) that fits int32.
 * TypeError or ValueError naming `opname` and the argument otherwise; returns 0 or -1. */
int fsc_py_parse_tag(PyObject *tag, const char *opname, int32_t *out);
/* A rank argument (root, dst, src, a batch item's peer): an int that fits a C int, else a
 * TypeError or ValueError naming it; the engine checks it against the group's size. */
int fsc_py_parse_rank(PyObject *v, const char *opname, const char *argname, int *out);

#define FSC_PY_IMPORTS_INLINE 4

/* The tensor arguments of one call into C, imported in order: their views (tensors[0..n)) and
 * the references that keep their memory alive (owners[i] for tensors[i]). Room for
 * FSC_PY_IMPORTS_INLINE views is inline; fsc_py_imports_init allocates more. */
typedef struct {
    fsc_tensor_t *tensors;
    PyObject **owners;
    size_t n, cap;
    fsc_tensor_t tensors_inline[FSC_PY_IMPORTS_INLINE];
    PyObject *owners_inline[FSC_PY_IMPORTS_INLINE];
} fsc_py_imports_t;

/* Room for `n` views; cannot fail for n <= FSC_PY_IMPORTS_INLINE, else -1 with MemoryError. */
int fsc_py_imports_init(fsc_py_imports_t *im, size_t n);

/* Import `obj` (fsc_py_import with `flags` and `stream`) into the next slot of `im`; *out points
 * at the view. -1 with the exception set on failure. */
int fsc_py_import_arg(fsc_py_imports_t *im, PyObject *module, PyObject *obj, const char *argname, int flags,
                      intptr_t stream, fsc_tensor_t **out);

/* Drop the owners and free what fsc_py_imports_init allocated. Idempotent. */
void fsc_py_imports_clear(fsc_py_imports_t *im);

/* The owners as a new tuple (they move into it; `im` keeps none). NULL with an exception set. */
PyObject *fsc_py_imports_owners(fsc_py_imports_t *im);

/* The end of a binding that returns None: clear `im`, then None, or the exception for `st`. */
PyObject *fsc_py_imports_finish(PyObject *module, fsc_py_imports_t *im, fsc_status_t st);

/* An import failed (exception set): clear `im` and return NULL. */
PyObject *fsc_py_imports_fail(fsc_py_imports_t *im);

#define FSC_PY_CALLS_INLINE (FSC_PY_IMPORTS_INLINE / 2)

/* The imported arguments of one call or a batch of calls: the engine's call descriptions and the
 * tensors they point at (two slots per call). */
typedef struct {
    fsc_comm_call_t *calls;
    size_t ncalls, cap_calls;
    fsc_comm_call_t calls_inline[FSC_PY_CALLS_INLINE];
    fsc_py_imports_t args;
    fsc_tensor_t *views; /* blocks of the imported tensors the calls point at (an all-to-all), or NULL */
} fsc_py_calls_t;

/* Room for `ncalls` calls (two tensors each). -1 with MemoryError set on failure. */
int fsc_py_calls_init(fsc_py_calls_t *c, size_t ncalls);

/* Drop the owners and free what fsc_py_calls_init allocated. Idempotent. */
void fsc_py_calls_clear(fsc_py_calls_t *c);

/* Parse `ops`, a sequence of 1..max tuples (name, *args) as the single-op methods take their
 * arguments: ("all_gather", output, input), ("reduce_scatter", output, input, op),
 * ("all_reduce", tensor, op), ("broadcast", tensor, root), ("reduce", tensor, op, root),
 * ("send", tensor, peer[, tag]), ("recv", tensor, peer[, tag]), ("copy", output, input). Tensors are imported with
 * `flags` (plus FSC_IMPORT_WRITABLE for written ones). Initialises `c`; on failure it is cleared. */
int fsc_py_parse_calls(fsc_py_calls_t *c, PyObject *module, PyObject *ops, size_t max, int flags, intptr_t stream);

/* An all_to_all_single(output, input, output_split_sizes, input_split_sizes) on a group of `size`
 * ranks as the engine's calls (fsc_comm_all_to_all_plan, which checks every argument rule):
 * imports both tensors with `flags` (output writable), takes each split-size argument as None /
 * an empty sequence (equal blocks) or a sequence of `size` ints, and fills `c` with the sends,
 * recvs and own-block copy; `device_type` < 0 takes the output's. Initialises `c`; -1 with an exception set (and `c`
 * cleared) otherwise. */
int fsc_py_parse_all_to_all(fsc_py_calls_t *c, PyObject *module, PyObject *output, PyObject *input,
                            PyObject *output_split_sizes, PyObject *input_split_sizes, int rank, int size, int flags,
                            intptr_t stream, int device_type, int device_id);

/* Subsystem hooks called from the module's exec slot, in this order. Each adds its
 * functions/types to `module`, fills its state fields, and returns 0 or -1 with an
 * exception set. A subsystem that is not built simply is not listed in module.c. */
int fsc_py_errors_exec(PyObject *module);
int fsc_py_dlpack_exec(PyObject *module);
int fsc_py_buffer_exec(PyObject *module); /* called by fsc_py_dlpack_exec */
int fsc_py_comm_exec(PyObject *module);
int fsc_py_work_exec(PyObject *module);       /* called by fsc_py_comm_exec */
int fsc_py_rendezvous_exec(PyObject *module); /* with comm: timeout parsing, segment names */
int fsc_py_gpu_exec(PyObject *module);
int fsc_py_nccl_exec(PyObject *module);

/* _C.Work (work.c): the handle of an op queued on a shm group. */
typedef struct {
    PyObject_HEAD fsc_shm_work_t *work;
    PyObject *owners; /* tuple keeping the tensors' memory alive until the op finishes */
    PyObject *module;
} fsc_py_work_t;

/* Wait for `w`'s op with the GIL released in slices, checking for signals between slices.
 * Returns 0 when the op finished OK, -1 with an exception set otherwise (its error, a signal's,
 * or DistributedError when timeout_s passed first; in a fork() child of the process that issued
 * it, DistributedError at once: the op runs in the parent). timeout_s < 0: no limit. */
int fsc_py_work_block(fsc_py_work_t *w, double timeout_s);

/* A wait for an op, GIL held at both ends: fsc_py_wait_begin() before, fsc_py_wait_end() after
 * (-1 when an exception is set then, else 0). In between, fsc_py_check_signals() runs Python's
 * signal handlers: KeyboardInterrupt or SystemExit from one is -1 with it set (the wait stops).
 * Any other exception a handler raises (torch's DataLoader raises one from SIGCHLD when a worker
 * dies) is kept until the op it interrupted has finished, and fsc_py_wait_end of that wait raises
 * it, an error already set taking it as __context__: as it would surface had the handler run
 * after the call, as with gloo; stopping the op would leave the group unusable on every rank. */
void fsc_py_wait_begin(void);
int fsc_py_check_signals(void);
int fsc_py_wait_end(void);

/* Parse the optional seconds argument `name` of `method` ("|O"): None -> -1 (no limit); else a
 * number >= 0 (infinity: no limit), or a datetime.timedelta (its total_seconds()). Returns -1 with ValueError/TypeError
 * set on a bad value, else 0. */
int fsc_py_parse_seconds(PyObject *args, PyObject *kwds, const char *method, char *name, double *out);

/* A PyMethodDef entry for a function taking (self, args, kwargs). */
#define FSC_PY_KW_METHOD(name, fn, doc) \
    { name, (PyCFunction)(void (*)(void))fn, METH_VARARGS | METH_KEYWORDS, doc }

#endif /* FSC_PY_BINDING_H */
