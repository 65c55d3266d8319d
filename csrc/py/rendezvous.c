/* rendezvous.c — what fairscale_c.distributed's rendezvous takes from the core: the one parser
 * of FAIRSCALE_C_TIMEOUT, and fresh shared-memory segment names (which carry what the sweep of
 * stale segments needs: the creator's pid and pid namespace). */
#include "binding.h"
#include "comm/comm.h"
#include "comm/shm.h"

/* _comm_timeout_s() -> float: FAIRSCALE_C_TIMEOUT in seconds (600 when unset); ValueError naming
 * the variable and its value when it is not a finite number in (0, 1e9]. */
static PyObject *py_comm_timeout_s(PyObject *module, PyObject *Py_UNUSED(args)) {
    double t = 0;
    fsc_status_t st = fsc_comm_timeout_get(&t);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return PyFloat_FromDouble(t);
}

/* _shm_segment_name() -> str: a fresh "/fsc-<pid>-<pidns>-<hex>" for a creator to publish. */
static PyObject *py_shm_segment_name(PyObject *module, PyObject *Py_UNUSED(args)) {
    (void)module;
    char name[64];
    fsc_shm_segment_name(name, sizeof(name));
    return PyUnicode_FromString(name);
}

static PyMethodDef rendezvous_functions[] = {
    {"_comm_timeout_s", py_comm_timeout_s, METH_NOARGS,
     "_comm_timeout_s() -> float: FAIRSCALE_C_TIMEOUT in seconds (600 when unset); ValueError when invalid."},
    {"_shm_segment_name", py_shm_segment_name, METH_NOARGS,
     "_shm_segment_name() -> str: a fresh shared-memory segment name for a group's creator to publish."},
    {NULL, NULL, 0, NULL},
};

int fsc_py_rendezvous_exec(PyObject *module) {
    return PyModule_AddFunctions(module, rendezvous_functions);
}
