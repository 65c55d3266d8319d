/* gpu.c — Python bindings for csrc/gpu/gpu.h (CUDA discovery and kernels) and their CPU
 * references in csrc/gpu/kernels_cpu.h. gpu_info() also reports the NCCL library found
 * (csrc/comm/nccl.h); the communicator binding is in nccl.c. */
#include <string.h>

#include "binding.h"
#include "comm/nccl.h"
#include "gpu/gpu.h"
#include "gpu/kernels_cpu.h"

/* Import flags of the kernels' arguments: contiguous views; written ones writable; the CPU
 * references take CPU tensors only. */
#define ARG_IN FSC_IMPORT_CONTIGUOUS
#define ARG_OUT (FSC_IMPORT_CONTIGUOUS | FSC_IMPORT_WRITABLE)
#define ARG_PLACE(cuda) ((cuda) ? 0 : FSC_IMPORT_CPU_ONLY)

/* ---- discovery -------------------------------------------------------------------------------- */

static PyObject *str_or_none(const char *s) {
    if (s == NULL || *s == '\0') Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(s);
}

/* gpu_info() -> dict: what CUDA and NCCL pieces this process can use. Never raises for a
 * missing driver; initialises the driver when there is one. */
static PyObject *py_gpu_info(PyObject *module, PyObject *Py_UNUSED(args)) {
    (void)module;
    fsc_gpu_info_t info;
    Py_BEGIN_ALLOW_THREADS
    fsc_gpu_info(&info);
    Py_END_ALLOW_THREADS
    PyObject *driver_path = str_or_none(info.driver_path);
    PyObject *runtime_path = str_or_none(info.runtime_path);
    PyObject *error = str_or_none(info.error);
    PyObject *nccl_path = str_or_none(fsc_nccl_path());
    PyObject *d = NULL;
    if (driver_path && runtime_path && error && nccl_path)
        d = Py_BuildValue("{s:O, s:i, s:O, s:O, s:i, s:O, s:O, s:i, s:O, s:i, s:O}", "driver_found",
                          info.driver_found ? Py_True : Py_False, "driver_version", info.driver_version, "driver_path",
                          driver_path, "runtime_found", info.runtime_found ? Py_True : Py_False, "runtime_version",
                          info.runtime_version, "runtime_path", runtime_path, "kernels_built",
                          info.kernels_built ? Py_True : Py_False, "device_count", info.device_count, "error", error,
                          "nccl_version", fsc_nccl_version(), "nccl_path", nccl_path);
    Py_XDECREF(driver_path);
    Py_XDECREF(runtime_path);
    Py_XDECREF(error);
    Py_XDECREF(nccl_path);
    return d;
}

/* ---- kernels and their CPU references ------------------------------------------------------- */

static PyObject *py_cuda_cast(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "src", "stream", NULL};
    PyObject *dst_obj, *src_obj;
    fsc_stream_t stream;
    fsc_py_imports_t im;
    fsc_tensor_t *dst, *src;
    fsc_status_t st;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO&:cuda_cast", kwlist, &dst_obj, &src_obj,
                                     fsc_py_stream_converter, &stream))
        return NULL;
    fsc_py_imports_init(&im, 2); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, dst_obj, "dst", ARG_OUT, stream, &dst) < 0 ||
        fsc_py_import_arg(&im, module, src_obj, "src", ARG_IN, stream, &src) < 0)
        return fsc_py_imports_fail(&im);
    Py_BEGIN_ALLOW_THREADS
    st = fsc_gpu_cast(dst, src, stream);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

