/*
 * cuda/common.cu -- device selection and the device-side id range check
 * shared by the launchers (see kernels.h, common.cuh).
 */
#include <climits>

#include "cuda/common.cuh"

extern "C" sf_status sfc_device_enter(int device, int *prev, sf_error *err)
{
    sf_status rc;
    if ((rc = sfc::cuda_call("device_enter", "cudaGetDevice", cudaGetDevice(prev), err)))
        return rc;
    if (*prev == device)
        return SF_OK;
    return sfc::cuda_call("device_enter", "cudaSetDevice", cudaSetDevice(device), err);
}

extern "C" void sfc_device_leave(int prev)
{
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev)
        (void)cudaSetDevice(prev);
}

extern "C" int sfc_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();          /* no driver / no device: clear the sticky-free error */
        return 0;
    }
    return n;
}

namespace sfc {

/* r[0] = first bad index, r[1] = min id, r[2] = max id */
__global__ void range_init(long long *r, int64_t count)
{
    r[0] = (long long)count;
    r[1] = LLONG_MAX;
    r[2] = LLONG_MIN;
}

__global__ void range_scan(const int64_t *ids, int64_t count, int has_ignore, int64_t ignore,
                           int64_t vocab, long long *r)
{
    const int64_t step = (int64_t)blockDim.x * gridDim.x;
    long long lo = LLONG_MAX, hi = LLONG_MIN, first = (long long)count;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += step) {
        const int64_t y = ids[i];
        lo = y < lo ? y : lo;
        hi = y > hi ? y : hi;
        if ((y < 0 || y >= vocab) && !(has_ignore && y == ignore) && i < first) first = i;
    }
    if (lo != LLONG_MAX) atomicMin(&r[1], lo);
    if (hi != LLONG_MIN) atomicMax(&r[2], hi);
    if (first < (long long)count) atomicMin(&r[0], first);
}

sf_status id_range(const char *fn, const int64_t *ids, int64_t count, int has_ignore,
                   int64_t ignore, int64_t vocab, cudaStream_t stream, int64_t *first,
                   int64_t *first_id, int64_t *lo, int64_t *hi, sf_error *err)
{
    long long *r = nullptr, host[3] = {0, 0, 0};
    sf_status rc;
    if ((rc = cuda_call(fn, "cudaMallocAsync (id check)",
                        cudaMallocAsync((void **)&r, 3 * sizeof(long long), stream), err)))
        return rc;
    range_init<<<1, 1, 0, stream>>>(r, count);
    if (count > 0)
        range_scan<<<blocks_for(count, kThreads), kThreads, 0, stream>>>(ids, count, has_ignore,
                                                                         ignore, vocab, r);
    rc = launched(fn, err);
    if (!rc)
        rc = cuda_call(fn, "cudaMemcpyAsync (id check)",
                       cudaMemcpyAsync(host, r, sizeof(host), cudaMemcpyDeviceToHost, stream), err);
    if (!rc)
        rc = cuda_call(fn, "cudaStreamSynchronize (id check)", cudaStreamSynchronize(stream), err);
    long long fid = 0;
    if (!rc && host[0] < (long long)count)
        rc = cuda_call(fn, "cudaMemcpy (id check)",
                       cudaMemcpyAsync(&fid, ids + host[0], sizeof(fid), cudaMemcpyDeviceToHost,
                                       stream), err);
    if (!rc && host[0] < (long long)count)
        rc = cuda_call(fn, "cudaStreamSynchronize (id check)", cudaStreamSynchronize(stream), err);
    sf_status frc = cuda_call(fn, "cudaFreeAsync (id check)", cudaFreeAsync(r, stream), err);
    if (rc) return rc;
    if (frc) return frc;
    *first = host[0];
    *first_id = fid;
    *lo = host[1];
    *hi = host[2];
    return SF_OK;
}

}  // namespace sfc
