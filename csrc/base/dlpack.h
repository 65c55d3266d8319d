/* dlpack.h — the DLPack 1.1 ABI (struct layouts and constants), as the DLPack spec defines them. */
#ifndef FSC_DLPACK_H
#define FSC_DLPACK_H

#include <stdint.h>

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 1

#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
} DLDeviceType;

typedef struct {
    int32_t device_type; /* DLDeviceType; a fixed-width int keeps the ABI exact */
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
} DLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

/* Legacy (pre-1.0) managed tensor: dl_tensor is the FIRST field. Capsule name "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* Versioned managed tensor: dl_tensor is the LAST field. Capsule name "dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* DLPack >= 1.2: the C exchange API a producer publishes as a capsule named "dlpack_exchange_api"
 * in its tensor type's `__dlpack_c_exchange_api__` attribute (torch >= 2.10 does). Only the
 * layout is declared here; fields a consumer does not use are opaque function pointers. */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

/* Fill `out` with a non-owning view of `py_object` (which must be of the type the API came from);
 * valid until control returns to the producer. 0, or -1 with a Python exception set. */
typedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out);

/* The producer's current work stream on a device (for CUDA, a cudaStream_t; NULL is the legacy
 * default stream): memory the producer exports without synchronising is safe to use from that
 * stream. 0, or -1 with a Python exception set. */
typedef int (*DLPackCurrentWorkStream)(DLDeviceType device_type, int32_t device_id, void **out_current_stream);

typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync;
    DLPackCurrentWorkStream current_work_stream;
} DLPackExchangeAPI;

#endif /* FSC_DLPACK_H */