/* Shared by the CUDA and CPU unscale bindings. */
static PyObject *unscale(PyObject *module, PyObject *args, PyObject *kwargs, int cuda) {
    static char *kwlist_cuda[] = {"buf", "inv_scale", "found_inf", "stream", NULL};
    static char *kwlist_cpu[] = {"buf", "inv_scale", "found_inf", NULL};
    PyObject *buf_obj, *fi_obj;
    float inv_scale;
    fsc_stream_t stream = 0;
    fsc_py_imports_t im;
    fsc_tensor_t *buf, *fi;
    fsc_status_t st;
    int ok = cuda ? PyArg_ParseTupleAndKeywords(args, kwargs, "OfOO&:cuda_unscale_inf_check", kwlist_cuda, &buf_obj,
                                                &inv_scale, &fi_obj, fsc_py_stream_converter, &stream)
                  : PyArg_ParseTupleAndKeywords(args, kwargs, "OfO:cpu_unscale_inf_check", kwlist_cpu, &buf_obj,
                                                &inv_scale, &fi_obj);
    if (!ok) return NULL;
    fsc_py_imports_init(&im, 2); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, buf_obj, "buf", ARG_OUT | ARG_PLACE(cuda), stream, &buf) < 0 ||
        fsc_py_import_arg(&im, module, fi_obj, "found_inf", ARG_OUT | ARG_PLACE(cuda), stream, &fi) < 0)
        return fsc_py_imports_fail(&im);
    Py_BEGIN_ALLOW_THREADS
    st = cuda ? fsc_gpu_unscale_inf_check(buf, inv_scale, fi, stream) : fsc_cpu_unscale_inf_check(buf, inv_scale, fi);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

static PyObject *py_cuda_unscale(PyObject *module, PyObject *args, PyObject *kwargs) {
    return unscale(module, args, kwargs, 1);
}

static PyObject *py_cpu_unscale(PyObject *module, PyObject *args, PyObject *kwargs) {
    return unscale(module, args, kwargs, 0);
}

static PyObject *py_cuda_sq_norm(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"out", "x", "workspace", "stream", "absmax", NULL};
    PyObject *out_obj, *x_obj, *ws_obj;
    fsc_stream_t stream;
    int absmax = 0;
    fsc_py_imports_t im;
    fsc_tensor_t *out, *x, *ws;
    fsc_status_t st;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO&|p:cuda_sq_norm", kwlist, &out_obj, &x_obj, &ws_obj,
                                     fsc_py_stream_converter, &stream, &absmax))
        return NULL;
    fsc_py_imports_init(&im, 3); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, out_obj, "out", ARG_OUT, stream, &out) < 0 ||
        fsc_py_import_arg(&im, module, x_obj, "x", ARG_IN, stream, &x) < 0 ||
        fsc_py_import_arg(&im, module, ws_obj, "workspace", ARG_OUT, stream, &ws) < 0)
        return fsc_py_imports_fail(&im);
    Py_BEGIN_ALLOW_THREADS
    st = fsc_gpu_norm(x, absmax ? FSC_NORM_ABSMAX : FSC_NORM_SUMSQ, ws, out, stream);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

static PyObject *py_cpu_sq_norm(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", "absmax", NULL};
    PyObject *x_obj;
    int absmax = 0;
    fsc_py_imports_t im;
    fsc_tensor_t *x;
    fsc_status_t st;
    float result = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p:cpu_sq_norm", kwlist, &x_obj, &absmax)) return NULL;
    fsc_py_imports_init(&im, 1); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, x_obj, "x", ARG_IN | ARG_PLACE(0), 0, &x) < 0) return fsc_py_imports_fail(&im);
    Py_BEGIN_ALLOW_THREADS
    st = fsc_cpu_norm(x, absmax ? FSC_NORM_ABSMAX : FSC_NORM_SUMSQ, &result);
    Py_END_ALLOW_THREADS
    fsc_py_imports_clear(&im);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    return PyFloat_FromDouble(result);
}

/* Shared by the CUDA and CPU AdamW bindings. */
static PyObject *adamw(PyObject *module, PyObject *args, PyObject *kwargs, int cuda) {
    /* the CPU reference takes everything but the trailing stream */
    static char *kwlist_cuda[] = {"param", "grad", "exp_avg",      "exp_avg_sq", "lr",     "beta1",
                                  "beta2", "eps",  "weight_decay", "step",       "stream", NULL};
    static char *kwlist_cpu[] = {"param", "grad", "exp_avg",      "exp_avg_sq", "lr", "beta1",
                                 "beta2", "eps",  "weight_decay", "step",       NULL};
    PyObject *objs[4];
    fsc_adamw_hparams_t hp;
    long long step;
    fsc_stream_t stream = 0;
    fsc_py_imports_t im;
    fsc_tensor_t *t[4];
    fsc_status_t st;
    static const char *names[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, cuda ? "OOOOdddddLO&:cuda_adamw_step" : "OOOOdddddL:cpu_adamw_step",
                                     cuda ? kwlist_cuda : kwlist_cpu, &objs[0], &objs[1], &objs[2], &objs[3], &hp.lr,
                                     &hp.beta1, &hp.beta2, &hp.eps, &hp.weight_decay, &step, fsc_py_stream_converter,
                                     &stream))
        return NULL;
    hp.step = step;
    fsc_py_imports_init(&im, 4); /* inline: cannot fail */
    for (int i = 0; i < 4; i++)
        if (fsc_py_import_arg(&im, module, objs[i], names[i], (i != 1 ? ARG_OUT : ARG_IN) | ARG_PLACE(cuda), stream,
                              &t[i]) < 0)
            return fsc_py_imports_fail(&im);
    Py_BEGIN_ALLOW_THREADS
    st = cuda ? fsc_gpu_adamw_step(t[0], t[1], t[2], t[3], &hp, stream)
              : fsc_cpu_adamw_step(t[0], t[1], t[2], t[3], &hp);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

