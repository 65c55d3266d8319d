/* errors.c — the one place where core status codes become Python exceptions. */
#include "binding.h"

PyObject *fsc_py_raise(PyObject *module, fsc_status_t st) {
    const char *msg = fsc_last_error();
    if (msg == NULL || *msg == '\0') msg = fsc_status_name(st);
    PyObject *exc = PyExc_RuntimeError;
    switch (st) {
        case FSC_OK: /* a caller bug: raising on success */
            exc = PyExc_SystemError;
            msg = "fairscale_c: fsc_py_raise called with FSC_OK";
            break;
        case FSC_ERR_VALUE: exc = PyExc_ValueError; break;
        case FSC_ERR_TYPE: exc = PyExc_TypeError; break;
        case FSC_ERR_DLPACK: exc = PyExc_BufferError; break;
        case FSC_ERR_NOMEM: exc = PyExc_MemoryError; break;
        case FSC_ERR_SYSTEM: exc = PyExc_OSError; break;
        case FSC_ERR_COMM:
        case FSC_ERR_TIMEOUT:
        case FSC_ERR_MISMATCH: {
            fsc_module_state *state = module ? fsc_py_state(module) : NULL;
            if (state != NULL && state->DistributedError != NULL) exc = state->DistributedError;
            break;
        }
        case FSC_ERR_UNAVAILABLE:
        case FSC_ERR_INTERNAL: exc = PyExc_RuntimeError; break;
    }
    PyErr_SetString(exc, msg);
    return NULL;
}

int fsc_py_errors_exec(PyObject *module) {
    fsc_module_state *state = fsc_py_state(module);
    state->DistributedError = PyErr_NewExceptionWithDoc(
        "fairscale_c.DistributedError",
        "A collective failed: a peer died or timed out, or ranks issued mismatched collectives.", PyExc_RuntimeError,
        NULL);
    if (state->DistributedError == NULL) return -1;
    /* PyModule_AddObjectRef keeps our own reference in the state. */
    return PyModule_AddObjectRef(module, "DistributedError", state->DistributedError);
}
