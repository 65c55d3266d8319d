/* gpu.c — run-time loader for the CUDA driver (libcuda.so.1) and runtime (libcudart): contexts,
 * events, streams, the embedded kernel image and its launches (the launchers that check their
 * arguments are in launchers.c). The only file that talks to the CUDA driver; nothing here needs
 * CUDA headers or libraries at build time. */
#include "gpu/gpu.h"
#include "gpu/gpu_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"

/* ---- the driver ABI we use (from the documented cuda.h; no header needed) --------------- */

typedef int cu_result_t; /* CUresult */
typedef int cu_device_t; /* CUdevice */
typedef void *cu_context_t;
typedef void *cu_module_t;
typedef void *cu_function_t;
typedef void *cu_stream_t;
typedef void *cu_event_t;
typedef unsigned long long cu_deviceptr_t; /* CUdeviceptr */

/* CUDA_MEMCPY2D as cuMemcpy2DAsync_v2 takes it (size_t fields). */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType; /* CUmemorytype */
    const void *srcHost;
    cu_deviceptr_t srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    cu_deviceptr_t dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} cu_memcpy2d_t;

#define CU_SUCCESS 0
#define CU_ERROR_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEMORYTYPE_DEVICE 0x2

/* Entry points, by their exported (versioned) symbol names: cuda.h maps e.g. cuEventDestroy
 * to cuEventDestroy_v2. The non-"_ptsz" variants are used, so stream 0 means the legacy
 * default stream, as it does for torch. */
typedef struct {
    cu_result_t (*cuInit)(unsigned int);
    cu_result_t (*cuDriverGetVersion)(int *);
    cu_result_t (*cuDeviceGetCount)(int *);
    cu_result_t (*cuDeviceGet)(cu_device_t *, int);
    cu_result_t (*cuDevicePrimaryCtxRetain)(cu_context_t *, cu_device_t);
    cu_result_t (*cuCtxGetCurrent)(cu_context_t *);
    cu_result_t (*cuCtxSetCurrent)(cu_context_t);
    cu_result_t (*cuCtxPushCurrent)(cu_context_t);
    cu_result_t (*cuCtxPopCurrent)(cu_context_t *);
    cu_result_t (*cuModuleLoadData)(cu_module_t *, const void *);
    cu_result_t (*cuModuleGetFunction)(cu_function_t *, cu_module_t, const char *);
    cu_result_t (*cuLaunchKernel)(cu_function_t, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                  unsigned int, unsigned int, cu_stream_t, void **, void **);
    cu_result_t (*cuStreamSynchronize)(cu_stream_t);
    cu_result_t (*cuEventCreate)(cu_event_t *, unsigned int);
    cu_result_t (*cuEventRecord)(cu_event_t, cu_stream_t);
    cu_result_t (*cuEventQuery)(cu_event_t);
    cu_result_t (*cuEventDestroy)(cu_event_t);
    cu_result_t (*cuMemcpy2DAsync)(const cu_memcpy2d_t *, cu_stream_t);
    cu_result_t (*cuMemcpyDtoDAsync)(cu_deviceptr_t, cu_deviceptr_t, size_t, cu_stream_t);
    cu_result_t (*cuGetErrorName)(cu_result_t, const char **);
    cu_result_t (*cuGetErrorString)(cu_result_t, const char **);
} cu_api_t;

static const struct {
    const char *name;
    size_t offset;
} cu_symbols[] = {
#define CU_SYM(field, sym) \
    { sym, offsetof(cu_api_t, field) }
    CU_SYM(cuInit, "cuInit"),
    CU_SYM(cuDriverGetVersion, "cuDriverGetVersion"),
    CU_SYM(cuDeviceGetCount, "cuDeviceGetCount"),
    CU_SYM(cuDeviceGet, "cuDeviceGet"),
    CU_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    CU_SYM(cuCtxGetCurrent, "cuCtxGetCurrent"),
    CU_SYM(cuCtxSetCurrent, "cuCtxSetCurrent"),
    CU_SYM(cuCtxPushCurrent, "cuCtxPushCurrent_v2"),
    CU_SYM(cuCtxPopCurrent, "cuCtxPopCurrent_v2"),
    CU_SYM(cuModuleLoadData, "cuModuleLoadData"),
    CU_SYM(cuModuleGetFunction, "cuModuleGetFunction"),
    CU_SYM(cuLaunchKernel, "cuLaunchKernel"),
    CU_SYM(cuStreamSynchronize, "cuStreamSynchronize"),
    CU_SYM(cuEventCreate, "cuEventCreate"),
    CU_SYM(cuEventRecord, "cuEventRecord"),
    CU_SYM(cuEventQuery, "cuEventQuery"),
    CU_SYM(cuEventDestroy, "cuEventDestroy_v2"),
    CU_SYM(cuMemcpy2DAsync, "cuMemcpy2DAsync_v2"),
    CU_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    CU_SYM(cuGetErrorName, "cuGetErrorName"),
    CU_SYM(cuGetErrorString, "cuGetErrorString"),
#undef CU_SYM
};