static PyObject *py_cuda_adamw(PyObject *module, PyObject *args, PyObject *kwargs) {
    return adamw(module, args, kwargs, 1);
}

static PyObject *py_cpu_adamw(PyObject *module, PyObject *args, PyObject *kwargs) {
    return adamw(module, args, kwargs, 0);
}

/* Shared by the CUDA and CPU bindings of FairScale's fused Adam step. */
static PyObject *fs_adam(PyObject *module, PyObject *args, PyObject *kwargs, int cuda) {
    static char *kwlist_cuda[] = {"param",
                                  "grad",
                                  "exp_avg",
                                  "exp_avg_sq",
                                  "param_copy",
                                  "found_inf",
                                  "lr",
                                  "beta1",
                                  "beta2",
                                  "eps",
                                  "weight_decay",
                                  "step",
                                  "bias_correction",
                                  "eps_inside_sqrt",
                                  "grad_scale",
                                  "optim_scale",
                                  "stream",
                                  NULL};
    static char *kwlist_cpu[] = {"param",        "grad", "exp_avg",         "exp_avg_sq",      "param_copy",
                                 "found_inf",    "lr",   "beta1",           "beta2",           "eps",
                                 "weight_decay", "step", "bias_correction", "eps_inside_sqrt", "grad_scale",
                                 "optim_scale",  NULL};
    static const char *names[6] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy", "found_inf"};
    PyObject *objs[6];
    double lr, beta1, beta2, eps, wd, grad_scale, optim_scale;
    long long step;
    int bias_correction, inside;
    fsc_stream_t stream = 0;
    fsc_py_imports_t im;
    fsc_tensor_t *t[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    fsc_fs_adam_scalars_t sc;
    fsc_status_t st;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, cuda ? "OOOOOOdddddLppddO&:cuda_fs_adam_step" : "OOOOOOdddddLppdd:cpu_fs_adam_step",
            cuda ? kwlist_cuda : kwlist_cpu, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &lr, &beta1,
            &beta2, &eps, &wd, &step, &bias_correction, &inside, &grad_scale, &optim_scale, fsc_py_stream_converter,
            &stream))
        return NULL;
    st = fsc_fs_adam_prepare(lr, beta1, beta2, eps, wd, (int64_t)step, bias_correction, inside, grad_scale, optim_scale,
                             &sc);
    if (st != FSC_OK) return fsc_py_raise(module, st);
    fsc_py_imports_init(&im, 6); /* inline: cannot fail */
    for (int i = 0; i < 6; i++) {
        if (i == 4 && objs[i] == Py_None) continue; /* no param_copy */
        if (fsc_py_import_arg(&im, module, objs[i], names[i], (i != 1 ? ARG_OUT : ARG_IN) | ARG_PLACE(cuda), stream,
                              &t[i]) < 0)
            return fsc_py_imports_fail(&im);
    }
    Py_BEGIN_ALLOW_THREADS
    st = cuda ? fsc_gpu_fs_adam_step(t[0], t[1], t[2], t[3], t[4], &sc, t[5], stream)
              : fsc_cpu_fs_adam_step(t[0], t[1], t[2], t[3], t[4], &sc, t[5]);
    Py_END_ALLOW_THREADS
    return fsc_py_imports_finish(module, &im, st);
}

