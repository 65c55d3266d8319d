/* module.c — fairscale_c._C: multi-phase init (PEP 489), module state, build_info. */
#include "base/dlpack.h"
#include "base/log.h"
#include "binding.h"

#ifndef FSC_VERSION
#define FSC_VERSION "0.0.0"
#endif

fsc_module_state *fsc_py_state(PyObject *module) {
    return (fsc_module_state *)PyModule_GetState(module);
}

fsc_module_state *fsc_py_state_of(PyObject *self) {
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &fsc_module_def);
    if (module == NULL) return NULL;
    return fsc_py_state(module);
}

/* _C._build_info() -> dict of what was compiled in. Run-time discovery of CUDA and NCCL is
 * reported by gpu_info(); fairscale_c.build_info() merges the two. */
static PyObject *py_build_info(PyObject *module, PyObject *Py_UNUSED(args)) {
    (void)module;
#ifdef FSC_WITH_CUDA_KERNELS
    PyObject *kernels = Py_True;
#else
    PyObject *kernels = Py_False;
#endif
    return Py_BuildValue("{s:s, s:s, s:O, s:s, s:i}", "version", FSC_VERSION, "compiler",
#if defined(__clang__)
                         "clang " __clang_version__,
#elif defined(__GNUC__)
                         "gcc " __VERSION__,
#else
                         "unknown",
#endif
                         "cuda_kernels_built", kernels, "dlpack_version",
                         Py_STRINGIFY(DLPACK_MAJOR_VERSION) "." Py_STRINGIFY(DLPACK_MINOR_VERSION), "c_standard",
                         (int)(__STDC_VERSION__ / 100 % 100));
}

/* _C._set_log_rank(rank): the rank shown in FAIRSCALE_C_DEBUG log lines. */
static PyObject *py_set_log_rank(PyObject *module, PyObject *arg) {
    (void)module;
    long rank = PyLong_AsLong(arg);
    if (rank == -1 && PyErr_Occurred()) return NULL;
    fsc_log_set_rank((int)rank);
    fsc_log_reload();
    Py_RETURN_NONE;
}

/* _C._log(level, message): emit one log line through the C logger (tests use it). */
static PyObject *py_log(PyObject *module, PyObject *args) {
    (void)module;
    int level;
    const char *msg;
    if (!PyArg_ParseTuple(args, "is:_log", &level, &msg)) return NULL;
    if (level < FSC_LOG_WARN || level > FSC_LOG_TRACE) {
        PyErr_Format(PyExc_ValueError, "_log(): argument 'level' must be 1 (WARN), 2 (INFO) or 3 (TRACE), got %d",
                     level);
        return NULL;
    }
    FSC_LOG((fsc_log_level_t)level, "python", "%s", msg);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_build_info", py_build_info, METH_NOARGS, "Compile-time facts about this build."},
    {"_set_log_rank", py_set_log_rank, METH_O, "Set the rank shown in log lines and re-read FAIRSCALE_C_DEBUG."},
    {"_log", py_log, METH_VARARGS, "Write one log line at the given level."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
    if (fsc_py_errors_exec(module) < 0) return -1;
    if (fsc_py_dlpack_exec(module) < 0) return -1;
#ifdef FSC_HAVE_COMM
    if (fsc_py_comm_exec(module) < 0) return -1;
    if (fsc_py_rendezvous_exec(module) < 0) return -1;
#endif
#ifdef FSC_HAVE_GPU
    if (fsc_py_gpu_exec(module) < 0) return -1;
#endif
#ifdef FSC_HAVE_NCCL
    if (fsc_py_nccl_exec(module) < 0) return -1;
#endif
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    fsc_module_state *st = fsc_py_state(module);
    Py_VISIT(st->DistributedError);
    Py_VISIT(st->BufferType);
    Py_VISIT(st->GroupType);
    Py_VISIT(st->WorkType);
    Py_VISIT(st->NcclCommType);
    Py_VISIT(st->xtype);
    Py_VISIT(st->xcapsule);
    Py_VISIT(st->xnone);
    return 0;
}

static int module_clear(PyObject *module) {
    fsc_module_state *st = fsc_py_state(module);
    Py_CLEAR(st->DistributedError);
    Py_CLEAR(st->BufferType);
    Py_CLEAR(st->GroupType);
    Py_CLEAR(st->WorkType);
    Py_CLEAR(st->NcclCommType);
    Py_CLEAR(st->xtype);
    Py_CLEAR(st->xcapsule);
    Py_CLEAR(st->xnone);
    st->xapi = NULL;
    return 0;
}

static void module_free(void *module) {
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef fsc_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fairscale_c._C",
    .m_doc = "fairscale_c's C core: DLPack bridge, collective engine, kernels.",
    .m_size = sizeof(fsc_module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) {
    return PyModuleDef_Init(&fsc_module_def);
}