/* ---- kernels in the embedded image ---------------------------------------------------------- */

#ifdef FSC_WITH_CUDA_KERNELS
/* Defined in the file tools/build_cuda.py generates. */
extern const unsigned char fsc_cuda_fatbin[];
extern const size_t fsc_cuda_fatbin_len;
#endif

/* extern "C" names of the kernels in csrc/cuda, indexed by fsc_gpu_kernel_t. */
static const char *const kernel_names[FSC_GPU_K_COUNT] = {
    "fsc_cast_f32_to_f16",
    "fsc_cast_f32_to_bf16",
    "fsc_cast_f16_to_f32",
    "fsc_cast_bf16_to_f32",
    "fsc_unscale_inf_check_f32",
    "fsc_unscale_inf_check_f16",
    "fsc_unscale_inf_check_bf16",
    "fsc_norm_partials_f32",
    "fsc_norm_partials_f16",
    "fsc_norm_partials_bf16",
    "fsc_norm_finalize",
    "fsc_adamw_f32",
    "fsc_fs_adam",
    "fsc_fs_adam_multi",
};

#define FSC_GPU_MAX_DEVICES 64

/* ---- process-wide state ------------------------------------------------------------------- */

static cu_api_t cu;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static fsc_status_t load_status = FSC_ERR_UNAVAILABLE;
static char load_message[256];
static int driver_found, driver_version, device_count;
static char driver_path[512]; /* where libcuda.so.1 resolved to, for bug reports */

/* Per device: the retained primary context and, once loaded, the module and its kernels.
 * Filled under `dev_lock`; contexts and modules live until the process exits (like torch's). */
typedef struct {
    cu_context_t ctx;
    cu_module_t module;
    cu_function_t fn[FSC_GPU_K_COUNT];
} device_state_t;
static device_state_t devices[FSC_GPU_MAX_DEVICES];
static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER;

/* "CUDA_ERROR_X (description)" for a driver result; valid until the next call on this thread. */
static const char *cu_describe(cu_result_t r) {
    static _Thread_local char buf[160];
    const char *name = NULL, *str = NULL;
    if (cu.cuGetErrorName) cu.cuGetErrorName(r, &name);
    if (cu.cuGetErrorString) cu.cuGetErrorString(r, &str);
    snprintf(buf, sizeof(buf), "%s (%s)", name ? name : "CUDA error", str ? str : "no description");
    return buf;
}

static fsc_status_t cu_fail(const char *op, const char *call, cu_result_t r) {
    return fsc_error(FSC_ERR_INTERNAL, "%s: %s failed: %s (code %d)", op, call, cu_describe(r), r);
}