static PyObject *py_cuda_fs_adam(PyObject *module, PyObject *args, PyObject *kwargs) {
    return fs_adam(module, args, kwargs, 1);
}

static PyObject *py_cpu_fs_adam(PyObject *module, PyObject *args, PyObject *kwargs) {
    return fs_adam(module, args, kwargs, 0);
}

/* FairScale's fused Adam over a list of parameters in one call: the per-parameter Python and
 * binding costs of fs_adam paid once. Every list has one entry per parameter (param_copies may
 * be None); steps holds each parameter's step count. */
static PyObject *fs_adam_multi(PyObject *module, PyObject *args, PyObject *kwargs, int cuda) {
    static char *kwlist_cuda[] = {
        "params",     "grads",       "exp_avgs", "exp_avg_sqs", "param_copies", "steps",           "found_inf",
        "lr",         "beta1",       "beta2",    "eps",         "weight_decay", "bias_correction", "eps_inside_sqrt",
        "grad_scale", "optim_scale", "stream",   NULL};
    static char *kwlist_cpu[] = {
        "params",     "grads",       "exp_avgs", "exp_avg_sqs", "param_copies", "steps",           "found_inf",
        "lr",         "beta1",       "beta2",    "eps",         "weight_decay", "bias_correction", "eps_inside_sqrt",
        "grad_scale", "optim_scale", "threads",  NULL};
    static const char *names[5] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "param_copies"};
    PyObject *objs[5], *steps_obj, *found_obj, *seqs[5] = {NULL, NULL, NULL, NULL, NULL}, *steps = NULL;
    double lr, beta1, beta2, eps, wd, grad_scale, optim_scale;
    int bias_correction, inside, threads = 1;
    fsc_stream_t stream = 0;
    fsc_py_imports_t im;
    fsc_tensor_t **t = NULL, *found = NULL;
    fsc_fs_adam_scalars_t *sc = NULL;
    fsc_status_t st = FSC_OK;
    PyObject *result = NULL;
    fsc_py_imports_init(&im, 0); /* inline: cannot fail */
    if (cuda ? !PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOdddddppddO&:cuda_fs_adam_multi", kwlist_cuda,
                                            &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &steps_obj, &found_obj,
                                            &lr, &beta1, &beta2, &eps, &wd, &bias_correction, &inside, &grad_scale,
                                            &optim_scale, fsc_py_stream_converter, &stream)
             : !PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOdddddppdd|$i:cpu_fs_adam_multi", kwlist_cpu, &objs[0],
                                            &objs[1], &objs[2], &objs[3], &objs[4], &steps_obj, &found_obj, &lr, &beta1,
                                            &beta2, &eps, &wd, &bias_correction, &inside, &grad_scale, &optim_scale,
                                            &threads))
        return NULL;
    int lists = objs[4] == Py_None ? 4 : 5;
    for (int k = 0; k < lists; k++) {
        seqs[k] = PySequence_Fast(objs[k], "");
        if (seqs[k] == NULL) {
            PyErr_Format(PyExc_TypeError, "argument '%s': expected a list of tensors, got %.200s", names[k],
                         Py_TYPE(objs[k])->tp_name);
            goto exit;
        }
    }
    steps = PySequence_Fast(steps_obj, "");
    if (steps == NULL) {
        PyErr_Format(PyExc_TypeError, "argument 'steps': expected a list of ints, got %.200s",
                     Py_TYPE(steps_obj)->tp_name);
        goto exit;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs[0]);
    for (int k = 1; k <= lists; k++) {
        PyObject *seq = k < lists ? seqs[k] : steps;
        if (PySequence_Fast_GET_SIZE(seq) != n) {
            PyErr_Format(PyExc_ValueError, "argument '%s': %zd entries, expected %zd (one per param)",
                         k < lists ? names[k] : "steps", PySequence_Fast_GET_SIZE(seq), n);
            goto exit;
        }
    }
    t = PyMem_Calloc((size_t)(n * 5 + 1), sizeof(*t));
    sc = PyMem_Calloc((size_t)n + 1, sizeof(*sc));
    if (t == NULL || sc == NULL || fsc_py_imports_init(&im, (size_t)(n * lists + 1)) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto exit;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long step = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(steps, i));
        if (step == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "argument 'steps': entry %zd is not an int", i);
            goto exit;
        }
        st = fsc_fs_adam_prepare(lr, beta1, beta2, eps, wd, (int64_t)step, bias_correction, inside, grad_scale,
                                 optim_scale, &sc[i]);
        if (st != FSC_OK) goto exit;
        for (int k = 0; k < lists; k++) {
            PyObject *obj = PySequence_Fast_GET_ITEM(seqs[k], i);
            if (k == 4 && obj == Py_None) continue; /* this parameter has no half copy */
            if (fsc_py_import_arg(&im, module, obj, names[k], (k != 1 ? ARG_OUT : ARG_IN) | ARG_PLACE(cuda), stream,
                                  &t[i * 5 + k]) < 0)
                goto exit;
        }
    }
    if (fsc_py_import_arg(&im, module, found_obj, "found_inf", ARG_OUT | ARG_PLACE(cuda), stream, &found) < 0)
        goto exit;
    Py_BEGIN_ALLOW_THREADS
    st = cuda ? fsc_gpu_fs_adam_multi(t, sc, n, found, stream) : fsc_cpu_fs_adam_multi(t, sc, n, found, threads);
    Py_END_ALLOW_THREADS
