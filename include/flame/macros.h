#pragma once
// Portability macros shared by host and device code.

#if defined(__CUDACC__)
#define FLAME_HD __host__ __device__
#define FLAME_INLINE __host__ __device__ __forceinline__
#else
#define FLAME_HD
#define FLAME_INLINE inline
#endif