static void load_driver(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = dlerror();
        snprintf(load_message, sizeof(load_message), "CUDA driver not found: %s", e ? e : "dlopen failed");
        return;
    }
    for (size_t i = 0; i < sizeof(cu_symbols) / sizeof(cu_symbols[0]); i++) {
        void *p = dlsym(h, cu_symbols[i].name);
        if (p == NULL) {
            snprintf(load_message, sizeof(load_message), "CUDA driver lacks %s (driver too old?)", cu_symbols[i].name);
            memset(&cu, 0, sizeof(cu));
            return; /* keep the handle open: unloading a half-used driver is not worth the risk */
        }
        memcpy((char *)&cu + cu_symbols[i].offset, &p, sizeof(p));
    }
    driver_found = 1;
    Dl_info where;
    void *entry;
    memcpy(&entry, &cu.cuDriverGetVersion, sizeof(entry));
    if (dladdr(entry, &where) && where.dli_fname) snprintf(driver_path, sizeof(driver_path), "%s", where.dli_fname);
    cu.cuDriverGetVersion(&driver_version);
    cu_result_t r = cu.cuInit(0);
    if (r != CU_SUCCESS) {
        snprintf(load_message, sizeof(load_message), "cuInit failed: %s", cu_describe(r));
        return;
    }
    r = cu.cuDeviceGetCount(&device_count);
    if (r != CU_SUCCESS || device_count <= 0) {
        device_count = 0;
        snprintf(load_message, sizeof(load_message), "CUDA driver %d sees no device", driver_version);
        return;
    }
    load_status = FSC_OK;
    FSC_INFO("gpu", "CUDA driver %d, %d device(s)", driver_version, device_count);
}

fsc_status_t fsc_gpu_load(void) {
    pthread_once(&load_once, load_driver);
    if (load_status != FSC_OK) return fsc_error(load_status, "%s", load_message);
    return FSC_OK;
}

/* The CUDA runtime, only to report its version and where it lives. Prefer the copy torch
 * already loaded (RTLD_NOLOAD matches a loaded library by soname), else any installed one. */
static void find_runtime(fsc_gpu_info_t *out) {
    static const char *const names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
    void *h = NULL;
    for (int pass = 0; pass < 2 && h == NULL; pass++) {
        int flags = RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0);
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && h == NULL; i++) h = dlopen(names[i], flags);
    }
    if (h == NULL) return;
    void *sym = dlsym(h, "cudaRuntimeGetVersion");
    int (*get_version)(int *) = NULL;
    memcpy(&get_version, &sym, sizeof(sym));
    if (get_version != NULL && get_version(&out->runtime_version) == 0) {
        Dl_info info;
        out->runtime_found = 1;
        if (dladdr(sym, &info) && info.dli_fname)
            snprintf(out->runtime_path, sizeof(out->runtime_path), "%s", info.dli_fname);
    }
    dlclose(h); /* drops only our reference; torch's stays */
}

void fsc_gpu_info(fsc_gpu_info_t *out) {
    memset(out, 0, sizeof(*out));
    fsc_status_t st = fsc_gpu_load();
    out->driver_found = driver_found;
    out->driver_version = driver_version;
    snprintf(out->driver_path, sizeof(out->driver_path), "%s", driver_path);
    out->device_count = device_count;
    if (st != FSC_OK) snprintf(out->error, sizeof(out->error), "%s", load_message);
#ifdef FSC_WITH_CUDA_KERNELS
    out->kernels_built = 1;
#endif
    find_runtime(out);
}

/* ---- contexts ----------------------------------------------------------------------------- */

static fsc_status_t check_device(int device, const char *op) {
    FSC_CHECK(fsc_gpu_load());
    if (device < 0 || device >= device_count || device >= FSC_GPU_MAX_DEVICES)
        return fsc_error(FSC_ERR_VALUE, "%s: CUDA device %d does not exist (%d visible)", op, device, device_count);
    return FSC_OK;
}

/* The primary context of `device`, retained on first use. Caller holds no lock. */
static fsc_status_t primary_ctx(int device, cu_context_t *out) {
    fsc_status_t st = FSC_OK;
    FSC_CHECK(check_device(device, "gpu"));
    pthread_mutex_lock(&dev_lock);
    if (devices[device].ctx == NULL) {
        cu_device_t dev;
        cu_result_t r = cu.cuDeviceGet(&dev, device);
        if (r == CU_SUCCESS) r = cu.cuDevicePrimaryCtxRetain(&devices[device].ctx, dev);
        if (r != CU_SUCCESS) FSC_CHECK_GOTO(cu_fail("gpu", "cuDevicePrimaryCtxRetain", r), st, exit);
    }
    *out = devices[device].ctx;
exit:
    pthread_mutex_unlock(&dev_lock);
    return st;
}

