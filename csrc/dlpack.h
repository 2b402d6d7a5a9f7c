/*
 * dlpack.h -- the part of the DLPack ABI that shardformer consumes.
 *
 * Written from the DLPack specification (v1.0): the structs below are laid
 * out exactly as the spec defines them so that a capsule produced by any
 * conforming framework (torch, numpy, jax) can be read.  We only *read*
 * tensors here; we never produce capsules.
 *
 * This is not a full DLPack header: device types and dtype codes that we
 * never accept are left out.
 */
#ifndef SHARDFORMER_DLPACK_H
#define SHARDFORMER_DLPACK_H

#include <stdint.h>

typedef enum {
    SF_DL_CPU = 1,
    SF_DL_CUDA = 2,
    SF_DL_CUDA_HOST = 3,
    SF_DL_CUDA_MANAGED = 13,
} SFDLDeviceType;

typedef struct {
    int32_t device_type; /* SFDLDeviceType */
    int32_t device_id;
} SFDLDevice;

typedef enum {
    SF_DL_INT = 0,
    SF_DL_UINT = 1,
    SF_DL_FLOAT = 2,
    SF_DL_BFLOAT = 4,
    SF_DL_BOOL = 6,
} SFDLDataTypeCode;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} SFDLDataType;

typedef struct {
    void *data;
    SFDLDevice device;
    int32_t ndim;
    SFDLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} SFDLTensor;

/* Capsule name "dltensor" (pre-1.0 protocol). */
typedef struct SFDLManagedTensor {
    SFDLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct SFDLManagedTensor *self);
} SFDLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} SFDLPackVersion;

/* Capsule name "dltensor_versioned" (protocol >= 1.0). */
typedef struct SFDLManagedTensorVersioned {
    SFDLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct SFDLManagedTensorVersioned *self);
    uint64_t flags;
    SFDLTensor dl_tensor;
} SFDLManagedTensorVersioned;

#define SF_DLPACK_FLAG_READ_ONLY ((uint64_t)1 << 0)

#endif /* SHARDFORMER_DLPACK_H */