exit:
    if (PyErr_Occurred())
        fsc_py_imports_clear(&im);
    else
        result = fsc_py_imports_finish(module, &im, st);
    for (int k = 0; k < 5; k++) Py_XDECREF(seqs[k]);
    Py_XDECREF(steps);
    PyMem_Free(t);
    PyMem_Free(sc);
    return result;
}

static PyObject *py_cuda_fs_adam_multi(PyObject *module, PyObject *args, PyObject *kwargs) {
    return fs_adam_multi(module, args, kwargs, 1);
}

static PyObject *py_cpu_fs_adam_multi(PyObject *module, PyObject *args, PyObject *kwargs) {
    return fs_adam_multi(module, args, kwargs, 0);
}

static PyObject *py_cpu_bn_combine(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"gathered", "world", "eps", "out", NULL};
    PyObject *g_obj, *o_obj;
    int world;
    double eps;
    fsc_py_imports_t im;
    fsc_tensor_t *g, *o;
    fsc_status_t st;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OidO:cpu_bn_combine", kwlist, &g_obj, &world, &eps, &o_obj))
        return NULL;
    fsc_py_imports_init(&im, 2); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, g_obj, "gathered", ARG_IN | ARG_PLACE(0), 0, &g) < 0 ||
        fsc_py_import_arg(&im, module, o_obj, "out", ARG_OUT | ARG_PLACE(0), 0, &o) < 0)
        return fsc_py_imports_fail(&im);
    st = fsc_cpu_bn_combine(g, world, eps, o);
    return fsc_py_imports_finish(module, &im, st);
}

static PyObject *py_cpu_bn_coeffs(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"sums", "total", "invstd", "weight", "out", NULL};
    PyObject *s_obj, *i_obj, *w_obj, *o_obj;
    double total;
    fsc_py_imports_t im;
    fsc_tensor_t *s, *inv, *w = NULL, *o;
    fsc_status_t st;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OdOOO:cpu_bn_coeffs", kwlist, &s_obj, &total, &i_obj, &w_obj,
                                     &o_obj))
        return NULL;
    fsc_py_imports_init(&im, 4); /* inline: cannot fail */
    if (fsc_py_import_arg(&im, module, s_obj, "sums", ARG_IN | ARG_PLACE(0), 0, &s) < 0 ||
        fsc_py_import_arg(&im, module, i_obj, "invstd", ARG_IN | ARG_PLACE(0), 0, &inv) < 0 ||
        (w_obj != Py_None && fsc_py_import_arg(&im, module, w_obj, "weight", ARG_IN | ARG_PLACE(0), 0, &w) < 0) ||
        fsc_py_import_arg(&im, module, o_obj, "out", ARG_OUT | ARG_PLACE(0), 0, &o) < 0)
        return fsc_py_imports_fail(&im);
    st = fsc_cpu_bn_coeffs(s, total, inv, w, o);
    return fsc_py_imports_finish(module, &im, st);
}