fsc_status_t fsc_gpu_ctx_enter(int device, fsc_gpu_ctx_t *g) {
    cu_context_t want, cur = NULL;
    g->pushed = 0;
    FSC_CHECK(primary_ctx(device, &want));
    cu_result_t r = cu.cuCtxGetCurrent(&cur);
    if (r != CU_SUCCESS) return cu_fail("gpu", "cuCtxGetCurrent", r);
    if (cur == want) return FSC_OK; /* the common case: torch already made it current */
    r = cu.cuCtxPushCurrent(want);
    if (r != CU_SUCCESS) return cu_fail("gpu", "cuCtxPushCurrent", r);
    g->pushed = 1;
    return FSC_OK;
}

void fsc_gpu_ctx_exit(fsc_gpu_ctx_t *g) {
    if (g->pushed) {
        cu_context_t popped;
        cu.cuCtxPopCurrent(&popped);
        g->pushed = 0;
    }
}

/* ---- events and streams ------------------------------------------------------------------ */

fsc_status_t fsc_gpu_event_record(int device, fsc_stream_t stream, fsc_gpu_event_t *ev) {
    fsc_gpu_ctx_t g;
    fsc_status_t st = FSC_OK;
    cu_event_t e = NULL;
    FSC_CHECK(fsc_gpu_ctx_enter(device, &g));
    cu_result_t r = cu.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
    if (r != CU_SUCCESS) FSC_CHECK_GOTO(cu_fail("event_record", "cuEventCreate", r), st, exit);
    r = cu.cuEventRecord(e, (cu_stream_t)stream);
    if (r != CU_SUCCESS) {
        cu.cuEventDestroy(e);
        FSC_CHECK_GOTO(cu_fail("event_record", "cuEventRecord", r), st, exit);
    }
    *ev = e;
exit:
    fsc_gpu_ctx_exit(&g);
    return st;
}

fsc_status_t fsc_gpu_event_query(int device, fsc_gpu_event_t ev, int *done) {
    fsc_gpu_ctx_t g;
    fsc_status_t st = FSC_OK;
    FSC_CHECK(fsc_gpu_ctx_enter(device, &g));
    cu_result_t r = cu.cuEventQuery(ev);
    *done = r == CU_SUCCESS;
    if (r != CU_SUCCESS && r != CU_ERROR_NOT_READY) st = cu_fail("event_query", "cuEventQuery", r);
    fsc_gpu_ctx_exit(&g);
    return st;
}

void fsc_gpu_event_destroy(int device, fsc_gpu_event_t ev) {
    fsc_gpu_ctx_t g;
    if (ev == NULL || fsc_gpu_ctx_enter(device, &g) != FSC_OK) return;
    cu.cuEventDestroy(ev);
    fsc_gpu_ctx_exit(&g);
}

fsc_status_t fsc_gpu_stream_synchronize(int device, fsc_stream_t stream) {
    fsc_gpu_ctx_t g;
    FSC_CHECK(fsc_gpu_ctx_enter(device, &g));
    cu_result_t r = cu.cuStreamSynchronize((cu_stream_t)stream);
    fsc_gpu_ctx_exit(&g);
    return r == CU_SUCCESS ? FSC_OK : cu_fail("stream_synchronize", "cuStreamSynchronize", r);
}

/* ---- launching ---------------------------------------------------------------------------- */

/* The kernel `k` in `device`'s context (current on this thread), loading the embedded image
 * into that context on first use. */
static fsc_status_t get_kernel(int device, fsc_gpu_kernel_t k, const char *op, cu_function_t *out) {
#ifndef FSC_WITH_CUDA_KERNELS
    (void)device, (void)k, (void)out;
    return fsc_error(FSC_ERR_UNAVAILABLE,
                     "%s: fairscale_c was built without CUDA kernels (nvcc was not found at build time); "
                     "reinstall with nvcc on PATH or CUDA_HOME set",
                     op);
#else
    fsc_status_t st = FSC_OK;
    device_state_t *d = &devices[device];
    pthread_mutex_lock(&dev_lock);
    if (d->module == NULL) {
        cu_module_t mod = NULL;
        cu_result_t r = cu.cuModuleLoadData(&mod, fsc_cuda_fatbin);
        if (r != CU_SUCCESS) {
            st = fsc_error(FSC_ERR_UNAVAILABLE,
                           "%s: loading the CUDA kernels on device %d failed: %s; the image holds sm_80/sm_90 "
                           "code and compute_90 PTX, which needs a driver at least as new as the nvcc that "
                           "built it",
                           op, device, cu_describe(r));
            goto exit;
        }
        for (int i = 0; i < FSC_GPU_K_COUNT; i++) {
            r = cu.cuModuleGetFunction(&d->fn[i], mod, kernel_names[i]);
            if (r != CU_SUCCESS) {
                /* leak `mod` rather than unload it: harmless, and only on a broken build */
                FSC_CHECK_GOTO(cu_fail(op, kernel_names[i], r), st, exit);
            }
        }
        d->module = mod;
        FSC_INFO("gpu", "loaded %zu-byte kernel image on device %d", (size_t)fsc_cuda_fatbin_len, device);
    }
    *out = d->fn[k];
exit:
    pthread_mutex_unlock(&dev_lock);
    return st;
#endif
}

