// The DLPack ABI (v0.8, the unversioned "dltensor" capsule every array library exports),
// declared here so the extension needs no header from torch or numpy. Field order and
// widths are the ABI; see https://dmlc.github.io/dlpack/latest/c_api.html.
#pragma once

#include <cstdint>

extern "C" {

enum DLDeviceType : int32_t {
    kDLCPU = 1,
    kDLCUDA = 2,
};

struct DLDevice {
    int32_t device_type;
    int32_t device_id;
};

enum DLDataTypeCode : uint8_t {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
};

struct DLDataType {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
};

struct DLTensor {
    void * data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t * shape;
    int64_t * strides;  // in elements; NULL means compact row-major
    uint64_t byte_offset;
};

struct DLManagedTensor {
    DLTensor dl_tensor;
    void * manager_ctx;
    void (*deleter)(DLManagedTensor * self);
};

}  // extern "C"