static PyMethodDef gpu_functions[] = {
    {"gpu_info", py_gpu_info, METH_NOARGS,
     "gpu_info() -> dict: CUDA driver/runtime found and versions, kernels built, device count, NCCL loaded."},
    FSC_PY_KW_METHOD("cuda_cast", py_cuda_cast,
                     "cuda_cast(dst, src, stream): float32 <-> float16/bfloat16 cast kernel (round to nearest even)."),
    FSC_PY_KW_METHOD(
        "cuda_unscale_inf_check", py_cuda_unscale,
        "cuda_unscale_inf_check(buf, inv_scale, found_inf, stream): buf *= inv_scale; found_inf = 1 if any "
        "element was non-finite."),
    FSC_PY_KW_METHOD("cuda_sq_norm", py_cuda_sq_norm,
                     "cuda_sq_norm(out, x, workspace, stream, absmax=False): out[0] = sum(x**2) (or max|x|)."),
    FSC_PY_KW_METHOD("cuda_adamw_step", py_cuda_adamw,
                     "cuda_adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, "
                     "stream): fused AdamW on flat float32 shards."),
    FSC_PY_KW_METHOD("cpu_unscale_inf_check", py_cpu_unscale,
                     "cpu_unscale_inf_check(buf, inv_scale, found_inf): CPU reference of cuda_unscale_inf_check."),
    FSC_PY_KW_METHOD("cpu_sq_norm", py_cpu_sq_norm,
                     "cpu_sq_norm(x, absmax=False) -> float: CPU reference of cuda_sq_norm."),
    FSC_PY_KW_METHOD("cpu_adamw_step", py_cpu_adamw,
                     "cpu_adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step): CPU "
                     "reference of cuda_adamw_step."),
    FSC_PY_KW_METHOD("cuda_fs_adam_step", py_cuda_fs_adam,
                     "cuda_fs_adam_step(param, grad, exp_avg, exp_avg_sq, param_copy, found_inf, lr, beta1, beta2, "
                     "eps, weight_decay, step, bias_correction, eps_inside_sqrt, grad_scale, optim_scale, stream): "
                     "FairScale's fused Adam on one parameter (param_copy: None or a half copy to write)."),
    FSC_PY_KW_METHOD("cpu_fs_adam_step", py_cpu_fs_adam,
                     "cpu_fs_adam_step(param, grad, exp_avg, exp_avg_sq, param_copy, found_inf, lr, beta1, beta2, "
                     "eps, weight_decay, step, bias_correction, eps_inside_sqrt, grad_scale, optim_scale): the same "
                     "on CPU tensors (bit-identical)."),
    FSC_PY_KW_METHOD("cuda_fs_adam_multi", py_cuda_fs_adam_multi,
                     "cuda_fs_adam_multi(params, grads, exp_avgs, exp_avg_sqs, param_copies, steps, found_inf, lr, "
                     "beta1, beta2, eps, weight_decay, bias_correction, eps_inside_sqrt, grad_scale, optim_scale, "
                     "stream): cuda_fs_adam_step over lists of parameters (param_copies: None or a list with None "
                     "for a parameter without a copy; steps: each parameter's step)."),
    FSC_PY_KW_METHOD("cpu_fs_adam_multi", py_cpu_fs_adam_multi,
                     "cpu_fs_adam_multi(params, grads, exp_avgs, exp_avg_sqs, param_copies, steps, found_inf, lr, "
                     "beta1, beta2, eps, weight_decay, bias_correction, eps_inside_sqrt, grad_scale, optim_scale, *, "
                     "threads=1): the same on CPU tensors, large steps split over up to `threads` threads."),
    FSC_PY_KW_METHOD("cpu_bn_combine", py_cpu_bn_combine,
                     "cpu_bn_combine(gathered, world, eps, out): SyncBatchNorm's statistics over the ranks' "
                     "[mean | var | count] rows into out = [mean | var | invstd | total]."),
    FSC_PY_KW_METHOD("cpu_bn_coeffs", py_cpu_bn_coeffs,
                     "cpu_bn_coeffs(sums, total, invstd, weight, out): SyncBatchNorm's input-gradient coefficients "
                     "[a | b | c] from the reduced [sum dy | sum dy*xhat]."),
    {NULL, NULL, 0, NULL},
};

int fsc_py_gpu_exec(PyObject *module) {
    return PyModule_AddFunctions(module, gpu_functions);
}