fsc_status_t fsc_gpu_launch(int device, fsc_gpu_kernel_t k, unsigned int grid, fsc_stream_t stream, void **args,
                            const char *op) {
    fsc_gpu_ctx_t g;
    fsc_status_t st = FSC_OK;
    cu_function_t f = NULL;
    FSC_CHECK(fsc_gpu_ctx_enter(device, &g));
    FSC_CHECK_GOTO(get_kernel(device, k, op, &f), st, exit);
    cu_result_t r = cu.cuLaunchKernel(f, grid, 1, 1, FSC_GPU_BLOCK, 1, 1, 0, (cu_stream_t)stream, args, NULL);
    if (r != CU_SUCCESS) st = cu_fail(op, kernel_names[k], r);
exit:
    fsc_gpu_ctx_exit(&g);
    return st;
}

/* Pitches above this go row by row: drivers cap a 2D copy's pitch (CU_DEVICE_ATTRIBUTE_MAX_PITCH,
 * 2^31 - 1 on current GPUs). */
#define FSC_GPU_MAX_PITCH ((size_t)INT32_MAX)

fsc_status_t fsc_gpu_pack_blocks(fsc_tensor_t *dst, const fsc_tensor_t *srcs, int n, int world, fsc_stream_t stream) {
    static const char *op = "pack_blocks";
    FSC_CHECK(fsc_tensor_pack_check(dst, srcs, n, world, FSC_DEV_CUDA, op));
    if (dst->numel == 0) return FSC_OK;
    size_t esz = fsc_dtype_size(dst->dtype), row = (size_t)(dst->numel / world) * esz; /* bytes per rank */
    fsc_gpu_ctx_t g;
    fsc_status_t st = FSC_OK;
    FSC_CHECK(fsc_gpu_ctx_enter(dst->device_id, &g));
    size_t at = 0; /* this source's offset inside each rank's row of dst */
    for (int i = 0; i < n && st == FSC_OK; i++) {
        size_t block = (size_t)(srcs[i].numel / world) * esz;
        if (block == 0) continue;
        cu_deviceptr_t s = (cu_deviceptr_t)(uintptr_t)srcs[i].data, d = (cu_deviceptr_t)(uintptr_t)dst->data + at;
        cu_result_t r = CU_SUCCESS;
        if (row <= FSC_GPU_MAX_PITCH) {
            /* source rows of `block` bytes back to back -> dst rows `row` bytes apart */
            cu_memcpy2d_t c;
            memset(&c, 0, sizeof(c));
            c.srcMemoryType = c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
            c.srcDevice = s;
            c.srcPitch = block;
            c.dstDevice = d;
            c.dstPitch = row;
            c.WidthInBytes = block;
            c.Height = (size_t)world;
            r = cu.cuMemcpy2DAsync(&c, (cu_stream_t)stream);
        } else {
            for (int k = 0; k < world && r == CU_SUCCESS; k++)
                r = cu.cuMemcpyDtoDAsync(d + (size_t)k * row, s + (size_t)k * block, block, (cu_stream_t)stream);
        }
        if (r != CU_SUCCESS) st = cu_fail(op, row <= FSC_GPU_MAX_PITCH ? "cuMemcpy2DAsync" : "cuMemcpyDtoDAsync", r);
        at += block;
    }
    fsc_gpu_ctx_exit(&g);
    return st;
}
